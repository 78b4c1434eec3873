"""Curvature blocks, one family per module; :func:`make_block` picks one.

=====================  ===================================================
kind                   approximations (module)
=====================  ===================================================
``fully_connected``    ``kron``, ``kron_in_diag``, ``kron_out_diag``,
                       ``kron_both_diag``, ``kron_indep`` (kronecker);
                       ``kron_series_1``, ``kron_series_2`` (multi_use);
                       ``diagonal`` (diagonal); ``full`` (full)
``conv``               ``kron``, ``kron_indep``, ``diagonal`` (conv);
                       ``kron_sua`` (sua)
``depthwise_conv``     ``diagonal``, ``kron`` (depthwise)
``separable_conv``     ``kron``, ``diagonal`` (depthwise)
``embedding``          ``kron``, ``kron_indep`` (embedding)
``tied_embedding``     ``kron_sum`` (tied)
``scale_and_shift``    ``full``, ``diagonal`` (scale_and_shift)
``generic``            ``diagonal`` (diagonal), ``full`` (full)
=====================  ===================================================

Multi-use layers keep their kind (``fully_connected`` with ``kron_indep``,
``conv`` with ``kron_indep``, ...). Every block is a frozen dataclass of
static fields whose methods are pure functions of a state pytree; blocks
equal up to ``layer`` act identically, so the estimator may stack them.

Example:
  >>> block = make_block(collection.layers[0], BlockConfig(exps=(-1,)))
  >>> state = block.init()
  >>> state = block.update_curvature(state, block.compute_stats(data), 0.95)
  >>> state = block.update_cache(state, damping=1e-3)
  >>> precond = block.multiply_inverse(state, (w_grad, b_grad))
"""

from __future__ import annotations

import math

from kfac_jax_lite.blocks import conv
from kfac_jax_lite.blocks import depthwise
from kfac_jax_lite.blocks import diagonal
from kfac_jax_lite.blocks import embedding
from kfac_jax_lite.blocks import full
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.blocks import multi_use
from kfac_jax_lite.blocks import scale_and_shift
from kfac_jax_lite.blocks import stacked
from kfac_jax_lite.blocks import sua
from kfac_jax_lite.blocks import tied
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
    ("fully_connected", "kron_series_1"): multi_use.series_block,
    ("fully_connected", "kron_series_2"): multi_use.series_block,
    ("fully_connected", "diagonal"): diagonal.dense_diagonal_block,
    ("fully_connected", "full"): full.dense_full_block,
    ("conv", "kron"): conv.conv_kron_block,
    ("conv", "kron_indep"): conv.conv_kron_block,
    ("conv", "kron_sua"): sua.conv_sua_block,
    ("conv", "diagonal"): conv.conv_diagonal_block,
    ("depthwise_conv", "diagonal"): depthwise.depthwise_diagonal_block,
    ("depthwise_conv", "kron"): depthwise.depthwise_kron_block,
    ("separable_conv", "kron"): depthwise.separable_block,
    ("separable_conv", "diagonal"): depthwise.separable_block,
    ("embedding", "kron"): embedding.embedding_block,
    ("embedding", "kron_indep"): embedding.embedding_block,
    ("tied_embedding", "kron_sum"): tied.tied_embedding_block,
    ("scale_and_shift", "full"): scale_and_shift.scale_and_shift_full_block,
    ("scale_and_shift", "diagonal"):
        scale_and_shift.scale_and_shift_diagonal_block,
    ("generic", "diagonal"): diagonal.naive_diagonal_block,
    ("generic", "full"): full.naive_full_block,
}


def inner_uses(kind: str, input_shapes: tuple) -> int:
  """Uses of a layer per example at one tag site, outside any ``lax.scan``.

  A dense layer applied to ``x: [B, T, ..., d_in]`` is used ``T·...`` times
  per example (each position is one use of the weights); so is an
  embedding looking up ``ids: [B, k, ...]``, and the output projection of a
  tied embedding (``tied_embedding`` sites) applied to ``[B, T, ..., d]``.
  Conv locations are not uses (KFC counts them in the block's scale), nor
  are the broadcast positions of a scale-and-shift layer (its per-example
  gradient sums over them).
  """
  if not input_shapes:
    return 1
  if kind in ("fully_connected", "tied_embedding") and len(
      input_shapes[0]) > 2:
    return int(math.prod(input_shapes[0][1:-1]))
  if kind == "embedding" and len(input_shapes[0]) > 1:
    return int(math.prod(input_shapes[0][1:]))
  return 1


def make_block(layer: Layer, config: BlockConfig | None = None):
  """The block for ``layer.kind`` and ``layer.approx``.

  A stacked layer (``layer.stack > 0``) gets a
  :class:`~kfac_jax_lite.blocks.stacked.StackedBlock` around the block of
  one slice.

  Args:
    layer: a static layer description (from :func:`kfac_jax_lite.scan`).
    config: options shared by every block; defaults to ``BlockConfig()``.

  Returns:
    A block (see :class:`~kfac_jax_lite.blocks.base.Block`).

  Raises:
    ValueError: when the layer's shapes or tag options do not fit its
      approximation (the message names the value and the fix).
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
