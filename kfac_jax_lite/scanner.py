"""Finds layers in a traced loss function; builds the collection.

Two jobs, both on the jaxpr of ``loss_fn(params, batch)``:

1. :func:`scan` walks the jaxpr at every nesting depth (``jit``,
   ``checkpoint``, ``custom_jvp``/``custom_vjp``, ``cond``, ``scan``) and
   keeps, for every value, a few *facts*: which parameter leaves it depends
   on, whether it is a plain *view* of one leaf (a cast, a row-major
   reshape, a leading broadcast, a transpose), whether it depends on the
   batch. From these it finds layer **sites**: the layer tags, and with
   ``auto_register=True`` the untagged layers of :mod:`flax` and plain-JAX
   code (``dot_general`` dense layers with an optional bias ``add``,
   ``conv_general_dilated``, ``gather`` / one-hot embeddings, scale-and-shift
   ``mul``/``add`` chains of normalisation layers). A site perturbs the
   output of one equation and records the layer inputs that are live at
   that point, laid out as the matching tag's inputs would be.

2. :func:`perturbed_fn` re-evaluates the jaxpr with a perturbation added to
   every site's output and returns the recorded layer inputs and the loss
   tags' operands. The derivative with respect to a zero perturbation is the
   loss gradient at the layer output, so a single ``jax.vjp`` gives the
   parameter gradient and every layer's output gradients. Equations that
   contain no site are re-bound unchanged; loops that contain sites are
   rebuilt with ``lax.scan`` / ``lax.switch`` so the perturbations become
   extra scanned inputs and the recorded inputs extra scanned outputs.

Soundness rules of automatic recognition (a layer block must see *every*
way its parameters reach the loss):

* a parameter leaf belongs to an automatic layer only if every use of it
  that reaches a loss tag is a recognised site of that layer; otherwise the
  leaf falls back to a generic block and ``describe()`` says which use was
  not recognised (e.g. the ``x @ table.T`` of a tied output projection);
* a site's input must depend on the batch, so that its leading axis is the
  batch axis;
* manual tags win: an automatic site that touches a tagged leaf is dropped.

This module and :mod:`kfac_jax_lite.tags` are the only ones that touch jaxpr
internals (``jax.extend.core``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.extend import core as jex_core

from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import collection as collection_lib
from kfac_jax_lite import losses as losses_lib
from kfac_jax_lite import tags

# A tag's parameter operand may pass through these (the leaf is "direct").
_PASSTHROUGH = frozenset({
    "convert_element_type", "reshape", "broadcast_in_dim", "copy", "copy_p",
    "squeeze", "expand_dims"})
_SAME_VIEW = frozenset({
    "convert_element_type", "copy", "copy_p", "reduce_precision"})
_RESHAPE_VIEW = frozenset({"reshape", "squeeze", "expand_dims"})
_INLINE = frozenset({
    "jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_TIED_HINT = ("a transposed kernel, as in a tied output projection "
              "(flax Embed.attend, x @ table.T)")


# ---------------------------------------------------------------------------
# Facts about a value.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Prov:
  """What the walk knows about one value of the jaxpr.

  Attributes:
    leaves: trainable parameter leaves the value depends on.
    direct: one leaf through ``_PASSTHROUGH`` ops only (a tag's operand).
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


_NONE = _Prov()
_BATCH = _Prov(batched=True)


def _ntrail(shape) -> int:
  """Number of axes after the leading size-1 axes."""
  shape = tuple(shape)
  while shape and shape[0] == 1:
    shape = shape[1:]
  return len(shape)


def _tail(shape, m: int) -> tuple:
  shape = tuple(shape)
  return shape[len(shape) - m:]


def _strip(shape) -> tuple:
  """``shape`` without its leading size-1 axes."""
  return _tail(shape, _ntrail(shape))


def _fits_features(p: _Prov, shape, feat, y_shape) -> bool:
  """Whether a view ``p`` (of ``shape``) adds one leaf entry per feature.

  True when the leaf, row-major, lies on the trailing axes ``feat`` of the
  output ``y_shape`` and is broadcast along every other axis, as a dense
  bias, a conv bias (channels last) or a normalisation scale/shift is.
  """
  if feat is None or p.view not in ("flat", "trail"):
    return False
  m = len(feat)
  return (len(shape) == len(y_shape) and _tail(y_shape, m) == tuple(feat)
          and _tail(shape, m) == tuple(feat)
          and math.prod(_tail(shape, p.trail)) == math.prod(feat))


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
    y_aval: the perturbed output's aval (per scan step).
    input_avals: avals of the recorded inputs (per scan step), laid out as
      the tag's inputs (a dense input flattened over its contracted axes).
    stack: index into ``scan_lengths`` of the scan that slices the stacked
      parameter leaves, or ``None``. That axis is the stack axis, not uses.
    found_by: ``"tag"`` or ``"auto"``.
    record: ``record(read) -> inputs`` for automatic sites (``read`` maps a
      jaxpr variable of the site's level to its value).
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

  @property
  def stack_shape(self) -> tuple:
    return tuple(self.scan_lengths)


@dataclasses.dataclass(frozen=True)
class LossSite:
  key: str
  spec: losses_lib.LossSpec


@dataclasses.dataclass
class _Draft:
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


@dataclasses.dataclass
class _Found:
  leaf_paths: tuple
  leaf_shapes: tuple
  auto: bool
  sites: dict = dataclasses.field(default_factory=dict)
  losses: list = dataclasses.field(default_factory=list)
  loss_facts: list = dataclasses.field(default_factory=list)
  unmatched: dict = dataclasses.field(default_factory=dict)
  rejected: dict = dataclasses.field(default_factory=dict)
  alias: dict = dataclasses.field(default_factory=dict)  # key -> (key, Site)

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


def _sub_jaxpr(eqn):
  """(Jaxpr, consts) for the inlinable higher-order primitives."""
  p = eqn.params
  j = p.get("jaxpr", p.get("call_jaxpr", p.get("fun_jaxpr")))
  if isinstance(j, jex_core.ClosedJaxpr):
    return j.jaxpr, j.consts
  return j, ()


def _has_tags(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive in (tags.layer_tag_p, tags.loss_tag_p):
      return True
    for sub in _eqn_subjaxprs(eqn):
      if _has_tags(sub):
        return True
  return False


def _eqn_subjaxprs(eqn):
  for v in eqn.params.values():
    vs = v if isinstance(v, (tuple, list)) else (v,)
    for x in vs:
      if isinstance(x, jex_core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jex_core.Jaxpr):
        yield x


def _tag_error(site_key, kind, idx, prov, leaf_paths):
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


def _aval(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _read_var(env, v):
  if isinstance(v, jex_core.Literal):
    return _NONE
  return env.get(v, _NONE)


def _chain_input(read, factors, shape, dtype):
  """The normalised input of a scale chain: the product of its factors."""
  x = None
  for v, op in factors:
    f = jnp.asarray(read(v))
    f = 1.0 / f if op == "div" else f
    x = f if x is None else x * f
  return jnp.broadcast_to(x, shape).astype(dtype)


# ---------------------------------------------------------------------------
# The walk.
# ---------------------------------------------------------------------------


class _Level:
  """Per-jaxpr state of the walk: facts, use counts, drafts."""

  def __init__(self, jaxpr, in_provs):
    self.env = dict(zip(jaxpr.invars, in_provs))
    self.uses = collections.Counter(
        v for eqn in jaxpr.eqns for v in eqn.invars
        if not isinstance(v, jex_core.Literal))
    self.uses.update(v for v in jaxpr.outvars
                     if not isinstance(v, jex_core.Literal))
    self.drafts = {}

  def read(self, v) -> _Prov:
    return _read_var(self.env, v)

  def sole_draft(self, v) -> Optional[_Draft]:
    """The draft whose output is ``v``, if ``v`` has no other consumer."""
    if isinstance(v, jex_core.Literal) or self.uses[v] != 1:
      return None
    return self.drafts.get(v)


class _Walker:
  """Walks a jaxpr (recursively), recording sites into a :class:`_Found`."""

  def __init__(self, found: _Found):
    self.found = found

  # ---- generic propagation ----------------------------------------------
  def _mix(self, ins, name, key, reason=None):
    """Facts of an output of an unrecognised op; consumes pending leaves."""
    pending = frozenset().union(*[p.pending for p in ins])
    if pending:
      self.found.note(pending, reason or (
          f"used by `{name}` at {key}, which is not part of a recognised "
          "layer"))
    leaves = frozenset().union(*[p.leaves for p in ins])
    raw = frozenset().union(*[p.raw for p in ins]) | pending
    sites = frozenset().union(*[p.sites for p in ins])
    batched = any(p.batched for p in ins)
    if not (leaves or raw or sites):
      return _BATCH if batched else _NONE
    first_op = next((p.op for p in ins if p.op), name)
    return _Prov(leaves=leaves, op=first_op, raw=raw, sites=sites,
                 batched=batched)

  def _view(self, eqn, p):
    """Facts of a view op's output whose operand is a parameter view."""
    name = eqn.primitive.name
    in_shape = tuple(eqn.invars[0].aval.shape)
    out_shape = tuple(eqn.outvars[0].aval.shape)
    direct = p.direct and name in _PASSTHROUGH
    view, trail = "", 0
    if name in _SAME_VIEW:
      view, trail = p.view, p.trail
    elif name in _RESHAPE_VIEW:
      if p.view == "flat":
        view, trail = "flat", _ntrail(out_shape)
    elif name == "broadcast_in_dim":
      k, dims, n = p.trail, tuple(eqn.params["broadcast_dimensions"]), len(
          out_shape)
      if p.view in ("flat", "trail") and (k == 0 or (
          dims[len(dims) - k:] == tuple(range(n - k, n))
          and in_shape[len(in_shape) - k:] == out_shape[n - k:])):
        flat = math.prod(out_shape) == math.prod(in_shape) and p.view == "flat"
        view, trail = ("flat", _ntrail(out_shape)) if flat else ("trail", k)
    elif name == "transpose":
      if p.view == "flat" and len(in_shape) == 2 and tuple(
          eqn.params["permutation"]) == (1, 0):
        view = "T"
    else:
      return None
    if not (direct or view):
      return None
    return dataclasses.replace(p, direct=direct, view=view, trail=trail,
                               op=p.op or ("" if direct else name))

  def _opaque(self, p, reason):
    """``p`` with any view forgotten (e.g. after a loop boundary)."""
    if not p.is_view:
      return p
    self.found.note(p.pending, reason)
    return _Prov(leaves=p.leaves, op=reason, raw=p.raw | p.pending,
                 sites=p.sites, batched=p.batched)

  def _base_shape(self, p) -> tuple:
    shape = tuple(self.found.leaf_shapes[p.leaf])
    return shape[1:] if p.stack is not None else shape

  # ---- the walk ----------------------------------------------------------
  def walk(self, jaxpr, in_provs, prefix, scan_lengths):
    lv = _Level(jaxpr, in_provs)
    for i, eqn in enumerate(jaxpr.eqns):
      key = f"{prefix}{i}"
      ins = [lv.read(v) for v in eqn.invars]
      outs = self._eqn(eqn, ins, key, lv, scan_lengths)
      for v, p in zip(eqn.outvars, outs):
        lv.env[v] = p
    for d in lv.drafts.values():
      self._emit(d, scan_lengths)
    return [lv.read(v) for v in jaxpr.outvars]

  def _eqn(self, eqn, ins, key, lv, scan_lengths):
    name = eqn.primitive.name
    if eqn.primitive is tags.layer_tag_p:
      return [self._layer_tag(eqn, ins, key, scan_lengths)]
    if eqn.primitive is tags.loss_tag_p:
      if scan_lengths:
        raise ValueError(
            f"A loss tag at {key} is inside lax.scan; register the loss on "
            "the stacked outputs after the loop instead.")
      meta = dict(eqn.params["meta"])
      self.found.losses.append(LossSite(key, losses_lib.make_loss_spec(
          eqn.params["kind"], meta, eqn.invars[0].aval.shape)))
      self.found.loss_facts.append(ins[0])
      return [ins[0]]
    if name in _INLINE:
      sub, _ = _sub_jaxpr(eqn)
      return self.walk(sub, ins, f"{key}/in/", scan_lengths)
    if name == "scan":
      return self._scan(eqn, ins, key, scan_lengths)
    if name == "cond":
      return self._cond(eqn, ins, key, scan_lengths)
    if name == "optimization_barrier":
      return list(ins)
    if self.found.auto:
      outs = _Matcher(self, eqn, ins, key, lv, scan_lengths).match()
      if outs is not None:
        return outs
    if len(ins) == 1 and ins[0].is_view:
      out = self._view(eqn, ins[0])
      if out is not None:
        return [out]
    subs = list(_eqn_subjaxprs(eqn))
    if any(_has_tags(s) for s in subs):
      raise ValueError(
          f"K-FAC tags inside `{name}` (at {key}) are not supported; move "
          "the tagged layer out of the loop, or use lax.scan instead of "
          "while_loop/fori_loop with dynamic bounds.")
    reason = None
    if subs:
      reason = (f"used inside `{name}` at {key}; layers inside this "
                "primitive are not recognised (use lax.scan or lax.cond)")
    return [self._mix(ins, name, key, reason)] * len(eqn.outvars)

  def _layer_tag(self, eqn, ins, key, scan_lengths):
    n_in, kind = eqn.params["n_inputs"], eqn.params["kind"]
    leaves, stacks = [], set()
    for j, p in enumerate(ins[1 + n_in:]):
      if not (p.direct and len(p.leaves) == 1):
        raise _tag_error(key, kind, j, p, self.found.leaf_paths)
      leaves.append(p.leaf)
      stacks.add(p.stack)
    if len(stacks) > 1:
      raise ValueError(
          f"The {kind} tag at {key} mixes parameters sliced by lax.scan "
          "(stacked layers) with whole parameters; stack all of a layer's "
          "parameters, or none.")
    y = ins[0]
    self.found.sites[key] = Site(
        key=key, kind=kind, meta=eqn.params["meta"], leaves=tuple(leaves),
        scan_lengths=tuple(scan_lengths), y_aval=eqn.invars[0].aval,
        input_avals=tuple(v.aval for v in eqn.invars[1:1 + n_in]),
        stack=stacks.pop() if stacks else None, found_by="tag",
        upstream=y.sites, raw_in=y.raw - frozenset(leaves))
    return _Prov(leaves=y.leaves | frozenset(leaves), sites=frozenset({key}),
                 batched=y.batched)

  def _scan(self, eqn, ins, key, scan_lengths):
    p = eqn.params
    nc, ncarry, length = p["num_consts"], p["num_carry"], p["length"]
    body = p["jaxpr"].jaxpr
    depth = len(scan_lengths)
    consts = list(ins[:nc])
    carry = [self._opaque(q, f"passed as a lax.scan carry at {key}")
             for q in ins[nc:nc + ncarry]]
    xs = [self._slice(q, v, depth, length, key)
          for q, v in zip(ins[nc + ncarry:], eqn.invars[nc + ncarry:])]
    inner = [*scan_lengths, length]
    # Whether the carry depends on the batch decides which uses are layers
    # (e.g. h @ w_h with h0 = 0): settle it first, recording nothing.
    scratch = _Walker(dataclasses.replace(
        self.found, sites={}, losses=[], loss_facts=[], unmatched={},
        rejected={}, alias={}))
    for _ in range(ncarry + 1):
      out = scratch.walk(body, consts + carry + xs, f"{key}/body/", inner)
      new = [dataclasses.replace(a, batched=a.batched or b.batched)
             for a, b in zip(carry, out[:ncarry])]
      if new == carry:
        break
      carry = new
    # Then record, iterating so facts flowing around the carry are seen.
    for _ in range(len(body.eqns) + 2):
      out = self.walk(body, consts + carry + xs, f"{key}/body/", inner)
      new = [self._union(a, self._opaque(b, f"lax.scan carry at {key}"))
             for a, b in zip(carry, out[:ncarry])]
      if new == carry:
        break
      carry = new
    return [self._opaque(q, f"returned by lax.scan at {key}") for q in out]

  def _slice(self, q, v, depth, length, key):
    """Facts of one step's slice of a scanned-over (``xs``) operand."""
    if not q.is_view:
      return dataclasses.replace(q, data="") if q.data else q
    shape = tuple(v.aval.shape)
    if (q.view == "flat" and q.stack is None and shape == tuple(
        self.found.leaf_shapes[q.leaf]) and shape and shape[0] == length):
      return _Prov(leaves=q.leaves, direct=q.direct, view="flat",
                   trail=_ntrail(shape[1:]), stack=depth)
    return self._opaque(
        q, f"sliced by lax.scan at {key} but not as a whole stacked leaf "
        f"(shape {shape}, scan length {length})")

  @staticmethod
  def _union(a: _Prov, b: _Prov) -> _Prov:
    if a == b:
      return a
    return _Prov(leaves=a.leaves | b.leaves, op=a.op or b.op,
                 raw=a.raw | b.raw | a.pending | b.pending,
                 sites=a.sites | b.sites, batched=a.batched or b.batched)

  def _cond(self, eqn, ins, key, scan_lengths):
    outs = [self.walk(br.jaxpr, ins[1:], f"{key}/branch{k}/", scan_lengths)
            for k, br in enumerate(eqn.params["branches"])]
    self._merge_branches(key, len(outs))
    index = ins[0]
    joined = []
    for ps in zip(*outs):
      p = ps[0]
      for q in ps[1:]:
        p = self._union(p, q)
      if index.sites or index.raw or index.batched:
        p = self._union(p, self._mix([index], "cond", key))
      joined.append(p)
    return joined

  def _merge_branches(self, key, n):
    """One site per layer use of a ``cond``: only one branch runs.

    The j-th site of a given signature (parameters, kind, shapes) in each
    branch become one site, keyed by the first; the others are its aliases.
    Each branch then records its own inputs into the shared slot instead of
    zeros for the branches that did not run.
    """
    slots = {}
    for k in range(n):
      prefix, seen = f"{key}/branch{k}/", collections.Counter()
      for site in [t for t in self.found.sites.values()
                   if t.key.startswith(prefix)]:
        sig = (site.leaves, site.kind, site.meta, site.found_by,
               site.scan_lengths, site.stack, site.y_aval.shape,
               site.y_aval.dtype,
               tuple((a.shape, a.dtype) for a in site.input_avals))
        j, seen[sig] = seen[sig], seen[sig] + 1
        first = slots.setdefault((sig, j), site.key)
        if first == site.key:
          continue
        del self.found.sites[site.key]
        self.found.alias[site.key] = (first, site)
        rep = self.found.sites[first]
        self.found.sites[first] = dataclasses.replace(
            rep, upstream=rep.upstream | site.upstream,
            raw_in=rep.raw_in | site.raw_in)

  # ---- sites -------------------------------------------------------------
  def _emit(self, d: _Draft, scan_lengths):
    record, input_avals = d.record, d.input_avals
    if d.factors is not None:
      if not d.batched:
        for leaf in d.leaves:
          self.found.rejected.setdefault(leaf, (
              f"scales a value that does not depend on the batch "
              f"(`mul` at {d.key})"))
        return
      y = d.y.aval
      record = functools.partial(_chain_input_record, factors=d.factors,
                                 shape=tuple(y.shape), dtype=y.dtype)
      input_avals = (_aval(y.shape, y.dtype),)
    self.found.sites[d.key] = Site(
        key=d.key, kind=d.kind, meta=d.meta, leaves=d.leaves,
        scan_lengths=tuple(scan_lengths), y_aval=d.y.aval,
        input_avals=input_avals, stack=d.stack, found_by="auto",
        record=record, upstream=d.upstream, raw_in=d.raw_in)


def _chain_input_record(read, *, factors, shape, dtype):
  return (_chain_input(read, factors, shape, dtype),)


def _site_out(d: _Draft) -> _Prov:
  return _Prov(leaves=d.dep_leaves, sites=frozenset({d.key}),
               batched=d.batched)


class _Matcher:
  """Recognises one equation as (part of) an untagged layer.

  ``match()`` returns the output facts when the equation starts, extends or
  rejects-with-a-reason a layer, or ``None`` to let the walk treat it as an
  ordinary op.
  """

  def __init__(self, walker, eqn, ins, key, lv, scan_lengths):
    self.w, self.eqn, self.ins, self.key, self.lv = walker, eqn, ins, key, lv
    self.scan_lengths = scan_lengths
    self.name = eqn.primitive.name

  def match(self):
    fn = {"dot_general": self._dot, "conv_general_dilated": self._conv,
          "gather": self._gather, "mul": self._mul, "div": self._div,
          "add": self._add, "add_any": self._add,
          "convert_element_type": self._convert, "iota": self._iota,
          "eq": self._eq}.get(self.name)
    return None if fn is None else fn()

  # ---- helpers -----------------------------------------------------------
  def _reject(self, reason):
    return [self.w._mix(self.ins, self.name, self.key,  # pylint: disable=protected-access
                        f"{reason} (`{self.name}` at {self.key})")]

  def _start(self, kind, p_w, x_prov, record, input_avals, meta, feat,
             factors=None, batched=True):
    y = self.eqn.outvars[0]
    d = _Draft(kind=kind, key=self.key, leaves=(p_w.leaf,), meta=meta, y=y,
               record=record, input_avals=input_avals, stack=p_w.stack,
               upstream=frozenset().union(*[p.sites for p in x_prov]),
               raw_in=frozenset().union(*[p.raw for p in x_prov]),
               dep_leaves=frozenset().union(*[p.leaves for p in x_prov])
               | p_w.leaves, feat=feat, factors=factors,
               batched=batched)
    self.lv.drafts[y] = d
    return [_site_out(d)]

  def _move(self, d: _Draft, **changes):
    """Moves draft ``d`` onto this equation's output."""
    del self.lv.drafts[d.y]
    y = self.eqn.outvars[0]
    d = dataclasses.replace(d, key=self.key, y=y, **changes)
    self.lv.drafts[y] = d
    return [_site_out(d)]

  @staticmethod
  def _input_problem(p_x):
    # An input may depend on the layer's own parameters through recognised
    # uses (RNN steps, a scan over stacked layers): each use is one site.
    if p_x.is_view:
      return "its input is itself a parameter"
    if not p_x.batched:
      return "its input does not depend on the batch"
    return None

  # ---- dense and one-hot embedding ---------------------------------------
  def _dot(self):
    (lc, rc), (lb, rb) = self.eqn.params["dimension_numbers"]
    p_x, p_w = self.ins
    x, w = self.eqn.invars
    if not p_w.is_view:
      if p_x.is_view:
        return self._reject(
            "the parameter is dot_general's left operand, so the output's "
            "feature axes are not trailing; write x @ w")
      return None
    if p_x.is_view:
      return self._reject("a product of two parameters is not a layer")
    problem = self._input_problem(p_x)
    if problem:
      return self._reject(f"dot_general is not a dense layer: {problem}")
    if lb or rb:
      return self._reject("dot_general with batch dimensions is not a dense "
                          "layer")
    nx, k = len(x.aval.shape), len(rc)
    trailing = tuple(lc) == tuple(range(nx - k, nx)) and nx > k
    if p_w.view == "flat" and trailing and tuple(rc) == tuple(range(k)):
      if p_x.data == "onehot" and k == 1 and len(w.aval.shape) == 2:
        return self._start(
            "embedding", p_w, [p_x],
            lambda read, x=x: (jnp.argmax(read(x), axis=-1).astype(
                jnp.int32),),
            (_aval(x.aval.shape[:-1], jnp.int32),), tags.layer_meta(
                approx=None), None)
      d_in = math.prod(w.aval.shape[:k])
      shape = tuple(x.aval.shape[:nx - k]) + (d_in,)
      # A kernel other than [d_in, d_out] (DenseGeneral, attention) says how
      # many of its leading axes are inputs; the block reshapes it to 2-D.
      base = self.w._base_shape(p_w)  # pylint: disable=protected-access
      in_axes = next((j for j in range(len(base) + 1)
                      if math.prod(base[:j]) == d_in), None)
      if in_axes is None:
        return self._reject(
            f"the kernel of shape {tuple(w.aval.shape)} is a reshape of the "
            f"parameter {base} that does not split it into input and output "
            "axes")
      meta = tags.layer_meta(approx=None) if (len(base) == 2 and in_axes == 1
                                              ) else tags.layer_meta(
                                                  approx=None,
                                                  kernel_in_axes=in_axes)
      return self._start(
          "fully_connected", p_w, [p_x],
          lambda read, x=x, shape=shape: (read(x).reshape(shape),),
          (_aval(shape, x.aval.dtype),), meta, tuple(w.aval.shape[k:]))
    transposed = (p_w.view == "T" and tuple(rc) == (0,)) or (
        p_w.view == "flat" and len(w.aval.shape) == 2 and tuple(rc) == (1,))
    if transposed and trailing:
      return self._reject(f"dot_general contracts the parameter on its last "
                          f"axis: {_TIED_HINT}")
    return self._reject(
        f"dot_general contracts kernel axes {tuple(rc)} with input axes "
        f"{tuple(lc)}; a dense layer contracts the input's trailing axes "
        "with the kernel's leading axes")

  # ---- convolution -------------------------------------------------------
  def _conv(self):
    p_x, p_w = self.ins
    x, w = self.eqn.invars
    prm = self.eqn.params
    if not p_w.is_view:
      return self._reject("the convolution's input is a parameter") if (
          p_x.is_view) else None
    if p_w.view != "flat" or tuple(w.aval.shape) != self.w._base_shape(p_w):  # pylint: disable=protected-access
      return self._reject("the conv kernel is not the parameter leaf itself "
                          "(it is reshaped or broadcast)")
    problem = self._input_problem(p_x)
    if problem:
      return self._reject(f"conv_general_dilated is not a layer: {problem}")
    if prm["batch_group_count"] != 1:
      return self._reject(
          f"batch_group_count={prm['batch_group_count']} has no block")
    dn = prm["dimension_numbers"]
    groups = int(prm["feature_group_count"])
    c_in = x.aval.shape[dn.lhs_spec[1]]
    if groups == 1:
      kind = "conv"
    elif groups == c_in:
      kind = "depthwise_conv"
    else:
      return self._reject(
          f"grouped convolution (feature_group_count={groups}, {c_in} input "
          "channels) has no block; only 1 (conv) or C_in (depthwise)")
    meta = tags.layer_meta(approx=None, **tags.conv_meta_kwargs(
        window_strides=prm["window_strides"], padding=prm["padding"],
        rhs_dilation=prm["rhs_dilation"], lhs_dilation=prm["lhs_dilation"],
        dimension_numbers=dn, feature_group_count=groups))
    y_shape = self.eqn.outvars[0].aval.shape
    feat = ((y_shape[-1],) if dn.out_spec[1] == len(y_shape) - 1 else None)
    return self._start(kind, p_w, [p_x], lambda read, x=x: (read(x),),
                       (_aval(x.aval.shape, x.aval.dtype),), meta, feat)

  # ---- gather embedding --------------------------------------------------
  def _gather(self):
    p_t, p_i = self.ins
    t, ids = self.eqn.invars
    if not p_t.is_view:
      return None
    dn, prm = self.eqn.params["dimension_numbers"], self.eqn.params
    out_nd = len(self.eqn.outvars[0].aval.shape)
    shape = tuple(t.aval.shape)
    row_lookup = (
        p_t.view == "flat" and shape == self.w._base_shape(p_t)  # pylint: disable=protected-access
        and len(shape) == 2 and tuple(dn.offset_dims) == (out_nd - 1,)
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and not tuple(dn.operand_batching_dims)
        and tuple(prm["slice_sizes"]) == (1, shape[1])
        and ids.aval.shape and ids.aval.shape[-1] == 1)
    if not row_lookup:
      return self._reject("gather does not look up whole rows of a 2-D "
                          "table by integer ids")
    problem = self._input_problem(p_i)
    if problem:
      return self._reject(f"gather is not an embedding: {problem}")
    return self._start(
        "embedding", p_t, [p_i], lambda read, ids=ids: (read(ids)[..., 0],),
        (_aval(ids.aval.shape[:-1], ids.aval.dtype),),
        tags.layer_meta(approx=None), None)

  # ---- scale-and-shift chains and biases ---------------------------------
  def _mul(self):
    (a, b), (pa, pb) = self.eqn.invars, self.ins
    y_shape = tuple(self.eqn.outvars[0].aval.shape)
    for (u, pu), (v, pv) in (((a, pa), (b, pb)), ((b, pb), (a, pa))):
      d = self.lv.sole_draft(u)
      if (d is not None and d.factors is not None and not pv.is_view
          and _tail(y_shape, len(d.feat)) == d.feat):
        return self._move(d, factors=d.factors + ((v, "mul"),),
                          raw_in=d.raw_in | pv.raw,
                          upstream=d.upstream | pv.sites,
                          dep_leaves=d.dep_leaves | pv.leaves,
                          batched=d.batched or pv.batched)
    for (s, ps), (x, px) in (((b, pb), (a, pa)), ((a, pa), (b, pb))):
      if not ps.is_view or px.is_view:
        continue
      feat = _strip(self.w._base_shape(ps))  # pylint: disable=protected-access
      if (len(y_shape) > len(feat)
          and _fits_features(ps, s.aval.shape, feat, y_shape)):
        # The record is built from the final factors when the site is
        # emitted (the chain may still grow).
        return self._start("scale_and_shift", ps, [px], None, (),
                           tags.layer_meta(approx=None), feat,
                           factors=((x, "mul"),), batched=px.batched)
    return None

  def _div(self):
    (a, b), (_, pb) = self.eqn.invars, self.ins
    d = self.lv.sole_draft(a)
    if d is None or d.factors is None or pb.is_view:
      return None
    return self._move(d, factors=d.factors + ((b, "div"),),
                      raw_in=d.raw_in | pb.raw, upstream=d.upstream | pb.sites,
                      dep_leaves=d.dep_leaves | pb.leaves,
                      batched=d.batched or pb.batched)

  def _convert(self):
    (x,), (px,) = self.eqn.invars, self.ins
    if px.data == "onehot":
      return [px]
    d = self.lv.sole_draft(x)
    return None if d is None else self._move(d)

  def _add(self):
    (a, b), (pa, pb) = self.eqn.invars, self.ins
    y_shape = tuple(self.eqn.outvars[0].aval.shape)
    for (u, _), (v, pv) in (((a, pa), (b, pb)), ((b, pb), (a, pa))):
      d = self.lv.sole_draft(u)
      if (d is None or len(d.leaves) != 1 or not pv.is_view
          or pv.leaf in d.leaves or pv.stack != d.stack
          or not _fits_features(pv, v.aval.shape, d.feat, y_shape)):
        continue
      if d.factors is not None and _strip(
          self.w._base_shape(pv)) != d.feat:  # pylint: disable=protected-access
        continue
      return self._move(d, leaves=d.leaves + (pv.leaf,), feat=None,
                        dep_leaves=d.dep_leaves | pv.leaves)
    return None

  # ---- one-hot encodings -------------------------------------------------
  def _iota(self):
    shape = self.eqn.params["shape"]
    if self.eqn.params["dimension"] == len(shape) - 1:
      return [_Prov(data="iota")]
    return None

  def _eq(self):
    (a, b), (pa, pb) = self.eqn.invars, self.ins
    for (u, pu), (_, pv) in (((a, pa), (b, pb)), ((b, pb), (a, pa))):
      if (pv.data == "iota" and pu.batched and not pu.leaves
          and u.aval.shape and u.aval.shape[-1] == 1
          and jnp.issubdtype(u.aval.dtype, jnp.integer)):
        return [_Prov(batched=True, sites=pu.sites, raw=pu.raw,
                      data="onehot")]
    return None


def _trace(loss_fn, params, batch, has_aux):
  closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(
      params, batch)
  if has_aux:
    if not (isinstance(out_shape, tuple) and len(out_shape) == 2):
      raise ValueError(
          "has_aux=True, but loss_fn does not return a (loss, aux) pair.")
    loss_shape = out_shape[0]
  else:
    loss_shape = out_shape
  if not hasattr(loss_shape, "shape") or loss_shape.shape != ():
    raise ValueError(
        f"loss_fn must return a scalar loss{' and aux' if has_aux else ''}; "
        f"got {jax.tree.map(lambda s: getattr(s, 'shape', s), out_shape)}. "
        "Set has_aux=True if it returns (loss, aux).")
  return closed, jax.tree.structure(out_shape)


def _trace_order(key: str) -> tuple:
  return tuple(int(p) if p.isdigit() else p for p in key.split("/"))


def find_sites(loss_fn, params, batch, has_aux=False, leaf_paths=None,
               trainable=(), auto_register=False):
  """Traces ``loss_fn`` once and returns its sites and loss sites.

  Args:
    loss_fn, params, batch, has_aux: as for :func:`scan`.
    leaf_paths: ``keystr`` of every parameter leaf (computed if ``None``).
    trainable: one bool per leaf; empty means all leaves are trainable.
    auto_register: also recognise untagged layers.

  Returns:
    ``(found, closed_jaxpr, out_treedef)``; ``found.sites`` is in trace
    order.
  """
  closed, out_tree = _trace(loss_fn, params, batch, has_aux)
  leaves = jax.tree.leaves(params)
  found = _Found(
      leaf_paths=leaf_paths or collection_lib.leaf_paths_of(params),
      leaf_shapes=tuple(tuple(getattr(x, "shape", ())) for x in leaves),
      auto=auto_register)
  in_provs = []
  for i, x in enumerate(leaves):
    if trainable and not trainable[i]:
      in_provs.append(_NONE)
    else:
      in_provs.append(_Prov(leaves=frozenset({i}), direct=True, view="flat",
                            trail=_ntrail(found.leaf_shapes[i])))
  in_provs += [_BATCH] * (len(closed.jaxpr.invars) - len(leaves))
  _Walker(found).walk(closed.jaxpr, in_provs, "", [])
  found.sites = dict(sorted(found.sites.items(),
                            key=lambda kv: _trace_order(kv[0])))
  return found, closed, out_tree


def _select(found: _Found):
  """Applies the soundness rules to the automatic sites.

  Returns:
    ``(sites, bad)``: the sites to use, in trace order, and
    ``{leaf: reason}`` for leaves that cannot be in an automatic layer.
  """
  sites = list(found.sites.values())
  tagged = {l for s in sites if s.found_by == "tag" for l in s.leaves}
  reach = set()
  frontier = [k for z in found.loss_facts for k in z.sites]
  while frontier:
    k = found.resolve(frontier.pop())
    if k in reach:
      continue
    reach.add(k)
    frontier.extend(found.sites[k].upstream)
  raw = frozenset().union(*[z.raw for z in found.loss_facts],
                          *[found.sites[k].raw_in for k in reach])
  bad = {l: r for l, r in found.rejected.items() if l not in tagged}
  for leaf in sorted(raw - tagged - set(bad)):
    bad[leaf] = found.unmatched.get(leaf, ["used outside a layer"])[0]
  kept = [s for s in sites if s.found_by == "tag" or (
      s.key in reach and not set(s.leaves) & tagged)]
  return kept, bad


# ---------------------------------------------------------------------------
# scan(): building the LayerCollection.
# ---------------------------------------------------------------------------


def _site_uses(site: Site) -> int:
  """Uses from one site: the non-stack scan steps x the kind's inner uses."""
  steps = [n for j, n in enumerate(site.scan_lengths) if j != site.stack]
  return int(math.prod(steps)) * blocks_lib.inner_uses(
      site.kind, tuple(a.shape for a in site.input_avals))


def _trainable_mask(params, params_filter, leaf_paths) -> tuple:
  """One bool per leaf from ``params_filter`` (see :func:`scan`)."""
  if params_filter is None:
    return ()
  if callable(params_filter):
    mask = tuple(bool(params_filter(p)) for p in leaf_paths)
  else:
    try:
      full = jax.tree.map(
          lambda m, sub: jax.tree.map(lambda _: bool(m), sub), params_filter,
          params)
    except (ValueError, TypeError) as e:
      raise ValueError(
          "params_filter must be a callable on the parameter path (as "
          "jax.tree_util.keystr prints it) or a pytree of bools whose "
          "structure is a prefix of params, e.g. {'params': True, "
          f"'batch_stats': False}}; got {params_filter!r}.") from e
    mask = tuple(jax.tree.leaves(full))
  if not any(mask):
    raise ValueError(
        f"params_filter={params_filter!r} selects no parameter leaf; it "
        f"must select the trainable ones among {list(leaf_paths[:4])}...")
  return mask


def _check_params(params, trainable):
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for i, (path, leaf) in enumerate(flat):
    if trainable and not trainable[i]:
      continue
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"params{jax.tree_util.keystr(path)} has dtype {dtype}; K-FAC "
          "needs floating-point parameters. Move integer or complex state "
          "out of the params pytree (pass it in the batch instead), or "
          "exclude it with params_filter.")


def _tag_layers(sites, leaf_paths):
  """Groups the tag sites into layers (the rules for manual tags)."""
  groups = {}   # leaves tuple -> list of sites
  owner = {}    # leaf -> leaves tuple
  for site in sites:
    if len(set(site.leaves)) != len(site.leaves):
      raise ValueError(
          f"The {site.kind} tag at {site.key} uses parameter "
          f"{leaf_paths[site.leaves[0]]} twice.")
    for leaf in site.leaves:
      prev = owner.get(leaf)
      if prev is not None and prev != site.leaves:
        raise ValueError(
            f"Parameter {leaf_paths[leaf]} is in two different layers: "
            f"{[leaf_paths[i] for i in prev]} and "
            f"{[leaf_paths[i] for i in site.leaves]}. A leaf may belong to "
            "one layer only; tag it with the same companions every time.")
      owner[leaf] = site.leaves
    groups.setdefault(site.leaves, []).append(site)
  for group, gsites in groups.items():
    names = [leaf_paths[i] for i in group]
    kinds = {s.kind for s in gsites}
    if len(kinds) > 1:
      raise ValueError(
          f"Parameters {names} are tagged as different layer kinds "
          f"{sorted(kinds)}; use one kind.")
    if len({s.stack is None for s in gsites}) > 1:
      raise ValueError(
          f"Parameters {names} are tagged both inside a lax.scan that "
          "slices them (a stacked layer) and as whole arrays; use one form.")
    approxes = {dict(s.meta).get("approx") for s in gsites} - {None}
    if len(approxes) > 1:
      raise ValueError(
          f"Parameters {names} are tagged with conflicting approx values "
          f"{sorted(approxes)}.")
  return groups


def _auto_layers(sites, leaf_paths, bad):
  """Groups automatic sites into layers; adds rejected leaves to ``bad``."""
  groups, by_leaf = {}, {}
  for s in sites:
    groups.setdefault(s.leaves, []).append(s)
    for leaf in s.leaves:
      by_leaf.setdefault(leaf, set()).add(s.leaves)
  good, rejected = {}, {}
  for group, gsites in groups.items():
    kinds = sorted({s.kind for s in gsites})
    what = (f"recognised as {' and '.join(kinds)} at "
            f"{', '.join(s.key for s in gsites[:3])}")
    others = sorted({g for l in group for g in by_leaf[l]} - {group})
    reason = next((f"{what}, but {bad[l]}" for l in group if l in bad), None)
    if reason is None and others:
      reason = (f"{what}, but its parameters also form a layer with other "
                "companions: " + "; ".join(
                    str([leaf_paths[i] for i in g]) + " at " +
                    ", ".join(s.key for s in groups[g][:3]) for g in others))
    elif reason is None and len(kinds) > 1:
      reason = f"{what}: a layer must be used as one kind"
    elif reason is None and len({s.stack is None for s in gsites}) > 1:
      reason = f"{what}, both sliced by lax.scan (stacked) and used whole"
    elif reason is None and len({s.meta for s in gsites}) > 1:
      reason = f"{what} with different settings (strides, padding, ...)"
    if reason is None:
      good[group] = gsites
    else:
      for leaf in group:
        rejected.setdefault(leaf, reason)
  bad.update(rejected)
  return good


def _make_layer(group, gsites, found_by, leaves, leaf_paths, approximations):
  kind = gsites[0].kind
  approxes = {dict(s.meta).get("approx") for s in gsites} - {None}
  uses = sum(_site_uses(s) for s in gsites)
  paths = tuple(leaf_paths[i] for i in group)
  stacked = gsites[0].stack is not None
  return collection_lib.Layer(
      name=collection_lib.layer_name(kind, paths), kind=kind,
      approx=collection_lib.resolve_approx(
          kind, uses, approxes.pop() if approxes else None, paths,
          approximations),
      param_paths=paths, param_indices=tuple(group),
      param_shapes=tuple(tuple(leaves[i].shape) for i in group),
      param_dtypes=tuple(str(leaves[i].dtype) for i in group),
      num_uses=uses, found_by=found_by,
      meta=tuple((k, v) for k, v in gsites[0].meta if k != "approx"),
      stack=int(leaves[group[0]].shape[0]) if stacked else 0)


def _leftover_reason(leaf, found, bad, auto_register) -> str:
  if not auto_register:
    return "no layer tag uses it (auto_register=False)"
  if leaf in bad:
    return bad[leaf]
  if leaf in found.unmatched:
    return (f"no use of it reaches a loss tag through a recognised layer "
            f"(first unrecognised use: {found.unmatched[leaf][0]}); if it is "
            "not trainable, exclude it with params_filter")
  if any(leaf in s.leaves for s in found.sites.values()):
    return "its layer's output does not reach a loss tag"
  return "loss_fn does not use it"


def scan(loss_fn: Callable, params, batch, *, has_aux: bool = False,
         auto_register: bool = True,
         approximations: Optional[Mapping[str, str]] = None,
         strict: bool = False,
         params_filter: Any = None) -> collection_lib.LayerCollection:
  """Traces ``loss_fn(params, batch)`` once and builds its LayerCollection.

  Every layer tag becomes (a use of) a layer; tags on the same parameters, or
  a tag inside ``lax.scan``, make one multi-use layer (Martens, Ba & Johnson
  2018). With ``auto_register=True`` untagged layers are recognised on the
  jaxpr:

  * dense: ``dot_general`` of an input contracted on its trailing axes with
    a kernel contracted on its leading axes, plus an optional bias ``add``
    (flax ``Dense``, ``DenseGeneral``, ``Einsum``-style attention
    projections). A kernel ``[*in_axes, *out_axes]`` is the matrix
    :math:`W \\in \\mathbb{R}^{d_{in} \\times d_{out}}` with
    :math:`d_{in} = \\prod \\text{in\\_axes}`; the input is recorded
    flattened to ``[..., d_in]``, and each position of ``[B, T, ..., d_in]``
    is one use;
  * conv: ``conv_general_dilated`` (1-, 2-, 3-D), with the metadata
    ``register_conv`` would store; ``feature_group_count == C_in`` is a
    ``depthwise_conv``;
  * embedding: a ``gather`` of whole rows of a 2-D table by integer ids
    (``jnp.take``, ``table[ids]``, flax ``Embed``), or a one-hot matrix
    (``jax.nn.one_hot``) times a table;
  * scale_and_shift: ``x̂ * scale (+ shift)`` where ``scale`` broadcasts
    along the trailing axes (LayerNorm, RMSNorm, BatchNorm); the recorded
    input is the product :math:`\\hat x` of the other factors;
  * stacked layers: a parameter leaf ``[L, ...]`` sliced by a ``lax.scan``
    (``nn.scan``) is one layer per slice (``Layer.stack == L``), whose
    block is ``vmap``-ped over the stack axis.

  Casts (``bf16`` compute on ``f32`` parameters), nested ``jit``,
  ``remat``, ``custom_jvp``/``custom_vjp`` and ``cond`` are looked through.
  Parameters left over become ``generic`` layers (one per leaf, naive
  diagonal by default), listed as fallbacks with the reason by
  ``describe()``; tied weights (an embedding table reused as ``x @
  table.T``) are one of them, as no block combines embedding and dense uses.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), the
      mean over the batch, with at least one loss tag.
    params: the parameter pytree (float leaves).
    batch: an example batch (any pytree).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    auto_register: recognise untagged layers. Manual tags always win.
    approximations: maps a layer kind (``"fully_connected"``, ...,
      ``"*_multi"``) or a parameter path prefix (``keystr`` form) to an
      approximation. Explicit ``approx=`` at the tag wins.
    strict: raise instead of falling back to generic layers.
    params_filter: which leaves are trainable, when ``params`` holds more
      than the parameters (e.g. flax ``variables`` with ``batch_stats``): a
      callable ``path -> bool`` on the ``keystr`` path (without nnx's
      ``.value``), or a pytree of bools whose structure is a prefix of
      ``params`` (``{"params": True, "batch_stats": False}``). Other leaves
      are treated as data: no layer, no block, and the estimator returns
      their vector entries unchanged.

  Returns:
    The immutable :class:`~kfac_jax_lite.collection.LayerCollection`.

  Raises:
    ValueError: no loss tag; a tag parameter computed from several leaves or
      from data; one leaf in two different tagged layers; an unknown
      approximation; a bad ``params_filter``; with ``strict=True``, any
      parameter that falls back to a generic block (naming its path and
      the reason).
    TypeError: non-float trainable parameters.

  Example:
    >>> collection = scan(loss_fn, params, batch)
    >>> print(collection.describe())
  """
  leaf_paths = collection_lib.leaf_paths_of(params)
  trainable = _trainable_mask(params, params_filter, leaf_paths)
  _check_params(params, trainable)
  collection_lib.validate_approximations(approximations, leaf_paths)
  found, _, _ = find_sites(loss_fn, params, batch, has_aux, leaf_paths,
                           trainable, auto_register)
  if not found.losses:
    raise ValueError(
        "loss_fn has no loss tag. Register the model's predictive "
        "distribution, e.g. register_categorical_predictive_distribution("
        "logits, labels), on the values the loss is computed from.")
  leaves = jax.tree.leaves(params)
  kept, bad = _select(found)
  groups = {g: ("tag", s) for g, s in _tag_layers(
      [s for s in kept if s.found_by == "tag"], leaf_paths).items()}
  groups.update({g: ("auto", s) for g, s in _auto_layers(
      [s for s in kept if s.found_by == "auto"], leaf_paths, bad).items()})
  order = sorted(groups, key=lambda g: _trace_order(groups[g][1][0].key))
  layers = [_make_layer(g, groups[g][1], groups[g][0], leaves, leaf_paths,
                        approximations) for g in order]
  owned = {i for g in groups for i in g}
  leftover = [i for i in range(len(leaf_paths))
              if i not in owned and not (trainable and not trainable[i])]
  reasons = {i: _leftover_reason(i, found, bad, auto_register)
             for i in leftover}
  if strict and leftover:
    raise ValueError(
        "strict=True, but these parameters have no layer structure: " +
        "; ".join(f"{leaf_paths[i]}: {reasons[i]}" for i in leftover) +
        ". Tag them with a register_* function, pass strict=False to use "
        "generic blocks, or exclude them with params_filter if they are not "
        "trainable.")
  for i in leftover:
    path, reason = leaf_paths[i], reasons[i]
    paths = (path,)
    layers.append(collection_lib.Layer(
        name=path, kind="generic",
        approx=collection_lib.resolve_approx("generic", 1, None, paths,
                                             approximations),
        param_paths=paths, param_indices=(i,),
        param_shapes=(tuple(leaves[i].shape),),
        param_dtypes=(str(leaves[i].dtype),), num_uses=1,
        found_by="leftover", note=f"generic block: {reason}"))
  names = [l.name for l in layers]
  if len(set(names)) != len(names):
    layers = [dataclasses.replace(l, name=f"{l.name}#{j}")
              for j, l in enumerate(layers)]
  return collection_lib.LayerCollection(
      layers=tuple(layers), losses=tuple(s.spec for s in found.losses),
      leaf_paths=leaf_paths, params_treedef=jax.tree.structure(params),
      loss_fn=loss_fn, has_aux=has_aux, trainable=trainable,
      leaf_shapes=found.leaf_shapes, auto_register=auto_register)


# ---------------------------------------------------------------------------
# Re-evaluation with perturbations at the sites.
# ---------------------------------------------------------------------------


def _zeros(aval):
  return jnp.zeros(aval.shape, aval.dtype)


def _bind(eqn, invals):
  """Re-binds an equation unchanged (the body of ``jax.core.eval_jaxpr``)."""
  bind_params = eqn.primitive.get_bind_params(eqn.params)
  ctx = getattr(eqn.ctx, "manager", None)
  if ctx is not None:
    with ctx:
      ans = eqn.primitive.bind(*invals, **bind_params)
  else:
    ans = eqn.primitive.bind(*invals, **bind_params)
  return ans if eqn.primitive.multiple_results else [ans]


class _Interpreter:
  """Evaluates a jaxpr, perturbing site outputs and recording inputs."""

  def __init__(self, eps: Mapping[str, Any], sites: Mapping[str, Site],
               sites_by_prefix: Mapping[str, list],
               slot: Mapping[str, str]):
    self.eps = eps
    self.sites = sites              # own key -> Site (merged ones included)
    self.sites_by_prefix = sites_by_prefix
    self.slot = slot                # own key -> key of eps and records
    self.layer_records = {}
    self.loss_records = {}

  def _under(self, prefix):
    return self.sites_by_prefix.get(prefix, [])

  def run(self, jaxpr, consts, args, prefix):
    env = {}

    def read(v):
      return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
      env[v] = c
    for v, a in zip(jaxpr.invars, args):
      env[v] = a
    for i, eqn in enumerate(jaxpr.eqns):
      key = f"{prefix}{i}"
      invals = [read(v) for v in eqn.invars]
      name = eqn.primitive.name
      slot = self.slot.get(key, key)
      if eqn.primitive is tags.layer_tag_p:
        n_in = eqn.params["n_inputs"]
        y = invals[0]
        if slot in self.eps:
          y = y + self.eps[slot].astype(y.dtype)
          self.layer_records[slot] = tuple(invals[1:1 + n_in])
        outs = [y]
      elif eqn.primitive is tags.loss_tag_p:
        self.loss_records[key] = tuple(invals)
        outs = [invals[0]]
      elif slot in self.eps:
        outs = _bind(eqn, invals)
        outs[0] = outs[0] + self.eps[slot].astype(outs[0].dtype)
        self.layer_records[slot] = self.sites[key].record(read)
      elif not self._under(f"{key}/"):
        outs = _bind(eqn, invals)
      elif name in _INLINE:
        sub, sub_consts = _sub_jaxpr(eqn)
        outs = self.run(sub, sub_consts, invals, f"{key}/in/")
      elif name == "scan":
        outs = self._scan(eqn, invals, key)
      elif name == "cond":
        outs = self._cond(eqn, invals, key)
      else:  # pragma: no cover - find_sites rejects these first.
        raise ValueError(f"Tags inside `{name}` are not supported.")
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
    return [read(v) for v in jaxpr.outvars]

  def _child(self, eps):
    return _Interpreter(eps, self.sites, self.sites_by_prefix, self.slot)

  def _scan(self, eqn, invals, key):
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    body = p["jaxpr"]
    inner = {s.key for s in self._under(f"{key}/body/")}
    eps = {k: self.eps[k] for k in inner if k in self.eps}

    def step(carry, scanned):
      xs_t, eps_t = scanned
      child = self._child(eps_t)
      outs = child.run(body.jaxpr, body.consts, [*consts, *carry, *xs_t],
                       f"{key}/body/")
      return outs[:ncarry], (outs[ncarry:], child.layer_records)

    carry, (ys, records) = lax.scan(
        step, list(init), (list(xs), eps), length=p["length"],
        reverse=p["reverse"], unroll=p["unroll"])
    self.layer_records.update(records)
    return [*carry, *ys]

  def _cond(self, eqn, invals, key):
    index, ops = invals[0], invals[1:]
    branches = eqn.params["branches"]
    inner = list({s.key: s for k in range(len(branches))
                  for s in self._under(f"{key}/branch{k}/")}.values())
    eps = {s.key: self.eps[s.key] for s in inner if s.key in self.eps}

    def make(k):
      def branch(ops, eps):
        child = self._child(eps)
        outs = child.run(branches[k].jaxpr, branches[k].consts, ops,
                         f"{key}/branch{k}/")
        recs = {s.key: child.layer_records.get(
            s.key, tuple(_zeros(a) for a in s.input_avals))
                for s in inner if s.key in eps}
        return outs, recs
      return branch

    outs, recs = lax.switch(index, [make(k) for k in range(len(branches))],
                            list(ops), eps)
    self.layer_records.update(recs)
    return outs


def _index_prefixes(sites, slot):
  """Maps every path prefix ``"a/b/"`` to the sites (slots) below it."""
  by_key = {s.key: s for s in sites}
  out = {}
  for own, key in slot.items():
    parts = own.split("/")
    for j in range(1, len(parts)):
      out.setdefault("/".join(parts[:j]) + "/", []).append(by_key[key])
  return out


@dataclasses.dataclass(frozen=True)
class Traced:
  """The result of tracing ``loss_fn`` at the current shapes.

  Attributes:
    fn: ``fn(params, eps) -> ((loss, zs), (aux, layer_inputs, targets))``
      where ``zs``/``targets`` are tuples over the loss tags and
      ``layer_inputs`` maps a site key to its recorded inputs (with leading
      scan axes).
    sites: the layer sites of the collection's layers, in trace order.
    loss_sites: the loss tag sites, in trace order.
    eps: zero perturbations keyed like the sites (leading scan axes).
  """
  fn: Callable
  sites: tuple
  loss_sites: tuple
  eps: dict


def _collection_sites(collection, kept):
  """The sites that belong to the collection's layers."""
  tagged = {l.param_indices for l in collection.layers if l.found_by == "tag"}
  auto = {(l.param_indices, l.kind) for l in collection.layers
          if l.found_by == "auto"}
  out = []
  for s in kept:
    if s.found_by == "tag":
      if s.leaves not in tagged:
        raise ValueError(
            f"The tag at {s.key} uses parameters "
            f"{[collection.leaf_paths[i] for i in s.leaves]}, which are not "
            "a tagged layer of the LayerCollection; scan() again for this "
            "loss_fn.")
      out.append(s)
    elif (s.leaves, s.kind) in auto:
      out.append(s)
  return tuple(out)


def perturbed_fn(collection: collection_lib.LayerCollection, params,
                 batch) -> Traced:
  """Traces ``collection.loss_fn`` at these shapes for one-pass statistics.

  Raises:
    ValueError: if the tags found now do not match the scanned collection.
  """
  collection.check_params(params)
  found, closed, out_tree = find_sites(
      collection.loss_fn, params, batch, collection.has_aux,
      collection.leaf_paths, collection.trainable, collection.auto_register)
  kept, _ = _select(found)
  sites = _collection_sites(collection, kept)
  if len(found.losses) != len(collection.losses):
    raise ValueError(
        f"loss_fn now has {len(found.losses)} loss tags; the collection was "
        f"scanned with {len(collection.losses)}. Scan again.")
  eps = {s.key: jnp.zeros(s.stack_shape + s.y_aval.shape, s.y_aval.dtype)
         for s in sites}
  # Sites merged across cond branches write into their first site's slot.
  slot = {s.key: s.key for s in sites}
  own = {s.key: s for s in sites}
  for k, (_, site) in found.alias.items():
    if found.resolve(k) in slot:
      slot[k], own[k] = found.resolve(k), site
  prefixes = _index_prefixes(sites, slot)
  has_aux = collection.has_aux

  def fn(params, eps):
    interp = _Interpreter(eps, own, prefixes, slot)
    args = [*jax.tree.leaves(params), *jax.tree.leaves(batch)]
    outs = interp.run(closed.jaxpr, closed.consts, args, "")
    out = jax.tree.unflatten(out_tree, outs)
    loss, aux = out if has_aux else (out, None)
    zs, targets = [], []
    for ls in found.losses:
      rec = interp.loss_records[ls.key]
      zs.append(rec[0])
      targets.append(rec[1] if len(rec) > 1 else None)
    return (loss, tuple(zs)), (aux, interp.layer_records, tuple(targets))

  return Traced(fn=fn, sites=sites, loss_sites=tuple(found.losses), eps=eps)
