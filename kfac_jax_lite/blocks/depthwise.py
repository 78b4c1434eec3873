"""Depthwise and separable 2-D convolution blocks.

A depthwise conv with kernel ``w: [h, w, C, M]`` is the dense conv whose
``[h, w, C, C·M]`` filter :math:`\\tilde W` is zero off the channel
diagonal, :math:`\\tilde W[:, :, c, cM + m] = w[:, :, c, m]` (TF K-FAC
``depthwise_conv2d_filter_to_conv2d_filter``). Its parameters are a linear
subspace of the dense filter's, so its Fisher block is the restriction
:math:`R F_{dense} R^T` of the dense-equivalent one.

* ``diagonal``: the exact diagonal of the per-example Fisher,
  :math:`\\nabla_{s,b} w[p, c, m] = \\sum_t x_{b,t}[p, c]\\, g_{s,b,t}[cM+m]`
  (the dense-equivalent diagonal restricted to the depthwise entries).
* ``kron``: the KFC block :math:`c\\,\\Omega \\otimes \\Gamma` of the
  dense-equivalent conv (Grosse & Martens 2016, eq. 23), restricted to the
  depthwise entries and to its channel-diagonal blocks. Restricted to the
  entries of channel ``c`` it is exactly :math:`c\\,\\Omega_{cc} \\otimes
  \\Gamma_{cc}` with :math:`\\Omega_{cc}` the ``[hw, hw]`` patch moment of
  channel ``c`` and :math:`\\Gamma_{cc}` the ``[M, M]`` block of its
  outputs, so the block is a stack of ``C`` small Kronecker blocks. Unlike
  TF K-FAC, which applies the dense-equivalent ``(Ω ⊗ Γ)^{-1}`` and keeps
  the depthwise entries (not the inverse of the restricted block), products,
  inverses and square roots here are mutually consistent. The
  cross-channel blocks :math:`\\Omega_{cc'} \\otimes \\Gamma_{cc'}` are
  dropped, as a Kronecker factorisation drops cross-layer blocks.

A separable conv (``register_separable_conv2d``) is a depthwise conv
followed by a 1x1 pointwise conv on its output ``depthwise_y``; its block is
block-diagonal (TF K-FAC registers the two parts separately): the depthwise
part ``diagonal`` with output gradient :math:`g_{dw} = g_y W_{pw}^T` (the
1x1 conv's transpose), the pointwise part a KFC ``kron`` or ``diagonal``
block of a 1x1 conv on ``depthwise_y``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import conv
from kfac_jax_lite.blocks import diagonal
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.blocks import per_example
from kfac_jax_lite.collection import Layer


def _data_format(layer: Layer) -> str:
  fmt = layer.meta_dict.get("data_format", "NHWC")
  if fmt not in ("NHWC", "NCHW"):
    raise ValueError(
        f"Layer {layer.name!r}: data_format={fmt!r}; use 'NHWC' or 'NCHW'.")
  return fmt


def depthwise_geometry(layer: Layer, kernel_shape) -> conv.ConvGeometry:
  """Geometry of the dense-equivalent conv of a ``[h, w, C, M]`` kernel."""
  if len(kernel_shape) != 4:
    raise ValueError(
        f"Layer {layer.name!r}: depthwise kernel shape {kernel_shape}; "
        "expected [h, w, C, M]. Register other convolutions with "
        "register_conv(...).")
  h, w, c, m = kernel_shape
  fmt = _data_format(layer)
  return conv.conv_geometry(
      layer, kernel_shape=(h, w, c, c * m), feature_group_count=1,
      dimension_numbers=(fmt, "HWIO", fmt))


@dataclasses.dataclass(frozen=True)
class DepthwiseGrads:
  """Per-example depthwise gradients ``Σ_t x_t[p, c] g_t[c, m]``."""
  geometry: conv.ConvGeometry
  multiplier: int
  needs_param_grads = False

  def rows(self, data: base.LayerData):
    """Patches ``[B, R, hw, C]`` and gradients ``[S, B, R, C, M]``."""
    geo = self.geometry
    x = geo.site_patches(data, False)
    x = x.reshape(x.shape[:2] + (geo.window, geo.c_in))
    g = geo.site_grads(data)
    return x, g.reshape(g.shape[:3] + (geo.c_in, self.multiplier))

  def per_example(self, data: base.LayerData) -> tuple:
    x, g = self.rows(data)
    grad = per_example.fold_sources(jnp.einsum("brkc,sbrcm->sbkcm", x, g))
    h, w = self.geometry.spatial_shape
    return (grad.reshape(grad.shape[:1] + (h, w) + grad.shape[2:]),)

  def sum_squares(self, data: base.LayerData) -> tuple:
    return per_example.squares_of(self.per_example(data))


@dataclasses.dataclass(frozen=True)
class DepthwiseKronBlock(base.Block):
  """``C`` independent Kronecker blocks ``c Ω_cc ⊗ Γ_cc`` (module docstring).

  The state is a :class:`~.kronecker.KroneckerState` with a leading channel
  axis; ``inner`` (a :class:`~.kronecker.KroneckerBlock` on ``[hw, M]``
  matrices) is ``vmap``-ped over it.
  """
  layer: Layer
  config: base.BlockConfig
  source: DepthwiseGrads
  inner: kronecker.KroneckerBlock
  needs_param_grads = False

  @property
  def _channels(self) -> int:
    return self.source.geometry.c_in

  def init(self):
    c = self._channels
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (c,) + x.shape),
                        self.inner.init())

  def compute_stats(self, data: base.LayerData) -> dict:
    x, g = self.source.rows(data)
    n = x.shape[0] * x.shape[1]
    r = base.rows_per_example(n, data.batch_size, "depthwise conv layer")
    a = jnp.einsum("brkc,brlc->ckl", x, x) / n
    g = jnp.einsum("sbrcm,sbrcn->cmn", g, g) / n
    sym = lambda m: 0.5 * (m + jnp.swapaxes(m, 1, 2))  # noqa: E731
    scale = jnp.full((self._channels,), r, linalg.factor_dtype())
    return {"a": sym(a), "g": sym(g), "scale": scale}

  def update_curvature(self, state, stats, ema_decay):
    new = jax.vmap(self.inner.update_curvature, (0, 0, None))(
        state, stats, ema_decay)
    finite = linalg.all_finite(stats)
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)

  def update_cache(self, state, damping):
    return jax.vmap(self.inner.update_cache, (0, None))(state, damping)

  def _per_channel(self, fn, state, v):
    """Applies ``fn(state_c, (v_c,))`` per channel, ``v_c: [hw, M]``."""
    h, w, c, m = v[0].shape
    vc = jnp.moveaxis(v[0].reshape(h * w, c, m), 1, 0)
    out = jax.vmap(lambda s, x: fn(s, (x,))[0])(state, vc)
    return (jnp.moveaxis(out, 0, 1).reshape(v[0].shape),)

  def multiply_matpower(self, state, v, exp):
    exp = base.check_exp(self, exp)
    return self._per_channel(
        lambda s, x: self.inner.multiply_matpower(s, x, exp), state, v)

  def multiply_cholesky(self, state, v, transpose=False):
    if self.config.damping_type == "pi":
      base.check_cached(self, "compute_cholesky", "multiply_cholesky")
    return self._per_channel(
        lambda s, x: self.inner.multiply_cholesky(s, x, transpose), state, v)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    if self.config.damping_type == "pi":
      base.check_cached(self, "compute_cholesky_inverse",
                        "multiply_cholesky_inverse")
    return self._per_channel(
        lambda s, x: self.inner.multiply_cholesky_inverse(s, x, transpose),
        state, v)

  def full_fisher_block(self, state):
    """Block-diagonal over channels, in ravel order of ``[h, w, C, M]``."""
    blocks = jax.vmap(self.inner.full_fisher_block)(state)
    c, m = self._channels, self.source.multiplier
    k = self.source.geometry.window
    idx = np.arange(k * c * m).reshape(k, c, m).transpose(1, 0, 2)
    idx = jnp.asarray(idx.reshape(c, k * m))
    out = jnp.zeros((k * c * m,) * 2, blocks.dtype)
    return out.at[idx[:, :, None], idx[:, None, :]].set(blocks)


def _depthwise_source(layer: Layer) -> DepthwiseGrads:
  shape = layer.param_shapes[0]
  return DepthwiseGrads(depthwise_geometry(layer, shape), shape[3])


def depthwise_diagonal_block(layer: Layer, config: base.BlockConfig):
  """``diagonal`` block of a depthwise conv."""
  return diagonal.DiagonalBlock(layer=layer, config=config,
                                source=_depthwise_source(layer),
                                param_shapes=layer.param_shapes)


def depthwise_kron_block(layer: Layer, config: base.BlockConfig):
  """``kron`` block of a depthwise conv: one Kronecker block per channel."""
  source = _depthwise_source(layer)
  layout = kronecker.MatrixLayout(a_dim=source.geometry.window,
                                  g_dim=source.multiplier,
                                  init_scale=layer.num_uses)
  inner = kronecker.KroneckerBlock(layer=None, config=config, layout=layout)
  return DepthwiseKronBlock(layer=layer, config=config, source=source,
                            inner=inner)


# ---------------------------------------------------------------------------
# Separable convolutions.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SeparableConvBlock(base.Block):
  """``blockdiag(F_depthwise, F_pointwise)`` for ``(dw, pw[, b])``.

  Both parts are ordinary blocks (without a layer of their own) fed with
  re-arranged :class:`~.base.LayerData`; the state is their pair.
  """
  layer: Layer
  config: base.BlockConfig
  depthwise: Any
  pointwise: Any
  channel_axis: int   # of the output y, per example (3 for NHWC, 1 NCHW)
  needs_param_grads = False

  def init(self):
    return (self.depthwise.init(), self.pointwise.init())

  def _depthwise_grads(self, g, pw):
    """``g_dw = g_y W_pwᵀ`` for ``g: [S, B, U, *y_shape[1:]]``."""
    dt = linalg.factor_dtype()
    axis = 2 + self.channel_axis
    w = pw.astype(dt).reshape(pw.shape[-2:])
    out = jnp.moveaxis(g.astype(dt), axis, -1) @ w.T
    return jnp.moveaxis(out, -1, axis)

  def compute_stats(self, data: base.LayerData) -> tuple:
    pw = data.params[1]
    dw_data = data._replace(
        inputs=tuple((inp[0],) for inp in data.inputs),
        grads=tuple(self._depthwise_grads(g, pw) for g in data.grads),
        params=data.params[:1])
    pw_data = data._replace(inputs=tuple((inp[1],) for inp in data.inputs),
                            params=data.params[1:])
    return (self.depthwise.compute_stats(dw_data),
            self.pointwise.compute_stats(pw_data))

  def update_curvature(self, state, stats, ema_decay):
    return (self.depthwise.update_curvature(state[0], stats[0], ema_decay),
            self.pointwise.update_curvature(state[1], stats[1], ema_decay))

  def update_cache(self, state, damping):
    return (self.depthwise.update_cache(state[0], damping),
            self.pointwise.update_cache(state[1], damping))

  def _both(self, fn, state, v):
    return (fn(self.depthwise, state[0], v[:1]) +
            fn(self.pointwise, state[1], v[1:]))

  def multiply_matpower(self, state, v, exp):
    exp = base.check_exp(self, exp)
    return self._both(lambda b, s, x: b.multiply_matpower(s, x, exp),
                      state, v)

  def _check_cholesky(self, flag, what):
    if (self.config.damping_type == "pi" and
        isinstance(self.pointwise, kronecker.KroneckerBlock)):
      base.check_cached(self, flag, what)

  def multiply_cholesky(self, state, v, transpose=False):
    self._check_cholesky("compute_cholesky", "multiply_cholesky")
    return self._both(lambda b, s, x: b.multiply_cholesky(s, x, transpose),
                      state, v)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    self._check_cholesky("compute_cholesky_inverse",
                         "multiply_cholesky_inverse")
    return self._both(
        lambda b, s, x: b.multiply_cholesky_inverse(s, x, transpose), state, v)

  def full_fisher_block(self, state):
    return jax.scipy.linalg.block_diag(
        self.depthwise.full_fisher_block(state[0]),
        self.pointwise.full_fisher_block(state[1]))


def separable_block(layer: Layer, config: base.BlockConfig):
  """Separable conv: depthwise ``diagonal`` + pointwise ``kron``/``diagonal``.

  Raises:
    ValueError: unless the params are ``(dw [h, w, C, M], pw [1, 1, C·M,
      O][, b [O]])``.
  """
  shapes = layer.param_shapes
  ok = (len(shapes) in (2, 3) and len(shapes[0]) == 4 and
        len(shapes[1]) == 4 and tuple(shapes[1][:2]) == (1, 1) and
        shapes[1][2] == shapes[0][2] * shapes[0][3])
  if not ok:
    raise ValueError(
        f"Layer {layer.name!r}: separable conv parameter shapes {shapes}; "
        "expected depthwise [h, w, C, M], pointwise [1, 1, C*M, O] and an "
        "optional bias [O].")
  fmt = _data_format(layer)
  sub = lambda **kw: dataclasses.replace(layer, **kw)  # noqa: E731
  dw_layer = sub(kind="depthwise_conv", approx="diagonal",
                 param_paths=layer.param_paths[:1],
                 param_indices=layer.param_indices[:1],
                 param_shapes=shapes[:1], param_dtypes=layer.param_dtypes[:1])
  pw_meta = (("dimension_numbers", (fmt, "HWIO", fmt)), ("padding", "VALID"),
             ("window_strides", (1, 1)))
  pw_layer = sub(kind="conv", param_paths=layer.param_paths[1:],
                 param_indices=layer.param_indices[1:],
                 param_shapes=shapes[1:], param_dtypes=layer.param_dtypes[1:],
                 meta=pw_meta)
  make_pw = (conv.conv_kron_block if layer.approx == "kron"
             else conv.conv_diagonal_block)
  strip = lambda b: dataclasses.replace(b, layer=None)  # noqa: E731
  return SeparableConvBlock(
      layer=layer, config=config,
      depthwise=strip(depthwise_diagonal_block(dw_layer, config)),
      pointwise=strip(make_pw(pw_layer, config)),
      channel_axis=3 if fmt == "NHWC" else 1)
