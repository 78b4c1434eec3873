"""Automatic layer recognition (scan(..., auto_register=True)).

Each model test asserts the exact layers (kind, uses, approximation, how
found, parameter paths), checks what ``perturbed_fn`` records for the
blocks where the layout matters, and runs one jitted ``kfac`` update whose
result must be finite.
"""

import time

import flax.linen as nn
from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import scanner
from kfac_jax_lite import tags

B = 4


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------


def _ce(logits, labels):
  logits = kl.register_categorical_predictive_distribution(logits, labels)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _linen(model, x, labels, **apply_kw):
  """(loss_fn, variables, batch) for a linen model whose output is logits."""
  params = jax.jit(lambda k, x: model.init(k, x, **apply_kw))(
      jax.random.PRNGKey(0), x)

  def loss_fn(params, batch):
    return _ce(model.apply(params, batch[0], **apply_kw), batch[1])

  return loss_fn, params, (x, labels)


def _summary(collection):
  return [(l.kind, l.num_uses, l.approx, l.found_by)
          for l in collection.layers]


def _paths(collection):
  return [l.param_paths for l in collection.layers]


def _update(loss_fn, params, batch, collection, has_aux=False):
  """One jitted kfac update; returns the updates after checking them."""
  tx = kl.kfac(1e-3, collection)

  @jax.jit  # One program, not hundreds of eager op-by-op compiles.
  def step(p, b):
    grads = jax.grad(loss_fn, has_aux=has_aux)(p, b)
    grads = grads[0] if has_aux else grads
    return tx.update(grads, tx.init(p), p, batch=b)
  updates, _ = step(params, batch)
  leaves = jax.tree.leaves(updates)
  assert all(bool(np.all(np.isfinite(u))) for u in leaves)
  assert any(bool(np.any(np.asarray(u) != 0)) for u in leaves)
  return updates


def _records(collection, params, batch):
  """``{site.key: (site, recorded inputs)}`` from one perturbed evaluation."""
  traced = scanner.perturbed_fn(collection, params, batch)
  _, (_, records, _, _) = jax.jit(traced.fn)(params, traced.eps)
  return {s.key: (s, records[s.key]) for s in traced.sites}


def _empirical_state(collection, params, batch, exps=(-1,)):
  """Estimator and state after one empirical-Fisher update (jitted)."""
  est = kl.FisherEstimator(collection, estimation_mode="empirical", exps=exps)

  @jax.jit
  def fn(params, batch):
    state = est.update_curvature(est.init(params), params, batch,
                                 jax.random.PRNGKey(0))
    return est.update_cache(state)

  return est, fn(params, batch)


def _empirical_fisher(collection, params, batch):
  est, state = _empirical_state(collection, params, batch)
  return jax.jit(est.full_fisher)(state)


