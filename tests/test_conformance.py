"""Every registered (kind, approximation) through the block protocol.

The pairs come from the registry (:mod:`kfac_jax_lite.kinds`), single-use
and multi-use, so a new row is tested without touching this file. Each case
runs its verbs in one ``jax.jit`` and checks what the protocol promises:
a stable state structure, statistics shaped like the factors, a
``factors``/``with_factors`` round trip, products that invert each other,
and the optional capabilities (Cholesky products, the factor-by-factor
refresh, fused products) agreeing with the plain verbs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import blocks
from kfac_jax_lite import kinds
from kfac_jax_lite.blocks import base
from tests import block_cases as cases
from tests import blocks_helpers as h
from tests import helpers
from tests.blocks_helpers import x64  # noqa: F401  (fixture)

# (kind, approx) without Cholesky products or without products at exp 1.
NO_CHOLESKY = {("fully_connected", "kron_series_1"),
               ("fully_connected", "kron_series_2")}
NO_EXP1 = {("fully_connected", "kron_series_2")}
PAIRS = [(k, a, multi) for k, row in kinds.KINDS.items()
         for multi in (False, True) for a in row.allowed(2 if multi else 1)]


def _twice(case):
  """A single-use case used at two sites: a multi-use layer."""
  layer, data, params, fn = case
  data = data._replace(inputs=data.inputs * 2, grads=data.grads * 2)
  return dataclasses.replace(layer, num_uses=2 * layer.num_uses), data, params


def _case(kind, approx, multi):
  """``(layer, data, params)`` of ``kind`` with ``approx``."""
  if kind == "fully_connected":
    if approx.startswith("kron_series"):
      return cases.series(1, approx=approx)[:3]
    return cases.dense(1, approx=approx, uses=3 if multi else 1,
                       sites=2 if multi else 1,
                       d_in=2 if approx == "full" else 3)[:3]
  if kind == "conv":
    return cases.conv(1, approx=approx, uses=2 if multi else 1)[:3]
  if kind == "embedding":
    return cases.embedding(1, approx=approx, k=None,
                           sites=2 if multi else 1)[:3]
  if kind == "tied_embedding":
    return cases.tied(1)[:3]   # Always several uses (lookups and attends).
  build = {"depthwise_conv": cases.depthwise,
           "separable_conv": cases.separable,
           "scale_and_shift": cases.scale_and_shift,
           "generic": cases.generic}[kind]
  case = build(1, approx=approx)
  return _twice(case) if multi else case[:3]


def _stacked(size=3):
  """A stacked layer (``layer.stack``) from ``size`` seeds of one case."""
  built = [cases.dense(s, approx="kron") for s in range(size)]
  layer = built[0][0]
  stack = lambda *xs: jnp.stack(xs)  # noqa: E731
  data = jax.tree.map(stack, *[b[1] for b in built])
  params = jax.tree.map(stack, *[b[2] for b in built])
  layer = dataclasses.replace(
      layer, stack=size,
      param_shapes=tuple((size,) + s for s in layer.param_shapes))
  return layer, data._replace(batch_size=built[0][1].batch_size), params


def _config(pair):
  return blocks.BlockConfig(
      exps=(-1,), compute_cholesky=pair not in NO_CHOLESKY,
      compute_cholesky_inverse=pair not in NO_CHOLESKY)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("kind,approx,multi", PAIRS)
def test_every_registered_pair_follows_the_protocol(kind, approx, multi):
  layer, data, params = _case(kind, approx, multi)
  assert layer.kind == kind and (layer.num_uses > 1) == (
      multi or kind == "tied_embedding")
  layer = dataclasses.replace(layer, approx=approx)
  block = blocks.make_block(layer, _config((kind, approx)))
  h.check_protocol(block, data, params, exp1=(kind, approx) not in NO_EXP1,
                   cholesky=(kind, approx) not in NO_CHOLESKY)


@pytest.mark.usefixtures("x64")
def test_stacked_layer_follows_the_protocol():
  layer, data, params = _stacked()
  block = blocks.make_block(layer, _config(None))
  assert isinstance(block, blocks.combinators.VmappedBlock)
  out = h.check_protocol(block, data, params)
  assert out["factors"]["a"].shape == (3, 4, 4)


def test_every_named_factory_resolves():
  for name, row in kinds.KINDS.items():
    for approx, _ in row.factories:
      assert callable(blocks.registered_factory(name, approx)), (name, approx)


def test_capabilities_are_declared_by_the_blocks_that_have_them():
  bucketed = {k: isinstance(blocks.make_block(_case(*k, False)[0]),
                            base.FactorBucketed)
              for k in (("fully_connected", "kron"), ("conv", "kron_sua"),
                        ("fully_connected", "diagonal"),
                        ("separable_conv", "kron"))}
  assert bucketed == {("fully_connected", "kron"): True,
                      ("conv", "kron_sua"): False,
                      ("fully_connected", "diagonal"): False,
                      ("separable_conv", "kron"): False}


# ---------------------------------------------------------------------------
# stats_sync="before_refresh" under pmap, with every kind of state.
# ---------------------------------------------------------------------------


def _separable_loss(params, batch):
  x, y = batch
  dw, pw, b = params["dw"], params["pw"], params["b"]
  c, m = dw.shape[2], dw.shape[3]
  dy = jax.lax.conv_general_dilated(
      x, dw.reshape(dw.shape[:2] + (1, c * m)), (1, 1), "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=c)
  h_ = jnp.einsum("bhwc,co->bhwo", dy, pw[0, 0]) + b
  h_ = kl.register_separable_conv2d(h_, x, dw, pw, dy, b, strides=1,
                                    padding="SAME")
  logits = h_.reshape(h_.shape[0], -1) @ params["w"]
  logits = kl.register_dense(logits, h_.reshape(h_.shape[0], -1),
                             params["w"])
  logits = kl.register_categorical_predictive_distribution(logits, y)
  return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits),
                                       y[:, None], axis=1))


def test_before_refresh_sync_under_pmap_with_a_separable_conv():
  r, n = 2, 8
  rng = np.random.default_rng(0)
  params = {"dw": jnp.asarray(rng.standard_normal((3, 3, 2, 2)), jnp.float32),
            "pw": jnp.asarray(rng.standard_normal((1, 1, 4, 3)), jnp.float32),
            "b": jnp.zeros((3,), jnp.float32),
            "w": jnp.asarray(rng.standard_normal((48, 5)) * 0.1, jnp.float32)}
  x = jnp.asarray(rng.standard_normal((n, 4, 4, 2)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 5, (n,)))
  collection = kl.scan(_separable_loss, params, (x, y))
  assert [l.kind for l in collection.layers] == ["separable_conv",
                                                 "fully_connected"]
  tx = kl.scale_by_kfac(collection, axis_name="d",
                        stats_sync="before_refresh", inverse_update_period=1)

  def step(state, batch):
    grads = jax.lax.pmean(jax.grad(_separable_loss)(params, batch), "d")
    return tx.update(grads, state, params, batch=batch)

  split = lambda a: a.reshape((r, -1) + a.shape[1:])  # noqa: E731
  with helpers.on_replica_devices(r) as devices:
    state = jax.tree.map(lambda a: jnp.stack([a] * r), tx.init(params))
    fn = jax.pmap(step, axis_name="d", devices=devices)
    for _ in range(2):
      direction, state = fn(state, (split(x), split(y)))
  for leaf in jax.tree.leaves((direction, state)):
    assert np.all(np.isfinite(leaf))
    np.testing.assert_array_equal(leaf[1], leaf[0])
