"""Named regression tests for the failures the generated suite found.

Each test is the smallest configuration of ``tests/test_generated.py`` that
failed, checked against an independent reference where one exists. The
``pmap`` tests run on ``helpers.replica_devices`` (the simulated CPU
devices beside one GPU), their one-device references there too.
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import distributed
from tests import blocks_helpers as bh
from tests import generated_models as gm
from tests import helpers

R = 2


def _on_replicas(tree, split):
  """``tree`` on ``R`` devices as ``pmap`` takes it: each leaf split along
  its batch axis (``split``) or replicated."""
  sharding = NamedSharding(Mesh(np.array(helpers.replica_devices(R)), ("d",)),
                           PartitionSpec("d"))
  place = (lambda a: np.asarray(a).reshape((R, -1) + a.shape[1:])) if split \
      else (lambda a: np.stack([np.asarray(a)] * R))
  return jax.device_put(jax.tree.map(place, tree), sharding)


@pytest.mark.parametrize("kind", [
    "depthwise_conv", pytest.param("separable_conv", marks=pytest.mark.slow)])
def test_grouped_conv_exact_statistics_under_pmap_match_one_device(kind):
  """Exact-mode statistics (one backward pass per output coordinate, under
  ``vmap``) of a depthwise or separable conv under ``pmap`` raised a bare
  ``NotImplementedError``: JAX has no batching rule for the kernel
  transpose of a grouped convolution under ``shard_map``. They now equal
  the statistics of the whole batch on one device."""
  with helpers.on_replica_devices(R) as devices:
    _check_grouped_conv_exact_statistics(kind, devices)


def _check_grouped_conv_exact_statistics(kind, devices):
  spec = gm.ModelSpec(kind, "kron")
  loss = gm.make_loss(spec)
  params, batch = gm.make_params(spec, 0), gm.make_batch(spec, 1)
  collection = gm.scan_collection(spec, loss, params, batch)
  rng = jax.random.PRNGKey(0)

  def factors(axis_name):
    est = kl.FisherEstimator(collection, estimation_mode="exact",
                             axis_name=axis_name)
    return lambda p, b: est.update_curvature(est.init(p), p, b, rng).stacked

  want = jax.jit(factors(None))(params, batch)
  got = jax.pmap(factors("d"), "d", devices=devices)(
      _on_replicas(params, False), _on_replicas(batch, True))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(g[1], g[0])
    np.testing.assert_allclose(g[0], w, rtol=2e-5,
                               atol=2e-6 * float(jnp.abs(w).max()))


def _directions(collection, loss, params, batches, stats_sync):
  """Directions of two ``scale_by_kfac`` steps under ``pmap`` (refresh at
  the first step only), replica by replica."""
  tx = kl.scale_by_kfac(collection, axis_name="d", stats_sync=stats_sync,
                        inverse_update_period=2, damping=1e-2)

  def step(p, state, batch):
    grads = jax.lax.pmean(jax.grad(loss)(p, batch), "d")
    return tx.update(grads, state, p, batch=batch)

  fn = jax.pmap(step, "d", devices=helpers.replica_devices(R))
  p = _on_replicas(params, False)
  state = _on_replicas(tx.init(params), False)
  out = []
  for b in batches:
    direction, state = fn(p, state, _on_replicas(b, True))
    out.append(direction)
  return out


@pytest.mark.parametrize("kind,approx", [
    ("fully_connected", "diagonal"),
    pytest.param("conv", "ekfac", marks=pytest.mark.slow)])
def test_before_refresh_directions_agree_across_replicas(kind, approx):
  """With ``stats_sync="before_refresh"``, a diagonal block (its product
  powers the live diagonal) and EK-FAC (its rescaling is a live factor)
  preconditioned each replica with its own factors between refreshes: the
  replicas' updates, and so their parameters, drifted apart. Now every
  replica's direction is the same, and equals ``every_update``'s (the
  average of the replicas' EMAs is the EMA of the averaged statistics)."""
  with helpers.on_replica_devices(R):
    _check_before_refresh_directions(kind, approx)


def _check_before_refresh_directions(kind, approx):
  spec = gm.ModelSpec(kind, approx, loss="normal")
  loss = gm.make_loss(spec)
  params = gm.make_params(spec, 0)
  batches = [gm.make_batch(spec, s) for s in (1, 2)]
  collection = gm.scan_collection(spec, loss, params, batches[0])
  got = _directions(collection, loss, params, batches, "before_refresh")
  want = _directions(collection, loss, params, batches, "every_update")
  for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]),
                  strict=True):
    np.testing.assert_array_equal(g[1], g[0])
    np.testing.assert_allclose(g[0], w[0], rtol=1e-4,
                               atol=1e-6 * float(np.abs(w).max()))


class _UserBlock:
  """A block from ``block_factories`` with neither ``layer`` nor
  ``config``: only the protocol's verbs (here delegated)."""

  def __init__(self, inner):
    self._inner = inner
    self.needs_param_grads = inner.needs_param_grads

  def __getattr__(self, name):
    if name in ("layer", "config"):
      raise AttributeError(name)
    return getattr(self._inner, name)


def test_live_factors_are_the_ones_products_read():
  """What the products average under ``before_refresh``: a diagonal
  block's diagonal; of a Kronecker block only the scalar ``scale`` (its
  powers of A and G are cached); every factor of a block the analysis
  cannot trace (a user block without ``layer``)."""
  shapes = [(3, 2), (2,)]
  make = lambda approx: blocks_lib.make_block(  # noqa: E731
      bh.make_layer("fully_connected", approx, shapes, dtype="float32"))
  assert distributed.live_factors(make("diagonal")) == (True,)
  # factors() of a Kronecker block: {"a", "g", "scale"}, in key order.
  assert distributed.live_factors(make("kron")) == (False, False, True)
  assert distributed.live_factors(_UserBlock(make("kron"))) == (True,) * 3
