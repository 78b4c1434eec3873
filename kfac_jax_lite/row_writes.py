"""Writing each device's blocks into its row of the sharded state in place.

Inside the ``shard_map`` of :mod:`kfac_jax_lite.sharded` each device holds
its row ``{dtype: [1, L]}`` (:class:`~kfac_jax_lite.placement.Layout`) and
runs the code of its own blocks only. XLA updates a row in place, with no
copy of it, only where it can order every read of the row before the
write that overwrites it, and where the row keeps its ``[1, L]`` shape.
Two structures do that:

* :func:`sequential`: each device's blocks under a ``lax.cond`` of its
  own, each layer's state read from the row just before its new state is
  written (the EMA: no buffer of the row's size besides the row);
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


def sequential(layout, names, branch, rows, operands) -> dict:
  """New rows: ``branch(r, layers, operands)`` gives ``{layer: fn}`` on
  device ``r`` (``fn(state)`` the layer's new state); device ``r`` applies
  them in turn, each to its layer's state read from the row as it is."""
  def one(r, rows, operands):
    for i, fn in branch(r, layout.plan.layers_of(r), operands).items():
      old = layout.unpack(r, rows)[i]
      rows = write(rows, layout, {i: old}, {i: fn(old)})
    return rows

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
