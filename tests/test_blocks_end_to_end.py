"""Every new block through the public path: tags, scan, FisherEstimator.

``estimation_mode="empirical"`` makes the statistics deterministic, so the
estimator's Fisher blocks can be compared with explicit ones built from
per-example gradients of the loss. The losses compute in float32, hence the
float32 tolerances.
"""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfac
from tests import blocks_helpers as h

B = 8
RTOL = 2e-4


def _nll(logits, labels):
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def _estimate(loss_fn, params, batch, damping=1e-3, **kwargs):
  collection = kfac.scan(loss_fn, params, batch)
  est = kfac.FisherEstimator(collection, estimation_mode="empirical",
                             damping=damping, **kwargs)

  @jax.jit
  def run(params, v):
    state = est.init(params)
    state = est.update_curvature(state, params, batch,
                                 jax.random.PRNGKey(0))
    state = est.update_cache(state)
    mi = est.multiply_inverse(state, v)
    return state, est.full_fisher(state), mi, est.multiply(state, mi)

  v = jax.tree.map(lambda x: jnp.asarray(
      np.random.default_rng(1).standard_normal(x.shape), x.dtype), params)
  state, full, mi, back = run(params, v)
  np.testing.assert_allclose(h.ravel(jax.tree.leaves(back)),
                             h.ravel(jax.tree.leaves(v)), rtol=1e-3,
                             atol=1e-3)
  return collection, state, np.asarray(full)


def _per_example_fisher(loss_fn, params, batch):
  """Exact empirical Fisher ``(1/B) Σ_b ∇ℓ_b ∇ℓ_bᵀ`` of the mean loss."""
  def one(example):
    ex = jax.tree.map(lambda x: x[None], example)
    g = jax.grad(loss_fn)(params, ex)
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(g)])
  grads = jax.jit(jax.vmap(one))(batch)
  return np.asarray(grads.T @ grads / grads.shape[0])


def _assert_close(got, want):
  np.testing.assert_allclose(got, want, rtol=RTOL,
                             atol=RTOL * np.abs(want).max())


def _rng(seed):
  return np.random.default_rng(seed)


# ---------------------------------------------------------------------------
# Convolutions.
# ---------------------------------------------------------------------------

