"""Where the curvature lives: a placement plan over a mesh axis.

With ``mesh=`` and ``curvature_axis=`` (:func:`kfac_jax_lite.scale_by_kfac`
and the transforms built on it) each layer's curvature block (its
Kronecker factors, their EMA weight and the cached damped powers or
eigenbases) lives on exactly one device of the axis: the *owner*. A
:class:`Plan` says which: whole blocks are assigned to devices by greedy
longest-processing-time first on their bytes, so every device holds about
``1/R`` of the curvature,

.. math::
  \\max_r \\sum_{\\ell:\\,o(\\ell)=r} s_\\ell
  \\le \\frac{1}{R}\\sum_\\ell s_\\ell + \\max_\\ell s_\\ell ,

(Graham 1969: within 4/3 of the best split), where ``s_ℓ`` is block
``ℓ``'s bytes. Its refresh (``d³`` per factor) and its products run on its
owner; only the preconditioned gradient block moves
(:mod:`kfac_jax_lite.sharded`). The plan is the one place that knows the
layout: the sharded estimator packs and unpacks each device's blocks with
it, and :meth:`Plan.describe` prints it.

References:
  Shi et al. (2023), "A Distributed Data-Parallel PyTorch Implementation of
  the Distributed Shampoo Optimizer", arXiv:2309.06497 (preconditioners
  partitioned across workers, search directions all-gathered);
  Graham (1969), "Bounds on multiprocessing timing anomalies", SIAM J.
  Appl. Math. 17(2) (the LPT bound).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Optional, Sequence

import jax
import jax.core  # jax.core.Tracer
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import distributed


def axis_names(curvature_axis) -> tuple:
  """``curvature_axis`` as a tuple of mesh axis names."""
  if isinstance(curvature_axis, (tuple, list)):
    return tuple(curvature_axis)
  return (curvature_axis,)


def check_mesh(mesh, curvature_axis, axis_name=None) -> tuple:
  """Validates ``mesh=`` and ``curvature_axis=``; returns the axis names.

  Raises:
    ValueError: ``curvature_axis`` without ``mesh`` (or the reverse), a
      name not among the mesh's axes, a repeated name, or ``axis_name``
      given too (each message names the argument, its value and the fix).
    TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
  """
  if mesh is None:
    if curvature_axis is not None:
      raise ValueError(
          f"curvature_axis={curvature_axis!r} needs mesh=... (the "
          "jax.sharding.Mesh whose axis it names); pass mesh=, or drop "
          "curvature_axis to keep the curvature replicated.")
    return ()
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
        f"mesh={mesh!r} is a {type(mesh).__name__}; pass a "
        "jax.sharding.Mesh, e.g. Mesh(np.array(jax.devices()), ('data',)).")
  if curvature_axis is None:
    raise ValueError(
        f"mesh= is given without curvature_axis=; name the mesh axis "
        f"(one of {list(mesh.axis_names)}) to spread the curvature over.")
  names = axis_names(curvature_axis)
  for n in names:
    if n not in mesh.axis_names:
      raise ValueError(
          f"curvature_axis={curvature_axis!r}: {n!r} is not an axis of the "
          f"mesh, whose axes are {list(mesh.axis_names)}; pass one of them "
          "(or a tuple of them).")
  if len(set(names)) != len(names):
    raise ValueError(
        f"curvature_axis={curvature_axis!r} names an axis twice; name each "
        "mesh axis once.")
  if axis_name is not None:
    raise ValueError(
        f"axis_name={axis_name!r} is given with mesh=: axis_name is for "
        "K-FAC inside pmap/shard_map, mesh= for jax.jit over a mesh (the "
        "batch sharded, the curvature spread by the plan); pass one.")
  return names


def _is_spec(x) -> bool:
  return isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec))


def check_param_shardings(param_shardings, names) -> None:
  """Validates ``param_shardings=`` (``names``: :func:`check_mesh`'s).

  Raises:
    ValueError: ``param_shardings`` without ``mesh``.
    TypeError: a leaf that is not a ``jax.sharding.Sharding`` or a
      ``PartitionSpec``.
  """
  if param_shardings is None:
    return
  if not names:
    raise ValueError(
        "param_shardings=... is given without mesh= and curvature_axis=; "
        "it says how the preconditioned update leaves the curvature's "
        "owners: pass mesh= and curvature_axis= too, or drop it.")
  for path, x in jax.tree_util.tree_flatten_with_path(
      param_shardings, is_leaf=_is_spec)[0]:
    if not _is_spec(x):
      raise TypeError(
          f"param_shardings{jax.tree_util.keystr(path)}={x!r} is a "
          f"{type(x).__name__}; pass a pytree like params of shardings "
          "(or PartitionSpecs of mesh=), e.g. "
          "jax.tree.map(lambda x: x.sharding, params).")


def param_layout(mesh, param_shardings, tree):
  """``param_shardings`` as a pytree of ``NamedSharding`` over ``mesh``
  (``PartitionSpec`` leaves completed with it), checked against the
  structure of ``tree`` (params-shaped).

  Raises:
    ValueError: the structures differ.
  """
  leaves, treedef = jax.tree.flatten(param_shardings, is_leaf=_is_spec)
  want = jax.tree.structure(tree)
  if treedef != want:
    raise ValueError(
        f"param_shardings= has the structure {treedef}, but the parameters "
        f"(and their updates) have {want}; pass one sharding per parameter "
        "leaf, e.g. "
        "jax.tree.map(lambda x: x.sharding, params).")
  return jax.tree.unflatten(treedef, [
      x if isinstance(x, jax.sharding.Sharding) else
      jax.sharding.NamedSharding(mesh, x) for x in leaves])


def check_devices(mesh, params) -> None:
  """Concrete ``params`` lie on the mesh's devices.

  Traced parameters (under ``jit``) carry no devices; JAX itself then
  rejects arrays on other devices.

  Raises:
    ValueError: a parameter lies on a device outside ``mesh``.
  """
  want = set(mesh.devices.flat)
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.core.Tracer) or sharding is None:
      continue
    got = set(sharding.device_set)
    if not got <= want:
      raise ValueError(
          f"params{jax.tree_util.keystr(path)} lies on devices "
          f"{sorted(d.id for d in got)}, but mesh= has devices "
          f"{sorted(d.id for d in want)}; build the mesh over the "
          "parameters' devices, or device_put the parameters onto it.")


@dataclasses.dataclass(frozen=True)
class Unit:
  """One layer's curvature block, placed whole."""
  layer: int          # its index in the collection
  name: str           # the layer's name
  nbytes: int         # the bytes of its state (factors and caches)
  flops: float        # the rough cost of its refresh (d³ per factor)


def block_units(estimator) -> tuple:
  """A :class:`Unit` per layer of ``estimator`` (shapes only, no arrays)."""
  out = []
  for i, (layer, block) in enumerate(zip(estimator.collection.layers,
                                         estimator.blocks)):
    shapes = jax.eval_shape(block.init)
    nbytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(shapes))
    out.append(Unit(i, layer.name, int(nbytes),
                    distributed.refresh_cost(shapes)))
  return tuple(out)


