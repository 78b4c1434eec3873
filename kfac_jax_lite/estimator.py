"""FisherEstimator: one curvature block per layer, and its verbs.

The estimator holds one curvature block per layer of a collection. Its
state groups same-shaped blocks (:mod:`kfac_jax_lite.grouping`); its
products are inherited from :class:`kfac_jax_lite.products.CurvatureProducts`;
the statistics come from one linearisation of the loss
(:mod:`kfac_jax_lite.linearization`), gathered into a
:class:`~kfac_jax_lite.stats.Stats` (:mod:`kfac_jax_lite.stats`), and the
cached inverses from a bucketed refresh (:mod:`kfac_jax_lite.refresh`). The
one-pass loss / gradient / statistics function,
:func:`kfac_jax_lite.one_pass.value_grad_and_stats`, is built on this
module.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from kfac_jax_lite import _blas_threads
from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import distributed
from kfac_jax_lite import products
from kfac_jax_lite import grouping
from kfac_jax_lite import linalg
from kfac_jax_lite import refresh
from kfac_jax_lite import linearization
from kfac_jax_lite import stats as stats_lib
from kfac_jax_lite import trees
from kfac_jax_lite.collection import LayerCollection
from kfac_jax_lite.grouping import EstimatorState
from kfac_jax_lite.grouping import ProductInputs  # noqa: F401  (re-export)
from kfac_jax_lite.linearization import canonical_mode
from kfac_jax_lite.linearization import Linearized
from kfac_jax_lite.linearization import MODES  # noqa: F401  (re-export)
from kfac_jax_lite.linearization import stats_rows  # noqa: F401  (re-export)
from kfac_jax_lite.stats import Stats


@dataclasses.dataclass(frozen=True)
class FisherEstimator(products.CurvatureProducts):
  """Block-diagonal curvature estimate for the layers of a collection.

  Math: :math:`\\hat F = \\mathrm{diag}(\\hat F_1, \\dots, \\hat F_L)` with one
  block per layer (Kronecker, diagonal, ...), each an exponential moving
  average (zero-debiased) of minibatch statistics.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    cov_ema_decay: EMA decay ``ρ ∈ [0, 1)`` of the factors.
    damping: default damping λ for :meth:`update_cache` (float or array).
    exps: matrix powers to cache (``-1`` the inverse, ``-0.5``, ...).
    estimation_mode: see :mod:`kfac_jax_lite.linearization` (kfac-jax names
      accepted).
    compute_cholesky: cache the Cholesky factors of the damped blocks (for
      :meth:`multiply_cholesky`).
    compute_cholesky_inverse: cache their inverses (for
      :meth:`multiply_cholesky_inverse`).
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
      Products at the cached ``exps`` average the few factor leaves they
      read directly (a diagonal block's diagonal, EK-FAC's rescaling), so
      every replica preconditions alike.
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
    stats_position_stride: ``k``: dense Kronecker factors (``kron``,
      ``kron_indep`` and their diagonal variants) average every ``k``-th of
      their ``N = B c`` rows (``c`` positions and uses of each of ``B``
      examples, in order; ``k`` at most ``c``, so examples are never
      dropped) from an offset ``o`` drawn uniformly from ``{0..k-1}`` at
      each statistics pass, divided by ``N/k``:

      .. math::
        \\hat A = \\frac{k}{N} \\sum_j \\bar a_{o+jk} \\bar a_{o+jk}^T,
        \\qquad \\mathbb{E}_o[\\hat A] = A

      (the same rows for ``G``; ``c = N/B`` still counts every row). The
      estimate is unbiased and its products cost ``k`` times fewer flops.
      Its variance: ``Â`` is one of the ``k`` offset-class means ``A_o``
      (``A`` their average), so :math:`\\mathrm{Var}[\\hat A_{ij}] =
      \\frac1k \\sum_o (A_{o,ij} - A_{ij})^2`: zero when neighbouring
      positions are alike, ``k`` times the all-row estimate's when rows
      are independent; the EMA over steps averages it further. The rank of
      one step's factor is at most ``⌈N/k⌉``. ``k = 1``, or no ``rng``,
      uses every row; None (default) chooses when lowering: 1 on CPU, 4 on
      other platforms, where the products of wide MLP factors dominate the
      statistics pass
      (:data:`kfac_jax_lite.blocks.kronecker.PLATFORM_STRIDES`). Other
      blocks (``kron_reduce``, conv, embeddings, diagonal, ...) use every
      row.
    block_factories: optional mapping from ``(kind, approx)`` or a
      parameter-path prefix to a factory ``(layer, config) -> block``
      that builds that layer's block instead of the built-in one
      (:func:`kfac_jax_lite.blocks.make_block`'s ``overrides``).

  Raises:
    TypeError: if ``collection`` is not a :class:`LayerCollection`.
    ValueError: for an unknown ``estimation_mode``, ``cov_ema_decay``
      outside ``[0, 1)``, a negative ``damping``, a ``stats_fraction``
      outside ``(0, 1]``, a ``stats_position_stride`` that is not None or
      a positive int, or inconsistent data-parallel options (each
      message names the argument and its value).

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
  stats_min_examples: int = linearization.STATS_MIN_EXAMPLES
  stats_position_stride: Optional[int] = None
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
    linearization.check_options(
        self.stats_fraction, self.stats_min_examples, self.num_samples,
        self.stats_position_stride)
    distributed.check_options(self.axis_name, self.stats_sync,
                              self.distributed_inverses)
    exps = tuple(self.exps) if isinstance(self.exps, (list, tuple)) else (
        self.exps,)
    object.__setattr__(self, "exps", exps)
    config = blocks_lib.BlockConfig(
        exps=exps, compute_cholesky=self.compute_cholesky,
        compute_cholesky_inverse=self.compute_cholesky_inverse,
        damping_type=self.damping_type,
        stats_position_stride=self.stats_position_stride)
    blocks_lib.check_overrides(self.collection.layers, self.block_factories)
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
    """The initial state: every block's, same-shaped blocks stacked.

    Args:
      params: the parameters (checked against the collection's structure).

    Returns:
      An :class:`EstimatorState` of zero factors and identity caches.

    Raises:
      ValueError: if ``params`` does not match the collection.
    """
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
    collection order, sliced out of the group stacks.

    Args:
      state: an :class:`EstimatorState` of this estimator, or a
        :class:`Stats` it computed.

    Returns:
      A tuple with one block state (or statistics) per layer.
    """
    return tuple(grouping.per_layer(self.groups, self._stacked(state),
                                    len(self.blocks)))

  def _stacked(self, x, name="state") -> list:
    """The per-group entries of a state or statistics, checked against
    this estimator's groups."""
    entries = grouping.entries(x, self._names, name)
    if isinstance(x, EstimatorState):
      grouping.check_state_shapes(
          x, self._state_shapes, self.groups,
          [l.name for l in self.collection.layers], name)
    return entries

  @functools.cached_property
  def _state_shapes(self) -> dict:
    return jax.eval_shape(lambda: {n: grouping.combine(
        [self.blocks[i].init() for i in g])
        for n, g in zip(self._names, self.groups)})

  # ---- statistics --------------------------------------------------------
  def linearize(self, params, batch, with_jvp: bool = False) -> Linearized:
    """One forward pass of the collection's loss function, linearised.

    ``with_jvp``: build it with its JVP (``jax.linearize``), for Fisher
    products through it (:meth:`Linearized.output_jvp`); without, it
    traces faster and its JVP, if asked for, costs one more transpose
    (:class:`Linearized`).

    Args:
      params: the parameters.
      batch: the batch ``loss_fn`` takes.
      with_jvp: build the JVP too (see above).

    Returns:
      A ``linearization.Linearized``: loss, gradient and the layers' inputs.
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

    Args:
      params: the parameters.
      batch: the whole batch ``lin`` was built from.
      lin: the whole batch's linearisation (:meth:`linearize`).
      with_jvp: as for :meth:`linearize`, for the second pass.

    Returns:
      ``lin`` or the head's ``linearization.Linearized``.
    """
    return linearization.linearize_head(
        self.collection, params, batch, lin, self.stats_fraction,
        self.stats_min_examples, with_jvp)

  def stats_from(self, lin: Linearized, rng) -> Stats:
    """Minibatch statistics from a linearisation (a backward pass each).

    With ``axis_name``, ``rng`` is folded with the replica's axis index
    (pass the same key on every replica).

    Args:
      lin: a linearisation (:meth:`linearize`).
      rng: a PRNG key for the sampled targets or Rademacher vectors.

    Returns:
      The :class:`Stats` of every block.
    """
    if self.axis_name is not None:
      rng = distributed.replica_key(rng, self.axis_name)
    p = linearization.statistics_pass(
        lin, self.blocks, rng, self.estimation_mode, self.num_samples,
        self.compute_params_stats, self.axis_name,
        1.0 if lin.head_only else self.stats_fraction,
        self.stats_min_examples)
    return stats_lib.make_stats(
        p, lin.params, self.blocks, self.groups,
        params_stats=self.compute_params_stats, axis_name=self.axis_name,
        stats_sync=self.stats_sync)

  def compute_stats(self, params, batch, rng) -> Stats:
    """Minibatch statistics of every block (one forward pass, no gradient).

    Args:
      params: the parameters.
      batch: the batch ``loss_fn`` takes.
      rng: a PRNG key for the sampled targets or Rademacher vectors.

    Returns:
      The :class:`Stats` of every block, for :meth:`update_curvature`.
    """
    # A named scope: profiles attribute the statistics pass to it
    # (docs/performance.md#where-the-gpt-step-goes).
    with jax.named_scope("kfac_pass"):
      return self.stats_from(self.linearize(params, batch), rng)

  def update_curvature(self, state: EstimatorState, params=None, batch=None,
                       rng=None, *, stats=None, ema_decay=None):
    """Folds one minibatch into the factors (zero-debiased EMA).

    Give either ``(params, batch, rng)`` or ``stats`` (from
    :func:`value_grad_and_stats` or :meth:`compute_stats`). Each block
    folds in only its own statistics, and only when they are finite.

    Args:
      state: the estimator state.
      params: the parameters (with ``batch``).
      batch: the batch ``loss_fn`` takes; statistics are computed from it.
      rng: a PRNG key for the sampled targets (None: a fixed key).
      stats: statistics from :func:`value_grad_and_stats` or
        :meth:`compute_stats`, instead of ``batch``.
      ema_decay: overrides ``cov_ema_decay`` for this update.

    Returns:
      The new :class:`EstimatorState`.

    Raises:
      ValueError: with neither or both of ``batch`` and ``stats``, or with
        statistics of another estimator or reduced over another axis.
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

    Returns:
      The state with the averaged factors.
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

    Returns:
      The state with refreshed caches.
    """
    damping = self.damping if damping is None else damping
    damping = jnp.asarray(damping, linalg.factor_dtype())
    if self.stats_sync == "before_refresh":
      state = self.sync_factors(state, layers)
    args = ([self.blocks[g[0]] for g in self.groups], self.groups,
            self._stacked(state), damping, layers)
    with jax.named_scope("kfac_refresh"):
      new = (refresh.update_cache(*args) if not self.distributed_inverses
             else refresh.distributed_update_cache(*args, self.axis_name))
    return self._replace(state, new)

  def _replace(self, state, per_group) -> EstimatorState:
    return state._replace(stacked=dict(zip(self._names, per_group)))

  def full_fisher(self, state):
    """Undamped dense block-diagonal ``[P, P]``, ``ravel_pytree`` order.

    For tests and small models: ``P`` is the number of parameters.

    Args:
      state: the estimator state.

    Returns:
      The ``[P, P]`` matrix in ``jax.flatten_util.ravel_pytree(params)``
      order.
    """
    return grouping.dense_block_diagonal(self.collection, self.blocks,
                                         self.per_layer(state))

  def params_stats(self, state):
    """The EMA of the mean per-source gradient (``compute_params_stats``).

    Args:
      state: the estimator state.

    Returns:
      A params-shaped tree.

    Raises:
      ValueError: unless built with ``compute_params_stats=True``.
    """
    if not self.compute_params_stats:
      raise ValueError(
          "params_stats needs FisherEstimator(compute_params_stats=True).")
    return state.params_stats
