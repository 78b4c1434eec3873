"""The refresh of the cached inverses / powers, with size buckets.

:func:`update_cache` refreshes a grouped estimator state: groups of
same-shaped layers under one ``vmap`` each, and the dense Kronecker
factors of the layers without a same-shaped twin together, in size
buckets (:func:`bucketed_update_cache`): factors of nearby sizes are
padded with an identity block to one size, which is exact (a matrix
function of a block-diagonal matrix is block-diagonal), so their
factorisation kernels compile once per bucket instead of once per factor
size (docs/performance.md#size-buckets).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import _xla_cpu
from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import distributed
from kfac_jax_lite import grouping
from kfac_jax_lite import linalg

# A factor of size n may be padded by at most max(1, n // PAD_DIVISOR) rows:
# at most 1/16 more rows, so at most (17/16)³ - 1 ≈ 20% more flops for that
# factor, and never more than one row for sizes below 32.
PAD_DIVISOR = 16


def max_padding(n: int) -> int:
  """The most rows a factor of size ``n`` may be padded by in a bucket."""
  return max(1, n // PAD_DIVISOR)


def size_buckets(sizes) -> list:
  """Groups factor sizes that can share one padded, batched refresh.

  Rule: sizes are visited from the largest down; the largest size not yet
  placed opens a bucket of that size ``N``, and every smaller unplaced
  ``n`` with ``N - n <= max_padding(n)`` (``= max(1, n // 16)``) joins it.
  A factor is thus never padded by more than 1/16 of its size (one row
  for sizes below 32): 30 joins 31, never 250 or 1000.

  Args:
    sizes: the factors' sizes.

  Returns:
    ``[(N, [indices into sizes]), ...]``: each bucket's padded size and
    its members, in decreasing ``N`` (members in their original order).
  """
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  buckets = []
  for i in order:
    if buckets and buckets[-1][0] - sizes[i] <= max_padding(sizes[i]):
      buckets[-1][1].append(i)
    else:
      buckets.append((sizes[i], [i]))
  return [(n, sorted(idx)) for n, idx in buckets]


def bucketed_map(fn, mats, dampings, padded_sizes=None) -> list:
  """``[fn(m, d) for m, d in zip(mats, dampings)]``, one size per bucket.

  Math: for a block-diagonal matrix every matrix function acts block by
  block, :math:`f\\begin{pmatrix} M & 0 \\\\ 0 & I \\end{pmatrix} =
  \\begin{pmatrix} f(M) & 0 \\\\ 0 & f(1) I \\end{pmatrix}`; so the
  top-left ``n x n`` block of ``(P + d I)^e`` with ``P = [[M, 0], [0, I]]``
  is ``(M + d I)^e`` exactly, and the padded block ``(1 + d)^e I`` stays
  finite (and well conditioned) for any damping ``d >= 0``. The Cholesky
  factor of ``P + d I`` has ``chol(M + d I)`` as its leading block
  (forward elimination never looks past it), and so does its inverse.

  Each matrix is padded to the size of its bucket (:func:`size_buckets`)
  and ``fn`` runs on it; each output leaf's top-left ``n x n`` block
  (``[n]`` for vectors) is the unpadded result. Every member of a bucket
  reaches ``fn`` through the same kernels: its size ``n`` and its damping
  are runtime arguments (read from vectors at
  :func:`~kfac_jax_lite._xla_cpu.opaque_indices`, in the CPU program:
  elsewhere at constants). ``fn`` is not
  ``vmap``-ed over a bucket (docs/performance.md#size-buckets).

  Args:
    fn: ``(matrix [N, N], damping []) -> pytree`` of arrays whose every
      axis has the matrix's size (or scalars), commuting with the padding
      as above (damped powers, Cholesky factors and their inverses do).
    mats: square matrices.
    dampings: one scalar each (a sequence, or a vector), or a function of
      the vector ``[tr(m) / n for m in mats]`` returning that vector: the
      traces are then taken of the zero-padded matrices (one kernel per
      bucket; the padding adds exact zeros), as the pi-adjusted damping
      needs them (:func:`linalg.pi_split`).
    padded_sizes: the size each matrix is padded to; by default its
      bucket's among ``mats`` (:func:`size_buckets`). Given, a matrix
      refreshed alone goes through the same padded computation as in the
      buckets of a larger refresh (the same rounding).

  Returns:
    ``fn``'s outputs for the unpadded matrices, in order.
  """
  sizes = [m.shape[0] for m in mats]
  if padded_sizes is None:
    padded_sizes = [0] * len(mats)
    for size, idx in size_buckets(sizes):
      for i in idx:
        padded_sizes[i] = size
  zero_padded = []
  for m, n, size in zip(mats, sizes, padded_sizes):
    if size < n:
      raise ValueError(f"padded_sizes: {size} is smaller than the matrix's "
                       f"size {n}; pass sizes at least the matrices'.")
    zero_padded.append(jnp.pad(m, ((0, size - n), (0, size - n)))
                       if size > n else m)
  if callable(dampings):
    dt = mats[0].dtype
    dampings = dampings(jnp.stack([jnp.trace(p) for p in zero_padded])
                        / jnp.asarray(sizes, dt))
  dampings = jnp.stack([jnp.asarray(d) for d in dampings]) if isinstance(
      dampings, (list, tuple)) else dampings
  dims = jnp.asarray(sizes, jnp.int32)
  index = _xla_cpu.opaque_indices(len(mats), dampings)
  out = []
  for i, (p, j) in enumerate(zip(zero_padded, index)):
    size = p.shape[0]
    n = jax.lax.dynamic_index_in_dim(dims, j, keepdims=False)
    p = p + jnp.diag((jnp.arange(size) >= n).astype(p.dtype))
    res = fn(p, jax.lax.dynamic_index_in_dim(dampings, j, keepdims=False))
    out.append(res if sizes[i] == size else jax.tree.map(
        lambda x, n=sizes[i]: x[(slice(0, n),) * x.ndim], res))
  return out


def _bucketable(block: blocks_lib.Block, state) -> bool:
  """A block whose ``"pi"`` refresh has dense factors to bucket."""
  return (isinstance(block, blocks_lib.base.FactorBucketed)
          and block.config.damping_type == "pi"
          and bool(block.factor_requests(state)))


def _bucket_requests(blocks, states) -> tuple:
  """``(pick, kinds)``: the indices of the blocks whose dense factors go to
  buckets, and their factors ``(i, name, matrix)`` by kind (factors share
  a bucket only with the same options and dtype; both factors of a block
  always share them)."""
  pick = [i for i, (b, s) in enumerate(zip(blocks, states))
          if _bucketable(b, s)]
  kinds = {}
  for i in pick:
    for name, f in blocks[i].factor_requests(states[i]):
      key = (blocks[i].factor_options, str(f.dtype))
      kinds.setdefault(key, []).append((i, name, f))
  return pick, kinds


def bucket_sizes(blocks, states) -> dict:
  """``{(i, name): N}``: the padded size of every bucketed factor in a
  refresh of ``blocks`` (see :func:`bucketed_update_cache`)."""
  out = {}
  for items in _bucket_requests(blocks, states)[1].values():
    for size, idx in size_buckets([f.shape[0] for _, _, f in items]):
      for k in idx:
        out[items[k][:2]] = size
  return out


def _kind_dampings(items, states, damping):
  """The ``dampings`` function of :func:`bucketed_map` for one kind's
  ``items`` ``(i, name, matrix)``: every owner's λ / c split by
  :func:`linalg.pi_split`, as vectors. Returns it and ``split``, which
  it fills with the dampings of the owners' diagonal factors."""
  members = {(i, name): k for k, (i, name, _) in enumerate(items)}
  owners = list(dict.fromkeys(i for i, _, _ in items))
  extra = [(i, n) for i in owners for n in ("a", "g")
           if (i, n) not in members]
  at = dict(members)
  at.update({k: len(items) + j for j, k in enumerate(extra)})
  split = {}

  def dampings(norms):
    dt = norms.dtype
    if extra:  # Diagonal factors' norms, after the members'.
      norms = jnp.concatenate([norms, jnp.stack(
          [linalg.trace_norm(getattr(states[i], n)) for i, n in extra]
      ).astype(dt)])
    scale = jnp.stack([states[i].scale for i in owners]).astype(dt)

    def split_at(idx):  # The pi split of owners[idx], as vectors.
      ta, tg = (norms[np.asarray([at[owners[b], n] for b in idx])]
                for n in ("a", "g"))
      return linalg.pi_split(ta, tg, jnp.asarray(damping, dt)
                             / scale[np.asarray(idx)])

    if extra:  # The diagonal factors' dampings, per block.
      da, dg = split_at(range(len(owners)))
      for b, i in enumerate(owners):
        split[i] = {"a": da[b], "g": dg[b]}
    # Each member's own split, gathered in one fused kernel
    # (docs/performance.md#size-buckets).
    da, dg = split_at([owners.index(i) for i, _, _ in items])
    return jnp.where(np.asarray([n == "g" for _, n, _ in items]), dg, da)

  return dampings, split


def bucketed_update_cache(blocks, states, damping, padded_sizes=None) -> list:
  """``[b.update_cache(s, damping)]``, dense Kronecker factors in buckets.

  The dense factors of every block with a ``"pi"`` refresh
  (:meth:`KroneckerBlock.factor_requests`), whatever their layer, go to
  :func:`bucketed_map` with the blocks' split dampings (as
  :meth:`KroneckerBlock.factor_dampings`, for all blocks as one vector
  from the traces the buckets take); the padding adds at most 1/16 of a
  factor's size (:func:`size_buckets`). Other blocks are refreshed one
  ``vmap`` per group of same-shaped blocks. ``padded_sizes`` (``{(i,
  name): N}``, as :func:`bucket_sizes`) sets the padded sizes instead.
  """
  out = [None] * len(blocks)
  pick, kinds = _bucket_requests(blocks, states)
  rest = [i for i in range(len(blocks)) if i not in set(pick)]
  if rest:
    new = grouping.grouped_map([blocks[i] for i in rest],
                               [states[i] for i in rest],
                               lambda b, s: b.update_cache(s, damping))
    for i, s in zip(rest, new):
      out[i] = s
  caches = {i: {} for i in pick}
  split = {}
  for items in kinds.values():
    dampings, kind_split = _kind_dampings(items, states, damping)
    res = bucketed_map(
        blocks[items[0][0]].factor_cache, [f for _, _, f in items], dampings,
        None if padded_sizes is None else [padded_sizes[i, n]
                                           for i, n, _ in items])
    split.update(kind_split)
    for (i, name, _), r in zip(items, res):
      caches[i][name] = r
  for i in pick:
    out[i] = blocks[i].with_factor_caches(states[i], damping, caches[i],
                                          split.get(i))
  return out


def alone_refresh(blocks, states, damping) -> Callable:
  """``refresh(k, state)`` for :func:`distributed.update_cache`: the block
  of a singleton group ``k`` refreshed through its bucket's padded
  computation, with the sizes the local refresh gives it (singleton
  groups share buckets), so that the distributed refresh rounds as the
  local one. ``blocks``, ``states``: those of the singleton groups."""
  sizes = bucket_sizes(blocks, states)

  def refresh(k, state):
    mine = {(0, n): size for (j, n), size in sizes.items() if j == k}
    return bucketed_update_cache([blocks[k]], [state], damping, mine)[0]

  return refresh


def highest_precision(fn: Callable) -> Callable:
  """``fn`` traced with every matmul at :data:`linalg.REFRESH_PRECISION`
  (``jax.default_matmul_precision``: a dot given no precision takes it)."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.default_matmul_precision(linalg.REFRESH_PRECISION.name.lower()):
      return fn(*args, **kwargs)

  return wrapped


@highest_precision
def update_cache(blocks, groups, states, damping, layers=None) -> list:
  """The refreshed state of every group (``vmap`` per group, buckets for
  the singleton groups).

  Args:
    blocks: one block per group.
    groups: the layer indices of each group.
    states: each group's state (stacked for groups of 2+).
    damping: λ.
    layers: optional layer indices to refresh (the others keep theirs).
  """
  parts = grouping.select(groups, states, layers)
  alone = [p.group for p in parts if len(groups[p.group]) == 1]
  bucketed = dict(zip(alone, bucketed_update_cache(
      [blocks[k] for k in alone], [states[k] for k in alone], damping)))
  new = [bucketed[p.group] if p.group in bucketed else jax.vmap(
      lambda s, b=blocks[p.group]: b.update_cache(s, damping))(p.state)
         for p in parts]
  return grouping.put(states, parts, new)


@highest_precision
def distributed_update_cache(blocks, groups, states, damping, layers,
                             axis_name) -> list:
  """:func:`update_cache` with each device of ``axis_name`` refreshing a
  share of the layers (:func:`distributed.update_cache`); the singleton
  groups' blocks go through their buckets' padded computation, so the
  result rounds as the local refresh."""
  parts = grouping.select(groups, states, layers)
  own = [blocks[p.group] for p in parts]
  sizes = [None if len(groups[p.group]) == 1 else
           len(groups[p.group]) if p.index is None else len(p.index)
           for p in parts]
  alone = [j for j, n in enumerate(sizes) if n is None]
  bucketed = alone_refresh([own[j] for j in alone],
                           [parts[j].state for j in alone], damping)
  where = {j: n for n, j in enumerate(alone)}

  def one(j, state):  # A unit of one layer.
    if j in where:
      return bucketed(where[j], state)
    return own[j].update_cache(state, damping)

  new = distributed.update_cache(own, [p.state for p in parts], sizes,
                                 damping, axis_name, one)
  return grouping.put(states, parts, new)
