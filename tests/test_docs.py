"""The documentation: docstrings, README, the docs site and its snippets.

The default tier checks what needs no build: every public name has a
complete docstring, is in ``__all__`` and in the API page; the README is a
front page (size, commands, no history) whose quickstart is a snippet that
the slow tier runs; the generated tables cover every registry entry. The
slow tier builds the site with ``mkdocs build --strict`` and runs every
snippet the guides include; ``tests/test_docs_browser.py`` looks at the
built site in a browser.
"""

import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import kinds
from kfac_jax_lite import linearization

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SNIPPETS = sorted((DOCS / "snippets").glob("*.py"))
README_LIMIT = 16 * 1024
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest tests'
EXAMPLE_COMMAND = "python examples/mnist_autoencoder.py"
# Pages other contributors own are checked for history like every page.
HISTORY = re.compile(
    r"\bissues? #?\d+|#\d{2,}\b|\b20\d\d-\d\d-\d\d\b|\bre-?runs?\b|"
    r"\bprevious (?:revision|version|tables?)\b|\bearlier version\b",
    re.IGNORECASE)
SECTION = re.compile(r"^(\w[\w ]*):\s*$")


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"docs_{name}",
                                                DOCS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _hooks():
  return _load("hooks")


def _sections(doc: str) -> dict:
  """Google-style sections of ``doc``: title -> the lines under it."""
  out, current = {}, None
  for line in doc.splitlines():
    match = SECTION.match(line)
    if match and not line.startswith(" "):
      current = out.setdefault(match.group(1), [])
    elif current is not None:
      current.append(line)
  return out


def _documented_names(lines) -> set:
  """The names an Args/Attributes section documents (``*args`` too)."""
  names = set()
  for line in lines:
    match = re.match(r"^ {2,4}(\*{0,2}\w+)(?: \([^)]*\))?:", line)
    if match:
      names.add(match.group(1).lstrip("*"))
  return names


def _parameters(fn) -> list:
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return []
  return [p for p in sig.parameters if p not in ("self", "cls")]


def _problems(obj, label: str, *, full: bool) -> list:
  """What ``obj``'s docstring lacks. ``full``: a public function of the
  package (Returns and Example too); else a public method."""
  doc = obj.__doc__ and inspect.cleandoc(obj.__doc__)
  if not doc:
    return [f"{label}: no docstring"]
  sections = _sections(doc)
  out = []
  params = _parameters(obj)
  if params:
    missing = set(params) - _documented_names(sections.get("Args", []))
    if missing:
      out.append(f"{label}: Args does not document {sorted(missing)}")
  if full and "Returns" not in sections:
    out.append(f"{label}: no Returns section")
  if full and "Example" not in sections:
    out.append(f"{label}: no Example section")
  return out


def _class_problems(cls, label: str) -> list:
  doc = cls.__doc__ and inspect.cleandoc(cls.__doc__)
  if not doc:
    return [f"{label}: no docstring"]
  sections = _sections(doc)
  out = []
  fields = getattr(cls, "_fields", None)
  if fields is None and hasattr(cls, "__dataclass_fields__"):
    fields = [f for f in cls.__dataclass_fields__ if not f.startswith("_")]
  if fields:
    missing = set(fields) - _documented_names(
        sections.get("Attributes", []) + sections.get("Args", []))
    if missing:
      out.append(f"{label}: Attributes does not document {sorted(missing)}")
  if "Example" not in sections:
    out.append(f"{label}: no Example section")
  for name, value in vars(cls).items():
    if name.startswith("_"):
      continue
    if isinstance(value, property):
      fn = value.fget
    elif isinstance(value, (staticmethod, classmethod)):
      fn = value.__func__
    elif inspect.isfunction(value):
      fn = value
    else:
      continue
    out += _problems(fn, f"{label}.{name}", full=False)
  return out


def _public_names() -> list:
  return sorted(n for n, v in vars(kl).items()
                if not n.startswith("_") and
                not isinstance(v, types.ModuleType))


def test_all_lists_every_public_name():
  assert sorted(kl.__all__) == _public_names(), (
      "kfac_jax_lite.__all__ must list every public name the package "
      "imports; add the new name to __all__ and to docs/reference/api.md.")


def test_every_public_name_has_a_complete_docstring():
  problems = []
  for name in kl.__all__:
    obj = getattr(kl, name)
    if inspect.isclass(obj):
      problems += _class_problems(obj, name)
    elif callable(obj):
      problems += _problems(obj, name, full=True)
  assert not problems, "\n".join(problems)


def test_docstring_check_catches_a_missing_argument():
  def f(x, y):
    """Adds.

    Args:
      x: a number.

    Returns:
      ``x + y``.

    Example:
      >>> f(1, 2)
    """
    return x + y

  assert _problems(f, "f", full=True) == ["f: Args does not document ['y']"]
  f.__doc__ = None
  assert _problems(f, "f", full=True) == ["f: no docstring"]


def test_api_page_lists_every_public_name():
  page = (DOCS / "reference" / "api.md").read_text()
  listed = set(re.findall(r"^::: kfac_jax_lite\.(\w+)\s*$", page, re.M))
  assert listed == set(kl.__all__)


