"""The built wheel, installed as a user installs it, works on its own.

The other tests import the checkout; these build the sdist and, from it, the
wheel (``python -m build``, as a packager runs it: setuptools comes from the
package index into the build's own environment), check what both hold, install
the wheel (not editable) into a fresh virtual environment and, from a
directory outside the repository, run the README quickstart and a ``scan`` and
a step of an untagged flax model. The environment sees the interpreter's
packages (``--system-site-packages``: jax, optax and flax are not downloaded
again) but must import ``kfac_jax_lite`` from the wheel, which is checked.
"""

import ast
import email.parser
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kfac_jax_lite"
# Left out of the copy the build starts from: what git ignores, and git.
IGNORED = (".git", "build", "dist", "*.egg-info", "__pycache__", ".venv",
           "site", ".pytest_cache", ".hypothesis")
NOT_SHIPPED = ("tests/", "benchmarks/", "docs/", "examples/", ".ci/")

pytestmark = pytest.mark.slow

# An untagged linen model: scan finds its Dense and LayerNorm layers; one
# jitted K-FAC step builds the blocks. Prints what the test checks.
FLAX_SCRIPT = '''
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import kfac_jax_lite as kl

print("kfac_jax_lite from", kl.__file__)


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(16)(x))
    x = nn.LayerNorm()(x)
    return nn.Dense(3)(x)


model = MLP()
key = jax.random.PRNGKey(0)
batch = (jax.random.normal(key, (32, 5)),
         jax.random.randint(key, (32,), 0, 3))
params = model.init(key, batch[0])["params"]


def loss_fn(params, batch):
  logits = model.apply({"params": params}, batch[0])
  kl.register_categorical_predictive_distribution(logits, batch[1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch[1]).mean()


collection = kl.scan(loss_fn, params, batch)
print("kinds", sorted(layer.kind for layer in collection.layers))
tx = kl.kfac(1e-2, collection)
state = tx.init(params)
loss, grads, stats = jax.jit(kl.value_grad_and_stats(loss_fn, collection))(
    params, batch, jax.random.PRNGKey(1))
updates, state = jax.jit(tx.update)(grads, state, params, stats=stats)
print("finite", bool(jnp.isfinite(loss)) and all(
    bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates)))
'''


def _run(cmd, cwd, env=None):
  out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=900)
  assert out.returncode == 0, (cmd, out.stdout[-4000:], out.stderr[-4000:])
  return out.stdout + out.stderr


def _clean_env():
  """The environment without the settings that would point Python at the
  checkout or make setuptools warn about this machine (bytecode off)."""
  env = dict(os.environ)
  for name in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONHOME"):
    env.pop(name, None)
  return env


def _version() -> str:
  """``__version__`` as the package's ``__init__.py`` assigns it."""
  tree = ast.parse((PACKAGE / "__init__.py").read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and [
        getattr(t, "id", None) for t in node.targets] == ["__version__"]:
      return ast.literal_eval(node.value)
  raise AssertionError("kfac_jax_lite/__init__.py assigns no __version__")


def _modules() -> set:
  """Every file of the package, relative to the repository."""
  return {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*")
          if p.is_file() and "__pycache__" not in p.parts}


def _quickstart() -> str:
  text = (ROOT / "README.md").read_text()
  start = text.index("```python\n", text.index("## Quickstart")) + 10
  return text[start:text.index("```\n", start)]


def _build(tmp: pathlib.Path):
  """``(wheel, sdist)`` built from a copy of the checkout; the build's
  output has no warning."""
  src = tmp / "src"
  shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*IGNORED))
  log = _run([sys.executable, "-m", "build", "--outdir", str(tmp / "dist"),
              str(src)], cwd=tmp, env=_clean_env())
  warnings = [line for line in log.splitlines()
              if re.search(r"warn|deprecat", line, re.IGNORECASE)]
  assert not warnings, warnings
  version = _version()
  wheel = tmp / "dist" / f"kfac_jax_lite-{version}-py3-none-any.whl"
  sdist = tmp / "dist" / f"kfac_jax_lite-{version}.tar.gz"
  assert wheel.is_file() and sdist.is_file(), sorted(
      p.name for p in (tmp / "dist").iterdir())
  return wheel, sdist


