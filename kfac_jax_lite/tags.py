"""Layer and loss tags: identity primitives that mark curvature structure.

A tag returns its first operand unchanged, in value and in gradient. Its other
operands (layer inputs, parameters, targets) are only *observed*: the scanner
(:mod:`kfac_jax_lite.scanner`) finds tags in the traced jaxpr, maps parameter
operands back to parameter leaves, and at estimation time re-evaluates the
function with a zero perturbation added to each tagged output, so that one
``jax.vjp`` yields both the gradient and the curvature statistics.

Two primitives carry every tag:

* ``kfac_layer_tag(y, *inputs, *params; kind, n_inputs, meta)`` for layers;
* ``kfac_loss_tag(z, [targets]; kind, meta)`` for predictive distributions.

``meta`` is a sorted tuple of ``(name, value)`` pairs of static (hashable)
values: strides, padding, the requested approximation, the loss weight, ...
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from kfac_jax_lite import kinds
from kfac_jax_lite import tag_checks

# --------------------------------------------------------------------------
# Primitives.
# --------------------------------------------------------------------------

layer_tag_p = jex_core.Primitive("kfac_layer_tag")
loss_tag_p = jex_core.Primitive("kfac_loss_tag")

LAYER_KINDS = tuple(kinds.KINDS)
LOSS_KINDS = ("categorical", "normal", "multi_bernoulli", "custom")


def _identity_impl(y, *unused_operands, **unused_params):
  return y


def _identity_abstract_eval(y, *unused_operands, **unused_params):
  return y


def _make_jvp(prim):
  def jvp(primals, tangents, **params):
    out = prim.bind(*primals, **params)
    t_y = tangents[0]
    if type(t_y) is ad.Zero:  # pylint: disable=unidiomatic-typecheck
      t_y = ad.instantiate_zeros(t_y)
    return out, t_y
  return jvp


def _make_batcher(prim):
  def batcher(args, dims, **params):
    # Move every batched operand's batch axis to the front; unbatched
    # operands (typically parameters under ``vmap(in_axes=None)``) stay.
    moved = [a if d is None else jnp.moveaxis(a, d, 0)
             for a, d in zip(args, dims)]
    y_dim = None if dims[0] is None else 0
    return prim.bind(*moved, **params), y_dim
  return batcher


for _p in (layer_tag_p, loss_tag_p):
  _p.def_impl(_identity_impl)
  _p.def_abstract_eval(_identity_abstract_eval)
  ad.primitive_jvps[_p] = _make_jvp(_p)
  batching.primitive_batchers[_p] = _make_batcher(_p)
  mlir.register_lowering(
      _p, mlir.lower_fun(_identity_impl, multiple_results=False))


def meta_dict(eqn_params) -> dict:
  """The static metadata of a tag equation as a dict."""
  return dict(eqn_params["meta"])


def _freeze(value):
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  if isinstance(value, dict):
    return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
  return value


def _static_meta(**kwargs) -> tuple:
  items = []
  for k, v in sorted(kwargs.items()):
    v = _freeze(v)
    try:
      hash(v)
    except TypeError as e:
      raise TypeError(
          f"Tag argument {k}={v!r} must be a static (hashable) value such as "
          "a Python number, string or tuple; got an unhashable "
          f"{type(v).__name__}.") from e
    if isinstance(v, jax.core.Tracer):
      raise TypeError(
          f"Tag argument {k} must be a static Python value, not a traced "
          "array. Pass a Python float/int/tuple.")
    items.append((k, v))
  return tuple(items)


def _check_array(name: str, value, fn: str):
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    raise TypeError(
        f"{fn}: argument {name} must be an array, got {type(value).__name__}.")


def _layer_tag(kind: str, y, inputs: Sequence[Any], params: Sequence[Any],
               fn: str, **meta):
  for i, a in enumerate((y, *inputs, *params)):
    _check_array(("y", *[f"input{j}" for j in range(len(inputs))],
                  *[f"param{j}" for j in range(len(params))])[i], a, fn)
  return layer_tag_p.bind(
      y, *inputs, *params, kind=kind, n_inputs=len(inputs),
      meta=_static_meta(**meta))


# --------------------------------------------------------------------------
# Layer registration functions.
# --------------------------------------------------------------------------


def register_dense(y, x, w, b=None, *, approx: Optional[str] = None):
  """Tags a dense layer ``y = x @ w + b``.

  .. math:: y_{\\ldots,j} = \\sum_i x_{\\ldots,i} w_{ij} + b_j

  The layer's Fisher block is approximated by the Kronecker product
  :math:`F \\approx A \\otimes G` with :math:`A = E[\\bar a \\bar a^T]`
  (:math:`\\bar a` the input with a trailing 1 for the bias) and
  :math:`G = E[g g^T]` (:math:`g` the loss gradient at ``y``); Martens &
  Grosse (2015), eq. (1)-(3).

  Args:
    y: the layer output, ``[..., d_out]``. Returned unchanged.
    x: the layer input, ``[..., d_in]``; leading axis is the batch.
    w: the kernel ``[d_in, d_out]`` (a parameter leaf, possibly cast).
    b: optional bias ``[d_out]``.
    approx: one of ``APPROXIMATIONS["fully_connected"]`` (default
      ``kron``; also ``ekfac``, ``kron_reduce``, ...), or for a layer used
      several times per example one of
      ``APPROXIMATIONS["fully_connected_multi"]`` (default ``kron_indep``;
      ``kron_series_1``, ``kron_series_2``). None: the collection's default.

  Returns:
    ``y``, unchanged in value and gradient.

  Raises:
    ValueError: if the shapes of ``y``, ``x``, ``w`` and ``b`` do not form
      a dense layer (the message names the argument and the shapes).

  Example:
    >>> def loss_fn(params, batch):
    ...   x, labels = batch
    ...   logits = kl.register_dense(x @ params["w"] + params["b"], x,
    ...                              params["w"], params["b"])
    ...   kl.register_categorical_predictive_distribution(logits, labels)
    ...   return optax.softmax_cross_entropy_with_integer_labels(
    ...       logits, labels).mean()
  """
  params = (w,) if b is None else (w, b)
  tag_checks.check_dense_shapes(y, x, w, b)
  return _layer_tag("fully_connected", y, (x,), params, "register_dense",
                    approx=approx)


register_fully_connected = register_dense


def register_conv(y, x, w, b=None, *, window_strides, padding,
                  rhs_dilation=None, lhs_dilation=None,
                  dimension_numbers=None, feature_group_count: int = 1,
                  approx: Optional[str] = None):
  """Tags ``y = lax.conv_general_dilated(x, w, ...) + b`` (1-, 2-, 3-D).

  The KFC approximation (Grosse & Martens 2016, eq. 23) is
  :math:`F \\approx |\\mathcal{T}|\\, \\Omega \\otimes \\Gamma` with
  :math:`\\Omega` the second moment of the input patches and
  :math:`\\Gamma` that of the output gradients, both averaged over examples
  and the :math:`|\\mathcal{T}|` spatial locations.

  Args:
    y: the convolution output (plus bias). Returned unchanged.
    x: the convolution input.
    w: the kernel, ``[*spatial, c_in, c_out]`` in the default layout.
    b: optional bias ``[c_out]``.
    window_strides: as for ``lax.conv_general_dilated``.
    padding: ``"SAME"``, ``"VALID"`` or explicit ``(low, high)`` pairs.
    rhs_dilation: the kernel dilation, as for ``lax.conv_general_dilated``.
    lhs_dilation: the input dilation, as for ``lax.conv_general_dilated``.
    dimension_numbers: as for ``lax.conv_general_dilated``: layout strings
      such as ``("NHWC", "HWIO", "NHWC")``, or None for lax's default.
    feature_group_count: as for ``lax.conv_general_dilated``; a grouped
      convolution with ``1 < feature_group_count < C`` is refused.
    approx: ``kron`` (default), ``diagonal``, ``kron_sua`` or ``ekfac``
      (``APPROXIMATIONS["conv"]``). None: the collection's default.

  Returns:
    ``y``, unchanged in value and gradient.

  Raises:
    ValueError: if the shapes or the convolution arguments are inconsistent
      (the message names the argument, its value and what was expected).

  Example:
    >>> dn = ("NHWC", "HWIO", "NHWC")
    >>> y = lax.conv_general_dilated(x, w, (1, 1), "SAME",
    ...                              dimension_numbers=dn) + b
    >>> y = kl.register_conv(y, x, w, b, window_strides=(1, 1),
    ...                      padding="SAME", dimension_numbers=dn)
  """
  params = (w,) if b is None else (w, b)
  tag_checks.check_conv_shapes(
      y, x, w, b, window_strides=window_strides, padding=padding,
      rhs_dilation=rhs_dilation, lhs_dilation=lhs_dilation,
      dimension_numbers=dimension_numbers,
      feature_group_count=feature_group_count)
  return _layer_tag(
      "conv", y, (x,), params, "register_conv", **conv_meta_kwargs(
          window_strides=window_strides, padding=padding,
          rhs_dilation=rhs_dilation, lhs_dilation=lhs_dilation,
          dimension_numbers=dimension_numbers,
          feature_group_count=feature_group_count), approx=approx)


def conv_meta_kwargs(*, window_strides, padding, rhs_dilation=None,
                     lhs_dilation=None, dimension_numbers=None,
                     feature_group_count: int = 1) -> dict:
  """The normalised convolution metadata that ``register_conv`` stores.

  Shared with the scanner's automatic detection, so a recognised
  ``conv_general_dilated`` carries exactly the metadata a manual tag with the
  same arguments would.
  """
  if isinstance(dimension_numbers, jax.lax.ConvDimensionNumbers):
    dimension_numbers = tuple(tuple(d) for d in dimension_numbers)
  return dict(
      window_strides=tuple(window_strides),
      padding=padding if isinstance(padding, str) else tuple(
          tuple(p) for p in padding),
      rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
      lhs_dilation=None if lhs_dilation is None else tuple(lhs_dilation),
      dimension_numbers=dimension_numbers,
      feature_group_count=int(feature_group_count))


def layer_meta(**kwargs) -> tuple:
  """A tag's static metadata tuple, as the ``register_*`` functions build it."""
  return _static_meta(**kwargs)


