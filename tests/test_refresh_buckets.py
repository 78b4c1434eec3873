"""The inverse refresh pads Kronecker factors of nearby sizes to one size.

``FisherEstimator.update_cache`` refreshes the dense factors of "pi"-damped
Kronecker blocks through :func:`refresh.bucketed_map`: each factor is padded
with an identity block to its bucket's size (exact for matrix functions of
a block-diagonal matrix), so XLA:CPU compiles one set of factorisation
kernels per bucket instead of one per factor size.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import linalg
from kfac_jax_lite import refresh
from tests import helpers

# Input factors 9, 10, 11 (with bias) and output factors 9, 10, 3.
SIZES = [8, 9, 10, 3]
DAMPING = 1e-2


def _estimator_and_state(**kw):
  params = helpers.mlp_params(jax.random.PRNGKey(0), SIZES)
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 16, SIZES[0],
                                       SIZES[-1])
  c = kl.scan(helpers.classifier_loss, params, batch)
  est = kl.FisherEstimator(c, damping=DAMPING, **kw)
  state = jax.jit(lambda p, b: est.update_curvature(  # One program.
      est.init(p), p, b, jax.random.PRNGKey(2)))(params, batch)
  return est, state


@pytest.mark.parametrize("kw", [
    dict(exps=(-1,)),
    dict(exps=(-1, -0.5)),
    pytest.param(dict(exps=(-1,), compute_cholesky=True),
                 marks=pytest.mark.slow),
    dict(exps=(-1, -0.5), compute_cholesky=True,
         compute_cholesky_inverse=True),
])
def test_bucketed_refresh_equals_per_block_refresh(kw):
  est, state = _estimator_and_state(**kw)
  new = jax.jit(est.update_cache)(state)
  # Each block refreshed alone, all in one jitted program (not op by op).
  alones = jax.jit(lambda blocks: [
      b.update_cache(s, jnp.asarray(DAMPING, jnp.float32))
      for b, s in zip(est.blocks, blocks)])(state.blocks)
  for s, n, alone in zip(state.blocks, new.blocks, alones):
    assert sorted(n.cache) == sorted(alone.cache)
    for k in alone.cache:
      assert n.cache[k].shape == alone.cache[k].shape, k
      np.testing.assert_allclose(n.cache[k], alone.cache[k], rtol=2e-5,
                                 atol=2e-5 * float(
                                     np.max(np.abs(alone.cache[k]))))
    np.testing.assert_allclose(n.damping, alone.damping)
    helpers.assert_trees_close((n.a, n.g, n.weight, n.scale),
                               (s.a, s.g, s.weight, s.scale), rtol=0)


@pytest.mark.slow
def test_padding_with_identity_is_exact_for_matrix_functions():
  m = jax.random.normal(jax.random.PRNGKey(0), (7, 7))
  m = m @ m.T
  fn = lambda x, d: linalg.damped_factor_cache(  # noqa: E731
      x, d, (-1.0, -0.5), True, True)
  (padded,) = refresh.bucketed_map(fn, [m], [0.1])
  direct = fn(m, 0.1)
  # [[m, 0], [0, I]], as bucketed_map pads a 7x7 factor in a 9x9 bucket.
  p = jnp.pad(m, ((0, 2), (0, 2))) + jnp.diag(jnp.arange(9) >= 7)
  np.testing.assert_allclose(p[:7, :7], m)
  np.testing.assert_allclose(p[7:, 7:], jnp.eye(2))
  np.testing.assert_allclose(p[:7, 7:], 0)
  big = fn(p, 0.1)
  for k in direct:
    np.testing.assert_allclose(big[k][:7, :7], direct[k], rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(padded[k], direct[k], rtol=1e-6)


def test_bucketing_rule_never_merges_distant_sizes():
  ae = [785, 1001, 501, 251, 31, 251, 501, 1001, 1000, 500, 250, 30, 250,
        500, 1000, 784]
  buckets = refresh.size_buckets(ae)
  assert sorted(n for n, _ in buckets) == [31, 251, 501, 785, 1001]
  for size, idx in buckets:
    for i in idx:
      assert size >= ae[i]
      assert size - ae[i] <= max(1, ae[i] // 16)
  assert sorted(i for _, idx in buckets for i in idx) == list(range(len(ae)))
  # 30 never joins 250 or 1000; 3 never joins 9; 784 never joins 1000.
  for sizes in ([30, 1000], [30, 250], [3, 9, 10, 11], [784, 1000],
                [1, 2, 4, 8, 16, 32]):
    for size, idx in refresh.size_buckets(sizes):
      for i in idx:
        assert size - sizes[i] <= max(1, sizes[i] // 16), (sizes, size)
  assert len(refresh.size_buckets([30, 1000])) == 2
  assert len(refresh.size_buckets([3, 9, 10, 11])) == 3   # {3}, {9}, {10, 11}
  assert refresh.size_buckets([100, 94, 93]) == [(100, [0]), (94, [1, 2])]


def _lapack_calls(text):
  """The distinct ``(kernel, size)`` of the LAPACK custom calls in a
  lowered program: the factorisation kernels XLA must compile."""
  return sorted(set(re.findall(
      r"custom_call @(lapack_\w+)\(.*?: \(tensor<(\d+)x\d+xf32>", text)))


@pytest.mark.perf
@pytest.mark.cpu_only  # XLA:CPU's LAPACK calls.
def test_refresh_program_has_one_factorisation_size_per_bucket():
  est, state = _estimator_and_state(exps=(-1,))
  factor_sizes = {f.shape[0] for s in state.blocks for f in (s.a, s.g)}
  assert factor_sizes == {9, 10, 11, 3}
  text = jax.jit(est.update_cache).lower(state).as_text()
  calls = _lapack_calls(text)
  chol = sorted(int(n) for k, n in calls if k.startswith("lapack_spotrf"))
  # Buckets {11 <- 10, 10, 11}, {9, 9}, {3}: three kernel sizes, not one
  # per factor size (4) as without buckets.
  assert chol == [3, 9, 11], calls
  assert len(calls) == 6, calls    # Cholesky + triangular solve per size
  assert len(calls) < 2 * len(factor_sizes)
  # Still unbatched LAPACK (see test_linalg_batching).
  assert not re.search(r"num_batch_dims = \"[1-9]", text)


@pytest.mark.perf
@pytest.mark.cpu_only  # XLA:CPU's LAPACK calls.
def test_the_transforms_refresh_through_the_buckets_too():
  """``scale_by_kfac`` keeps its state grouped (Curvature.step); layers
  without a same-shaped twin still share padded buckets there."""
  params = helpers.mlp_params(jax.random.PRNGKey(0), SIZES)
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 16, SIZES[0],
                                       SIZES[-1])
  c = kl.scan(helpers.classifier_loss, params, batch)
  tx = kl.scale_by_kfac(c, damping=DAMPING, inverse_update_period=1)
  grads = jax.grad(helpers.classifier_loss)(params, batch)
  text = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b)).lower(
      grads, tx.init(params), params, batch).as_text()
  chol = sorted(int(n) for k, n in _lapack_calls(text)
                if k.startswith("lapack_spotrf"))
  assert chol == [3, 9, 11], chol


@pytest.mark.perf
def test_split_dampings_are_one_vector_computation():
  """The pi-adjusted dampings of all blocks come from one vector
  computation (its sqrt count does not grow with the layers), and every
  member of a bucket reads its damping and size at a runtime index, so
  its kernels are the bucket's, not its own."""
  counts = []
  for sizes in ([8, 9, 10, 3], [8, 9, 10, 11, 12, 13, 3]):
    params = helpers.mlp_params(jax.random.PRNGKey(0), sizes)
    batch = helpers.classification_batch(jax.random.PRNGKey(1), 16,
                                         sizes[0], sizes[-1])
    est = kl.FisherEstimator(kl.scan(helpers.classifier_loss, params, batch),
                             damping=DAMPING)
    jaxpr = jax.make_jaxpr(est.update_cache)(est.init(params)).jaxpr
    factors = 2 * (len(sizes) - 1)
    counts.append(helpers.count_primitive(jaxpr, "sqrt"))
    # A damping and a size per factor, each read at an opaque index.
    assert helpers.count_primitive(jaxpr, "dynamic_slice") == 2 * factors
  assert counts[0] == counts[1] == 2, counts


