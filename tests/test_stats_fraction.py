"""stats_fraction: row statistics from the first ⌈f·B⌉ examples of a batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers
from tests import problems

SIZES = [5, 6, 3]


def _problem(n=8, seed=0):
  p = problems.mlp_classifier(SIZES, n, seed=seed, first_batch_seed=seed + 1)
  return p.params, p.batch


def _stats(collection, params, batch, fraction, mode="exact", **kw):
  vgs = kl.value_grad_and_stats(collection.loss_fn, collection,
                                estimation_mode=mode,
                                stats_fraction=fraction,
                                stats_min_examples=1, **kw)
  # One jitted program, not hundreds of eager op-by-op compiles.
  return jax.jit(lambda p, b: vgs(p, b, jax.random.PRNGKey(3)))(params, batch)


@pytest.mark.parametrize("fraction,rows", [
    pytest.param(0.5, 4, marks=pytest.mark.slow),
    pytest.param(0.3, 3, marks=pytest.mark.slow), (1 / 8, 1)])
def test_row_statistics_are_those_of_the_first_examples(fraction, rows):
  params, batch = _problem()
  collection = kl.scan(helpers.classifier_loss, params, batch)
  _, grads, stats = _stats(collection, params, batch, fraction)
  head = jax.tree.map(lambda x: x[:rows], batch)
  _, _, want = _stats(collection, params, head, 1.0)
  _, full_grads, full = _stats(collection, params, batch, 1.0)
  for got, ref, every in zip(stats.blocks, want.blocks,
                             full.blocks):
    for k in ("a", "g"):
      np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)
      # The subset differs from the whole batch (else this test is void).
      assert not np.allclose(got[k], every[k], rtol=1e-3, atol=1e-5)
  # The gradient (and the loss) always use the whole batch.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               grads, full_grads)


def _scaled_loss(params, batch):
  """An MLP whose logits are scaled by a generic (summed-gradient) vector."""
  x, y = batch
  logits, _ = helpers.mlp_forward(params["mlp"], x)
  logits = logits * kl.register_generic(params["scale"], approx="full")
  kl.register_categorical_predictive_distribution(logits, y)
  return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits),
                                       y[:, None], axis=-1))


def test_parameter_gradient_blocks_use_the_whole_batch():
  params, batch = _problem()
  params = {"mlp": params, "scale": 1.0 + 0.1 * jnp.arange(SIZES[-1],
                                                           dtype=jnp.float32)}
  collection = kl.scan(_scaled_loss, params, batch)
  kinds = [l.kind for l in collection.layers]
  generic = kinds.index("generic")
  _, _, sub = _stats(collection, params, batch, 0.25)
  _, _, full = _stats(collection, params, batch, 1.0)
  head = jax.tree.map(lambda x: x[:2], batch)
  _, _, head_stats = _stats(collection, params, head, 1.0)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
               sub.blocks[generic], full.blocks[generic])
  assert not all(np.allclose(a, b) for a, b in zip(
      jax.tree.leaves(full.blocks[generic]),
      jax.tree.leaves(head_stats.blocks[generic])))
  dense = [i for i, k in enumerate(kinds) if k != "generic"]
  for i in dense:  # ... while the row statistics use the first 2 examples.
    np.testing.assert_allclose(sub.blocks[i]["a"],
                               head_stats.blocks[i]["a"], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, True, "half", None])
def test_bad_fraction_names_the_argument(bad):
  params, batch = _problem()
  collection = kl.scan(helpers.classifier_loss, params, batch)
  with pytest.raises(ValueError, match="stats_fraction"):
    kl.FisherEstimator(collection, stats_fraction=bad)
  if bad is not None:  # None is kfac's default: every example.
    with pytest.raises(ValueError, match="stats_fraction"):
      kl.kfac(1e-2, collection, stats_fraction=bad)


def test_kfac_fraction_is_static_under_inject_hyperparams():
  params, batch = _problem()
  collection = kl.scan(helpers.classifier_loss, params, batch)
  with pytest.raises(ValueError, match=r"stats_fraction=.*array.*static_args"):
    optax.inject_hyperparams(kl.kfac)(
        1e-2, collection, stats_fraction=0.5).init(params)
  tx = optax.inject_hyperparams(kl.kfac, static_args=("stats_fraction",))(
      1e-2, collection, stats_fraction=0.5)
  assert tx.init(params).hyperparams["learning_rate"] == 1e-2


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_bad_minimum_names_the_argument(bad):
  params, batch = _problem()
  collection = kl.scan(helpers.classifier_loss, params, batch)
  with pytest.raises(ValueError, match="stats_min_examples"):
    kl.FisherEstimator(collection, stats_min_examples=bad)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "4"])
def test_bad_position_stride_names_the_argument(bad):
  params, batch = _problem()
  collection = kl.scan(helpers.classifier_loss, params, batch)
  with pytest.raises(ValueError, match=r"stats_position_stride=.*positive"):
    kl.FisherEstimator(collection, stats_position_stride=bad)
  with pytest.raises(ValueError, match="stats_position_stride"):
    kl.kfac_adamw(1e-3, collection, stats_position_stride=bad)


@pytest.mark.slow
def test_position_stride_never_drops_examples():
  """One row per example (no positions): every stride keeps every row."""
  params, batch = _problem()
  collection = kl.scan(helpers.classifier_loss, params, batch)
  est = kl.FisherEstimator(collection, stats_position_stride=2)
  with pytest.raises(ValueError, match="stats_position_stride=2"):
    kl.kfac_adamw(1e-3, collection, stats_position_stride=2, estimator=est)
  stats = [kl.FisherEstimator(collection, stats_position_stride=k)
           .compute_stats(params, batch, jax.random.PRNGKey(1))
           for k in (1, 2)]
  jax.tree.map(np.testing.assert_array_equal, stats[0].stacked,
               stats[1].stacked)


@pytest.mark.parametrize("batch_size,fraction,minimum,rows", [
    (500, 0.25, 64, 125), (200, 0.25, 64, 64), (40, 0.25, 64, 40),
    (8, 0.5, 1, 4), (8, 0.3, 1, 3), (10, 1.0, 64, 10)])
def test_rows_are_a_fraction_with_a_floor(batch_size, fraction, minimum,
                                          rows):
  assert kl.estimator.stats_rows(batch_size, fraction, minimum) == rows


def test_small_batches_keep_every_example_by_default():
  params, batch = _problem()          # 8 examples < 64
  collection = kl.scan(helpers.classifier_loss, params, batch)
  vgs = lambda **kw: jax.jit(kl.value_grad_and_stats(  # noqa: E731
      collection.loss_fn, collection, estimation_mode="exact", **kw))(
          params, batch, jax.random.PRNGKey(0))[2]
  jax.tree.map(np.testing.assert_array_equal,
               vgs(stats_fraction=0.25).blocks, vgs().blocks)
  est = kl.FisherEstimator(collection, stats_fraction=0.25)
  same = []

  def head_is_the_whole_batch(p, b):
    lin = est.linearize(p, b)
    same.append(est.linearize_head(p, b, lin) is lin)

  jax.eval_shape(head_is_the_whole_batch, params, batch)  # Traced only.
  assert same == [True]


@pytest.mark.slow
def test_transforms_pass_the_fraction_to_their_estimator():
  params, batch = _problem()
  collection = kl.scan(helpers.classifier_loss, params, batch)
  est = kl.FisherEstimator(collection, stats_fraction=0.5,
                           stats_min_examples=1, estimation_mode="exact")
  for tx in (kl.kfac(1e-2, collection, estimator=est),
             kl.kfac_optimizer(collection, estimator=est)):
    updates, state = jax.jit(lambda p, b, tx=tx: tx.update(
        jax.grad(helpers.classifier_loss)(p, b), tx.init(p), p, batch=b))(
            params, batch)
    assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
    curv = [x for x in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, kl.transform.CurvatureState))
            if isinstance(x, kl.transform.CurvatureState)][0]
    head = jax.tree.map(lambda x: x[:4], batch)
    _, _, want = _stats(collection, params, head, 1.0)
    for got, ref in zip(curv.estimator.blocks, want.blocks):
      np.testing.assert_allclose(got.a, ref["a"], rtol=1e-5, atol=1e-6)


def _ce(logits, y):
  kl.register_categorical_predictive_distribution(logits, y)
  return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits),
                                       y[:, None], axis=-1))


def _normal(shape, seed):
  return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _assert_rows_match(collection, params, batch, head, fraction):
  _, _, sub = _stats(collection, params, batch, fraction)
  _, _, want = _stats(collection, params, head, 1.0)
  _, _, full = _stats(collection, params, batch, 1.0)
  for got, ref, every in zip(sub.blocks, want.blocks, full.blocks):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-6), got, ref)
    # The factors of the subset differ from the whole batch's.
    assert not np.allclose(got["a"], every["a"], rtol=1e-3, atol=1e-5)
    assert not np.allclose(got["g"], every["g"], rtol=1e-3, atol=1e-5)


def test_scan_over_stacked_layers_slices_the_batch_axis():
  def loss_fn(p, batch):
    h, _ = jax.lax.scan(lambda h, wb: (jnp.tanh(h @ wb[1] + wb[0]), None),
                        batch[0], (p["B"], p["W"]))
    return _ce(h, batch[1])
  params = {"B": 0.1 * _normal((3, 4), 1), "W": 0.5 * _normal((3, 4, 4), 2)}
  x = _normal((8, 4), 3)
  y = jax.random.randint(jax.random.PRNGKey(4), (8,), 0, 4)
  collection = kl.scan(loss_fn, params, (x, y))
  assert collection.layers[0].stack == 3
  _assert_rows_match(collection, params, (x, y), (x[:2], y[:2]), 0.25)


def test_scan_over_time_slices_the_batch_not_the_time_axis():
  def loss_fn(p, batch):
    h, hs = jax.lax.scan(
        lambda h, x: (jnp.tanh(x @ p["wx"] + h @ p["wh"]),) * 2,
        jnp.zeros((batch[0].shape[1], 4)), batch[0])
    return _ce(hs[-1] @ p["out"], batch[1])
  params = {"wx": _normal((3, 4), 1), "wh": 0.5 * _normal((4, 4), 2),
            "out": _normal((4, 3), 3)}
  x = _normal((5, 8, 3), 4)   # [T, B, d]
  y = jax.random.randint(jax.random.PRNGKey(5), (8,), 0, 3)
  collection = kl.scan(loss_fn, params, (x, y))
  assert collection.layers[0].num_uses == 5
  _assert_rows_match(collection, params, (x, y), (x[:, :4], y[:4]), 0.5)


def test_optimizer_fisher_products_come_from_the_head_of_the_batch():
  params, batch = _problem()
  collection = kl.scan(helpers.classifier_loss, params, batch)
  est = kl.FisherEstimator(collection, stats_fraction=0.5,
                           stats_min_examples=1)
  exact = kl.FisherEstimator(collection, stats_fraction=0.5,
                             stats_min_examples=1, estimation_mode="exact")

  @jax.jit  # One program, not hundreds of eager op-by-op compiles.
  def run(params, batch):
    lin = est.linearize(params, batch)
    head = est.linearize_head(params, batch, lin)
    assert head is not lin and head.head_only
    assert [z.shape[0] for z in head.zs] == [4]
    u = jax.grad(helpers.classifier_loss)(params, batch)
    v = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
    got = kl.optimizer.fisher_gram(head, [u, v])
    first = jax.tree.map(lambda x: x[:4], batch)
    want = kl.optimizer.fisher_gram(est.linearize(params, first), [u, v])
    everything = kl.optimizer.fisher_gram(lin, [u, v])
    # Its statistics use every one of its rows (it is the head already).
    rng = jax.random.PRNGKey(0)
    stats = exact.stats_from(exact.linearize_head(params, batch, lin), rng)
    ref = exact.stats_from(exact.linearize(params, batch), rng)
    # Without stats_fraction there is no second forward pass.
    assert kl.FisherEstimator(collection).linearize_head(params, batch,
                                                         lin) is lin
    return got, want, everything, stats, ref
  got, want, everything, stats, ref = run(params, batch)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert not np.allclose(got, everything, rtol=1e-3)
  np.testing.assert_allclose(stats.blocks[0]["a"], ref.blocks[0]["a"],
                             rtol=1e-5, atol=1e-6)


def test_time_major_batch_warns_and_keeps_the_whole_batch():
  def loss_fn(p, batch):
    hs = jnp.tanh(batch[0] @ p["w"])          # [T, B, 4]
    return _ce(hs[-1] @ p["out"], batch[1])
  params = {"w": _normal((3, 4), 1), "out": _normal((4, 3), 2)}
  x = _normal((5, 8, 3), 3)
  y = jax.random.randint(jax.random.PRNGKey(4), (8,), 0, 3)
  collection = kl.scan(loss_fn, params, (x, y))
  est = kl.FisherEstimator(collection, stats_fraction=0.5,
                           stats_min_examples=1)
  lin = est.linearize(params, (x, y))
  with pytest.warns(UserWarning, match="stats_fraction=0.5"):
    assert est.linearize_head(params, (x, y), lin) is lin


def test_uncut_batch_warns_and_keeps_the_whole_batch():
  def loss_fn(p, x):  # x: [T, B, 3]; no leaf has the examples first.
    out = jnp.tanh(x @ p["w"])[-1]
    kl.register_normal_predictive_distribution(out, jnp.zeros_like(out))
    return jnp.mean(out ** 2)
  params = {"w": _normal((3, 4), 1)}
  x = _normal((5, 8, 3), 3)
  collection = kl.scan(loss_fn, params, x)
  est = kl.FisherEstimator(collection, stats_fraction=0.5,
                           stats_min_examples=1)
  lin = est.linearize(params, x)
  with pytest.warns(UserWarning, match=r"loss tags of \[8\] rows"):
    assert est.linearize_head(params, x, lin) is lin


@pytest.mark.slow
def test_kfac_optimizer_uses_a_quarter_of_large_batches_by_default():
  params, batch = _problem(n=256)
  collection = kl.scan(helpers.classifier_loss, params, batch)
  tx = kl.kfac_optimizer(collection, estimation_mode="exact")
  _, state = jax.jit(lambda s, p, b: tx.update(None, s, p, batch=b))(
      tx.init(params), params, batch)
  head = jax.tree.map(lambda x: x[:64], batch)
  _, _, want = _stats(collection, params, head, 1.0)
  _, _, every = _stats(collection, params, batch, 1.0)
  got = state.curvature.estimator.blocks
  for g, w, e in zip(got, want.blocks, every.blocks):
    np.testing.assert_allclose(g.a, w["a"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(g.a, e["a"], rtol=1e-3, atol=1e-5)
  # kfac keeps every example by default (its stats= may come from the
  # caller's value_grad_and_stats, whose default is the whole batch too);
  # stats_fraction=0.125 keeps its floor of 64 examples (not 32): the
  # head kfac_optimizer's default takes.
  for kw, ref in (({}, every), ({"stats_fraction": 0.125}, want)):
    tx = kl.kfac(1e-2, collection, estimation_mode="exact", **kw)
    _, state = jax.jit(lambda g, s, p, b, tx=tx: tx.update(
        g, s, p, batch=b))(params, tx.init(params), params, batch)
    for g, r in zip(state.inner[0].estimator.blocks, ref.blocks):
      np.testing.assert_allclose(g.a, r["a"], rtol=1e-5, atol=1e-6)
