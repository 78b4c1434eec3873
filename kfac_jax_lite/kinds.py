"""The registry of layer kinds: one row per kind, everything else derived.

A :class:`LayerKind` row says what the rest of the package needs to know
about a kind of layer: its name (the ``kind`` of the layer tag), its
curvature approximations for a layer used once and for one used several
times per example (the default first), the block factory of every
approximation, how a tag site counts uses, and which parameter (if any) is
an optional bias. From the rows come
:data:`APPROXIMATIONS` (and so ``scan``'s checks), ``tags.LAYER_KINDS``,
``Layer.has_bias``, the scanner's use counting and merging of tied sites,
``blocks.make_block``'s dispatch, and the README's table
(:func:`markdown_table`).

This module sits at the bottom of the package and imports no block module:
the factories are *named* (``"kronecker.dense_block"``, relative to
:mod:`kfac_jax_lite.blocks`) and resolved by ``blocks.make_block``, so the
scanner and the collection read the registry without importing any block.
A user block is not a new row: ``blocks.make_block(..., overrides=...)``
(and the estimator's ``block_factories``) map a ``(kind, approx)`` pair or
a parameter-path prefix to a factory per call, with no global state.

Example:
  >>> kinds.KINDS["conv"].approximations
  ('kron', 'diagonal', 'kron_sua', 'ekfac', 'kron_reduce')
  >>> kinds.approximations("fully_connected", num_uses=3)[0]
  'kron_indep'
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Mapping, Optional

# A multi-use layer asked for one of these gets its multi-use counterpart,
# when the kind does not list the name itself for multi-use layers.
MULTI_ALIASES: Mapping[str, str] = types.MappingProxyType(
    {"kron": "kron_indep"})

# How a tag site counts uses per example (see inner_uses).
USE_COUNTS = ("one", "positions", "ids")


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """One kind of layer.

  Attributes:
    name: the tag's ``kind`` (``"fully_connected"``, ...).
    approximations: for a layer used once per example; default first.
    multi_approximations: for a layer used several times (scan steps,
      repeated tags, inner positions); default first.
    factories: ``((approx, "module.function"), ...)``: the block factory
      ``(layer, config) -> block`` of every approximation, named relative to
      :mod:`kfac_jax_lite.blocks`.
    use_count: ``"one"``: a site is one use; ``"positions"``: every
      position of an input ``[B, T, ..., d]`` is a use (``T·...``);
      ``"ids"``: every id of ``[B, k, ...]`` ids is a use.
    bias_index: position of the optional bias parameter (one more input
      row), or None.
    joins: site kinds that, on the same parameters as a site of this kind,
      make one layer of this kind (a table looked up and attended).
  """
  name: str
  approximations: tuple
  multi_approximations: tuple
  factories: tuple
  use_count: str = "one"
  bias_index: Optional[int] = None
  joins: tuple = ()

  def __post_init__(self):
    named = {a for a, _ in self.factories}
    missing = set(self.approximations + self.multi_approximations) - named
    if missing or self.use_count not in USE_COUNTS:
      raise ValueError(
          f"LayerKind {self.name!r}: approximations {sorted(missing)} have no "
          f"factory, or use_count={self.use_count!r} is not in {USE_COUNTS}.")

  def factory(self, approx: str) -> Optional[str]:
    """The named factory of ``approx`` (None if the kind has none)."""
    return dict(self.factories).get(approx)

  def allowed(self, num_uses: int) -> tuple:
    """The approximations for a layer used ``num_uses`` times per example."""
    return self.multi_approximations if num_uses > 1 else self.approximations

  def has_bias(self, num_params: int) -> bool:
    """Whether a layer of this kind with ``num_params`` params has a bias."""
    return self.bias_index is not None and num_params == self.bias_index + 1


def _kron(name):
  return tuple((a, name) for a in ("kron", "kron_in_diag", "kron_out_diag",
                                    "kron_both_diag", "kron_indep"))


_ROWS = (
    LayerKind(
        "fully_connected",
        ("kron", "kron_in_diag", "kron_out_diag", "kron_both_diag",
         "diagonal", "full", "ekfac", "kron_reduce"),
        ("kron_indep", "kron_series_1", "kron_series_2", "kron_in_diag",
         "kron_out_diag", "kron_both_diag", "diagonal", "full", "ekfac",
         "kron_reduce"),
        _kron("kronecker.dense_block") + (
            ("ekfac", "ekfac.dense_ekfac_block"),
            ("kron_reduce", "kronecker.dense_reduce_block"),
            ("kron_series_1", "multi_use.series_block"),
            ("kron_series_2", "multi_use.series_block"),
            ("diagonal", "diagonal.dense_diagonal_block"),
            ("full", "full.dense_full_block")),
        use_count="positions", bias_index=1),
    LayerKind(
        "conv",
        ("kron", "diagonal", "kron_sua", "ekfac", "kron_reduce"),
        ("kron_indep", "diagonal", "ekfac", "kron_reduce"),
        (("kron", "conv.conv_kron_block"),
         ("kron_reduce", "conv.conv_reduce_block"),
         ("ekfac", "ekfac.conv_ekfac_block"),
         ("kron_indep", "conv.conv_kron_block"),
         ("kron_sua", "sua.conv_sua_block"),
         ("diagonal", "conv.conv_diagonal_block")),
        bias_index=1),
    LayerKind(
        "depthwise_conv",
        ("diagonal", "kron"), ("diagonal", "kron"),
        (("diagonal", "depthwise.depthwise_diagonal_block"),
         ("kron", "depthwise.depthwise_kron_block")),
        bias_index=1),
    LayerKind(
        "separable_conv",
        ("kron", "diagonal"), ("kron", "diagonal"),
        (("kron", "depthwise.separable_block"),
         ("diagonal", "depthwise.separable_block")),
        bias_index=2),
    LayerKind(
        "embedding", ("kron",), ("kron_indep",),
        (("kron", "embedding.embedding_block"),
         ("kron_indep", "embedding.embedding_block")),
        use_count="ids"),
    LayerKind(
        "tied_embedding", ("kron_sum",), ("kron_sum",),
        (("kron_sum", "tied.tied_embedding_block"),),
        use_count="positions", joins=("embedding",)),
    LayerKind(
        "scale_and_shift",
        ("full", "diagonal"), ("full", "diagonal"),
        (("full", "scale_and_shift.scale_and_shift_full_block"),
         ("diagonal", "scale_and_shift.scale_and_shift_diagonal_block"))),
    LayerKind(
        "generic", ("diagonal", "full"), ("diagonal", "full"),
        (("diagonal", "diagonal.naive_diagonal_block"),
         ("full", "full.naive_full_block"))),
)

KINDS: Mapping[str, LayerKind] = types.MappingProxyType(
    {row.name: row for row in _ROWS})


def kind(name: str) -> LayerKind:
  """The row of kind ``name``.

  Raises:
    ValueError: for an unknown kind (the message lists the known ones).
  """
  if name not in KINDS:
    raise ValueError(f"Layer kind {name!r} is unknown; the kinds are "
                     f"{list(KINDS)}.")
  return KINDS[name]


def approximation_key(name: str, num_uses: int) -> str:
  """``"conv"`` or ``"conv_multi"``: the key of :data:`APPROXIMATIONS`."""
  return f"{name}_multi" if num_uses > 1 else name


def approximations(name: str, num_uses: int = 1) -> tuple:
  """The approximations of kind ``name`` used ``num_uses`` times; default
  first."""
  return kind(name).allowed(num_uses)


# Allowed approximations per "kind" and "kind_multi"; the first is the
# default.
APPROXIMATIONS: Mapping[str, tuple] = types.MappingProxyType({
    approximation_key(r.name, n): r.allowed(n)
    for r in _ROWS for n in (1, 2)})


def canonical(name: str, num_uses: int, approx: str) -> str:
  """``approx`` with :data:`MULTI_ALIASES` applied for a multi-use layer
  whose kind does not list ``approx`` itself."""
  if num_uses > 1 and approx not in approximations(name, num_uses):
    return MULTI_ALIASES.get(approx, approx)
  return approx


def inner_uses(name: str, input_shapes: tuple) -> int:
  """Uses of a layer per example at one tag site, outside any ``lax.scan``.

  A dense layer applied to ``x: [B, T, ..., d_in]`` is used ``T·...`` times
  per example (each position is one use of the weights); so is an
  embedding looking up ``ids: [B, k, ...]``, and the output projection of a
  tied embedding (``tied_embedding`` sites) applied to ``[B, T, ..., d]``.
  Conv locations are not uses (KFC counts them in the block's scale), nor
  are the broadcast positions of a scale-and-shift layer (its per-example
  gradient sums over them).
  """
  count = kind(name).use_count
  if not input_shapes or count == "one":
    return 1
  shape = input_shapes[0]
  if count == "positions" and len(shape) > 2:
    return int(math.prod(shape[1:-1]))
  if count == "ids" and len(shape) > 1:
    return int(math.prod(shape[1:]))
  return 1


def joined_kind(site_kinds) -> Optional[str]:
  """The kind of a layer whose sites have ``site_kinds``, if a row joins
  them (``{"embedding", "tied_embedding"}`` -> ``"tied_embedding"``)."""
  found = set(site_kinds)
  for row in _ROWS:
    if row.joins and found == {row.name, *row.joins}:
      return row.name
  return None


def markdown_table() -> str:
  """The kinds x approximations table of the README, as Markdown.

  One row per kind, and one more for its multi-use variant when that has
  other approximations; the first approximation is the default.
  """
  lines = ["| kind | approximations |", "|---|---|"]
  for r in _ROWS:
    multi = approximation_key(r.name, 2)
    if r.approximations == r.multi_approximations:
      lines.append(_md_row((r.name, multi), r.approximations))
    else:
      lines.append(_md_row((r.name,), r.approximations))
      lines.append(_md_row((multi,), r.multi_approximations))
  return "\n".join(lines)


def _md_row(names, approxes) -> str:
  return "| {} | {} |".format(*(", ".join(f"`{x}`" for x in xs)
                                for xs in (names, approxes)))
