"""Untagged Equinox models: recognition, layouts and the training loop.

Equinox layers compute per example (``weight @ x`` with ``weight: [d_out,
d_in]``, a ``[c_out, 1, ..., 1]`` conv bias, ``weight[x]`` lookups) and are
batched by ``jax.vmap``. The scanner records their inputs and output
gradients in the layout of the same layer written ``x @ w.T``, and the
dense blocks read the kernel through its ``kernel_perm``: the curvature and
the direction must not depend on how the product was written.
"""

import inspect

import equinox as eqx
import jax
import jax.flatten_util
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import kfac_jax_lite as kl

B = 8


def _labels(key, n, classes):
  return jax.random.randint(key, (n,), 0, classes)


def _ce(logits, labels):
  kl.register_categorical_predictive_distribution(logits, labels)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def _loss_of(static):
  """``loss_fn(params, (x, y))`` of a model split by ``eqx.partition``."""
  def loss_fn(params, batch):
    model = eqx.combine(params, static)
    x, y = batch
    return _ce(jax.vmap(model)(x), y)
  return loss_fn


def _scan(model, batch, **kw):
  params, static = eqx.partition(model, eqx.is_inexact_array)
  return kl.scan(_loss_of(static), params, batch, **kw), params, static


def _no_fallback(collection):
  bad = [(l.name, l.kind, l.found_by, l.note) for l in collection.layers
         if l.kind == "generic" or l.found_by != "auto"]
  assert not bad, collection.describe()


# ---------------------------------------------------------------------------
# Models.
# ---------------------------------------------------------------------------


class CNN(eqx.Module):
  conv: eqx.nn.Conv2d
  norm: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(1, 4, 3, key=k1)
    self.norm = eqx.nn.LayerNorm((4, 4, 4))
    self.mlp = eqx.nn.MLP(4 * 16, 5, 8, 1, key=k2)

  def __call__(self, x):
    h = jax.nn.relu(self.norm(self.conv(x)))
    return self.mlp(h.reshape(-1))


class Transformer(eqx.Module):
  embed: eqx.nn.Embedding
  attn: eqx.nn.MultiheadAttention
  norm1: eqx.nn.LayerNorm
  norm2: eqx.nn.RMSNorm
  mlp: eqx.nn.MLP
  head: eqx.nn.Linear

  def __init__(self, key, vocab=11, d=8, classes=5):
    ks = jax.random.split(key, 4)
    self.embed = eqx.nn.Embedding(vocab, d, key=ks[0])
    self.attn = eqx.nn.MultiheadAttention(2, d, use_query_bias=True,
                                          use_output_bias=True, key=ks[1])
    self.norm1 = eqx.nn.LayerNorm(d)
    self.norm2 = eqx.nn.RMSNorm(d)
    self.mlp = eqx.nn.MLP(d, d, 2 * d, 1, key=ks[2])
    self.head = eqx.nn.Linear(d, classes, key=ks[3])

  def __call__(self, ids):
    h = jax.vmap(self.embed)(ids)
    h = h + self.attn(*(jax.vmap(self.norm1)(h),) * 3)
    h = h + jax.vmap(self.mlp)(jax.vmap(self.norm2)(h))
    return self.head(jnp.mean(h, axis=0))


class Convs(eqx.Module):
  c1: eqx.nn.Conv1d
  c3: eqx.nn.Conv3d
  seq: eqx.nn.Sequential

  def __init__(self, key):
    ks = jax.random.split(key, 4)
    self.c1 = eqx.nn.Conv1d(2, 3, 3, key=ks[0])
    self.c3 = eqx.nn.Conv3d(1, 2, 2, key=ks[1])
    self.seq = eqx.nn.Sequential([
        eqx.nn.Linear(3 * 4 + 2 * 27, 6, use_bias=False, key=ks[2]),
        eqx.nn.Lambda(jnp.tanh), eqx.nn.Linear(6, 4, key=ks[3])])

  def __call__(self, x):
    a, b = x
    h = jnp.concatenate([jnp.tanh(self.c1(a)).reshape(-1),
                         jnp.tanh(self.c3(b)).reshape(-1)])
    return self.seq(h)


