"""Trace-time checks of the arrays given to the layer tags.

Shapes are static under ``jit``, so a wrong shape is reported when the
user's function is traced, naming the tag's argument, the shape it has,
the shape expected and the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def shape_error(fn, what, got, want, fix):
  return ValueError(f"{fn}: {what} has shape {tuple(got)}, expected "
                    f"{tuple(want)}. {fix}")


def check_dense_shapes(y, x, w, b):
  fn = "register_dense"
  if w.ndim != 2:
    raise ValueError(
        f"{fn}: w has shape {w.shape}; a dense kernel is [d_in, d_out]. "
        "Reshape it, or use register_generic for other parameter shapes.")
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise shape_error(fn, "x", x.shape, (..., w.shape[0]),
                       "x's last axis must match w's first (x @ w).")
  want = tuple(x.shape[:-1]) + (w.shape[1],)
  if tuple(y.shape) != want:
    raise shape_error(fn, "y", y.shape, want,
                       "y must be x @ w (+ b) for the x and w given.")
  if b is not None and b.size != w.shape[1]:
    raise shape_error(fn, "b", b.shape, (w.shape[1],),
                       "The bias has one entry per output feature.")


def check_conv_shapes(y, x, w, b, **conv_kwargs):
  fn = "register_conv"
  kw = dict(conv_kwargs)
  kw["lhs_dilation"] = kw["lhs_dilation"] or None
  kw["rhs_dilation"] = kw["rhs_dilation"] or None
  try:
    out = jax.eval_shape(lambda x, w: jax.lax.conv_general_dilated(
        x, w, **kw), jax.ShapeDtypeStruct(x.shape, jnp.float32),
                         jax.ShapeDtypeStruct(w.shape, jnp.float32))
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"{fn}: x {x.shape} and w {w.shape} are not a valid convolution "
        f"with {conv_kwargs}: {e}") from e
  if tuple(y.shape) != tuple(out.shape):
    raise shape_error(
        fn, "y", y.shape, out.shape,
        "y must be lax.conv_general_dilated(x, w, ...) (+ b) with the "
        "window_strides, padding, dilations and dimension_numbers given; "
        f"check them ({conv_kwargs}).")
  if b is not None and b.size not in (y.shape[-1], y.shape[1]):
    raise ValueError(
        f"{fn}: b has {b.size} entries; expected one per output channel.")


def check_embedding(y, ids, table):
  fn = "register_embedding"
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(
        f"{fn}: ids have dtype {ids.dtype}; embedding ids must be integers.")
  if table.ndim != 2:
    raise ValueError(
        f"{fn}: table has shape {table.shape}; expected [vocab, d].")
  want = tuple(ids.shape) + (table.shape[1],)
  if tuple(y.shape) != want:
    raise shape_error(fn, "y", y.shape, want, "y must be table[ids].")
  if not isinstance(ids, jax.core.Tracer) and ids.size:
    # NumPy, not jnp: inside a trace jnp ops on constants are staged too.
    concrete = np.asarray(ids)
    lo, hi = int(concrete.min()), int(concrete.max())
    if lo < 0 or hi >= table.shape[0]:
      raise ValueError(
          f"{fn}: ids range over [{lo}, {hi}], outside the vocabulary "
          f"[0, {table.shape[0]}). Clip or remap the ids.")


def check_loss_function(z, targets, loss_fn, sampler, fn):
  """Checks ``register_loss_function``'s callables at trace time.

  ``loss_fn`` (and ``sampler``) must be static: hashable, closing over no
  traced value, and ``loss_fn`` of one position must be a scalar.
  """
  for name, f in (("loss_fn", loss_fn), ("sampler", sampler)):
    if f is None and name == "sampler":
      continue
    if not callable(f):
      raise TypeError(
          f"{fn}: {name}={f!r} must be a function, e.g. "
          "loss_fn=lambda z, y: jnp.exp(z) - y * z (one position).")
    cells = getattr(f, "__closure__", None) or ()
    for cell in cells:
      try:
        value = cell.cell_contents
      except ValueError:  # An empty cell.
        continue
      if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value)):
        raise TypeError(
            f"{fn}: {name} closes over a traced array; it is kept as a "
            "static tag parameter and called again later, outside this "
            "trace. Pass arrays through z or targets, or define it at "
            "module level with only Python constants.")
  lead = z.shape[:-1] if z.ndim >= 2 else z.shape
  if targets is not None and tuple(targets.shape[:len(lead)]) != tuple(lead):
    raise ValueError(
        f"{fn}: targets have shape {tuple(targets.shape)}; their leading "
        f"axes must be z's positions {tuple(lead)} (z {tuple(z.shape)}), "
        "one target per position.")
  z_n = jax.ShapeDtypeStruct(z.shape[len(lead):], z.dtype)
  y_n = None if targets is None else jax.ShapeDtypeStruct(
      targets.shape[len(lead):], targets.dtype)
  out = jax.eval_shape(loss_fn, z_n, y_n)
  if not hasattr(out, "shape") or out.shape != ():
    raise ValueError(
        f"{fn}: loss_fn(z_n, y_n) must return a scalar for one position "
        f"(z_n of shape {z_n.shape}); it returned "
        f"{getattr(out, 'shape', type(out).__name__)}. Sum over the event "
        "axis inside loss_fn; the positions are averaged for you.")
