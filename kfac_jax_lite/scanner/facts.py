"""Facts the walk keeps about jaxpr values, and layer sites."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from kfac_jax_lite import losses as losses_lib
from kfac_jax_lite import tags


PASSTHROUGH = frozenset({
    "convert_element_type", "reshape", "broadcast_in_dim", "copy", "copy_p",
    "squeeze", "expand_dims"})
SAME_VIEW = frozenset({
    "convert_element_type", "copy", "copy_p", "reduce_precision"})
RESHAPE_VIEW = frozenset({"reshape", "squeeze", "expand_dims"})


# ---------------------------------------------------------------------------
# Facts about a value.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prov:
  """What the walk knows about one value of the jaxpr.

  Attributes:
    leaves: trainable parameter leaves the value depends on.
    direct: one leaf through ``PASSTHROUGH`` ops only (a tag's operand).
    op: the first non-view op it went through, for error messages.
    view: for a value that is one leaf seen through casts and reshapes:
      ``"flat"`` (the leaf's elements in row-major order), ``"trail"``
      (its trailing ``trail`` axes hold the leaf row-major, broadcast along
      the leading axes) or ``"T"`` (a 2-D leaf transposed); else ``""``.
    trail: see ``view``.
    stack: for a slice of a stacked leaf taken by ``lax.scan``, the index of
      that scan among the enclosing scans; else ``None``.
    raw: leaves that reach this value through a use that is not part of a
      recognised layer.
    sites: the nearest site keys upstream (a site's output restarts it).
    batched: depends on the batch.
    data: ``"iota"`` / ``"onehot"`` for the pieces of a one-hot encoding.
  """
  leaves: frozenset = frozenset()
  direct: bool = False
  op: str = ""
  view: str = ""
  trail: int = 0
  stack: Optional[int] = None
  raw: frozenset = frozenset()
  sites: frozenset = frozenset()
  batched: bool = False
  data: str = ""

  @property
  def is_view(self) -> bool:
    return self.direct or bool(self.view)

  @property
  def leaf(self) -> int:
    (leaf,) = self.leaves
    return leaf

  @property
  def pending(self) -> frozenset:
    """Leaves this value carries that no layer has consumed yet."""
    return self.leaves if self.is_view else frozenset()


NONE = Prov()
BATCH = Prov(batched=True)


def ntrail(shape) -> int:
  """Number of axes after the leading size-1 axes."""
  shape = tuple(shape)
  while shape and shape[0] == 1:
    shape = shape[1:]
  return len(shape)


def tail(shape, m: int) -> tuple:
  shape = tuple(shape)
  return shape[len(shape) - m:]


def strip(shape) -> tuple:
  """``shape`` without its leading size-1 axes."""
  return tail(shape, ntrail(shape))


def fits_features(p: Prov, shape, feat, y_shape, at=None) -> bool:
  """Whether a view ``p`` (of ``shape``) adds one leaf entry per feature.

  True when the leaf, row-major, lies on the feature axes of the output
  ``y_shape`` (sizes ``feat``, from axis ``at``; the trailing axes when
  ``at`` is None) and is broadcast along every other axis, as a dense
  bias, a conv bias (``[c_out]`` channels last, Equinox's ``[c_out, 1,
  1]`` channels first) or a normalisation scale/shift is.
  """
  if feat is None or p.view not in ("flat", "trail"):
    return False
  m, n = len(feat), len(y_shape)
  if len(shape) != n:
    return False
  if at is None or at + m == n:
    return (tail(y_shape, m) == tuple(feat) and tail(shape, m) == tuple(feat)
            and math.prod(tail(shape, p.trail)) == math.prod(feat))
  inside = range(at, at + m)
  return (p.view == "flat"
          and tuple(y_shape[at:at + m]) == tuple(feat)
          and tuple(shape[at:at + m]) == tuple(feat)
          and all(d == 1 for i, d in enumerate(shape) if i not in inside))


# ---------------------------------------------------------------------------
# Sites.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Site:
  """One place in the jaxpr whose output is perturbed (one layer use).

  Attributes:
    key: the perturbed equation's path, e.g. ``"3/body/2"`` (unique, stable).
    kind: layer kind.
    meta: static metadata, as the matching tag stores it.
    leaves: parameter leaf indices, in the tag's operand order.
    scan_lengths: lengths of the enclosing ``lax.scan`` loops, outermost
      first.
    y_aval: the aval of the layer output as the tag's ``y`` would be laid
      out (per scan step): features trailing, ``[..., d_out]`` for a dense
      layer, whatever the order of ``dot_general``'s operands.
    input_avals: avals of the recorded inputs (per scan step), laid out as
      the tag's inputs (a dense input flattened over its contracted axes).
    stack: index into ``scan_lengths`` of the scan that slices the stacked
      parameter leaves, or ``None``. That axis is the stack axis, not uses.
    found_by: ``"tag"`` or ``"auto"``.
    record: ``record(read) -> inputs`` for automatic sites (``read`` maps a
      jaxpr variable of the site's level to its value).
    to_out: for an automatic site whose equation's output is not laid out
      as ``y_aval`` (``w @ x`` gives ``[d_out, B]``, Equinox's vmapped conv
      a reshaped output), ``eps -> eps`` in the output's layout: a
      transpose, then a reshape.
  """
  key: str
  kind: str
  meta: tuple
  leaves: tuple
  scan_lengths: tuple
  y_aval: Any
  input_avals: tuple
  stack: Optional[int] = None
  found_by: str = "tag"
  record: Optional[Callable] = dataclasses.field(
      default=None, compare=False, repr=False)
  upstream: frozenset = dataclasses.field(
      default=frozenset(), compare=False, repr=False)
  raw_in: frozenset = dataclasses.field(
      default=frozenset(), compare=False, repr=False)
  to_out: Optional[Callable] = dataclasses.field(
      default=None, compare=False, repr=False)

  def perturbation(self, eps):
    """``eps`` (laid out as ``y_aval``) in the perturbed output's layout."""
    return eps if self.to_out is None else self.to_out(eps)

  @property
  def stack_shape(self) -> tuple:
    return tuple(self.scan_lengths)


@dataclasses.dataclass(frozen=True)
class LossSite:
  key: str
  spec: losses_lib.PositionLoss  # a LossSpec or a CustomLossSpec


@dataclasses.dataclass
class Draft:
  """An automatic site under construction (may still absorb a bias/shift)."""
  kind: str
  key: str
  leaves: tuple
  meta: tuple
  y: Any                      # the jaxpr variable that would be perturbed
  record: Callable
  input_avals: tuple
  stack: Optional[int]
  upstream: frozenset
  raw_in: frozenset
  dep_leaves: frozenset
  feat: Optional[tuple]       # feature axes a bias/shift may be added on
  factors: Optional[tuple] = None   # scale chain: ((var, "mul"|"div"), ...)
  batched: bool = True        # a scale chain has met a batched factor
  feat_at: Optional[int] = None     # first feature axis of y; None: trailing
  canon: Optional[tuple] = None     # y_aval's shape, when not y's own
  perm: Optional[tuple] = None      # y = transpose(canon, perm), reshaped
  also: frozenset = frozenset()     # other sites summed into y (keys)

  def to_out(self) -> Optional[Callable]:
    """``Site.to_out`` of this draft (None when ``y`` is in canonical
    layout)."""
    if self.canon is None:
      return None
    return functools.partial(out_layout, perm=self.perm,
                             shape=tuple(self.y.aval.shape))


@dataclasses.dataclass
class Found:
  """Everything one walk found.

  Attributes:
    leaf_paths, leaf_shapes: of every parameter leaf.
    auto: recognise untagged layers.
    sites: key -> :class:`Site`, tag and automatic.
    losses: the loss tags; ``loss_facts`` the facts of their ``z`` operand.
    unmatched: leaf -> reasons, for each use outside a recognised layer.
    rejected: leaf -> reason, for uses that looked like a layer but are not.
    alias: key -> (key it was merged into, its own Site), for sites in
      ``cond`` branches that share one slot.
  """
  leaf_paths: tuple
  leaf_shapes: tuple
  auto: bool
  sites: dict = dataclasses.field(default_factory=dict)
  losses: list = dataclasses.field(default_factory=list)
  loss_facts: list = dataclasses.field(default_factory=list)
  unmatched: dict = dataclasses.field(default_factory=dict)
  rejected: dict = dataclasses.field(default_factory=dict)
  alias: dict = dataclasses.field(default_factory=dict)

  def resolve(self, key: str) -> str:
    """The key of the site that ``key`` was merged into (itself if none)."""
    while key in self.alias:
      key = self.alias[key][0]
    return key

  def note(self, leaves, reason: str):
    for leaf in leaves:
      reasons = self.unmatched.setdefault(leaf, [])
      if reason not in reasons:
        reasons.append(reason)


def has_tags(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive in (tags.layer_tag_p, tags.loss_tag_p):
      return True
    for sub in eqn_subjaxprs(eqn):
      if has_tags(sub):
        return True
  return False


def eqn_subjaxprs(eqn):
  for v in eqn.params.values():
    vs = v if isinstance(v, (tuple, list)) else (v,)
    for x in vs:
      if isinstance(x, jex_core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jex_core.Jaxpr):
        yield x


def tag_error(site_key, kind, idx, prov, leaf_paths):
  what = f"parameter operand {idx} of the {kind} tag at {site_key}"
  if not prov.leaves:
    return ValueError(
        f"The {what} does not come from a parameter leaf (it depends only on "
        "the batch, on constants or on leaves outside params_filter). Pass "
        "the parameter array itself (optionally cast or reshaped) to the "
        "register_* function.")
  names = [leaf_paths[i] for i in sorted(prov.leaves)]
  return ValueError(
      f"The {what} is computed by `{prov.op or 'transpose'}` from parameter "
      f"leaves {names}; a tag's parameters must each be one parameter leaf "
      "(optionally cast or reshaped). Tag the leaf before combining it, or "
      "use register_generic for these parameters.")


def aval(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def read_var(env, v):
  if isinstance(v, jex_core.Literal):
    return NONE
  return env.get(v, NONE)


def chain_input(read, factors, shape, dtype):
  """The normalised input of a scale chain: the product of its factors."""
  x = None
  for v, op in factors:
    f = jnp.asarray(read(v))
    f = 1.0 / f if op == "div" else f
    x = f if x is None else x * f
  assert x is not None  # a scale chain has at least one factor
  return jnp.broadcast_to(x, shape).astype(dtype)


def chain_input_record(read, *, factors, shape, dtype):
  return (chain_input(read, factors, shape, dtype),)


def out_layout(eps, *, perm, shape):
  """A canonical perturbation in the layout of the perturbed output."""
  if perm is not None:
    eps = jnp.transpose(eps, perm)
  return eps.reshape(shape)


def retype_sites(sites, rejected: dict) -> list:
  """Settles the kind of ``x @ w.T``-shaped sites (``tied_embedding``).

  A 2-D parameter contracted on its last axis (``x @ w.T``, ``w @ x``,
  ``einsum("oi,...i->...o", w, x)``) is the output projection of a tied
  embedding when the same table is also looked up by ids; otherwise it is
  a dense layer whose kernel is held ``[d_out, d_in]`` (Equinox's and
  PyTorch's layout), and its site becomes ``fully_connected`` with
  ``kernel_perm=(1, 0)``. A bias on a tied projection is dropped from the
  site (``rejected`` gets the reason): the tied block has no bias.
  """
  looked_up = {s.leaves[0] for s in sites if s.kind == "embedding"}
  out = []
  for s in sites:
    if s.kind == "tied_embedding" and s.found_by == "auto":
      table = s.leaves[0]
      if table not in looked_up:
        s = dataclasses.replace(s, kind="fully_connected", meta=tuple(
            sorted(dict(s.meta, kernel_perm=(1, 0)).items())))
      elif len(s.leaves) > 1:
        rejected.setdefault(s.leaves[1], (
            f"added to the output projection at {s.key} of a tied "
            "embedding (its table is also looked up), whose block has no "
            "bias term"))
        s = dataclasses.replace(s, leaves=s.leaves[:1])
    out.append(s)
  return out


def site_out(d: Draft) -> Prov:
  return Prov(leaves=d.dep_leaves, sites=frozenset({d.key}) | d.also,
              batched=d.batched)


