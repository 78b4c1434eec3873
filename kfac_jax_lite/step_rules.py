"""The rules of :func:`~kfac_jax_lite.kfac`'s step: its bounds, its statistics.

* KL clipping (Ba, Grosse & Martens 2017, sec. 5): the preconditioned
  gradient is scaled so that the step's KL under the quadratic model is at
  most ``C`` (:func:`kl_clip_coefficient`).
* The refresh warm-up: the damped inverses are refreshed at every one of
  the first ``w`` steps, then every ``p`` steps (:func:`refresh_due`).
  Early in training the factors change fastest, and an inverse kept for
  ``p`` steps sends the gradient into directions it scales by up to
  ``1/λ``: ``gᵀF̂⁻¹g`` then grows by orders of magnitude within a period
  and KL clipping shrinks the step to nothing. Fresh inverses keep
  ``gᵀF̂⁻¹g`` the size it has in the current curvature.
* The statistics' share of ``batch=`` (``stats_fraction`` of ``kfac``,
  ``kfac_adamw``, ``kfac_soap``): the transform computing the curvature
  is given the first ``⌈f·B⌉`` examples only (:func:`statistics_from_head`).

Why these defaults, with the measurements: docs/guides/tuning.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import linearization
from kfac_jax_lite import trees

# ``kfac``'s default KL-clipping bound ``C`` (``norm_constraint``): the
# ``kl_clip`` default of the PyTorch K-FAC implementations and ACKTR's
# trust radius.
DEFAULT_NORM_CONSTRAINT = 1e-3

# ``kfac``'s default refresh warm-up (``inverse_update_warmup``): the
# damped inverses are refreshed at each of the first 20 steps.
DEFAULT_INVERSE_UPDATE_WARMUP = 20


def kl_clip_coefficient(direction, grads, learning_rate, norm_constraint):
  """KL clipping (Ba, Grosse & Martens 2017, sec. 5).

  .. math:: \\nu = \\min\\left(1, \\sqrt{\\frac{C}{\\alpha^2\\, g^T \\hat F^{-1} g}}
    \\right)

  ``α²ν²gᵀF̂⁻¹g`` is the step's KL under the quadratic model (TF K-FAC's
  ``norm_constraint``; :func:`kfac` uses ``C = 1e-3`` by default).
  Returns ``ν`` (1 when the constraint is inactive or ``gᵀF̂⁻¹g <= 0``).
  """
  sq = trees.inner_products((direction, grads), ((0, 1),))[0]
  sq = learning_rate ** 2 * sq
  return jnp.where(sq > 0, jnp.minimum(1.0, jnp.sqrt(
      norm_constraint / jnp.where(sq > 0, sq, 1.0))), 1.0)


def check_warmup(value):
  """``inverse_update_warmup`` is an int >= 0 (a number of steps), or an
  integer scalar array (under ``optax.inject_hyperparams``)."""
  # A tracer is a jax.Array too.
  if isinstance(value, jax.Array) and jnp.issubdtype(
      value.dtype, jnp.integer) and value.shape == ():
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(
        f"inverse_update_warmup={value!r} must be an int >= 0: the number "
        "of first steps that refresh the inverses at every step (0: none), "
        "e.g. inverse_update_warmup=20.")


def refresh_due(count, period, warmup):
  """Whether step ``count`` refreshes the damped inverses.

  .. math:: \\mathrm{count} < w \\ \\lor\\ \\mathrm{count} \\bmod p = 0

  (``w = warmup``, ``p = period``; ``w = 0`` is the plain period).
  """
  return ((count % period) == 0) | (count < warmup)


def first_examples_of(batch, fraction: float, minimum: int = 1):
  """The first ``min(B, max(⌈f·B⌉, minimum))`` examples of every leaf of
  ``batch`` whose leading axis has ``B`` entries, ``B`` that of the first
  leaf with an axis."""
  sized = [x for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0)]
  if fraction >= 1.0 or not sized:
    return batch
  total = sized[0].shape[0]
  return linearization.batch_head(
      batch, total, linearization.stats_rows(total, fraction, minimum))


def statistics_from_head(inner: optax.GradientTransformation,
                         fraction: float, minimum: int = 1
                         ) -> optax.GradientTransformationExtraArgs:
  """``inner`` given only the first examples of ``batch=``
  (:func:`first_examples_of`); ``stats=`` passes unchanged."""
  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, *, batch=None, **extra_args):
    if extra_args.get("linearized") is not None:
      raise ValueError(
          f"update(linearized=...) with stats_fraction={fraction}: the "
          "statistics would come from every example of the linearised "
          "batch; pass batch=..., or drop stats_fraction.")
    if batch is not None:
      batch = first_examples_of(batch, fraction, minimum)
    return inner.update(updates, state, params, batch=batch, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def kfac_statistics_share(inner, fraction):
  """:func:`kfac`'s ``stats_fraction``: ``inner`` given the first
  ``max(⌈f·B⌉, 64)`` examples of ``batch=`` (all ``B`` if fewer); None
  keeps every example (and stays out of ``optax.inject_hyperparams``)."""
  if isinstance(fraction, jax.Array):
    raise ValueError(
        f"stats_fraction={fraction!r} is an array (optax.inject_hyperparams"
        " makes every number one): it sets the statistics' batch shape, so "
        "name it static, inject_hyperparams(kfac, static_args="
        "('stats_fraction',)).")
  if fraction is None:
    return inner
  linearization.check_fraction(fraction)
  if fraction >= 1.0:
    return inner
  return statistics_from_head(inner, fraction,
                              linearization.STATS_MIN_EXAMPLES)
