"""Re-evaluating a jaxpr with perturbations at the sites (one-pass stats)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
from jax import lax
import jax.numpy as jnp
from jax.extend import core as jex_core

from kfac_jax_lite import collection as collection_lib
from kfac_jax_lite import tags
from kfac_jax_lite.scanner import forms
from kfac_jax_lite.scanner.facts import Site
from kfac_jax_lite.scanner.walk import find_sites
from kfac_jax_lite.scanner.walk import select


def _zeros(aval):
  return jnp.zeros(aval.shape, aval.dtype)


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
        outs = forms.bind(eqn, invals)
        eps = self.sites[key].perturbation(self.eps[slot])
        outs[0] = outs[0] + eps.astype(outs[0].dtype)
        record = self.sites[key].record
        assert record is not None  # an automatic site (tags are above)
        self.layer_records[slot] = record(read)
      elif not self._under(f"{key}/"):
        outs = forms.bind(eqn, invals)
      elif name in forms.INLINE:
        sub, sub_consts = forms.inline_body(eqn)
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
    form = forms.scan_form(eqn)
    nc, ncarry = form.num_consts, form.num_carry
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    inner = {s.key for s in self._under(f"{key}/body/")}
    eps = {k: self.eps[k] for k in inner if k in self.eps}

    def step(carry, scanned):
      xs_t, eps_t = scanned
      child = self._child(eps_t)
      outs = child.run(form.body, form.body_consts, [*consts, *carry, *xs_t],
                       f"{key}/body/")
      return outs[:ncarry], (outs[ncarry:], child.layer_records)

    carry, (ys, records) = lax.scan(
        step, list(init), (list(xs), eps), length=form.length,
        reverse=form.reverse, unroll=form.unroll)
    self.layer_records.update(records)
    return [*carry, *ys]

  def _cond(self, eqn, invals, key):
    index, ops = invals[0], invals[1:]
    branches = forms.cond_branches(eqn)
    inner = list({s.key: s for k in range(len(branches))
                  for s in self._under(f"{key}/branch{k}/")}.values())
    eps = {s.key: self.eps[s.key] for s in inner if s.key in self.eps}

    def make(k):
      def branch(ops, eps):
        child = self._child(eps)
        jaxpr, consts = branches[k]
        outs = child.run(jaxpr, consts, ops, f"{key}/branch{k}/")
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
    fn: ``fn(params, eps) -> ((loss, zs), (aux, layer_inputs, targets,
      masks))`` where ``zs``/``targets``/``masks`` are tuples over the loss
      tags (None for a tag without targets or mask) and
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
    elif (s.leaves, s.kind) in auto or (s.leaves, "tied_embedding") in auto:
      out.append(s)   # A tied embedding's lookups are "embedding" sites.
  return tuple(out)


def perturbed_fn(collection: collection_lib.LayerCollection, params,
                 batch) -> Traced:
  """Traces ``collection.loss_fn`` at these shapes for one-pass statistics.

  Raises:
    ValueError: if the tags found now do not match the scanned collection.
  """
  collection.check_params(params)
  try:
    found, closed, out_tree = find_sites(
        collection.loss_fn, params, batch, collection.has_aux,
        collection.leaf_paths, collection.trainable, collection.auto_register)
  except Exception as e:  # pylint: disable=broad-except
    want = collection.batch_treedef
    if want is None or jax.tree.structure(batch) == want:
      raise
    # The user's own error, with what K-FAC knows: the batch changed form.
    raise ValueError(
        f"batch=... has structure {jax.tree.structure(batch)}, but scan() "
        f"traced loss_fn with a batch of structure {want}, and loss_fn "
        f"fails on it ({type(e).__name__}: {e}). Pass update() the batch "
        "loss_fn takes (the same pytree as given to scan()).") from e
  kept, _ = select(found)
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
    zs, targets, masks = [], [], []
    for ls in found.losses:
      rec = list(interp.loss_records[ls.key])
      zs.append(rec.pop(0))
      targets.append(rec.pop(0) if ls.spec.has_targets else None)
      masks.append(rec.pop(0) if ls.spec.has_mask else None)
    return (loss, tuple(zs)), (aux, interp.layer_records, tuple(targets),
                               tuple(masks))

  return Traced(fn=fn, sites=sites, loss_sites=tuple(found.losses), eps=eps)

