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
them. The flags
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


os.environ.setdefault("XLA_FLAGS", "")
if (not os.environ.get("KFAC_TEST_DEFAULT_XLA")
    and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
    and _flags_are_known(FAST_COMPILE_FLAGS)):
  os.environ["XLA_FLAGS"] += " " + FAST_COMPILE_FLAGS
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
