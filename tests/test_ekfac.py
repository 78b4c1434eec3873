"""EK-FAC against explicit constructions (blocks/ekfac.py, docs/ekfac.md).

The reference is the exact empirical Fisher block of one batch,
``F = (1/B) Σ_{s,b} vec∇W_{s,b} vec∇W_{s,b}ᵀ`` from per-example gradients
(``jax.grad`` per example, summed over a layer's uses), and the basis
``U = U_A ⊗ U_G`` of the K-FAC factors of the same batch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import blocks
from kfac_jax_lite.blocks import ekfac
from tests import block_cases as cases
from tests import blocks_helpers as h
from tests import helpers
from tests import problems
from tests.blocks_helpers import x64  # noqa: F401  (fixture)

DAMPING = 0.1


def _fit(block, data, damping=DAMPING):
  """One batch: the factors, a refresh (the basis of this batch's A and G),
  then the scalings of the same batch in that basis (``ema_decay=0``)."""
  @jax.jit  # One program, not hundreds of eager op-by-op compiles.
  def fit():
    stats = block.compute_stats(data)
    state = block.update_curvature(block.init(), stats, 0.95)
    state = block.update_cache(state, damping)
    return block.update_curvature(state, stats, 0.0)
  return fit()


def _explicit_fisher(layer, data, params, fn, conv=False):
  """``(1/B) Σ_{s,b} ∇∇ᵀ`` of the layer, per-example gradients summed over
  its uses and sites (ravel order of the params)."""
  per = 0.0
  for (x,), g in zip(data.inputs, data.grads):
    if conv:   # Uses: [B, U, ...], each a call of the conv.
      for u in range(x.shape[1]):
        per = per + h.per_example_grads(fn, params, x[:, u], g[:, :, u])
    else:
      per = per + h.per_example_grads(fn, params, x, g)
  return np.asarray(h.per_example_fisher(per))


def _basis(block, state):
  """``U_A ⊗ U_G`` with its rows in ravel order of the params."""
  u = np.kron(np.asarray(state.cache["a_eigvec"]),
              np.asarray(state.cache["g_eigvec"]))
  index = block.layout.ravel_index()
  if index is None:
    return u
  out = np.zeros_like(u)
  out[np.asarray(index)] = u
  return out


CASES = {
    "dense": lambda: cases.dense(0, approx="ekfac"),
    "dense_nobias": lambda: cases.dense(1, approx="ekfac", bias=False),
    "dense_multi_use": lambda: cases.dense(2, approx="ekfac", uses=3,
                                           sites=2),
    "conv": lambda: cases.conv(3, approx="ekfac"),
    "conv_oihw": lambda: cases.conv(4, approx="ekfac",
                                    case="nchw_oihw_explicit"),
    "conv_multi_use": lambda: cases.conv(5, approx="ekfac", uses=2),
}


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("name", list(CASES))
def test_scalings_are_the_diagonal_of_the_exact_block_in_the_basis(name):
  layer, data, params, fn = CASES[name]()
  block = h.make_block(layer, exps=(-1, -0.5))
  state = _fit(block, data)
  f = _explicit_fisher(layer, data, params, fn, conv=name.startswith("conv"))
  u = _basis(block, state)
  # U is the eigenbasis of this batch's K-FAC factors.
  kfac = np.kron(np.asarray(state.a), np.asarray(state.g))
  rot = u.T @ _to_ravel(block, kfac) @ u
  np.testing.assert_allclose(rot, np.diag(np.diag(rot)),
                             atol=1e-9 * np.abs(rot).max())
  np.testing.assert_allclose(
      float(state.scale) * np.diag(rot),
      np.asarray(jax.jit(ekfac.kfac_eigenvalues)(state)).reshape(-1),
      rtol=1e-8, atol=1e-10 * np.abs(rot).max())
  # s = diag(Uᵀ F U), and the EK-FAC block is U diag(s) Uᵀ.
  want = np.diag(u.T @ f @ u)
  np.testing.assert_allclose(np.asarray(state.s).reshape(-1), want,
                             rtol=1e-9, atol=1e-12 * want.max())
  ek = np.asarray(jax.jit(block.full_fisher_block)(state))
  np.testing.assert_allclose(ek, u @ np.diag(want) @ u.T,
                             atol=1e-9 * np.abs(f).max())
  # No further from F (Frobenius) than K-FAC's c A ⊗ G; strictly here.
  kfac_full = float(state.scale) * _to_ravel(block, kfac)
  d_ek = np.linalg.norm(ek - f)
  d_kfac = np.linalg.norm(kfac_full - f)
  assert d_ek < d_kfac, (d_ek, d_kfac)
  # And it is the Frobenius-closest matrix diagonal in U: any other
  # scaling of the basis is further away.
  other = u @ np.diag(want * 1.01) @ u.T
  assert np.linalg.norm(other - f) > d_ek


def _to_ravel(block, f):
  index = block.layout.ravel_index()
  return f if index is None else h.to_ravel(f, np.asarray(index))


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("name", ["dense", "dense_multi_use", "conv",
                                  "conv_multi_use"])
def test_products_are_powers_of_the_damped_block(name):
  layer, data, params, _ = CASES[name]()
  block = h.make_block(layer, exps=(-1, -0.5))
  state = _fit(block, data)
  damped = np.asarray(block.full_fisher_block(state)) + DAMPING * np.eye(
      sum(p.size for p in params))
  v = h.random_like(5, params)
  flat = np.asarray(h.ravel(v))
  w, q = np.linalg.eigh(damped)
  for exp in (1, -1, -0.5):
    got = h.ravel(block.multiply_matpower(state, v, exp))
    np.testing.assert_allclose(got, q @ (w ** exp * (q.T @ flat)),
                               rtol=1e-8)
  back = block.multiply(state, block.multiply_inverse(state, v))
  np.testing.assert_allclose(h.ravel(back), flat, rtol=1e-9)
  c = block.multiply_cholesky(state, block.multiply_cholesky(state, v, True))
  np.testing.assert_allclose(h.ravel(c), damped @ flat, rtol=1e-8)


@pytest.mark.usefixtures("x64")
def test_multi_use_scalings_sum_uses_before_squaring():
  """Per example = summed over uses: not the per-position moments."""
  layer, data, params, _ = CASES["dense_multi_use"]()
  block = h.make_block(layer)
  state = _fit(block, data)
  stats = block.compute_stats(data)
  ua, ug = state.cache["a_eigvec"], state.cache["g_eigvec"]
  x, g = np.asarray(stats["x"]), np.asarray(stats["dy"])
  b = x.shape[0]
  per_example = np.einsum("bri,sbrj->sbij", x @ ua, g @ ug)
  np.testing.assert_allclose(state.s, (per_example ** 2).sum((0, 1)) / b,
                             rtol=1e-10)
  per_position = np.einsum("bri,sbrj->ij", (x @ ua) ** 2, (g @ ug) ** 2) / b
  assert not np.allclose(state.s, per_position, rtol=1e-3)


@pytest.mark.usefixtures("x64")
def test_refresh_carries_scalings_into_the_new_basis():
  """At a refresh s becomes diag(U_newᵀ F̂_old U_new): the trace and the
  diagonal of the old EK-FAC matrix in the new basis."""
  layer, data, params, _ = CASES["dense"]()
  block = h.make_block(layer)
  state = _fit(block, data)
  _, data2, _, _ = cases.dense(7, approx="ekfac")
  moved = block.update_curvature(state, block.compute_stats(data2), 0.5)
  before = np.asarray(block.full_fisher_block(moved))
  new = block.update_cache(moved, DAMPING)
  u = _basis(block, new)
  assert not np.allclose(u, _basis(block, state), atol=1e-3)
  np.testing.assert_allclose(np.asarray(new.s).reshape(-1),
                             np.diag(u.T @ before @ u), rtol=1e-9)
  np.testing.assert_allclose(np.trace(np.asarray(
      block.full_fisher_block(new))), np.trace(before), rtol=1e-10)


@pytest.mark.usefixtures("x64")
def test_stacked_layer_follows_the_protocol():
  built = [cases.dense(s, approx="ekfac") for s in range(3)]
  layer = built[0][0]
  stack = lambda *xs: jnp.stack(xs)  # noqa: E731
  data = jax.tree.map(stack, *[b[1] for b in built])
  params = jax.tree.map(stack, *[b[2] for b in built])
  layer = dataclasses.replace(
      layer, stack=3, param_shapes=tuple((3,) + p.shape[1:] for p in params))
  block = h.make_block(layer, compute_cholesky=True,
                       compute_cholesky_inverse=True)
  data = data._replace(batch_size=built[0][1].batch_size)
  assert block.row_stats == ("x", "dy")
  out = h.check_protocol(block, data, params)
  assert out["factors"]["s"].shape == (3, 4, 2)


def test_registry_rows_and_damping_type():
  assert "ekfac" in kl.APPROXIMATIONS["fully_connected"]
  assert "ekfac" in kl.APPROXIMATIONS["fully_connected_multi"]
  assert "ekfac" in kl.APPROXIMATIONS["conv"]
  assert "ekfac" in kl.APPROXIMATIONS["conv_multi"]
  layer = cases.dense(0, approx="ekfac")[0]
  for damping_type in ("pi", "exact"):
    block = h.make_block(layer, damping_type=damping_type)
    assert isinstance(block, ekfac.EKFACBlock)
    assert isinstance(block, blocks.CholeskyProducts)
    assert not isinstance(block, blocks.FactorBucketed)


# ---------------------------------------------------------------------------
# Through scan / FisherEstimator / kfac.
# ---------------------------------------------------------------------------


def _per_example_loss(params, x, y):
  logits, _ = helpers.mlp_forward(params, x[None], tag=False)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y[None])[0]


@pytest.mark.usefixtures("x64")
def test_estimator_empirical_block_is_diag_of_exact_fisher_in_basis():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [5, 6, 3])
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 12, 5, 3)
  params, batch = jax.tree.map(lambda a: a.astype(jnp.float64)
                               if a.dtype == jnp.float32 else a,
                               (params, batch))
  coll = kl.scan(helpers.classifier_loss, params, batch,
                 approximations={"fully_connected": "ekfac"})
  assert {l.approx for l in coll.layers} == {"ekfac"}
  est = kl.FisherEstimator(coll, estimation_mode="empirical", damping=1e-2)
  kest = kl.FisherEstimator(
      kl.scan(helpers.classifier_loss, params, batch),
      estimation_mode="empirical")
  @jax.jit
  def states(params, batch):
    state = est.update_curvature(est.init(params), params, batch)
    state = est.update_cache(state)
    state = est.update_curvature(state, params, batch, ema_decay=0.0)
    kstate = kest.update_curvature(kest.init(params), params, batch)
    return state, kstate

  state, kstate = states(params, batch)
  grads = jax.jit(jax.vmap(jax.grad(_per_example_loss), (None, 0, 0)))(
      params, *batch)
  b = batch[0].shape[0]
  layers = zip(coll.layers, est.blocks, est.per_layer(state),
               kest.blocks, kest.per_layer(kstate))
  for i, (layer, block, st, kblock, kst) in enumerate(layers):
    assert layer.param_paths[0] == f"['layer{i}']['w']"
    g = grads[f"layer{i}"]   # (w, b) per example: the block's ravel order.
    flat = np.concatenate([np.asarray(g["w"]).reshape(b, -1),
                           np.asarray(g["b"])], axis=1)
    fb = flat.T @ flat / b
    u = _basis(block, st)
    np.testing.assert_allclose(np.asarray(st.s).reshape(-1),
                               np.diag(u.T @ fb @ u), rtol=1e-8,
                               atol=1e-12)
    ek = np.asarray(block.full_fisher_block(st))
    kf = np.asarray(kblock.full_fisher_block(kst))
    assert np.linalg.norm(ek - fb) < np.linalg.norm(kf - fb)
  # Damped products through the estimator.
  v = jax.tree.map(lambda p: jnp.ones_like(p), params)
  back = jax.jit(lambda s, v: est.multiply(s, est.multiply_inverse(s, v)))(
      state, v)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(v)):
    np.testing.assert_allclose(a, b, rtol=1e-9)


def _seq_loss(params, batch):
  """A dense layer on [B, T, d] (multi-use) then a per-example readout."""
  x, y = batch
  p = params["seq"]
  hid = kl.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"])
  hid = jnp.tanh(hid).reshape(x.shape[0], -1)
  q = params["out"]
  logits = kl.register_dense(hid @ q["w"], hid, q["w"])
  kl.register_categorical_predictive_distribution(logits, y)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


@pytest.mark.usefixtures("x64")
def test_multi_use_through_scan_is_exact_per_example_summed():
  rng = np.random.default_rng(0)
  params = {"seq": {"w": jnp.asarray(rng.standard_normal((3, 4)) * 0.5),
                    "b": jnp.asarray(rng.standard_normal(4) * 0.1)},
            "out": {"w": jnp.asarray(rng.standard_normal((12, 3)) * 0.3)}}
  batch = (jnp.asarray(rng.standard_normal((10, 3, 3))),
           jnp.asarray(rng.integers(0, 3, 10)))
  coll = kl.scan(_seq_loss, params, batch,
                 approximations={"fully_connected_multi": "ekfac",
                                 "fully_connected": "ekfac"})
  seq = [l for l in coll.layers if l.num_uses == 3]
  assert len(seq) == 1 and seq[0].approx == "ekfac"
  est = kl.FisherEstimator(coll, estimation_mode="empirical")

  @jax.jit  # One program, not hundreds of eager op-by-op compiles.
  def curvature(params, batch):
    state = est.update_curvature(est.init(params), params, batch)
    state = est.update_cache(state)
    return est.update_curvature(state, params, batch, ema_decay=0.0)
  state = curvature(params, batch)

  def one(p, x, y):
    return _seq_loss(p, (x[None], y[None]))

  grads = jax.jit(jax.vmap(jax.grad(one), (None, 0, 0)))(
      params, *batch)["seq"]
  flat = np.concatenate([np.asarray(grads["w"]).reshape(10, -1),
                         np.asarray(grads["b"])], axis=1)
  f = flat.T @ flat / 10
  i = coll.layers.index(seq[0])
  st, block = est.per_layer(state)[i], est.blocks[i]
  u = _basis(block, st)
  want = np.diag(u.T @ f @ u)
  np.testing.assert_allclose(np.asarray(st.s).reshape(-1), want, rtol=1e-8,
                             atol=1e-12)
  np.testing.assert_allclose(jax.jit(block.full_fisher_block)(st),
                             u @ np.diag(want) @ u.T,
                             atol=1e-9 * np.abs(f).max())


def test_kfac_steps_with_ekfac_reduce_the_loss():
  params, batches, _ = problems.small_classifier(1)
  batch = batches[0]
  coll = kl.scan(helpers.classifier_loss, params, batch,
                 approximations={"fully_connected": "ekfac"})
  tx = kl.kfac(0.1, coll)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(helpers.classifier_loss)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(8):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("distributed_inverses", [False, True])
def test_data_parallel_scalings_use_the_global_batch(distributed_inverses):
  """Under pmap (stats_sync="every_update") each replica's rows are
  gathered, not averaged: the state equals one device's on the whole
  batch (also when each device refreshes a share of the layers)."""
  r = 2
  with helpers.on_replica_devices(r) as devices:
    _check_data_parallel_scalings(distributed_inverses, r, devices)


def _check_data_parallel_scalings(distributed_inverses, r, devices):
  params, batches, _ = problems.small_classifier(1)
  batch = batches[0]
  coll = kl.scan(helpers.classifier_loss, params, batch,
                 approximations={"fully_connected": "ekfac"})
  single = kl.FisherEstimator(coll, estimation_mode="empirical")
  multi = dataclasses.replace(single, axis_name="d",
                              distributed_inverses=distributed_inverses)

  def run(est, b):
    s = est.update_curvature(est.init(params), params, b)
    s = est.update_cache(s)
    s = est.update_curvature(s, params, b, ema_decay=0.5)
    # The eigenvectors' signs may differ between programs: compare what
    # does not depend on them.
    return [x.s for x in est.per_layer(s)], est.full_fisher(s)

  want = jax.jit(lambda b: run(single, b))(batch)
  split = jax.tree.map(lambda a: a.reshape((r, -1) + a.shape[1:]), batch)
  got = jax.pmap(lambda b: run(multi, b), axis_name="d",
                 devices=devices)(split)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(b[0], a, rtol=2e-4, atol=1e-6)
    np.testing.assert_array_equal(b[0], b[1])
