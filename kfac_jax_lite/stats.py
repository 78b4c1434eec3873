"""The statistics a step carries: :class:`Stats`.

:func:`make_stats` turns a statistics pass
(:func:`kfac_jax_lite.linearization.statistics_pass`) into one stacked
entry per group of the estimator state (:mod:`kfac_jax_lite.grouping`), with a
finiteness marker, averaged over a data-parallel axis unless the average is
deferred to the refresh (``stats_sync="before_refresh"``); the static
``reduction`` records which, and :func:`check_reduction` refuses statistics
reduced otherwise than a consumer expects.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from kfac_jax_lite import _xla_cpu
from kfac_jax_lite import grouping
from kfac_jax_lite import linalg
from kfac_jax_lite.linearization import Pass


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("stacked", "params", "finite_marker"),
                   meta_fields=("reduction",))
@dataclasses.dataclass(frozen=True)
class Stats:
  """Minibatch statistics, grouped as the estimator state.

  Attributes:
    stacked: per group of the state (same keys as
      :attr:`EstimatorState.stacked`), the blocks' ``compute_stats``,
      stacked like the group's state.
    params: the mean per-source gradient (``compute_params_stats``), or
      ``()``.
    finite_marker: ``[]`` float32, ``0`` when every statistic is finite and
      NaN otherwise (:func:`~kfac_jax_lite._xla_cpu.finite_marker`); it
      stands for the statistics in finiteness checks.
    reduction: static: ``()``, or ``(axis_name, stats_sync)`` when the
      statistics were reduced over a data-parallel axis; the consumer
      checks that it expects the same reduction.

  Example:
    >>> loss, grads, stats = kl.value_grad_and_stats(loss_fn, collection)(
    ...     params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params,
    ...                                stats=stats)
  """
  stacked: dict
  params: Any
  finite_marker: Any
  reduction: tuple = ()

  @property
  def blocks(self) -> tuple:
    """One block's statistics per layer, in collection order (read-only)."""
    return grouping.layer_view(self.stacked)


def reduction(axis_name, stats_sync) -> tuple:
  """:attr:`Stats.reduction` for an estimator's ``axis_name`` and
  ``stats_sync``."""
  return () if axis_name is None else (axis_name, stats_sync)


def make_stats(p: Pass, params, blocks, groups, *, params_stats: bool,
               axis_name=None, stats_sync="every_update") -> Stats:
  """The :class:`Stats` of a statistics pass: each group's statistics
  computed stacked (:func:`grouping.group_stats`), checked for
  finiteness, and averaged over ``axis_name`` as ``stats_sync`` says."""
  with jax.named_scope("kfac_stats"):
    stacked = grouping.group_stats(blocks, groups, p.layer_data)
  mean_grads = ()
  if params_stats:
    leaves = [jnp.sum(g, axis=0).astype(linalg.factor_dtype()) / p.grad_norm
              for g in p.param_grads_all]
    mean_grads = jax.tree.unflatten(jax.tree.structure(params), leaves)
  # Checked on the stacked groups (docs/performance.md#finite-marker).
  marker = _xla_cpu.finite_marker((stacked, mean_grads))
  if axis_name is not None:
    # Generic blocks were reduced in the pass (psum of their gradients);
    # the others are means over examples: average them unless deferred.
    defer = stats_sync == "before_refresh"
    avg = [None if (blocks[g[0]].needs_param_grads or defer) else s
           for g, s in zip(groups, stacked)]
    split = [_split_rows(blocks[g[0]], a) for g, a in zip(groups, avg)]
    avg, rows = [a for a, _ in split], [r for _, r in split]
    avg, mean_grads = lax.pmean((avg, mean_grads), axis_name)
    avg = [_gather_rows(a, r, axis_name) for a, r in zip(avg, rows)]
    stacked = [s if a is None else a for s, a in zip(stacked, avg)]
  return Stats(stacked=dict(zip(map(grouping.group_name, groups), stacked)),
               params=mean_grads, finite_marker=marker,
               reduction=reduction(axis_name, stats_sync))


def _split_rows(block, stats):
  """``(rest, rows)``: ``stats`` without, and with only, the per-example
  rows the block names in ``row_stats`` (EK-FAC's); rows None if none."""
  names = getattr(block, "row_stats", ())
  if stats is None or not names:
    return stats, None
  return ({k: v for k, v in stats.items() if k not in names},
          {k: stats[k] for k in names})


def _gather_rows(stats, rows, axis_name):
  """``stats`` with the replicas' per-example rows put back, gathered along
  their batch axis (third from last: ``[..., B, R, d]``), not averaged."""
  if rows is None:
    return stats
  return {**stats, **{k: lax.all_gather(v, axis_name, axis=v.ndim - 3,
                                        tiled=True) for k, v in rows.items()}}


def check_reduction(stats, axis_name, stats_sync):
  """Raises unless ``stats`` is a :class:`Stats` reduced as an estimator
  with ``axis_name`` and ``stats_sync`` expects."""
  if not isinstance(stats, Stats):
    raise TypeError(
        "stats=... must be the Stats returned by value_grad_and_stats or "
        f"FisherEstimator.compute_stats; got {type(stats).__name__}.")
  want = reduction(axis_name, stats_sync)
  if stats.reduction != want:
    describe = lambda t: f"{t[0]!r}, {t[1]}" if t else "no axis"  # noqa: E731
    raise ValueError(
        f"stats=... were reduced for ({describe(stats.reduction)}) but this "
        f"estimator has axis_name={axis_name!r}, stats_sync={stats_sync!r} "
        f"({describe(want)}). Build value_grad_and_stats with the same "
        "axis_name and stats_sync, or pass it estimator=... .")
