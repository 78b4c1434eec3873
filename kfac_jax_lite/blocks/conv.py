"""Convolution blocks: KFC (``kron``, ``kron_indep``, ``kron_reduce``),
``diagonal``, SUA.

KFC (Grosse & Martens 2016, eq. 23) approximates the Fisher block of a
convolution, with :math:`p_{b,t}` the input patch at output location ``t``
(a trailing 1 for the bias) and :math:`g_{b,t}` the output gradient there,

.. math::
  F \\approx |\\mathcal T|\\, \\Omega \\otimes \\Gamma, \\quad
  \\Omega = \\frac{1}{B|\\mathcal T|} \\sum_{b,t} p_{b,t} p_{b,t}^T, \\quad
  \\Gamma = \\frac{1}{B|\\mathcal T|} \\sum_{s,b,t} g_{s,b,t} g_{s,b,t}^T.

A conv used ``U`` times (``kron_indep``, Martens, Ba & Johnson 2018) has
``c = |T| · U`` and the averages run over uses too. Patches follow the
layer's strides, padding, dilations and dimension numbers, so strided,
dilated, SAME/VALID/explicit, 1-, 2- and 3-D and NCHW convolutions are all
exact, in the kernel's flatten order ``[*spatial, c_in]``. On the CPU they
are ``K`` strided slices of the padded input; elsewhere
``lax.conv_general_dilated_patches``, a convolution with a one-hot filter
that costs :math:`B|\\mathcal T|(K c_{in})^2` multiply-adds, as much as
:math:`\\Omega`'s outer products (:meth:`ConvGeometry.patches`).

``diagonal`` is the exact diagonal of the per-example Fisher, from
:math:`\\nabla_{s,b} W = \\sum_t p_{b,t} g_{s,b,t}^T` (TF ``ConvDiagonalFB``).

``kron_reduce`` (KFC-reduce, K-FAC-reduce of Eschenhagen et al. 2023)
sums the patches and the output gradients over locations before the outer
products (:class:`ConvReduceLayout`): ``B`` rows instead of ``B|T|``, and
the patch sums come from the input without forming the patches.

``kron_sua`` (spatially uncorrelated activations) is in :mod:`.sua`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from jax import lax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import _xla_cpu
from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import diagonal
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.blocks import layouts
from kfac_jax_lite.blocks import per_example
from kfac_jax_lite.layer import Layer


# ---------------------------------------------------------------------------
# Geometry: patches and the kernel <-> matrix reshapes.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
  """Static description of one ``lax.conv_general_dilated`` call.

  Rows are in a canonical order: ``[N, s_0, s_1, ..., features]`` with the
  spatial axes in the order of ``dimension_numbers`` (lhs and out alike).
  """
  kernel_shape: tuple
  window_strides: tuple
  padding: Any
  lhs_dilation: Any
  rhs_dilation: Any
  dimension_numbers: lax.ConvDimensionNumbers

  @property
  def spatial_shape(self) -> tuple:
    return tuple(self.kernel_shape[a]
                 for a in self.dimension_numbers.rhs_spec[2:])

  @property
  def c_in(self) -> int:
    return self.kernel_shape[self.dimension_numbers.rhs_spec[1]]

  @property
  def c_out(self) -> int:
    return self.kernel_shape[self.dimension_numbers.rhs_spec[0]]

  @property
  def window(self) -> int:
    return int(math.prod(self.spatial_shape))

  @property
  def patch_size(self) -> int:
    return self.window * self.c_in

  @property
  def perm(self) -> tuple:
    """Kernel axes in matrix order: ``(*spatial, in, out)``."""
    rhs = self.dimension_numbers.rhs_spec
    return (*rhs[2:], rhs[1], rhs[0])

  def kernel_to_mat(self, w):
    """Kernel (stored layout) -> ``[K·c_in, c_out]``, channel fastest."""
    return w.transpose(self.perm).reshape(self.patch_size, self.c_out)

  def mat_to_kernel(self, m):
    """``[*lead, K·c_in, c_out]`` -> ``[*lead, *kernel_shape]``."""
    lead = m.shape[:-2]
    m = m.reshape(lead + self.spatial_shape + (self.c_in, self.c_out))
    n = len(lead)
    inv = tuple(int(i) for i in np.argsort(self.perm))
    return m.transpose(tuple(range(n)) + tuple(n + i for i in inv))

  @property
  def is_pointwise(self) -> bool:
    """A 1x1, stride-1, unpadded, undilated conv: patches are the input."""
    ones = lambda t: t is None or all(int(i) == 1 for i in t)  # noqa: E731
    unpadded = self.padding in ("SAME", "VALID") or all(
        tuple(p) == (0, 0) for p in self.padding)
    return (self.window == 1 and ones(self.window_strides)
            and ones(self.lhs_dilation) and unpadded)

  def _canonical(self, x, spec):
    """Moves ``x``'s (batch, feature, spatial) axes to (0, spatial, -1)."""
    return x.transpose((spec[0], *spec[2:], spec[1]))

  def patches(self, x):
    """``x: [N, *x_shape[1:]]`` -> ``[N, L, K·c_in]`` (kernel flatten order).

    On the CPU by :meth:`sliced_patches` (``K`` strided slices, no
    arithmetic); elsewhere by ``lax.conv_general_dilated_patches``, whose
    one-hot filter costs :math:`N L (K c_{in})^2` multiply-adds, as much
    as the outer products of the factor itself (chosen when lowering,
    :func:`kfac_jax_lite._xla_cpu.on_cpu`). The two are equal exactly.
    """
    if self.is_pointwise:
      p = self._canonical(x, self.dimension_numbers.lhs_spec)
      return p.reshape(x.shape[0], -1, self.c_in)
    return _xla_cpu.on_cpu(self.sliced_patches, self.conv_patches, x)

  def conv_patches(self, x):
    """:meth:`patches` by ``lax.conv_general_dilated_patches``."""
    dn = self.dimension_numbers
    p = lax.conv_general_dilated_patches(
        x, filter_shape=self.spatial_shape,
        window_strides=self.window_strides, padding=self.padding,
        lhs_dilation=self.lhs_dilation, rhs_dilation=self.rhs_dilation,
        dimension_numbers=dn, precision=lax.Precision.HIGHEST)
    p = self._canonical(p, dn.out_spec)
    p = p.reshape(x.shape[0], -1, self.c_in, self.window)
    return jnp.swapaxes(p, -1, -2).reshape(x.shape[0], -1, self.patch_size)

  def _padded(self, x):
    """Canonical ``x`` dilated and padded as ``conv_general_dilated`` does
    (``lax.pad``'s interior padding, string padding from the undilated
    shape), with the kernel's dilation and the output's spatial shape."""
    n = len(self.spatial_shape)
    x = self._canonical(x, self.dimension_numbers.lhs_spec)
    lhs_dil = self.lhs_dilation or (1,) * n
    rhs_dil = tuple(self.rhs_dilation or (1,) * n)
    eff = [(k - 1) * d + 1 for k, d in zip(self.spatial_shape, rhs_dil)]
    pads = self.padding
    if isinstance(pads, str):
      pads = lax.padtype_to_pads(x.shape[1:-1], eff, self.window_strides,
                                 pads)
    x = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] + [
        (lo, hi, d - 1) for (lo, hi), d in zip(pads, lhs_dil)] + [(0, 0, 0)])
    out = tuple((s - e) // t + 1 for s, e, t
                in zip(x.shape[1:-1], eff, self.window_strides))
    return x, rhs_dil, out

  def sliced_patches(self, x):
    """:meth:`patches` as strided slices of the padded, dilated input.

    Window offset ``k`` is the slice of the padded input (:meth:`_padded`)
    from ``k·rhs_dilation`` with step ``window_strides``.
    """
    x, rhs_dil, out = self._padded(x)
    steps = tuple(self.window_strides)
    cols = []
    for offset in itertools.product(*map(range, self.spatial_shape)):
      start = [o * d for o, d in zip(offset, rhs_dil)]
      limit = [s + (m - 1) * t + 1 for s, m, t in zip(start, out, steps)]
      cols.append(lax.slice(x, (0, *start, 0),
                            (x.shape[0], *limit, x.shape[-1]),
                            (1, *steps, 1)))
    p = jnp.stack(cols, axis=-2)                    # [N, *out, K, c_in]
    return p.reshape(x.shape[0], -1, self.patch_size)

  def patch_sums(self, x):
    """``Σ_t p_{n,t}``: the patches summed over output locations, unformed.

    .. math::
      \\Big(\\sum_t p_{n,t}\\Big)_{k,c} = \\sum_{t} \\tilde x_{n,\\,
      k \\cdot d + t \\cdot s,\\, c}

    for the padded, dilated input :math:`\\tilde x` (:meth:`_padded`),
    kernel dilation ``d`` and stride ``s``: for each kernel offset ``k``
    the sum of a strided window of :math:`\\tilde x` as large as the
    output. One ``lax.reduce_window`` (window = the output's shape,
    window dilation = the stride, window stride = the kernel dilation)
    gives every offset at once: :math:`N |\\mathcal T| K c_{in}` adds and
    an ``[N, K·c_in]`` result, where :meth:`patches` would write
    ``[N, |T|, K·c_in]``.

    Returns:
      ``(sums, L)``: ``[N, K·c_in]`` in the kernel flatten order, and the
      number ``L`` of output locations.
    """
    x, rhs_dil, out = self._padded(x)
    s = lax.reduce_window(
        x, jnp.zeros((), x.dtype), lax.add, (1, *out, 1),
        (1, *rhs_dil, 1), "VALID",
        window_dilation=(1, *self.window_strides, 1))
    s = lax.slice(s, (0,) * s.ndim,
                  (s.shape[0], *self.spatial_shape, s.shape[-1]))
    return s.reshape(x.shape[0], self.patch_size), int(math.prod(out))

  def out_rows(self, g, lead: int):
    """``g: [*lead, *y_shape[1:]]`` -> ``[*lead[:-1], lead[-1]·L, c_out]``."""
    shape = g.shape[:lead]
    g = g.reshape((-1,) + g.shape[lead:])
    g = self._canonical(g, self.dimension_numbers.out_spec)
    return g.reshape(shape[:-1] + (-1, self.c_out))

  def site_patches(self, data, has_bias):
    """Input rows ``[B, R, K·c_in (+1)]`` over every site (R = uses x L)."""
    dt = linalg.factor_dtype()
    rows = []
    for inp in data.inputs:
      x = inp[0]
      b, u = x.shape[:2]
      p = self.patches(x.reshape((b * u,) + x.shape[2:]).astype(dt))
      rows.append(p.reshape(b, -1, p.shape[-1]))
    x = jnp.concatenate(rows, axis=1)
    return layouts.append_ones(x) if has_bias else x

  def site_grads(self, data):
    """Output-gradient rows ``[S, B, R, c_out]`` over every site."""
    dt = linalg.factor_dtype()
    return jnp.concatenate([self.out_rows(g.astype(dt), 3)
                            for g in data.grads], axis=2)

  def site_patch_means(self, data, has_bias):
    """Per-example mean patch ``[B, K·c_in (+1)]`` over every site's uses
    and locations (:meth:`patch_sums`; the bias's 1 appended)."""
    dt = linalg.factor_dtype()
    total, rows = 0.0, 0
    for inp in data.inputs:
      x = inp[0]
      b, u = x.shape[:2]
      p, locations = self.patch_sums(
          x.reshape((b * u,) + x.shape[2:]).astype(dt))
      total = total + jnp.sum(p.reshape(b, u, -1), axis=1)
      rows += u * locations
    x = total / rows
    return layouts.append_ones(x) if has_bias else x

  def site_grad_sums(self, data):
    """Per-example output gradients summed over every site's uses and
    locations, ``[S, B, c_out]``."""
    dt = linalg.factor_dtype()
    feature = 2 + self.dimension_numbers.out_spec[1]  # g: [S, B, U, *y[1:]]
    return sum(jnp.sum(g.astype(dt), axis=tuple(
        a for a in range(2, g.ndim) if a != feature)) for g in data.grads)


