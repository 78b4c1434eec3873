"""Scale-and-shift blocks (LayerNorm, BatchNorm, RMSNorm parameters).

For ``y = x * scale + shift`` with ``scale`` and ``shift`` broadcast against
``x``, the per-example gradients are sums over the broadcast positions
(and over the layer's uses),

.. math::
  \\nabla_{s,b}\\, \\mathrm{scale} = \\sum_{\\text{broadcast}} x_b \\odot
  g_{s,b}, \\qquad
  \\nabla_{s,b}\\, \\mathrm{shift} = \\sum_{\\text{broadcast}} g_{s,b},

and the block is their exact ``full`` second moment or its ``diagonal``
(TF K-FAC ``ScaleAndShiftFullFB`` / ``ScaleAndShiftDiagonalFB``); see
:mod:`.full` and :mod:`.diagonal` for damping and products.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import diagonal
from kfac_jax_lite.blocks import full
from kfac_jax_lite.blocks import per_example
from kfac_jax_lite.layer import Layer


def _reduce_to(x, shape: tuple):
  """Sums ``x: [S, B, U, *y]`` to ``[S, B, *shape]`` by broadcasting rules.

  ``shape`` is right-aligned with ``y`` (a leading 1 for the batch axis is
  allowed); every axis of ``y`` where ``shape`` has 1 (or nothing) is
  summed, and ``U`` (the uses) always is.
  """
  y = x.shape[3:]
  trimmed = tuple(shape)
  while len(trimmed) > len(y) and trimmed[0] == 1:
    trimmed = trimmed[1:]
  padded = (1,) * (len(y) - len(trimmed)) + trimmed
  if len(padded) != len(y) or any(p not in (1, d) for p, d in zip(padded, y)):
    raise ValueError(
        f"A scale-and-shift parameter of shape {tuple(shape)} does not "
        f"broadcast against the output's per-example shape {y}. Pass "
        "register_scale_and_shift the y, x, scale and shift of "
        "y = x * scale + shift.")
  axes = (2,) + tuple(3 + i for i, (p, d) in enumerate(zip(padded, y))
                      if p == 1 and d != 1)
  return jnp.sum(x, axis=axes).reshape(x.shape[:2] + tuple(shape))


@dataclasses.dataclass(frozen=True)
class ScaleShiftGrads:
  """Per-example gradients of ``(scale[, shift])``; see the module docs."""
  param_shapes: Sequence[tuple]  # a tuple: (scale's shape[, shift's])
  needs_param_grads = False

  def per_example(self, data: base.LayerData) -> tuple:
    dt = linalg.factor_dtype()
    scale = shift = 0.0
    for inp, g in zip(data.inputs, data.grads):
      g = g.astype(dt)
      x = inp[0].astype(dt)
      # x: [B, U, *x_shape[1:]] right-aligned with g: [S, B, U, *y_shape].
      x = x.reshape(x.shape[:2] + (1,) * (g.ndim - 1 - x.ndim) + x.shape[2:])
      scale = scale + _reduce_to(x[None] * g, self.param_shapes[0])
      if len(self.param_shapes) > 1:
        shift = shift + _reduce_to(g, self.param_shapes[1])
    out = (per_example.fold_sources(scale),)
    if len(self.param_shapes) > 1:
      out += (per_example.fold_sources(shift),)
    return out

  def sum_squares(self, data: base.LayerData) -> tuple:
    return per_example.squares_of(self.per_example(data))


def _source(layer: Layer) -> ScaleShiftGrads:
  return ScaleShiftGrads(tuple(tuple(s) for s in layer.param_shapes))


scale_and_shift_full_block = per_example.factory(full.FullBlock, _source)
scale_and_shift_diagonal_block = per_example.factory(diagonal.DiagonalBlock,
                                                     _source)
