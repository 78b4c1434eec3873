"""Sharded curvature: each layer's block lives, refreshes and multiplies on
one device of a mesh axis.

:class:`ShardedEstimator` wraps a :class:`~kfac_jax_lite.FisherEstimator`
with a :class:`~kfac_jax_lite.placement.Plan`. Its state,
:class:`ShardedState`, holds one ``[R, L]`` array per dtype whose row ``r``
packs the blocks device ``r`` owns (:class:`~kfac_jax_lite.placement.Layout`),
sharded ``NamedSharding(mesh, P(curvature_axis))``: each device stores
only its own blocks. Every verb runs under ``jax.shard_map`` over the mesh;
inside, each device runs the code of its own blocks only (a conditional on
its position along the axis):

* each layer's statistics inputs (the global batch's rows of its inputs
  and output gradients, split over the batch on the devices) go to its
  owner by one ``all_to_all`` (:mod:`kfac_jax_lite.routing`), which
  alone forms the layer's factor statistics and folds them into its EMA
  (:mod:`kfac_jax_lite.owner_stats`);
* the damped powers of each block are refreshed on its owner (no factor or
  inverse is gathered anywhere);
* each layer's part of the gradient ``g`` (split on its leading axis) goes
  to its owner the same way, which computes

  .. math::
    u_\\ell = (\\hat F_\\ell + \\lambda)^{p} g_\\ell ,

  and ``u_ℓ`` goes back split the same way, then is all-gathered: ``u``
  leaves whole on every device, as without a mesh. Given the parameters'
  layout (``param_shardings``, e.g. FSDP), ``u`` instead leaves split
  and is laid out as the parameters are, never whole on one device. Only
  statistics inputs, gradients and updates move.

The EMA and the refresh write the leaves they change into the device's
row in place (:mod:`kfac_jax_lite.row_writes`): the EMA layer by layer
(each device's largest block last, its factor matrices one at a time:
no copy of its old factors), the refresh through two windows of the
caches (each device's largest block's, then the others'). The verbs make
no copy of the row, also under the ``lax.cond`` of the refresh schedule
(the compiled step holds one row per device).

Each block runs the same code as without a mesh, so the sharded step is
the replicated one up to the rounding of the batched refresh (a device
refreshes its own blocks together, in buckets of its own).

References:
  Shi et al. (2023), arXiv:2309.06497 (Distributed Shampoo: preconditioners
  partitioned ZeRO-1 style, only the search directions all-gathered);
  Martens & Grosse (2015), "Optimizing Neural Networks with
  Kronecker-factored Approximate Curvature", ICML.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kfac_jax_lite import _blas_threads
from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import grouping
from kfac_jax_lite import linalg
from kfac_jax_lite import placement
from kfac_jax_lite import refresh
from kfac_jax_lite import owner_stats
from kfac_jax_lite import routing
from kfac_jax_lite import row_writes
from kfac_jax_lite import stats as stats_lib
from kfac_jax_lite.grouping import EstimatorState
from kfac_jax_lite.grouping import ProductInputs


class ShardedState(NamedTuple):
  """The curvature state of a :class:`ShardedEstimator`.

  Attributes:
    rows: dtype name -> ``[R, L]``; row ``r`` packs the block states of the
      layers device ``r`` of the curvature axis owns, sharded over it.

  Example:
    >>> state = kl.kfac(1e-2, c, mesh=mesh, curvature_axis="data").init(p)
    >>> state.inner[0].estimator.rows["float32"].sharding
  """
  rows: dict  # dtype -> [R, L] sharded over the curvature axis


def place(estimator, mesh, curvature_axis, param_shardings=None) -> Any:
  """``estimator``, or a :class:`ShardedEstimator` of it over ``mesh``.

  Raises:
    ValueError, TypeError: as :func:`kfac_jax_lite.placement.check_mesh`
      and :func:`~kfac_jax_lite.placement.check_param_shardings`;
      ``ValueError`` for an estimator with ``compute_params_stats``.
  """
  names = placement.check_mesh(mesh, curvature_axis, estimator.axis_name)
  placement.check_param_shardings(param_shardings, names)
  if not names:
    return estimator
  if estimator.compute_params_stats:
    raise ValueError(
        "mesh= with an estimator with compute_params_stats=True: the "
        "parameter statistics are not placed; build the FisherEstimator "
        "without compute_params_stats, or drop mesh=.")
  return ShardedEstimator(estimator, mesh, names, param_shardings)


def gather(estimator, layout, state: ShardedState) -> EstimatorState:
  """``estimator``'s own state from a sharded ``state`` packed by
  ``layout`` (every block gathered where this runs)."""
  per = {}
  for r in range(layout.plan.num_devices):
    per.update(layout.unpack(r, {dt: x[r] for dt, x in state.rows.items()}))
  stacked = [grouping.combine([per[i] for i in g]) for g in estimator.groups]
  names = [grouping.group_name(g) for g in estimator.groups]
  return EstimatorState(dict(zip(names, stacked)), (), ())


def curvature_plan(estimator, mesh, curvature_axis) -> placement.Plan:
  """The placement ``mesh=``/``curvature_axis=`` give ``estimator``'s
  blocks: which device owns each layer (print it to see the split).

  Args:
    estimator: a :class:`~kfac_jax_lite.FisherEstimator`
      (``kl.FisherEstimator(collection)`` has the blocks of ``kfac``,
      ``kfac_adamw`` and ``kfac_optimizer``).
    mesh: a ``jax.sharding.Mesh``.
    curvature_axis: its axis name(s) the curvature is spread over.

  Returns:
    A ``kfac_jax_lite.placement.Plan``: ``owners`` (a layer's device),
    ``layers_of(r)``, ``loads()`` (bytes per device), ``imbalance()``
    (the largest load over the mean) and ``describe()`` (also its
    ``print``).

  Raises:
    ValueError, TypeError: as for ``mesh=`` and ``curvature_axis=`` of
      :func:`~kfac_jax_lite.scale_by_kfac`.

  Example:
    >>> print(kl.curvature_plan(kl.FisherEstimator(c), mesh, "data"))
  """
  if curvature_axis is None:
    placement.check_mesh(mesh, curvature_axis)
  return place(estimator, mesh, curvature_axis).plan


def relayout_curvature(opt_state, estimator, mesh, curvature_axis):
  """``opt_state`` with every :class:`ShardedState` in it moved onto
  ``curvature_axis`` of ``mesh`` (e.g. a checkpoint of 8 devices resumed
  on 4): each is gathered with the plan of its own number of rows and
  packed with the new mesh's plan. The blocks' values move bit for bit.

  Args:
    opt_state: an optax state holding sharded curvature states (restored
      from a checkpoint, with its rows on any devices).
    estimator: a :class:`~kfac_jax_lite.FisherEstimator` whose blocks
      match the transform's (``kl.FisherEstimator(collection)`` for
      ``kfac``, ``kfac_adamw`` and ``kfac_optimizer``).
    mesh: the new ``jax.sharding.Mesh``.
    curvature_axis: its axis name(s) for the curvature.

  Returns:
    ``opt_state`` on the new layout; other leaves are unchanged.

  Raises:
    ValueError, TypeError: as for ``mesh=`` and ``curvature_axis=`` of
      :func:`~kfac_jax_lite.scale_by_kfac`.

  Example:
    >>> opt = kl.relayout_curvature(restored, kl.FisherEstimator(c),
    ...                             mesh4, "data")
  """
  new = place(estimator, mesh, curvature_axis)

  def move(s):
    if not isinstance(s, ShardedState):
      return s
    rows = next(iter(s.rows.values())).shape[0]
    old = placement.make_layout(
        placement.make_plan(estimator, rows, new.axis), estimator)
    return new.from_logical(gather(estimator, old, s))

  return jax.tree.map(move, opt_state,
                      is_leaf=lambda x: isinstance(x, ShardedState))


@dataclasses.dataclass(frozen=True)
class ShardedEstimator:
  """A :class:`~kfac_jax_lite.FisherEstimator` whose blocks are spread
  over ``axis`` of ``mesh`` by a :class:`~kfac_jax_lite.placement.Plan`.

  It has the verbs the transforms use (``init``, ``update_curvature``,
  ``update_cache``, ``product_inputs``, ``multiply_matpower``,
  ``multiply_inverse``, ``multiply``) on a :class:`ShardedState`; the
  other attributes (``collection``, ``blocks``, ``stats_from``,
  ``linearize``, ...) are the wrapped estimator's. :meth:`logical` and
  :meth:`from_logical` convert to and from the estimator's own state (for
  inspection, and to move a checkpoint onto another mesh).

  Args:
    estimator: the wrapped estimator (no ``axis_name``).
    mesh: the ``jax.sharding.Mesh``.
    axis: the names of the mesh axes the curvature is spread over.
    param_shardings: None (products whole on every device), or the
      parameters' shardings (a params-like pytree): products leave split
      and are laid out as the parameters.
  """
  estimator: Any
  mesh: Any
  axis: tuple[Any, ...]
  param_shardings: Any = None

  def __getattr__(self, name):
    if name.startswith("__") or name == "estimator":
      raise AttributeError(name)
    return getattr(self.estimator, name)

  @functools.cached_property
  def num_devices(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.axis)

  @functools.cached_property
  def plan(self) -> placement.Plan:
    """The :class:`~kfac_jax_lite.placement.Plan` of the blocks."""
    return placement.make_plan(self.estimator, self.num_devices, self.axis)

  @functools.cached_property
  def layout(self) -> placement.Layout:
    return placement.make_layout(self.plan, self.estimator)

  def describe(self) -> str:
    """The plan: each device's layers, bytes and refresh cost."""
    return self.plan.describe()

  @property
  def _spec(self):
    names = list(self.axis)
    return P(tuple(names) if len(names) > 1 else names[0])

  @property
  def sharding(self) -> NamedSharding:
    """The sharding of every row array of the state."""
    return NamedSharding(self.mesh, self._spec)

  # ---- layout ------------------------------------------------------------
  def from_logical(self, state: EstimatorState) -> ShardedState:
    """The sharded state holding ``state``'s blocks (the estimator's own
    state, e.g. from :meth:`logical` of another mesh's estimator)."""
    per = dict(enumerate(self.estimator.per_layer(state)))
    packed = [self.layout.pack(r, per) for r in range(self.num_devices)]
    rows = {dt: jnp.stack([p[dt] for p in packed]) for dt in packed[0]}
    return ShardedState(jax.lax.with_sharding_constraint(rows,
                                                         self.sharding))

  def logical(self, state: ShardedState) -> EstimatorState:
    """The wrapped estimator's state (every block gathered): for tests,
    inspection and moving a state onto another mesh, not for steps."""
    return gather(self.estimator, self.layout, state)

  def _check(self, state, name="state"):
    if not isinstance(state, ShardedState) or set(state.rows) != set(
        self.layout.widths):
      raise ValueError(
          f"{name}=... is a {type(state).__name__}, not the state of this "
          "sharded estimator; pass the state its init made (with the same "
          "mesh= and curvature_axis=).")

  # ---- running each device's own blocks ----------------------------------
  def _update(self, branch, rows, operands, specs=None, before=None,
              write=row_writes.windowed):
    """New rows: ``write(layout, axis, branch, rows, operands)`` on each
    device (:mod:`~kfac_jax_lite.row_writes`: ``branch`` runs device
    ``r``'s own blocks) under ``shard_map`` (``operands`` entering with
    ``specs``; ``before`` maps them on every device first, e.g. an
    exchange). No copy of a row is made."""
    def body(rows, operands):  # rows: {dtype: [1, L]}, this device's.
      if before is not None:
        operands = before(operands)
      return write(self.layout, self.axis, branch, rows, operands)

    fn = jax.shard_map(body, mesh=self.mesh, in_specs=(
        self._spec, P() if specs is None else specs), out_specs=self._spec,
        check_vma=False)
    return fn(rows, operands)

  # ---- verbs -------------------------------------------------------------
  def init(self, params) -> ShardedState:
    """The initial state (zero factors, identity caches), each block on
    its owner.

    Raises:
      ValueError: if ``params`` does not match the collection or
        ``param_shardings``, or lies on devices outside the mesh.
    """
    placement.check_devices(self.mesh, params)
    self.estimator.collection.check_params(params)
    if self.param_shardings is not None:
      placement.param_layout(self.mesh, self.param_shardings, params)
    est, layout = self.estimator, self.layout

    def body():
      def one(r):
        rows = layout.pack(r, {i: est.blocks[i].init()
                               for i in self.plan.layers_of(r)})
        return {dt: x[None] for dt, x in rows.items()}

      if self.num_devices == 1:
        return one(0)
      return lax.switch(lax.axis_index(self.axis),
                        [functools.partial(one, r)
                         for r in range(self.num_devices)])

    # Each device builds its own row: the whole curvature is never
    # materialised on one device.
    return ShardedState(jax.shard_map(
        body, mesh=self.mesh, in_specs=(), out_specs=self._spec,
        check_vma=False)())

  def stats_from(self, lin, rng) -> owner_stats.StatsInputs:
    """The statistics' inputs of a linearisation, for
    :meth:`update_curvature` (:func:`owner_stats.stats_from`)."""
    return owner_stats.stats_from(self.estimator, lin, rng)

  def compute_stats(self, params, batch, rng) -> owner_stats.StatsInputs:
    """:meth:`stats_from` of ``batch``'s linearisation."""
    with jax.named_scope("kfac_pass"):
      return self.stats_from(self.estimator.linearize(params, batch), rng)

  def update_curvature(self, state, params=None, batch=None, rng=None, *,
                       stats=None, ema_decay=None) -> ShardedState:
    """Folds one minibatch into each block's EMA, on its owner (as
    :meth:`FisherEstimator.update_curvature`).

    From ``batch`` (or the :class:`StatsInputs` of :meth:`stats_from`)
    each layer's statistics inputs go to its owner
    (:class:`~kfac_jax_lite.routing.Route`), which alone computes the
    layer's factor statistics; ``stats=`` from
    :func:`~kfac_jax_lite.value_grad_and_stats` are whole on every device
    already, and each owner folds in its layers' part.
    """
    est = self.estimator
    self._check(state)
    if (batch is None) == (stats is None):
      raise ValueError(
          "update_curvature needs exactly one of batch=... or stats=...; "
          f"got {'both' if batch is not None else 'neither'}.")
    if stats is None:
      stats = self.compute_stats(params, batch, jax.random.PRNGKey(0)
                                 if rng is None else rng)
    decay = est.cov_ema_decay if ema_decay is None else ema_decay
    static = isinstance(decay, (int, float))
    d = 0.0 if static else jnp.asarray(decay)
    def ema(i, s, x, d):
      return est.blocks[i].update_curvature(s, x, decay if static else d)

    with jax.named_scope("kfac_ema"):
      if isinstance(stats, owner_stats.StatsInputs):
        branch, ops, specs, before = owner_stats.ema_on_owners(
            est, self.plan, self.axis, stats, d, ema)
        return ShardedState(self._update(branch, state.rows, ops, specs,
                                         before, row_writes.sequential))
      stats_lib.check_reduction(stats, est.axis_name, est.stats_sync)
      return ShardedState(self._update(
          lambda r, layers, ops: {i: functools.partial(
              ema, i, x=ops[0][i], d=ops[1]) for i in layers},
          state.rows, (est.per_layer(stats), d),
          write=row_writes.sequential))

  @_blas_threads.limited  # One LAPACK thread: docs/performance.md.
  def update_cache(self, state, damping=None, layers=None) -> ShardedState:
    """Refreshes each block's damped powers on its owner (as
    :meth:`FisherEstimator.update_cache`; ``layers`` restricts it)."""
    est = self.estimator
    self._check(state)
    damping = est.damping if damping is None else damping
    damping = jnp.asarray(damping, linalg.factor_dtype())
    wanted = None if layers is None else set(layers)

    units = self.plan.units
    largest = {r: max(own, key=lambda i: units[i].nbytes) for r in range(
        self.num_devices) if (own := self.plan.layers_of(r))}

    def branch(first, r, states, lam):
      return self.layout.keep_unrefreshed(states, self._refresh_own(
          [i for i in states if (wanted is None or i in wanted)
           and (i == largest[r]) == first], states, lam))

    # Each device's largest block first, the others after: two windows,
    # each smaller than all the caches (the layout puts the largest
    # block's first), and their refresh temporaries not live together.
    # (One switch over the devices: its compiled program counts one
    # device's refresh, where a cond per device would count all.)
    rows = self._update(functools.partial(branch, True), state.rows, damping)
    return ShardedState(self._update(functools.partial(branch, False), rows,
                                     damping))

  @functools.cached_property
  def _padded_sizes(self) -> dict:
    """``{(layer, factor): N}``: the size each dense factor of a layer
    without a same-shaped twin is padded to in the refresh without a mesh
    (:func:`refresh.bucket_sizes`), so its owner rounds alike."""
    est = self.estimator
    alone = [g[0] for g in est.groups if len(g) == 1]
    sizes = {}

    def probe():
      blocks = [est.blocks[i] for i in alone]
      sizes.update(refresh.bucket_sizes(blocks, [b.init() for b in blocks]))
      return 0

    jax.eval_shape(probe)
    return {(alone[k], name): n for (k, name), n in sizes.items()}

  @refresh.highest_precision
  def _refresh_own(self, mine, states, lam) -> dict:
    """The refreshed states of the layers ``mine`` of one device, computed
    as without a mesh: a layer without a same-shaped twin through the
    padded bucket it has there, the members of a group under one
    ``vmap``."""
    est = self.estimator
    out = {}
    for g in est.groups:
      own = [i for i in g if i in mine]
      if len(g) > 1 and len(own) == 1:  # No stack: a copy of the state.
        out[own[0]] = est.blocks[own[0]].update_cache(states[own[0]], lam)
      elif len(g) > 1 and own:
        new = jax.vmap(lambda s, b=est.blocks[g[0]]: b.update_cache(s, lam))(
            grouping.stack([states[i] for i in own]))
        out.update(zip(own, grouping.unstack(new, len(own))))
    alone = [i for i in mine if i not in out]
    if alone:
      sizes = {(k, n): size for (i, n), size in self._padded_sizes.items()
               for k, j in enumerate(alone) if i == j}
      out.update(zip(alone, refresh.bucketed_update_cache(
          [est.blocks[i] for i in alone], [states[i] for i in alone], lam,
          sizes)))
    return out

  def product_inputs(self, state, v, name: str = "v") -> ProductInputs:
    """``v`` as the blocks multiply it, per layer (``per_group`` holds one
    entry per layer here)."""
    self._check(state)
    est = self.estimator
    leaves, parts = grouping.split_params(est.collection, v, name)
    xs = [b.product_input(p) for b, p in zip(est.blocks, parts)]
    used = {i for l in est.collection.layers for i in l.param_indices}
    rest = [x for i, x in enumerate(leaves) if i not in used]
    return ProductInputs(leaves, parts, xs, rest)

  def multiply_matpower(self, state, v, exp, inputs=None):
    """``F̂^exp v`` (damped): each layer's block on its owner (as
    :meth:`FisherEstimator.multiply_matpower`).

    Each layer's part of ``v`` enters split over the axis on its leading
    axis (:func:`~kfac_jax_lite.routing.split_axis`) and goes whole to its
    owner only; the owner's product goes back split the same way
    (:class:`~kfac_jax_lite.routing.Route`) and is all-gathered, so the
    result is whole on every device (as without a mesh); with
    ``param_shardings`` it stays split and takes their layout instead.
    """
    est = self.estimator
    for b in est.blocks:
      blocks_lib.base.check_exp(b, exp)
    if inputs is None:
      inputs = self.product_inputs(state, v)
    self._check(state)
    parts = [list(p) for p in inputs.parts]
    route = routing.make_route(self.plan, parts)
    names, layout = self.axis, self.layout

    def raw(i, s, x):
      return est.blocks[i].multiply_matpower_raw(s, x, exp)

    def branch(r, rows, received, local):
      full = route.at_owner(r, received, local)
      states = layout.unpack(r, rows)
      xs = {i: est.blocks[i].product_input(tuple(full[i])) for i in states}
      res = {}
      for g in est.groups:  # One vmap per group, as without a mesh.
        own = [i for i in g if i in states]
        if len(own) > 1:  # A lone member unstacked: no copy of its state.
          out = jax.vmap(functools.partial(raw, g[0]))(
              grouping.stack([states[i] for i in own]),
              grouping.stack([xs[i] for i in own]))
          res.update(zip(own, grouping.unstack(out, len(own), True)))
        elif own:
          res[own[0]] = raw(own[0], states[own[0]], xs[own[0]])
      return route.from_owner(r, {i: list(est.blocks[i].finish_product(
          res[i], tuple(full[i]))) for i in res})

    def body(rows, local):
      rows = {dt: x[0] for dt, x in rows.items()}
      received = route.to_owners(local, names)
      fns = [functools.partial(branch, r) for r in range(self.num_devices)]
      if len(fns) == 1:
        out = fns[0](rows, received, local)
      else:
        out = lax.switch(lax.axis_index(names), fns, rows, received, local)
      buffers, whole = out
      return route.back(buffers, whole, names, gather=not split)

    specs, split = route.specs(names), self.param_shardings is not None
    with jax.named_scope("kfac_sharded_product"):
      out = jax.shard_map(body, mesh=self.mesh, in_specs=(self._spec, specs),
                          out_specs=specs if split else P(),
                          check_vma=False)(state.rows, parts)
    out = grouping.merge_params(est.collection, v, inputs.leaves, out)
    if not split:
      return out
    return lax.with_sharding_constraint(out, placement.param_layout(
        self.mesh, self.param_shardings, v))

  def multiply(self, state, v):
    """``F̂ v`` (damped)."""
    return self.multiply_matpower(state, v, 1)

  def multiply_inverse(self, state, v):
    """``F̂⁻¹ v`` (damped)."""
    return self.multiply_matpower(state, v, -1)
