"""The suite's compile settings (``tests/conftest.py``)."""

import os

import pytest


@pytest.mark.xla_defaults
def test_xla_defaults_tests_run_under_xlas_default_compile():
  """An ``xla_defaults`` test sees none of the suite's fast-compile flags
  (conftest runs it in a subprocess without them)."""
  flags = os.environ.get("XLA_FLAGS", "")
  for name in ("xla_cpu_use_fusion_emitters", "xla_llvm_disable_expensive",
               "xla_backend_optimization_level"):
    assert name not in flags, flags