@pytest.mark.perf
def test_split_dampings_add_no_per_block_kernels():
  """Each member's split damping is computed elementwise from the stacked
  traces, gathered at static indices, and XLA fuses that into the
  kernels that read it: the compiled refresh holds no vector with one
  entry per block. Stacking the A and G traces per block, then
  concatenating and gathering their splits, were three kernels more."""
  for sizes in (SIZES, [8, 9, 10, 11, 12, 13, 3]):
    params = helpers.mlp_params(jax.random.PRNGKey(0), sizes)
    batch = helpers.classification_batch(jax.random.PRNGKey(1), 16,
                                         sizes[0], sizes[-1])
    est = kl.FisherEstimator(kl.scan(helpers.classifier_loss, params, batch),
                             damping=DAMPING)
    text = jax.jit(est.update_cache).lower(est.init(params)).compile(
        ).as_text()
    lengths = [int(n) for n in re.findall(
        r"^\s+(?:ROOT )?%?\S+ = f32\[(\d+)(?:,1)?\]\{[^}]*\} fusion\(",
        text, re.M)]
    vectors = [n for n in lengths if n > 1]  # Scalars are f32[1] or f32[].
    factors = 2 * (len(sizes) - 1)
    assert set(vectors) == {factors}, lengths  # None of len(sizes) - 1.


