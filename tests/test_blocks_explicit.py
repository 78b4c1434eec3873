"""Each block's statistics against explicit dense Fisher blocks.

Per-example gradients come from ``jax.vmap(jax.grad(...))`` of the layer
itself and conv patches from ``jax.jacfwd`` of the convolution with respect
to its kernel, so nothing here reuses the library's reshapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from tests import block_cases as cases
from tests import blocks_helpers as h
from tests.blocks_helpers import x64  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("x64")  # float64 factors


def _stats_state(block, data):
  """The state after one zero-debiased update (no cache needed)."""
  return jax.jit(lambda: block.update_curvature(
      block.init(), block.compute_stats(data), 0.9))()


def _full(block, data):
  return np.asarray(block.full_fisher_block(_stats_state(block, data)))


def _explicit_fisher(fn, data, params):
  """``(1/B) Σ_{s,b} ∇∇ᵀ`` with every site and use folded per example."""
  x = jnp.concatenate([inp[0] for inp in data.inputs], axis=1)
  g = jnp.concatenate(list(data.grads), axis=2)
  grads = h.per_example_grads(lambda p, xb: fn(p, xb[0]), params, x, g)
  return h.per_example_fisher(grads)


PER_EXAMPLE = [
    ("dense_diagonal", cases.dense, dict(approx="diagonal")),
    ("dense_diagonal_uses", cases.dense,
     dict(approx="diagonal", uses=3, sites=2)),
    ("dense_full_uses", cases.dense, dict(approx="full", uses=2, sites=2)),
    ("dense_full_nobias", cases.dense, dict(approx="full", bias=False)),
    ("conv_diagonal_uses", cases.conv, dict(approx="diagonal", uses=2)),
    ("conv_diagonal_oihw", cases.conv,
     dict(approx="diagonal", case="nchw_oihw_explicit")),
    ("conv_diagonal_1d", cases.conv, dict(approx="diagonal",
                                          case="nwc_1d_same")),
    ("depthwise_diagonal", cases.depthwise, dict(approx="diagonal")),
    ("depthwise_diagonal_nchw", cases.depthwise,
     dict(approx="diagonal", data_format="NCHW", mult=3)),
    ("separable_diagonal", cases.separable, dict(approx="diagonal")),
    ("scale_and_shift_diagonal", cases.scale_and_shift,
     dict(approx="diagonal")),
] + [(f"scale_and_shift_full_{c}", cases.scale_and_shift,
      dict(approx="full", case=c)) for c in cases.SCALE_SHIFT_SHAPES] + [
          (f"depthwise_lax_diagonal_{c}", cases.depthwise_lax,
           dict(approx="diagonal", case=c)) for c in cases.DEPTHWISE_LAX]


@pytest.mark.parametrize("name,builder,kwargs", PER_EXAMPLE,
                         ids=[p[0] for p in PER_EXAMPLE])
def test_per_example_blocks_match_explicit_fisher(name, builder, kwargs):
  """Diagonal / full blocks are the exact (diagonal of the) Fisher."""
  layer, data, params, fn = builder(3, **kwargs)
  block = h.make_block(layer)

  @jax.jit
  def run():
    state = block.update_curvature(block.init(), block.compute_stats(data),
                                   0.9)
    return block.full_fisher_block(state), _explicit_fisher(fn, data, params)

  full, explicit = map(np.asarray, run())
  if layer.approx == "diagonal":
    explicit = np.diag(np.diag(explicit))
  np.testing.assert_allclose(full, explicit, rtol=1e-10,
                             atol=1e-10 * np.abs(explicit).max())


def test_generic_full_is_square_of_the_sum():
  layer, data, params, _ = cases.generic(4, approx="full")
  pg = jnp.concatenate([g.reshape(g.shape[0], -1) for g in data.param_grads],
                       axis=1)
  explicit = pg.T @ pg / data.batch_size
  np.testing.assert_allclose(_full(h.make_block(layer), data), explicit,
                             rtol=1e-12)


# ---------------------------------------------------------------------------
# KFC, SUA, depthwise and separable against explicit patch moments.
# ---------------------------------------------------------------------------


def _specs(meta):
  dn = meta.get("dimension_numbers")
  if dn is None:
    sp = "HWD"[: len(meta["w"]) - 2]
    return "NC" + sp, "OI" + sp, "NC" + sp
  return dn


def _to_nlc(y, spec):
  """``[N, ...]`` in layout ``spec`` -> ``[N, L, C]``."""
  perm = [spec.index("N")] + [i for i, ch in enumerate(spec)
                              if ch not in "NC"] + [spec.index("C")]
  y = y.transpose(perm)
  return y.reshape(y.shape[0], -1, y.shape[-1])


def _patches(meta, x, w):
  """Patches ``[N, L, K·I]`` in kernel-matrix order, by differentiation."""
  lhs, rhs, out = _specs(meta)
  fn = cases.conv_fn(meta)
  jac = jax.jit(jax.jacfwd(lambda w: _to_nlc(fn((w,), x), out)[:, :, 0]))(w)
  jac = jnp.take(jac, 0, axis=2 + rhs.index("O"))     # kernel column o = 0
  kernel = rhs.replace("O", "")
  perm = [kernel.index(ch) for ch in kernel if ch != "I"] + [kernel.index("I")]
  jac = jac.transpose([0, 1] + [2 + p for p in perm])
  return jac.reshape(jac.shape[0], jac.shape[1], -1)


def _kfc_explicit(meta, data, params, bias):
  """``c · kron(Ω, Γ)`` in kernel-matrix order, and the ravel index."""
  _, rhs, out = _specs(meta)
  x = data.inputs[0][0]
  x = x.reshape((-1,) + x.shape[2:])
  p = _patches(meta, x, params[0])
  if bias:
    p = jnp.concatenate([p, jnp.ones(p.shape[:2] + (1,))], axis=-1)
  g = data.grads[0]
  g = _to_nlc(g.reshape((-1,) + g.shape[3:]), out).reshape(
      g.shape[0], -1, params[0].shape[rhs.index("O")])
  n = p.shape[0] * p.shape[1]
  omega = np.einsum("nlp,nlq->pq", p, p) / n
  gamma = np.einsum("snd,sne->de", g, g) / n
  c = n / data.batch_size
  index = h.kernel_ravel_index(params[0].shape, rhs, bias)
  return c, omega, gamma, index


@pytest.mark.parametrize("case,bias,uses", [
    (c, True, 1) for c in sorted(cases.CONV_META)] + [
        ("nhwc_valid_dilated", False, 2), ("nchw_oihw_explicit", False, 2)])
def test_kfc_is_patch_moment_kronecker(case, bias, uses):
  """KFC (Grosse & Martens 2016, eq. 23): ``|T| Ω ⊗ Γ`` over patches."""
  meta = cases.CONV_META[case]
  approx = "kron" if uses == 1 else "kron_indep"
  layer, data, params, _ = cases.conv(5, approx, case, bias=bias, uses=uses)
  c, omega, gamma, index = _kfc_explicit(meta, data, params, bias)
  explicit = h.to_ravel(c * np.kron(omega, gamma), index)
  full = _full(h.make_block(layer), data)
  np.testing.assert_allclose(full, explicit, rtol=1e-10,
                             atol=1e-12 * np.abs(explicit).max())


@pytest.mark.parametrize("case,bias", [("nhwc_same_strided", True),
                                       ("nchw_oihw_explicit", False),
                                       ("ndhwc_3d_valid", True)])
def test_sua_is_the_uncorrelated_patch_model(case, bias):
  """``Ω = I_K ⊗ Σ + m̄ m̄ᵀ`` (not TF's ``Σ ⊗ I_K``), ``Γ`` and ``c`` as KFC."""
  meta = cases.CONV_META[case]
  layer, data, params, _ = cases.conv(6, "kron_sua", case, bias=bias)
  c, _, gamma, index = _kfc_explicit(meta, data, params, bias)
  lhs = _specs(meta)[0]
  x = data.inputs[0][0]
  pos = np.asarray(_to_nlc(x.reshape((-1,) + x.shape[2:]), lhs))
  pos = pos.reshape(-1, pos.shape[-1])
  mu = pos.mean(0)
  sigma = np.cov(pos.T, bias=True)
  k = int(np.prod(meta["w"])) // (pos.shape[1] * gamma.shape[0])
  mbar = np.tile(mu, k)
  omega = np.kron(np.eye(k), sigma)
  if bias:
    mbar = np.append(mbar, 1.0)
    omega = np.pad(omega, ((0, 1), (0, 1)))
  omega = omega + np.outer(mbar, mbar)
  explicit = h.to_ravel(c * np.kron(omega, gamma), index)
  full = _full(h.make_block(layer), data)
  np.testing.assert_allclose(full, explicit, rtol=1e-10,
                             atol=1e-12 * np.abs(explicit).max())


def _dense_filter(w):
  """``[h, w, C, M]`` -> ``[h, w, C, C·M]``, zero off the channel diagonal."""
  kh, kw, c, m = w.shape
  eye = jnp.eye(c, dtype=w.dtype)
  return jnp.einsum("hwcm,cd->hwcdm", w, eye).reshape(kh, kw, c, c * m)


@pytest.mark.parametrize("data_format,mult", [("NHWC", 2), ("NCHW", 1)])
def test_depthwise_kron_is_restricted_dense_kfc(data_format, mult):
  """Dense-equivalent KFC restricted to the depthwise entries, per channel."""
  layer, data, params, fn = cases.depthwise(7, "kron", mult, data_format)
  w = params[0]
  kh, kw, c, m = w.shape
  meta = dict(cases.DEPTHWISE_META, x=None, w=(kh, kw, c, c * m),
              dimension_numbers=(data_format, "HWIO", data_format))
  x = data.inputs[0][0][:, 0]
  dense_fn = cases.conv_fn(meta)
  # The equivalence the block relies on.
  np.testing.assert_allclose(fn(params, x), dense_fn((_dense_filter(w),), x),
                             rtol=1e-12, atol=1e-12)
  cst, omega, gamma, _ = _kfc_explicit(
      meta, data, (_dense_filter(w),), False)
  dense = cst * np.kron(omega, gamma)   # HWIO: matrix order = ravel order
  hw, ci, mi = np.meshgrid(np.arange(kh * kw), np.arange(c), np.arange(m),
                           indexing="ij")
  idx = ((hw * c + ci) * c * m + ci * m + mi).reshape(-1)
  same_channel = (ci.reshape(-1)[:, None] == ci.reshape(-1)[None, :])
  explicit = dense[idx][:, idx] * same_channel
  full = _full(h.make_block(layer), data)
  np.testing.assert_allclose(full, explicit, rtol=1e-10,
                             atol=1e-12 * np.abs(explicit).max())


def _lax_dense_filter(w, spec, c):
  """Lax depthwise kernel (``I = 1``, ``O = C·M``) -> dense ``I = C`` filter."""
  i_ax, o_ax = spec.index("I"), spec.index("O")
  m = w.shape[o_ax] // c
  w = jnp.moveaxis(w, (i_ax, o_ax), (-2, -1))     # [..., 1, C·M]
  ci = np.repeat(np.arange(c), m)                 # input channel of output o
  dense = jnp.where(jnp.arange(c)[:, None] == ci[None, :], w, 0.0)
  return jnp.moveaxis(dense, (-2, -1), (i_ax, o_ax))


@pytest.mark.parametrize("case,bias", [("nwc_1d", True), ("nchw_oihw", True),
                                       ("ndhwc_3d", False)])
def test_depthwise_lax_kron_is_restricted_dense_kfc(case, bias):
  """The flax/lax kernel layout: same restriction of the dense-equivalent KFC.

  Entry ``(k, c, m)`` of the depthwise kernel is entry ``(k, c)`` x ``c·M + m``
  of the dense filter; the bias ``c·M + m`` is its bias column ``c·M + m``.
  """
  layer, data, params, fn = cases.depthwise_lax(11, "kron", case, bias)
  meta = cases.DEPTHWISE_LAX[case]
  kw, _ = cases.depthwise_lax_meta(case)
  c = kw["feature_group_count"]
  spec = cases.rhs_spec(meta)
  w = params[0]
  dense_w = _lax_dense_filter(w, spec, c)
  dense_meta = dict(meta, w=dense_w.shape)
  dense_fn = cases.conv_fn(dense_meta)
  x = data.inputs[0][0][:, 0]
  np.testing.assert_allclose(fn(params, x),
                             dense_fn((dense_w,) + params[1:], x),
                             rtol=1e-12, atol=1e-12)
  cst, omega, gamma, _ = _kfc_explicit(dense_meta, data,
                                       (dense_w,) + params[1:], bias)
  dense = cst * np.kron(omega, gamma)       # kernel-matrix order
  # Matrix position (row (k, ci) or the bias row, column o) of every
  # depthwise parameter, in ravel order of (w[, b]).
  o_total = w.shape[spec.index("O")]
  m = o_total // c
  sp = [i for i, ch in enumerate(spec) if ch not in "IO"]
  k_idx = np.ravel_multi_index(
      np.indices(w.shape)[sp], [w.shape[i] for i in sp])
  o_idx = np.indices(w.shape)[spec.index("O")]
  rows = (k_idx * c + o_idx // m).reshape(-1)
  cols = o_idx.reshape(-1)
  chan = cols // m
  if bias:
    rows = np.append(rows, np.full(o_total, omega.shape[0] - 1))
    cols = np.append(cols, np.arange(o_total))
    chan = np.append(chan, np.arange(o_total) // m)
  idx = rows * o_total + cols
  explicit = dense[idx][:, idx] * (chan[:, None] == chan[None, :])
  full = _full(h.make_block(layer), data)
  np.testing.assert_allclose(full, explicit, rtol=1e-10,
                             atol=1e-12 * np.abs(explicit).max())


def test_separable_is_depthwise_diagonal_plus_pointwise_kfc():
  layer, data, params, fn = cases.separable(8, "kron", bias=True)
  x = data.inputs[0][0]
  grads = jax.jit(lambda: h.per_example_grads(
      lambda p, xb: fn(p, xb[0]), params, x, data.grads[0]))()
  n_dw = params[0].size
  dw = np.diag(np.diag(np.asarray(h.per_example_fisher(grads[..., :n_dw]))))
  dy = data.inputs[0][1].reshape(-1, params[1].shape[2])
  dy = np.concatenate([dy, np.ones((dy.shape[0], 1))], axis=1)
  g = np.asarray(data.grads[0]).reshape(data.grads[0].shape[0], -1,
                                        params[1].shape[3])
  n = dy.shape[0]
  pw = (n / data.batch_size) * np.kron(dy.T @ dy / n,
                                       np.einsum("snd,sne->de", g, g) / n)
  explicit = scipy.linalg.block_diag(dw, pw)
  full = _full(h.make_block(layer), data)
  np.testing.assert_allclose(full, explicit, rtol=1e-10,
                             atol=1e-12 * np.abs(explicit).max())


# ---------------------------------------------------------------------------
# Embeddings.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("k,sites", [(None, 1), (3, 1), (2, 2)])
def test_embedding_factors_are_lookup_moments(k, sites):
  """``A = E[e_id e_idᵀ]`` (diagonal) and ``G = E[g gᵀ]`` over lookups."""
  vocab = 5
  layer, data, params, _ = cases.embedding(9, vocab=vocab, k=k, sites=sites)
  ids = jnp.concatenate([inp[0].reshape(-1) for inp in data.inputs])
  g = jnp.concatenate([gr.reshape(gr.shape[0], -1, gr.shape[-1])
                       for gr in data.grads], axis=1)
  onehot = np.eye(vocab)[np.asarray(ids)]
  n = onehot.shape[0]
  a = onehot.T @ onehot / n
  explicit = (n / data.batch_size) * np.kron(
      a, np.einsum("snd,sne->de", g, g) / n)
  state = _stats_state(h.make_block(layer), data)
  assert state.a.shape == (vocab,)          # stored as its diagonal
  np.testing.assert_allclose(h.make_block(layer).full_fisher_block(state),
                             explicit, rtol=1e-12, atol=1e-14)


def test_embedding_kron_is_exact_fisher_for_one_id_and_shared_grads():
  """One id per example and one output gradient: K-FAC = the exact Fisher."""
  layer, data, params, fn = cases.embedding(10, vocab=4, k=None)
  shared = jnp.broadcast_to(data.grads[0][:, :1], data.grads[0].shape)
  data = data._replace(grads=(shared,))
  explicit = np.asarray(jax.jit(lambda: _explicit_fisher(fn, data, params))())
  np.testing.assert_allclose(_full(h.make_block(layer), data), explicit,
                             rtol=1e-12, atol=1e-14)


def test_embedding_50k_vocab_never_allocates_vocab_squared():
  """Update, cache and precondition a 50k table: no aval near vocab²."""
  vocab, dim = 50_000, 8
  layer = h.make_layer("embedding", "kron", [(vocab, dim)], num_uses=3,
                       dtype="float32")
  table = jnp.zeros((vocab, dim), jnp.float32)
  ids = jnp.zeros((4, 1, 3), jnp.int32)
  g = jnp.zeros((1, 4, 1, 3, dim), jnp.float32)
  data = h.layer_data([(ids,)], [g], (table,))
  for config in (dict(), dict(damping_type="exact"),
                 dict(compute_cholesky=True, compute_cholesky_inverse=True,
                      exps=(-1, -0.5))):
    block = h.make_block(layer, **config)

    def step(table):
      state = block.update_curvature(block.init(), block.compute_stats(data),
                                     0.9)
      state = block.update_cache(state, 1e-3)
      out = block.multiply_inverse(state, (table,))
      if config.get("compute_cholesky"):
        out += block.multiply_cholesky(state, (table,))
        out += block.multiply_cholesky_inverse(state, (table,), True)
        out += block.multiply_matpower(state, (table,), -0.5)
      return state, out

    jaxpr = jax.make_jaxpr(step)(table)
    biggest = max(h.aval_size(a) for a in h.all_avals(jaxpr.jaxpr))
    assert biggest == vocab * dim, (config, biggest)
    state, out = jax.eval_shape(step, table)
    assert max(x.size for x in jax.tree.leaves(state)) == vocab  # diag(A)


# ---------------------------------------------------------------------------
# Tied embeddings.
# ---------------------------------------------------------------------------


def _tied_terms(data, vocab):
  """Hand-computed ``(c_e, a, G, c_o, r, X)`` of a tied table (numpy)."""
  ids = np.asarray(data.inputs[0][0]).reshape(-1)
  g = np.asarray(data.grads[0]).reshape(data.grads[0].shape[0], -1,
                                        data.grads[0].shape[-1])
  x = np.asarray(data.inputs[1][0]).reshape(-1, g.shape[-1])
  delta = np.asarray(data.grads[1]).reshape(g.shape[0], -1, vocab)
  n_e, n_o, b = ids.size, x.shape[0], data.batch_size
  onehot = np.eye(vocab)[ids]
  a = np.diag(onehot.T @ onehot) / n_e           # lookup frequencies
  gg = sum(gs.T @ gs for gs in g) / n_e
  r = sum((ds ** 2).sum(0) for ds in delta) / n_o
  xx = x.T @ x / n_o
  return n_e / b, a, gg, n_o / b, r, xx


def test_tied_embedding_statistics_by_hand():
  """``c_e diag(a) ⊗ G + c_o diag(r) ⊗ X`` on a tiny vocab; the damped block
  is the sum of the two pi-damped terms with λ' = λ / (c_e + c_o)."""
  vocab, damping = 5, 0.1
  layer, data, params, _ = cases.tied(12, vocab=vocab, dim=3, k=2, t=3)
  block = h.make_block(layer)
  c_e, a, gg, c_o, r, xx = _tied_terms(data, vocab)
  assert (c_e, c_o) == (2, 3)
  explicit = c_e * np.kron(np.diag(a), gg) + c_o * np.kron(np.diag(r), xx)
  v = h.random_like(2, params)

  @jax.jit
  def run(v):
    state = h.fit(block, data, damping)
    return (block.full_fisher_block(state), block.multiply(state, v),
            block.multiply_inverse(state, v))

  full, m, mi = run(v)
  np.testing.assert_allclose(full, explicit, rtol=1e-12, atol=1e-14)
  assert np.linalg.eigvalsh(np.asarray(full)).min() > -1e-12
  lam = damping / (c_e + c_o)
  damped = 0.0
  for c, fv, fd in ((c_e, a, gg), (c_o, r, xx)):
    pi = np.sqrt(fv.mean() / (np.trace(fd) / fd.shape[0]))
    damped = damped + c * np.kron(np.diag(fv + pi * np.sqrt(lam)),
                                  fd + np.sqrt(lam) / pi * np.eye(3))
  vec = np.asarray(v[0]).reshape(-1)
  np.testing.assert_allclose(np.asarray(m[0]).reshape(-1), damped @ vec,
                             rtol=1e-10)
  np.testing.assert_allclose(np.asarray(mi[0]).reshape(-1),
                             np.linalg.solve(damped, vec), rtol=1e-8)


def test_tied_embedding_50k_vocab_never_allocates_vocab_squared():
  vocab, dim = 50_000, 8
  layer = h.make_layer("tied_embedding", "kron_sum", [(vocab, dim)],
                       num_uses=4, dtype="float32")
  table = jnp.zeros((vocab, dim), jnp.float32)
  data = h.layer_data(
      [(jnp.zeros((4, 1, 2), jnp.int32),), (jnp.zeros((4, 1, 2, dim)),)],
      [jnp.zeros((1, 4, 1, 2, dim)), jnp.zeros((1, 4, 1, 2, vocab))],
      (table,))
  block = h.make_block(layer, compute_cholesky=True)

  def step(table):
    state = block.update_curvature(block.init(), block.compute_stats(data),
                                   0.9)
    state = block.update_cache(state, 1e-3)
    return state, (block.multiply_inverse(state, (table,)),
                   block.multiply(state, (table,)),
                   block.multiply_cholesky(state, (table,), True),
                   block.multiply_cholesky_inverse(state, (table,)))

  jaxpr = jax.make_jaxpr(step)(table)
  biggest = max(h.aval_size(a) for a in h.all_avals(jaxpr.jaxpr))
  assert biggest == vocab * dim, biggest  # = the [S, B, t, vocab] grads
  with pytest.raises(ValueError, match="'kron_sum' supports exps -1 and 1"):
    h.make_block(layer, exps=(-1, -0.5)).multiply_matpower(
        block.init(), (table,), -0.5)
  with pytest.raises(ValueError, match="damping_type='pi' only"):
    h.make_block(layer, damping_type="exact")


# ---------------------------------------------------------------------------
# Reduced precision.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["conv_kron", "embedding_kron",
                                  "series_1"])
def test_bf16_params_give_float32_factors(name):
  with h.float32():
    layer, data, params, _, _ = cases.build(name)
    bf = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(  # noqa: E731
        x.dtype, jnp.floating) else x
    data = data._replace(inputs=jax.tree.map(bf, data.inputs),
                         grads=jax.tree.map(bf, data.grads))
    params = tuple(bf(p) for p in params)
    block = h.make_block(layer)
    v = h.random_like(1, params)

    @jax.jit
    def run(v):
      state = h.fit(block, data, 1e-3)
      return state, block.multiply_inverse(state, v)

    state, out = run(v)
    for x in jax.tree.leaves(state):
      assert x.dtype == jnp.float32, x.dtype
    for o, p in zip(out, params):
      assert o.dtype == jnp.bfloat16 and o.shape == p.shape
      assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32))))


