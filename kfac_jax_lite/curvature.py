"""The curvature update as an optax transformation: ``update_curvature``.

It keeps the K-FAC state (factors, cached damped powers, counters, the
sampling key) and, every step, folds in the statistics of the batch and
refreshes the caches as scheduled; it returns its ``updates`` unchanged.
:func:`~kfac_jax_lite.scale_by_kfac` and
:func:`~kfac_jax_lite.kfac_optimizer` run it and read the curvature from its
state, as ``optax.contrib.scale_by_sophia`` runs its Hessian estimator.

Statistics are folded in at steps ``0, k, 2k, ...`` (``k =
cov_update_period``) and the damped powers refreshed at steps ``0, p, 2p,
...`` (``p = inverse_update_period``), each decision a ``lax.cond``, so one
jitted step is one compiled program.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Union

import jax
import jax.core  # jax.core.Tracer
from jax import lax
import jax.numpy as jnp
import optax

from kfac_jax_lite import distributed
from kfac_jax_lite import estimator as estimator_lib
from kfac_jax_lite import keys as keys_lib
from kfac_jax_lite import linalg
from kfac_jax_lite import stats as stats_lib
from kfac_jax_lite import step_rules
from kfac_jax_lite import trees

ScalarOrSchedule = Union[float, optax.Schedule]


def check_period(name, value):
  """A period is a positive int, or an integer scalar array (injected)."""
  if isinstance(value, (jax.Array, jax.core.Tracer)) and jnp.issubdtype(
      value.dtype, jnp.integer) and value.shape == ():
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(
        f"{name}={value!r} must be a positive int (a number of steps).")


def check_nonnegative(name, value):
  """Validates Python numbers; arrays (e.g. injected) are checked at each
  step (a non-finite value skips the step)."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    if math.isnan(value) or value < 0:
      raise ValueError(f"{name}={value!r} must be a number >= 0.")


def value_at(x, count):
  """A hyperparameter's value at step ``count`` (float, array or schedule)."""
  return x(count) if callable(x) else x


def dynamic(*values) -> tuple:
  """The values that may be non-finite at run time: every one that is not
  a finite Python number (those are checked when the transform is built)."""
  return tuple(v for v in values if not (
      isinstance(v, (int, float)) and math.isfinite(v)))


def _finite_marker(stats):
  """The statistics' one-scalar finiteness marker, or None for statistics
  that carry none (then every leaf is checked)."""
  return stats.finite_marker if isinstance(stats, stats_lib.Stats) else None


def inputs_finite(updates, stats=None, axis_name=None) -> jnp.ndarray:
  """True when ``updates`` (and ``stats``, if given) are all finite.

  With ``axis_name``: on every replica of the axis (the replicas' inputs
  may differ, e.g. statistics under ``stats_sync="before_refresh"``), so
  every replica takes the same decision and their states never drift.

  Statistics from :func:`~kfac_jax_lite.value_grad_and_stats` carry a
  finiteness marker (:func:`kfac_jax_lite._xla_cpu.finite_marker` of them,
  taken on the stacked groups before they were split per layer); it
  stands for their leaves here. Other ``stats`` are checked leaf by leaf.
  """
  leaves = jax.tree.leaves(updates)
  check = [[x for x in leaves if jnp.ndim(x)]]
  if stats is not None:
    marker = _finite_marker(stats)
    check.append(stats if marker is None else marker)
  finite = trees.all_finite(check)
  for x in leaves:  # Scalars (a learning rate) apart: no concatenation.
    if not jnp.ndim(x):
      finite = finite & jnp.all(jnp.isfinite(x))
  if axis_name is not None:
    distributed.axis_size(axis_name)  # A clear error if it is not bound.
    finite = lax.pmin(finite.astype(jnp.int32), axis_name) > 0
  return finite


def check_batch_and_stats(batch, stats):
  if (batch is None) == (stats is None):
    which = "both batch and stats" if batch is not None else (
        "neither batch nor stats")
    raise ValueError(
        "update() needs exactly one of batch=... (K-FAC computes its "
        "statistics from the batch) or stats=... (from "
        f"value_grad_and_stats); got {which}.")