def test_diagonal_factors_take_their_split_from_the_buckets_traces():
  """A block with a diagonal input factor (``kron_in_diag``) next to
  dense blocks: its dense factor is refreshed in a bucket, its diagonal
  one elementwise, both with the same pi-split as a refresh of the block
  alone."""
  params = helpers.mlp_params(jax.random.PRNGKey(0), SIZES)
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 16, SIZES[0],
                                       SIZES[-1])
  c = kl.scan(helpers.classifier_loss, params, batch,
              approximations={"fully_connected": "kron_in_diag"})
  est = kl.FisherEstimator(c, damping=DAMPING)
  state = jax.jit(lambda p, b: est.update_curvature(  # One program.
      est.init(p), p, b, jax.random.PRNGKey(2)))(params, batch)
  assert all(s.a.ndim == 1 and s.g.ndim == 2 for s in state.blocks)
  new = jax.jit(est.update_cache)(state)
  alones = jax.jit(lambda blocks: [
      b.update_cache(s, jnp.asarray(DAMPING, jnp.float32))
      for b, s in zip(est.blocks, blocks)])(state.blocks)
  for n, alone in zip(new.blocks, alones):
    assert sorted(n.cache) == sorted(alone.cache)
    for k in alone.cache:
      np.testing.assert_allclose(n.cache[k], alone.cache[k], rtol=2e-5,
                                 atol=2e-5 * float(
                                     np.max(np.abs(alone.cache[k]))))


def test_padded_sizes_reproduce_a_factors_bucket_alone():
  """A block refreshed alone at the padded sizes a larger refresh gives its
  factors (what each device does under ``distributed_inverses``) goes
  through the same padded computation: the same caches as in the larger
  refresh, where its own buckets (no padding) round differently."""
  est, state = _estimator_and_state(exps=(-1, -0.5))
  blocks, states = list(est.blocks), list(state.blocks)
  sizes = refresh.bucket_sizes(blocks, states)
  assert sizes[1, "a"] == 11 and states[1].a.shape == (10, 10)
  full = jax.jit(lambda s: refresh.bucketed_update_cache(
      blocks, s, DAMPING))(states)
  for i in range(len(blocks)):
    mine = {(0, n): size for (k, n), size in sizes.items() if k == i}
    alone = jax.jit(lambda s, i=i, mine=mine: (
        refresh.bucketed_update_cache(
            [blocks[i]], [s], DAMPING, mine)[0]))(states[i])
    for k in full[i].cache:   # Bit for bit (unpadded: 1.1e-7 apart).
      np.testing.assert_array_equal(alone.cache[k], full[i].cache[k])