def conv_dimension_numbers(dn, kernel_shape) -> lax.ConvDimensionNumbers:
  """``dimension_numbers`` as stored in tag metadata -> the lax form."""
  n = len(kernel_shape)
  if dn is not None and len(dn) == 3 and not isinstance(dn[0], str):
    return lax.ConvDimensionNumbers(*(tuple(int(i) for i in d) for d in dn))
  return lax.conv_dimension_numbers((1,) * n, kernel_shape, dn)


def conv_geometry(layer: Layer, kernel_shape=None, **overrides) -> ConvGeometry:
  """The :class:`ConvGeometry` of a conv layer from its tag metadata.

  Raises:
    ValueError: for grouped convolutions, a batch axis that is not first,
      or strides that do not match the kernel's rank.
  """
  meta = {**layer.meta_dict, **overrides}
  kernel_shape = tuple(kernel_shape or layer.param_shapes[0])
  n = len(kernel_shape) - 2
  groups = meta.get("feature_group_count", 1)
  if meta.get("batch_group_count", 1) != 1:
    raise ValueError(
        f"Layer {layer.name!r}: batch_group_count="
        f"{meta['batch_group_count']}; conv blocks need batch_group_count=1."
        " Register this layer with register_generic(...).")
  if groups != 1:
    raise ValueError(
        f"Layer {layer.name!r}: feature_group_count={groups}; conv blocks "
        "need feature_group_count=1. Tag depthwise convolutions with "
        "register_depthwise_conv2d, or other grouped ones with "
        "register_generic(...).")
  strides = tuple(meta.get("window_strides") or (1,) * n)
  if len(strides) != n:
    raise ValueError(
        f"Layer {layer.name!r}: window_strides={strides} has {len(strides)} "
        f"entries but the kernel {kernel_shape} has {n} spatial axes. Give "
        "one stride per spatial axis.")
  dn = conv_dimension_numbers(meta.get("dimension_numbers"), kernel_shape)
  if dn.lhs_spec[0] != 0 or dn.out_spec[0] != 0:
    raise ValueError(
        f"Layer {layer.name!r}: dimension_numbers={tuple(dn)} put the batch "
        "axis of the input or output elsewhere than first; K-FAC reads the "
        "batch from axis 0. Transpose to a batch-first layout (e.g. NHWC).")
  padding = meta.get("padding", "VALID")
  if not isinstance(padding, str):
    padding = tuple(tuple(int(i) for i in p) for p in padding)
  dil = lambda k: None if meta.get(k) is None else tuple(meta[k])  # noqa
  return ConvGeometry(kernel_shape=kernel_shape, window_strides=strides,
                      padding=padding, lhs_dilation=dil("lhs_dilation"),
                      rhs_dilation=dil("rhs_dilation"), dimension_numbers=dn)


