"""Trace-time checks of the arrays given to the layer tags.

Shapes are static under ``jit``, so a wrong shape is reported when the
user's function is traced, naming the tag's argument, the shape it has,
the shape expected and the fix.
"""

from __future__ import annotations

import jax
import jax.core  # jax.core.Tracer
import jax.numpy as jnp
import numpy as np


def _shape_str(shape) -> str:
  """``(2, 3)``, or ``(..., 3)`` for a shape with free leading axes."""
  parts = ["..." if d is Ellipsis else str(d) for d in shape]
  return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def shape_error(fn, what, got, want, fix):
  return ValueError(f"{fn}: {what} has shape {_shape_str(got)}, expected "
                    f"{_shape_str(want)}. {fix}")


def check_arrays(fn, **named):
  """Each named argument (None skipped) is an array, not a list or number."""
  for name, value in named.items():
    if value is not None and not (hasattr(value, "shape") and hasattr(
        value, "dtype")):
      raise TypeError(
          f"{fn}: {name} is a {type(value).__name__}; expected an array "
          f"(jax.Array or np.ndarray). Pass jnp.asarray({name}).")


def check_dense_shapes(y, x, w, b):
  fn = "register_dense"
  check_arrays(fn, y=y, x=x, w=w, b=b)
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
  check_arrays(fn, y=y, x=x, w=w, b=b)
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
        f"with {conv_kwargs}: {e}. x is [N, *spatial, C_in] and w "
        "[*spatial, C_in, C_out] in the layout dimension_numbers names."
    ) from e
  if tuple(y.shape) != tuple(out.shape):
    raise shape_error(
        fn, "y", y.shape, out.shape,
        "y must be lax.conv_general_dilated(x, w, ...) (+ b) with the "
        "window_strides, padding, dilations and dimension_numbers given; "
        f"check them ({conv_kwargs}).")
  dn = jax.lax.conv_dimension_numbers(x.shape, w.shape,
                                      kw["dimension_numbers"])
  if b is not None and b.size != y.shape[dn.out_spec[1]]:
    raise ValueError(
        f"{fn}: b has {b.size} entries; expected one per output channel "
        f"(y {tuple(y.shape)}). Pass the conv's own bias [C_out].")


def check_embedding(y, ids, table):
  fn = "register_embedding"
  check_arrays(fn, y=y, ids=ids, table=table)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(
        f"{fn}: ids have dtype {ids.dtype}; embedding ids must be integers "
        "(row indices of the table). Pass ids.astype(jnp.int32).")
  if table.ndim != 2:
    raise ValueError(
        f"{fn}: table has shape {table.shape}; expected [vocab, d]. "
        "Register other lookups with register_generic(...).")
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


def _conv_out(fn, x, w, fix, **kw):
  """``eval_shape`` of ``conv_general_dilated(x, w, **kw)``, or a
  ``ValueError`` naming ``fn`` when the shapes do not convolve."""
  try:
    return jax.eval_shape(lambda x, w: jax.lax.conv_general_dilated(
        x, w, **kw), jax.ShapeDtypeStruct(x.shape, jnp.float32),
                          jax.ShapeDtypeStruct(w.shape, jnp.float32)).shape
  except (TypeError, ValueError) as e:
    raise ValueError(f"{fn}: x {tuple(x.shape)} and the kernel "
                     f"{tuple(w.shape)} do not convolve: {e}. {fix}") from e