CONV = dict(window_strides=(2, 1), padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _conv_problem(approx):
  r = _rng(0)
  params = {"w": jnp.asarray(r.standard_normal((2, 3, 2, 3)), jnp.float32),
            "b": jnp.asarray(r.standard_normal(3), jnp.float32)}
  batch = {"x": jnp.asarray(r.standard_normal((B, 5, 4, 2)), jnp.float32),
           "y": jnp.asarray(r.integers(0, 3, B))}

  def loss_fn(p, batch):
    x = batch["x"]
    y = lax.conv_general_dilated(x, p["w"], **CONV) + p["b"][None, None, None]
    y = kfac.register_conv(y, x, p["w"], p["b"], approx=approx, **CONV)
    logits = jnp.mean(y, axis=(1, 2))
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  return loss_fn, params, batch


def _conv_output_grads(loss_fn, params, batch):
  """Per-example ∂ℓ_b/∂y as ``[B, L, O]`` (y = conv output)."""
  x = batch["x"]
  y = lax.conv_general_dilated(x, params["w"], **CONV)
  y = y + params["b"][None, None, None]
  g = jax.vmap(jax.grad(lambda yb, lb: _nll(
      jnp.mean(yb, axis=(0, 1))[None], lb[None])[0]))(y, batch["y"])
  return np.asarray(g).reshape(B, -1, g.shape[-1])


def _conv_patches(x, w_shape):
  jac = jax.jit(jax.jacfwd(lambda w: lax.conv_general_dilated(
      x, w, **CONV)[..., 0]))(jnp.zeros(w_shape, x.dtype))[..., 0]
  p = np.asarray(jac).reshape(x.shape[0], -1, int(np.prod(w_shape[:3])))
  return np.concatenate([p, np.ones(p.shape[:2] + (1,))], axis=-1)


@pytest.mark.parametrize("approx", ["kron", "kron_sua", "diagonal"])
def test_conv(approx):
  loss_fn, params, batch = _conv_problem(approx)
  collection, state, full = _estimate(loss_fn, params, batch)
  (layer,) = collection.layers
  assert (layer.kind, layer.approx) == ("conv", approx)
  if approx == "diagonal":
    want = np.diag(np.diag(_per_example_fisher(loss_fn, params, batch)))
    # ravel_pytree orders the dict as (b, w); the block is (w, b).
    _assert_close(full, want)
    return
  g = _conv_output_grads(loss_fn, params, batch)
  n = g.shape[0] * g.shape[1]
  gamma = np.einsum("nlo,nlp->op", g, g) / n
  if approx == "kron":
    p = _conv_patches(batch["x"], params["w"].shape)
    omega = np.einsum("nlp,nlq->pq", p, p) / n
  else:
    pos = np.asarray(batch["x"]).reshape(-1, 2)
    mu, sigma = pos.mean(0), np.cov(pos.T, bias=True)
    mbar = np.append(np.tile(mu, 6), 1.0)
    omega = np.pad(np.kron(np.eye(6), sigma), ((0, 1), (0, 1)))
    omega = omega + np.outer(mbar, mbar)
  block = (n / B) * np.kron(omega, gamma)
  # Leaves are ordered (b, w) in the full Fisher; the block is (w, b).
  nw = params["w"].size
  perm = np.r_[nw:nw + 3, 0:nw]
  _assert_close(full, block[perm][:, perm])


def test_conv_used_twice_is_kron_indep():
  r = _rng(1)
  params = {"w": jnp.asarray(r.standard_normal((3, 3, 2, 2)) / 3, jnp.float32)}
  batch = {"x": jnp.asarray(r.standard_normal((B, 4, 4, 2)), jnp.float32),
           "y": jnp.asarray(r.integers(0, 2, B))}
  conv = dict(window_strides=(1, 1), padding="SAME",
              dimension_numbers=("NHWC", "HWIO", "NHWC"))

  def loss_fn(p, batch):
    h1 = batch["x"]
    for _ in range(2):
      y = lax.conv_general_dilated(h1, p["w"], **conv)
      h1 = jnp.tanh(kfac.register_conv(y, h1, p["w"], **conv))
    logits = jnp.mean(h1, axis=(1, 2))
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  collection, state, _ = _estimate(loss_fn, params, batch)
  (layer,) = collection.layers
  assert (layer.approx, layer.num_uses) == ("kron_indep", 2)
  assert float(state.blocks[0].scale) == 2 * 16   # uses x locations


def test_depthwise_kron():
  r = _rng(2)
  kh, kw, c, m = 2, 2, 3, 2
  params = {"w": jnp.asarray(r.standard_normal((kh, kw, c, m)), jnp.float32)}
  batch = {"x": jnp.asarray(r.standard_normal((B, 4, 5, c)), jnp.float32),
           "y": jnp.asarray(r.integers(0, c * m, B))}
  dn = ("NHWC", "HWIO", "NHWC")

  def depthwise(x, w):
    return lax.conv_general_dilated(x, w.reshape(kh, kw, 1, c * m), (1, 1),
                                    "SAME", dimension_numbers=dn,
                                    feature_group_count=c)

  def loss_fn(p, batch):
    y = kfac.register_depthwise_conv2d(depthwise(batch["x"], p["w"]),
                                       batch["x"], p["w"], strides=(1, 1),
                                       padding="SAME", approx="kron")
    logits = jnp.mean(y, axis=(1, 2))
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  collection, state, full = _estimate(loss_fn, params, batch)
  assert collection.layers[0].kind == "depthwise_conv"
  # Patches of channel k: ∂y[..., k·M] / ∂w[:, :, k, 0].
  jac = jax.jit(jax.jacfwd(lambda w: depthwise(batch["x"], w)))(params["w"])
  jac = np.asarray(jac).reshape(B, 20, c, m, kh * kw, c, m)
  patches = np.stack([jac[:, :, k, 0, :, k, 0] for k in range(c)])
  y = depthwise(batch["x"], params["w"])
  g = np.asarray(jax.vmap(jax.grad(lambda yb, lb: _nll(
      jnp.mean(yb, axis=(0, 1))[None], lb[None])[0]))(y, batch["y"]))
  g = g.reshape(B * 20, c, m)
  n = B * 20
  want = np.zeros_like(full)
  for k in range(c):
    p = patches[k].reshape(n, -1)
    block = 20 * np.kron(p.T @ p / n, g[:, k].T @ g[:, k] / n)
    idx = (np.arange(kh * kw)[:, None] * c * m + k * m +
           np.arange(m)[None]).reshape(-1)
    want[np.ix_(idx, idx)] = block
  _assert_close(full, want)


def test_separable():
  r = _rng(3)
  params = {"dw": jnp.asarray(r.standard_normal((2, 2, 2, 2)), jnp.float32),
            "pw": jnp.asarray(r.standard_normal((1, 1, 4, 3)), jnp.float32),
            "pb": jnp.asarray(r.standard_normal(3), jnp.float32)}
  batch = {"x": jnp.asarray(r.standard_normal((B, 4, 4, 2)), jnp.float32),
           "y": jnp.asarray(r.integers(0, 3, B))}
  dn = ("NHWC", "HWIO", "NHWC")

  def loss_fn(p, batch):
    x = batch["x"]
    dy = lax.conv_general_dilated(x, p["dw"].reshape(2, 2, 1, 4), (1, 1),
                                  "VALID", dimension_numbers=dn,
                                  feature_group_count=2)
    y = lax.conv_general_dilated(dy, p["pw"], (1, 1), "VALID",
                                 dimension_numbers=dn)
    y = y + p["pb"][None, None, None]
    y = kfac.register_separable_conv2d(y, x, p["dw"], p["pw"], dy, p["pb"],
                                       strides=(1, 1), padding="VALID")
    logits = jnp.mean(y, axis=(1, 2))
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  collection, state, full = _estimate(loss_fn, params, batch)
  assert (collection.layers[0].kind, collection.layers[0].approx) == (
      "separable_conv", "kron")
  exact = _per_example_fisher(loss_fn, params, batch)
  # Leaves in ravel order: dw (16), pb (3), pw (12); the block is
  # blockdiag(diag of the exact dw block, KFC of the 1x1 conv on dy).
  dw = slice(0, 16)
  _assert_close(full[dw, dw], np.diag(np.diag(exact[dw, dw])))
  assert np.all(full[dw, 16:] == 0)
  x = batch["x"]
  dy = lax.conv_general_dilated(x, params["dw"].reshape(2, 2, 1, 4), (1, 1),
                                "VALID", dimension_numbers=dn,
                                feature_group_count=2)
  y = lax.conv_general_dilated(dy, params["pw"], (1, 1), "VALID",
                               dimension_numbers=dn)
  y = y + params["pb"][None, None, None]
  g = np.asarray(jax.vmap(jax.grad(lambda yb, lb: _nll(
      jnp.mean(yb, axis=(0, 1))[None], lb[None])[0]))(y, batch["y"]))
  g = g.reshape(-1, 3)
  a = np.asarray(dy).reshape(-1, 4)
  a = np.concatenate([a, np.ones((a.shape[0], 1))], axis=1)
  n = a.shape[0]
  pw = (n / B) * np.kron(a.T @ a / n, g.T @ g / n)   # order (pw, pb)
  perm = np.r_[12:15, 0:12]                         # ravel order (pb, pw)
  _assert_close(full[16:, 16:], pw[perm][:, perm])


# ---------------------------------------------------------------------------
# Embeddings, scale-and-shift, dense diagonal / full, generic full.
# ---------------------------------------------------------------------------


def test_embedding():
  r = _rng(4)
  vocab, dim = 7, 3
  params = {"table": jnp.asarray(r.standard_normal((vocab, dim)),
                                 jnp.float32)}
  out_w = jnp.asarray(r.standard_normal((dim, 4)), jnp.float32)
  batch = {"ids": jnp.asarray(r.integers(0, vocab, B)),
           "y": jnp.asarray(r.integers(0, 4, B))}

  def loss_fn(p, batch):
    e = kfac.register_embedding(p["table"][batch["ids"]], batch["ids"],
                                p["table"])
    logits = e @ out_w
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  collection, state, full = _estimate(loss_fn, params, batch)
  (layer,) = collection.layers
  assert (layer.kind, layer.approx) == ("embedding", "kron")
  e = params["table"][batch["ids"]]
  g = np.asarray(jax.vmap(jax.grad(lambda eb, yb: _nll(
      (eb @ out_w)[None], yb[None])[0]))(e, batch["y"]))
  counts = np.bincount(np.asarray(batch["ids"]), minlength=vocab) / B
  _assert_close(full, np.kron(np.diag(counts), g.T @ g / B))


def test_embedding_with_several_ids_per_example():
  r = _rng(5)
  params = {"table": jnp.asarray(r.standard_normal((6, 2)), jnp.float32)}
  batch = {"ids": jnp.asarray(r.integers(0, 6, (B, 3))),
           "y": jnp.asarray(r.integers(0, 2, B))}

  def loss_fn(p, batch):
    e = kfac.register_embedding(p["table"][batch["ids"]], batch["ids"],
                                p["table"])
    logits = jnp.sum(e, axis=1)
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  collection, state, _ = _estimate(loss_fn, params, batch)
  (layer,) = collection.layers
  assert (layer.approx, layer.num_uses) == ("kron_indep", 3)
  counts = np.bincount(np.asarray(batch["ids"]).ravel(), minlength=6)
  _assert_close(np.asarray(state.blocks[0].a), counts / (3 * B))


def test_scale_and_shift_full():
  r = _rng(6)
  params = {"scale": jnp.asarray(r.standard_normal(3), jnp.float32),
            "shift": jnp.asarray(r.standard_normal(3), jnp.float32)}
  batch = {"x": jnp.asarray(r.standard_normal((B, 4, 3)), jnp.float32),
           "y": jnp.asarray(r.integers(0, 3, B))}

  def loss_fn(p, batch):
    x = batch["x"]
    xn = (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + 1e-3)
    y = xn * p["scale"][None, None] + p["shift"][None, None]
    y = kfac.register_scale_and_shift(y, xn, p["scale"], p["shift"])
    logits = jnp.sum(jnp.tanh(y), axis=1)
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  collection, _, full = _estimate(loss_fn, params, batch)
  assert collection.layers[0].approx == "full"
  _assert_close(full, _per_example_fisher(loss_fn, params, batch))


@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_dense_per_example_blocks(approx):
  r = _rng(7)
  params = {"w": jnp.asarray(r.standard_normal((3, 4)), jnp.float32),
            "b": jnp.asarray(r.standard_normal(4), jnp.float32)}
  batch = {"x": jnp.asarray(r.standard_normal((B, 3)), jnp.float32),
           "y": jnp.asarray(r.integers(0, 4, B))}

  def loss_fn(p, batch):
    logits = kfac.register_dense(batch["x"] @ p["w"] + p["b"][None],
                                 batch["x"], p["w"], p["b"], approx=approx)
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  _, _, full = _estimate(loss_fn, params, batch)
  exact = _per_example_fisher(loss_fn, params, batch)
  _assert_close(full, exact if approx == "full" else np.diag(np.diag(exact)))


def test_generic_full_is_square_of_the_mean_gradient():
  r = _rng(8)
  params = {"a": jnp.asarray(r.standard_normal(3), jnp.float32)}
  batch = {"x": jnp.asarray(r.standard_normal((B, 3)), jnp.float32),
           "y": jnp.asarray(r.integers(0, 2, B))}

  def loss_fn(p, batch):
    a = kfac.register_generic(p["a"], approx="full")
    logits = jnp.stack([batch["x"] @ a, -(batch["x"] ** 2) @ a], axis=-1)
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  _, _, full = _estimate(loss_fn, params, batch)
  g = np.asarray(jax.grad(loss_fn)(params, batch)["a"])
  _assert_close(full, B * np.outer(g, g))


# ---------------------------------------------------------------------------
# Multi-use dense with temporal structure.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("approx", ["kron_series_1", "kron_series_2"])
def test_rnn_series(approx):
  r = _rng(9)
  t, d, hdim = 4, 2, 3
  params = {"w": jnp.asarray(r.standard_normal((d, hdim)), jnp.float32),
            "u": jnp.asarray(r.standard_normal((hdim, hdim)) / 2,
                             jnp.float32)}
  xs = np.cumsum(r.standard_normal((B, t, d)), axis=1)   # correlated in time
  batch = {"x": jnp.asarray(xs, jnp.float32),
           "y": jnp.asarray(r.integers(0, hdim, B))}

  def loss_fn(p, batch):
    def step(hid, x_t):
      pre = kfac.register_dense(x_t @ p["w"], x_t, p["w"])
      return jnp.tanh(pre + hid @ p["u"]), None
    hid, _ = lax.scan(step, jnp.zeros((B, hdim)),
                      jnp.moveaxis(batch["x"], 1, 0))
    kfac.register_categorical_predictive_distribution(hid, batch["y"])
    return jnp.mean(_nll(hid, batch["y"]))

  collection = kfac.scan(loss_fn, params, batch,
                         approximations={"fully_connected_multi": approx})
  layer = collection.layer("['w']")
  assert (layer.approx, layer.num_uses) == (approx, t)
  est = kfac.FisherEstimator(collection, estimation_mode="empirical")
  state = jax.jit(lambda p: est.update_cache(est.update_curvature(
      est.init(p), p, batch, jax.random.PRNGKey(0))))(params)
  block_state = state.blocks[collection.layers.index(layer)]
  n = B * t
  _assert_close(np.asarray(block_state.a0),
                np.einsum("btd,bte->de", xs, xs) / n)
  _assert_close(np.asarray(block_state.a1),
                np.einsum("btd,bte->de", xs[:, 1:], xs[:, :-1]) / n)
  v = jax.tree.map(jnp.ones_like, params)
  out = est.multiply_inverse(state, v)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))


