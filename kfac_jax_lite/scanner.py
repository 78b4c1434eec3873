"""Finds layer and loss tags in a traced loss function; builds the collection.

Two jobs, both on the jaxpr of ``loss_fn(params, batch)``:

1. :func:`scan` walks the jaxpr at every nesting depth (``jit``,
   ``checkpoint``, ``custom_jvp``/``custom_vjp``, ``cond``, ``scan``), tracks
   which parameter leaf each value comes from (looking through
   ``convert_element_type``, ``reshape``, ``broadcast_in_dim``), and turns
   the tags into a :class:`~kfac_jax_lite.collection.LayerCollection`.

2. :func:`perturbed_fn` re-evaluates the jaxpr with a perturbation added to
   every tagged layer output and returns the layer inputs and the loss tags'
   operands. The derivative with respect to a zero perturbation is the loss
   gradient at the layer output, so a single ``jax.vjp`` gives the parameter
   gradient and every layer's output gradients (the sampled-Fisher
   cotangents run through the same residuals). Equations that contain no tag
   are re-bound unchanged; loops that contain tags are rebuilt with
   ``lax.scan`` / ``lax.switch`` so the perturbations become extra scanned
   inputs and the recorded activations extra scanned outputs.

This module and :mod:`kfac_jax_lite.tags` are the only ones that touch jaxpr
internals (``jax.extend.core``).
"""

from __future__ import annotations

import dataclasses
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

_PASSTHROUGH = frozenset({
    "convert_element_type", "reshape", "broadcast_in_dim", "copy", "copy_p",
    "squeeze", "expand_dims", "optimization_barrier"})