def _convs_batch(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return ((jax.random.normal(k1, (B, 2, 6)),
           jax.random.normal(k2, (B, 1, 4, 4, 4))), _labels(k3, B, 4))


class RNN(eqx.Module):
  cell: eqx.Module
  head: eqx.nn.Linear

  def __init__(self, cell_cls, key, d_in=3, hidden=4):
    k1, k2 = jax.random.split(key)
    self.cell = cell_cls(d_in, hidden, key=k1)
    self.head = eqx.nn.Linear(hidden, 5, key=k2)

  def __call__(self, xs):
    hidden = self.cell.hidden_size
    h0 = jnp.zeros((hidden,))
    if isinstance(self.cell, eqx.nn.LSTMCell):
      h0 = (h0, h0)

    def step(h, x):
      return self.cell(x, h), None
    h, _ = lax.scan(step, h0, xs)
    h = h[0] if isinstance(h, tuple) else h
    return self.head(h)


def _image_batch(key, shape=(1, 6, 6), classes=5):
  k1, k2 = jax.random.split(key)
  return jax.random.normal(k1, (B,) + shape), _labels(k2, B, classes)


# ---------------------------------------------------------------------------
# Recognition.
# ---------------------------------------------------------------------------


def test_mlp_is_recognised_untagged():
  model = eqx.nn.MLP(6, 5, 7, 2, activation=jnp.tanh,
                     key=jax.random.PRNGKey(0))
  c, _, _ = _scan(model, _image_batch(jax.random.PRNGKey(1), (6,)))
  _no_fallback(c)
  assert [(l.kind, l.approx, l.param_shapes) for l in c.layers] == [
      ("fully_connected", "kron", ((7, 6), (7,))),
      ("fully_connected", "kron", ((7, 7), (7,))),
      ("fully_connected", "kron", ((5, 7), (5,)))]
  assert all(l.meta_dict["kernel_perm"] == (1, 0) for l in c.layers)


def test_mlp_with_scan_is_a_stacked_layer():
  if "scan" not in inspect.signature(eqx.nn.MLP).parameters:
    pytest.skip("eqx.nn.MLP(scan=True) needs equinox >= 0.13.5 (which "
                "needs jax >= 0.7.2); this equinox is older.")
  model = eqx.nn.MLP(6, 5, 7, 3, activation=jnp.tanh, scan=True,
                     key=jax.random.PRNGKey(0))
  c, _, _ = _scan(model, _image_batch(jax.random.PRNGKey(1), (6,)))
  _no_fallback(c)
  assert [(l.kind, l.stack) for l in c.layers] == [
      ("fully_connected", 0), ("fully_connected", 2),
      ("fully_connected", 0)]


def test_cnn_is_recognised_untagged():
  c, _, _ = _scan(CNN(jax.random.PRNGKey(0)),
                  _image_batch(jax.random.PRNGKey(1)))
  _no_fallback(c)
  assert [(l.kind, l.param_shapes) for l in c.layers] == [
      ("conv", ((4, 1, 3, 3), (4, 1, 1))),
      ("scale_and_shift", ((4, 4, 4), (4, 4, 4))),
      ("fully_connected", ((8, 64), (8,))),
      ("fully_connected", ((5, 8), (5,)))]


def test_transformer_is_recognised_untagged():
  model = Transformer(jax.random.PRNGKey(0))
  batch = (jax.random.randint(jax.random.PRNGKey(1), (B, 6), 0, 11),
           _labels(jax.random.PRNGKey(2), B, 5))
  c, _, _ = _scan(model, batch)
  _no_fallback(c)
  kinds = {l.name: (l.kind, l.num_uses) for l in c.layers}
  assert kinds[".embed.weight"] == ("embedding", 6)
  for proj in ("query_proj", "key_proj", "value_proj", "output_proj"):
    name = next(n for n in kinds if proj in n)
    assert kinds[name] == ("fully_connected", 6), kinds
  assert sum(k == "scale_and_shift" for k, _ in kinds.values()) == 2


def test_conv1d_conv3d_sequential_and_linear_without_bias():
  c, _, _ = _scan(Convs(jax.random.PRNGKey(0)),
                  _convs_batch(jax.random.PRNGKey(1)))
  _no_fallback(c)
  assert [(l.kind, len(l.param_paths)) for l in c.layers] == [
      ("conv", 2), ("conv", 2), ("fully_connected", 1),
      ("fully_connected", 2)]


@pytest.mark.parametrize("cell", [eqx.nn.GRUCell, eqx.nn.LSTMCell])
def test_recurrent_cells_under_scan(cell):
  model = RNN(cell, jax.random.PRNGKey(0))
  batch = (jax.random.normal(jax.random.PRNGKey(1), (B, 5, 3)),
           _labels(jax.random.PRNGKey(2), B, 5))
  c, _, _ = _scan(model, batch)
  of = {p: l for l in c.layers for p in l.param_paths}
  ih, hh = of[".cell.weight_ih"], of[".cell.weight_hh"]
  assert (ih.kind, ih.num_uses, ih.approx) == ("fully_connected", 5,
                                               "kron_indep")
  assert (hh.kind, hh.num_uses, hh.approx) == ("fully_connected", 5,
                                               "kron_indep")
  # GRU: b_ih is weight_ih's bias; LSTM: the one bias of W_ih x + W_hh h.
  assert ih.param_paths == (".cell.weight_ih", ".cell.bias")
  generic = [l for l in c.layers if l.kind == "generic"]
  if cell is eqx.nn.LSTMCell:
    assert not generic, c.describe()
  else:
    # GRU's bias_n is added to one gate's slice of W_hh h: no layer's
    # bias. The note says why and what to do, not to rewrite the cell.
    (bias_n,) = generic
    assert bias_n.param_paths == (".cell.bias_n",)
    assert "one gate's slice" in bias_n.note
    assert "approximations={'.cell.bias_n': 'full'}" in bias_n.note


# ---------------------------------------------------------------------------
# Layouts: the direction does not depend on how the product is written.
# ---------------------------------------------------------------------------

LAYOUTS = {
    "vmap_w_at_x": lambda w, b, h: jax.vmap(lambda v: w @ v + b)(h),
    "x_at_wT": lambda w, b, h: h @ w.T + b,
    "w_at_xT_T": lambda w, b, h: (w @ h.T).T + b[None, :],
    "w_at_xT_bias_col": lambda w, b, h: (w @ h.T + b[:, None]).T,
    "einsum_trailing": lambda w, b, h: jnp.einsum("oi,...i->...o", w, h) + b,
    "einsum_out_first": lambda w, b, h: jnp.einsum("oi,bi->ob", w, h).T + b,
    "equinox_linear": lambda w, b, h: jax.vmap(eqx.tree_at(
        lambda l: (l.weight, l.bias),
        eqx.nn.Linear(w.shape[1], w.shape[0], key=jax.random.PRNGKey(0)),
        (w, b)))(h),
}


def _mlp_params(key, sizes):
  ks = jax.random.split(key, len(sizes))
  return [{"w": jax.random.normal(k, (o, i)) / np.sqrt(i),
           "b": 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (o,))}
          for k, i, o in zip(ks, sizes[:-1], sizes[1:])]


