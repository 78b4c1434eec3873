"""Depthwise and separable convolution blocks (1-, 2-, 3-D).

A depthwise conv with ``C`` input channels and channel multiplier ``M`` is
the dense conv whose ``[*spatial, C, C·M]`` filter :math:`\\tilde W` is zero
off the channel diagonal, :math:`\\tilde W[\\ldots, c, cM + m] = w[\\ldots, c,
m]` (TF K-FAC ``depthwise_conv2d_filter_to_conv2d_filter``). Its parameters
are a linear subspace of the dense filter's, so its Fisher block is the
restriction :math:`R F_{dense} R^T` of the dense-equivalent one.

Two kernel layouts reach these blocks; :class:`DepthwiseLayout` maps both to
a canonical ``[K, C, M]`` array (``K`` the spatial window, flattened in the
kernel's spatial order) and back:

* ``register_depthwise_conv2d``: ``w: [h, w, C, M]`` with a ``data_format``
  (``NHWC``/``NCHW``); canonical is a reshape;
* a recognised ``lax.conv_general_dilated`` with ``feature_group_count ==
  C`` (flax ``nn.Conv(..., feature_group_count=C)``): the kernel is in its
  ``dimension_numbers``' rhs layout with in-features 1 and out-features
  ``C·M`` (``[*spatial, 1, C·M]`` for flax), output channel ``o = cM + m``;
  canonical is the transpose to ``[*spatial, 1, C·M]`` and a reshape.
  Strides, padding, dilations and dimension numbers are the matched conv's,
  and an optional bias ``[C·M]`` is one more input row per channel.

* ``diagonal``: the exact diagonal of the per-example Fisher,
  :math:`\\nabla_{s,b} w[k, c, m] = \\sum_t x_{b,t}[k, c]\\, g_{s,b,t}[cM+m]`
  and :math:`\\nabla_{s,b} b[cM+m] = \\sum_t g_{s,b,t}[cM+m]` (the
  dense-equivalent diagonal restricted to the depthwise entries).
* ``kron``: the KFC block :math:`c\\,\\Omega \\otimes \\Gamma` of the
  dense-equivalent conv (Grosse & Martens 2016, eq. 23), restricted to the
  depthwise entries and to its channel-diagonal blocks. Restricted to the
  entries of channel ``c`` it is exactly :math:`c\\,\\Omega_{cc} \\otimes
  \\Gamma_{cc}` with :math:`\\Omega_{cc}` the ``[K, K]`` patch moment of
  channel ``c`` (``[K+1, K+1]`` with the homogeneous coordinate of a bias)
  and :math:`\\Gamma_{cc}` the ``[M, M]`` block of its outputs, so the block
  is a stack of ``C`` small Kronecker blocks. Unlike TF K-FAC, which applies
  the dense-equivalent ``(Ω ⊗ Γ)^{-1}`` and keeps the depthwise entries (not
  the inverse of the restricted block), products, inverses and square roots
  here are mutually consistent. The cross-channel blocks
  :math:`\\Omega_{cc'} \\otimes \\Gamma_{cc'}` are dropped, as a Kronecker
  factorisation drops cross-layer blocks.

Grouped convolutions with ``1 < feature_group_count < C`` have no block (the
scanner falls back to a generic layer and says so).

A separable conv (``register_separable_conv2d``) is a depthwise conv
followed by a 1x1 pointwise conv on its output ``depthwise_y``; its block is
block-diagonal (TF K-FAC registers the two parts separately): the depthwise
part ``diagonal`` with output gradient :math:`g_{dw} = g_y W_{pw}^T` (the
1x1 conv's transpose), the pointwise part a KFC ``kron`` or ``diagonal``
block of a 1x1 conv on ``depthwise_y``.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import combinators
from kfac_jax_lite.blocks import conv
from kfac_jax_lite.blocks import diagonal
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.blocks import layouts
from kfac_jax_lite.blocks import per_example
from kfac_jax_lite.layer import Layer


def _data_format(layer: Layer) -> str:
  fmt = layer.meta_dict.get("data_format", "NHWC")
  if fmt not in ("NHWC", "NCHW"):
    raise ValueError(
        f"Layer {layer.name!r}: data_format={fmt!r}; use 'NHWC' or 'NCHW'.")
  return fmt


@dataclasses.dataclass(frozen=True)
class DepthwiseLayout:
  """A depthwise kernel (and bias) <-> canonical ``[K, C, M]`` (and ``[C, M]``).

  Attributes:
    geometry: the dense-equivalent conv (``C`` -> ``C·M``, no groups).
    kernel_shape: the stored kernel's shape.
    perm: stored kernel axes in the order ``(*spatial, a, b)`` where the
      transposed kernel ``[*spatial, a, b]`` reshapes row-major to
      ``[*spatial, C, M]`` (``(C, M)`` for ``[h, w, C, M]``, ``(1, C·M)``
      for the lax layout).
    multiplier: ``M``.
    has_bias: a ``[C·M]`` bias follows the kernel.
  """
  geometry: conv.ConvGeometry
  kernel_shape: tuple
  perm: tuple
  multiplier: int
  has_bias: bool

  @property
  def channels(self) -> int:
    return self.geometry.c_in

  @property
  def window(self) -> int:
    return self.geometry.window

  def canonical(self, w):
    """Kernel (stored layout, jnp or np) -> ``[K, C, M]``."""
    return w.transpose(self.perm).reshape(
        self.window, self.channels, self.multiplier)

  def stored(self, m):
    """``[*lead, K, C, M]`` -> ``[*lead, *kernel_shape]``."""
    lead = m.shape[:-3]
    t_shape = tuple(self.kernel_shape[i] for i in self.perm)
    m = m.reshape(lead + t_shape)
    n = len(lead)
    inv = tuple(int(i) for i in np.argsort(self.perm))
    return m.transpose(tuple(range(n)) + tuple(n + i for i in inv))

  def channel_index(self) -> np.ndarray:
    """``[C, (K (+1))·M]``: ravel position of each per-channel matrix entry."""
    n = int(math.prod(self.kernel_shape))
    idx = self.canonical(np.arange(n).reshape(self.kernel_shape))
    idx = idx.transpose(1, 0, 2)                      # [C, K, M]
    if self.has_bias:
      bias = n + np.arange(self.channels * self.multiplier)
      idx = np.concatenate(
          [idx, bias.reshape(self.channels, 1, self.multiplier)], axis=1)
    return idx.reshape(self.channels, -1)


def depthwise_layout(layer: Layer) -> DepthwiseLayout:
  """The :class:`DepthwiseLayout` of a depthwise layer from its metadata.

  A ``feature_group_count`` in the metadata (a recognised
  ``conv_general_dilated``) means the lax kernel layout; otherwise the
  kernel is ``register_depthwise_conv2d``'s ``[h, w, C, M]``.

  Raises:
    ValueError: for a kernel whose shape does not fit its layout (e.g. a
      grouped conv with ``1 < feature_group_count < C``).
  """
  shape = tuple(layer.param_shapes[0])
  has_bias = layer.has_bias
  meta = layer.meta_dict
  if "feature_group_count" not in meta:
    if len(shape) != 4:
      raise ValueError(
          f"Layer {layer.name!r}: depthwise kernel shape {shape}; expected "
          "[h, w, C, M]. Register other convolutions with register_conv(...).")
    h, w, c, m = shape
    fmt = _data_format(layer)
    geo = conv.conv_geometry(
        layer, kernel_shape=(h, w, c, c * m), feature_group_count=1,
        dimension_numbers=(fmt, "HWIO", fmt))
    return DepthwiseLayout(geo, shape, (0, 1, 2, 3), m, has_bias)
  c = int(meta["feature_group_count"])
  dn = conv.conv_dimension_numbers(meta.get("dimension_numbers"), shape)
  i_axis, o_axis = dn.rhs_spec[1], dn.rhs_spec[0]
  if shape[i_axis] != 1 or shape[o_axis] % c:
    raise ValueError(
        f"Layer {layer.name!r}: kernel shape {shape} with feature_group_count"
        f"={c} is not a depthwise kernel (in-features 1, out-features a "
        f"multiple of {c}); grouped convolutions with 1 < groups < C have no "
        "block. Register it with register_generic(...).")
  dense_shape = tuple(c if a == i_axis else n for a, n in enumerate(shape))
  geo = conv.conv_geometry(layer, kernel_shape=dense_shape,
                           feature_group_count=1, dimension_numbers=dn)
  return DepthwiseLayout(geo, shape, geo.perm, shape[o_axis] // c, has_bias)


@dataclasses.dataclass(frozen=True)
class DepthwiseGrads:
  """Per-example depthwise gradients ``Σ_t x_t[k, c] g_t[c, m]`` (+ bias)."""
  layout: DepthwiseLayout
  needs_param_grads = False

  def rows(self, data: base.LayerData):
    """Patches ``[B, R, K, C]`` and gradients ``[S, B, R, C, M]``."""
    lay = self.layout
    geo = lay.geometry
    x = geo.site_patches(data, False)
    x = x.reshape(x.shape[:2] + (geo.window, geo.c_in))
    g = geo.site_grads(data)
    return x, g.reshape(g.shape[:3] + (geo.c_in, lay.multiplier))

  def per_example(self, data: base.LayerData) -> tuple:
    x, g = self.rows(data)
    grad = per_example.fold_sources(jnp.einsum("brkc,sbrcm->sbkcm", x, g))
    out = (self.layout.stored(grad),)
    if self.layout.has_bias:
      bias = per_example.fold_sources(jnp.sum(g, axis=2))
      out += (bias.reshape(bias.shape[0], -1),)
    return out

  def sum_squares(self, data: base.LayerData) -> tuple:
    return per_example.squares_of(self.per_example(data))


@dataclasses.dataclass(frozen=True)
class ChannelAxis:
  """The channel axis of a depthwise ``kron`` block: ``C`` Kronecker blocks
  ``c Ω_cc ⊗ Γ_cc`` on ``[K(+1), M]`` matrices (module docstring), for
  :class:`~.combinators.VmappedBlock`. The channels are one layer: a
  non-finite statistic leaves them all unchanged."""
  source: DepthwiseGrads
  all_or_nothing = True

  @property
  def _layout(self) -> DepthwiseLayout:
    return self.source.layout

  def stats(self, inner, data: base.LayerData) -> dict:
    """Every channel's ``{"a", "g", "scale"}`` at once, ``[C, ...]``."""
    del inner
    x, g = self.source.rows(data)
    if self._layout.has_bias:
      x = jnp.concatenate([x, jnp.ones(x.shape[:2] + (1,) + x.shape[3:],
                                       x.dtype)], axis=2)
    n = x.shape[0] * x.shape[1]
    r = base.rows_per_example(n, data.batch_size, "depthwise conv layer")
    a = jnp.einsum("brkc,brlc->ckl", x, x) / n
    g = jnp.einsum("sbrcm,sbrcn->cmn", g, g) / n
    sym = lambda m: 0.5 * (m + jnp.swapaxes(m, 1, 2))  # noqa: E731
    scale = jnp.full((self._layout.channels,), r, linalg.factor_dtype())
    return {"a": sym(a), "g": sym(g), "scale": scale}

  def to_axis(self, v: tuple) -> tuple:
    """``(w[, b])`` -> ``([C, K(+1), M],)``: channel ``c``'s ``[w_c; b_c]``."""
    lay = self._layout
    dt = linalg.factor_dtype()
    vc = jnp.moveaxis(lay.canonical(v[0].astype(dt)), 1, 0)   # [C, K, M]
    b = v[1].astype(dt) if lay.has_bias else None
    return (base.with_bias_row(vc, b),)

  def from_axis(self, out: tuple, like: tuple) -> tuple:
    lay = self._layout
    w, *b = base.split_bias_row(out[0], lay.window, lay.has_bias)
    res = (lay.stored(jnp.moveaxis(w, 0, 1)), *b)
    return base.vector_dtype_cast(res, like)

  def ravel_index(self) -> np.ndarray:
    return self._layout.channel_index()