def _x(*shape, seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _labels(*shape, n=3):
  return jnp.asarray(
      (np.arange(int(np.prod(shape))).reshape(shape) % n).astype(np.int32))


# ---------------------------------------------------------------------------
# Dense layers: linen, nnx, plain JAX.
# ---------------------------------------------------------------------------


class _LinenMLP(nn.Module):
  use_bias: bool
  act: str

  @nn.compact
  def __call__(self, x):
    act = {"relu": nn.relu, "gelu": nn.gelu}[self.act]
    x = act(nn.Dense(8, use_bias=self.use_bias)(x))
    x = act(nn.Dense(8, use_bias=self.use_bias)(x))
    return nn.Dense(3, use_bias=self.use_bias)(x)


@pytest.mark.parametrize("act,use_bias", [
    ("relu", True), ("gelu", False),
    pytest.param("relu", False, marks=pytest.mark.slow),
    pytest.param("gelu", True, marks=pytest.mark.slow)])
def test_linen_mlp(use_bias, act):
  loss_fn, params, batch = _linen(_LinenMLP(use_bias, act), _x(B, 5),
                                  _labels(B))
  c = kl.scan(loss_fn, params, batch, strict=True)
  assert _summary(c) == [("fully_connected", 1, "kron", "auto")] * 3
  names = ("kernel", "bias") if use_bias else ("kernel",)
  assert _paths(c) == [tuple(f"['params']['Dense_{i}']['{n}']" for n in names)
                       for i in range(3)]
  _update(loss_fn, params, batch, c)


class _NnxMLP(nnx.Module):

  def __init__(self, use_bias, rngs):
    self.l1 = nnx.Linear(5, 8, use_bias=use_bias, rngs=rngs)
    self.l2 = nnx.Linear(8, 3, use_bias=use_bias, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.gelu(self.l1(x)))


@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_mlp(use_bias):
  graphdef, state = nnx.split(_NnxMLP(use_bias, nnx.Rngs(0)), nnx.Param)

  def loss_fn(state, batch):
    return _ce(nnx.merge(graphdef, state)(batch[0]), batch[1])

  batch = (_x(B, 5), _labels(B))
  c = kl.scan(loss_fn, state, batch, strict=True)
  assert _summary(c) == [("fully_connected", 1, "kron", "auto")] * 2
  names = ("kernel", "bias") if use_bias else ("kernel",)
  assert _paths(c) == [tuple(f"['{l}']['{n}']" for n in names)
                       for l in ("l1", "l2")]
  _update(loss_fn, state, batch, c)


def _plain_mlp(tagged):
  """A plain-JAX MLP, optionally with manual tags on every layer."""
  def loss_fn(p, batch):
    x, y = batch
    h = x @ p["w1"] + p["b1"]
    if tagged:
      h = kl.register_dense(h, x, p["w1"], p["b1"])
    a = jnp.tanh(h)
    out = a @ p["w2"]
    if tagged:
      out = kl.register_dense(out, a, p["w2"])
    return _ce(out, y)
  params = {"w1": _x(5, 6, seed=1), "b1": _x(6, seed=2),
            "w2": _x(6, 3, seed=3)}
  return loss_fn, params, (_x(B, 5), _labels(B))


def test_auto_matches_manual_tags():
  """Auto-registration finds the tagged layers with the same statistics."""
  loss_auto, params, batch = _plain_mlp(tagged=False)
  loss_tag, _, _ = _plain_mlp(tagged=True)
  auto = kl.scan(loss_auto, params, batch)
  manual = kl.scan(loss_tag, params, batch)
  assert [(l.kind, l.num_uses, l.approx, l.param_paths) for l in auto.layers
         ] == [(l.kind, l.num_uses, l.approx, l.param_paths)
               for l in manual.layers]
  assert {l.found_by for l in auto.layers} == {"auto"}
  assert {l.found_by for l in manual.layers} == {"tag"}
  f_auto = _empirical_fisher(auto, params, batch)
  f_manual = _empirical_fisher(manual, params, batch)
  assert float(jnp.max(jnp.abs(f_auto))) > 0
  np.testing.assert_allclose(f_auto, f_manual, rtol=1e-5, atol=1e-7)


def test_auto_fisher_is_kron_of_explicit_moments():
  """The auto dense factors are the explicit moments of inputs and grads."""
  loss_fn, params, batch = _plain_mlp(tagged=False)
  c = kl.scan(loss_fn, params, batch)
  _, state = _empirical_state(c, params, batch)
  x, y = batch

  def per_example_logits_grad(p, x1, y1):
    h = x1 @ p["w1"] + p["b1"]
    return jax.grad(lambda h: _ce(jnp.tanh(h)[None] @ p["w2"], y1[None]))(h)

  g = jax.vmap(per_example_logits_grad, (None, 0, 0))(params, x, y)
  a = jnp.concatenate([x, jnp.ones((B, 1))], axis=1)
  np.testing.assert_allclose(state.blocks[0].a, a.T @ a / B, rtol=1e-5)
  np.testing.assert_allclose(state.blocks[0].g, g.T @ g / B, rtol=1e-4,
                             atol=1e-7)


def test_manual_tags_win_and_approximations_override():
  def loss_fn(p, batch):
    x, y = batch
    h = kl.register_dense(x @ p["w1"], x, p["w1"], approx="kron_in_diag")
    return _ce(jnp.tanh(h) @ p["w2"], y)
  params = {"w1": _x(5, 6), "w2": _x(6, 3)}
  batch = (_x(B, 5), _labels(B))
  c = kl.scan(loss_fn, params, batch)
  assert _summary(c) == [("fully_connected", 1, "kron_in_diag", "tag"),
                         ("fully_connected", 1, "kron", "auto")]
  c = kl.scan(loss_fn, params, batch,
              approximations={"fully_connected": "kron_out_diag"})
  assert _summary(c) == [("fully_connected", 1, "kron_in_diag", "tag"),
                         ("fully_connected", 1, "kron_out_diag", "auto")]
  _update(loss_fn, params, batch, c)


def test_auto_register_false_leaves_generic():
  loss_fn, params, batch = _plain_mlp(tagged=False)
  c = kl.scan(loss_fn, params, batch, auto_register=False)
  assert _summary(c) == [("generic", 1, "diagonal", "leftover")] * 3
  assert "auto_register=False" in c.describe()


# ---------------------------------------------------------------------------
# Looking through casts, jit, remat, custom_vjp, cond.
# ---------------------------------------------------------------------------


class _Remat(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.remat(nn.Dense)(6)(x)))