def split_axis(shape, num_devices: int,
               from_last: bool = False) -> Optional[int]:
  """The first axis of ``shape`` that ``num_devices`` divides (the last
  such axis with ``from_last``), or None (the array then enters whole on
  every device)."""
  axes = range(len(shape))
  for a in (reversed(axes) if from_last else axes):
    n = shape[a]
    if n >= num_devices and n % num_devices == 0:
      return a
  return None


def whole_gradients(collection, num_devices: int) -> tuple:
  """The parameter leaves (paths) of ``collection``'s layers none of whose
  axes ``num_devices`` divides: their gradients and updates are not split
  but enter and leave whole on every device."""
  shapes = collection.leaf_shapes
  used = sorted({k for layer in collection.layers
                 for k in layer.param_indices})  # In flatten order.
  return tuple(collection.leaf_paths[k] for k in used
               if shapes and split_axis(shapes[k], num_devices) is None)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which device of the curvature axis owns each layer's block.

  Attributes:
    axis: the mesh axis names the curvature is spread over.
    num_devices: ``R``, the product of those axes' sizes.
    units: one :class:`Unit` per layer, in collection order.
    owners: ``owners[ℓ]``, the position along the axis owning layer ``ℓ``.
    whole: the parameter leaves whose gradients and updates enter whole on
      every device (:func:`whole_gradients`).

  Example:
    >>> plan = kl.placement.make_plan(estimator, 8, ("data",))
    >>> print(plan.describe())
  """
  axis: tuple
  num_devices: int
  units: tuple
  owners: tuple
  whole: tuple = ()

  def layers_of(self, device: int) -> tuple:
    """The layers ``device`` owns, in collection order."""
    return tuple(u.layer for u, o in zip(self.units, self.owners)
                 if o == device)

  def loads(self, field: str = "nbytes") -> list:
    """Per device, the sum of its units' ``field`` (``nbytes``, ``flops``)."""
    out = [0.0] * self.num_devices
    for u, o in zip(self.units, self.owners):
      out[o] += getattr(u, field)
    return out

  def imbalance(self, field: str = "nbytes") -> float:
    """``max_r load_r / (total / R)`` (1 is a perfect split)."""
    loads = self.loads(field)
    total = sum(loads)
    return max(loads) * self.num_devices / total if total else 1.0

  def describe(self) -> str:
    """A table: per device its layers, bytes and refresh cost; then the
    parameter leaves whose gradients and updates enter whole on every
    device (:attr:`whole`), if any."""
    nb, fl = self.loads("nbytes"), self.loads("flops")
    total = sum(nb)
    lines = [
        f"Curvature placement over {'x'.join(map(str, self.axis))} "
        f"({self.num_devices} devices): {len(self.units)} blocks, "
        f"{_size(total)} in all; max/mean bytes "
        f"{self.imbalance():.3f}, refresh cost {self.imbalance('flops'):.3f}"]
    for r in range(self.num_devices):
      names = [self.units[i].name for i in self.layers_of(r)]
      lines.append(f"  device {r}: {_size(nb[r]):>10}, "
                   f"refresh {fl[r]:.3g}  {', '.join(names) or '-'}")
    if self.whole:
      lines.append(f"  whole on every device (no axis divisible by "
                   f"{self.num_devices}): the gradients and updates of "
                   f"{', '.join(self.whole)}")
    return "\n".join(lines)

  def __repr__(self) -> str:
    return self.describe()


