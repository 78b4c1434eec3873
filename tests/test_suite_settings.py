"""The suite's compile settings (``tests/conftest.py``)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.mark.xla_defaults
def test_xla_defaults_tests_run_under_xlas_default_compile():
  """An ``xla_defaults`` test sees none of the suite's fast-compile flags
  (conftest runs it in a subprocess without them)."""
  flags = os.environ.get("XLA_FLAGS", "")
  for name in ("xla_cpu_use_fusion_emitters", "xla_llvm_disable_expensive",
               "xla_backend_optimization_level"):
    assert name not in flags, flags


def test_conftest_probed_this_processs_backend():
  """The compile flags and the matmul precision were chosen for the
  backend this process got."""
  assert os.environ["KFAC_TEST_BACKEND"] == jax.default_backend()


def test_llvm_flags_only_where_the_cpu_is_the_default_backend():
  """XLA:GPU's code generation reads the LLVM flags too: conftest adds
  them only where the CPU is the default backend."""
  if jax.default_backend() == "cpu":
    pytest.skip("the CPU is the default backend")
  flags = os.environ.get("XLA_FLAGS", "")
  for name in ("xla_llvm_disable_expensive", "xla_backend_optimization_level"):
    assert name not in flags, flags


def test_accelerators_compute_float32_matmuls_in_float32():
  """Where the default matmul precision is lower than float32 (TF32 on
  NVIDIA GPUs: about 1e-3 relative error), conftest pins ``highest``."""
  if jax.default_backend() == "cpu":
    pytest.skip("XLA:CPU computes float32 matmuls in float32")
  assert jax.config.jax_default_matmul_precision == "highest"
  a, b = jax.random.normal(jax.random.PRNGKey(0), (2, 256, 256))
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  err = np.abs(np.asarray(jax.jit(jnp.matmul)(a, b)) - want).max()
  assert err / np.abs(want).max() < 1e-5


@pytest.mark.default_precision
def test_default_precision_tests_run_at_jaxs_default():
  assert jax.config.jax_default_matmul_precision is None


@pytest.mark.cpu_only
def test_cpu_only_tests_run_on_the_cpu_only():
  assert jax.default_backend() == "cpu"