register_convolution = register_conv


def _strides_2d(strides, name: str, fn: str):
  given = strides
  strides = tuple(strides) if isinstance(strides, (list, tuple)) else (
      strides, strides)
  if len(strides) == 4:
    strides = strides[1:3]
  if len(strides) != 2 or not all(
      isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 1
      for s in strides):
    raise ValueError(
        f"{fn}: {name}={given!r}; expected positive ints: one for both "
        "axes, 2 spatial values or TF's 4-element form [1, sh, sw, 1].")
  return strides


def _check_data_format(data_format, fn: str):
  if data_format not in ("NHWC", "NCHW"):
    raise ValueError(f"{fn}: data_format={data_format!r}; use 'NHWC' or "
                     "'NCHW'.")


def register_conv2d(y, x, w, b=None, *, strides, padding, dilations=None,
                    data_format: str = "NHWC", approx: Optional[str] = None):
  """Tags a 2-D convolution, with TensorFlow's argument names.

  The same layer and approximations as :func:`register_conv`, whose
  arguments this converts (``strides`` -> ``window_strides``,
  ``dilations`` -> ``rhs_dilation``, ``data_format`` -> the dimension
  numbers with an ``HWIO`` kernel).

  Args:
    y: the convolution output (plus bias). Returned unchanged.
    x: the input, ``[B, H, W, C]`` (``NHWC``) or ``[B, C, H, W]``.
    w: the kernel ``[h, w, c_in, c_out]`` (``HWIO``).
    b: optional bias ``[c_out]``.
    strides: an int, 2 spatial values, or TF's ``[1, sh, sw, 1]``.
    padding: ``"SAME"``, ``"VALID"`` or explicit pairs.
    dilations: the kernel dilation, in the form of ``strides``; None for 1.
    data_format: ``"NHWC"`` (default) or ``"NCHW"``.
    approx: as for :func:`register_conv`.

  Returns:
    ``y``, unchanged in value and gradient.

  Raises:
    ValueError: for a ``data_format`` other than ``NHWC``/``NCHW``, or
      ``strides``/``dilations`` of the wrong length.

  Example:
    >>> y = kl.register_conv2d(y, x, w, b, strides=1, padding="SAME")
  """
  fn = "register_conv2d"
  _check_data_format(data_format, fn)
  dn = (data_format, "HWIO", data_format)
  return register_conv(
      y, x, w, b, window_strides=_strides_2d(strides, "strides", fn),
      padding=padding,
      rhs_dilation=None if dilations is None else _strides_2d(
          dilations, "dilations", fn),
      dimension_numbers=dn, approx=approx)