# ---------------------------------------------------------------------------
# KFC: a KroneckerBlock layout, and the per-example source for diagonal.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvLayout:
  """KFC layout: ``V = [W_mat; b]`` with ``W_mat = [K·c_in, c_out]``."""
  geometry: ConvGeometry
  has_bias: bool
  num_uses: int

  @property
  def a_dim(self) -> int:
    return self.geometry.patch_size + int(self.has_bias)

  @property
  def g_dim(self) -> int:
    return self.geometry.c_out

  @property
  def init_scale(self) -> int:
    return self.num_uses

  def to_mat(self, v: tuple):
    m = self.geometry.kernel_to_mat(v[0].astype(linalg.factor_dtype()))
    return base.with_bias_row(m, v[1] if self.has_bias else None)

  def from_mat(self, m, like: tuple) -> tuple:
    w, *b = base.split_bias_row(m, self.geometry.patch_size, self.has_bias)
    return base.vector_dtype_cast((self.geometry.mat_to_kernel(w), *b), like)

  def ravel_index(self):
    """Ravel position of each ``[W_mat; b]`` entry (None for HWIO-like)."""
    geo = self.geometry
    n = int(math.prod(geo.kernel_shape))
    idx = np.arange(n).reshape(geo.kernel_shape).transpose(geo.perm)
    idx = idx.reshape(geo.patch_size, geo.c_out)
    if self.has_bias:
      idx = np.concatenate([idx, n + np.arange(geo.c_out)[None]], axis=0)
    idx = idx.reshape(-1)
    return None if np.array_equal(idx, np.arange(idx.size)) else idx

  def factor_stats(self, data, a_diagonal, g_diagonal) -> dict:
    x = self.geometry.site_patches(data, self.has_bias)
    g = self.geometry.site_grads(data)
    x = x.reshape(-1, x.shape[-1])
    g = g.reshape(g.shape[0], -1, g.shape[-1])
    return layouts.kron_stats(x, g, data.batch_size, a_diagonal,
                              g_diagonal, "conv layer")


