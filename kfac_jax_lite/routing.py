"""Moving each layer's arrays to and from its owner on the curvature axis.

Inside the ``shard_map`` of :mod:`kfac_jax_lite.sharded` every device holds
a ``1/R`` piece of each layer's array (the statistics' inputs split along
the batch, a gradient split along its leading axis); the owner of a layer
(:class:`~kfac_jax_lite.placement.Plan`) needs the whole array. A
:class:`Route` moves them with one ``all_to_all`` per dtype: device ``s``
packs, for each device ``r``, its pieces of the layers ``r`` owns into
chunk ``r`` of a ``[R, W]`` buffer, and after the exchange row ``s`` of
device ``r``'s buffer holds device ``s``'s pieces, which the owner
concatenates in device order into the global arrays,

.. math::
  X_\\ell = \\big[X_\\ell^{(1)};\\, \\dots;\\, X_\\ell^{(R)}\\big]
  \\quad\\text{on } o(\\ell) \\text{ only.}

So each device receives only the data of its own layers (``W`` is the
largest device's share of the pieces), and nothing of a layer is
gathered anywhere else. The way back (the owner's products to every
device's piece) is the same exchange read the other way. An array no
axis of which ``R`` divides is not split: every device holds it whole (it
enters replicated; a result of that shape is summed over the axis, the
other devices contributing zeros).

References:
  Shi et al. (2023), arXiv:2309.06497 (preconditioner blocks partitioned
  over workers, the search directions exchanged).
"""

from __future__ import annotations

import dataclasses
import math

from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kfac_jax_lite import placement


split_axis = placement.split_axis


