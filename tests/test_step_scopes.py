"""The parts of a ``kfac_adamw`` step on a tiny char GPT, by JAX scope.

``benchmarks/step_profile.py`` attributes a step's kernels to the scopes
the library names (docs/performance.md#where-the-gpt-step-goes); these
tests check that each part is under its scope, and that the curvature
work of identical transformer blocks is one stacked computation per group:
its equations do not grow when the blocks do.
"""

import jax
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers

SCOPES = {  # scope -> a primitive every step has under it
    "kfac_pass": "dot_general",          # the statistics' model passes
    "kfac_stats": "dot_general",         # the factors' outer products
    "kfac_ema": "mul",
    "kfac_refresh": "cholesky",
    "kfac_inputs": "concatenate",        # [W; b]
    "kfac_precondition": "dot_general",
    "kfac_finite": "reduce_sum",
}


def _step_jaxpr(layers: int):
  pytest.importorskip("flax")
  from flax import nnx  # pylint: disable=import-outside-toplevel
  char_gpt = helpers.load_example("char_gpt")
  model = char_gpt.GPT(11, 8, 16, layers, 2, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.as_pure(params)
  loss_fn = char_gpt.make_loss_fn(graphdef)
  ids = np.random.default_rng(0).integers(0, 11, 200).astype(np.int32)
  batch = char_gpt.train_batch(ids, 0, 8, 8, 0)
  tx = kl.kfac_adamw(3e-3, kl.scan(loss_fn, params, batch))

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  return jax.make_jaxpr(step)(params, tx.init(params), batch).jaxpr


@pytest.mark.perf
def test_each_part_of_the_step_is_under_its_scope():
  jaxpr = _step_jaxpr(2)
  for scope, primitive in SCOPES.items():
    assert helpers.count_primitive(jaxpr, primitive, scope) > 0, scope


@pytest.mark.perf
def test_curvature_work_does_not_grow_with_identical_blocks():
  """2 and 4 identical blocks: the same statistics products, EMA,
  factorisations and preconditioning products (one stacked computation
  per group of same-shaped layers). The statistics' model passes are
  the model's own and do grow."""
  small, large = _step_jaxpr(2), _step_jaxpr(4)
  for scope, primitive in SCOPES.items():
    n_small = helpers.count_primitive(small, primitive, scope)
    n_large = helpers.count_primitive(large, primitive, scope)
    if scope == "kfac_pass":
      assert n_large > n_small, (scope, n_small, n_large)
    else:
      assert n_large == n_small, (scope, n_small, n_large)
