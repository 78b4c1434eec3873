"""Small random layers of every (kind, approx), as LayerData built by hand.

Each builder returns ``(layer, data, params, layer_fn)``: the static layer
description, one batch of recorded inputs / output gradients, the parameter
values, and (where a per-example check needs it) ``layer_fn(params, x)``
computing the layer output from one site's input ``x: [N, ...]``.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from tests import blocks_helpers as h

S, B = 2, 6


def _normal(key, shape):
  """Gaussian test data from a numpy RNG seeded by ``key`` (an int)."""
  return jnp.asarray(np.random.default_rng(key).standard_normal(shape))


def _split(key, n=2):
  return [key * 7919 + i + 1 for i in range(n)]


def trailing(p, ndim):
  """``p`` reshaped to broadcast against a rank-``ndim`` array explicitly."""
  return p.reshape((1,) * (ndim - p.ndim) + p.shape)


def _grads_for(key, y_shape, uses=1):
  """Output gradients ``[S, B, U, *y_shape[1:]]``."""
  return _normal(key, (S, B, uses) + tuple(y_shape[1:]))


def dense(key, approx="kron", bias=True, uses=1, sites=1, d_in=3, d_out=2):
  ks = _split(key, 4)
  params = (_normal(ks[0], (d_in, d_out)),)
  if bias:
    params += (_normal(ks[1], (d_out,)),)
  inputs, grads = [], []
  for k in _split(ks[2], sites):
    k1, k2 = _split(k)
    inputs.append((_normal(k1, (B, uses, d_in)),))
    grads.append(_normal(k2, (S, B, uses, d_out)))
  layer = h.make_layer("fully_connected", approx, [p.shape for p in params],
                       num_uses=uses * sites)
  def fn(p, x):
    y = x @ p[0]
    return y + trailing(p[1], y.ndim) if bias else y
  return layer, h.layer_data(inputs, grads, params), params, fn


def generic(key, approx="diagonal"):
  ks = _split(key, 4)
  params = (_normal(ks[0], (3, 2)), _normal(ks[1], (4,)))
  pg = (_normal(ks[2], (S, 3, 2)), _normal(ks[3], (S, 4)))
  layer = h.make_layer("generic", approx, [p.shape for p in params])
  data = h.layer_data([], [jnp.zeros((S, B, 1))], params, pg)
  return layer, data, params, None


CONV_META = {
    "nhwc_same_strided": dict(
        x=(B, 5, 4, 2), w=(2, 2, 2, 3), window_strides=(2, 1),
        padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
    "nhwc_valid_dilated": dict(
        x=(B, 6, 5, 2), w=(2, 2, 2, 3), window_strides=(1, 1),
        padding="VALID", rhs_dilation=(2, 1),
        dimension_numbers=("NHWC", "HWIO", "NHWC")),
    "nchw_oihw_explicit": dict(
        x=(B, 2, 5, 4), w=(3, 2, 2, 2), window_strides=(1, 2),
        padding=((1, 0), (0, 1)), lhs_dilation=(2, 1),
        dimension_numbers=None),
    "nwc_1d_same": dict(
        x=(B, 7, 2), w=(3, 2, 3), window_strides=(2,), padding="SAME",
        dimension_numbers=("NWC", "WIO", "NWC")),
    "ndhwc_3d_valid": dict(
        x=(B, 3, 4, 3, 2), w=(2, 2, 1, 2, 2), window_strides=(1, 1, 1),
        padding="VALID", dimension_numbers=("NDHWC", "DHWIO", "NDHWC")),
    "nhwc_1x1": dict(
        x=(B, 3, 3, 3), w=(1, 1, 3, 2), window_strides=(1, 1),
        padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
}


def rhs_spec(meta) -> str:
  dn = meta.get("dimension_numbers")
  if dn is None:
    return "OI" + "HWD"[: len(meta["w"]) - 2]
  return dn[1]


def conv_fn(meta):
  kw = {k: v for k, v in meta.items() if k not in ("x", "w")}
  def fn(p, x):
    y = lax.conv_general_dilated(x, p[0], **kw)
    if len(p) > 1:
      dn = lax.conv_dimension_numbers(x.shape, p[0].shape,
                                      kw.get("dimension_numbers"))
      shape = [1] * y.ndim
      shape[dn.out_spec[1]] = -1
      y = y + p[1].reshape(shape)
    return y
  return fn


def _conv_arrays(key, meta, fn_meta, bias, uses=1):
  """Kernel (and bias) of shape ``meta["w"]``, ``conv_fn(fn_meta)``, inputs
  ``[N, uses, ...]`` of shape ``meta["x"]`` and matching output grads."""
  ks = _split(key, 4)
  w = _normal(ks[0], meta["w"])
  c_out = meta["w"][rhs_spec(meta).index("O")]
  params = (w, _normal(ks[1], (c_out,))) if bias else (w,)
  fn = conv_fn(fn_meta)
  x = _normal(ks[2], (meta["x"][0], uses) + meta["x"][1:])
  y_shape = jax.eval_shape(lambda: fn(params, x[:, 0])).shape
  return params, fn, x, _grads_for(ks[3], y_shape, uses)


def conv(key, approx="kron", case="nhwc_same_strided", bias=True, uses=1):
  meta = CONV_META[case]
  params, fn, x, g = _conv_arrays(key, meta, meta, bias, uses)
  tag_meta = {k: v for k, v in meta.items() if k not in ("x", "w")}
  layer = h.make_layer("conv", approx, [p.shape for p in params],
                       num_uses=uses, **tag_meta)
  return layer, h.layer_data([(x,)], [g], params), params, fn


DEPTHWISE_META = dict(window_strides=(2, 1), padding="SAME",
                      rhs_dilation=(1, 2))


def depthwise_fn(data_format="NHWC", **meta):
  def fn(p, x):
    kh, kw, c, m = p[0].shape
    return lax.conv_general_dilated(
        x, p[0].reshape(kh, kw, 1, c * m), meta["window_strides"],
        meta["padding"], rhs_dilation=meta["rhs_dilation"],
        dimension_numbers=(data_format, "HWIO", data_format),
        feature_group_count=c)
  return fn


def depthwise(key, approx="diagonal", mult=2, data_format="NHWC"):
  ks = _split(key, 3)
  params = (_normal(ks[0], (2, 3, 2, mult)),)
  shape = (B, 5, 6, 2) if data_format == "NHWC" else (B, 2, 5, 6)
  x = _normal(ks[1], (B, 1) + shape[1:])
  fn = depthwise_fn(data_format, **DEPTHWISE_META)
  y_shape = jax.eval_shape(lambda: fn(params, x[:, 0])).shape
  g = _grads_for(ks[2], y_shape)
  layer = h.make_layer("depthwise_conv", approx, [params[0].shape],
                       data_format=data_format, **DEPTHWISE_META)
  return layer, h.layer_data([(x,)], [g], params), params, fn


# Depthwise convs as lax/flax write them: feature_group_count = C, kernel in
# the rhs layout with in-features 1 and out-features C·M (output o = c·M + m).
DEPTHWISE_LAX = {
    "nwc_1d": dict(x=(B, 7, 3), w=(3, 1, 6), window_strides=(2,),
                   padding=((1, 1),), dimension_numbers=("NWC", "WIO", "NWC")),
    "nhwc_2d": dict(x=(B, 5, 4, 2), w=(2, 3, 1, 4), window_strides=(1, 2),
                    padding="SAME", rhs_dilation=(2, 1),
                    dimension_numbers=("NHWC", "HWIO", "NHWC")),
    "nchw_oihw": dict(x=(B, 2, 5, 4), w=(2, 1, 2, 2), window_strides=(1, 1),
                      padding="VALID", dimension_numbers=None),
    "ndhwc_3d": dict(x=(B, 3, 4, 3, 2), w=(2, 2, 1, 1, 4),
                     window_strides=(1, 1, 1), padding="VALID",
                     dimension_numbers=("NDHWC", "DHWIO", "NDHWC")),
}


def depthwise_lax_meta(case):
  """(conv kwargs for lax, the tag metadata the scanner stores)."""
  meta = DEPTHWISE_LAX[case]
  kw = {k: v for k, v in meta.items() if k not in ("x", "w")}
  channels = meta["x"][1 if kw["dimension_numbers"] is None else -1]
  kw["feature_group_count"] = channels
  dn = lax.conv_dimension_numbers(meta["x"], meta["w"],
                                  kw["dimension_numbers"])
  stored = dict(kw, dimension_numbers=tuple(tuple(d) for d in dn),
                padding=kw["padding"] if isinstance(kw["padding"], str)
                else tuple(tuple(p) for p in kw["padding"]),
                rhs_dilation=kw.get("rhs_dilation"), lhs_dilation=None)
  return kw, stored


def depthwise_lax(key, approx="diagonal", case="nhwc_2d", bias=True):
  """A recognised depthwise conv (kind ``depthwise_conv``, lax layout)."""
  kw, stored = depthwise_lax_meta(case)
  meta = DEPTHWISE_LAX[case]
  params, fn, x, g = _conv_arrays(key, meta, kw, bias)
  layer = h.make_layer("depthwise_conv", approx, [p.shape for p in params],
                       **stored)
  return layer, h.layer_data([(x,)], [g], params), params, fn


def separable(key, approx="kron", bias=True):
  ks = _split(key, 5)
  params = (_normal(ks[0], (2, 2, 2, 2)), _normal(ks[1], (1, 1, 4, 3)))
  if bias:
    params += (_normal(ks[2], (3,)),)
  dw_fn = depthwise_fn("NHWC", **DEPTHWISE_META)
  def fn(p, x):
    dy = dw_fn(p[:1], x)
    y = jnp.einsum("bhwc,co->bhwo", dy, p[1][0, 0])
    return y + trailing(p[2], 4) if len(p) > 2 else y
  x = _normal(ks[3], (B, 1, 5, 4, 2))
  dy = dw_fn(params, x[:, 0])[:, None]
  y_shape = jax.eval_shape(lambda: fn(params, x[:, 0])).shape
  g = _grads_for(ks[4], y_shape)
  layer = h.make_layer("separable_conv", approx, [p.shape for p in params],
                       data_format="NHWC", **DEPTHWISE_META)
  return layer, h.layer_data([(x, dy)], [g], params), params, fn


def embedding(key, approx="kron", vocab=5, dim=3, k=2, sites=1):
  ks = _split(key, 3)
  params = (_normal(ks[0], (vocab, dim)),)
  inputs, grads = [], []
  for kk in _split(ks[1], sites):
    k1, k2 = _split(kk)
    shape = (B, 1) if k is None else (B, 1, k)
    ids = jnp.asarray(np.random.default_rng(k1).integers(0, vocab, shape))
    inputs.append((ids,))
    grads.append(_normal(k2, (S,) + shape + (dim,)))
  uses = (1 if k is None else k) * sites
  layer = h.make_layer("embedding", approx, [params[0].shape],
                       num_uses=uses)
  return layer, h.layer_data(inputs, grads, params), params, (
      lambda p, ids: p[0][ids])


def tied(key, vocab=5, dim=3, k=2, t=3):
  """A tied table: ids ``[B, k]`` looked up, ``x: [B, t, dim] @ table.T``.

  Sites in trace order: the lookup (integer ids), then the attend (float x).
  """
  ks = _split(key, 5)
  params = (_normal(ks[0], (vocab, dim)),)
  ids = jnp.asarray(np.random.default_rng(ks[1]).integers(0, vocab,
                                                          (B, 1, k)))
  g = _normal(ks[2], (S, B, 1, k, dim))
  x = _normal(ks[3], (B, 1, t, dim))
  delta = _normal(ks[4], (S, B, 1, t, vocab))
  layer = h.make_layer("tied_embedding", "kron_sum", [params[0].shape],
                       num_uses=k + t)
  return layer, h.layer_data([(ids,), (x,)], [g, delta], params), params, None


SCALE_SHIFT_SHAPES = {
    "layernorm": ((B, 4, 3), (3,), (3,)),
    "batchnorm_conv": ((B, 3, 2, 2), (2,), (2,)),
    "leading_ones": ((B, 3, 2), (1, 1, 2), (1, 2)),
    "rmsnorm": ((B, 5, 3), (3,), None),
    "per_position": ((B, 2, 3), (2, 3), (3,)),
}


def scale_and_shift(key, approx="full", case="layernorm"):
  x_shape, scale_shape, shift_shape = SCALE_SHIFT_SHAPES[case]
  ks = _split(key, 4)
  params = (_normal(ks[0], scale_shape),)
  if shift_shape is not None:
    params += (_normal(ks[1], shift_shape),)
  def fn(p, x):
    y = x * trailing(p[0], x.ndim)
    return y + trailing(p[1], x.ndim) if len(p) > 1 else y
  x = _normal(ks[2], (B, 1) + x_shape[1:])
  y_shape = jax.eval_shape(lambda: fn(params, x[:, 0])).shape
  g = _grads_for(ks[3], y_shape)
  layer = h.make_layer("scale_and_shift", approx, [p.shape for p in params])
  return layer, h.layer_data([(x,)], [g], params), params, fn


def series(key, approx="kron_series_1", t=3, bias=True, d_in=3, d_out=2,
           rho=0.6):
  """An AR(1)-like sequence so the lag-1 moments are far from zero."""
  ks = _split(key, 5)
  params = (_normal(ks[0], (d_in, d_out)),)
  if bias:
    params += (_normal(ks[1], (d_out,)),)
  def ar(k, shape):
    noise = np.asarray(_normal(k, shape))
    out = np.zeros(shape)
    for t in range(shape[-2]):
      prev = out[..., t - 1, :] if t else 0.0
      out[..., t, :] = rho * prev + noise[..., t, :]
    return jnp.asarray(out)
  x = ar(ks[2], (B * 4, t, d_in))
  g = ar(ks[3], (S, B * 4, t, d_out))
  layer = h.make_layer("fully_connected", approx, [p.shape for p in params],
                       num_uses=t)
  return layer, h.layer_data([(x,)], [g], params), params, None


# name -> (builder, kwargs, supports): supports lists what the block offers.
ALL = ("inverse", "power", "cholesky", "exact")
CASES = {
    "dense_kron": (dense, {}, ALL),
    "dense_kron_uses": (dense, dict(uses=3, sites=2), ALL),
    "dense_kron_in_diag": (dense, dict(approx="kron_in_diag"), ALL),
    "dense_kron_both_diag": (dense, dict(approx="kron_both_diag"), ALL),
    "dense_diagonal": (dense, dict(approx="diagonal"), ALL),
    "dense_full": (dense, dict(approx="full", d_in=2), ALL),
    "dense_full_uses": (dense, dict(approx="full", d_in=2, uses=2), ALL),
    "generic_diagonal": (generic, dict(approx="diagonal"), ALL),
    "generic_full": (generic, dict(approx="full"), ALL),
    "conv_kron": (conv, {}, ALL),
    "conv_kron_oihw": (conv, dict(case="nchw_oihw_explicit"), ALL),
    "conv_kron_indep": (conv, dict(approx="kron_indep", uses=2), ALL),
    "conv_diagonal": (conv, dict(approx="diagonal"), ALL),
    "conv_sua": (conv, dict(approx="kron_sua"),
                 ("inverse", "cholesky", "exact")),
    "conv_sua_nobias_oihw": (
        conv, dict(approx="kron_sua", bias=False, case="nchw_oihw_explicit"),
        ("inverse", "cholesky", "exact")),
    "depthwise_diagonal": (depthwise, dict(approx="diagonal"), ALL),
    "depthwise_kron": (depthwise, dict(approx="kron"), ALL),
    "depthwise_kron_nchw": (
        depthwise, dict(approx="kron", data_format="NCHW", mult=1), ALL),
    "depthwise_lax_diagonal": (depthwise_lax, dict(approx="diagonal"), ALL),
    "depthwise_lax_kron": (depthwise_lax, dict(approx="kron"), ALL),
    "depthwise_lax_kron_oihw": (
        depthwise_lax, dict(approx="kron", case="nchw_oihw", bias=False), ALL),
    "separable_kron": (separable, dict(approx="kron"), ALL),
    "separable_diagonal": (separable, dict(approx="diagonal", bias=False),
                           ALL),
    "embedding_kron": (embedding, {}, ALL),
    "embedding_kron_indep": (embedding, dict(approx="kron_indep", sites=2),
                             ALL),
    "tied_kron_sum": (tied, {}, ("inverse", "cholesky")),
    "scale_and_shift_full": (scale_and_shift, {}, ALL),
    "scale_and_shift_diagonal": (scale_and_shift, dict(approx="diagonal"),
                                 ALL),
    "series_1": (series, dict(approx="kron_series_1"), ("inverse",)),
    "series_2": (series, dict(approx="kron_series_2"), ()),
}


def build(name, seed=0):
  fn, kwargs, supports = CASES[name]
  return fn(seed, **kwargs) + (supports,)


def numpy(x):
  return np.asarray(x)