# ---------------------------------------------------------------------------
# Errors name the argument, its value and the fix.
# ---------------------------------------------------------------------------


def test_conv_errors_are_helpful():
  base = dict(window_strides=(1, 1), padding="SAME",
              dimension_numbers=("NHWC", "HWIO", "NHWC"))
  grouped = h.make_layer("conv", "kron", [(2, 2, 1, 4)],
                         feature_group_count=2, **base)
  with pytest.raises(ValueError, match="feature_group_count=2"):
    h.make_block(grouped)
  batch_last = h.make_layer("conv", "kron", [(2, 2, 3, 4)],
                            window_strides=(1, 1), padding="SAME",
                            dimension_numbers=("HWCN", "HWIO", "HWCN"))
  with pytest.raises(ValueError, match="batch axis"):
    h.make_block(batch_last)
  strides = h.make_layer("conv", "kron", [(2, 2, 3, 4)],
                         **dict(base, window_strides=(1,)))
  with pytest.raises(ValueError, match=r"window_strides=\(1,\)"):
    h.make_block(strides)


def test_unsupported_products_raise_value_errors():
  layer, data, params, *_ = cases.build("conv_sua")
  block = h.make_block(layer, exps=(-1, 0.5))
  state = block.init()   # errors come at trace time, whatever the values
  with pytest.raises(ValueError, match="'kron_sua' supports exps -1 and 1"):
    block.multiply_matpower(state, params, 0.5)
  layer, data, params, *_ = cases.build("series_2")
  block = h.make_block(layer)
  state = block.init()
  with pytest.raises(ValueError, match="'kron_series_2' supports exp -1 "):
    block.multiply(state, params)
  with pytest.raises(ValueError, match="kron_series_2"):
    block.multiply_cholesky(state, params)
  with pytest.raises(ValueError, match="damping_type='pi' only"):
    h.make_block(layer, damping_type="exact")
  bad = h.make_layer("separable_conv", "kron", [(2, 2, 2, 2), (1, 1, 3, 3)],
                     window_strides=(1, 1), padding="SAME")
  with pytest.raises(ValueError, match=r"pointwise \[1, 1, C\*M, O\]"):
    h.make_block(bad)