class _BF16(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(6, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)
    return nn.Dense(3, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                    use_bias=False)(nn.relu(h)).astype(jnp.float32)


class _InnerJit(nn.Module):

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(6)
    h = jax.jit(lambda x: x * 2.0)(x)  # An unrelated jit, then a jitted layer.
    w = self.param("w", nn.initializers.lecun_normal(), (6, 3))
    h = nn.relu(dense(h))
    return jax.jit(lambda h, w: h @ w)(h, w)


@pytest.mark.parametrize("model", [_Remat(), _BF16(), _InnerJit()],
                         ids=["remat", "bf16", "inner_jit"])
def test_looks_through_remat_casts_and_jit(model):
  loss_fn, params, batch = _linen(model, _x(B, 5), _labels(B))
  c = kl.scan(loss_fn, params, batch, strict=True)
  assert _summary(c) == [("fully_connected", 1, "kron", "auto")] * 2
  records = _records(c, params, batch)
  assert [r[0].shape for _, r in records.values()] == [(B, 5), (B, 6)]
  _update(loss_fn, params, batch, c)


def test_custom_vjp_layer():
  @jax.custom_vjp
  def matmul(x, w):
    return x @ w
  matmul.defvjp(lambda x, w: (x @ w, (x, w)),
                lambda res, g: (g @ res[1].T, res[0].T @ g))

  def loss_fn(p, batch):
    return _ce(matmul(jnp.tanh(batch[0] @ p["w1"]), p["w2"]), batch[1])
  params = {"w1": _x(5, 6), "w2": _x(6, 3)}
  batch = (_x(B, 5), _labels(B))
  c = kl.scan(loss_fn, params, batch, strict=True)
  assert _summary(c) == [("fully_connected", 1, "kron", "auto")] * 2
  _update(loss_fn, params, batch, c)


def test_cond_branches_are_one_use():
  """A layer in both branches of a cond is one use with that branch's data."""
  def model(p, x, with_cond):
    h = jnp.tanh(x @ p["w1"])
    if not with_cond:
      return h @ p["w2"]
    return lax.cond(jnp.sum(x) > 1e9, lambda h: 0.5 * (h @ p["w2"]),
                    lambda h: h @ p["w2"], h)
  params = {"w1": _x(5, 6), "w2": _x(6, 3)}
  batch = (_x(B, 5), _labels(B))
  fisher = []
  for with_cond in (False, True):
    loss_fn = lambda p, b, c=with_cond: _ce(model(p, b[0], c), b[1])  # noqa: E731
    c = kl.scan(loss_fn, params, batch, strict=True)
    assert _summary(c) == [("fully_connected", 1, "kron", "auto")] * 2
    fisher.append(_empirical_fisher(c, params, batch))
  np.testing.assert_allclose(fisher[0], fisher[1], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# Convolutions (no conv block in this branch: collection and records).
# ---------------------------------------------------------------------------


class _CNN(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3), strides=2)(x))
    x = nn.relu(nn.Conv(5, (3, 3), use_bias=False, padding="VALID",
                        kernel_dilation=1)(x))
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


@pytest.mark.slow
def test_linen_cnn():
  loss_fn, params, batch = _linen(_CNN(), _x(B, 8, 8, 3), _labels(B))
  c = kl.scan(loss_fn, params, batch, strict=True)
  assert _summary(c) == [("conv", 1, "kron", "auto"),
                         ("conv", 1, "kron", "auto"),
                         ("fully_connected", 1, "kron", "auto")]
  assert _paths(c) == [("['params']['Conv_0']['kernel']",
                        "['params']['Conv_0']['bias']"),
                       ("['params']['Conv_1']['kernel']",),
                       ("['params']['Dense_0']['kernel']",
                        "['params']['Dense_0']['bias']")]
  nhwc = ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))
  assert c.layers[0].meta_dict == tags.conv_meta_kwargs(
      window_strides=(2, 2), padding=((0, 1), (0, 1)), rhs_dilation=(1, 1),
      lhs_dilation=(1, 1), dimension_numbers=nhwc)
  assert c.layers[1].meta_dict["padding"] == ((0, 0), (0, 0))
  shapes = [(s.kind, [r.shape for r in rec], s.y_aval.shape)
            for s, rec in _records(c, params, batch).values()]
  assert shapes == [("conv", [(B, 8, 8, 3)], (B, 4, 4, 4)),
                    ("conv", [(B, 4, 4, 4)], (B, 2, 2, 5)),
                    ("fully_connected", [(B, 20)], (B, 3))]
  _update(loss_fn, params, batch, c)