def register_depthwise_conv2d(y, x, w, *, strides, padding, rate=None,
                              data_format: str = "NHWC",
                              approx: Optional[str] = None):
  """Tags a depthwise 2-D convolution with kernel ``[h, w, C, M]``.

  The block works on the equivalent dense filter ``[h, w, C, C*M]`` that is
  zero off the channel diagonal (TF K-FAC ``DepthwiseConv*FB``).

  Args:
    y: the convolution output. Returned unchanged.
    x: the input, ``[B, H, W, C]`` (``NHWC``) or ``[B, C, H, W]``.
    w: the depthwise kernel ``[h, w, C, M]`` (``M`` channels per input
      channel).
    strides: an int, 2 spatial values, or TF's ``[1, sh, sw, 1]``.
    padding: ``"SAME"``, ``"VALID"`` or explicit pairs.
    rate: the kernel dilation, in the form of ``strides``; None for 1.
    data_format: ``"NHWC"`` (default) or ``"NCHW"``.
    approx: ``diagonal`` (default) or ``kron``.

  Returns:
    ``y``, unchanged in value and gradient.

  Raises:
    ValueError: for a ``data_format`` other than ``NHWC``/``NCHW``, or
      ``strides``/``rate`` of the wrong length.

  Example:
    >>> y = kl.register_depthwise_conv2d(y, x, w, strides=1, padding="SAME")
  """
  fn = "register_depthwise_conv2d"
  kw = _depthwise_kwargs(fn, strides, padding, rate, data_format)
  tag_checks.check_depthwise_shapes(fn, y, x, w, **kw)
  return _layer_tag("depthwise_conv", y, (x,), (w,), fn,
                    window_strides=kw["strides"], padding=padding,
                    rhs_dilation=kw["rate"], data_format=data_format,
                    approx=approx)


