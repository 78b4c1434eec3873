"""The module floors of docs/architecture.md hold, and nothing hides from
them.

Every ``kfac_jax_lite`` module sits on one floor of the table in
docs/architecture.md and imports only modules of its own floor or of the
floors below. Imports are read from the source (``ast``): every import
statement anywhere in a module (a function-level import counts as much as
a top-level one, and is refused), and ``importlib.import_module`` /
``__import__`` of a package name, which is refused too. No module looks
names up lazily: a module-level ``__getattr__`` (or ``__dir__``), any use
of ``importlib`` and any call of ``__import__`` are refused, whatever they
import, since an import they make is one the floors cannot see. The
package's import graph has no cycle, and every module is under the line
budget (``MAX_LINES``).
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kfac_jax_lite"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# A module past this many lines is split (along a seam that names itself).
MAX_LINES = 550


def _modules() -> dict:
  """``{dotted name: path}`` of every module of the package."""
  out = {}
  for path in PACKAGE.rglob("*.py"):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    out[".".join(parts)] = path
  return out


MODULES = _modules()


def _resolve(name: str):
  """The package module ``name`` is, or lies in (an imported attribute)."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _imports(path: pathlib.Path) -> dict:
  """``{imported package module: [(line, how)]}`` for the module at
  ``path``; ``how`` is ``"top"``, ``"nested"`` or ``"dynamic"``."""
  tree = ast.parse(path.read_text())
  # A module's top level, and the body of a top-level `if TYPE_CHECKING:`
  # (imports for annotations only, still held to the floors below).
  top = {id(n) for n in tree.body}
  for n in tree.body:
    if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING":
      top |= {id(m) for m in n.body}
  found = {}

  def add(name, node, how):
    mod = _resolve(name) if name.startswith("kfac_jax_lite") else None
    if mod is not None:
      found.setdefault(mod, []).append((node.lineno, how))

  for node in ast.walk(tree):
    how = "top" if id(node) in top else "nested"
    if isinstance(node, ast.Import):
      for a in node.names:
        add(a.name, node, how)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        add(f"{node.module}.{a.name}", node, how)
    elif isinstance(node, ast.Call):
      f = node.func
      fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
      if fname in ("import_module", "__import__") and node.args and \
          isinstance(node.args[0], ast.Constant) and \
          isinstance(node.args[0].value, str):
        add(node.args[0].value, node, "dynamic")
  return found


def _floors() -> dict:
  """``{module: floor index}`` from the table (0 is the top floor)."""
  text = ARCHITECTURE.read_text()
  table = text.split("## The floors", 1)[1].split("\n## ", 1)[0]
  rows = [r for r in table.splitlines() if r.startswith("|")][2:]
  out = {}
  for i, row in enumerate(rows):
    for entry in re.findall(r"`([\w/]+(?:\.py|/))`", row.split("|")[2]):
      name = "kfac_jax_lite." + entry.removesuffix(".py").rstrip(
          "/").replace("/", ".")
      for mod in MODULES:
        if mod == name or mod.startswith(name + "."):
          out[mod] = i
  return out


def _package_deps() -> dict:
  return {m: set(_imports(p)) - {m} for m, p in MODULES.items()}


def test_every_module_is_on_a_floor():
  floors = _floors()
  missing = sorted(set(MODULES) - set(floors) - {"kfac_jax_lite"})
  assert not missing, (
      f"{missing} are on no floor of docs/architecture.md; add each to the "
      "floor of the modules it imports.")


def test_no_module_imports_a_floor_above_its_own():
  floors = _floors()
  bad = []
  for mod, deps in _package_deps().items():
    if mod not in floors:
      continue
    for dep in deps:
      if dep in floors and floors[dep] < floors[mod]:
        bad.append(f"{mod} (floor {floors[mod]}) imports {dep} "
                   f"(floor {floors[dep]})")
  assert not bad, bad


def test_no_import_is_hidden_in_a_function_or_importlib():
  hidden = [f"{m}:{line} {how} import of {dep}"
            for m, p in MODULES.items()
            for dep, uses in _imports(p).items()
            for line, how in uses if how != "top"]
  assert not hidden, hidden


