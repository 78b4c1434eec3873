"""FisherEstimator and the one-pass loss / gradient / statistics function.

The estimator holds one curvature block per layer of a collection. Its
state groups same-shaped blocks (:mod:`kfac_jax_lite.grouping`); the
statistics come from one linearisation of the loss
(:mod:`kfac_jax_lite.statistics`) and the cached inverses from a bucketed
refresh (:mod:`kfac_jax_lite.refresh`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from kfac_jax_lite import _blas_threads
from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import distributed
from kfac_jax_lite import grouping
from kfac_jax_lite import linalg
from kfac_jax_lite import refresh
from kfac_jax_lite import statistics
from kfac_jax_lite import stats as stats_lib
from kfac_jax_lite import trees
from kfac_jax_lite.collection import LayerCollection
from kfac_jax_lite.grouping import EstimatorState
from kfac_jax_lite.grouping import ProductInputs
from kfac_jax_lite.statistics import canonical_mode
from kfac_jax_lite.statistics import Linearized
from kfac_jax_lite.statistics import MODES  # noqa: F401  (re-export)
from kfac_jax_lite.statistics import stats_rows  # noqa: F401  (re-export)
from kfac_jax_lite.stats import Stats



@dataclasses.dataclass(frozen=True)
class FisherEstimator:
  """Block-diagonal curvature estimate for the layers of a collection.

  Math: :math:`\\hat F = \\mathrm{diag}(\\hat F_1, \\dots, \\hat F_L)` with one
  block per layer (Kronecker, diagonal, ...), each an exponential moving
  average (zero-debiased) of minibatch statistics.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    cov_ema_decay: EMA decay ``ρ ∈ [0, 1)`` of the factors.
    damping: default damping λ for :meth:`update_cache` (float or array).
    exps: matrix powers to cache (``-1`` the inverse, ``-0.5``, ...).
    estimation_mode: see :mod:`kfac_jax_lite.statistics` (kfac-jax names
      accepted).
    compute_cholesky, compute_cholesky_inverse: cache Cholesky factors.
    compute_params_stats: also keep the EMA of the mean per-source gradient
      (in ``empirical`` mode: the mean gradient).
    num_samples: target draws per example (``gradients``,
      ``curvature_prop``).
    damping_type: ``"pi"`` or ``"exact"``.
    axis_name: the ``pmap``/``shard_map`` axis of data parallelism (a name,
      or a tuple of mesh axis names). The statistics then describe the
      global batch (see :mod:`kfac_jax_lite.distributed`): each replica's
      sampling key is folded with its axis index, generic blocks' gradients
      are summed over the axis, and the factors are averaged as
      ``stats_sync`` says. None: no collectives (also right under plain
      ``jax.jit`` over batch-sharded inputs).
    stats_sync: ``"every_update"`` (default) averages the statistics at
      every update, so every replica always holds the global factors and
      the state is identical on all replicas; ``"before_refresh"`` keeps
      per-replica EMAs and averages the factors only in
      :meth:`update_cache`, writing the average back: exact for the cached
      inverses (the EMA is linear), one all-reduce per refresh instead of
      per update, but between refreshes the replicas' factors (and so
      ``multiply``, ``full_fisher``) are local, and the state must be kept
      per replica (``pmap``, or ``shard_map`` with a sharded state).
    distributed_inverses: split :meth:`update_cache` across the devices of
      ``axis_name``: each computes the inverses of its share of the blocks
      and one ``psum`` shares them (:func:`distributed.update_cache`).
    stats_fraction: ``f ∈ (0, 1]``. Factors built from rows of per-example
      quantities (Kronecker ``A = E[a aᵀ]``, ``G = E[g gᵀ]``, conv, scale
      and shift, embeddings) average over the first ``m = ⌈f·B⌉`` examples
      of each batch (of each replica's batch under ``axis_name``) instead
      of all ``B``: the outer products cost ``f`` times as much, and the
      EMA over steps makes up for the noisier minibatch estimate (TF
      K-FAC's ``sub_sample_outer_products`` / ``sub_sample_inputs`` make
      the same trade). ``m`` is at least ``stats_min_examples`` (or the
      whole batch, if smaller), so small batches keep every example. Take
      shuffled batches: the subset is the first ``m``, not a random draw.
      Under ``jax.jit`` with the batch sharded over devices (no
      ``axis_name``) the first ``m`` examples are on the first devices
      only: correct, but unevenly spread; with ``axis_name``
      (``shard_map``/``pmap``) every replica takes its own first ``m``.
      Blocks built from summed parameter gradients (``full``, ``diagonal``
      over generic layers) always use the whole batch; so do the gradient
      and the loss.
    stats_min_examples: the floor on ``m`` above (default 64).
    block_factories: optional mapping from ``(kind, approx)`` or a
      parameter-path prefix to a factory ``(layer, config) -> block``
      that builds that layer's block instead of the built-in one
      (:func:`kfac_jax_lite.blocks.make_block`'s ``overrides``).

  Example:
    >>> est = FisherEstimator(collection, damping=1e-3)
    >>> state = est.init(params)
    >>> state = est.update_curvature(state, params, batch, rng)
    >>> state = est.update_cache(state)
    >>> direction = est.multiply_inverse(state, grads)
  """
  collection: LayerCollection
  cov_ema_decay: Any = 0.95
  damping: Any = 1e-3
  exps: tuple = (-1,)
  estimation_mode: str = "gradients"
  compute_cholesky: bool = False
  compute_cholesky_inverse: bool = False
  compute_params_stats: bool = False
  num_samples: int = 1
  damping_type: str = "pi"
  axis_name: Any = None
  stats_sync: str = "every_update"
  distributed_inverses: bool = False
  stats_fraction: float = 1.0
  stats_min_examples: int = 64
  block_factories: Optional[Mapping] = dataclasses.field(
      default=None, hash=False)

  def __post_init__(self):
    if not isinstance(self.collection, LayerCollection):
      raise TypeError(
          "FisherEstimator(collection=...) needs the LayerCollection returned "
          f"by kfac_jax_lite.scan(...); got {type(self.collection).__name__}.")
    object.__setattr__(self, "estimation_mode",
                       canonical_mode(self.estimation_mode))
    if isinstance(self.cov_ema_decay, (int, float)) and not (
        0.0 <= self.cov_ema_decay < 1.0):
      raise ValueError(
          f"cov_ema_decay={self.cov_ema_decay!r} must be in [0, 1).")
    if isinstance(self.damping, (int, float)) and self.damping < 0:
      raise ValueError(f"damping={self.damping!r} must be >= 0.")
    statistics.check_options(self.stats_fraction, self.stats_min_examples,
                             self.num_samples)
    distributed.check_options(self.axis_name, self.stats_sync,
                              self.distributed_inverses)
    exps = tuple(self.exps) if isinstance(self.exps, (list, tuple)) else (
        self.exps,)
    object.__setattr__(self, "exps", exps)
    config = blocks_lib.BlockConfig(
        exps=exps, compute_cholesky=self.compute_cholesky,
        compute_cholesky_inverse=self.compute_cholesky_inverse,
        damping_type=self.damping_type)
    object.__setattr__(self, "_blocks", tuple(
        blocks_lib.make_block(l, config, overrides=self.block_factories)
        for l in self.collection.layers))

  @property
  def blocks(self) -> tuple:
    """One block per layer, in collection order."""
    return self._blocks  # pylint: disable=no-member

  @functools.cached_property
  def groups(self) -> tuple:
    """The layer indices of each group of same-shaped blocks, in the
    order of the state's ``stacked`` (:mod:`kfac_jax_lite.grouping`)."""
    shapes = [jax.eval_shape(b.init) for b in self.blocks]
    return grouping.find_groups(self.blocks, shapes)

  @functools.cached_property
  def _names(self) -> tuple:
    return tuple(map(grouping.group_name, self.groups))

  # ---- state -------------------------------------------------------------
  def init(self, params) -> EstimatorState:
    """The initial state: every block's, same-shaped blocks stacked."""
    self.collection.check_params(params)
    ps, pw = (), ()
    if self.compute_params_stats:
      ps = jax.tree.map(lambda x: jnp.zeros(x.shape, linalg.factor_dtype()),
                        params)
      pw = jnp.zeros((), linalg.factor_dtype())
    stacked = [grouping.combine([self.blocks[i].init() for i in g])
               for g in self.groups]
    return EstimatorState(dict(zip(self._names, stacked)), ps, pw)

  def per_layer(self, state) -> tuple:
    """A read-only per-layer view: one block state per layer of ``state``
    (or one block's statistics per layer of a :class:`Stats`), in
    collection order, sliced out of the group stacks."""
    return tuple(grouping.per_layer(self.groups, self._stacked(state),
                                    len(self.blocks)))

  def _stacked(self, x, name="state") -> list:
    """The per-group entries of a state or statistics, checked against
    this estimator's groups."""
    # Sets: jax flattens a dict in sorted key order, so a state that went
    # through jit comes back with its groups sorted by name.
    if set(getattr(x, "stacked", None) or ()) != set(self._names):
      got = (list(x.stacked) if isinstance(getattr(x, "stacked", None), dict)
             else type(x).__name__)
      raise ValueError(
          f"{name}=... does not match this estimator: its groups are {got}, "
          f"the estimator's {list(self._names)}. Pass the {name} made by "
          "this estimator (init / compute_stats / value_grad_and_stats "
          "with estimator=...).")
    return [x.stacked[n] for n in self._names]

  # ---- statistics --------------------------------------------------------
  def linearize(self, params, batch, with_jvp: bool = False) -> Linearized:
    """One forward pass of the collection's loss function, linearised.

    ``with_jvp``: build it with its JVP (``jax.linearize``), for Fisher
    products through it (:meth:`Linearized.output_jvp`); without, it
    traces faster and its JVP, if asked for, costs one more transpose
    (:class:`Linearized`).
    """
    return Linearized(self.collection, params, batch, with_jvp=with_jvp)

  def linearize_head(self, params, batch, lin: Linearized,
                     with_jvp: bool = True) -> Linearized:
    """The linearisation the curvature of ``batch`` is estimated from.

    ``lin`` itself when ``stats_fraction`` is 1; otherwise a second, smaller
    forward pass over the first ``m = ⌈f·B⌉`` examples (``B`` the rows of
    ``lin``'s loss tags): every batch leaf whose leading axis has ``B``
    entries is cut to its first ``m``. Its statistics use all its rows, and
    JVPs through it (the optimizer's Fisher products) cost ``f`` times
    those through ``lin``. ``with_jvp``: as :meth:`linearize`, for that
    second pass.

    When the cut batch does not give loss tags of ``m`` rows (examples not
    on the leading axis, e.g. a time-major ``[T, B, ...]`` sequence batch)
    it warns at trace time and returns ``lin``: the factors still use the
    first ``m`` rows, the Fisher products the whole batch.
    """
    return statistics.linearize_head(
        self.collection, params, batch, lin, self.stats_fraction,
        self.stats_min_examples, with_jvp)

  def stats_from(self, lin: Linearized, rng) -> Stats:
    """Minibatch statistics from a linearisation (a backward pass each).

    With ``axis_name``, ``rng`` is folded with the replica's axis index
    (pass the same key on every replica).
    """
    if self.axis_name is not None:
      rng = distributed.replica_key(rng, self.axis_name)
    p = statistics.statistics_pass(
        lin, self.blocks, rng, self.estimation_mode, self.num_samples,
        self.compute_params_stats, self.axis_name,
        1.0 if lin.head_only else self.stats_fraction,
        self.stats_min_examples)
    return stats_lib.make_stats(
        p, lin.params, self.blocks, self.groups,
        params_stats=self.compute_params_stats, axis_name=self.axis_name,
        stats_sync=self.stats_sync)

  def compute_stats(self, params, batch, rng) -> Stats:
    """Minibatch statistics of every block (one forward pass, no gradient)."""
    return self.stats_from(self.linearize(params, batch), rng)

  def update_curvature(self, state: EstimatorState, params=None, batch=None,
                       rng=None, *, stats=None, ema_decay=None):
    """Folds one minibatch into the factors (zero-debiased EMA).

    Give either ``(params, batch, rng)`` or ``stats`` (from
    :func:`value_grad_and_stats` or :meth:`compute_stats`). Each block
    folds in only its own statistics, and only when they are finite.
    """
    if (batch is None) == (stats is None):
      raise ValueError(
          "update_curvature needs exactly one of batch=... (statistics are "
          "computed from it) or stats=... (from value_grad_and_stats); got "
          f"{'both' if batch is not None else 'neither'}.")
    if stats is None:
      if rng is None:
        rng = jax.random.PRNGKey(0)
      stats = self.compute_stats(params, batch, rng)
    stats_lib.check_reduction(stats, self.axis_name, self.stats_sync)
    per_group = self._stacked(stats, "stats")
    decay = self.cov_ema_decay if ema_decay is None else ema_decay
    ema = lambda b, s, x: b.update_curvature(s, x, decay)  # noqa: E731
    with jax.named_scope("kfac_ema"):
      new = [grouping.map_group(ema, self.blocks[g[0]], len(g), s, x)
             for g, s, x in zip(self.groups, self._stacked(state),
                                 per_group)]
    ps, pw = state.params_stats, state.params_weight
    if self.compute_params_stats:
      finite = trees.all_finite(stats.params)
      new_ps, new_pw = trees.ema(ps, stats.params, pw, decay)
      ps = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_ps, ps)
      pw = jnp.where(finite, new_pw, pw)
    return self._replace(state, new)._replace(params_stats=ps,
                                              params_weight=pw)

  # ---- refresh -----------------------------------------------------------
  def sync_factors(self, state: EstimatorState, layers=None):
    """Averages the factors over ``axis_name`` (no-op without an axis).

    .. math:: \\bar F \\leftarrow \\frac{1}{R} \\sum_{r=1}^{R} \\bar F^{(r)}

    The average of the replicas' EMAs is the EMA of the averaged
    statistics (the EMA is linear and its weight is the same everywhere),
    so after this every replica holds the factors of the global batch.
    :meth:`update_cache` calls it with ``stats_sync="before_refresh"``.

    Args:
      state: the estimator state.
      layers: optional indices of the layers to average (default: all).
    """
    if self.axis_name is None:
      return state
    parts = grouping.select(self.groups, self._stacked(state), layers)
    new = distributed.average_factors(
        [self.blocks[self.groups[p.group][0]] for p in parts],
        [p.state for p in parts], self.axis_name)
    return self._replace(state, grouping.put(self._stacked(state), parts, new))

  @_blas_threads.limited  # One LAPACK thread: docs/performance.md.
  def update_cache(self, state: EstimatorState, damping=None, layers=None):
    """Refreshes inverses / powers / Cholesky factors at ``damping``.

    With ``stats_sync="before_refresh"`` the refreshed layers' factors are
    first averaged over ``axis_name`` (:meth:`sync_factors`); with
    ``distributed_inverses`` each device of the axis computes a share of
    the blocks (:func:`kfac_jax_lite.distributed.update_cache`).

    Args:
      state: the estimator state.
      damping: λ (float or scalar array); None uses the constructor's.
      layers: optional indices of the layers to refresh (others keep their
        cache); used to stagger refreshes over several steps.
    """
    damping = self.damping if damping is None else damping
    damping = jnp.asarray(damping, linalg.factor_dtype())
    if self.stats_sync == "before_refresh":
      state = self.sync_factors(state, layers)
    args = ([self.blocks[g[0]] for g in self.groups], self.groups,
            self._stacked(state), damping, layers)
    new = (refresh.update_cache(*args) if not self.distributed_inverses
           else refresh.distributed_update_cache(*args, self.axis_name))
    return self._replace(state, new)

  def _replace(self, state, per_group) -> EstimatorState:
    return state._replace(stacked=dict(zip(self._names, per_group)))

  # ---- products ----------------------------------------------------------
  def _per_group(self, state, fn, xs) -> list:
    """``fn(block, group_state, x)`` per group: one ``vmap`` over the
    group's stack and its ``xs`` (:func:`grouping.combine` of its layers'
    values); results stacked like the state."""
    return [grouping.map_group(fn, self.blocks[g[0]], len(g), st, x)
            for g, st, x in zip(self.groups, self._stacked(state), xs)]

  def _combine(self, parts) -> list:
    return [grouping.combine([parts[i] for i in g]) for g in self.groups]

  def _apply(self, state, v, fn: Callable, finish=None, inputs=None):
    """The params-shaped product: ``fn(block, state, x)`` per group, then
    the results split per layer (at runtime indices,
    :func:`grouping.unstack`) and ``finish(block, r, x)`` (optional)
    turning a layer's result ``r`` into its parameter tuple. The split and
    the finish sit together under ``kfac_merge``, where their slices fuse
    with the consumers of the product. ``inputs`` (:meth:`product_inputs`
    of ``v``) replaces ``v``'s own per-layer tuples as what ``fn``
    multiplies."""
    if inputs is None:
      leaves, parts = grouping.split_params(self.collection, v)
      xs = self._combine(parts)
    else:
      leaves, parts, xs = inputs.leaves, inputs.parts, inputs.per_group
    out = self._per_group(state, fn, xs)
    finish = finish or (lambda b, r, x: r)
    with jax.named_scope("kfac_merge"):
      out = grouping.per_layer(self.groups, out, len(self.blocks),
                               runtime_index=True)
      return grouping.merge_params(self.collection, v, leaves, [
          finish(b, r, x) for b, r, x in zip(self.blocks, out, parts)])

  def product_inputs(self, state, v, name: str = "v") -> ProductInputs:
    """``v`` (params-shaped) as :meth:`multiply_matpower` multiplies it:
    per group of ``state``, the blocks'
    :meth:`~blocks.base.Block.product_input` (``[W; b]`` for dense
    layers), stacked like the group's state.

    Pass it to :meth:`multiply_matpower` as ``inputs=``. A caller that
    also checks ``v`` (the transforms' finiteness check) checks
    :meth:`ProductInputs.checked` instead: ``v``'s leaves are then read
    once, by the kernels that build the matrices
    (docs/performance.md#product-inputs). ``name`` names ``v`` in the
    error raised when it does not match the parameters.
    """
    leaves, parts = grouping.split_params(self.collection, v, name)
    per_group = self._per_group(state, lambda b, s, x: b.product_input(x),
                                self._combine(parts))
    used = {i for l in self.collection.layers for i in l.param_indices}
    rest = [x for i, x in enumerate(leaves) if i not in used]
    return ProductInputs(leaves, parts, per_group, rest)

  def multiply_matpower(self, state, v, exp, inputs=None):
    """``F̂^exp v`` (damped) for a params-shaped ``v``.

    Each block computes :meth:`~blocks.base.Block.multiply_matpower_raw`
    (``[W; b]`` as one matrix for dense layers, stacked per group of
    same-shaped layers); it is cut per layer and per parameter afterwards
    (:meth:`~blocks.base.Block.finish_product`), where the slices fuse
    with what consumes the product instead of being kernels of their own.
    ``inputs``: :meth:`product_inputs` of ``v``, when the caller made it.
    """
    for b in self.blocks:
      blocks_lib.base.check_exp(b, exp)
    return self._apply(
        state, v, lambda b, s, x: b.multiply_matpower_raw(s, x, exp),
        finish=lambda b, r, x: b.finish_product(r, x), inputs=inputs)

  def multiply(self, state, v):
    return self.multiply_matpower(state, v, 1)

  def multiply_inverse(self, state, v):
    return self.multiply_matpower(state, v, -1)

  def multiply_cholesky(self, state, v, transpose=False):
    return self._apply(state, v, lambda b, s, x: b.multiply_cholesky(
        s, x, transpose))

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    return self._apply(state, v, lambda b, s, x: b.multiply_cholesky_inverse(
        s, x, transpose))

  def full_fisher(self, state):
    """Undamped dense block-diagonal ``[P, P]``, ``ravel_pytree`` order."""
    return grouping.dense_block_diagonal(self.collection, self.blocks,
                                         self.per_layer(state))

  def params_stats(self, state):
    if not self.compute_params_stats:
      raise ValueError(
          "params_stats needs FisherEstimator(compute_params_stats=True).")
    return state.params_stats


# ---------------------------------------------------------------------------
# One pass for loss, gradient and statistics.
# ---------------------------------------------------------------------------


def value_grad_and_stats(loss_fn: Callable, collection: LayerCollection, *,
                         estimation_mode: str = "gradients",
                         has_aux: bool = False, num_samples: int = 1,
                         axis_name: Any = None,
                         stats_sync: str = "every_update",
                         stats_fraction: float = 1.0,
                         stats_min_examples: int = 64,
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
    axis_name, stats_sync, stats_fraction, stats_min_examples: as
      :class:`FisherEstimator`.
    estimator: use this estimator's blocks and options instead.
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