@dataclasses.dataclass(frozen=True)
class ConvReduceLayout(ConvLayout):
  """KFC-reduce (``kron_reduce``): K-FAC-reduce over the locations and uses.

  Eschenhagen et al. (2023) reduce over the shared axis before the outer
  products; for a convolution the shared axis is the ``R = U·|T|`` uses
  and output locations of an example:

  .. math::
    \\bar p_b = \\frac{1}{R} \\sum_{u,t} \\bar p_{b,u,t}, \\quad
    \\bar g_{s,b} = \\sum_{u,t} g_{s,b,u,t}, \\quad
    A = \\frac{1}{B} \\sum_b \\bar p_b \\bar p_b^T, \\quad
    G = \\frac{1}{B} \\sum_{s,b} \\bar g_{s,b} \\bar g_{s,b}^T,
    \\quad c = 1

  (``p̄`` with the bias's 1 appended). The patch sums are formed without
  the patches (:meth:`ConvGeometry.patch_sums`), so the factors cost
  :math:`B (K c_{in} + 1)^2` multiply-adds instead of KFC's
  :math:`B |\\mathcal T| (K c_{in} + 1)^2`. It is exact (``A ⊗ G`` is the
  layer's GGN block) when the layer's outputs are summed over locations
  before a Gaussian loss and the layer is linear in its input; KFC
  (:class:`ConvLayout`, K-FAC-expand) when every location has its own
  loss instead.

  References:
    Eschenhagen, Immer, Turner, Schneider & Hennig (2023), "Kronecker-
    Factored Approximate Curvature for Modern Neural Network
    Architectures", NeurIPS (K-FAC-reduce, sec. 3).
  """

  @property
  def init_scale(self) -> int:
    return 1

  def factor_stats(self, data, a_diagonal, g_diagonal) -> dict:
    x = self.geometry.site_patch_means(data, self.has_bias)
    g = self.geometry.site_grad_sums(data)
    return layouts.kron_stats(x, g, data.batch_size, a_diagonal,
                              g_diagonal, "conv layer")