def _depthwise_kwargs(fn, strides, padding, rate, data_format) -> dict:
  """The checked depthwise arguments, as the shape checks take them."""
  _check_data_format(data_format, fn)
  return dict(strides=_strides_2d(strides, "strides", fn), padding=padding,
              rate=None if rate is None else _strides_2d(rate, "rate", fn),
              data_format=data_format)


def register_separable_conv2d(y, x, depthwise_w, pointwise_w, depthwise_y,
                              b=None, *, strides, padding, rate=None,
                              data_format: str = "NHWC",
                              approx: Optional[str] = None):
  """Tags a separable conv: a depthwise conv, then a 1x1 pointwise conv.

  One tag covers both parts. The pointwise part is a 1x1 convolution on
  ``depthwise_y`` (``approx``: ``kron`` or ``diagonal``); the depthwise part
  gets the ``diagonal`` block of ``register_depthwise_conv2d``, its output
  gradient recovered as :math:`g_{dw} = g_y W_{pw}^T` (the 1x1 conv's
  transpose), so ``depthwise_y`` needs no tag of its own.

  Args:
    y: the output of the pointwise convolution (plus bias). Returned
      unchanged.
    x: the input of the depthwise convolution, ``[B, H, W, C]`` (``NHWC``)
      or ``[B, C, H, W]``.
    depthwise_w: the depthwise kernel ``[h, w, C, M]``.
    pointwise_w: the pointwise kernel ``[1, 1, C*M, c_out]``.
    depthwise_y: the depthwise convolution's output (the pointwise input).
    b: optional bias ``[c_out]``.
    strides: an int, 2 spatial values, or TF's ``[1, sh, sw, 1]``.
    padding: ``"SAME"``, ``"VALID"`` or explicit pairs.
    rate: the depthwise kernel's dilation; None for 1.
    data_format: ``"NHWC"`` (default) or ``"NCHW"``.
    approx: the pointwise part's block, ``kron`` (default) or ``diagonal``.

  Returns:
    ``y``, unchanged in value and gradient.

  Raises:
    ValueError: for a ``data_format`` other than ``NHWC``/``NCHW``, or
      ``strides``/``rate`` of the wrong length.

  Example:
    >>> y = kl.register_separable_conv2d(y, x, dw, pw, dy, b, strides=1,
    ...                                  padding="SAME")
  """
  fn = "register_separable_conv2d"
  kw = _depthwise_kwargs(fn, strides, padding, rate, data_format)
  tag_checks.check_separable_shapes(y, x, depthwise_w, pointwise_w,
                                    depthwise_y, b, **kw)
  params = (depthwise_w, pointwise_w) + (() if b is None else (b,))
  return _layer_tag(
      "separable_conv", y, (x, depthwise_y), params, fn,
      window_strides=kw["strides"], padding=padding, rhs_dilation=kw["rate"],
      data_format=data_format, approx=approx)


