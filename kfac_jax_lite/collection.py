"""The immutable LayerCollection: layers, losses and their approximations.

A :class:`LayerCollection` is what :func:`kfac_jax_lite.scan` returns. It
holds static descriptions only (no arrays): which parameter leaves form each
layer, the layer kind, the chosen curvature approximation, how many times the
layer is used, and the registered losses. It is hashable, so it can be
closed over by jitted functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import jax

from kfac_jax_lite import kinds
from kfac_jax_lite.layer import Layer  # Also kfac_jax_lite.collection.Layer.

# Allowed approximations per layer kind and multi-use kind ("conv_multi"),
# the default first; derived from the registry (kfac_jax_lite.kinds).
APPROXIMATIONS = kinds.APPROXIMATIONS
"""The approximations of each layer kind, the default first (read-only).

Keys are the kinds (``"fully_connected"``, ``"conv"``, ...) and their
multi-use variants (``"fully_connected_multi"``, ...), for a layer used
more than once per example; values are tuples of approximation names.
Derived from the registry in :mod:`kfac_jax_lite.kinds`.

Example:
  >>> kl.APPROXIMATIONS["conv"]
  ('kron', 'diagonal', 'kron_sua', 'ekfac', 'kron_reduce')
  >>> "kron_series_1" in kl.APPROXIMATIONS["fully_connected_multi"]
  True