_INLINE = frozenset({
    "jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


# ---------------------------------------------------------------------------
# Provenance: which parameter leaves a value is derived from.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Prov:
  leaves: frozenset           # parameter leaf indices this value depends on
  direct: bool                # a leaf passed through casts/reshapes only
  op: str = ""                # the first non-passthrough op, for errors


def _join(provs, op):
  provs = [p for p in provs if p is not None]
  if not provs:
    return None
  leaves = frozenset().union(*[p.leaves for p in provs])
  if op in _PASSTHROUGH and len(provs) == 1 and provs[0].direct:
    return provs[0]
  first_op = next((p.op for p in provs if p.op), op)
  return _Prov(leaves, False, first_op)


@dataclasses.dataclass(frozen=True)
class Site:
  """One place in the jaxpr whose output is perturbed (a tag use).

  Attributes:
    key: the equation's path, e.g. ``"3/body/2"`` (unique, stable).
    kind: layer kind.
    meta: the tag's static metadata.
    leaves: parameter leaf indices of the tag's parameter operands.
    scan_lengths: lengths of the enclosing ``lax.scan`` loops, outermost
      first (each multiplies the use count).
    y_aval: the tagged output's aval (per scan step).
    input_avals: avals of the recorded inputs (per scan step).
  """
  key: str
  kind: str
  meta: tuple
  leaves: tuple
  scan_lengths: tuple
  y_aval: Any
  input_avals: tuple

  @property
  def stack_shape(self) -> tuple:
    return tuple(self.scan_lengths)


@dataclasses.dataclass(frozen=True)
class LossSite:
  key: str
  spec: losses_lib.LossSpec


@dataclasses.dataclass
class _Found:
  sites: list = dataclasses.field(default_factory=list)
  losses: list = dataclasses.field(default_factory=list)
  leaf_paths: tuple = ()


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


def _read_prov(env, v):
  if isinstance(v, jex_core.Literal):
    return None
  return env.get(v)


def _tag_error(site_key, kind, idx, prov, leaf_paths):
  what = f"parameter operand {idx} of the {kind} tag at {site_key}"
  if prov is None:
    return ValueError(
        f"The {what} does not come from a parameter leaf (it depends only on "
        "the batch or on constants). Pass the parameter array itself "
        "(optionally cast or reshaped) to the register_* function.")
  names = [leaf_paths[i] for i in sorted(prov.leaves)]
  return ValueError(
      f"The {what} is computed by `{prov.op}` from parameter leaves {names}; "
      "a tag's parameters must each be one parameter leaf (optionally cast "
      "or reshaped). Tag the leaf before combining it, or use "
      "register_generic for these parameters.")


def _walk(jaxpr, in_provs, prefix, scan_lengths, found: _Found):
  """Walks a jaxpr, recording tag sites; returns the outputs' provenance."""
  env = {}
  for v, p in zip(jaxpr.invars, in_provs):
    env[v] = p
  for i, eqn in enumerate(jaxpr.eqns):
    key = f"{prefix}{i}"
    name = eqn.primitive.name
    ins = [_read_prov(env, v) for v in eqn.invars]
    outs = None
    if eqn.primitive is tags.layer_tag_p:
      n_in = eqn.params["n_inputs"]
      kind = eqn.params["kind"]
      param_provs = ins[1 + n_in:]
      leaves = []
      for j, p in enumerate(param_provs):
        if p is None or not p.direct:
          raise _tag_error(key, kind, j, p, found.leaf_paths)
        (leaf,) = tuple(p.leaves)
        leaves.append(leaf)
      found.sites.append(Site(
          key=key, kind=kind, meta=eqn.params["meta"], leaves=tuple(leaves),
          scan_lengths=tuple(scan_lengths), y_aval=eqn.invars[0].aval,
          input_avals=tuple(v.aval for v in eqn.invars[1:1 + n_in])))
      outs = [ins[0]]
    elif eqn.primitive is tags.loss_tag_p:
      if scan_lengths:
        raise ValueError(
            f"A loss tag at {key} is inside lax.scan; register the loss on "
            "the stacked outputs after the loop instead.")
      meta = dict(eqn.params["meta"])
      found.losses.append(LossSite(key, losses_lib.make_loss_spec(
          eqn.params["kind"], meta, eqn.invars[0].aval.shape)))
      outs = [ins[0]]
    elif name in _INLINE:
      sub, _ = _sub_jaxpr(eqn)
      outs = _walk(sub, ins, f"{key}/in/", scan_lengths, found)
    elif name == "scan":
      body = eqn.params["jaxpr"].jaxpr
      nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
      body_in = list(ins[:nc])
      # Carries lose direct provenance (they are loop state).
      body_in += [None if p is None else _Prov(p.leaves, False, "scan carry")
                  for p in ins[nc:nc + ncarry]]
      # Scanned-over parameters are slices of a stacked leaf.
      body_in += [None if p is None else _Prov(p.leaves, False, "scan xs")
                  for p in ins[nc + ncarry:]]
      body_out = _walk(body, body_in, f"{key}/body/",
                       [*scan_lengths, eqn.params["length"]], found)
      outs = [None if p is None else _Prov(p.leaves, False, "scan")
              for p in body_out]
    elif name == "cond":
      branch_outs = []
      for k, br in enumerate(eqn.params["branches"]):
        branch_outs.append(_walk(br.jaxpr, ins[1:], f"{key}/branch{k}/",
                                 scan_lengths, found))
      outs = [_join(ps, "cond") for ps in zip(*branch_outs)]
    else:
      subs = list(_eqn_subjaxprs(eqn))
      if any(_has_tags(s) for s in subs):
        raise ValueError(
            f"K-FAC tags inside `{name}` (at {key}) are not supported; move "
            "the tagged layer out of the loop, or use lax.scan instead of "
            "while_loop/fori_loop with dynamic bounds.")
      outs = [_join(ins, name)] * len(eqn.outvars)
    for v, p in zip(eqn.outvars, outs):
      env[v] = p
  return [_read_prov(env, v) for v in jaxpr.outvars]


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


def find_sites(loss_fn, params, batch, has_aux=False, leaf_paths=None):
  """Traces ``loss_fn`` once and returns its tag sites and loss sites.

  Returns:
    ``(found, closed_jaxpr, out_treedef)``.
  """
  closed, out_tree = _trace(loss_fn, params, batch, has_aux)
  n_params = len(jax.tree.leaves(params))
  found = _Found(leaf_paths=leaf_paths or collection_lib.leaf_paths_of(
      params))
  in_provs = [_Prov(frozenset({i}), True) for i in range(n_params)]
  in_provs += [None] * (len(closed.jaxpr.invars) - n_params)
  _walk(closed.jaxpr, in_provs, "", [], found)
  return found, closed, out_tree


# ---------------------------------------------------------------------------
# scan(): building the LayerCollection.
# ---------------------------------------------------------------------------


def _site_uses(site: Site) -> int:
  """Uses contributed by one site: scan steps x the kind's inner uses."""
  uses = int(math.prod(site.scan_lengths)) if site.scan_lengths else 1
  return uses * blocks_lib.inner_uses(
      site.kind, tuple(a.shape for a in site.input_avals))


def _check_params(params):
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"params{jax.tree_util.keystr(path)} has dtype {dtype}; K-FAC "
          "needs floating-point parameters. Move integer or complex state "
          "out of the params pytree (pass it in the batch instead).")


def scan(loss_fn: Callable, params, batch, *, has_aux: bool = False,
         auto_register: bool = True,
         approximations: Optional[Mapping[str, str]] = None,
         strict: bool = False) -> collection_lib.LayerCollection:
  """Traces ``loss_fn(params, batch)`` once and builds its LayerCollection.

  Every layer tag becomes (a use of) a layer; tags on the same parameters, or
  a tag inside ``lax.scan``, make one multi-use layer (Martens, Ba & Johnson
  2018). Parameters without a tag become ``generic`` layers (one per leaf,
  naive diagonal by default) and are listed as fallbacks by ``describe()``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), the
      mean over the batch, with at least one loss tag.
    params: the parameter pytree (float leaves).
    batch: an example batch (any pytree).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    auto_register: recognise untagged layers (dense, conv, embedding, ...).
      Recognition of untagged code is not implemented yet: leftover
      parameters become generic layers and are listed by ``describe()``.
    approximations: maps a layer kind (``"fully_connected"``, ...,
      ``"*_multi"``) or a parameter path prefix (``keystr`` form) to an
      approximation. Explicit ``approx=`` at the tag wins.
    strict: raise instead of falling back to generic layers.

  Returns:
    The immutable :class:`~kfac_jax_lite.collection.LayerCollection`.

  Raises:
    ValueError: no loss tag; a tag parameter computed from several leaves or
      from data; one leaf in two different layers; an unknown approximation;
      with ``strict=True``, any leftover parameter.
    TypeError: non-float parameters.

  Example:
    >>> collection = scan(loss_fn, params, batch)
    >>> print(collection.describe())
  """
  _check_params(params)
  leaf_paths = collection_lib.leaf_paths_of(params)
  collection_lib.validate_approximations(approximations, leaf_paths)
  found, _, _ = find_sites(loss_fn, params, batch, has_aux, leaf_paths)
  if not found.losses:
    raise ValueError(
        "loss_fn has no loss tag. Register the model's predictive "
        "distribution, e.g. register_categorical_predictive_distribution("
        "logits, labels), on the values the loss is computed from.")
  leaves = jax.tree.leaves(params)
  groups = {}   # leaves tuple -> list of sites
  owner = {}    # leaf -> leaves tuple
  for site in found.sites:
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
  layers = []
  for group, sites in groups.items():
    kinds = {s.kind for s in sites}
    if len(kinds) > 1:
      raise ValueError(
          f"Parameters {[leaf_paths[i] for i in group]} are tagged as "
          f"different layer kinds {sorted(kinds)}; use one kind.")
    kind = sites[0].kind
    approxes = {dict(s.meta).get("approx") for s in sites} - {None}
    if len(approxes) > 1:
      raise ValueError(
          f"Parameters {[leaf_paths[i] for i in group]} are tagged with "
          f"conflicting approx values {sorted(approxes)}.")
    explicit = approxes.pop() if approxes else None
    uses = sum(_site_uses(s) for s in sites)
    paths = tuple(leaf_paths[i] for i in group)
    layers.append(collection_lib.Layer(
        name=collection_lib.layer_name(kind, paths), kind=kind,
        approx=collection_lib.resolve_approx(kind, uses, explicit, paths,
                                             approximations),
        param_paths=paths, param_indices=tuple(group),
        param_shapes=tuple(tuple(leaves[i].shape) for i in group),
        param_dtypes=tuple(str(leaves[i].dtype) for i in group),
        num_uses=uses, found_by="tag",
        meta=tuple((k, v) for k, v in sites[0].meta if k != "approx")))
  fallbacks = []
  for i, path in enumerate(leaf_paths):
    if i in owner:
      continue
    reason = ("no layer tag uses it" +
              ("" if not auto_register else
               " and automatic recognition found no layer for it"))
    if strict:
      raise ValueError(
          f"Parameter {path} has no layer structure ({reason}); with "
          "strict=True every parameter must belong to a layer. Tag it with "
          "a register_* function, or pass strict=False to use a generic "
          "block.")
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
      loss_fn=loss_fn, has_aux=has_aux, fallbacks=tuple(fallbacks))