def register_embedding(y, ids, table, *, approx: Optional[str] = None):
  """Tags an embedding lookup ``y = table[ids]``.

  The input factor is the diagonal of lookup frequencies
  :math:`A = \\mathrm{diag}(E[\\mathrm{counts}])` (exact when each example
  looks up one id), the output factor :math:`G = E[g g^T]` is dense. No
  ``vocab x vocab`` matrix is ever built.

  Args:
    y: the looked-up embeddings, ``ids.shape + (d,)``.
    ids: integer ids, ``[B]`` or ``[B, k]``.
    table: the ``[vocab, d]`` table.
    approx: ``kron`` (default; ``kron_indep`` when used several times).

  Returns:
    ``y``, unchanged in value and gradient.

  Raises:
    TypeError: if ``ids`` are not integers.
    ValueError: if ``table`` is not ``[vocab, d]``, ``y`` is not
      ``ids.shape + (d,)``, or concrete ``ids`` fall outside the table.

  Example:
    >>> y = kl.register_embedding(table[ids], ids, table)
  """
  tag_checks.check_embedding(y, ids, table)
  return _layer_tag("embedding", y, (ids,), (table,), "register_embedding",
                    approx=approx)


def register_scale_and_shift(y, x, scale, shift=None, *,
                             approx: Optional[str] = None):
  """Tags ``y = x * scale + shift`` (LayerNorm, BatchNorm, RMSNorm params).

  Args:
    y: the output. Returned unchanged.
    x: the normalised input, broadcast against ``scale``.
    scale: the scale parameter.
    shift: optional shift parameter.
    approx: ``full`` (default) or ``diagonal``.

  Returns:
    ``y``, unchanged in value and gradient.

  Raises:
    ValueError: for an ``approx`` that is not one of the kind's (at scan
      time).

  Example:
    >>> y = kl.register_scale_and_shift(x_hat * scale + shift, x_hat, scale,
    ...                                 shift)
  """
  params = (scale,) if shift is None else (scale, shift)
  tag_checks.check_scale_and_shift(y, x, scale, shift)
  return _layer_tag("scale_and_shift", y, (x,), params,
                    "register_scale_and_shift", approx=approx)


