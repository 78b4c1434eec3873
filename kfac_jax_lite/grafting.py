"""Step-size grafting and the K-FAC recipe built on it: ``graft``,
``kfac_adamw``.

Grafting (Agarwal, Anil, Hazan, Koren & Zhang 2020, "Disentangling
Adaptive Gradient Methods from Learning Rates") takes each parameter
tensor's step *direction* from one optimizer and its step *length* from
another. ``graft(scale_by_kfac(...), optax.scale_by_rms(...))`` keeps
K-FAC's direction within each tensor and RMSProp's per-tensor norm, so the
learning rate, momentum and weight decay of AdamW carry over unchanged;
:func:`kfac_adamw` is that chain, as ``optax.adamw`` is a chain of
``scale_by_adam``. It is the recipe ``docs/transformers.md`` measures on a
character-level GPT.

Example:
  >>> collection = kfac_jax_lite.scan(loss_fn, params, batch)
  >>> tx = kfac_jax_lite.kfac_adamw(3e-3, collection)
  >>> state = tx.init(params)
  >>> grads = jax.grad(loss_fn)(params, batch)
  >>> updates, state = tx.update(grads, state, params, batch=batch)
  >>> params = optax.apply_updates(params, updates)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import estimator as estimator_lib
from kfac_jax_lite import linearization
from kfac_jax_lite.collection import LayerCollection
from kfac_jax_lite.curvature import ScalarOrSchedule
from kfac_jax_lite.curvature import check_nonnegative
from kfac_jax_lite.step_rules import statistics_from_head
from kfac_jax_lite.transform import make_estimator
from kfac_jax_lite.transform import scale_by_kfac
from kfac_jax_lite.transform import skip_nonfinite


class GraftState(NamedTuple):
  """State of :func:`graft`.

  Attributes:
    direction: the direction transformation's state.
    magnitude: the magnitude transformation's state.

  Example:
    >>> tx = kl.graft(kl.scale_by_kfac(collection), optax.scale_by_rms())
    >>> state = tx.init(params)          # a GraftState
    >>> state.direction                  # scale_by_kfac's state
  """
  direction: Any
  magnitude: Any


def _graft_leaf(d, m):
  """``d ‖m‖ / ‖d‖``; ``m`` where ``d`` is all zeros."""
  nd, nm = jnp.linalg.norm(d), jnp.linalg.norm(m)
  return jnp.where(nd > 0, d * (nm / jnp.where(nd > 0, nd, 1.0)), m)


def graft(direction: optax.GradientTransformation,
          magnitude: optax.GradientTransformation
          ) -> optax.GradientTransformationExtraArgs:
  """Per-tensor grafting: ``direction``'s direction, ``magnitude``'s norm.

  .. math::
    u_i = d_i\\,\\frac{\\lVert m_i\\rVert_2}{\\lVert d_i\\rVert_2}

  for each leaf ``i`` of the updates, where ``d`` and ``m`` are the outputs
  of ``direction`` and ``magnitude`` on the same incoming updates (``m_i``
  itself where ``d_i`` is all zeros). Within a tensor the step points where
  ``direction`` says; its length is that of ``magnitude``'s step, so the
  learning rate tuned for ``magnitude`` carries over (Agarwal et al. 2020,
  sec. 3, "M#D" with M = ``magnitude``, D = ``direction``; the grafting
  with which Shampoo is run, Anil et al. 2020, "Scalable Second Order
  Optimization for Deep Learning", sec. 4).

  Both transformations receive ``params`` and the extra arguments
  (``batch=``, ``stats=``, ...), so a K-FAC direction works as is.

  Args:
    direction: gives each tensor's direction, e.g.
      :func:`~kfac_jax_lite.scale_by_kfac`.
    magnitude: gives each tensor's norm, e.g. ``optax.scale_by_rms(...)``
      (RMSProp) or ``optax.scale_by_adam(...)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`GraftState`.

  Example:
    >>> tx = optax.chain(
    ...     kfac_jax_lite.graft(kfac_jax_lite.scale_by_kfac(collection),
    ...                         optax.scale_by_rms(bias_correction=True)),
    ...     optax.scale_by_learning_rate(1e-3))
  """
  direction = optax.with_extra_args_support(direction)
  magnitude = optax.with_extra_args_support(magnitude)

  def init_fn(params):
    return GraftState(direction.init(params), magnitude.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    d, d_state = direction.update(updates, state.direction, params,
                                  **extra_args)
    m, m_state = magnitude.update(updates, state.magnitude, params,
                                  **extra_args)
    return jax.tree.map(_graft_leaf, d, m), GraftState(d_state, m_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def kfac_adamw(learning_rate: ScalarOrSchedule,
               collection: Optional[LayerCollection], *,
               b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.01,
               damping: ScalarOrSchedule = 1e-3,
               inverse_update_period: int = 10,
               cov_update_period: int = 1,
               stats_fraction: float = 0.125, seed: int = 0,
               estimator: Optional[estimator_lib.FisherEstimator] = None,
               stats_position_stride: Optional[int] = None,
               mesh: Any = None, curvature_axis: Any = None,
               param_shardings: Any = None,
               ) -> optax.GradientTransformationExtraArgs:
  """AdamW with K-FAC's per-tensor directions: the transformer recipe.

  .. math::
    r_t = \\frac{g_t}{\\sqrt{\\hat v_t} + \\epsilon},\\quad
    d_t = (\\hat F + \\lambda I)^{-1} g_t,\\quad
    u_{t,i} = d_{t,i}\\,\\frac{\\lVert r_{t,i}\\rVert}{\\lVert d_{t,i}\\rVert},
    \\quad
    \\Delta\\theta_t = -\\alpha\\,(\\hat m_t + \\eta\\,\\theta_t)

  with ``v̂`` Adam's bias-corrected second moment of ``g`` (decay
  ``b2``), ``m̂`` the bias-corrected EMA (decay ``b1``) of the grafted
  ``u``, per parameter tensor ``i``. It is

  .. code-block:: python

    skip_nonfinite(optax.chain(
        graft(scale_by_kfac(collection, damping=damping, ...),  # F̂⁻¹g
              optax.scale_by_rms(b2, eps, eps_in_sqrt=False,
                                 bias_correction=True)),
        optax.ema(b1, debias=True),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate)))

  with ``scale_by_kfac`` given only the first ``⌈stats_fraction · B⌉``
  examples of ``batch=``. Its learning rate is AdamW's: where
  ``optax.adamw(lr, weight_decay=wd)`` works, ``kfac_adamw(lr,
  collection, weight_decay=wd)`` needs no new search (grafting, Agarwal et
  al. 2020); damping matters less than for :func:`~kfac_jax_lite.kfac`,
  since it shapes the direction only. The defaults are those
  ``docs/transformers.md`` measures against AdamW on the character-level
  GPT of ``examples/char_gpt.py``.

  Args:
    learning_rate: α, a float or schedule (AdamW's).
    collection: from :func:`kfac_jax_lite.scan` (None with ``estimator``).
    b1: decay of the momentum (Adam's first moment).
    b2: decay of the second moment that sets each tensor's step length.
    eps: added to ``√v̂``.
    weight_decay: η, decoupled (AdamW's).
    damping: λ of the K-FAC direction, a float or schedule.
    inverse_update_period: refresh the damped inverses every this many
      steps.
    cov_update_period: fold in statistics every this many steps.
    stats_fraction: the share ``f ∈ (0, 1]`` of ``batch=``'s examples the
      curvature statistics use: the first ``⌈f·B⌉`` of every batch leaf
      whose leading axis has the first leaf's ``B`` entries (put the
      example axis first). The gradient is whatever the caller passes.
      Ignored with ``stats=`` (the caller computed them).
    seed: seed of K-FAC's sampling key.
    estimator: a :class:`~kfac_jax_lite.FisherEstimator` for the other
      options of :func:`~kfac_jax_lite.scale_by_kfac` (``cov_ema_decay``,
      ``estimation_mode``, ``approximations`` through its collection, ...).
    stats_position_stride: ``k``: the dense layers' Kronecker factors
      average every ``k``-th position of the statistics' sequences, from
      an offset drawn at each pass (unbiased, ``k`` times fewer flops in
      the factor products; the variance is stated at
      :class:`~kfac_jax_lite.FisherEstimator`). None: the estimator's
      default, chosen when lowering (every position on CPU, every 4th
      elsewhere). Set it on the ``estimator`` instead when giving one.
    mesh: spread the curvature over this ``jax.sharding.Mesh``, with
      ``curvature_axis`` the axis name(s), as for
      :func:`~kfac_jax_lite.scale_by_kfac`.
    curvature_axis: see ``mesh``.
    param_shardings: the parameters' shardings when they are sharded
      (FSDP), as for :func:`~kfac_jax_lite.scale_by_kfac`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes
    ``params`` and exactly one of ``batch=`` or ``stats=``; steps whose
    gradients, statistics, learning rate or damping are not finite are
    skipped and counted (:func:`~kfac_jax_lite.skip_nonfinite`).

  Raises:
    ValueError: for a ``stats_fraction`` outside ``(0, 1]``, a negative
      ``b1``, ``b2``, ``eps`` or ``weight_decay``, or a
      ``stats_position_stride`` that is not a positive int (or given with
      ``estimator``).

  Example:
    >>> tx = kfac_jax_lite.kfac_adamw(3e-3, collection)
    >>> grads = jax.grad(loss_fn)(params, batch)
    >>> updates, state = tx.update(grads, state, params, batch=batch)

  References:
    Agarwal et al. (2020), arXiv:2002.11803, sec. 3 (grafting);
    Loshchilov & Hutter (2019), "Decoupled Weight Decay Regularization";
    Martens & Grosse (2015), K-FAC.
  """
  for name, value in (("b1", b1), ("b2", b2), ("eps", eps),
                      ("weight_decay", weight_decay)):
    check_nonnegative(name, value)
  linearization.check_fraction(stats_fraction)
  if stats_position_stride is not None:
    linearization.check_stride(stats_position_stride)
    estimator = make_estimator(collection, estimator, -1,
                               stats_position_stride=stats_position_stride)
  direction = scale_by_kfac(
      collection, damping=damping, cov_update_period=cov_update_period,
      inverse_update_period=inverse_update_period,
      learning_rate=learning_rate, seed=seed, estimator=estimator,
      mesh=mesh, curvature_axis=curvature_axis,
      param_shardings=param_shardings)
  if stats_fraction < 1.0:
    direction = statistics_from_head(direction, stats_fraction)
  rms = optax.scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False,
                           bias_correction=True)
  return skip_nonfinite(optax.chain(
      graft(direction, rms),
      optax.ema(b1, debias=True),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate)))
