"""Smoke tests: the examples run end to end with tiny sizes."""

import importlib.util
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_example(name):
  """Imports ``examples/<name>.py`` as a module (examples is no package)."""
  path = ROOT / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"example_{name}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses (flax modules) look it up.
  spec.loader.exec_module(module)
  return module


def test_mnist_mlp_runs_and_returns_finite_losses(capsys):
  pytest.importorskip("flax")
  mnist_mlp = _load_example("mnist_mlp")
  results = mnist_mlp.main(["--max-steps", "3", "--hidden", "32",
                            "--batch-size", "32", "--epochs", "1",
                            "--log-every", "1"])
  assert set(results) == {"kfac", "adam"}
  for name, res in results.items():
    assert res["steps"] == 3, name
    assert len(res["epoch_losses"]) == 1, name
    assert all(math.isfinite(x) for x in res["epoch_losses"]), (name, res)
    assert 0.0 <= res["test_accuracy"] <= 1.0, name
  out = capsys.readouterr().out
  assert "final: K-FAC loss" in out
  assert "[kfac] epoch 1 step" in out