@dataclasses.dataclass(frozen=True)
class ConvGrads:
  """Per-example conv gradients ``Σ_t p_{b,t} g_{s,b,t}ᵀ`` (and ``Σ_t g``)."""
  geometry: ConvGeometry
  has_bias: bool
  needs_param_grads = False

  def per_example(self, data: base.LayerData) -> tuple:
    x = self.geometry.site_patches(data, self.has_bias)
    g = self.geometry.site_grads(data)
    m = jnp.einsum("brp,sbro->sbpo", x, g)
    w, *b = base.split_bias_row(per_example.fold_sources(m),
                                self.geometry.patch_size, self.has_bias)
    return (self.geometry.mat_to_kernel(w), *b)

  def sum_squares(self, data: base.LayerData) -> tuple:
    return per_example.squares_of(self.per_example(data))


def conv_kron_block(layer: Layer, config: base.BlockConfig):
  """KFC block (``kron``; ``kron_indep`` for a multi-use conv)."""
  layout = ConvLayout(conv_geometry(layer), layer.has_bias,
                      layer.num_uses)
  return kronecker.KroneckerBlock(layer=layer, config=config, layout=layout)


def conv_reduce_block(layer: Layer, config: base.BlockConfig):
  """KFC-reduce block (``kron_reduce``, :class:`ConvReduceLayout`)."""
  layout = ConvReduceLayout(conv_geometry(layer), layer.has_bias,
                            layer.num_uses)
  return kronecker.KroneckerBlock(layer=layer, config=config, layout=layout)


def conv_grads(layer: Layer) -> ConvGrads:
  """The per-example source of a conv layer."""
  return ConvGrads(conv_geometry(layer), layer.has_bias)


# Exact diagonal of the per-example Fisher of a conv layer.
conv_diagonal_block = per_example.factory(diagonal.DiagonalBlock, conv_grads)