def _check_wheel(wheel: pathlib.Path):
  """The package's files, ``py.typed``, the licence and the metadata; no
  tests, benchmarks, docs or examples."""
  version = _version()
  info = f"kfac_jax_lite-{version}.dist-info"
  archive = zipfile.ZipFile(wheel)
  names = set(archive.namelist())
  package = {n for n in names if not n.startswith(info + "/")}
  assert package == _modules(), package ^ _modules()
  assert "kfac_jax_lite/py.typed" in names
  assert not [n for n in names if n.startswith(NOT_SHIPPED)]
  assert archive.read(f"{info}/licenses/LICENSE") == (
      ROOT / "LICENSE").read_bytes()
  meta = email.parser.Parser().parsestr(
      archive.read(f"{info}/METADATA").decode())
  assert meta["Version"] == version
  assert meta["License-Expression"] == "Apache-2.0"
  assert meta.get_all("License-File") == ["LICENSE"]
  assert "Typing :: Typed" in meta.get_all("Classifier")
  requires = meta.get_all("Requires-Dist")
  for name in ("jax>=", "jaxlib>=", "optax>=", "numpy>="):
    assert any(r.startswith(name) and "extra ==" not in r
               for r in requires), (name, requires)


def _check_sdist(sdist: pathlib.Path):
  """The package, its licence, README and CHANGELOG; no tests (they need
  the whole repository), benchmarks, docs or examples."""
  top = sdist.name.removesuffix(".tar.gz")
  names = {n.removeprefix(top + "/") for n in
           tarfile.open(sdist).getnames() if n != top}
  assert _modules() <= names, _modules() - names
  assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml"} <= names
  assert not [n for n in names if n.startswith(NOT_SHIPPED)]


def _install(wheel: pathlib.Path, tmp: pathlib.Path) -> str:
  """The python of a fresh venv holding ``wheel`` (not editable); checks
  that it imports ``kfac_jax_lite`` from there."""
  venv = tmp / "venv"
  env = _clean_env()
  _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
       cwd=tmp, env=env)
  python = str(venv / "bin" / "python")
  # Offline: every dependency must already be there (the interpreter's).
  _run([python, "-m", "pip", "install", "--no-index", "--no-cache-dir",
        str(wheel)], cwd=tmp, env=env)
  where = _run([python, "-c", "import kfac_jax_lite as kl; "
                "print(kl.__file__); print(kl.__version__)"],
               cwd=tmp, env=env).split()
  assert pathlib.Path(where[0]).resolve().is_relative_to(venv.resolve()), (
      f"the venv imported kfac_jax_lite from {where[0]}, not the wheel")
  assert where[1] == _version()
  return python


def test_the_built_wheel_installs_and_runs_outside_the_repository(tmp_path):
  wheel, sdist = _build(tmp_path)
  _check_wheel(wheel)
  _check_sdist(sdist)
  python = _install(wheel, tmp_path)
  venv = pathlib.Path(python).parents[1].resolve()
  work = tmp_path / "user"
  work.mkdir()
  env = _clean_env()
  (work / "quickstart.py").write_text(_quickstart())
  out = _run([python, "quickstart.py"], cwd=work, env=env)
  match = re.search(r"loss after 20 steps: (\S+)", out)
  assert match and math.isfinite(float(match.group(1))), out
  (work / "flax_scan.py").write_text(FLAX_SCRIPT)
  out = _run([python, "flax_scan.py"], cwd=work, env=env)
  source = re.search(r"kfac_jax_lite from (\S+)", out)
  assert source and pathlib.Path(source.group(1)).resolve().is_relative_to(
      venv), out
  assert ("kinds ['fully_connected', 'fully_connected', 'scale_and_shift']"
          in out), out
  assert "finite True" in out, out