# ---------------------------------------------------------------------------
# Re-evaluation with perturbations at the tagged outputs.
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
  """Evaluates a jaxpr, perturbing tagged outputs and recording inputs."""

  def __init__(self, eps: Mapping[str, Any], site_keys: frozenset,
               sites_by_prefix: Mapping[str, list]):
    self.eps = eps
    self.site_keys = site_keys
    self.sites_by_prefix = sites_by_prefix
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
      if eqn.primitive is tags.layer_tag_p:
        n_in = eqn.params["n_inputs"]
        y = invals[0]
        if key in self.eps:
          y = y + self.eps[key].astype(y.dtype)
          self.layer_records[key] = tuple(invals[1:1 + n_in])
        outs = [y]
      elif eqn.primitive is tags.loss_tag_p:
        self.loss_records[key] = tuple(invals)
        outs = [invals[0]]
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
    return _Interpreter(eps, self.site_keys, self.sites_by_prefix)

  def _scan(self, eqn, invals, key):
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    body = p["jaxpr"]
    inner = [s.key for s in self._under(f"{key}/body/")]
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
    inner = [s for k in range(len(branches))
             for s in self._under(f"{key}/branch{k}/")]
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


def _index_prefixes(sites):
  """Maps every path prefix ``"a/b/"`` to the sites below it."""
  out = {}
  for s in sites:
    parts = s.key.split("/")
    for j in range(1, len(parts)):
      out.setdefault("/".join(parts[:j]) + "/", []).append(s)
  return out


