"""Reductions and averages over pytrees of arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax_lite import _xla_cpu


def all_finite(tree) -> jnp.ndarray:
  """True when every floating-point leaf of ``tree`` is finite.

  One ``isfinite`` of :func:`kfac_jax_lite._xla_cpu.finite_marker`, which
  is exactly ``0`` when everything is finite and NaN otherwise. Integer
  leaves are always finite.
  """
  return jnp.isfinite(_xla_cpu.finite_marker(tree))


def inner_products(trees, pairs) -> jnp.ndarray:
  """``[⟨trees[i], trees[j]⟩ for (i, j) in pairs]``, in the factor dtype.

  The trees (same structure, e.g. a gradient, a direction and a velocity;
  integer leaves are skipped) are cast to the factor dtype (float32, or
  float64 under ``jax_enable_x64``, as :func:`linalg.factor_dtype`) and
  cut into aligned :func:`~kfac_jax_lite._xla_cpu.flat_chunks` once each;
  every product is one ``vdot`` per chunk
  (docs/performance.md#flat-chunks).
  """
  dt = jax.dtypes.canonicalize_dtype(jnp.float64)

  def cast(x):
    x = jnp.asarray(x)
    return x.astype(dt) if jnp.issubdtype(x.dtype, jnp.inexact) else x

  flat = [_xla_cpu.flat_chunks(jax.tree.map(cast, t)) for t in trees]
  out = []
  for i, j in pairs:
    total = jnp.zeros((), dt)
    for a, b in zip(flat[i], flat[j], strict=True):
      total = total + jnp.vdot(a, b)
    out.append(total)
  return jnp.stack(out)


def ema(old, new, weight, decay):
  """Zero-debiased exponential moving average.

  With :math:`w_t = \\rho w_{t-1} + 1`,
  :math:`x_t = (\\rho w_{t-1} x_{t-1} + s_t) / w_t`, the exactly debiased
  average :math:`\\sum_k \\rho^k s_{t-k} / \\sum_k \\rho^k`: after one update
  it equals the first statistic (TF K-FAC ``MovingAverageVariable``).

  Returns:
    ``(new_value, new_weight)``.
  """
  w = decay * weight + 1.0
  return jax.tree.map(lambda o, n: (decay * weight * o + n) / w, old, new), w
