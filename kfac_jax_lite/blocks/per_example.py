"""Per-example gradients: the statistic of diagonal and full blocks.

A diagonal or full block estimates the layer's Fisher block directly,

.. math::
  F = \\frac{1}{B} \\sum_{s} \\sum_{b} \\nabla_{s,b} \\nabla_{s,b}^T,

with :math:`\\nabla_{s,b}` the gradient of example ``b``'s loss (under
source ``s``: a sampled target, an exact-mode column, ...) with respect to
the layer's parameters. A *source* rebuilds these gradients from what the
estimator recorded, without one backward pass per example:

* :class:`ParamGrads` (generic layers, TF K-FAC ``NaiveDiagonalFB`` /
  ``NaiveFullFB``): the gradient of the loss *summed* over the batch, so
  :math:`F = \\frac{1}{B} \\sum_s (\\sum_b \\nabla_{s,b})(\\cdot)^T`
  ("square of the sum", unbiased only in expectation);
* :class:`DenseGrads`: :math:`\\nabla_{s,b} W = \\sum_u \\bar a_{b,u}
  g_{s,b,u}^T` summed over the uses ``u`` of the weights (TF K-FAC
  ``FullyConnectedDiagonalFactor`` for one use);
* conv, depthwise and scale-and-shift sources live with their layer family.

Every source has ``needs_param_grads``, ``per_example(data)`` (per parameter,
``[R, *shape]`` with ``R = S·B`` rows) and ``sum_squares(data)`` (per
parameter, the sum of the squared rows).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.layer import Layer


def squares_of(per_example: tuple) -> tuple:
  """``Σ_r x_r²`` of each ``[R, *shape]`` array."""
  return tuple(jnp.sum(jnp.square(x), axis=0) for x in per_example)


def fold_sources(x):
  """``[S, B, *shape] -> [S·B, *shape]``."""
  return x.reshape((-1,) + x.shape[2:])


def site_rows(x, batch_axes: int, d: int):
  """``[*lead, U, ..., d] -> [*lead, R, d]`` (``lead`` = the first axes)."""
  return x.reshape(x.shape[:batch_axes] + (-1, d))


class FromSource:
  """What a block fed by a per-example ``source`` over ``param_shapes``
  derives from them (diagonal and full blocks)."""
  # Declared for type checkers: the subclass's fields.
  source: Any
  param_shapes: tuple

  @property
  def num_params(self) -> int:
    return sum(int(math.prod(s)) for s in self.param_shapes)

  @property
  def needs_param_grads(self) -> bool:
    return self.source.needs_param_grads


@dataclasses.dataclass(frozen=True)
class ParamGrads:
  """Gradients of the batch-summed loss per source (generic layers)."""
  needs_param_grads = True

  def per_example(self, data: base.LayerData) -> tuple:
    dt = linalg.factor_dtype()
    return tuple(pg.astype(dt) for pg in data.param_grads)

  def sum_squares(self, data: base.LayerData) -> tuple:
    return squares_of(self.per_example(data))


@dataclasses.dataclass(frozen=True)
class DenseGrads:
  """Per-example gradients of ``y = x @ w + b`` summed over its uses.

  .. math::
    \\nabla_{s,b} w = \\sum_u a_{b,u} g_{s,b,u}^T, \\qquad
    \\nabla_{s,b} b = \\sum_u g_{s,b,u}

  (uses: scan steps, repeated tags and inner positions of ``[B, T, d]``
  inputs). With one use per example ``sum_squares`` needs no per-example
  array (:math:`(a g^T)^{\\odot 2} = a^{\\odot 2} (g^{\\odot 2})^T`); with
  several it materialises ``[S, B, d_in, d_out]``.
  """
  d_in: int
  d_out: int
  has_bias: bool
  kernel_perm: Optional[tuple] = None    # see layouts.DenseLayout
  kernel_shape: Optional[tuple] = None
  needs_param_grads = False

  def _kernel(self, m):
    """``[..., d_in, d_out]`` matrices as kernels of the leaf's layout."""
    if self.kernel_perm is None:
      return m
    assert self.kernel_shape is not None  # recorded with kernel_perm
    return base.mat_to_kernel(m, self.kernel_perm, self.kernel_shape)

  def _rows(self, data):
    dt = linalg.factor_dtype()
    x = jnp.concatenate([site_rows(inp[0], 1, self.d_in).astype(dt)
                         for inp in data.inputs], axis=1)
    g = jnp.concatenate([site_rows(gr, 2, self.d_out).astype(dt)
                         for gr in data.grads], axis=2)
    return x, g   # [B, R, d_in], [S, B, R, d_out]

  def per_example(self, data: base.LayerData) -> tuple:
    x, g = self._rows(data)
    out = (self._kernel(fold_sources(jnp.einsum("bri,sbro->sbio", x, g))),)
    if self.has_bias:
      out += (fold_sources(jnp.sum(g, axis=2)),)
    return out

  def sum_squares(self, data: base.LayerData) -> tuple:
    x, g = self._rows(data)
    if x.shape[1] != 1:
      return squares_of(self.per_example(data))
    # One use per example: (a gᵀ)² = a² (g²)ᵀ, no [S, B, d_in, d_out] array.
    g2 = jnp.square(g[:, :, 0])
    out = (self._kernel(jnp.einsum("bi,sbo->io", jnp.square(x[:, 0]), g2)),)
    if self.has_bias:
      out += (jnp.sum(g2, axis=(0, 1)),)
    return out


def factory(block_cls, source_of):
  """The factory ``(layer, config) -> block_cls(...)`` of a block fed by the
  source ``source_of(layer)`` (diagonal and full blocks)."""
  def make(layer: Layer, config: base.BlockConfig):
    return block_cls(layer=layer, config=config, source=source_of(layer),
                     param_shapes=layer.param_shapes)
  return make


def param_grads(layer: Layer) -> ParamGrads:
  """The square-of-the-sum source of a generic layer."""
  del layer
  return ParamGrads()


def dense_grads(layer: Layer) -> DenseGrads:
  """The :class:`DenseGrads` of a dense layer with a rank-2 kernel.

  Raises:
    ValueError: for a kernel that is not ``[d_in, d_out]``.
  """
  shape = tuple(layer.param_shapes[0])
  meta = layer.meta_dict
  perm = meta.get("kernel_perm")
  if len(shape) != 2 and "kernel_in_axes" not in meta:
    raise ValueError(
        f"Layer {layer.name!r} has kernel shape {shape}; register_dense "
        "needs a rank-2 [d_in, d_out] kernel. Reshape it, or register it "
        "with register_generic(...).")
  k = meta.get("kernel_in_axes", 1)
  ordered = shape if perm is None else tuple(shape[a] for a in perm)
  return DenseGrads(math.prod(ordered[:k]), math.prod(ordered[k:]),
                    layer.has_bias,
                    None if perm is None else tuple(perm),
                    shape if perm is not None else None)