@dataclasses.dataclass(frozen=True)
class Traced:
  """The result of tracing ``loss_fn`` at the current shapes.

  Attributes:
    fn: ``fn(params, eps) -> ((loss, zs), (aux, layer_inputs, targets))``
      where ``zs``/``targets`` are tuples over the loss tags and
      ``layer_inputs`` maps a site key to its recorded inputs (with leading
      scan axes).
    sites: the layer tag sites, in trace order.
    loss_sites: the loss tag sites, in trace order.
    eps: zero perturbations keyed like the sites (leading scan axes).
  """
  fn: Callable
  sites: tuple
  loss_sites: tuple
  eps: dict


def perturbed_fn(collection: collection_lib.LayerCollection, params,
                 batch) -> Traced:
  """Traces ``collection.loss_fn`` at these shapes for one-pass statistics.

  Raises:
    ValueError: if the tags found now do not match the scanned collection.
  """
  collection.check_params(params)
  found, closed, out_tree = find_sites(
      collection.loss_fn, params, batch, collection.has_aux,
      collection.leaf_paths)
  known = {l.param_indices for l in collection.layers}
  for s in found.sites:
    if s.leaves not in known:
      raise ValueError(
          f"The tag at {s.key} uses parameters "
          f"{[collection.leaf_paths[i] for i in s.leaves]}, which are not a "
          "layer of the LayerCollection; scan() again for this loss_fn.")
  if len(found.losses) != len(collection.losses):
    raise ValueError(
        f"loss_fn now has {len(found.losses)} loss tags; the collection was "
        f"scanned with {len(collection.losses)}. Scan again.")
  sites = tuple(found.sites)
  eps = {s.key: jnp.zeros(s.stack_shape + s.y_aval.shape, s.y_aval.dtype)
         for s in sites}
  prefixes = _index_prefixes(sites)
  keys = frozenset(eps)
  has_aux = collection.has_aux

  def fn(params, eps):
    interp = _Interpreter(eps, keys, prefixes)
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
