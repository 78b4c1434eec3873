"""Convolution tags with TensorFlow's argument names.

:func:`register_conv2d`, :func:`register_depthwise_conv2d` and
:func:`register_separable_conv2d` take ``strides``, ``dilations`` /
``rate`` and ``data_format`` as TensorFlow's ``tf.nn`` functions do, check
them, and bind the layer tag of :mod:`kfac_jax_lite.tags`. The package
exports them (``kfac_jax_lite.register_conv2d``, ...).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kfac_jax_lite import tag_checks
from kfac_jax_lite import tags


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
  return tags.register_conv(
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
  return tags.layer_tag("depthwise_conv", y, (x,), (w,), fn,
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
  return tags.layer_tag(
      "separable_conv", y, (x, depthwise_y), params, fn,
      window_strides=kw["strides"], padding=padding, rhs_dilation=kw["rate"],
      data_format=data_format, approx=approx)