def _size(n: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{int(n)} B"


def make_plan(estimator, num_devices: int, axis: Sequence[Hashable] = ()
              ) -> Plan:
  """The plan of ``estimator``'s blocks over ``num_devices`` devices.

  Greedy longest-processing-time first on the blocks' bytes
  (:func:`kfac_jax_lite.distributed.assign`): the largest block goes to
  the least-loaded device, and so on.

  Args:
    estimator: a :class:`~kfac_jax_lite.FisherEstimator`.
    num_devices: ``R``, the devices along the curvature axis.
    axis: the axis names (for :meth:`Plan.describe`).

  Returns:
    A :class:`Plan`.
  """
  units = block_units(estimator)
  owners = distributed.assign([float(u.nbytes) for u in units], num_devices)
  return Plan(tuple(axis), num_devices, units, owners,
              whole_gradients(estimator.collection, num_devices))


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where one leaf of a layer's state sits in its owner's row."""
  dtype: str
  offset: int
  shape: tuple


@dataclasses.dataclass(frozen=True)
class Layout:
  """Each device's blocks packed into one row per dtype.

  Row ``r`` of a ``[R, L_dtype]`` array holds device ``r``'s layers' state
  leaves, raveled, in two regions: first the leaves a refresh leaves alone
  (the factors and their EMA weight), then, from the same offset
  ``N_dtype`` on every device, those a refresh rewrites (the cached powers
  or eigenbases); in each, the device's largest block first, then the
  others by size; each region is zero padded to the longest device's.
  The rows are sharded over the curvature axis, so each device stores its
  own row only; a layer's leaves of one region are adjacent, so its EMA
  is one write (a device's largest block: one per factor matrix, then one
  for the rest), and a refresh writes windows of the caches
  (:meth:`window`; :mod:`kfac_jax_lite.row_writes`).
  """
  plan: Plan
  treedefs: tuple     # per layer, its state's structure
  slots: tuple        # per layer, one Slot per leaf
  widths: dict        # dtype -> L_dtype
  rewritten: tuple = ()  # per layer, per leaf: a refresh rewrites it

  def pack(self, device: int, states: dict) -> dict:
    """``{dtype: [L]}``, the row of ``device`` from its layers' states."""
    parts: dict = {dt: [] for dt in self.widths}
    for i in self.plan.layers_of(device):
      for s, x in zip(self.slots[i], jax.tree.leaves(states[i])):
        parts[s.dtype].append((s.offset, jnp.ravel(x).astype(s.dtype)))
    out = {}
    for dt, width in self.widths.items():
      pieces, at = [], 0
      for off, x in sorted(parts[dt], key=lambda p: p[0]):
        if off > at:
          pieces.append(jnp.zeros((off - at,), dt))
        pieces.append(x)
        at = off + x.size
      if at < width:
        pieces.append(jnp.zeros((width - at,), dt))
      out[dt] = jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    return out

  def unpack(self, device: int, rows: dict) -> dict:
    """``{layer: state}`` of the layers ``device`` owns, from its row
    (``{dtype: [L]}``, or ``[1, L]``: read without reshaping the row)."""
    out = {}
    for i in self.plan.layers_of(device):
      leaves = [(rows[s.dtype][..., s.offset:s.offset + math.prod(s.shape)]
                 if rows[s.dtype].ndim == 1 else rows[s.dtype][
                     0, s.offset:s.offset + math.prod(s.shape)])
                .reshape(s.shape) for s in self.slots[i]]
      out[i] = jax.tree.unflatten(self.treedefs[i], leaves)
    return out

  def changed(self, old: dict, new: dict) -> dict:
    """``{dtype: (lo, hi)}``: the span of the slots of the leaves of
    ``new`` (``{layer: state}``) that are not ``old``'s own arrays (traced:
    a leaf passed through unchanged is the same object)."""
    spans: dict = {}
    for i, state in new.items():
      for s, n, o in zip(self.slots[i], jax.tree.leaves(state),
                         jax.tree.leaves(old[i])):
        if n is not o:
          lo, hi = spans.get(s.dtype, (s.offset, s.offset))
          spans[s.dtype] = (min(lo, s.offset),
                            max(hi, s.offset + math.prod(s.shape)))
    return spans

  def window(self, rows: dict, old: dict, new: dict, spans: dict) -> dict:
    """``{dtype: rows[dtype][lo:hi]}`` with the leaves of ``new`` that are
    not ``old``'s (:meth:`changed`, inside the ``spans``) written in.

    Built as one concatenation of the new leaves and the old row's pieces
    between them: the window is materialised once, from its pieces, with
    no copy of the old window to write into."""
    parts: dict = {dt: [] for dt in spans}
    for i, state in new.items():
      for s, n, o in zip(self.slots[i], jax.tree.leaves(state),
                         jax.tree.leaves(old[i])):
        if n is not o:
          parts[s.dtype].append((s.offset, jnp.ravel(n).astype(s.dtype)))
    out = {}
    for dt, (lo, hi) in spans.items():
      pieces, at = [], lo
      for off, x in sorted(parts[dt], key=lambda p: p[0]):
        if off > at:
          pieces.append(rows[dt][at:off])
        pieces.append(x)
        at = off + x.size
      if at < hi:
        pieces.append(rows[dt][at:hi])
      out[dt] = jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    return out

  def keep_unrefreshed(self, old: dict, new: dict) -> dict:
    """``new`` (``{layer: refreshed state}``) with the leaves a refresh
    leaves alone (:func:`refreshed_leaves`) taken from ``old``: a batched
    refresh returns them as new arrays of the same values, which would
    widen the refresh's window (:meth:`window`) over the factors."""
    out = {}
    for i, state in new.items():
      leaves = [n if f else o for n, o, f in zip(
          jax.tree.leaves(state), jax.tree.leaves(old[i]), self.rewritten[i])]
      out[i] = jax.tree.unflatten(self.treedefs[i], leaves)
    return out


def refreshed_leaves(block) -> tuple:
  """Per leaf of ``block``'s state: whether its refresh rewrites it (the
  leaves ``update_cache`` returns as new arrays, found by tracing it)."""
  flags: list = []

  def probe():
    state = block.init()
    new = block.update_cache(state, jnp.asarray(1e-3, jnp.float32))
    flags.extend(n is not o for n, o in zip(jax.tree.leaves(new),
                                            jax.tree.leaves(state)))
    return 0

  jax.eval_shape(probe)
  return tuple(flags)


def make_layout(plan: Plan, estimator) -> Layout:
  """The :class:`Layout` of ``plan`` for ``estimator``'s block states."""
  n = len(plan.units)
  slots: list[list] = [[] for _ in range(n)]
  flat = [jax.tree.flatten(jax.eval_shape(b.init)) for b in estimator.blocks]
  shapes = [leaves for leaves, _ in flat]
  treedefs = [treedef for _, treedef in flat]
  flags = [refreshed_leaves(b) for b in estimator.blocks]
  starts: dict[str, int] = {}
  for region in (False, True):  # Left alone by a refresh, then rewritten.
    ends: dict[str, int] = {}
    for r in range(plan.num_devices):
      used = dict(starts)
      for i in sorted(plan.layers_of(r), key=lambda i: -plan.units[i].nbytes):
        for k, (x, f) in enumerate(zip(shapes[i], flags[i])):
          if f is region:
            dt = str(x.dtype)
            slots[i].append((k, Slot(dt, used.get(dt, 0), tuple(x.shape))))
            used[dt] = used.get(dt, 0) + math.prod(x.shape)
      for dt, u in used.items():
        ends[dt] = max(ends.get(dt, 0), u)
    starts = {**starts, **ends}
  widths = {dt: max(w, 1) for dt, w in starts.items()}
  return Layout(plan, tuple(treedefs), tuple(
      tuple(s for _, s in sorted(ss, key=lambda t: t[0])) for ss in slots),
                dict(sorted(widths.items())), tuple(flags))