# ---------------------------------------------------------------------------
# All families at once through the optax transform.
# ---------------------------------------------------------------------------


def test_kfac_steps_with_every_block_family():
  """conv kron + SUA, depthwise kron, embedding, scale-and-shift, a
  kron_series_2 RNN and dense layers in one model: kfac() trains it."""
  r = _rng(10)
  f32 = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)  # noqa
  params = {"c1": f32(3, 3, 2, 4), "c2": f32(3, 3, 4, 4), "dw": f32(3, 3, 4, 2),
            "emb": f32(10, 8), "scale": f32(8), "shift": f32(8),
            "w": f32(8, 8), "u": f32(8, 8) * 0.3, "out": f32(8, 5)}
  batch = {"x": f32(B, 6, 6, 2), "ids": jnp.asarray(r.integers(0, 10, (B, 3))),
           "y": jnp.asarray(r.integers(0, 5, B))}
  dn = ("NHWC", "HWIO", "NHWC")

  def conv(x, w, stride, approx=None, groups=1):
    y = lax.conv_general_dilated(x, w, stride, "SAME", dimension_numbers=dn,
                                 feature_group_count=groups)
    return kfac.register_conv(y, x, w, window_strides=stride, padding="SAME",
                              dimension_numbers=dn, approx=approx)

  def loss_fn(p, batch):
    h1 = jnp.tanh(conv(batch["x"], p["c1"], (1, 1)))
    h2 = jnp.tanh(conv(h1, p["c2"], (2, 2), approx="kron_sua"))
    d = lax.conv_general_dilated(h2, p["dw"].reshape(3, 3, 1, 8), (1, 1),
                                 "SAME", dimension_numbers=dn,
                                 feature_group_count=4)
    d = kfac.register_depthwise_conv2d(d, h2, p["dw"], strides=(1, 1),
                                       padding="SAME", approx="kron")
    e = kfac.register_embedding(p["emb"][batch["ids"]], batch["ids"],
                                p["emb"])
    e = e.mean(1) + jnp.mean(d, axis=(1, 2))
    xn = (e - e.mean(-1, keepdims=True)) / (e.std(-1, keepdims=True) + 1e-3)
    e = kfac.register_scale_and_shift(
        xn * p["scale"][None] + p["shift"][None], xn, p["scale"], p["shift"])

    def step(hid, _):
      pre = kfac.register_dense(e @ p["w"], e, p["w"])
      return jnp.tanh(pre + hid @ p["u"]), None

    hid, _ = lax.scan(step, jnp.zeros((B, 8)), None, length=3)
    logits = kfac.register_dense(hid @ p["out"], hid, p["out"])
    kfac.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(_nll(logits, batch["y"]))

  collection = kfac.scan(loss_fn, params, batch, approximations={
      "fully_connected_multi": "kron_series_2"})
  kinds = {(layer.kind, layer.approx) for layer in collection.layers}
  assert {("conv", "kron"), ("conv", "kron_sua"), ("depthwise_conv", "kron"),
          ("embedding", "kron_indep"), ("scale_and_shift", "full"),
          ("fully_connected", "kron_series_2")} <= kinds
  tx = kfac.kfac(1e-2, collection, damping=1e-2, inverse_update_period=1)

  @jax.jit
  def update(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  losses = []
  for _ in range(4):
    params, state, loss = update(params, state)
    losses.append(float(loss))
  assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses
