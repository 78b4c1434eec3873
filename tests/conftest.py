"""Test configuration: 4 simulated CPU devices, cheaper XLA compiles and
float32 matmuls on every platform.

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
XLA's defaults.

The flags are tried first in a subprocess, which also reports JAX's default
backend (``KFAC_TEST_BACKEND``, inherited by xdist's workers): a jaxlib that
no longer knows a flag aborts on it, and then the suite runs with XLA's
defaults instead. The LLVM flags also reach XLA:GPU's code generation, so
they are added only where the default backend is the CPU; elsewhere only
the CPU-only emitter flag is (the CPU devices still run the multi-device
tests, ``tests/helpers.py``'s ``replica_devices``).

On an accelerator (default backend other than the CPU) float32 matmuls and
convolutions default to lower precision (TF32 on NVIDIA GPUs), and the
tests compare the library against float32 references: the suite's
processes, subprocesses included, then run with
``JAX_DEFAULT_MATMUL_PRECISION=highest`` unless the environment sets it. A
test marked ``default_precision`` runs at JAX's default instead. A test
marked ``cpu_only`` asserts what XLA:CPU does (LAPACK calls, BLAS threads)
and is skipped on other default backends.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

# XLA:CPU's older elemental emitters: read by the CPU compiler only.
CPU_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
# LLVM optimisation: XLA:GPU's LLVM code generation reads these too, so
# they are added only where JAX's default backend is the CPU.
LLVM_FLAGS = ("--xla_llvm_disable_expensive_passes=true",
              "--xla_backend_optimization_level=0")
FAST_COMPILE_FLAGS = " ".join(CPU_FLAGS + LLVM_FLAGS)


def _probe(flags):
  """JAX's default backend (``"cpu"``, ``"gpu"``, ...) in a fresh process
  with ``XLA_FLAGS=flags``, or None where that process fails (a jaxlib
  aborts on a flag it does not know)."""
  env = dict(os.environ, XLA_FLAGS=flags)
  try:
    run = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"],
        env=env, capture_output=True, text=True, timeout=120, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  out = run.stdout.split()
  return out[-1] if run.returncode == 0 and out else None


# XLA's defaults, for the ``xla_defaults`` subprocesses (xdist's workers
# inherit the flags this file added in the controller).
DEFAULT_XLA_FLAGS = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if f not in FAST_COMPILE_FLAGS.split())
os.environ.setdefault("XLA_FLAGS", "")
if "KFAC_TEST_BACKEND" not in os.environ:  # Once, in the controller.
  flags, backend = os.environ["XLA_FLAGS"], None
  if (not os.environ.get("KFAC_TEST_DEFAULT_XLA")
      and "xla_cpu_use_fusion_emitters" not in flags):
    backend = _probe(f"{flags} {FAST_COMPILE_FLAGS}")
    if backend is not None:
      added = CPU_FLAGS + (LLVM_FLAGS if backend == "cpu" else ())
      os.environ["XLA_FLAGS"] = " ".join((flags,) + added)
  os.environ["KFAC_TEST_BACKEND"] = backend or _probe(flags) or "unknown"
  if os.environ["KFAC_TEST_BACKEND"] != "cpu":
    # Accelerators run float32 matmuls at lower precision by default
    # (TF32 on NVIDIA GPUs); the suite compares against float32 references.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    if "jax" in sys.modules:  # A plugin imported it: too late for the variable.
      sys.modules["jax"].config.update(
          "jax_default_matmul_precision",
          os.environ["JAX_DEFAULT_MATMUL_PRECISION"])
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

FAST_COMPILE = any(f in os.environ["XLA_FLAGS"].split()
                   for f in FAST_COMPILE_FLAGS.split())
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


@pytest.hookimpl(tryfirst=True)  # Before any fixture of the test.
def pytest_runtest_setup(item):
  """Skips a ``cpu_only`` test where JAX's default backend is not the CPU."""
  if item.get_closest_marker("cpu_only"):
    import jax  # pylint: disable=g-import-not-at-top
    if jax.default_backend() != "cpu":
      pytest.skip(f"cpu_only: asserts what XLA:CPU does; JAX's default "
                  f"backend here is {jax.default_backend()} "
                  f"({jax.device_count()} device(s))")


@pytest.fixture(autouse=True)
def _default_precision(request):
  """A ``default_precision`` test runs at JAX's default matmul precision
  where this file pinned float32 (``highest``) for the others."""
  if not request.node.get_closest_marker("default_precision"):
    yield
    return
  import jax  # pylint: disable=g-import-not-at-top
  with jax.default_matmul_precision(None):
    yield


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