"""
approximation_key = kinds.approximation_key


def resolve_approx(kind: str, num_uses: int, explicit: Optional[str],
                   param_paths: tuple,
                   approximations: Optional[Mapping[str, str]]) -> str:
  """Explicit ``approx`` > path prefix in ``approximations`` > kind > default.

  For a multi-use layer the ``"<kind>_multi"`` key comes before the
  ``"<kind>"`` key, which applies when the layer has its approximation
  (``{"fully_connected": "kron_reduce"}`` reaches every dense layer).

  Raises:
    ValueError: for an approximation the layer kind does not support.
  """
  key = approximation_key(kind, num_uses)
  allowed = APPROXIMATIONS[key]
  source = "approx"
  chosen = explicit
  if chosen is None and approximations:
    # Longest matching parameter-path prefix wins over a kind key.
    best = None
    for k in approximations:
      if k in APPROXIMATIONS:
        continue
      if any(p.startswith(k) for p in param_paths):
        if best is None or len(k) > len(best):
          best = k
    if best is not None:
      chosen, source = approximations[best], f"approximations[{best!r}]"
    elif key in approximations:
      chosen, source = approximations[key], f"approximations[{key!r}]"
    elif kind in approximations and (num_uses == 1 or kinds.canonical(
        kind, num_uses, approximations[kind]) in allowed):
      # A kind key reaches multi-use layers too when they have its value.
      chosen, source = approximations[kind], f"approximations[{kind!r}]"
  if chosen is None:
    return allowed[0]
  chosen = kinds.canonical(kind, num_uses, chosen)
  if chosen not in allowed:
    raise ValueError(
        f"{source}={chosen!r} is not an approximation for a {key!r} layer "
        f"with parameters {list(param_paths)}; choose one of {list(allowed)}.")
  return chosen


def validate_approximations(approximations: Optional[Mapping[str, str]],
                            leaf_paths: tuple) -> None:
  """Checks that every key of ``approximations`` names a kind or a path."""
  if approximations is None:
    return
  if not isinstance(approximations, Mapping):
    raise TypeError(
        "approximations must be a dict mapping a layer kind or a parameter "
        f"path prefix to an approximation; got {type(approximations)}.")
  for k, v in approximations.items():
    if k in APPROXIMATIONS:
      if v not in APPROXIMATIONS[k] and kinds.MULTI_ALIASES.get(
          v) not in APPROXIMATIONS[k]:
        raise ValueError(
            f"approximations[{k!r}]={v!r} is unknown; choose one of "
            f"{list(APPROXIMATIONS[k])}.")
    elif not any(p.startswith(k) for p in leaf_paths):
      raise ValueError(
          f"approximations key {k!r} is neither a layer kind "
          f"({sorted(APPROXIMATIONS)}) nor a prefix of a parameter path; "
          f"paths look like {list(leaf_paths[:3])}.")


@dataclasses.dataclass(frozen=True)
class LayerCollection:
  """Layers and losses found in a loss function (immutable, hashable).

  Attributes:
    layers: tuple of :class:`Layer`.
    losses: tuple of :class:`~kfac_jax_lite.losses.LossSpec`.
    leaf_paths: ``keystr`` of every parameter leaf, in flatten order.
    params_treedef: the parameters' tree structure.
    loss_fn: the scanned function ``loss_fn(params, batch)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    fallbacks: extra notes for ``describe()``.
    trainable: one bool per leaf (the ``params_filter`` of ``scan``); empty
      means every leaf is trainable. Leaves that are not trainable belong to
      no layer; the estimator leaves their vector entries unchanged.
    leaf_shapes: the shape of every leaf, in flatten order.
    auto_register: whether ``scan`` recognised untagged layers (the
      estimator re-traces with the same setting).
    batch_treedef: the tree structure of the batch ``scan`` traced with
      (named in the error when a later batch does not fit ``loss_fn``).

  Example:
    >>> collection = kl.scan(loss_fn, params, batch)
    >>> print(collection.describe())
    >>> [(l.name, l.kind, l.approx) for l in collection.layers]
    >>> collection.check_registration(params)
  """
  layers: tuple
  losses: tuple
  leaf_paths: tuple
  params_treedef: Any
  loss_fn: Callable = dataclasses.field(compare=False, repr=False)
  has_aux: bool = False
  fallbacks: tuple = ()
  trainable: tuple = ()
  leaf_shapes: tuple = ()
  auto_register: bool = False
  batch_treedef: Any = dataclasses.field(default=None, compare=False,
                                         repr=False)

  def is_trainable(self, index: int) -> bool:
    """Whether leaf ``index`` is trainable (``scan``'s ``params_filter``).

    Args:
      index: a leaf's position in flatten order.

    Returns:
      True when the leaf is optimised (and may belong to a layer).
    """
    return not self.trainable or self.trainable[index]

  @property
  def registered_variables(self) -> tuple:
    """The registered parameter paths, in layer order."""
    return tuple(p for layer in self.layers for p in layer.param_paths)

  def layer(self, name: str) -> Layer:
    """The layer called ``name``.

    Args:
      name: a :attr:`Layer.name`, as ``describe()`` prints it.

    Returns:
      The :class:`Layer`.

    Raises:
      KeyError: if no layer has that name (the message lists them).
    """
    for layer in self.layers:
      if layer.name == name:
        return layer
    raise KeyError(f"No layer named {name!r}; layers are "
                   f"{[l.name for l in self.layers]}.")

  def check_registration(self, params) -> None:
    """Raises ``ValueError`` listing unregistered or doubly registered leaves.

    Args:
      params: a parameter pytree (e.g. the one that will be optimised).

    Raises:
      ValueError: listing every leaf that is unregistered, registered in
        several layers, or registered but not in ``params``.
    """
    paths = leaf_paths_of(params)
    if len(paths) == len(self.leaf_paths):
      paths = [p for i, p in enumerate(paths) if self.is_trainable(i)]
    counts = {}
    for p in self.registered_variables:
      counts[p] = counts.get(p, 0) + 1
    errors = []
    for p in paths:
      if p not in counts:
        errors.append(f"parameter {p} is not registered in any layer")
    for p, c in counts.items():
      if c > 1:
        errors.append(f"parameter {p} is registered in {c} layers")
      if p not in paths:
        errors.append(f"registered parameter {p} is not in params")
    if errors:
      raise ValueError(
          "check_registration(params): " + "; ".join(errors) +
          ". Tag every parameter exactly once (or let scan() register "
          "leftovers as generic layers).")

  def check_params(self, params, argname: str = "params") -> None:
    """Raises ``ValueError`` if ``params`` differ in structure from the scan.

    Leaves are compared by normalised path, so a flax ``nnx.State`` of
    ``Param`` variables and its ``nnx.as_pure`` arrays both match.

    Args:
      params: the pytree to check.
      argname: its name in the error message.

    Raises:
      ValueError: naming missing and unexpected leaves.
    """
    if jax.tree.structure(params) == self.params_treedef:
      self._check_shapes(jax.tree.leaves(params), argname)
      return
    paths = leaf_paths_of(params)
    if paths != self.leaf_paths:
      missing = sorted(set(self.leaf_paths) - set(paths))[:3]
      extra = sorted(set(paths) - set(self.leaf_paths))[:3]
      raise ValueError(
          f"{argname} does not match the parameters the LayerCollection was "
          f"scanned with (missing {missing}, unexpected {extra}, "
          f"{len(paths)} vs {len(self.leaf_paths)} leaves). Pass the same "
          "parameter pytree that was given to scan(), or scan again.")
    self._check_shapes(jax.tree.leaves(params), argname)

  def _check_shapes(self, leaves, argname: str) -> None:
    """Each trainable leaf has the shape it was scanned with."""
    if not self.leaf_shapes:
      return
    for i, (leaf, want) in enumerate(zip(leaves, self.leaf_shapes)):
      got = tuple(getattr(leaf, "shape", ()))
      if got != tuple(want) and self.is_trainable(i):
        owner = [l.name for l in self.layers if i in l.param_indices]
        raise ValueError(
            f"{argname}{self.leaf_paths[i]} has shape {got}, but the "
            f"LayerCollection was scanned with {tuple(want)} (layer "
            f"{owner[0] if owner else '?'!r}): the collection belongs to "
            "another model. Scan this model's parameters: "
            "kfac_jax_lite.scan(loss_fn, params, batch).")

  def describe(self) -> str:
    """A human-readable table of layers, approximations and fallbacks.

    Returns:
      One line per layer (name, kind, approximation, parameter shapes,
      uses, found by tag or auto), the losses, the parameter count and,
      under "fallbacks", every parameter left to a generic block and why.
    """
    rows = [("layer", "kind", "approx", "shapes", "uses", "found by")]
    for l in self.layers:
      shapes = " ".join("x".join(map(str, s)) or "()" for s in l.param_shapes)
      uses = str(l.num_uses) + (f" (stack of {l.stack})" if l.stack else "")
      rows.append((l.name, l.kind, l.approx, shapes, uses, l.found_by))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("losses: " + ", ".join(
        f"{s.kind}(weight={s.weight:g}, shape={s.shape})"
        for s in self.losses))
    num = sum(l.num_params for l in self.layers)
    lines.append(f"parameters: {num} in {len(self.layers)} layers")
    frozen = [p for i, p in enumerate(self.leaf_paths)
              if not self.is_trainable(i)]
    if frozen:
      lines.append(f"not trainable (params_filter), no block: {len(frozen)} "
                   f"leaves, e.g. {frozen[0]}")
    notes = [f"  {l.name}: {l.note}" for l in self.layers if l.note]
    notes += [f"  {f}" for f in self.fallbacks]
    if notes:
      lines.append("fallbacks:")
      lines.extend(notes)
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.describe()


def leaf_paths_of(params) -> tuple:
  """``keystr`` of each leaf, with flax nnx ``.value`` suffixes removed."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return tuple(normalize_path(jax.tree_util.keystr(p)) for p, _ in flat)


def normalize_path(path: str) -> str:
  for suffix in (".value", ".raw_value"):
    if path.endswith(suffix):
      return path[: -len(suffix)]
  return path


def layer_name(kind: str, paths: Sequence[str]) -> str:
  """A readable layer name: the common prefix of its parameter paths."""
  if not paths:
    return kind
  prefix = paths[0]
  for p in paths[1:]:
    i = 0
    while i < min(len(prefix), len(p)) and prefix[i] == p[i]:
      i += 1
    prefix = prefix[:i]
  if len(paths) > 1:
    # Cut at the last complete key.
    cut = max(prefix.rfind("]"), prefix.rfind("."))
    if cut < 0:  # No common key, e.g. ['w1'] and ['b1'].
      return " + ".join(paths)
    prefix = prefix[: cut + 1]
  return prefix or paths[0]