def _module_level(body):
  """The statements at a module's top level, through ``if`` / ``try`` /
  ``with`` blocks (not into functions or classes)."""
  for node in body:
    yield node
    for field in ("body", "orelse", "finalbody"):
      inner = getattr(node, field, None)
      if isinstance(inner, list) and not isinstance(
          node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield from _module_level(inner)
    for handler in getattr(node, "handlers", ()):
      yield from _module_level(handler.body)


def _lazy_lookups(path: pathlib.Path) -> list:
  """``[(line, what)]``: module ``__getattr__`` / ``__dir__``, imports of
  ``importlib`` and any ``__import__`` in the module at ``path``."""
  tree = ast.parse(path.read_text())
  found = [(n.lineno, f"module-level {n.name}")
           for n in _module_level(tree.body)
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
           and n.name in ("__getattr__", "__dir__")]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, f"import {a.name}") for a in node.names
                if a.name.split(".")[0] == "importlib"]
    elif isinstance(node, ast.ImportFrom) and node.module and \
        node.module.split(".")[0] == "importlib":
      found.append((node.lineno, f"from {node.module} import"))
    elif isinstance(node, ast.Name) and node.id == "__import__":
      found.append((node.lineno, "__import__"))
  return found


def test_no_module_getattr_importlib_or_dunder_import():
  lazy = [f"{m}:{line} {what}" for m, p in MODULES.items()
          for line, what in _lazy_lookups(p)]
  assert not lazy, (
      f"{lazy}: import what a module needs at its top (from the floors "
      "below), and let the package's __init__.py export names; no lazy "
      "lookups.")


def test_every_module_is_under_the_line_budget():
  long = {m: n for m, p in MODULES.items()
          if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, (
      f"{long} have more than {MAX_LINES} lines; split each along a seam "
      "that names itself, as blocks/kronecker.py (the block) and "
      "blocks/layouts.py (its layouts and row statistics) are.")


def test_the_import_graph_has_no_cycle():
  deps = {m: d - {"kfac_jax_lite"} for m, d in _package_deps().items()
          if m != "kfac_jax_lite"}
  state = {}

  def visit(m, path):
    if state.get(m) == "done":
      return None
    if state.get(m) == "open":
      return path[path.index(m):] + [m]
    state[m] = "open"
    for d in sorted(deps.get(m, ())):
      cycle = visit(d, path + [m])
      if cycle:
        return cycle
    state[m] = "done"
    return None

  for m in sorted(deps):
    cycle = visit(m, [])
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("source,how", [
    ("import jax\n\ndef f():\n  from kfac_jax_lite import losses\n",
     "nested"),
    (("import importlib\nm = importlib.import_module("
      "'kfac_jax_lite.one_pass')\n"), "dynamic"),
    ("from kfac_jax_lite.blocks import kronecker\n", "top")])
def test_the_reader_sees_nested_and_dynamic_imports(source, how, tmp_path):
  path = tmp_path / "m.py"
  path.write_text(source)
  found = _imports(path)
  assert [h for uses in found.values() for _, h in uses] == [how], found


@pytest.mark.parametrize("source,want", [
    ("import importlib\n", ["import importlib"]),
    ("import importlib.util as u\n", ["import importlib.util"]),
    ("from importlib import import_module\n", ["from importlib import"]),
    ("m = __import__('kfac_jax_lite.tags')\n", ["__import__"]),
    ("def __getattr__(name):\n  raise AttributeError(name)\n",
     ["module-level __getattr__"]),
    ("import sys\nif sys:\n  def __dir__():\n    return []\n",
     ["module-level __dir__"]),
    ("class C:\n  def __getattr__(self, name):\n    return name\n", []),
    ("def f():\n  def __getattr__(name):\n    return name\n", [])])
def test_the_reader_sees_lazy_lookups(source, want, tmp_path):
  path = tmp_path / "m.py"
  path.write_text(source)
  assert [what for _, what in _lazy_lookups(path)] == want