def _untagged_loss(layout):
  def loss_fn(params, batch):
    h, y = batch
    for j, p in enumerate(params):
      h = LAYOUTS[layout](p["w"], p["b"], h)
      h = jnp.tanh(h) if j < len(params) - 1 else h
    return _ce(h, y)
  return loss_fn


def _tagged_loss(params, batch):
  """The same MLP with ``[d_in, d_out]`` kernels, tagged by hand."""
  h, y = batch
  for j, p in enumerate(params):
    h = kl.register_dense(h @ p["w"] + p["b"], h, p["w"], p["b"])
    h = jnp.tanh(h) if j < len(params) - 1 else h
  return _ce(h, y)


def _direction(loss_fn, params, batch, approx):
  c = kl.scan(loss_fn, params, batch,
              approximations={"fully_connected": approx})
  assert [l.kind for l in c.layers] == ["fully_connected"] * len(params), (
      c.describe())
  est = kl.FisherEstimator(c, estimation_mode="exact", exps=(-1,))
  grads = jax.grad(loss_fn)(params, batch)

  @jax.jit
  def run(params, grads):
    s = est.update_curvature(est.init(params), params, batch,
                             jax.random.PRNGKey(0))
    s = est.update_cache(s, damping=0.05)
    return est.multiply_inverse(s, grads), est.full_fisher(s)
  return run(params, grads)