class CurvatureState(NamedTuple):
  """State of :func:`update_curvature`: every array K-FAC keeps.

  Attributes:
    count: ``[]`` int32, the steps applied.
    rng: ``[2]`` uint32, the key of the sampled targets.
    num_cov_updates: ``[]`` int32, the statistics updates done.
    num_inverse_updates: ``[]`` int32, the steps that refreshed a cache.
    last_finite: ``[]`` bool, whether the last step's inputs were finite.
    estimator: the :class:`~kfac_jax_lite.EstimatorState` (factors and
      caches, same-shaped blocks stacked).

  Example:
    >>> state = kl.scale_by_kfac(collection).init(params)
    >>> state.count, state.estimator.blocks[0]
  """
  count: jnp.ndarray                # [] int32, steps applied
  rng: jnp.ndarray                  # [2] uint32, key for sampled targets
  num_cov_updates: jnp.ndarray      # [] int32, statistics updates done
  num_inverse_updates: jnp.ndarray  # [] int32, steps that refreshed a cache
  last_finite: jnp.ndarray          # [] bool, the last step's inputs finite
  estimator: estimator_lib.EstimatorState  # same-shaped blocks stacked


def _every_step(period) -> bool:
  return isinstance(period, int) and period == 1


def _refresh(est, period, stagger, count, est_state, damping, gate,
             warmup=0):
  """Refreshes the caches as scheduled, where ``gate`` holds; returns the
  state and whether a refresh ran."""
  if stagger and not isinstance(period, int):
    raise ValueError(
        "stagger_inverse_updates=True needs a static inverse_update_period;"
        " mark it static (e.g. inject_hyperparams(..., static_args=...)).")
  def refresh(s, layers=None):
    # Named for profiles (docs/performance.md#where-the-gpt-step-goes).
    with jax.named_scope("kfac_refresh"):
      return est.update_cache(s, damping, layers)

  def keep(s):
    return s

  if not stagger or _every_step(period):
    do = step_rules.refresh_due(count, period, warmup) & gate
    return lax.cond(do, refresh, keep, est_state), do
  # Every block at step 0 and through the warm-up, then round robin.
  new = lax.cond((count < jnp.maximum(warmup, 1)) & gate, refresh, keep,
                 est_state)
  n = len(est.blocks)
  for j in range(period):
    layers = tuple(range(j, n, period))
    if layers:
      new = lax.cond((count >= jnp.maximum(warmup, 1))
                     & (count % period == j) & gate,
                     lambda s, l=layers: refresh(s, l), keep, new)
  return new, gate


