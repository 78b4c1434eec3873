"""Full blocks: a dense ``[P, P]`` Fisher block, ``(F + λI)^e``.

.. math::
  F = \\frac{1}{B} \\sum_{s,b} \\nabla_{s,b} \\nabla_{s,b}^T

with the per-example gradients of a *source* (:mod:`.per_example`): exact
for dense, scale-and-shift (TF K-FAC ``ScaleAndShiftFullFB``) and multi-use
layers; the "square of the sum" for generic parameters (``NaiveFullFB``).
Only sensible for small layers: the state is ``P x P``.

Damping is added directly. ``update_cache`` computes every registered power
from one eigendecomposition (a lone inverse uses a Cholesky solve) and the
lower Cholesky factor ``L`` of ``F + λI`` when asked; ``multiply`` (exp 1)
uses the live ``F`` and the last damping.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import per_example
from kfac_jax_lite.layer import Layer


class FullState(NamedTuple):
  f: jnp.ndarray        # [P, P] Fisher block, ravel order of the params
  weight: jnp.ndarray   # [] total EMA weight
  damping: jnp.ndarray  # [] damping at the last update_cache
  cache: dict           # "^e" -> [P, P]; "chol", "chol_inv" -> [P, P]


@dataclasses.dataclass(frozen=True)
class FullBlock(base.Shorthands, base.UnfusedProducts, base.FieldFactors,
                per_example.FromSource):
  """Dense Fisher block from a source of per-example gradients."""
  layer: Layer
  config: base.BlockConfig
  source: Any
  param_shapes: tuple   # equal blocks (up to layer) must act on equal shapes
  factor_fields = ("f",)

  def _cache_names(self):
    names = [f"^{e:g}" for e in self.config.cached_exps]
    if self.config.compute_cholesky:
      names.append("chol")
    if self.config.compute_cholesky_inverse:
      names.append("chol_inv")
    return names

  def init(self) -> FullState:
    dt = linalg.factor_dtype()
    f = jnp.zeros((self.num_params, self.num_params), dt)
    return FullState(f=f, weight=jnp.zeros((), dt), damping=jnp.zeros((), dt),
                     cache={n: jnp.zeros_like(f) for n in self._cache_names()})

  def compute_stats(self, data: base.LayerData) -> dict:
    rows = self.source.per_example(data)
    rows = jnp.concatenate(
        [r.reshape(r.shape[0], -1).astype(linalg.factor_dtype())
         for r in rows], axis=1)
    return {"f": linalg.symmetrize(rows.T @ rows) / data.batch_size}

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, self.factor_fields, stats, ema_decay)

  def update_cache(self, state, damping):
    damping = jnp.asarray(damping, linalg.factor_dtype())
    powers = linalg.damped_powers(state.f, damping, self.config.cached_exps)
    cache = {f"^{e:g}": p for e, p in powers.items()}
    if self.config.compute_cholesky or self.config.compute_cholesky_inverse:
      chol = linalg.damped_cholesky(state.f, damping)
      if self.config.compute_cholesky:
        cache["chol"] = chol
      if self.config.compute_cholesky_inverse:
        cache["chol_inv"] = linalg.lower_triangular_inverse(chol)
    return state._replace(cache=cache, damping=damping)

  def multiply_matpower(self, state, v, exp):
    """``(F + λI)^exp v``; exp 1 uses the live ``F``."""
    exp = base.check_exp(self, exp)
    x = base.ravel(v)
    if exp == 1.0:
      out = state.f @ x + state.damping * x
    else:
      out = state.cache[f"^{exp:g}"] @ x
    return base.unravel(out, v)

  def _triangular(self, state, name, v, transpose):
    m = state.cache[name]
    x = base.ravel(v)
    return base.unravel((m.T @ x) if transpose else (m @ x), v)

  def multiply_cholesky(self, state, v, transpose=False):
    """``L v`` (or ``Lᵀ v``), ``L Lᵀ = F + λI``."""
    base.check_cached(self, "compute_cholesky", "multiply_cholesky")
    return self._triangular(state, "chol", v, transpose)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    """``L⁻¹ v`` (or ``L⁻ᵀ v``)."""
    base.check_cached(self, "compute_cholesky_inverse",
                      "multiply_cholesky_inverse")
    return self._triangular(state, "chol_inv", v, transpose)

  def full_fisher_block(self, state):
    return state.f


# Generic parameters: the "square of the sum" full estimate.
naive_full_block = per_example.factory(FullBlock, per_example.param_grads)
# Dense layer: the per-example Fisher of ``(w, b)``, exact.
dense_full_block = per_example.factory(FullBlock, per_example.dense_grads)
