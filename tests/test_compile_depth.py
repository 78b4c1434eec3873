"""The K-FAC step's factorisations do not grow with the model's depth.

XLA:CPU compiles one kernel per distinct fusion, and most of the compile
time of a K-FAC step goes to those kernels (benchmarks/compile_parts.py,
docs/performance.md#where-the-gpts-compile-goes). Same-shaped layers are
stacked into one group (kfac_jax_lite/grouping.py), so adding identical
layers adds no factor size, no LAPACK call and no refresh loop: the
refresh's program is one per factor size, whatever the depth. These tests
lower ``kfac_adamw``'s update for MLPs of 2 and 6 identical hidden layers
and compare the two programs' factorisations; a slow one runs
``benchmarks/compile_parts.py``'s child on the char GPT.
"""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

import kfac_jax_lite as kl
from tests import helpers

WIDTH = 12


def _lowered_update(depth: int) -> str:
  """The StableHLO text of ``kfac_adamw``'s update for an MLP 6 -> 12,
  then ``depth`` identical 12 -> 12 layers, then 12 -> 3."""
  sizes = [6] + [WIDTH] * (depth + 1) + [3]
  params = helpers.mlp_params(jax.random.PRNGKey(0), sizes)
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 8, sizes[0],
                                       sizes[-1])
  c = kl.scan(helpers.classifier_loss, params, batch)
  tx = kl.kfac_adamw(1e-3, c, stats_fraction=1.0)
  grads = jax.grad(helpers.classifier_loss)(params, batch)
  return jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b)).lower(
      grads, tx.init(params), params, batch).as_text()


def _lapack_calls(text: str) -> list:
  """Every LAPACK custom call of a lowered program, ``(kernel, size)``."""
  return sorted(re.findall(
      r"custom_call @(lapack_\w+)\(.*?: \(tensor<(\d+)x\d+xf32>", text))


@pytest.mark.perf
@pytest.mark.cpu_only  # XLA:CPU's LAPACK calls.
def test_refresh_factorisations_do_not_grow_with_depth():
  shallow, deep = _lowered_update(2), _lowered_update(6)
  calls = _lapack_calls(shallow)
  # One Cholesky and one triangular solve per factor size: the input
  # factors 7 and 13 (with the bias), the output factors 12 and 3 (12
  # and 13 share the padded bucket of the layers without a twin, 13).
  chol = sorted({int(n) for k, n in calls if k.startswith("lapack_spotrf")})
  assert chol and max(chol) == WIDTH + 1, calls
  assert _lapack_calls(deep) == calls
  # The identical layers' refresh is one loop per factor of the group,
  # whatever its length: as many loops at depth 6 as at depth 2.
  assert deep.count("stablehlo.while") == shallow.count("stablehlo.while")


@pytest.mark.slow
@pytest.mark.cpu_only  # XLA:CPU's compiler events.
@pytest.mark.xla_defaults  # The suite's fast emitters have no such events.
def test_compile_parts_names_every_kernel_of_the_gpt_step():
  """benchmarks/compile_parts.py's child (one fresh process per step):
  every kernel XLA compiles for ``kfac_adamw``'s char GPT step at one
  block is counted once, in a part of the step, and the K-FAC parts are
  there."""
  pytest.importorskip("flax")
  root = helpers.ROOT
  cmd = [sys.executable, str(root / "benchmarks" / "compile_parts.py"),
         "--child", "1", "kfac"]
  env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       timeout=600, check=True).stdout
  got = json.loads(out.strip().splitlines()[-1])
  parts = got["parts"]
  assert sum(n for n, _ in parts.values()) == got["phases"]["kernels"], got
  for part in ("refresh", "statistics pass", "EMA", "preconditioning",
               "grafting norms", "gradient"):
    assert parts.get(part, [0])[0] > 0, (part, parts)
  assert "other" not in parts, parts