def test_readme_is_a_front_page():
  text = README.read_text()
  assert len(text.encode()) <= README_LIMIT, len(text.encode())
  first_code = text.index("```")
  quickstart = text.index("## Quickstart")
  assert first_code < text.index(TEST_COMMAND) < quickstart
  assert first_code < text.index(EXAMPLE_COMMAND) < quickstart


def _pages():
  pages = [README] + sorted(DOCS.rglob("*.md"))
  return pages + sorted((ROOT / "kfac_jax_lite").rglob("*.py")) + SNIPPETS


@pytest.mark.parametrize("path", _pages(), ids=lambda p: str(
    p.relative_to(ROOT)))
def test_no_history_or_issue_numbers(path):
  found = [(i + 1, line.strip()) for i, line in
           enumerate(path.read_text().splitlines()) if HISTORY.search(line)]
  assert not found, (f"{path.relative_to(ROOT)} states history or internal "
                     f"issue numbers (git and CHANGELOG.md hold those): "
                     f"{found}")


def _code_block(text: str, heading: str) -> str:
  start = text.index(heading)
  block = text.index("```python\n", start) + len("```python\n")
  return text[block:text.index("```\n", block)]


def test_readme_quickstart_is_the_tested_snippet():
  quickstart = _code_block(README.read_text(), "## Quickstart")
  assert quickstart == (DOCS / "snippets" / "quickstart.py").read_text()


def test_every_snippet_is_included_by_a_page():
  included = set()
  for page in DOCS.rglob("*.md"):
    included |= set(re.findall(r'--8<-- "([^"]+)"', page.read_text()))
  names = {p.name for p in SNIPPETS}
  assert names <= {i.split(":")[0] for i in included}, names - included
  assert {i.split(":")[0] for i in included} <= names


def test_generated_tables_cover_the_registries():
  hooks = _hooks()
  modes = hooks.modes_table()
  for mode in linearization.MODES:
    assert f"| `{mode}` |" in modes
  for alias in linearization.MODE_ALIASES:
    assert f"`{alias}`" in modes
  table = hooks.tags_table()
  for name in kinds.KINDS:
    assert f"| `{name}` |" in table
  page = (DOCS / "reference" / "tables.md").read_text()
  for name in hooks.TABLES:
    assert f"<!-- generated: {name} -->" in page


def test_hooks_refuse_an_unknown_table():
  hooks = _hooks()
  with pytest.raises(ValueError, match="no generated table 'nope'"):
    hooks.on_page_markdown("<!-- generated: nope -->", None, None, None)


def test_doctests_become_fenced_code():
  convert = _load("griffe_rst").convert
  doc = inspect.cleandoc("""Runs.

      Example:
        >>> # a comment, not a heading
        >>> def f(x):
        ...   return x
        >>> f(1)
        1

        >>> f(:math:`x`)

      Then prose :math:`x`.

      ```python
      >>> already_fenced()
      ```
      """)
  assert convert(doc).split("\n") == [
      "Runs.", "", "Example:",
      "  ```pycon",
      "  >>> # a comment, not a heading",
      "  >>> def f(x):", "  ...   return x", "  >>> f(1)", "  1",
      "  ```", "",
      "  ```pycon", "  >>> f(:math:`x`)", "  ```", "",
      "Then prose $x$.", "",
      "```python", ">>> already_fenced()", "```"]


def test_math_is_served_with_the_site():
  config = (ROOT / "mkdocs.yml").read_text()
  assets = re.findall(r"^extra_(?:javascript|css):\n((?:  - .*\n)+)",
                      config, re.M)
  paths = [line.strip()[2:] for block in assets
           for line in block.splitlines()]
  assert "javascripts/katex/katex.min.js" in paths, paths
  for path in paths:
    assert "//" not in path, f"mkdocs.yml loads {path} from another host"
    assert (DOCS / path).is_file(), path
  css = (DOCS / "javascripts/katex/katex.min.css").read_text()
  fonts = re.findall(r"url\(([^)]+)\)", css)
  assert fonts, "katex.min.css names no fonts"
  missing = [f for f in fonts
             if not (DOCS / "javascripts/katex" / f).is_file()]
  assert not missing, missing


@pytest.mark.slow
def test_strict_build_documents_every_public_name(tmp_path):
  site = tmp_path / "site"
  run = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, check=False)
  assert run.returncode == 0, run.stdout + run.stderr
  api = (site / "reference" / "api" / "index.html").read_text()
  missing = [n for n in kl.__all__ if f'id="kfac_jax_lite.{n}"' not in api]
  assert not missing, missing
  tables = (site / "reference" / "tables" / "index.html").read_text()
  assert "<!-- generated" not in tables
  assert "kron_series_1" in tables and "curvature_prop_GGN" in tables


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda p: p.name)
def test_snippet_runs(snippet, tmp_path):
  env = {**os.environ, "PYTHONPATH": str(ROOT),
         "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu", "KFAC_DOCS_TMP": str(tmp_path)}
  run = subprocess.run([sys.executable, str(snippet)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env=env,
                       check=False)
  assert run.returncode == 0, run.stdout + run.stderr
