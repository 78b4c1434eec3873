"""Data-parallel K-FAC: replica keys, factor averaging, distributed inverses.

Under ``jax.pmap`` or ``jax.shard_map`` with ``axis_name``, each of the
``R`` replicas holds ``b`` examples of a global batch of ``B = R b``. The
curvature of the mean loss over the global batch is the replica average of
the per-replica curvatures, because every Kronecker statistic is a mean over
examples:

.. math::
  A = \\frac{1}{B} \\sum_{i=1}^{B} \\bar a_i \\bar a_i^T
    = \\frac{1}{R} \\sum_{r=1}^{R} A_r, \\qquad
  G = \\frac{1}{R} \\sum_{r=1}^{R} G_r.

The exponential moving average is linear too, so with decay :math:`\\rho`
and zero-debiasing weight :math:`w_t` (the same on every replica),

.. math::
  \\frac{1}{R} \\sum_r \\bar F^{(r)}_t
  = \\frac{1}{R} \\sum_r \\frac{\\rho w_{t-1} \\bar F^{(r)}_{t-1} + S^{(r)}_t}
    {w_t}
  = \\frac{\\rho w_{t-1} \\bar F_{t-1} + \\bar S_t}{w_t},

the average of per-replica EMAs equals the EMA of averaged statistics. So
the statistics can be averaged at every update (``stats_sync=
"every_update"``: every replica always holds the global factors) or only
the factors, just before the damped inverses are refreshed (``stats_sync=
"before_refresh"``: one reduction per refresh instead of one per update; the
inverses are the same; between refreshes the replicas' factors differ).

Naive (generic) blocks estimate their diagonal from the square of the
batch-summed gradient, :math:`\\frac{1}{B}\\sum_s (\\sum_i g_{s,i})^2`, which
is not a mean over examples; the estimator sums those gradients over the
axis (``psum``) before squaring, at every update, whatever ``stats_sync``.

Distributed inverses (:func:`update_cache`): the refresh of every block is
assigned to one device of the axis; each device computes its share under
``lax.cond`` and one ``psum`` of zeros-or-result gives every replica all the
caches, as TF K-FAC's ``replica_round_robin`` placement does with a
cross-replica sum. Per-device inverse work falls roughly as ``1/R``; the
price is one all-reduce of the refreshed caches.

References:
  Ba, Grosse & Martens (2017), "Distributed second-order optimization using
  Kronecker-factored approximations", ICLR (statistics averaged over
  workers; inverses computed on separate workers).
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import jax
import jax.extend
from jax import lax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import keys as keys_lib

STATS_SYNCS = ("every_update", "before_refresh")


def check_options(axis_name, stats_sync, distributed_inverses):
  """Raises ``ValueError`` for an invalid data-parallel option."""
  if stats_sync not in STATS_SYNCS:
    raise ValueError(
        f"stats_sync={stats_sync!r}; choose one of "
        f"{list(STATS_SYNCS)}.")
  if distributed_inverses and axis_name is None:
    raise ValueError(
        "distributed_inverses=True needs axis_name=... (the pmap/shard_map "
        "axis whose devices share the inverses); without an axis every "
        "device computes all of them.")


def axis_size(axis_name: Hashable, argument: str = "axis_name") -> int:
  """The number of replicas along ``axis_name`` (static).

  Raises:
    ValueError: ``axis_name`` is not bound here (no enclosing ``pmap`` or
      ``shard_map`` with that name); JAX's own message is appended.
  """
  try:
    return lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"{argument}={axis_name!r} is not a mapped axis where K-FAC runs. "
        "Call the step inside jax.pmap(..., axis_name=...) or jax.shard_map "
        "over a mesh with that axis name, or pass axis_name=None under "
        f"plain jax.jit (batch-sharded inputs need no axis). JAX: {e}"
    ) from e


def varying_axes(tree) -> tuple:
  """Mesh axes some leaf of ``tree`` varies over inside ``shard_map``.

  Empty outside ``shard_map``, under ``pmap`` and with ``check_vma=False``
  (JAX then tracks no varying axes).
  """
  axes = set()
  for x in jax.tree.leaves(tree):
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    axes |= set(getattr(mat, "varying", None) or getattr(t, "vma", ()))
  return tuple(sorted(axes, key=str))


def vary(tree, axes: tuple):
  """Casts every leaf to vary over ``axes`` (a no-op at run time).

  Inside ``shard_map``, differentiating through a replicated (invariant)
  value that meets per-shard data sums its cotangent over the axis. K-FAC
  needs per-replica cotangents (per-example output gradients must not be
  summed across shards), so the linearisation's inputs are made varying
  first; the reductions are then explicit, as under ``pmap``.
  """
  if not axes:
    return tree

  def cast(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
      return x
    if hasattr(lax, "pcast"):
      return lax.pcast(x, missing, to="varying")
    # jax < 0.9, before pcast replaced it.
    return lax.pvary(x, missing)  # pyright: ignore[reportAttributeAccessIssue]

  return jax.tree.map(cast, tree)


def replica_key(key, axis_name: Hashable):
  """``key`` hashed with the axis index: a sampling key per replica.

  The key in the optimizer state stays the same on every replica; only the
  key used for this step's sampled targets is folded, so replicas draw
  independent targets for their own examples.
  """
  axis_size(axis_name)
  return keys_lib.derive(key, lax.axis_index(axis_name))


def average_factors(blocks: Sequence, states: Sequence, axis_name) -> list:
  """``pmean`` of the factors of every block (one all-reduce).

  Blocks that need parameter gradients (square-of-sum statistics) are
  skipped: their statistics are already reduced over the axis at every
  update. A state may hold a stack of same-shaped layers.
  """
  axis_size(axis_name)
  picked = [None if b.needs_param_grads else b.factors(s)
            for b, s in zip(blocks, states)]
  picked = lax.pmean(picked, axis_name)
  return [s if p is None else b.with_factors(s, p)
          for b, s, p in zip(blocks, states, picked)]


def live_factors(block) -> tuple:
  """Which factor leaves ``block.multiply_matpower`` reads at its cached
  exponents.

  A Kronecker block's damped powers come from its refreshed cache, but a
  diagonal block powers its live diagonal at every product, and EK-FAC
  rescales by its live eigenbasis second moments. With
  ``stats_sync="before_refresh"`` such leaves differ across replicas
  between refreshes, so the products average them first
  (:func:`average_live_factors`). Found by following the data flow of the
  product's jaxpr (traced once, abstractly) from each leaf of
  ``block.factors(state)``; a leaf feeding any equation whose results reach
  the product counts as read.

  Returns:
    One bool per leaf of ``block.factors(state)``; ``()`` for blocks
    whose statistics are reduced over the axis at every update
    (``needs_param_grads``).
  """
  if block.needs_param_grads:
    return ()
  state = jax.eval_shape(block.init)
  factors = block.factors(state)
  if not (hasattr(block, "layer") and hasattr(block, "config")):
    # A user block without them: average every factor leaf (safe).
    return (True,) * len(jax.tree.leaves(factors))
  v = tuple(jax.ShapeDtypeStruct(s, d) for s, d in zip(
      block.layer.param_shapes, block.layer.param_dtypes))
  closed = jax.make_jaxpr(
      lambda f, s, v, e: block.multiply_matpower(
          block.with_factors(s, f), v, e), static_argnums=3)
  n = len(jax.tree.leaves(factors))
  read = [False] * n
  for e in block.config.cached_exps:
    jaxpr = closed(factors, state, v, e).jaxpr
    reach = {var: {i} for i, var in enumerate(jaxpr.invars[:n])}
    for eqn in jaxpr.eqns:
      found = set().union(*(reach.get(x, set()) for x in eqn.invars
                            if not isinstance(x, jax.extend.core.Literal)))
      if found:
        reach.update({o: found for o in eqn.outvars})
    for o in jaxpr.outvars:
      if not isinstance(o, jax.extend.core.Literal):
        for i in reach.get(o, ()):
          read[i] = True
  return tuple(read)


def average_live_factors(blocks: Sequence, states: Sequence,
                         live: Sequence, axis_name) -> list:
  """``states`` with the factor leaves flagged in ``live`` (one tuple of
  bools per block, :func:`live_factors`; a state may stack same-shaped
  layers) averaged over ``axis_name`` (one all-reduce for all of them)."""
  picked, where = [], []
  for k, (b, s, flags) in enumerate(zip(blocks, states, live)):
    for i, (x, f) in enumerate(zip(jax.tree.leaves(b.factors(s)), flags)):
      if f:
        picked.append(x)
        where.append((k, i))
  if not picked:
    return list(states)
  picked = lax.pmean(picked, axis_name)
  out = list(states)
  for k in sorted({k for k, _ in where}):
    factors = blocks[k].factors(states[k])
    leaves, tree = jax.tree.flatten(factors)
    for (kk, i), x in zip(where, picked):
      if kk == k:
        leaves[i] = x
    out[k] = blocks[k].with_factors(states[k], jax.tree.unflatten(tree, leaves))
  return out


def refresh_cost(state) -> float:
  """Rough cost of refreshing a block: ``d³`` per square matrix leaf.

  Leaves ``[..., d, d]`` count ``prod(...) · d³`` (a factorisation); other
  leaves their size. Only ratios between blocks matter.
  """
  cost = 0.0
  for x in jax.tree.leaves(state):
    if x.ndim >= 2 and x.shape[-1] == x.shape[-2]:
      cost += math.prod(x.shape[:-2]) * float(x.shape[-1]) ** 3
    else:
      cost += float(x.size)
  return cost


def assign(costs: Sequence[float], num_devices: int) -> tuple:
  """Owners of the work units: greedy longest-processing-time first.

  Units in decreasing cost (ties: original order) go to the least-loaded
  device (ties: lowest id). Equal costs give plain round robin
  ``0, 1, ..., R-1, 0, ...`` (TF K-FAC's ``replica_round_robin``); unequal
  ones are balanced within a factor 4/3 of the best split (Graham 1969).

  Returns:
    ``owners[u]`` in ``[0, num_devices)`` for each unit.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices={num_devices!r} must be >= 1.")
  load = [0.0] * num_devices
  owners = [0] * len(costs)
  for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
    d = min(range(num_devices), key=lambda d: (load[d], d))
    owners[u] = d
    load[d] += costs[u]
  return tuple(owners)


def plan(costs: Sequence[float], sizes: Sequence[int], num_devices: int):
  """Splits the refresh into units and assigns each to a device.

  A group of ``n`` same-shaped blocks (refreshed with one ``vmap``) becomes
  ``min(n, R)`` units of near-equal size (members ``j, j + c, ...``), so
  several identical layers are spread over devices too.

  Args:
    costs: the refresh cost of one member of each group.
    sizes: each group's number of members.
    num_devices: ``R``.

  Returns:
    ``(units, owners)``: units ``(group, positions)`` and each unit's
    device.
  """
  units = []
  for k, n in enumerate(sizes):
    c = min(n, num_devices)
    units.extend((k, tuple(range(n))[j::c]) for j in range(c))
  return units, assign([len(u) * costs[k] for k, u in units], num_devices)


def _changed_leaves(block, state, damping) -> tuple:
  """Which leaves of ``block.update_cache(state)`` are new (traced once).

  Leaves the refresh passes through (the factors, the EMA weight) need not
  be communicated.
  """
  flags = []

  def probe(s):
    new = block.update_cache(s, damping)
    if jax.tree.structure(new) != jax.tree.structure(s):
      raise ValueError(
          f"update_cache of layer {block.layer.name!r} changed the state's "
          "structure; a block state must keep its structure.")
    flags.append(tuple(n is not o for n, o in zip(jax.tree.leaves(new),
                                                   jax.tree.leaves(s))))
    return new

  jax.eval_shape(probe, state)
  return flags[0]


def _take(state, size, pos):
  """The members ``pos`` of a state stacking ``size`` layers (None: one
  unstacked state), unstacked when ``pos`` has one member."""
  if size is None:
    return state
  if len(pos) == 1:
    return jax.tree.map(lambda x: x[pos[0]], state)
  if len(pos) == size:
    return state
  step = pos[1] - pos[0]
  return jax.tree.map(lambda x: x[pos[0]:pos[-1] + 1:step], state)


def update_cache(blocks: Sequence, states: Sequence, sizes: Sequence,
                 damping, axis_name, refresh=None) -> list:
  """Refreshes every block's cache, each on one device, then shares them.

  .. math::
    C_\\ell = \\sum_{r=1}^{R} [\\mathrm{owner}(\\ell) = r]\\; f_\\ell(F_\\ell)

  (``psum`` of zeros-or-result; adding zeros is exact, so every replica
  gets the owner's values bit for bit.) The factors must already be the
  same on every replica (averaged statistics, or :func:`average_factors`).

  Args:
    blocks, states: the blocks to refresh and their states; ``states[k]``
      stacks ``sizes[k]`` same-shaped layers along a leading axis
      (``sizes[k]`` None: one unstacked state).
    sizes: as above.
    damping: λ for every block.
    axis_name: the data-parallel axis whose devices share the work.
    refresh: ``(k, state) -> new state`` for a unit of one layer of entry
      ``k`` (default ``blocks[k].update_cache(state, damping)``).

  Returns:
    The new states, in order.
  """
  num = axis_size(axis_name)
  member = [s if n is None else jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), s)
            for s, n in zip(states, sizes)]
  units, owners = plan([refresh_cost(m) for m in member],
                       [1 if n is None else n for n in sizes], num)
  changed = [_changed_leaves(b, m, damping) for b, m in zip(blocks, member)]
  me = lax.axis_index(axis_name)
  shared = []
  for (k, pos), owner in zip(units, owners):
    block = blocks[k]

    def mine(ss, block=block, k=k, pos=pos):
      if len(pos) > 1:
        new = jax.vmap(lambda s: block.update_cache(s, damping))(ss)
      elif refresh is not None:
        new = refresh(k, ss)
      else:
        new = block.update_cache(ss, damping)
      return [x for x, c in zip(jax.tree.leaves(new), changed[k]) if c]

    ss = _take(states[k], sizes[k], pos)
    if num == 1:
      shared.append(mine(ss))
    else:
      zeros = lambda ss, mine=mine: jax.tree.map(  # noqa: E731
          lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(mine, ss))
      shared.append(lax.cond(me == owner, mine, zeros, ss))
  if num > 1:
    shared = lax.psum(shared, axis_name)
  return [_assemble(states[k], sizes[k], changed[k],
                    [(pos, v) for (j, pos), v in zip(units, shared) if j == k])
          for k in range(len(states))]


def _assemble(state, size, changed, pieces):
  """``state`` with its changed leaves from the units' ``pieces``
  ``(positions, values)`` (stacked back in member order)."""
  if size is not None and len(pieces) == 1 and len(pieces[0][0]) > 1:
    new = pieces[0][1]
  elif size is not None:
    order = [i for pos, _ in pieces for i in pos]
    perm = np.argsort(order)
    new = [jnp.concatenate([v[c] if len(pos) > 1 else v[c][None]
                            for pos, v in pieces])
           for c in range(len(pieces[0][1]))]
    if order != sorted(order):
      new = [x[perm] for x in new]
  else:
    new = pieces[0][1]
  it = iter(new)
  leaves = [next(it) if c else x
            for x, c in zip(jax.tree.leaves(state), changed)]
  return jax.tree.unflatten(jax.tree.structure(state), leaves)
