"""``scan()``: from sites to layers, approximations and fallbacks."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from kfac_jax_lite import collection as collection_lib
from kfac_jax_lite import kinds as kinds_lib
from kfac_jax_lite.scanner.facts import Site
from kfac_jax_lite.scanner.walk import find_sites
from kfac_jax_lite.scanner.walk import select
from kfac_jax_lite.scanner.walk import trace_order


def _site_uses(site: Site) -> int:
  """Uses from one site: the non-stack scan steps x the kind's inner uses."""
  steps = [n for j, n in enumerate(site.scan_lengths) if j != site.stack]
  return int(math.prod(steps)) * kinds_lib.inner_uses(
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
    approxes = {a for s in gsites
                if (a := dict(s.meta).get("approx")) is not None}
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
    elif (reason is None and len(kinds) > 1 and
          kinds_lib.joined_kind(kinds) is None):
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
  kinds = sorted({s.kind for s in gsites})
  kind = kinds_lib.joined_kind(kinds) or kinds[0]
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


def _generic_layer(i, leaves, leaf_paths, reason, approximations):
  """The fallback layer of leaf ``i``, with the reason as its note."""
  paths = (leaf_paths[i],)
  return collection_lib.Layer(
      name=paths[0], kind="generic",
      approx=collection_lib.resolve_approx("generic", 1, None, paths,
                                           approximations),
      param_paths=paths, param_indices=(i,),
      param_shapes=(tuple(leaves[i].shape),),
      param_dtypes=(str(leaves[i].dtype),), num_uses=1,
      found_by="leftover", note=f"generic block: {reason}")


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

  * dense: ``dot_general`` of a batched input with a kernel, in either
    operand order and any contraction layout, plus an optional bias
    ``add`` (flax ``Dense``, ``DenseGeneral``, ``Einsum``-style attention
    projections; Equinox's ``Linear``, ``weight @ x`` per example under
    ``vmap``; ``x @ w.T``; ``einsum("oi,...i->...o", w, x)``). A kernel
    ``[*in_axes, *out_axes]`` is the matrix :math:`W \\in
    \\mathbb{R}^{d_{in} \\times d_{out}}` with :math:`d_{in} = \\prod
    \\text{in\\_axes}`; a kernel in another order (``[d_out, d_in]``) is
    read through ``kernel_perm`` in the layer's metadata, so its curvature
    is that of the same layer written ``x @ W``. The input is recorded
    flattened to ``[..., d_in]`` and the output gradient as ``[...,
    d_out]``; each position of ``[B, T, ..., d_in]`` is one use. ``W_1 x_1
    + W_2 x_2 + b`` (an LSTM step) gives ``b`` to the first layer;
  * conv: ``conv_general_dilated`` (1-, 2-, 3-D), with the metadata
    ``register_conv`` would store, and a bias on the channel axis wherever
    it is (``[c_out]`` channels last, Equinox's ``[c_out, 1, 1]``);
    ``feature_group_count == C_in`` is a ``depthwise_conv`` (kernel
    ``[*spatial, 1, C·M]`` in the rhs layout);
  * embedding: a ``gather`` of whole rows of a 2-D table by integer ids
    (``jnp.take``, ``table[ids]``, flax ``Embed``, Equinox's ``Embedding``
    under ``vmap``), or a one-hot matrix
    (``jax.nn.one_hot``) times a table;
  * tied_embedding: such a table also used as a transposed kernel, ``x @
    table.T`` (flax ``Embed.attend``): one multi-use layer whose lookups are
    ``embedding`` sites and whose projections are ``tied_embedding`` sites
    (:mod:`kfac_jax_lite.blocks.tied`). ``x @ w.T`` on a parameter that is
    not looked up is a dense layer;
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
  ``describe()`` (e.g. grouped convolutions with ``1 < feature_group_count
  < C_in``).

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
    >>> collection = scan(loss_fn, params, batch,
    ...                   params_filter={"params": True,
    ...                                  "batch_stats": False})
    >>> print(collection.describe())

  References:
    Martens & Grosse (2015), sec. 3 (dense layers, eq. 1-3); Grosse &
    Martens (2016), "A Kronecker-factored approximate Fisher matrix for
    convolution layers" (KFC); Martens, Ba & Johnson (2018), "Kronecker-
    factored curvature approximations for recurrent neural networks"
    (multi-use layers, sec. 3).
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
  kept, bad = select(found)
  groups = {g: ("tag", s) for g, s in _tag_layers(
      [s for s in kept if s.found_by == "tag"], leaf_paths).items()}
  groups.update({g: ("auto", s) for g, s in _auto_layers(
      [s for s in kept if s.found_by == "auto"], leaf_paths, bad).items()})
  order = sorted(groups, key=lambda g: trace_order(groups[g][1][0].key))
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
  layers += [_generic_layer(i, leaves, leaf_paths, reasons[i], approximations)
             for i in leftover]
  names = [l.name for l in layers]
  if len(set(names)) != len(names):
    layers = [dataclasses.replace(l, name=f"{l.name}#{j}")
              for j, l in enumerate(layers)]
  return collection_lib.LayerCollection(
      layers=tuple(layers), losses=tuple(s.spec for s in found.losses),
      leaf_paths=leaf_paths, params_treedef=jax.tree.structure(params),
      loss_fn=loss_fn, has_aux=has_aux, trainable=trainable,
      leaf_shapes=found.leaf_shapes, auto_register=auto_register,
      batch_treedef=jax.tree.structure(batch))


