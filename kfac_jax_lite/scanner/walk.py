"""The recursive walk over a jaxpr: facts, sites, soundness rules."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Optional

import jax
from jax.extend import core as jex_core

from kfac_jax_lite import collection as collection_lib
from kfac_jax_lite import custom_losses
from kfac_jax_lite import tags
from kfac_jax_lite.scanner import forms
from kfac_jax_lite.scanner.facts import aval
from kfac_jax_lite.scanner.facts import BATCH
from kfac_jax_lite.scanner.facts import chain_input_record
from kfac_jax_lite.scanner.facts import Draft
from kfac_jax_lite.scanner.facts import eqn_subjaxprs
from kfac_jax_lite.scanner.facts import Found
from kfac_jax_lite.scanner.facts import has_tags
from kfac_jax_lite.scanner.facts import LossSite
from kfac_jax_lite.scanner.facts import NONE
from kfac_jax_lite.scanner.facts import ntrail
from kfac_jax_lite.scanner.facts import PASSTHROUGH
from kfac_jax_lite.scanner.facts import Prov
from kfac_jax_lite.scanner.facts import read_var
from kfac_jax_lite.scanner.facts import RESHAPE_VIEW
from kfac_jax_lite.scanner.facts import retype_sites
from kfac_jax_lite.scanner.facts import SAME_VIEW
from kfac_jax_lite.scanner.facts import Site
from kfac_jax_lite.scanner.facts import tag_error
from kfac_jax_lite.scanner.match import Matcher


class Level:
  """Per-jaxpr state of the walk: facts, use counts, drafts."""

  def __init__(self, jaxpr, in_provs):
    self.env = dict(zip(jaxpr.invars, in_provs))
    self.uses = collections.Counter(
        v for eqn in jaxpr.eqns for v in eqn.invars
        if not isinstance(v, jex_core.Literal))
    self.uses.update(v for v in jaxpr.outvars
                     if not isinstance(v, jex_core.Literal))
    self.drafts = {}

  def read(self, v) -> Prov:
    return read_var(self.env, v)

  def sole_draft(self, v) -> Optional[Draft]:
    """The draft whose output is ``v``, if ``v`` has no other consumer."""
    if isinstance(v, jex_core.Literal) or self.uses[v] != 1:
      return None
    return self.drafts.get(v)


class Walker:
  """Walks a jaxpr (recursively), recording sites into a :class:`Found`."""

  def __init__(self, found: Found):
    self.found = found

  # ---- generic propagation ----------------------------------------------
  def mix(self, ins, name, key, reason=None):
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
      return BATCH if batched else NONE
    first_op = next((p.op for p in ins if p.op), name)
    return Prov(leaves=leaves, op=first_op, raw=raw, sites=sites,
                batched=batched)

  def _view(self, eqn, p):
    """Facts of a view op's output whose operand is a parameter view."""
    name = eqn.primitive.name
    in_shape = tuple(eqn.invars[0].aval.shape)
    out_shape = tuple(eqn.outvars[0].aval.shape)
    direct = p.direct and name in PASSTHROUGH
    view, trail = "", 0
    if name in SAME_VIEW:
      view, trail = p.view, p.trail
    elif name in RESHAPE_VIEW:
      if p.view == "flat":
        view, trail = "flat", ntrail(out_shape)
    elif name == "broadcast_in_dim":
      k, dims, n = p.trail, tuple(eqn.params["broadcast_dimensions"]), len(
          out_shape)
      if p.view in ("flat", "trail") and (k == 0 or (
          dims[len(dims) - k:] == tuple(range(n - k, n))
          and in_shape[len(in_shape) - k:] == out_shape[n - k:])):
        flat = math.prod(out_shape) == math.prod(in_shape) and p.view == "flat"
        view, trail = ("flat", ntrail(out_shape)) if flat else ("trail", k)
      elif (p.view == "flat" and math.prod(out_shape) == math.prod(in_shape)
            and list(dims) == sorted(dims)):
        # Only unit axes inserted (b[:, None]): a reshape.
        view, trail = "flat", ntrail(out_shape)
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
    return Prov(leaves=p.leaves, op=reason, raw=p.raw | p.pending,
                sites=p.sites, batched=p.batched)

  def base_shape(self, p) -> tuple:
    shape = tuple(self.found.leaf_shapes[p.leaf])
    return shape[1:] if p.stack is not None else shape

  # ---- the walk ----------------------------------------------------------
  def walk(self, jaxpr, in_provs, prefix, scan_lengths):
    lv = Level(jaxpr, in_provs)
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
      self.found.losses.append(LossSite(key, custom_losses.make_loss_spec(
          eqn.params["kind"], meta, eqn.invars[0].aval.shape)))
      self.found.loss_facts.append(ins[0])
      return [ins[0]]
    if name in forms.INLINE:
      sub, _ = forms.inline_body(eqn)
      return self.walk(sub, ins, f"{key}/in/", scan_lengths)
    if name == "scan":
      return self._scan(eqn, ins, key, scan_lengths)
    if name == "cond":
      return self._cond(eqn, ins, key, scan_lengths)
    if name == "optimization_barrier":
      return list(ins)
    if self.found.auto:
      outs = Matcher(self, eqn, ins, key, lv, scan_lengths).match()
      if outs is not None:
        return outs
    if len(ins) == 1 and ins[0].is_view:
      out = self._view(eqn, ins[0])
      if out is not None:
        return [out]
    subs = list(eqn_subjaxprs(eqn))
    if any(has_tags(s) for s in subs):
      raise ValueError(
          f"K-FAC tags inside `{name}` (at {key}) are not supported; move "
          "the tagged layer out of the loop, or use lax.scan instead of "
          "while_loop/fori_loop with dynamic bounds.")
    reason = None
    if subs:
      reason = (f"used inside `{name}` at {key}; layers inside this "
                "primitive are not recognised (use lax.scan or lax.cond)")
    return [self.mix(ins, name, key, reason)] * len(eqn.outvars)

  def _layer_tag(self, eqn, ins, key, scan_lengths):
    n_in, kind = eqn.params["n_inputs"], eqn.params["kind"]
    leaves, stacks = [], set()
    for j, p in enumerate(ins[1 + n_in:]):
      if not (p.direct and len(p.leaves) == 1):
        raise tag_error(key, kind, j, p, self.found.leaf_paths)
      leaves.append(p.leaf)
      stacks.add(p.stack)
    if len(stacks) > 1:
      raise ValueError(
          f"The {kind} tag at {key} mixes parameters sliced by lax.scan "
          "(stacked layers) with whole parameters; stack all of a layer's "
          "parameters, or none.")
    y = ins[0]
    self._check_output_depends(key, kind, leaves, y)
    self.found.sites[key] = Site(
        key=key, kind=kind, meta=eqn.params["meta"], leaves=tuple(leaves),
        scan_lengths=tuple(scan_lengths), y_aval=eqn.invars[0].aval,
        input_avals=tuple(v.aval for v in eqn.invars[1:1 + n_in]),
        stack=stacks.pop() if stacks else None, found_by="tag",
        upstream=y.sites, raw_in=y.raw - frozenset(leaves))
    return Prov(leaves=y.leaves | frozenset(leaves), sites=frozenset({key}),
                batched=y.batched)

  def _check_output_depends(self, key, kind, leaves, y):
    """A tag's output must be computed from each of its parameters: the
    walk's provenance of ``y`` (exact, from the jaxpr) names every leaf it
    depends on. A generic tag's "output" is its first parameter."""
    if kind == "generic":
      return
    missing = [self.found.leaf_paths[i] for i in leaves
               if i not in y.leaves]
    if missing:
      raise ValueError(
          f"The {kind} tag at {key}: its output y does not depend on "
          f"parameter {missing[0]} (y depends on "
          f"{sorted(self.found.leaf_paths[i] for i in y.leaves)}); a tag "
          "describes y = layer(x, params), so the curvature of another "
          "value would be estimated. Pass the value computed from these "
          "parameters as y (e.g. register_dense(x @ w + b, x, w, b)).")

  def _scan(self, eqn, ins, key, scan_lengths):
    form = forms.scan_form(eqn)
    nc, ncarry, length, body = (form.num_consts, form.num_carry, form.length,
                                form.body)
    depth = len(scan_lengths)
    consts = list(ins[:nc])
    carry = [self._opaque(q, f"passed as a lax.scan carry at {key}")
             for q in ins[nc:nc + ncarry]]
    xs = [self._slice(q, v, depth, length, key)
          for q, v in zip(ins[nc + ncarry:], eqn.invars[nc + ncarry:])]
    inner = [*scan_lengths, length]
    # Whether the carry depends on the batch decides which uses are layers
    # (e.g. h @ w_h with h0 = 0): settle it first, recording nothing.
    scratch = Walker(dataclasses.replace(
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
      return Prov(leaves=q.leaves, direct=q.direct, view="flat",
                  trail=ntrail(shape[1:]), stack=depth)
    return self._opaque(
        q, f"sliced by lax.scan at {key} but not as a whole stacked leaf "
        f"(shape {shape}, scan length {length})")

  @staticmethod
  def _union(a: Prov, b: Prov) -> Prov:
    if a == b:
      return a
    return Prov(leaves=a.leaves | b.leaves, op=a.op or b.op,
                raw=a.raw | b.raw | a.pending | b.pending,
                sites=a.sites | b.sites, batched=a.batched or b.batched)

  def _cond(self, eqn, ins, key, scan_lengths):
    outs = [self.walk(br, ins[1:], f"{key}/branch{k}/", scan_lengths)
            for k, (br, _) in enumerate(forms.cond_branches(eqn))]
    self._merge_branches(key, len(outs))
    index = ins[0]
    joined = []
    for ps in zip(*outs):
      p = ps[0]
      for q in ps[1:]:
        p = self._union(p, q)
      if index.sites or index.raw or index.batched:
        p = self._union(p, self.mix([index], "cond", key))
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
  def _emit(self, d: Draft, scan_lengths):
    record, input_avals = d.record, d.input_avals
    if d.factors is not None:
      if not d.batched:
        for leaf in d.leaves:
          self.found.rejected.setdefault(leaf, (
              f"scales a value that does not depend on the batch "
              f"(`mul` at {d.key})"))
        return
      y = d.y.aval
      record = functools.partial(chain_input_record, factors=d.factors,
                                 shape=tuple(y.shape), dtype=y.dtype)
      input_avals = (aval(y.shape, y.dtype),)
    y_aval = d.y.aval if d.canon is None else aval(d.canon, d.y.aval.dtype)
    self.found.sites[d.key] = Site(
        key=d.key, kind=d.kind, meta=d.meta, leaves=d.leaves,
        scan_lengths=tuple(scan_lengths), y_aval=y_aval,
        input_avals=input_avals, stack=d.stack, found_by="auto",
        record=record, upstream=d.upstream, raw_in=d.raw_in,
        to_out=d.to_out())


def trace(loss_fn, params, batch, has_aux):
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


def trace_order(key: str) -> tuple:
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
  closed, out_tree = trace(loss_fn, params, batch, has_aux)
  leaves = jax.tree.leaves(params)
  found = Found(
      leaf_paths=leaf_paths or collection_lib.leaf_paths_of(params),
      leaf_shapes=tuple(tuple(getattr(x, "shape", ())) for x in leaves),
      auto=auto_register)
  in_provs = []
  for i, _x in enumerate(leaves):
    if trainable and not trainable[i]:
      in_provs.append(NONE)
    else:
      in_provs.append(Prov(leaves=frozenset({i}), direct=True, view="flat",
                           trail=ntrail(found.leaf_shapes[i])))
  in_provs += [BATCH] * (len(closed.jaxpr.invars) - len(leaves))
  Walker(found).walk(closed.jaxpr, in_provs, "", [])
  found.sites = dict(sorted(found.sites.items(),
                            key=lambda kv: trace_order(kv[0])))
  return found, closed, out_tree


def select(found: Found):
  """Applies the soundness rules to the automatic sites.

  Returns:
    ``(sites, bad)``: the sites to use, in trace order, and
    ``{leaf: reason}`` for leaves that cannot be in an automatic layer.
  """
  sites = retype_sites(list(found.sites.values()), found.rejected)
  tagged = {l for s in sites if s.found_by == "tag" for l in s.leaves}
  reach = set()
  frontier = [k for z in found.loss_facts for k in z.sites]
  while frontier:
    k = found.resolve(frontier.pop())
    if k in reach or k not in found.sites:  # Not emitted: see Walker._emit.
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


