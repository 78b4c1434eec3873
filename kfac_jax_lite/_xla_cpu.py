"""XLA:CPU compile-time and runtime workarounds, in one place.

Each function here computes exactly what its plain JAX counterpart would;
it only changes the program XLA:CPU gets, so that it compiles fewer distinct
kernels or avoids a runtime hazard. The reasons are measured in
``docs/performance.md`` ("Compile-time techniques"); each function names
its anchor there. The sampling keys' integer hash (:mod:`kfac_jax_lite.keys`)
is the one trick kept elsewhere, next to the keys it derives.

The workarounds that change the program's structure (a loop, a
conditional) are chosen when the program is lowered, by
:func:`on_cpu`: the CPU program gets them, every other platform the plain
computation (one batched factorisation per stack on a GPU, constant
indices), so a program lowered for both (``lowering_platforms=("cpu",
"cuda")``) is right on each (docs/performance.md#platform-specific-programs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def on_cpu(cpu, default, *args):
  """``cpu(*args)`` in a program lowered for the CPU, else ``default(*args)``.

  ``jax.lax.platform_dependent``: both are traced, the lowering keeps the
  one of its platform (a conditional on the platform only when lowered for
  several at once), so no flag and no default backend decides it. The two
  must compute the same values; ``cpu`` only steers XLA:CPU.
  """
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def sequential_under_vmap(fn):
  """``fn`` (one matrix in, arrays out) whose ``vmap`` is a ``lax.map`` on
  the CPU, and a plain ``vmap`` (one batched call) on other platforms.

  jaxlib's CPU LAPACK kernels split a batch over XLA's intra-op thread pool
  and block until it is done, so two batched calls running at once can
  deadlock a small pool; mapped one matrix at a time they never wait on
  the pool, and the program still holds one kernel per shape, not one per
  layer (docs/performance.md#lapack-under-vmap). A GPU has no such pool:
  there a stack of ``B`` matrices is one batched cuSOLVER custom call, not
  an XLA loop of ``B`` calls, each iteration waiting on its predicate
  (:func:`on_cpu` picks the rule when lowering).
  """
  wrapped = _sequential_vmap(fn)

  @functools.wraps(fn)
  def dispatch(*args):
    return on_cpu(wrapped, fn, *args)

  return dispatch


def _sequential_vmap(fn):
  """``fn`` with a ``custom_vmap`` rule that maps it one slice at a time."""
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *args):
    del axis_size
    if not any(in_batched):
      out = wrapped(*args)
      return out, jax.tree.map(lambda _: False, out)
    batched = [a if b else None for a, b in zip(args, in_batched)]
    fixed = [None if b else a for a, b in zip(args, in_batched)]

    def one(xs):
      it = iter(xs)
      return wrapped(*[f if b is None else next(it)
                       for f, b in zip(fixed, batched)])

    out = jax.lax.map(one, [a for a in batched if a is not None])
    return out, jax.tree.map(lambda _: True, out)

  return wrapped


def opaque_indices(n: int, like) -> tuple:
  """``(0, 1, ..., n - 1)`` as int32 scalars XLA:CPU cannot constant-fold.

  Both branches of a ``lax.cond`` return the same constants, so the values
  are exact whatever the predicate (any element of ``like``); but XLA keeps
  the conditional, and each index reaches the kernels that use it as an
  argument instead of a constant inside them. Kernels that differ only in
  such an index are then one kernel, compiled once
  (docs/performance.md#opaque-indices). Other platforms get the plain
  constants (:func:`on_cpu`): the conditional would cost a GPU a
  synchronising branch for nothing.
  """
  index = lambda *_: tuple(jnp.asarray(j, jnp.int32) for j in range(n))  # noqa: E731
  if not jnp.size(like):  # Nothing to read: plain constants.
    return index()

  def opaque(first):
    return jax.lax.cond(first == 0, index, index)

  return on_cpu(opaque, index, jnp.ravel(like)[0])


# Leaves of one dtype smaller than FINITE_ALONE elements are reduced in
# concatenated chunks of up to FINITE_CHUNK elements (flat_chunks); larger
# leaves are reduced alone (no copy of large factors and gradients).
FINITE_CHUNK = 1 << 20
FINITE_ALONE = 1 << 16


def flat_chunks(tree) -> list:
  """The floating-point leaves of ``tree`` as a few 1-D arrays.

  Leaves of at least :data:`FINITE_ALONE` elements are raveled alone (no
  copy); smaller leaves of one dtype are raveled and concatenated, in
  chunks of at most :data:`FINITE_CHUNK` elements. Two trees of the same
  structure and dtypes give aligned chunks (same order, same sizes), so
  elementwise reductions over a tree cost one kernel per chunk instead of
  one or more per leaf (docs/performance.md#flat-chunks). Integer leaves
  are left out.
  """
  chunks, pending, sizes = [], {}, {}
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    if x.size >= FINITE_ALONE:
      chunks.append(x.reshape(-1))
      continue
    dt = x.dtype
    if sizes.get(dt, 0) + x.size > FINITE_CHUNK:
      chunks.append(pending.pop(dt))
      sizes[dt] = 0
    pending.setdefault(dt, []).append(x.reshape(-1))
    sizes[dt] = sizes.get(dt, 0) + x.size
  chunks += list(pending.values())
  return [c[0] if len(c) == 1 else jnp.concatenate(c)
          if isinstance(c, list) else c for c in chunks]


def finite_marker(tree) -> jnp.ndarray:
  """:math:`\\sum_{\\text{leaves}} \\sum_i (x_i - x_i)`: a float32 scalar.

  ``x - x`` is ``0`` for finite ``x`` and NaN for ``±inf`` or NaN (XLA does
  not fold it for floats), so the sum is exactly ``0`` when every float
  leaf of ``tree`` is finite and NaN otherwise; it cannot overflow. Each
  chunk (:func:`flat_chunks`) is one fused reduction, where
  ``all(isfinite(x))`` materialises a boolean array first
  (docs/performance.md#finite-marker). A linear combination of trees (a
  sum, an average, an EMA) has the same combination of their markers as a
  valid marker, so a marker computed with statistics stays true for them
  when they are averaged.
  """
  total = jnp.zeros((), jnp.float32)
  for c in flat_chunks(tree):
    total = total + jnp.real(jnp.sum(c - c)).astype(jnp.float32)
  return total
