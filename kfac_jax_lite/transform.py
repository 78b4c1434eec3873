"""K-FAC as optax transforms: ``scale_by_kfac`` and ``kfac``.

All curvature state (factors, cached inverses, counters, the sampling key)
lives in the optax state; every decision (update the statistics? refresh
the inverses?) is traced with ``lax.cond``, so one jitted step is one
compiled program.

Example:
  >>> collection = kfac_jax_lite.scan(loss_fn, params, batch)
  >>> tx = kfac_jax_lite.kfac(1e-3, collection, damping=1e-3)
  >>> state = tx.init(params)
  >>> grads = jax.grad(loss_fn)(params, batch)
  >>> updates, state = tx.update(grads, state, params, batch=batch)
  >>> params = optax.apply_updates(params, updates)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import jax
from jax import lax
import jax.numpy as jnp
import optax

from kfac_jax_lite import estimator as estimator_lib
from kfac_jax_lite import linalg
from kfac_jax_lite.collection import LayerCollection

ScalarOrSchedule = Union[float, optax.Schedule]


class ScaleByKFACState(NamedTuple):
  count: jnp.ndarray               # [] int32, updates done
  rng: jnp.ndarray                 # [2] uint32, key for sampled targets
  num_cov_updates: jnp.ndarray     # [] int32, curvature updates done
  num_inverse_updates: jnp.ndarray  # [] int32, cache refreshes done
  estimator: estimator_lib.EstimatorState


def _check_period(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(
        f"{name}={value!r} must be a positive int (a number of steps).")


def _value(x, count):
  return x(count) if callable(x) else x


def check_batch_and_stats(batch, stats):
  if (batch is None) == (stats is None):
    raise ValueError(
        "update() needs exactly one of batch=... (K-FAC computes its "
        "statistics from the batch) or stats=... (from "
        "value_grad_and_stats); got "
        f"{'both batch and stats' if batch is not None else 'neither batch nor stats'}.")


def scale_by_kfac(collection: LayerCollection, *,
                  damping: ScalarOrSchedule = 1e-3,
                  cov_ema_decay: float = 0.95, cov_update_period: int = 1,
                  inverse_update_period: int = 5,
                  estimation_mode: str = "gradients", power: float = -1,
                  axis_name: Optional[str] = None, seed: int = 0,
                  **estimator_kwargs: Any
                  ) -> optax.GradientTransformationExtraArgs:
  """Preconditions gradients with the K-FAC curvature: ``F̂^power g``.

  .. math::
    u = (\\hat F + \\lambda I)^{p} g,\\qquad \\hat F = \\mathrm{diag}_\\ell
    (c_\\ell A_\\ell \\otimes G_\\ell)

  with factors refreshed every ``cov_update_period`` steps and their damped
  powers every ``inverse_update_period`` steps (Martens & Grosse 2015).
  Returns a *direction*, like ``optax.scale_by_adam``.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    damping: λ, a float or an ``optax.Schedule`` of the step count.
    cov_ema_decay: EMA decay of the factors, in ``[0, 1)``.
    cov_update_period: update the statistics every this many steps.
    inverse_update_period: refresh the damped powers every this many steps
      (at steps 0, k, 2k, ...), under ``lax.cond``.
    estimation_mode: ``gradients``, ``empirical``, ``curvature_prop``,
      ``curvature_prop_GGN``, ``exact``, ``exact_GGN``.
    power: the exponent ``p`` (``-1`` natural gradient, ``-0.5``).
    axis_name: ``pmap``/``shard_map`` axis to average statistics over.
    seed: seed of the sampling key kept in the state.
    **estimator_kwargs: more :class:`FisherEstimator` options
      (``num_samples``, ``damping_type``, ``exps``, ...).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes
    ``params`` and exactly one of ``batch=`` or ``stats=``.
  """
  _check_period("cov_update_period", cov_update_period)
  _check_period("inverse_update_period", inverse_update_period)
  if not isinstance(power, (int, float)) or power >= 0:
    raise ValueError(f"power={power!r} must be a negative number (-1, -0.5).")
  exps = tuple(estimator_kwargs.pop("exps", (power,)))
  if power not in exps:
    exps = exps + (power,)
  est = estimator_lib.FisherEstimator(
      collection, cov_ema_decay=cov_ema_decay, damping=0.0, exps=exps,
      estimation_mode=estimation_mode, axis_name=axis_name,
      **estimator_kwargs)
  if not callable(damping) and damping < 0:
    raise ValueError(f"damping={damping!r} must be >= 0.")

  def init_fn(params):
    zero = jnp.zeros((), jnp.int32)
    return ScaleByKFACState(count=zero, rng=jax.random.PRNGKey(seed),
                            num_cov_updates=zero, num_inverse_updates=zero,
                            estimator=est.init(params))

  def update_fn(updates, state, params=None, *, batch=None, stats=None,
                **extra_args):
    del extra_args  # Unknown extra args are ignored (optax.chain forwards).
    if params is None:
      raise ValueError("scale_by_kfac.update needs params=... (the current "
                       "parameters), as optax.adamw does.")
    check_batch_and_stats(batch, stats)
    key, next_rng = jax.random.split(state.rng)
    if axis_name is not None:
      key = jax.random.fold_in(key, lax.axis_index(axis_name))
    count = state.count

    def cov_update(est_state):
      return est.update_curvature(
          est_state, params, batch, key, stats=stats)

    do_cov = (count % cov_update_period) == 0
    est_state = lax.cond(do_cov, cov_update, lambda s: s, state.estimator)
    do_inv = (count % inverse_update_period) == 0
    lam = jnp.asarray(_value(damping, count), linalg.factor_dtype())
    est_state = lax.cond(do_inv, lambda s: est.update_cache(s, lam),
                         lambda s: s, est_state)
    direction = est.multiply_matpower(est_state, updates, power)
    new_state = ScaleByKFACState(
        count=count + 1, rng=next_rng,
        num_cov_updates=state.num_cov_updates + do_cov.astype(jnp.int32),
        num_inverse_updates=state.num_inverse_updates + do_inv.astype(
            jnp.int32),
        estimator=est_state)
    return direction, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def kfac(learning_rate: ScalarOrSchedule, collection: LayerCollection, *,
         momentum: float = 0.9, weight_decay: float = 0.0,
         **scale_by_kfac_kwargs: Any) -> optax.GradientTransformationExtraArgs:
  """K-FAC with momentum and a learning rate: descent updates like adam.

  .. math::
    v \\leftarrow \\mu v + \\hat F^{-1} g + \\eta\\,\\theta,\\qquad
    \\Delta\\theta = -\\alpha\\, v

  (decoupled weight decay ``η`` after preconditioning, as TF K-FAC's
  ``use_weight_decay``).

  Args:
    learning_rate: α, a float or schedule.
    collection: from :func:`kfac_jax_lite.scan`.
    momentum: μ (0 disables momentum).
    weight_decay: η.
    **scale_by_kfac_kwargs: passed to :func:`scale_by_kfac`.
  """
  parts = [scale_by_kfac(collection, **scale_by_kfac_kwargs)]
  if weight_decay:
    parts.append(optax.add_decayed_weights(weight_decay))
  if momentum:
    parts.append(optax.trace(decay=momentum))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)
