"""The static description of one layer (what a curvature block is built for).

It sits below both :mod:`kfac_jax_lite.collection` (which re-exports it)
and :mod:`kfac_jax_lite.blocks`, so neither imports the other.
"""

from __future__ import annotations

import dataclasses
import math

from kfac_jax_lite import kinds


@dataclasses.dataclass(frozen=True)
class Layer:
  """A static layer description.

  Attributes:
    name: a readable unique name (derived from the parameter paths).
    kind: ``fully_connected``, ``conv``, ``depthwise_conv``,
      ``separable_conv``, ``embedding``, ``tied_embedding`` (a table both
      looked up and used as ``x @ table.T``), ``scale_and_shift`` or
      ``generic``.
    approx: the resolved approximation string.
    param_paths: ``jax.tree_util.keystr`` of each parameter leaf, in the
      tag's operand order (e.g. kernel then bias).
    param_indices: positions of those leaves in ``jax.tree.leaves(params)``.
    param_shapes: shapes of the parameter leaves (whole leaves, including
      the stack axis of a stacked layer).
    param_dtypes: dtype names of the parameter leaves.
    num_uses: how many times the layer is applied per example (scan steps,
      repeated tags, inner axes such as ``T`` of ``[B, T, d]`` inputs). For a
      stacked layer: the uses of one slice.
    found_by: ``tag`` (registered by the user), ``auto`` (recognised by the
      scanner) or ``leftover`` (no structure found: generic block).
    meta: static tag metadata (strides, padding, ...), a sorted tuple.
    note: why a fallback happened, if one did.
    stack: ``0``, or ``L`` for a stacked layer: every parameter leaf has a
      leading axis of size ``L`` that a ``lax.scan`` (e.g. ``nn.scan``)
      slices, and slice ``l`` is an independent layer. The curvature block
      is built for one slice and ``vmap``-ped over the stack axis
      (:class:`kfac_jax_lite.blocks.combinators.VmappedBlock`).

  Example:
    >>> layer = collection.layers[0]
    >>> layer.kind, layer.approx, layer.num_uses
    ('fully_connected', 'kron', 1)
    >>> layer.param_paths              # keystr of the kernel and bias leaves
  """
  name: str
  kind: str
  approx: str
  param_paths: tuple
  param_indices: tuple
  param_shapes: tuple
  param_dtypes: tuple
  num_uses: int = 1
  found_by: str = "tag"
  meta: tuple = ()
  note: str = ""
  stack: int = 0

  def unstacked(self) -> "Layer":
    """The layer of one slice of a stacked layer (itself if not stacked)."""
    if not self.stack:
      return self
    return dataclasses.replace(
        self, param_shapes=tuple(s[1:] for s in self.param_shapes), stack=0)

  @property
  def is_multi(self) -> bool:
    """Whether the layer is used more than once per example."""
    return self.num_uses > 1

  @property
  def meta_dict(self) -> dict:
    """The tag metadata as a dict (strides, padding, ...)."""
    return dict(self.meta)

  @property
  def has_bias(self) -> bool:
    """Whether the layer's kind has an optional bias and it is present."""
    row = kinds.KINDS.get(self.kind)
    return row is not None and row.has_bias(len(self.param_paths))

  @property
  def num_params(self) -> int:
    """The number of parameters (every entry of every leaf)."""
    return sum(int(math.prod(s)) for s in self.param_shapes)