def _check_params(layer: Layer):
  if len(layer.param_shapes) not in (1, 2):
    raise ValueError(
        f"Layer {layer.name!r}: depthwise conv parameter shapes "
        f"{layer.param_shapes}; expected a kernel and an optional bias.")


def depthwise_diagonal_block(layer: Layer, config: base.BlockConfig):
  """``diagonal`` block of a depthwise conv."""
  _check_params(layer)
  return diagonal.DiagonalBlock(
      layer=layer, config=config,
      source=DepthwiseGrads(depthwise_layout(layer)),
      param_shapes=layer.param_shapes)


def depthwise_kron_block(layer: Layer, config: base.BlockConfig):
  """``kron`` block of a depthwise conv: one Kronecker block per channel."""
  _check_params(layer)
  source = DepthwiseGrads(depthwise_layout(layer))
  lay = source.layout
  matrix = layouts.MatrixLayout(a_dim=lay.window + int(lay.has_bias),
                                g_dim=lay.multiplier,
                                init_scale=layer.num_uses)
  inner = kronecker.KroneckerBlock(layer=None, config=config, layout=matrix)
  return combinators.VmappedBlock(layer=layer, config=config, inner=inner,
                                  size=lay.channels, axis=ChannelAxis(source))


# ---------------------------------------------------------------------------
# Separable convolutions.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SeparableSplit:
  """A separable conv's data for its parts (``depthwise``, ``pointwise``):
  the depthwise part's output gradient is ``g_dw = g_y W_pwᵀ``."""
  channel_axis: int   # of the output y, per example (3 for NHWC, 1 NCHW)

  def _depthwise_grads(self, g, pw):
    """``g_dw = g_y W_pwᵀ`` for ``g: [S, B, U, *y_shape[1:]]``."""
    dt = linalg.factor_dtype()
    axis = 2 + self.channel_axis
    w = pw.astype(dt).reshape(pw.shape[-2:])
    out = jnp.moveaxis(g.astype(dt), axis, -1) @ w.T
    return jnp.moveaxis(out, -1, axis)

  def data(self, data: base.LayerData) -> tuple:
    pw = data.params[1]
    dw_data = data._replace(
        inputs=tuple((inp[0],) for inp in data.inputs),
        grads=tuple(self._depthwise_grads(g, pw) for g in data.grads),
        params=data.params[:1])
    pw_data = data._replace(inputs=tuple((inp[1],) for inp in data.inputs),
                            params=data.params[1:])
    return dw_data, pw_data


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
  parts = (depthwise_diagonal_block(dw_layer, config),
           make_pw(pw_layer, config))
  return combinators.BlockDiagonal(
      layer=layer, config=config,
      parts=tuple(dataclasses.replace(b, layer=None) for b in parts),
      param_counts=(1, len(shapes) - 1),
      split=SeparableSplit(channel_axis=3 if fmt == "NHWC" else 1))