def register_generic(params, *, approx: Optional[str] = None):
  """Registers parameters without layer structure (naive diagonal or full).

  The Fisher block is estimated from the parameters' own gradients,
  :math:`F \\approx \\frac{1}{B} (\\sum_b g_b)(\\sum_b g_b)^T` (TF K-FAC's
  ``NaiveFullFB`` / ``NaiveDiagonalFB``).

  Several leaves make *one* block over their concatenation (linked
  parameters, TF K-FAC's ``define_linked_parameters``; by path from
  outside the model: :func:`~kfac_jax_lite.link_parameters`).

  Args:
    params: an array, or a pytree of arrays, that are parameter leaves.
    approx: ``diagonal`` (default) or ``full``.

  Returns:
    ``params``, unchanged in value and gradient.

  Raises:
    ValueError: if ``params`` holds no arrays.

  Example:
    >>> temperature = kl.register_generic(params["temperature"])
  """
  leaves, treedef = jax.tree.flatten(params)
  if not leaves:
    raise ValueError(
        f"register_generic: params={params!r} holds no arrays; pass the "
        "parameter array (or a pytree of them), e.g. "
        "register_generic(params['w']).")
  out = _layer_tag("generic", leaves[0], (), tuple(leaves),
                   "register_generic", approx=approx)
  return jax.tree.unflatten(treedef, [out, *leaves[1:]])


# --------------------------------------------------------------------------
# Loss registration functions.
# --------------------------------------------------------------------------


def _check_mask(z, mask, fn):
  _check_array("mask", mask, fn)
  lead = z.shape[:-1] if z.ndim >= 2 else z.shape
  try:
    ok = np.broadcast_shapes(tuple(mask.shape), tuple(lead)) == tuple(lead)
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
        f"{fn}: mask has shape {tuple(mask.shape)}, which does not "
        f"broadcast to the leading shape {tuple(lead)} of z "
        f"{tuple(z.shape)} (every axis but the last). Give one entry per "
        "position, e.g. a [B, T] mask for [B, T, V] logits.")


def _loss_tag(kind, z, targets, fn, mask=None, **meta):
  _check_array("logits/mean", z, fn)
  if kind == "categorical" and z.ndim < 2:
    raise ValueError(
        f"{fn}: logits have shape {tuple(z.shape)}; they need a leading "
        "(batch) axis and the class axis last, [..., V].")
  operands = (z,) if targets is None else (z, targets)
  if targets is not None:
    _check_array("targets", targets, fn)
    tag_checks.check_loss_targets(fn, kind, z, targets)
  if mask is not None:
    _check_mask(z, mask, fn)
    operands += (mask,)
  for k in ("weight", "var"):
    if k in meta:
      v = meta[k]
      if isinstance(v, jax.core.Tracer) or not isinstance(
          v, (int, float)) or isinstance(v, bool):
        raise TypeError(
            f"{fn}: {k}={v!r} must be a Python float (a static value).")
      if v <= 0:
        raise ValueError(f"{fn}: {k}={v!r} must be positive.")
      meta[k] = float(v)
  if mask is not None:
    meta["has_mask"] = True
  return loss_tag_p.bind(*operands, kind=kind, meta=_static_meta(
      has_targets=targets is not None, **meta))


