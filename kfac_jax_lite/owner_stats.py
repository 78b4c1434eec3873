"""Each layer's factor statistics formed on its owner only.

Without a mesh the statistics pass reduces every layer's inputs ``a`` and
output gradients ``g`` to its factor statistics, e.g. for a dense layer

.. math::
  \\hat A_\\ell = \\frac{1}{m}\\sum_{n=1}^{m} a_n a_n^\\top ,\\qquad
  \\hat G_\\ell = \\frac{1}{m}\\sum_{n=1}^{m} g_n g_n^\\top ,

over the ``m`` rows of the (``stats_fraction``-cut) global batch. With the
curvature spread over a mesh (:mod:`kfac_jax_lite.sharded`) those
matrices are needed by the layer's owner only: :func:`stats_from` stops
the pass at the per-example rows (:class:`StatsInputs`), a
:class:`~kfac_jax_lite.routing.Route` moves each layer's rows (split over
the batch on the devices) to its owner, and the owner computes the layer's
statistics with the same code as without a mesh
(:func:`grouping.group_stats`) and folds them into its EMA. No device
forms the statistics of a layer it does not own, and the mean is over the
same global rows as without a mesh.

References:
  Martens & Grosse (2015), "Optimizing Neural Networks with
  Kronecker-factored Approximate Curvature", ICML (eqs. 1-2: the factors
  as expectations over the data).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec as P
import numpy as np

from kfac_jax_lite import grouping
from kfac_jax_lite import linearization
from kfac_jax_lite import routing


class StatsInputs(NamedTuple):
  """What a sharded estimator's statistics are computed from: per layer
  its :class:`~kfac_jax_lite.blocks.LayerData` (the global batch's inputs
  and output gradients, not yet reduced to factor statistics)."""
  layer_data: tuple


def stats_from(estimator, lin, rng) -> StatsInputs:
  """The :class:`StatsInputs` of a linearisation (one backward pass), as
  :meth:`FisherEstimator.stats_from` up to the reduction (``estimator``
  has no ``axis_name`` and no ``compute_params_stats``)."""
  est = estimator
  p = linearization.statistics_pass(
      lin, est.blocks, rng, est.estimation_mode, est.num_samples, False,
      None, 1.0 if lin.head_only else est.stats_fraction,
      est.stats_min_examples)
  return StatsInputs(tuple(p.layer_data))


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def unread_params_dropped(block, data):
  """``data`` without its parameter values where ``block``'s statistics do
  not read them (tried at trace time: ``compute_stats`` with ``None`` in
  their place), so they are not moved to the owner."""
  if not data.params:
    return data
  bare = data._replace(params=(None,) * len(data.params))
  try:
    jax.eval_shape(lambda: block.compute_stats(bare))
  except (TypeError, AttributeError, IndexError, ValueError):
    return data
  return bare


def own_stats(estimator, data: dict) -> dict:
  """``{layer: statistics}`` of one device's layers from their whole
  ``LayerData`` (``data``): the members of a group one ``vmap``, as
  without a mesh (:func:`grouping.group_stats`)."""
  est = estimator
  groups = [own for own in (tuple(i for i in g if i in data)
                            for g in est.groups) if own]
  layers = grouping.per_layer(
      groups, grouping.group_stats(est.blocks, groups, data),
      len(est.blocks))
  return {i: layers[i] for g in groups for i in g}


def ema_on_owners(estimator, plan, names, stats: StatsInputs, decay, ema):
  """``(branch, operands, specs, before)`` for the sharded estimator's
  update: ``before`` sends each layer's rows to its owner (every device),
  ``branch(r, layers, ops)`` forms device ``r``'s statistics and returns
  ``{layer: fn}``, ``fn(state)`` being ``ema(layer, state, statistics,
  decay)`` (:func:`kfac_jax_lite.row_writes.sequential`)."""
  data = [unread_params_dropped(b, x)
          for b, x in zip(estimator.blocks, stats.layer_data)]
  flat = [jax.tree.flatten(x) for x in data]
  arrays = [[x for x in leaves if _is_array(x)] for leaves, _ in flat]
  # Split on their last axis (features), not the batch: entering the map
  # split on the batch, the layer output gradients pin the backward
  # pass's cotangents to the batch layout, and XLA then partitions each
  # backward product with the all-gathered FSDP weight, holding every
  # gathered weight from the forward pass to the backward (as AdamW does
  # not). The owner concatenates the pieces: the same global arrays.
  route = routing.make_route(plan, arrays, from_last=True)

  def rebuild(i, full):
    it = iter(full)
    leaves, treedef = flat[i]
    return treedef.unflatten([next(it) if _is_array(x) else x
                              for x in leaves])

  def branch(r, layers, ops):
    received, local, d = ops
    full = route.at_owner(r, received, local)
    own = own_stats(estimator, {i: rebuild(i, full[i]) for i in layers})
    return {i: functools.partial(ema, i, x=own[i], d=d) for i in layers}

  def before(ops):
    return route.to_owners(ops[0], names), ops[0], ops[1]

  return branch, (arrays, decay), (route.specs(names), P()), before
