"""Which input leaves each output leaf of a function reads.

:func:`leaf_dependencies` traces ``fn(tree)`` and follows its jaxpr
forward: an equation's outputs read every input leaf any of its operands
reads (a nested jaxpr, e.g. of ``jit`` or ``cond``, counts as one
equation, so the answer may over-count, never under-count). Used by
:mod:`kfac_jax_lite.row_writes` to order in-place writes so that no leaf
is read after it is overwritten.
"""

from __future__ import annotations

import jax
from jax.extend import core as jex_core


def leaf_dependencies(fn, tree) -> list:
  """Per leaf of ``fn(tree)`` (a pytree with ``tree``'s structure), the
  ``frozenset`` of the indices of ``tree``'s leaves it depends on
  (over-approximated: see the module docstring).

  Args:
    fn: a function of one pytree argument; what it closes over counts as
      no leaf.
    tree: a pytree of arrays (abstract values are enough).

  Returns:
    One ``frozenset`` of leaf indices per leaf of ``fn(tree)``.
  """
  leaves, treedef = jax.tree.flatten(tree)

  def flat(*xs):
    return jax.tree.leaves(fn(jax.tree.unflatten(treedef, xs)))

  jaxpr = jax.make_jaxpr(flat)(*leaves).jaxpr
  reads = {v: frozenset([k]) for k, v in enumerate(jaxpr.invars)}

  def of(v):
    if isinstance(v, jex_core.Literal):
      return frozenset()
    return reads.get(v, frozenset())

  for eqn in jaxpr.eqns:
    got = frozenset().union(*(of(v) for v in eqn.invars))
    for v in eqn.outvars:
      reads[v] = got
  return [of(v) for v in jaxpr.outvars]
