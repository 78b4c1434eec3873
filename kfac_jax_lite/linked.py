r"""Linked parameters: several parameter leaves as one curvature block.

``register_generic((a, b, ...))`` inside the loss function makes the leaves
one generic layer, whose block (``full`` or ``diagonal``) is over their
concatenation :math:`\theta = [\mathrm{vec}(a); \mathrm{vec}(b); \dots]`
(``ravel_pytree`` order):

.. math::
  F_\theta = \frac{1}{B} \sum_s \Big(\sum_b \nabla_\theta \ell_{s,b}\Big)
  \Big(\sum_b \nabla_\theta \ell_{s,b}\Big)^T

(TF K-FAC's ``NaiveFullFB`` / ``NaiveDiagonalFB`` over the group; the
cross terms between the leaves are kept by ``full``). A tag on a leaf wins
over the automatic recognition of its layer, so a linked leaf leaves any
layer it was part of (the layer's other leaves become blocks of their own).

:func:`link_parameters` does the same from outside the model, by
parameter path (TF K-FAC's ``define_linked_parameters``), for models whose
code is not yours to tag (flax modules): it wraps the loss function, which
is then the one to scan and train.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax

from kfac_jax_lite import collection as collection_lib
from kfac_jax_lite import tags


def _groups_of(paths: Sequence[str], groups) -> list:
  """Per group, the indices of the leaves whose path starts with one of
  its prefixes."""
  out, taken = [], {}
  for g, group in enumerate(groups):
    if isinstance(group, str) or not group:
      raise TypeError(
          f"link_parameters: group {group!r} must be a non-empty tuple of "
          "parameter-path prefixes, e.g. (\"['enc']\", \"['dec']['w']\").")
    idx = []
    for prefix in group:
      hits = [i for i, p in enumerate(paths) if p.startswith(prefix)]
      if not hits:
        raise ValueError(
            f"link_parameters: prefix {prefix!r} of group {g} matches no "
            f"parameter leaf; the paths are {list(paths)[:8]}"
            f"{' ...' if len(paths) > 8 else ''} (jax.tree_util.keystr).")
      idx += [i for i in hits if i not in idx]
    for i in idx:
      if i in taken:
        raise ValueError(
            f"link_parameters: leaf {paths[i]} is in groups {taken[i]} "
            f"and {g}; a leaf belongs to one block.")
      taken[i] = g
    out.append(idx)
  return out


def link_parameters(loss_fn: Callable, groups: Sequence[Sequence[str]], *,
                    approx: Optional[str] = None) -> Callable:
  """``loss_fn`` with each group of parameter leaves one generic block.

  Each group is a tuple of parameter-path prefixes (as
  ``jax.tree_util.keystr`` prints them); every leaf under one of them joins
  the group, which is tagged with ``register_generic`` before ``loss_fn``
  runs: one block over the concatenation of the leaves (see the module
  docstring for the math).

  Args:
    loss_fn: ``loss_fn(params, batch, *args)``, any return value.
    groups: the groups of prefixes; a leaf may be in one group only.
    approx: ``full`` or ``diagonal`` for every group; None: the
      collection's default for generic layers, or ``scan``'s
      ``approximations`` by kind (``"generic"``) or path prefix.

  Returns:
    The wrapped loss function: the same value and gradient. Scan it, and
    give it to ``value_grad_and_stats``.

  Raises:
    TypeError: for a group that is not a tuple of strings.
    ValueError: for a prefix that matches no leaf, or a leaf in two groups
      (when the wrapped function is traced).

  Example:
    >>> # params = {"q": ..., "k": ..., "out": ...}: q and k as one block.
    >>> linked = kl.link_parameters(loss_fn, [("['q']", "['k']")],
    ...                             approx="full")
    >>> collection = kl.scan(linked, params, batch)
  """
  groups = tuple(tuple(g) if not isinstance(g, str) else g for g in groups)

  @functools.wraps(loss_fn)
  def linked(params, batch, *args, **kwargs):
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [collection_lib.normalize_path(jax.tree_util.keystr(p))
             for p, _ in flat]
    leaves = [x for _, x in flat]
    for idx in _groups_of(paths, groups):
      tagged = tags.register_generic(tuple(leaves[i] for i in idx),
                                     approx=approx)
      for i, x in zip(idx, tagged):
        leaves[i] = x
    return loss_fn(jax.tree.unflatten(treedef, leaves), batch, *args,
                   **kwargs)

  return linked