def update_curvature(estimator: estimator_lib.FisherEstimator, *,
                     damping: ScalarOrSchedule = 1e-3,
                     cov_update_period: int = 1,
                     inverse_update_period: int = 5,
                     stagger_inverse_updates: bool = False,
                     seed: int = 0, inverse_update_warmup: int = 0,
                     ) -> optax.GradientTransformationExtraArgs:
  """Periodic statistics updates and cache refreshes of a K-FAC estimate.

  .. math::
    \\bar A_\\ell \\leftarrow \\rho \\bar A_\\ell + (1-\\rho) A_\\ell,\\quad
    \\bar G_\\ell \\leftarrow \\rho \\bar G_\\ell + (1-\\rho) G_\\ell
    \\ \\text{every } k \\text{ steps};\\qquad
    (\\bar A_\\ell \\otimes \\bar G_\\ell + \\lambda I)^{e}
    \\ \\text{every } p \\text{ steps}

  (Martens & Grosse 2015, sec. 5 and 8; ``ρ`` the estimator's
  ``cov_ema_decay``, ``e`` its ``exps``).

  ``update(updates, state, params, *, batch=None, stats=None,
  linearized=None)`` returns ``updates`` unchanged and the new state. It
  needs exactly one of ``batch`` or ``stats`` (statistics from
  :func:`~kfac_jax_lite.value_grad_and_stats`), or ``linearized`` (an
  :class:`~kfac_jax_lite.estimator.Linearized` of the batch, when the
  caller already ran the forward pass; ``stats``, if also given, win).

  A step applies only when ``updates``, ``stats`` and the damping are
  finite (on every replica of the estimator's ``axis_name``): otherwise
  the counters, the key and the caches stay as they are, and
  ``state.last_finite`` is False. Pass as ``updates`` whatever the step's
  update is computed from (the gradients, or the values a product reads
  them as). The factors fold in only finite statistics, whatever the
  gradients.

  Args:
    estimator: the :class:`~kfac_jax_lite.FisherEstimator` whose state this
      keeps.
    damping: λ of the refreshed powers, a float or an ``optax.Schedule`` of
      the step count.
    cov_update_period: update the statistics every this many steps.
    inverse_update_period: refresh the damped powers every this many steps.
    stagger_inverse_updates: refresh every block at step 0, then a ``1/p``
      slice of the blocks at every step (round robin), so no step pays for
      all refreshes at once.
    seed: seed of the sampling key kept in the state.
    inverse_update_warmup: refresh the damped powers at each of the first
      this many applied steps too (0: none; :func:`kfac` uses 20), as
      :func:`~kfac_jax_lite.step_rules.refresh_due` says.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`CurvatureState`.

  Raises:
    ValueError: for a period below 1, a negative ``damping`` or
      ``inverse_update_warmup``; at
      ``update``, with neither or both of ``batch`` and ``stats``.

  Example:
    >>> est = kl.FisherEstimator(collection, exps=(-1, -0.5))
    >>> tx = optax.chain(kl.update_curvature(est, damping=1e-3),
    ...                  optax.scale_by_adam())
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params, batch=batch)
  """
  est = estimator
  check_period("cov_update_period", cov_update_period)
  check_period("inverse_update_period", inverse_update_period)
  check_nonnegative("damping", damping)
  step_rules.check_warmup(inverse_update_warmup)

  def init_fn(params):
    # Distinct arrays per field: a shared buffer cannot be donated twice.
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    state = est.init(params)
    return CurvatureState(count=zero(), rng=jax.random.PRNGKey(seed),
                          num_cov_updates=zero(), num_inverse_updates=zero(),
                          last_finite=jnp.ones((), bool), estimator=state)

  def update_fn(updates, state, params=None, *, batch=None, stats=None,
                linearized=None, **extra_args):
    del extra_args  # Unknown extra args are ignored (optax.chain forwards).
    if linearized is not None:
      batch = None
      if stats is None:
        stats = lambda key: est.stats_from(linearized, key)  # noqa: E731
    check_batch_and_stats(batch, stats)
    count = state.count
    lam = value_at(damping, count)
    checked = stats if not callable(stats) else None
    with jax.named_scope("kfac_finite"):
      finite = inputs_finite((updates, dynamic(lam)), checked, est.axis_name)
    # The estimator hashes the key with the axis index (per-replica draws).
    key, next_rng = keys_lib.step_keys(state.rng)

    def cov_update(s):
      st = stats(key) if callable(stats) else stats
      return est.update_curvature(s, params, batch, key, stats=st)

    # No conditional or select around the whole state: the factors fold in
    # only finite statistics, and the gate joins the refresh's predicate
    # (docs/performance.md#skipping-without-copying-the-curvature).
    if _every_step(cov_update_period):
      do_cov = jnp.asarray(True)
      est_state = cov_update(state.estimator)
    else:
      do_cov = (count % cov_update_period) == 0
      est_state = lax.cond(do_cov, cov_update, lambda s: s, state.estimator)
    lam = jnp.asarray(lam, linalg.factor_dtype())
    est_state, do_inv = _refresh(est, inverse_update_period,
                                 stagger_inverse_updates, count, est_state,
                                 lam, finite, inverse_update_warmup)
    one = lambda b: b.astype(jnp.int32)  # noqa: E731
    return updates, CurvatureState(
        count=count + one(finite), rng=jnp.where(finite, next_rng, state.rng),
        num_cov_updates=state.num_cov_updates + one(do_cov & finite),
        num_inverse_updates=state.num_inverse_updates + one(do_inv),
        last_finite=finite, estimator=est_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
