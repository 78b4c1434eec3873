"""LAPACK kernels run one matrix at a time, also under ``vmap``.

jaxlib's batched CPU LAPACK kernels share XLA's thread pool; two of them at
once deadlocked the inverse refresh of models with same-shaped layers on a
2-core machine (see ``_xla_cpu.sequential_under_vmap``). On the CPU the
refresh of a group of same-shaped blocks must therefore lower to unbatched
LAPACK calls (inside one loop) and still give the per-layer results. The
tests of the lowered program are ``cpu_only`` (XLA:CPU's LAPACK calls);
the results are checked on every platform.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import linalg
from tests import helpers


def _lapack_batch_dims(lowered_text):
  """``num_batch_dims`` of every LAPACK custom call in a lowered program."""
  return [int(m) for m in re.findall(
      r"custom_call @lapack_\w+.*?num_batch_dims = \"(\d+)\"",
      lowered_text)]


def _grouped(damping_type):
  """``(estimator, params, batch)`` of an MLP whose three same-shaped 7x7
  layers are one group."""
  sizes = [5, 7, 7, 7, 3]
  params = helpers.mlp_params(jax.random.PRNGKey(0), sizes)
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 16, 5, 3)
  c = kl.scan(helpers.classifier_loss, params, batch)
  est = kl.FisherEstimator(c, damping=1e-2, damping_type=damping_type)
  return est, params, batch


@pytest.mark.parametrize("damping_type", ["pi", "exact"])
def test_grouped_refresh_matches_per_layer(damping_type):
  est, params, batch = _grouped(damping_type)
  # Jitted programs, not hundreds of eager op-by-op compiles.
  state = jax.jit(lambda p, b: est.update_curvature(
      est.init(p), p, b, jax.random.PRNGKey(2)))(params, batch)
  grouped = jax.jit(est.update_cache)(state)
  alones = jax.jit(lambda blocks: [
      b.update_cache(s, jnp.asarray(1e-2, jnp.float32))
      for b, s in zip(est.blocks, blocks)])(state.blocks)
  for i, alone in enumerate(alones):
    helpers.assert_trees_close(grouped.blocks[i].cache, alone.cache,
                               rtol=1e-5)


@pytest.mark.cpu_only
@pytest.mark.parametrize("damping_type", ["pi", "exact"])
def test_grouped_refresh_uses_unbatched_lapack(damping_type):
  est, params, _ = _grouped(damping_type)
  text = jax.jit(est.update_cache).lower(est.init(params)).as_text()
  dims = _lapack_batch_dims(text)
  assert dims, "expected LAPACK calls in the refresh"
  assert dims == [0] * len(dims), dims


@pytest.mark.perf
@pytest.mark.cpu_only
def test_a_groups_inverses_are_one_loop_per_factor_shape():
  """The Cholesky factorisation and the triangular solve of a group's
  inverses run in one ``lax.map`` (:func:`linalg.cholesky_inverse`): one
  loop per factor shape, where each of the two ran its own (every loop
  is a few XLA:CPU kernels of its own)."""
  sizes = [5, 7, 7, 7, 3]   # one group of three: factors 8 x 8 and 7 x 7
  params = helpers.mlp_params(jax.random.PRNGKey(0), sizes)
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 16, 5, 3)
  est = kl.FisherEstimator(kl.scan(helpers.classifier_loss, params, batch),
                           damping=1e-2)
  state = est.init(params)
  text = jax.jit(est.update_cache).lower(state).as_text()
  assert text.count("stablehlo.while") == 2, text.count("stablehlo.while")


def _spd():
  m = jax.random.normal(jax.random.PRNGKey(0), (4, 6, 6))
  return jnp.einsum("bij,bkj->bik", m, m) + 6 * jnp.eye(6)


def test_cholesky_inverse_under_vmap():
  spd = _spd()
  inv = jax.vmap(linalg.cholesky_inverse)(spd)
  np.testing.assert_allclose(inv, jnp.linalg.inv(jnp.linalg.cholesky(spd)),
                             rtol=1e-4, atol=1e-5)


@pytest.mark.cpu_only
def test_cholesky_inverse_under_vmap_is_one_loop_of_unbatched_lapack():
  text = jax.jit(jax.vmap(linalg.cholesky_inverse)).lower(_spd()).as_text()
  assert _lapack_batch_dims(text) == [0, 0]
  assert text.count("stablehlo.while") == 1


def test_sequential_under_vmap_maps_batched_and_fixed_arguments():
  spd = _spd()
  chol = jax.vmap(linalg.cholesky)(spd)
  np.testing.assert_allclose(chol, jnp.linalg.cholesky(spd), rtol=1e-5,
                             atol=1e-6)
  eye = jnp.eye(6)
  inv = jax.vmap(linalg.lower_triangular_solve, (0, None))(chol, eye)
  np.testing.assert_allclose(jnp.einsum("bij,bjk->bik", inv, chol),
                             jnp.broadcast_to(eye, (4, 6, 6)), atol=1e-5)


@pytest.mark.cpu_only
def test_sequential_under_vmap_lowers_to_unbatched_lapack():
  spd = _spd()
  text = jax.jit(jax.vmap(linalg.cholesky)).lower(spd).as_text()
  assert _lapack_batch_dims(text) == [0]
  plain = jax.jit(jax.vmap(jnp.linalg.cholesky)).lower(spd).as_text()
  assert _lapack_batch_dims(plain) == [1]   # what the wrapper avoids
