"""Diagonal blocks: ``(diag(d) + λI)^e`` on the layer's raveled parameters.

``NaiveDiagonalBlock`` (generic parameters, TF K-FAC ``NaiveDiagonalFB``)
estimates the diagonal from the gradient of the summed per-source loss,
:math:`d = \\frac{1}{B} \\sum_s (\\sum_b g_{s,b})^2` ("square of the sum").
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.collection import Layer


class DiagonalState(NamedTuple):
  diag: jnp.ndarray     # [P] raveled diagonal of the Fisher block
  weight: jnp.ndarray   # [] total EMA weight
  damping: jnp.ndarray  # [] damping at the last update_cache


def _ravel(v: tuple):
  dt = linalg.factor_dtype()
  return jnp.concatenate([x.astype(dt).reshape(-1) for x in v])


def _unravel(flat, like: tuple) -> tuple:
  out, i = [], 0
  for l in like:
    n = int(math.prod(l.shape))
    out.append(flat[i:i + n])
    i += n
  return base.vector_dtype_cast(tuple(out), like)


@dataclasses.dataclass(frozen=True)
class NaiveDiagonalBlock(base.Block):
  """Diagonal block from parameter gradients (generic layers)."""
  layer: Layer
  config: base.BlockConfig
  needs_param_grads = True

  def init(self) -> DiagonalState:
    dt = linalg.factor_dtype()
    return DiagonalState(diag=jnp.zeros((self.layer.num_params,), dt),
                         weight=jnp.zeros((), dt), damping=jnp.zeros((), dt))

  def compute_stats(self, data: base.LayerData) -> dict:
    dt = linalg.factor_dtype()
    g = jnp.concatenate([pg.reshape(pg.shape[0], -1).astype(dt)
                         for pg in data.param_grads], axis=1)
    return {"diag": jnp.sum(jnp.square(g), axis=0) / data.batch_size}

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, ("diag",), stats, ema_decay)

  def update_cache(self, state, damping):
    return state._replace(damping=jnp.asarray(damping, state.damping.dtype))

  def multiply_matpower(self, state, v, exp):
    exp = base.check_exp(self, exp)
    d = jnp.maximum(state.diag, 0.0) + state.damping
    return _unravel(jnp.power(d, exp) * _ravel(v), v)

  def multiply_cholesky(self, state, v, transpose=False):
    del transpose  # Diagonal: C = Cᵀ.
    d = jnp.maximum(state.diag, 0.0) + state.damping
    return _unravel(jnp.sqrt(d) * _ravel(v), v)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    del transpose
    d = jnp.maximum(state.diag, 0.0) + state.damping
    return _unravel(jax.lax.rsqrt(d) * _ravel(v), v)

  def full_fisher_block(self, state):
    return jnp.diag(state.diag)
