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

The layers' ``register_*`` functions are here; the convolution tags with
TensorFlow's argument names are in :mod:`kfac_jax_lite.conv2d_tags` and the
loss tags in :mod:`kfac_jax_lite.loss_tags`. Those modules import this one,
never the reverse; every ``register_*`` function is exported by the package
itself (``kfac_jax_lite.register_conv2d``, ...).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.core  # jax.core.Tracer
import jax.numpy as jnp
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


def check_array(name: str, value, fn: str):
  """Raises the TypeError of a tag argument that is not an array."""
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    raise TypeError(
        f"{fn}: argument {name} must be an array, got {type(value).__name__}.")


def layer_tag(kind: str, y, inputs: Sequence[Any], params: Sequence[Any],
               fn: str, **meta):
  """Checks the arrays and binds the layer tag (the ``register_*``
  functions' common end)."""
  for i, a in enumerate((y, *inputs, *params)):
    check_array(("y", *[f"input{j}" for j in range(len(inputs))],
                 *[f"param{j}" for j in range(len(params))])[i], a, fn)
  return layer_tag_p.bind(
      y, *inputs, *params, kind=kind, n_inputs=len(inputs),
      meta=_static_meta(**meta))


def bind_loss_tag(operands: Sequence[Any], kind: str, **meta):
  """Binds the loss tag to ``operands`` (``z``, then the targets and the
  mask when given) with the static metadata ``meta``."""
  return loss_tag_p.bind(*operands, kind=kind, meta=_static_meta(**meta))


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
  return layer_tag("fully_connected", y, (x,), params, "register_dense",
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
    approx: ``kron`` (default), ``diagonal``, ``kron_sua``, ``ekfac`` or
      ``kron_reduce`` (``APPROXIMATIONS["conv"]``). None: the collection's
      default.

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
  return layer_tag(
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
  return layer_tag("embedding", y, (ids,), (table,), "register_embedding",
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
  return layer_tag("scale_and_shift", y, (x,), params,
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
  out = layer_tag("generic", leaves[0], (), tuple(leaves),
                  "register_generic", approx=approx)
  return jax.tree.unflatten(treedef, [out, *leaves[1:]])