def check_depthwise_shapes(fn, y, x, w, *, strides, padding, rate,
                           data_format):
  """``y`` is the depthwise convolution of ``x`` by ``w: [h, w, C, M]``."""
  check_arrays(fn, y=y, x=x, w=w)
  c_axis = -1 if data_format == "NHWC" else 1
  if w.ndim != 4 or x.ndim != 4 or w.shape[2] != x.shape[c_axis]:
    raise shape_error(fn, "the depthwise kernel", w.shape,
                      ("h", "w", x.shape[c_axis] if x.ndim == 4 else "C",
                       "M"), "A depthwise kernel is [h, w, C, M] with C "
                      f"the input channels of x {tuple(x.shape)} "
                      f"({data_format}).")
  h, k, c, m = w.shape
  out = _conv_out(fn, x, w.reshape(h, k, 1, c * m),
                  "Check strides, padding and rate.", window_strides=strides,
                  padding=padding, rhs_dilation=rate,
                  dimension_numbers=(data_format, "HWIO", data_format),
                  feature_group_count=c)
  if tuple(y.shape) != tuple(out):
    raise shape_error(fn, "the depthwise output", y.shape, out,
                      "It must be the depthwise convolution of x by the "
                      f"kernel with strides={strides}, padding={padding!r}, "
                      f"rate={rate}; check them.")


def check_separable_shapes(y, x, depthwise_w, pointwise_w, depthwise_y, b,
                           **depthwise_kwargs):
  """The depthwise part as :func:`check_depthwise_shapes`, then ``y`` is the
  1x1 convolution of ``depthwise_y`` by ``pointwise_w: [1, 1, C·M, O]``."""
  fn = "register_separable_conv2d"
  check_arrays(fn, pointwise_w=pointwise_w, b=b)
  check_depthwise_shapes(fn, depthwise_y, x, depthwise_w, **depthwise_kwargs)
  c_axis = -1 if depthwise_kwargs["data_format"] == "NHWC" else 1
  cm = depthwise_y.shape[c_axis]
  if pointwise_w.ndim != 4 or tuple(pointwise_w.shape[:3]) != (1, 1, cm):
    raise shape_error(fn, "pointwise_w", pointwise_w.shape, (1, 1, cm, "O"),
                      "The pointwise kernel is a 1x1 convolution from the "
                      "C·M depthwise channels.")
  want = list(depthwise_y.shape)
  want[c_axis] = pointwise_w.shape[3]
  if tuple(y.shape) != tuple(want):
    raise shape_error(fn, "y", y.shape, want,
                      "y must be the 1x1 convolution of depthwise_y by "
                      "pointwise_w (+ b).")
  if b is not None and b.size != pointwise_w.shape[3]:
    raise shape_error(fn, "b", b.shape, (pointwise_w.shape[3],),
                      "The bias has one entry per output channel.")


def check_scale_and_shift(y, x, scale, shift):
  """``y = x * scale + shift`` by broadcasting."""
  fn = "register_scale_and_shift"
  check_arrays(fn, y=y, x=x, scale=scale, shift=shift)
  for name, p in (("scale", scale), ("shift", shift)):
    if p is None:
      continue
    try:
      ok = np.broadcast_shapes(tuple(x.shape), tuple(p.shape)) == tuple(
          y.shape)
    except ValueError:
      ok = False
    if not ok:
      raise ValueError(
          f"{fn}: {name} {tuple(p.shape)} and x {tuple(x.shape)} do not "
          f"broadcast to y {tuple(y.shape)}; expected y = x * scale + shift "
          f"with {name} broadcast against x, e.g. [d] for x [..., d].")


def check_loss_targets(fn, kind, z, targets):
  """Targets have one entry per position (categorical, integer) or ``z``'s
  shape (normal, multi-Bernoulli); a custom loss's targets are checked by
  :func:`check_loss_function`."""
  if kind == "categorical":
    if not jnp.issubdtype(targets.dtype, jnp.integer):
      raise TypeError(
          f"{fn}: targets have dtype {targets.dtype}; expected integer "
          "class ids. Pass targets.astype(jnp.int32) (labels, not one-hot "
          "or float).")
    want = tuple(z.shape[:-1])
    if tuple(targets.shape) != want:
      raise shape_error(fn, "targets", targets.shape, want,
                        f"One class id per position of the logits "
                        f"{tuple(z.shape)} (every axis but the last).")
  elif kind == "custom":
    return  # check_loss_function checks the leading shape.
  elif tuple(targets.shape) != tuple(z.shape):
    raise shape_error(fn, "targets", targets.shape, z.shape,
                      "Targets have the shape of the registered "
                      "distribution parameters.")