def register_categorical_predictive_distribution(logits, targets=None, *,
                                                 weight: float = 1.0,
                                                 mask=None):
  """Registers a categorical distribution over the last axis of ``logits``.

  The registered loss is the mean over every leading position of
  ``logits: [..., V]`` (the batch, and for sequences the time axis too),
  ``optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  .mean()``: ``[B, T, V]`` and its flattening ``[B·T, V]`` give the same
  curvature. A flattened tag keeps each example's positions together (row
  ``b·T + t``, as ``reshape(-1, V)`` does). One position's Fisher is
  :math:`F_R = \\mathrm{diag}(p) - p p^T`, :math:`p = \\mathrm{softmax}(z)`.

  Args:
    logits: ``[..., V]``, at least 2-D.
    targets: integer class ids of the leading shape (for ``empirical``).
    weight: multiplies this loss's contribution (``weight · mean``).
    mask: optional, broadcastable to the leading shape (0 drops a
      position): the mean is over the kept positions, ``Σ_n m_n nll_n /
      Σ_n m_n``, counted in this batch (per device under data
      parallelism).

  Returns:
    ``logits``, unchanged.

  Raises:
    ValueError: for a mask that does not broadcast to the leading shape,
      a non-positive ``weight`` or ``var``, or (categorical) 1-D logits.
    TypeError: if ``weight`` or ``var`` is not a Python float.

  Example:
    >>> logits = kl.register_categorical_predictive_distribution(
    ...     logits, labels)             # logits [B, V] or [B, T, V]
  """
  return _loss_tag("categorical", logits, targets,
                   "register_categorical_predictive_distribution",
                   mask=mask, weight=weight)


register_softmax_cross_entropy_loss = (
    register_categorical_predictive_distribution)


def register_normal_predictive_distribution(mean, targets=None, *,
                                            var: float = 0.5,
                                            weight: float = 1.0,
                                            mask=None):
  """Registers a Normal with fixed scalar variance ``var`` around ``mean``.

  ``mean: [..., d]``: the last axis is one position's ``d`` coordinates,
  every other axis indexes positions (a 1-D ``mean`` is ``N`` positions of
  one coordinate). The registered loss is the mean over the positions of
  the per-position NLL; with ``var=0.5`` (up to a constant)
  ``jnp.sum((mean - targets) ** 2, axis=-1).mean()``. ``[B, T, d]`` and
  ``[B·T, d]`` give the same curvature. :math:`F_R = I / \\mathrm{var}`.

  Args:
    mean: ``[..., d]`` (or ``[N]``).
    targets: values of ``mean``'s shape (for ``empirical``).
    var: the fixed variance (a Python float).
    weight: multiplies this loss's contribution (``weight · mean``).
    mask: optional, broadcastable to the leading shape ``mean.shape[:-1]``
      (0 drops a position): the mean over the kept positions of this
      batch, as for the categorical tag.

  Returns:
    ``mean``, unchanged.

  Raises:
    ValueError: for a mask that does not broadcast to the leading shape,
      a non-positive ``weight`` or ``var``, or (categorical) 1-D logits.
    TypeError: if ``weight`` or ``var`` is not a Python float.

  Example:
    >>> y_hat = kl.register_normal_predictive_distribution(y_hat, y)
    >>> loss = jnp.sum((y_hat - y) ** 2, axis=-1).mean()
  """
  return _loss_tag("normal", mean, targets,
                   "register_normal_predictive_distribution",
                   mask=mask, var=var, weight=weight)


register_squared_error_loss = register_normal_predictive_distribution


def register_multi_bernoulli_predictive_distribution(logits, targets=None, *,
                                                     weight: float = 1.0,
                                                     mask=None):
  """Registers independent Bernoullis with the given logits.

  ``logits: [..., d]`` (or ``[N]``) as for the Normal tag: the registered
  loss is ``optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1)
  .mean()``, the mean over the leading positions.
  :math:`F_R = \\mathrm{diag}(p (1 - p))`, :math:`p = \\sigma(z)`.

  Args:
    logits: ``[..., d]`` (or ``[N]``).
    targets: 0/1 values of ``logits``' shape (for ``empirical``).
    weight: multiplies this loss's contribution (``weight · mean``).
    mask: optional, broadcastable to the leading shape (0 drops a
      position), as for the categorical tag.

  Returns:
    ``logits``, unchanged.

  Raises:
    ValueError: for a mask that does not broadcast to the leading shape,
      a non-positive ``weight`` or ``var``, or (categorical) 1-D logits.
    TypeError: if ``weight`` or ``var`` is not a Python float.

  Example:
    >>> logits = kl.register_multi_bernoulli_predictive_distribution(
    ...     logits, pixels)
  """
  return _loss_tag("multi_bernoulli", logits, targets,
                   "register_multi_bernoulli_predictive_distribution",
                   mask=mask, weight=weight)