def _transposed(params):
  return [{"w": p["w"].T, "b": p["b"]} for p in params]


# Three layouts (the transposed product, an einsum, Equinox's own Linear) in
# the default tier, the rest slow.
@pytest.mark.parametrize("layout", [
    l if l in ("x_at_wT", "einsum_out_first", "equinox_linear")
    else pytest.param(l, marks=pytest.mark.slow) for l in sorted(LAYOUTS)])
def test_direction_does_not_depend_on_layout(layout):
  params = _mlp_params(jax.random.PRNGKey(0), (5, 6, 4))
  x = jax.random.normal(jax.random.PRNGKey(1), (B, 5))
  batch = (x, _labels(jax.random.PRNGKey(2), B, 4))
  got, _ = _direction(_untagged_loss(layout), params, batch, "kron")
  want, _ = _direction(_tagged_loss, _transposed(params), batch, "kron")
  for g, w in zip(got, _transposed(want)):
    np.testing.assert_allclose(g["w"], w["w"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(g["b"], w["b"], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("approx", [
    "kron", "diagonal", *(pytest.param(a, marks=pytest.mark.slow)
                          for a in ("kron_in_diag", "full", "ekfac"))])
def test_every_dense_block_reads_the_transposed_kernel(approx):
  params = _mlp_params(jax.random.PRNGKey(3), (4, 5, 3))
  x = jax.random.normal(jax.random.PRNGKey(4), (B, 4))
  batch = (x, _labels(jax.random.PRNGKey(5), B, 3))
  got, f_got = _direction(_untagged_loss("vmap_w_at_x"), params, batch,
                          approx)
  want, f_want = _direction(_tagged_loss, _transposed(params), batch, approx)
  for g, w in zip(got, _transposed(want)):
    np.testing.assert_allclose(g["w"], w["w"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(g["b"], w["b"], rtol=2e-5, atol=1e-6)
  # The full Fisher is in ravel order of each model's own params: the
  # same matrix up to the permutation that transposes the kernels.
  flat_t, unravel_t = jax.flatten_util.ravel_pytree(_transposed(params))
  index = unravel_t(jnp.arange(flat_t.size, dtype=jnp.float32))
  perm = np.asarray(jax.flatten_util.ravel_pytree(_transposed(index))[0]
                    ).astype(int)
  np.testing.assert_allclose(f_got, np.asarray(f_want)[np.ix_(perm, perm)],
                             rtol=2e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# The Equinox loop.
# ---------------------------------------------------------------------------


def _make_tx(name, collection):
  if name == "kfac":
    return kl.kfac(0.05, collection, damping=1e-2, inverse_update_period=1)
  if name == "kfac_adamw":
    return kl.kfac_adamw(0.1, collection, inverse_update_period=1,
                         stats_fraction=1.0)
  return kl.kfac_optimizer(collection, initial_damping=1.0)


@pytest.mark.parametrize("name", ["kfac", "kfac_adamw", "kfac_optimizer"])
def test_equinox_training_loop(name):
  model = eqx.nn.MLP(6, 4, 8, 1, activation=jnp.tanh,
                     key=jax.random.PRNGKey(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (32, 6))
  y = (x[:, 0] > 0).astype(jnp.int32) + 2 * (x[:, 1] > 0).astype(jnp.int32)
  batch = (x, y)
  c, params, static = _scan(model, batch)
  _no_fallback(c)
  loss_fn = _loss_of(static)
  tx = _make_tx(name, c)
  state = tx.init(params)

  @eqx.filter_jit
  def step(model, state, batch):
    def loss(m):
      return _ce(jax.vmap(m)(batch[0]), batch[1])
    value, grads = eqx.filter_value_and_grad(loss)(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = tx.update(grads, state, params, batch=batch)
    return eqx.apply_updates(model, updates), state, value

  losses = []
  for _ in range(8):
    model, state, value = step(model, state, batch)
    losses.append(float(value))
  assert np.all(np.isfinite(losses))
  final = float(loss_fn(eqx.filter(model, eqx.is_inexact_array), batch))
  assert final < 0.7 * losses[0], losses


def test_params_with_none_leaves():
  """``eqx.partition`` leaves None where a field is not an array (a Linear
  without bias, the activation): scan and the transforms accept it."""
  model = eqx.nn.Sequential([
      eqx.nn.Linear(5, 6, use_bias=False, key=jax.random.PRNGKey(0)),
      eqx.nn.Lambda(jnp.tanh),
      eqx.nn.Linear(6, 3, key=jax.random.PRNGKey(1))])
  batch = _image_batch(jax.random.PRNGKey(2), (5,), 3)
  c, params, _ = _scan(model, batch)
  assert params.layers[0].bias is None
  _no_fallback(c)
  tx = kl.kfac(0.1, c)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p, batch=batch)
                       )(grads, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)


# ---------------------------------------------------------------------------
# Data parallel.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mapping", ["pmap", pytest.param("shard_map", marks=pytest.mark.slow)])
def test_data_parallel_matches_one_device(mapping):
  r = 4
  if len(jax.devices()) < r:
    pytest.skip(f"needs {r} devices (tests/conftest.py sets them)")
  model = CNN(jax.random.PRNGKey(0))
  batch = _image_batch(jax.random.PRNGKey(1))
  c, params, static = _scan(model, batch)
  grads = jax.jit(jax.grad(_loss_of(static)))(params, batch)

  def run(axis, fn_map):
    tx = kl.kfac(0.1, c, damping=1e-2, estimation_mode="exact",
                 inverse_update_period=1, axis_name=axis)

    def step(state, params, grads, batch):
      return tx.update(grads, state, params, batch=batch)
    state = jax.jit(tx.init)(params)
    return fn_map(step)(state, params, grads, batch)[0]

  want = run(None, jax.jit)
  if mapping == "shard_map":
    mesh = Mesh(np.array(jax.devices()[:r]), ("d",))
    got = run("d", lambda f: jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P(), P(), P(), P("d")), out_specs=P())))
  else:
    # The batch split and the first replica's result jitted: eager, each
    # leaf's reshape and slice is a compile of its own.
    split = jax.jit(lambda t: jax.tree.map(
        lambda a: a.reshape((r, -1) + a.shape[1:]), t))
    first = jax.jit(lambda t: jax.tree.map(lambda a: a[0], t))

    def pmapped(f):
      g = jax.pmap(f, axis_name="d", in_axes=(None, None, None, 0))
      return lambda s, p, gr, b: first(g(s, p, gr, split(b)))
    got = run("d", pmapped)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
