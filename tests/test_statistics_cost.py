"""Strided factor rows (``stats_position_stride``): unbiased, and cheaper.

Checks that the strided estimate of a dense layer's Kronecker factors
averages to the all-row factors over the offsets, that the estimator's
draws reach every offset, that XLA's flop count of the statistics drops by
the factor products' share, that the platform default is every row on CPU
and every 4th row when lowered for a GPU, and that ``kfac_adamw`` trains
with it.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite.blocks import layouts

D_IN, D_HID, VOCAB = 16, 48, 12


def _seq_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  logits = h @ params["w2"]
  logits = kl.register_categorical_predictive_distribution(logits,
                                                           batch["y"])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()


def _seq_problem(batch_size=4, length=24, seed=0):
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
  params = {"w1": jax.random.normal(k1, (D_IN, D_HID)) / np.sqrt(D_IN),
            "b1": jnp.zeros((D_HID,)),
            "w2": jax.random.normal(k2, (D_HID, VOCAB)) / np.sqrt(D_HID)}
  batch = {"x": jax.random.normal(k3, (batch_size, length, D_IN)),
           "y": jax.random.randint(k4, (batch_size, length), 0, VOCAB)}
  return params, batch


def _flops(fn, *args, platform=None):
  lowered = jax.jit(fn).trace(*args).lower(
      **({"lowering_platforms": (platform,)} if platform else {}))
  cost = lowered.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return cost["flops"]


@pytest.mark.parametrize("rows,stride", [
    (26, 4), (5, 8), *(pytest.param(r, s, marks=pytest.mark.slow)
                       for r, s in ((24, 4), (7, 3), (12, 1)))])
@pytest.mark.parametrize("diagonal", [False, True])
def test_strided_factors_average_to_the_full_factors(rows, stride, diagonal):
  """Over the ``k`` offsets the strided estimates average to the all-row
  ``A`` and ``G`` exactly (``N`` a multiple of ``k`` or not, ``k > N``)."""
  kx, kg = jax.random.split(jax.random.PRNGKey(rows * 10 + stride))
  x = jax.random.normal(kx, (rows, 5))
  g = jax.random.normal(kg, (2, rows, 3))
  full = layouts.kron_stats(x, g, 1, diagonal, diagonal, "t")
  k = min(stride, rows)
  parts = [layouts.kron_stats(x, g, 1, diagonal, diagonal, "t", stride,
                              jnp.float32((o + 0.5) / k))
           for o in range(k)]
  for name in ("a", "g"):
    mean = sum(p[name] for p in parts) / k
    np.testing.assert_allclose(mean, full[name], rtol=1e-5, atol=1e-6)
    if k > 1:  # Each part alone is an estimate, not the factor.
      assert not np.allclose(parts[0][name], full[name], rtol=1e-3)
  assert all(p["scale"] == full["scale"] for p in parts)


def test_stride_one_is_every_row_bitwise():
  params, batch = _seq_problem()
  c = kl.scan(_seq_loss, params, batch)
  key = jax.random.PRNGKey(3)
  stats = [jax.jit(kl.FisherEstimator(c, stats_position_stride=k)
                   .compute_stats)(params, batch, key) for k in (1, None)]
  # None is every row on CPU: the same statistics, bit for bit.
  jax.tree.map(np.testing.assert_array_equal, stats[0].stacked,
               stats[1].stacked)


@pytest.mark.slow
def test_estimator_draws_reach_every_offset_and_average_to_the_factor():
  """Empirical mode samples nothing, so the offset is the only randomness:
  the keys give exactly ``k`` distinct factors, whose mean is the
  all-row factor."""
  params, batch = _seq_problem()
  c = kl.scan(_seq_loss, params, batch)
  full = kl.FisherEstimator(c, estimation_mode="empirical",
                            stats_position_stride=1)
  strided = kl.FisherEstimator(c, estimation_mode="empirical",
                               stats_position_stride=4)
  want = full.per_layer(full.compute_stats(params, batch, None))
  keys = jax.random.split(jax.random.PRNGKey(0), 64)
  got = jax.jit(jax.vmap(lambda k: strided.compute_stats(params, batch, k)
                         ))(keys)
  for layer, w in enumerate(want):
    a = np.asarray(strided.per_layer(got)[layer]["a"])
    distinct = np.unique(a.reshape(len(keys), -1), axis=0)
    assert len(distinct) == 4, layer
    np.testing.assert_allclose(distinct.mean(axis=0),
                               np.asarray(w["a"]).ravel(), rtol=1e-5,
                               atol=1e-6)


def test_factor_product_flops_drop_by_the_stride():
  """XLA's flop count of the statistics drops by ``(1 - 1/k)`` of the
  factor products, ``2 N (d_a² + d_g²)`` per dense layer."""
  params, batch = _seq_problem(batch_size=8, length=64)
  c = kl.scan(_seq_loss, params, batch)
  key = jax.random.PRNGKey(0)
  flops = {k: _flops(kl.FisherEstimator(c, stats_position_stride=k)
                     .compute_stats, params, batch, key) for k in (1, 4)}
  n = 8 * 64
  products = 2 * n * ((D_IN + 1) ** 2 + D_HID ** 2 + D_HID ** 2
                      + VOCAB ** 2)
  saved = flops[1] - flops[4]
  assert abs(saved - 0.75 * products) < 0.05 * products, (flops, products)


def test_default_stride_is_every_row_on_cpu_and_four_on_gpu():
  params, batch = _seq_problem(batch_size=8, length=64)
  c = kl.scan(_seq_loss, params, batch)
  key = jax.random.PRNGKey(0)
  flops = lambda k, p=None: _flops(  # noqa: E731
      kl.FisherEstimator(c, stats_position_stride=k).compute_stats,
      params, batch, key, platform=p)
  assert flops(None, "cpu") == flops(1, "cpu")
  assert flops(None, "cuda") == pytest.approx(flops(4, "cuda"), rel=1e-3)
  assert flops(None, "cuda") < 0.8 * flops(1, "cuda")


@pytest.mark.slow
def test_char_gpt_statistics_cost_a_fifth_of_the_gradient_on_gpu():
  """At the GPT of the measured profile (6 x 384, 6 heads, 256 x 64
  characters) the default statistics of the first 8 sequences, lowered
  for a GPU, cost at most 0.2x the loss and gradient by XLA's flop count
  (0.23x with every row; trace and lowering only)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  if not hasattr(nnx, "List"):
    pytest.skip("examples/char_gpt.py needs nnx.List, flax >= 0.12 (the "
                "examples extra); this environment has an older flax")
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir,
                                  "examples"))
  import char_gpt  # pylint: disable=g-import-not-at-top
  args = char_gpt.parse_args(["--batch-size", "64", "--context", "256",
                              "--width", "384", "--layers", "6",
                              "--heads", "6"])
  s = char_gpt.setup(args)
  params, batch = s["params"], s["batch_fn"](0)
  head = jax.tree.map(lambda x: x[:8], batch)
  key = jax.random.PRNGKey(0)
  grad = _flops(jax.value_and_grad(s["loss_fn"]), params, batch,
                platform="cuda")
  stats = lambda k: _flops(  # noqa: E731
      kl.FisherEstimator(s["collection"], stats_position_stride=k)
      .compute_stats, params, head, key, platform="cuda")
  assert stats(None) <= 0.2 * grad
  assert stats(1) > 0.2 * grad   # What the default saves.


def test_kfac_adamw_trains_with_strided_statistics():
  params, batch = _seq_problem(batch_size=16, length=24, seed=1)
  c = kl.scan(_seq_loss, params, batch)
  tx = kl.kfac_adamw(1e-2, c, stats_position_stride=4, stats_fraction=0.5,
                     inverse_update_period=2)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(_seq_loss)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(30):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow
def test_kfac_adamw_passes_the_position_stride_to_its_estimator():
  params, batch = _seq_problem()
  c = kl.scan(_seq_loss, params, batch)
  grads = jax.grad(_seq_loss)(params, batch)

  def updates(**kw):
    tx = kl.kfac_adamw(1e-3, c, stats_fraction=1.0, **kw)
    return tx.update(grads, tx.init(params), params, batch=batch)[0]

  # Every row on CPU by default; every 2nd position differs.
  jax.tree.map(np.testing.assert_array_equal, updates(),
               updates(stats_position_stride=1))
  assert not all(jax.tree.leaves(jax.tree.map(
      np.array_equal, updates(), updates(stats_position_stride=2))))