register_sigmoid_cross_entropy_loss = (
    register_multi_bernoulli_predictive_distribution)


def register_loss_function(z, targets=None, *, loss_fn: Callable,
                           weight: float = 1.0, mask=None,
                           sampler: Optional[Callable] = None):
  """Registers a loss given by a function of one position's outputs.

  ``z: [..., E]``: every leading axis indexes positions (examples, time
  steps), the last is one position's ``E`` outputs (a 1-D ``z`` is ``N``
  positions of one output). The registered loss is the mean over the
  positions, ``jnp.mean(vmap(loss_fn)(z_n, y_n))`` (over the kept
  positions with a ``mask``), as for the other loss tags, and its
  curvature the generalised Gauss-Newton matrix of that mean,

  .. math:: G = \\frac{w}{N} \\sum_n m_n J_n^T H_n J_n,\\quad
     H_n = \\nabla_z^2\\, \\mathrm{loss\\_fn}(z_n, y_n)

  from autodiff Hessians (:mod:`kfac_jax_lite.custom_losses`): estimation
  modes ``exact_GGN``, ``curvature_prop_GGN`` (an eigendecomposition of each
  ``H_n``, for ``E`` up to ``custom_losses.MAX_FACTOR_SIZE``) and
  ``empirical``; ``gradients`` needs ``sampler``; ``exact`` and
  ``curvature_prop`` raise (a loss function has no Fisher of its own).

  Args:
    z: the model outputs the loss is a function of, ``[..., E]`` or ``[N]``.
      Returned unchanged.
    targets: optional, with z's leading shape first (``y_n = targets[n]``,
      any trailing shape and dtype); without, ``loss_fn`` gets ``None``.
    loss_fn: ``loss_fn(z_n, y_n) -> scalar`` for one position (``z_n`` of
      shape ``[E]``, or ``()`` for a 1-D ``z``). A static value: a
      module-level function or one closing over Python constants only
      (it is called again outside this trace); convex in ``z_n`` for a
      positive semi-definite ``H_n`` (a negative eigenvalue is clipped).
    weight: multiplies this loss's contribution (``weight · mean``).
    mask: optional, broadcastable to the leading shape (0 drops a
      position), as for the categorical tag.
    sampler: optional ``sampler(key, z_n) -> y_n`` drawing a target from
      the model's predictive distribution (``key`` a raw ``uint32[2]``
      jax.random key), for ``estimation_mode="gradients"`` and
      :func:`~kfac_jax_lite.eval_losses_on_samples`.

  Returns:
    ``z``, unchanged.

  Raises:
    TypeError: if ``loss_fn``/``sampler`` is not a function or closes
      over a traced array.
    ValueError: if ``loss_fn`` of one position is not a scalar, or the
      targets' leading shape is not z's.

  Example:
    >>> def poisson(z, y):  # z: [] log-rate of one position
    ...   return jnp.exp(z) - y * z
    >>> z = register_loss_function(model(params, x)[:, 0], counts,
    ...                            loss_fn=poisson)
    >>> loss = jnp.mean(jnp.exp(z) - counts * z)
  """
  fn = "register_loss_function"
  _check_array("z", z, fn)
  if targets is not None:
    _check_array("targets", targets, fn)
  tag_checks.check_loss_function(z, targets, loss_fn, sampler, fn)
  return _loss_tag("custom", z, targets, fn, mask=mask, weight=weight,
                   loss_fn=loss_fn, sampler=sampler)
