"""Diagonal blocks: ``(diag(d) + λI)^e`` on the layer's raveled parameters.

.. math::
  d = \\frac{1}{B} \\sum_{s,b} \\nabla_{s,b} \\odot \\nabla_{s,b}

with :math:`\\nabla_{s,b}` the per-example gradients of a *source*
(:mod:`.per_example`): the exact diagonal of the empirical per-example
Fisher for dense, conv, depthwise and scale-and-shift layers (TF K-FAC
``FullyConnectedDiagonalFB``, ``ConvDiagonalFB``,
``ScaleAndShiftDiagonalFB``), or the "square of the sum" for generic
parameters (``NaiveDiagonalFB``). Damping is added directly, whatever
``damping_type``; powers, Cholesky factors (``sqrt``, so ``transpose`` is
irrelevant) and their inverses are elementwise and computed on the fly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import per_example
from kfac_jax_lite.layer import Layer


class DiagonalState(NamedTuple):
  diag: jnp.ndarray     # [P] raveled diagonal of the Fisher block
  weight: jnp.ndarray   # [] total EMA weight
  damping: jnp.ndarray  # [] damping at the last update_cache


@dataclasses.dataclass(frozen=True)
class DiagonalBlock(base.Shorthands, base.UnfusedProducts, base.FieldFactors,
                    per_example.FromSource):
  """Diagonal Fisher block from a source of per-example gradients."""
  layer: Layer
  config: base.BlockConfig
  source: Any
  param_shapes: tuple   # equal blocks (up to layer) must act on equal shapes
  factor_fields = ("diag",)

  def init(self) -> DiagonalState:
    dt = linalg.factor_dtype()
    return DiagonalState(diag=jnp.zeros((self.num_params,), dt),
                         weight=jnp.zeros((), dt), damping=jnp.zeros((), dt))

  def compute_stats(self, data: base.LayerData) -> dict:
    sq = self.source.sum_squares(data)
    return {"diag": base.ravel(sq) / data.batch_size}

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, self.factor_fields, stats, ema_decay)

  def update_cache(self, state, damping):
    return state._replace(damping=jnp.asarray(damping, state.damping.dtype))

  def _damped(self, state):
    return jnp.maximum(state.diag, 0.0) + state.damping

  def multiply_matpower(self, state, v, exp):
    exp = base.check_exp(self, exp)
    return base.unravel(jnp.power(self._damped(state), exp) * base.ravel(v), v)

  def multiply_cholesky(self, state, v, transpose=False):
    del transpose  # Diagonal: C = Cᵀ.
    return base.unravel(jnp.sqrt(self._damped(state)) * base.ravel(v), v)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    del transpose
    return base.unravel(jax.lax.rsqrt(self._damped(state)) * base.ravel(v), v)

  def full_fisher_block(self, state):
    return jnp.diag(state.diag)


# Generic parameters: the diagonal of the "square of the sum" estimate.
naive_diagonal_block = per_example.factory(DiagonalBlock,
                                           per_example.param_grads)
# Dense layer: the exact diagonal of the per-example Fisher.
dense_diagonal_block = per_example.factory(DiagonalBlock,
                                           per_example.dense_grads)
