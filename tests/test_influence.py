"""Smoke test: examples/influence.py runs end to end with tiny sizes."""

import math

import numpy as np
import pytest

from tests import helpers

# Runs the example end to end (the examples' tier).
pytestmark = pytest.mark.slow


def test_influence_example_runs(mnist, tmp_path, capsys):
  influence = helpers.load_example("influence")
  png = tmp_path / "influence.png"
  plot = str(png) if _has_matplotlib() else ""
  out = influence.main([
      "--train-size", "128", "--hidden", "8", "--steps", "3",
      "--batch-size", "32", "--curvature-batch", "64", "--num-test", "2",
      "--top", "2", "--tiny-train-size", "64", "--tiny-removals", "3",
      "--plot", plot, *mnist])
  for name in ("ekfac", "kron"):
    assert out[name].shape == (2, 128) and np.all(np.isfinite(out[name]))
  assert set(out["tiny_correlation"]) == {"exact Hessian", "ekfac", "kron"}
  assert all(math.isfinite(c) for c in out["tiny_correlation"].values())
  assert len(out["tiny_actual"]) == 3
  if plot:
    assert png.stat().st_size > 0
  assert "leave-one-out retraining" in capsys.readouterr().out


def _has_matplotlib():
  try:
    import matplotlib  # noqa: F401  pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return True


del pytest
