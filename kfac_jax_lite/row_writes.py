"""Writing each device's blocks into its row of the sharded state in place.

Inside the ``shard_map`` of :mod:`kfac_jax_lite.sharded` each device holds
its row ``{dtype: [1, L]}`` (:class:`~kfac_jax_lite.placement.Layout`) and
runs the code of its own blocks only. XLA updates a row in place, with no
copy of it, only where it can order every read of the row before the
write that overwrites it, and where the row keeps its ``[1, L]`` shape.
Two structures do that:

* :func:`sequential`: each device's blocks under a ``lax.cond`` of its
  own, each layer's state read from the row just before its new state is
  written (the EMA: no buffer of the row's size besides the row); the
  device's largest block goes last and writes its factor matrices one at
  a time (:func:`in_turn`), so not even its old factors are copied out;
* :func:`windowed`: one ``lax.switch`` over the devices whose branches
  read the row and return only the window of it that they change (the
  same offsets on every device), written in after the switch (the
  refresh, whose layers are batched together: reads of every layer come
  before any write). Each branch builds its window once, as one
  concatenation of the new leaves and the old row between them: new
  leaves written into a slice of the row make XLA copy the slice first,
  so the window is live twice. Its compiled program counts the flops of
  one device's branch, where a cond per device counts every device's.

A ``lax.switch`` that returns the whole row, or a row reshaped to ``[L]``
around a conditional, makes XLA copy the row.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from kfac_jax_lite.scanner import deps


def write(rows: dict, layout, old: dict, new: dict) -> dict:
  """``rows`` (``{dtype: [1, L]}``) with the leaves of ``new``
  (``{layer: state}``) that are not ``old``'s own arrays (traced: a leaf
  passed through unchanged is the same object) written in at their slots.

  Each layer's adjacent slots that hold a changed leaf are written by one
  ``dynamic_update_slice`` (their leaves concatenated): XLA writes it in
  place after the reads of the leaves, where a second write would follow
  reads it cannot order before the first.
  """
  rows = dict(rows)
  for i, state in new.items():
    for run in _runs(zip(layout.slots[i], jax.tree.leaves(state),
                         jax.tree.leaves(old[i]))):
      changed = [k for k, (_, n, o) in enumerate(run) if n is not o]
      if not changed:
        continue
      run = run[changed[0]:changed[-1] + 1]
      dt = run[0][0].dtype
      parts = [jnp.ravel(n).astype(dt) for _, n, _ in run]
      rows[dt] = lax.dynamic_update_slice_in_dim(
          rows[dt], jnp.concatenate(parts)[None], run[0][0].offset, 1)
  return rows


def _runs(leaves) -> list:
  """``(slot, new, old)`` triples grouped into runs of adjacent slots (one
  dtype, each starting where the last ended), in offset order."""
  runs: list = []
  for s, n, o in sorted(leaves, key=lambda t: (t[0].dtype, t[0].offset)):
    last = runs[-1][-1][0] if runs else None
    if last and last.dtype == s.dtype and (
        last.offset + math.prod(last.shape) == s.offset):
      runs[-1].append((s, n, o))
    else:
      runs.append([(s, n, o)])
  return runs


def write_order(fn, old) -> list | None:
  """The changed leaves of ``fn(old)`` (indices) in an order in which each
  can be computed from the row as the earlier writes left it: no leaf's
  new value reads a leaf written before it (e.g. the factors of an EMA
  before the weight they read). None if there is no such order."""
  new = jax.tree.leaves(fn(old))
  changed = [k for k, (n, o) in enumerate(zip(new, jax.tree.leaves(old)))
             if n is not o]
  reads = deps.leaf_dependencies(fn, old)
  order, left = [], list(changed)
  while left:  # Next, a leaf no other leaf still to write reads.
    free = [k for k in left if not any(k in reads[j] for j in left if j != k)]
    if not free:
      return None
    order.append(free[0])
    left.remove(free[0])
  return order


def in_turn(rows: dict, layout, r: int, i: int, fn) -> dict:
  """``rows`` with layer ``i``'s state (on device ``r``) replaced by
  ``fn(state)``: its matrices one at a time (:func:`write_order`), each
  computed from the row as the writes before it left it, then its other
  changed leaves by one :func:`write`.

  Each matrix's write reads its old value from the window it overwrites
  (and leaves not yet written), so XLA fuses the update into the write and
  makes no copy of the old matrix (one write of several leaves copies them
  out of the row first). Without such an order, every leaf goes by one
  :func:`write`. Call it last on a row: a read of the row after a write
  of a few scalars lets XLA fuse that write into the read and copy the row.
  """
  old = layout.unpack(r, rows)[i]
  order = write_order(fn, old) or []
  rows, done = dict(rows), set()
  for k in order:
    slot = layout.slots[i][k]
    if len(slot.shape) < 2:  # The scalars and vectors go together below.
      break
    leaf = jax.tree.leaves(fn(layout.unpack(r, rows)[i]))[k]
    rows[slot.dtype] = lax.dynamic_update_slice_in_dim(
        rows[slot.dtype], jnp.ravel(leaf).astype(slot.dtype)[None],
        slot.offset, 1)
    done.add(k)
  now = layout.unpack(r, rows)[i]
  leaves, treedef = jax.tree.flatten(now)
  rest = [x if k in done else n
          for k, (x, n) in enumerate(zip(leaves, jax.tree.leaves(fn(now))))]
  return write(rows, layout, {i: now}, {i: jax.tree.unflatten(treedef, rest)})


def sequential(layout, names, branch, rows, operands) -> dict:
  """New rows: ``branch(r, layers, operands)`` gives ``{layer: fn}`` on
  device ``r`` (``fn(state)`` the layer's new state); device ``r`` applies
  them in turn, each to its layer's state read from the row as it is
  (:func:`in_turn`)."""
  def one(r, rows, operands):
    fns = branch(r, layout.plan.layers_of(r), operands)
    last = max(fns, key=lambda i: layout.plan.units[i].nbytes, default=None)
    for i, fn in fns.items():
      if i != last:
        old = layout.unpack(r, rows)[i]
        rows = write(rows, layout, {i: old}, {i: fn(old)})
    # The largest block last, its matrices in place (in_turn).
    return rows if last is None else in_turn(rows, layout, r, last,
                                             fns[last])

  num_devices = layout.plan.num_devices
  if num_devices == 1:
    return one(0, rows, operands)
  here = lax.axis_index(names)
  for r in range(num_devices):
    if layout.plan.layers_of(r):
      rows = lax.cond(here == r, functools.partial(one, r),
                      lambda rows, _: rows, rows, operands)
  return rows


def windowed(layout, names, branch, rows, operands) -> dict:
  """New rows: ``branch(r, states, operands)`` gives ``{layer: new
  state}`` on device ``r`` from its blocks' ``states``; each branch
  returns the window of its row holding the leaves it changed
  (:meth:`~kfac_jax_lite.placement.Layout.window`), written in after."""
  spans: dict = {}
  for r in range(layout.plan.num_devices):  # Which leaves change.
    def probe(rows, operands, r=r):
      old = layout.unpack(r, rows)
      for dt, (lo, hi) in layout.changed(
          old, branch(r, old, operands)).items():
        a, b = spans.get(dt, (lo, hi))
        spans[dt] = (min(a, lo), max(b, hi))
      return 0
    jax.eval_shape(probe, rows, operands)

  def one(r, rows, operands):
    flat = {dt: x[0] for dt, x in rows.items()}
    old = layout.unpack(r, flat)
    new = layout.window(flat, old, branch(r, old, operands), spans)
    return {dt: x[None] for dt, x in new.items()}

  fns = [functools.partial(one, r) for r in range(layout.plan.num_devices)]
  if not spans:
    return rows
  if len(fns) == 1:
    new = fns[0](rows, operands)
  else:
    new = lax.switch(lax.axis_index(names), fns, rows, operands)
  return {dt: x if dt not in spans else lax.dynamic_update_slice_in_dim(
      x, new[dt], spans[dt][0], 1) for dt, x in rows.items()}
