"""Curvature blocks, one family per module; :func:`make_block` picks one."""

from __future__ import annotations

import math

from kfac_jax_lite.blocks import diagonal
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.blocks import stacked
from kfac_jax_lite.blocks.base import BlockConfig, LayerData
from kfac_jax_lite.collection import Layer

__all__ = ["BlockConfig", "LayerData", "inner_uses", "make_block"]

# (kind, approx) -> constructor(layer, config).
_FACTORIES = {
    ("fully_connected", "kron"): kronecker.dense_block,
    ("fully_connected", "kron_in_diag"): kronecker.dense_block,
    ("fully_connected", "kron_out_diag"): kronecker.dense_block,
    ("fully_connected", "kron_both_diag"): kronecker.dense_block,
    ("fully_connected", "kron_indep"): kronecker.dense_block,
    ("generic", "diagonal"): diagonal.NaiveDiagonalBlock,
}


def inner_uses(kind: str, input_shapes: tuple) -> int:
  """Uses of a layer per example at one tag site, outside any ``lax.scan``.

  A dense layer applied to ``x: [B, T, ..., d_in]`` is used ``T·...`` times
  per example (each position is one use of the weights).
  """
  if kind == "fully_connected" and input_shapes and len(input_shapes[0]) > 2:
    return int(math.prod(input_shapes[0][1:-1]))
  return 1


def make_block(layer: Layer, config: BlockConfig | None = None):
  """The block for ``layer.kind`` and ``layer.approx``.

  A stacked layer (``layer.stack > 0``) gets a
  :class:`~kfac_jax_lite.blocks.stacked.StackedBlock` around the block of
  one slice.

  Raises:
    NotImplementedError: for a (kind, approx) pair with no block yet.
  """
  config = config or BlockConfig()
  if layer.stack:
    return stacked.StackedBlock(layer=layer, config=config,
                                inner=make_block(layer.unstacked(), config),
                                size=layer.stack)
  factory = _FACTORIES.get((layer.kind, layer.approx))
  if factory is None:
    done = sorted(a for k, a in _FACTORIES if k == layer.kind)
    raise NotImplementedError(
        f"Layer {layer.name!r}: approximation {layer.approx!r} for kind "
        f"{layer.kind!r} has no block in this version (available: {done}). "
        "Pass approximations={...} to scan() to choose another.")
  return factory(layer, config)
