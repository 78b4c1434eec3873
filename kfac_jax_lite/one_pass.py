"""The one-pass loss / gradient / statistics function.

:func:`value_grad_and_stats` runs one forward pass of the collection's loss
function (a :class:`~kfac_jax_lite.linearization.Linearized`) and returns the
loss, the gradient and the curvature statistics of a
:class:`~kfac_jax_lite.estimator.FisherEstimator`'s blocks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from kfac_jax_lite.collection import LayerCollection
from kfac_jax_lite.estimator import FisherEstimator
from kfac_jax_lite.linearization import STATS_MIN_EXAMPLES


def value_grad_and_stats(loss_fn: Callable, collection: LayerCollection, *,
                         estimation_mode: str = "gradients",
                         has_aux: bool = False, num_samples: int = 1,
                         axis_name: Any = None,
                         stats_sync: str = "every_update",
                         stats_fraction: float = 1.0,
                         stats_min_examples: int = STATS_MIN_EXAMPLES,
                         estimator: Optional[FisherEstimator] = None):
  """Loss, gradient and curvature statistics from one forward pass.

  Returns ``fn(params, batch, rng) -> (loss_or_(loss, aux), grads, stats)``.
  The gradient equals ``jax.grad(loss_fn)``; ``stats`` can be passed to
  ``FisherEstimator.update_curvature(stats=...)`` or to the optax
  transforms' ``update(..., stats=...)``.

  Under ``pmap``/``shard_map`` the loss and gradient are this replica's
  (average the gradient yourself, ``lax.pmean(grads, axis_name)``); the
  statistics are reduced over ``axis_name`` as the consumer expects, so
  give the same ``axis_name`` and ``stats_sync`` as the transform (a
  mismatch raises ``ValueError`` in ``update``).

  Args:
    loss_fn: the scanned loss function (must be ``collection.loss_fn``).
    collection: its LayerCollection.
    estimation_mode: as :class:`FisherEstimator`; must match the consumer.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    num_samples: target draws per example.
    axis_name: the data-parallel axis, as for :class:`FisherEstimator`.
    stats_sync: as for :class:`FisherEstimator`; must match the consumer.
    stats_fraction: as for :class:`FisherEstimator`.
    stats_min_examples: as for :class:`FisherEstimator`.
    estimator: use this estimator's blocks and options instead (give the
      consumer the same one).

  Returns:
    ``fn(params, batch, rng) -> (loss_or_(loss, aux), grads, stats)``.

  Raises:
    ValueError: if ``loss_fn`` is not ``collection.loss_fn`` or
      ``has_aux`` differs from the scan's.

  Example:
    >>> fn = kl.value_grad_and_stats(loss_fn, collection)
    >>> loss, grads, stats = fn(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params,
    ...                                stats=stats)
  """
  if loss_fn is not collection.loss_fn:
    raise ValueError(
        "value_grad_and_stats(loss_fn=...) must be the function the "
        "collection was scanned from (collection.loss_fn).")
  if has_aux != collection.has_aux:
    raise ValueError(
        f"has_aux={has_aux} but the collection was scanned with "
        f"has_aux={collection.has_aux}.")
  est = estimator or FisherEstimator(
      collection, estimation_mode=estimation_mode, num_samples=num_samples,
      axis_name=axis_name, stats_sync=stats_sync,
      stats_fraction=stats_fraction, stats_min_examples=stats_min_examples)

  def fn(params, batch, rng):
    lin = est.linearize(params, batch)
    stats = est.stats_from(lin, rng)
    out = (lin.loss, lin.aux) if has_aux else lin.loss
    return out, lin.gradient(), stats

  return fn