def test_conv_meta_equals_register_conv():
  """A recognised conv stores what register_conv stores for its arguments."""
  conv = dict(window_strides=(1, 2), padding=((1, 1), (2, 0)),
              rhs_dilation=(2, 1), lhs_dilation=(1, 1),
              dimension_numbers=("NHWC", "HWIO", "NHWC"))

  def make(tagged):
    def loss_fn(p, batch):
      x = batch[0]
      y = lax.conv_general_dilated(x, p["w"], **conv)
      if tagged:
        dn = lax.conv_dimension_numbers(x.shape, p["w"].shape,
                                        conv["dimension_numbers"])
        y = kl.register_conv(y, x, p["w"], **dict(conv, dimension_numbers=dn))
      return _ce(y.reshape(y.shape[0], -1), batch[1])
    return loss_fn

  params = {"w": _x(3, 3, 2, 2)}
  batch = (_x(B, 6, 6, 2), _labels(B))
  auto = kl.scan(make(False), params, batch, strict=True)
  manual = kl.scan(make(True), params, batch, strict=True)
  assert auto.layers[0].kind == manual.layers[0].kind == "conv"
  assert auto.layers[0].found_by == "auto"
  assert auto.layers[0].meta == manual.layers[0].meta
  # ... and the same statistics.
  _, s_auto = _empirical_state(auto, params, batch)
  _, s_manual = _empirical_state(manual, params, batch)
  for a, m in zip(jax.tree.leaves(s_auto), jax.tree.leaves(s_manual)):
    np.testing.assert_allclose(a, m, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("groups", [1, 4, 2])
def test_conv1d_depthwise_and_grouped(groups):
  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.Conv(8, (3,), feature_group_count=groups)(x)
      return nn.Dense(3)(x.mean(axis=1))

  loss_fn, params, batch = _linen(Net(), _x(B, 7, 4), _labels(B))
  c = kl.scan(loss_fn, params, batch)
  dense = ("fully_connected", 1, "kron", "auto")
  if groups == 1:
    assert _summary(c) == [("conv", 1, "kron", "auto"), dense]
  elif groups == 4:  # feature_group_count == C_in: depthwise.
    assert _summary(c) == [("depthwise_conv", 1, "diagonal", "auto"), dense]
    assert c.layers[0].param_shapes == ((3, 1, 8), (8,))
    assert "fallbacks" not in c.describe()
  else:
    assert _summary(c) == [dense] + [("generic", 1, "diagonal",
                                      "leftover")] * 2
    assert "grouped convolution (feature_group_count=2" in c.describe()
    with pytest.raises(ValueError, match=r"\['Conv_0'\]\['kernel'\]: "
                       r"grouped convolution"):
      kl.scan(loss_fn, params, batch, strict=True)
    return
  meta = c.layers[0].meta_dict
  assert meta["feature_group_count"] == groups
  assert meta["dimension_numbers"] == ((0, 2, 1), (2, 1, 0), (0, 2, 1))
  assert meta["window_strides"] == (1,) and meta["padding"] == ((1, 1),)
  (site, rec), _ = _records(c, params, batch).values()
  assert [r.shape for r in rec] == [(B, 7, 4)]
  assert site.y_aval.shape == (B, 7, 8)
  _update(loss_fn, params, batch, c)


@pytest.mark.parametrize("approx", ["diagonal", "kron"])
def test_auto_depthwise_equals_register_depthwise_conv2d(approx):
  """A lax depthwise conv ([h, w, 1, C·M] kernel, found automatically) has
  the statistics of register_depthwise_conv2d on the kernel reshaped to
  [h, w, C, M] (same ravel order, so the Fisher blocks compare directly)."""
  kh, kw, ch, m = 2, 3, 3, 2
  conv = dict(window_strides=(2, 1), padding="SAME", rhs_dilation=(1, 2),
              dimension_numbers=("NHWC", "HWIO", "NHWC"),
              feature_group_count=ch)

  def make(tagged):
    def loss_fn(p, batch):
      x = batch[0]
      w = p["w"].reshape(kh, kw, 1, ch * m)
      y = lax.conv_general_dilated(x, w, **conv)
      if tagged:
        y = kl.register_depthwise_conv2d(y, x, p["w"], strides=(2, 1),
                                         padding="SAME", rate=(1, 2),
                                         approx=approx)
      return _ce(jnp.mean(y, axis=(1, 2)), batch[1])
    return loss_fn

  batch = (_x(B, 5, 4, ch), _labels(B, n=ch * m))
  w = _x(kh, kw, 1, ch * m, seed=1)
  auto = kl.scan(make(False), {"w": w}, batch, strict=True,
                 approximations={"depthwise_conv": approx})
  manual = kl.scan(make(True), {"w": w.reshape(kh, kw, ch, m)}, batch,
                   strict=True)
  assert _summary(auto) == [("depthwise_conv", 1, approx, "auto")]
  assert _summary(manual) == [("depthwise_conv", 1, approx, "tag")]
  _, s_auto = _empirical_state(auto, {"w": w}, batch)
  _, s_manual = _empirical_state(manual, {"w": w.reshape(kh, kw, ch, m)},
                                 batch)
  assert float(jnp.max(jnp.abs(jax.tree.leaves(s_auto.blocks)[0]))) > 0
  for a, b in zip(jax.tree.leaves(s_auto.blocks),
                  jax.tree.leaves(s_manual.blocks), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# Scale and shift.
# ---------------------------------------------------------------------------


class _Norms(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(5)(x)
    x = nn.LayerNorm()(x)
    x = nn.RMSNorm()(x)
    x = nn.BatchNorm(use_running_average=True)(x)
    return nn.Dense(3)(x)


def test_norms_scale_and_shift():
  model = _Norms()
  x, labels = _x(B, 4), _labels(B)
  variables = jax.jit(lambda k, x: jax.tree.map(
      lambda v: v + 0.1 * _x(*v.shape, seed=v.size), model.init(k, x)))(
          jax.random.PRNGKey(0), x)

  def loss_fn(params, batch):
    v = {"params": params, "batch_stats": variables["batch_stats"]}
    return _ce(model.apply(v, batch[0]), batch[1])

  params, batch = variables["params"], (x, labels)
  c = kl.scan(loss_fn, params, batch, strict=True)
  ss = ("scale_and_shift", 1, "full", "auto")
  fc = ("fully_connected", 1, "kron", "auto")
  assert _summary(c) == [fc, ss, ss, ss, fc]
  assert _paths(c)[1:4] == [("['LayerNorm_0']['scale']",
                             "['LayerNorm_0']['bias']"),
                            ("['RMSNorm_0']['scale']",),
                            ("['BatchNorm_0']['scale']",
                             "['BatchNorm_0']['bias']")]
  # The recorded input is the normalised x̂ with y = x̂ * scale + shift.
  names = ["LayerNorm_0", "RMSNorm_0", "BatchNorm_0"]

  @jax.jit
  def x_hats(params, x):
    _, state = model.apply({"params": params,
                            "batch_stats": variables["batch_stats"]}, x,
                           capture_intermediates=True,
                           mutable=["intermediates"])
    inter = state["intermediates"]
    return [(inter[name]["__call__"][0] - params[name].get("bias", 0.0))
            / params[name]["scale"] for name in names]
  records = list(_records(c, params, batch).values())
  for (site, rec), x_hat in zip(records[1:4], x_hats(params, x)):
    assert rec[0].shape == site.y_aval.shape == (B, 5)
    np.testing.assert_allclose(rec[0], x_hat, rtol=1e-4, atol=1e-5)
  _update(loss_fn, params, batch, c)


class _BNNet(nn.Module):
  train: bool
  affine: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(5)(x)
    x = nn.BatchNorm(use_running_average=not self.train,
                     use_scale=self.affine, use_bias=self.affine)(x)
    return nn.Dense(3)(nn.relu(x))


@pytest.mark.parametrize("train", [False, True])
def test_batchnorm_whole_variables_params_filter(train):
  model = _BNNet(train)
  x, labels = _x(B, 6), _labels(B)
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)

  def loss_fn(v, batch):
    if train:
      out, updates = model.apply(v, batch[0], mutable=["batch_stats"])
      return _ce(out, batch[1]), updates
    return _ce(model.apply(v, batch[0]), batch[1])

  batch = (x, labels)
  plain = kl.scan(loss_fn, variables, batch, has_aux=train)
  stats = [l for l in plain.layers if "batch_stats" in l.name]
  assert [(l.kind, l.found_by) for l in stats] == [("generic", "leftover")] * 2
  assert "params_filter" in plain.describe() or not train
  with pytest.raises(ValueError, match=r"batch_stats.*mean.*params_filter"):
    kl.scan(loss_fn, variables, batch, has_aux=train, strict=True)
  expected = [("fully_connected", 1, "kron", "auto"),
              ("scale_and_shift", 1, "full", "auto"),
              ("fully_connected", 1, "kron", "auto")]
  for pf in ({"params": True, "batch_stats": False},
             lambda path: path.startswith("['params']")):
    c = kl.scan(loss_fn, variables, batch, has_aux=train, params_filter=pf,
                strict=True)
    assert _summary(c) == expected
    assert "not trainable (params_filter), no block: 2 leaves" in (
        c.describe())
    c.check_registration(variables)
  _update(loss_fn, variables, batch, c, has_aux=train)


def test_params_filter_leaves_non_trainable_vectors_unchanged():
  model = _BNNet(train=False, affine=False)  # Dense layers only have blocks.
  x, labels = _x(B, 6), _labels(B)
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  variables["batch_stats"]["BatchNorm_0"]["var"] += 0.5

  def loss_fn(v, batch):
    return _ce(model.apply(v, batch[0]), batch[1])

  batch = (x, labels)
  c = kl.scan(loss_fn, variables, batch, strict=True,
              params_filter={"params": True, "batch_stats": False})
  assert _summary(c) == [("fully_connected", 1, "kron", "auto")] * 2
  tx = kl.scale_by_kfac(c)
  grads = jax.jit(jax.grad(loss_fn))(variables, batch)
  direction, _ = jax.jit(lambda g, p, b: tx.update(g, tx.init(p), p, batch=b))(
      grads, variables, batch)
  np.testing.assert_array_equal(direction["batch_stats"]["BatchNorm_0"]["var"],
                                grads["batch_stats"]["BatchNorm_0"]["var"])
  assert not np.allclose(direction["params"]["Dense_0"]["kernel"],
                         grads["params"]["Dense_0"]["kernel"])
  assert all(bool(jnp.all(jnp.isfinite(d)))
             for d in jax.tree.leaves(direction))
  est = kl.FisherEstimator(c)
  n = sum(v.size for v in jax.tree.leaves(variables))
  assert jax.eval_shape(lambda v: est.full_fisher(est.init(v)),
                        variables).shape == (n, n)


def test_params_filter_errors():
  loss_fn, params, batch = _plain_mlp(tagged=False)
  with pytest.raises(ValueError, match="selects no parameter leaf"):
    kl.scan(loss_fn, params, batch, params_filter=lambda p: False)
  with pytest.raises(ValueError, match="params_filter must be a callable"):
    kl.scan(loss_fn, params, batch, params_filter={"nope": True})


# ---------------------------------------------------------------------------
# Embeddings and tied weights.
# ---------------------------------------------------------------------------


class _EmbedNet(nn.Module):
  tied: bool

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(11, 4)
    h = embed(ids)
    return embed.attend(h) if self.tied else nn.Dense(11)(h)


def test_embed_and_dense():
  ids = _labels(B, 3, n=11)
  loss_fn, params, batch = _linen(_EmbedNet(tied=False), ids, ids)
  c = kl.scan(loss_fn, params, batch, strict=True)
  # ids [B, 3]: three lookups per example are three uses of the table.
  assert _summary(c) == [("embedding", 3, "kron_indep", "auto"),
                         ("fully_connected", 3, "kron_indep", "auto")]
  (emb, rec_e), (_, rec_d) = _records(c, params, batch).values()
  assert rec_e[0].dtype == jnp.int32 and rec_e[0].shape == (B, 3)
  np.testing.assert_array_equal(rec_e[0], ids)
  assert emb.y_aval.shape == (B, 3, 4)
  assert rec_d[0].shape == (B, 3, 4)
  _update(loss_fn, params, batch, c)


def test_tied_embedding_is_one_multi_use_layer():
  """Embed + Embed.attend: lookups and x @ table.T make one kron_sum layer."""
  ids = _labels(B, 3, n=11)
  loss_fn, params, batch = _linen(_EmbedNet(tied=True), ids, ids)
  c = kl.scan(loss_fn, params, batch, strict=True)
  # Three lookups and three attend positions per example.
  assert _summary(c) == [("tied_embedding", 6, "kron_sum", "auto")]
  assert c.layers[0].param_shapes == ((11, 4),)
  assert "fallbacks" not in c.describe()
  (look, rec_l), (att, rec_a) = _records(c, params, batch).values()
  assert (look.kind, att.kind) == ("embedding", "tied_embedding")
  np.testing.assert_array_equal(rec_l[0], ids)
  assert rec_a[0].dtype == jnp.float32 and rec_a[0].shape == (B, 3, 4)
  assert att.y_aval.shape == (B, 3, 11)
  _update(loss_fn, params, batch, c)


@pytest.mark.parametrize("lookup", ["one_hot", "take", "take_along_axis",
                                    "index"])
def test_plain_jax_embeddings(lookup):
  def loss_fn(p, batch):
    ids = batch[0]
    table = p["table"]
    if lookup == "one_hot":
      h = jax.nn.one_hot(ids, 7) @ table
    elif lookup == "take":
      h = jnp.take(table, ids, axis=0)
    elif lookup == "take_along_axis":
      h = jnp.take_along_axis(table, ids[:, None], axis=0)
    else:
      h = table[ids]
    return _ce(h @ p["out"], batch[1])
  params = {"table": _x(7, 4), "out": _x(4, 3)}
  ids = jnp.array([1, 6, 3, 1])
  batch = (ids, _labels(B))
  c = kl.scan(loss_fn, params, batch, strict=True)
  assert _summary(c) == [("embedding", 1, "kron", "auto"),
                         ("fully_connected", 1, "kron", "auto")]
  (_, rec), _ = _records(c, params, batch).values()
  np.testing.assert_array_equal(rec[0], ids)
  _update(loss_fn, params, batch, c)


# ---------------------------------------------------------------------------
# Attention: DenseGeneral with several input or output axes.
# ---------------------------------------------------------------------------


def test_multi_head_attention_projections():
  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)(x)

  t, d = 3, 6
  loss_fn, params, batch = _linen(Net(), _x(B, t, d), _labels(B, t, n=d))
  c = kl.scan(loss_fn, params, batch, strict=True)
  assert _summary(c) == [("fully_connected", t, "kron_indep", "auto")] * 4
  assert [l.name.split("[")[-1] for l in c.layers] == [
      "'query']", "'key']", "'value']", "'out']"]
  assert [l.param_shapes for l in c.layers] == [((d, 2, 2), (2, 2))] * 3 + [
      ((2, 2, d), (d,))]
  # How many leading kernel axes are inputs: the block's [d_in, d_out].
  assert [l.meta_dict["kernel_in_axes"] for l in c.layers] == [1, 1, 1, 2]
  # The out projection's input [B, T, heads, head_dim] is recorded flattened.
  shapes = [(r[0].shape, s.y_aval.shape)
            for s, r in _records(c, params, batch).values()]
  assert shapes == [((B, t, d), (B, t, 2, 2))] * 3 + [((B, t, 4), (B, t, d))]
  _update(loss_fn, params, batch, c)


# ---------------------------------------------------------------------------
# Scan over stacked layers.
# ---------------------------------------------------------------------------


class _ScanBlock(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    return nn.tanh(nn.Dense(6)(x)), None


class _ScanNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(_ScanBlock, variable_axes={"params": 0},
                    split_rngs={"params": True}, length=4)
    x, _ = stack()(x, None)
    return nn.Dense(3)(x)


def test_nn_scan_over_stacked_dense():
  loss_fn, params, batch = _linen(_ScanNet(), _x(B, 6), _labels(B))
  c = kl.scan(loss_fn, params, batch, strict=True)
  assert _summary(c) == [("fully_connected", 1, "kron", "auto")] * 2
  assert c.layers[0].stack == 4 and c.layers[1].stack == 0
  assert c.layers[0].param_shapes == ((4, 6, 6), (4, 6))
  assert "1 (stack of 4)" in c.describe()
  _update(loss_fn, params, batch, c)


def test_stacked_fisher_equals_unrolled_layers():
  """One vmapped block per slice = the same layers written out one by one."""
  depth = 3
  stacked = {"B": _x(depth, 4, seed=1), "W": 0.5 * _x(depth, 4, 4, seed=2)}
  unrolled = {f"{k}{l}": stacked[k][l] for k in "BW" for l in range(depth)}

  def loss_stacked(p, batch):
    h, _ = lax.scan(lambda h, wb: (jnp.tanh(h @ wb[1] + wb[0]), None),
                    batch[0], (p["B"], p["W"]))
    return _ce(h, batch[1])

  def loss_unrolled(p, batch):
    h = batch[0]
    for l in range(depth):
      h = jnp.tanh(h @ p[f"W{l}"] + p[f"B{l}"])
    return _ce(h, batch[1])

  batch = (_x(B, 4), _labels(B, n=4))
  c_s = kl.scan(loss_stacked, stacked, batch, strict=True)
  c_u = kl.scan(loss_unrolled, unrolled, batch, strict=True)
  assert _summary(c_s) == [("fully_connected", 1, "kron", "auto")]
  assert c_s.layers[0].stack == depth
  assert _summary(c_u) == [("fully_connected", 1, "kron", "auto")] * depth
  est_s, state_s = _empirical_state(c_s, stacked, batch)
  est_u, state_u = _empirical_state(c_u, unrolled, batch)
  f_s = jax.jit(est_s.full_fisher)(state_s)
  assert float(jnp.max(jnp.abs(f_s))) > 0
  np.testing.assert_allclose(f_s, jax.jit(est_u.full_fisher)(state_u),
                             rtol=1e-5, atol=1e-7)
  # Preconditioned vectors agree too.
  v = jax.grad(loss_unrolled)(unrolled, batch)
  v_stacked = {k: jnp.stack([v[f"{k}{l}"] for l in range(depth)])
               for k in "BW"}
  out_s = jax.jit(est_s.multiply_inverse)(state_s, v_stacked)
  out_u = jax.jit(est_u.multiply_inverse)(state_u, v)
  for k in "BW":
    for l in range(depth):
      np.testing.assert_allclose(out_s[k][l], out_u[f"{k}{l}"], rtol=1e-4,
                                 atol=1e-6)


def test_manual_tag_inside_stacked_scan():
  def loss_fn(p, batch):
    def body(h, w):
      return jnp.tanh(kl.register_dense(h @ w, h, w)), None
    h, _ = lax.scan(body, batch[0], p["W"])
    return _ce(h @ p["out"], batch[1])
  params = {"W": _x(3, 4, 4), "out": _x(4, 3)}
  batch = (_x(B, 4), _labels(B))
  c = kl.scan(loss_fn, params, batch, strict=True)
  assert _summary(c) == [("fully_connected", 1, "kron", "tag"),
                         ("fully_connected", 1, "kron", "auto")]
  assert c.layers[0].stack == 3
  _update(loss_fn, params, batch, c)


def test_rnn_scan_over_time_is_multi_use():
  def loss_fn(p, batch):
    h, hs = lax.scan(lambda h, x: (jnp.tanh(x @ p["wx"] + h @ p["wh"]),) * 2,
                     jnp.zeros((B, 4)), batch[0])
    return _ce(hs[-1] @ p["out"], batch[1])
  params = {"wx": _x(3, 4), "wh": _x(4, 4), "out": _x(4, 3)}
  batch = (_x(5, B, 3), _labels(B))
  c = kl.scan(loss_fn, params, batch, strict=True)
  assert _summary(c) == [("fully_connected", 5, "kron_indep", "auto")] * 2 + [
      ("fully_connected", 1, "kron", "auto")]
  _update(loss_fn, params, batch, c)


# ---------------------------------------------------------------------------
# Unsupported uses fall back, with the reason.
# ---------------------------------------------------------------------------


def test_unrecognised_use_falls_back_with_reason():
  def loss_fn(p, batch):
    h = jnp.tanh(batch[0] @ p["w1"])
    h = h * jnp.sum(jnp.sin(p["w1"]))   # A use that is no layer.
    return _ce(h @ p["w2"], batch[1]) + 1e-3 * jnp.sum(p["w2"] ** 2)
  params = {"w1": _x(5, 6), "w2": _x(6, 3)}
  batch = (_x(B, 5), _labels(B))
  c = kl.scan(loss_fn, params, batch)
  # w2's regulariser does not reach the loss tag: w2 stays a dense layer.
  assert _summary(c) == [("fully_connected", 1, "kron", "auto"),
                         ("generic", 1, "diagonal", "leftover")]
  assert c.layers[1].param_paths == ("['w1']",)
  assert "used by `sin`" in c.describe()
  assert "recognised as fully_connected" in c.layers[1].note
  with pytest.raises(ValueError, match=r"\['w1'\]: recognised as "
                     r"fully_connected.*used by `sin`"):
    kl.scan(loss_fn, params, batch, strict=True)
  _update(loss_fn, params, batch, c)


def test_scale_of_unbatched_value_falls_back():
  def loss_fn(p, batch):
    pos = jnp.ones((3, 4)) * p["pos_scale"]   # No batch axis: not a layer.
    return _ce((batch[0] + pos) @ p["w"], batch[1])
  params = {"pos_scale": _x(4), "w": _x(4, 5)}
  batch = (_x(B, 3, 4), _labels(B, 3, n=5))
  c = kl.scan(loss_fn, params, batch)
  assert _summary(c) == [("fully_connected", 3, "kron_indep", "auto"),
                         ("generic", 1, "diagonal", "leftover")]
  assert "does not depend on the batch" in c.layers[1].note


def test_transposed_kernel_is_dense_and_parameter_products_fall_back():
  def loss_fn(p, batch):
    h = jnp.tanh(batch[0] @ p["w1"].T)
    return _ce(h @ (p["a"] @ p["b"]), batch[1])
  params = {"a": _x(6, 2), "b": _x(2, 3), "w1": _x(6, 5)}
  batch = (_x(B, 5), _labels(B))
  c = kl.scan(loss_fn, params, batch)
  # x @ w.T is the output projection of a tied embedding only when the
  # table is also looked up; otherwise a dense layer with a [d_out, d_in]
  # kernel.
  assert _summary(c) == [("fully_connected", 1, "kron", "auto")] + [
      ("generic", 1, "diagonal", "leftover")] * 2
  assert c.layers[0].param_paths == ("['w1']",)
  assert c.layers[0].meta_dict["kernel_perm"] == (1, 0)
  assert "a product of two parameters is not a layer" in c.describe()


# ---------------------------------------------------------------------------
# Scan time.
# ---------------------------------------------------------------------------


class _Residual(nn.Module):
  depth: int

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(64)(x)
    for _ in range(self.depth):
      x = x + nn.relu(nn.LayerNorm()(nn.Dense(64)(x)))
    return nn.Dense(10)(x)


@pytest.mark.perf
def test_scan_of_48_residual_blocks_is_fast():
  """Loosely bounded here; benchmarks/compile_depth.py has the timings."""
  loss_fn, params, batch = _linen(_Residual(48), _x(8, 64), _labels(8, n=10))
  start = time.perf_counter()
  c = kl.scan(loss_fn, params, batch, strict=True)
  elapsed = time.perf_counter() - start
  kinds = [l.kind for l in c.layers]
  assert kinds.count("fully_connected") == 50
  assert kinds.count("scale_and_shift") == 48
  assert elapsed < 5.0, f"scan took {elapsed:.2f}s"
