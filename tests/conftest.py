"""Test configuration: 4 simulated CPU devices and cheaper XLA compiles.

XLA_FLAGS must be set before jax initialises its backends, so this runs at
conftest import time, before any test module imports jax.

Most of the suite's time is XLA compiling small programs, whose kernels then
run for microseconds. XLA's CPU backend compiles them about 2x faster with
its older elemental emitters instead of the MLIR fusion emitters, and
another third faster at LLVM optimisation level 0 (the kernels run slower,
which the suite's small problems do not feel). These are XLA's own CPU code
generators and optimisation levels for the same programs, and every test
passes with XLA's defaults too: set ``KFAC_TEST_DEFAULT_XLA=1`` to test with
them. A test marked ``xla_defaults`` asserts what holds under XLA's default
compile only (two differently built programs giving bitwise the same
result, or agreeing to a few float32 ulps): it runs in a subprocess with
XLA's defaults. The flags
are checked in a subprocess first: a jaxlib that no longer knows one would
abort on it, and then the suite runs with the defaults instead.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false "
                      "--xla_llvm_disable_expensive_passes=true "
                      "--xla_backend_optimization_level=0")


def _flags_are_known(flags):
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  try:
    return subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"], env=env,
        capture_output=True, timeout=120, check=False).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


# XLA's defaults, for the ``xla_defaults`` subprocesses (xdist's workers
# inherit the flags this file added in the controller).
DEFAULT_XLA_FLAGS = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if f not in FAST_COMPILE_FLAGS.split())
os.environ.setdefault("XLA_FLAGS", "")
if (not os.environ.get("KFAC_TEST_DEFAULT_XLA")
    and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
    and _flags_are_known(FAST_COMPILE_FLAGS)):
  os.environ["XLA_FLAGS"] += " " + FAST_COMPILE_FLAGS
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

FAST_COMPILE = FAST_COMPILE_FLAGS in os.environ["XLA_FLAGS"]
ROOT = pathlib.Path(__file__).resolve().parents[1]

# After XLA_FLAGS: jax reads them when its backends start, not at import.
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

# The tests' float64 switch, jax.enable_x64, is jax.experimental.enable_x64
# in jax 0.7 (the lowest version pyproject.toml allows, which
# .ci/min_pins.sh tests); jax 0.8 made it public.
if not hasattr(jax, "enable_x64"):
  from jax.experimental import enable_x64 as _enable_x64  # pylint: disable=g-import-not-at-top
  jax.enable_x64 = _enable_x64


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  """Runs an ``xla_defaults`` test in a subprocess with XLA's default
  compile settings when this process compiles with the fast ones."""
  if (os.environ.get("KFAC_TEST_DEFAULT_XLA") or not FAST_COMPILE
      or not pyfuncitem.get_closest_marker("xla_defaults")):
    return None
  env = dict(os.environ, KFAC_TEST_DEFAULT_XLA="1",
             XLA_FLAGS=DEFAULT_XLA_FLAGS)
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "",
       "-p", "no:cacheprovider", pyfuncitem.nodeid],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
      check=False)
  if run.returncode != 0:
    pytest.fail(f"{pyfuncitem.nodeid} under XLA's default compile:\n"
                f"{run.stdout[-6000:]}\n{run.stderr[-2000:]}", pytrace=False)
  return True


@pytest.fixture(name="mnist", scope="session")
def _mnist(tmp_path_factory):
  """``--data`` for a 256/128-image slice of the bundled MNIST file.

  Same keys and dtypes; the examples then skip decoding and converting all
  70,000 images each.
  """
  with np.load(ROOT / "examples" / "data" / "mnist.npz") as d:
    small = {k: d[k][:256 if k.endswith("train") else 128]
             for k in ("x_train", "y_train", "x_test", "y_test")}
  path = tmp_path_factory.mktemp("data") / "mnist_small.npz"
  np.savez(path, **small)
  return ["--data", str(path)]
