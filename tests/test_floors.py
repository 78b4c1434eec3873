"""The module floors of docs/architecture.md hold, and nothing hides from
them.

Every ``kfac_jax_lite`` module sits on one floor of the table in
docs/architecture.md and imports only modules of its own floor or of the
floors below. Imports are read from the source (``ast``): every import
statement anywhere in a module (a function-level import counts as much as
a top-level one, and is refused), and ``importlib.import_module`` /
``__import__`` of a package name, which is refused too. The package's
import graph has no cycle.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kfac_jax_lite"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


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
  top = {id(n) for n in tree.body}
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