@dataclasses.dataclass(frozen=True)
class Route:
  """How each layer's leaves (global shapes) are split and exchanged.

  Attributes:
    plan: the placement (owners).
    axes: per layer, per leaf: the split axis or None (replicated).
    shapes: per layer, per leaf: the global shape.
    dtypes: per layer, per leaf: the dtype name.
    widths: dtype -> ``W``, the largest device's chunk (its layers' pieces).
  """
  plan: placement.Plan
  axes: tuple
  shapes: tuple
  dtypes: tuple
  widths: dict

  def specs(self, names) -> list:
    """Per layer, per leaf: the ``PartitionSpec`` it enters the map with."""
    spec = names[0] if len(names) == 1 else tuple(names)
    return [[P() if a is None else P(*([None] * a), spec) for a in axes]
            for axes in self.axes]

  def _local(self, i, k) -> tuple:
    shape, a = list(self.shapes[i][k]), self.axes[i][k]
    shape[a] //= self.plan.num_devices
    return tuple(shape)

  def _chunk(self, r):
    """``[(layer, leaf, dtype, offset, local shape)]`` of device ``r``'s
    chunk (its layers' split leaves, in layer order)."""
    used, out = {}, []
    for i in self.plan.layers_of(r):
      for k, a in enumerate(self.axes[i]):
        if a is None:
          continue
        dt, shape = self.dtypes[i][k], self._local(i, k)
        out.append((i, k, dt, used.get(dt, 0), shape))
        used[dt] = used.get(dt, 0) + math.prod(shape)
    return out

  def _pack(self, pieces_of) -> dict:
    """``{dtype: [R, W]}``: row ``r`` the ravelled ``pieces_of(r, i, k)``
    of device ``r``'s chunk, zero padded."""
    rows = []
    for r in range(self.plan.num_devices):
      parts = {dt: [] for dt in self.widths}
      for i, k, dt, _, _ in self._chunk(r):
        parts[dt].append(jnp.ravel(pieces_of(r, i, k)))
      rows.append({dt: _padded(p, self.widths[dt], dt)
                   for dt, p in parts.items()})
    return {dt: jnp.stack([row[dt] for row in rows]) for dt in self.widths}

  def to_owners(self, local: list, names) -> dict:
    """Sends each layer's pieces (``local[i][k]``) to its owner: the
    buffers :meth:`at_owner` reads."""
    buf = self._pack(lambda r, i, k: local[i][k])
    return {dt: _exchange(x, names) for dt, x in buf.items()}

  def at_owner(self, r: int, received: dict, local: list) -> dict:
    """``{layer: [global leaves]}`` of device ``r``'s layers (inside its
    branch): the pieces from every device concatenated in device order;
    a leaf not split is ``local``'s own."""
    out = {i: list(local[i]) for i in self.plan.layers_of(r)}
    for i, k, dt, off, shape in self._chunk(r):
      n = math.prod(shape)
      pieces = [received[dt][s, off:off + n].reshape(shape)
                for s in range(self.plan.num_devices)]
      out[i][k] = jnp.concatenate(pieces, axis=self.axes[i][k])
    return out

  def from_owner(self, r: int, results: dict) -> tuple:
    """Device ``r``'s branch's share of the way back: ``(buffers, whole)``
    where ``buffers[dtype][s]`` holds device ``s``'s pieces of ``results``
    (``{layer: [global leaves]}`` of ``r``'s layers) and ``whole`` the
    leaves not split, per layer (zeros for the layers of others)."""
    def piece(s, i, k):
      a = self.axes[i][k]
      size = self.shapes[i][k][a] // self.plan.num_devices
      return lax.slice_in_dim(results[i][k], s * size, (s + 1) * size,
                              axis=a)

    mine = self._chunk(r)
    bufs = []
    for s in range(self.plan.num_devices):
      parts = {dt: [] for dt in self.widths}
      for i, k, dt, _, _ in mine:
        parts[dt].append(jnp.ravel(piece(s, i, k)))
      bufs.append({dt: _padded(p, self.widths[dt], dt)
                   for dt, p in parts.items()})
    buffers = {dt: jnp.stack([b[dt] for b in bufs]) for dt in self.widths}
    whole = [[(results[i][k] if i in results else jnp.zeros(
        self.shapes[i][k], self.dtypes[i][k])) if a is None else None
              for k, a in enumerate(axes)] for i, axes in enumerate(self.axes)]
    return buffers, whole

  def back(self, buffers: dict, whole: list, names, gather=True) -> list:
    """Per layer, per leaf: the owner's result, whole on every device (the
    exchange of :meth:`from_owner`'s buffers gives each device its piece,
    an ``all_gather`` the rest; the leaves not split summed over the
    axis). With ``gather=False`` a split leaf stays this device's piece
    (leave the map with :meth:`specs`)."""
    received = {dt: _exchange(x, names) for dt, x in buffers.items()}
    whole = lax.psum(whole, names)
    out = [list(w) for w in whole]
    axis = names if len(names) > 1 else names[0]
    for o in range(self.plan.num_devices):
      for i, k, dt, off, shape in self._chunk(o):
        piece = received[dt][o, off:off + math.prod(shape)].reshape(shape)
        out[i][k] = piece if not gather else lax.all_gather(
            piece, axis, axis=self.axes[i][k], tiled=True)
    return out


def _padded(parts, width, dt):
  used = sum(p.size for p in parts)
  if used < width:
    parts = parts + [jnp.zeros((width - used,), dt)]
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _exchange(x, names):
  """Row ``r`` of this device's ``[R, W]`` to device ``r``; row ``s`` of
  the result came from device ``s``."""
  if x.shape[0] == 1:
    return x
  return lax.all_to_all(x, names if len(names) > 1 else names[0], 0, 0,
                        tiled=True)


def make_route(plan: placement.Plan, leaves: list,
               from_last: bool = False) -> Route:
  """The :class:`Route` of per-layer lists of (global, possibly abstract)
  arrays ``leaves``, each split on its first axis ``R`` divides (its last
  with ``from_last``: :func:`split_axis`)."""
  r = plan.num_devices
  axes = tuple(tuple(split_axis(x.shape, r, from_last) for x in ls)
               for ls in leaves)
  shapes = tuple(tuple(tuple(x.shape) for x in ls) for ls in leaves)
  dtypes = tuple(tuple(str(jnp.dtype(x.dtype)) for x in ls) for ls in leaves)
  route = Route(plan, axes, shapes, dtypes, {})
  widths: dict = {}
  for d in range(r):
    used: dict = {}
    for _, _, dt, off, shape in route._chunk(d):  # pylint: disable=protected-access
      used[dt] = off + math.prod(shape)
    for dt, n in used.items():
      widths[dt] = max(widths.get(dt, 1), n)
  return dataclasses.replace(route, widths=dict(sorted(widths.items())))

