"""Recognising untagged layers, one jaxpr equation at a time."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kfac_jax_lite import tags
from kfac_jax_lite.scanner.facts import aval
from kfac_jax_lite.scanner.facts import Draft
from kfac_jax_lite.scanner.facts import fits_features
from kfac_jax_lite.scanner.facts import Prov
from kfac_jax_lite.scanner.facts import site_out
from kfac_jax_lite.scanner.facts import strip
from kfac_jax_lite.scanner.facts import tail


class Matcher:
  """Recognises one equation as (part of) an untagged layer.

  ``match()`` returns the output facts when the equation starts, extends or
  rejects-with-a-reason a layer, or ``None`` to let the walk treat it as an
  ordinary op.
  """

  def __init__(self, walker, eqn, ins, key, lv, scan_lengths):
    self.w, self.eqn, self.ins, self.key, self.lv = walker, eqn, ins, key, lv
    self.scan_lengths = scan_lengths
    self.name = eqn.primitive.name

  def match(self):
    fn = {"dot_general": self._dot, "conv_general_dilated": self._conv,
          "gather": self._gather, "mul": self._mul, "div": self._div,
          "add": self._add, "add_any": self._add,
          "convert_element_type": self._convert, "iota": self._iota,
          "eq": self._eq}.get(self.name)
    return None if fn is None else fn()

  # ---- helpers -----------------------------------------------------------
  def _reject(self, reason):
    return [self.w.mix(self.ins, self.name, self.key,
                       f"{reason} (`{self.name}` at {self.key})")]

  def _start(self, kind, p_w, x_prov, record, input_avals, meta, feat,
             factors=None, batched=True):
    y = self.eqn.outvars[0]
    d = Draft(kind=kind, key=self.key, leaves=(p_w.leaf,), meta=meta, y=y,
              record=record, input_avals=input_avals, stack=p_w.stack,
              upstream=frozenset().union(*[p.sites for p in x_prov]),
              raw_in=frozenset().union(*[p.raw for p in x_prov]),
              dep_leaves=frozenset().union(*[p.leaves for p in x_prov])
              | p_w.leaves, feat=feat, factors=factors,
              batched=batched)
    self.lv.drafts[y] = d
    return [site_out(d)]

  def _move(self, d: Draft, **changes):
    """Moves draft ``d`` onto this equation's output."""
    del self.lv.drafts[d.y]
    y = self.eqn.outvars[0]
    d = dataclasses.replace(d, key=self.key, y=y, **changes)
    self.lv.drafts[y] = d
    return [site_out(d)]

  @staticmethod
  def _input_problem(p_x):
    # An input may depend on the layer's own parameters through recognised
    # uses (RNN steps, a scan over stacked layers): each use is one site.
    if p_x.is_view:
      return "its input is itself a parameter"
    if not p_x.batched:
      return "its input does not depend on the batch"
    return None

  # ---- dense and one-hot embedding ---------------------------------------
  def _dot(self):
    (lc, rc), (lb, rb) = self.eqn.params["dimension_numbers"]
    p_x, p_w = self.ins
    x, w = self.eqn.invars
    if not p_w.is_view:
      if p_x.is_view:
        return self._reject(
            "the parameter is dot_general's left operand, so the output's "
            "feature axes are not trailing; write x @ w")
      return None
    if p_x.is_view:
      return self._reject("a product of two parameters is not a layer")
    problem = self._input_problem(p_x)
    if problem:
      return self._reject(f"dot_general is not a dense layer: {problem}")
    if lb or rb:
      return self._reject("dot_general with batch dimensions is not a dense "
                          "layer")
    if p_w.view not in ("flat", "T"):
      return self._reject("the kernel is a broadcast or reshaped view of the "
                          "parameter, not its elements in order")
    nx, k = len(x.aval.shape), len(rc)
    trailing = tuple(lc) == tuple(range(nx - k, nx)) and nx > k
    base = self.w.base_shape(p_w)
    if p_w.view == "flat" and trailing and tuple(rc) == tuple(range(k)):
      if p_x.data == "onehot" and k == 1 and tuple(w.aval.shape) == base:
        return self._start(
            "embedding", p_w, [p_x],
            lambda read, x=x: (jnp.argmax(read(x), axis=-1).astype(
                jnp.int32),),
            (aval(x.aval.shape[:-1], jnp.int32),), tags.layer_meta(
                approx=None), None)
      d_in = math.prod(w.aval.shape[:k])
      shape = tuple(x.aval.shape[:nx - k]) + (d_in,)
      # A kernel other than [d_in, d_out] (DenseGeneral, attention) says how
      # many of its leading axes are inputs; the block reshapes it to 2-D.
      in_axes = next((j for j in range(len(base) + 1)
                      if math.prod(base[:j]) == d_in), None)
      if in_axes is None:
        return self._reject(
            f"the kernel of shape {tuple(w.aval.shape)} is a reshape of the "
            f"parameter {base} that does not split it into input and output "
            "axes")
      extra = {} if (len(base), in_axes) == (2, 1) else {
          "kernel_in_axes": in_axes}
      meta = tags.layer_meta(approx=None, **extra)
      return self._start(
          "fully_connected", p_w, [p_x],
          lambda read, x=x, shape=shape: (read(x).reshape(shape),),
          (aval(shape, x.aval.dtype),), meta, tuple(w.aval.shape[k:]))
    transposed = (p_w.view == "T" and tuple(rc) == (0,)) or (
        p_w.view == "flat" and tuple(w.aval.shape) == base
        and len(base) == 2 and tuple(rc) == (1,))
    if transposed and trailing:
      # z = x @ table.T: the output projection of a tied embedding, a layer
      # only together with a lookup of the same table (see collect.py).
      return self._start(
          "tied_embedding", p_w, [p_x], lambda read, x=x: (read(x),),
          (aval(x.aval.shape, x.aval.dtype),), tags.layer_meta(approx=None),
          None)
    return self._reject(
        f"dot_general contracts kernel axes {tuple(rc)} with input axes "
        f"{tuple(lc)}; a dense layer contracts the input's trailing axes "
        "with the kernel's leading axes")

  # ---- convolution -------------------------------------------------------
  def _conv(self):
    p_x, p_w = self.ins
    x, w = self.eqn.invars
    prm = self.eqn.params
    if not p_w.is_view:
      return self._reject("the convolution's input is a parameter") if (
          p_x.is_view) else None
    if p_w.view != "flat" or tuple(w.aval.shape) != self.w.base_shape(p_w):
      return self._reject("the conv kernel is not the parameter leaf itself "
                          "(it is reshaped or broadcast)")
    problem = self._input_problem(p_x)
    if problem:
      return self._reject(f"conv_general_dilated is not a layer: {problem}")
    if prm["batch_group_count"] != 1:
      return self._reject(
          f"batch_group_count={prm['batch_group_count']} has no block")
    dn = prm["dimension_numbers"]
    groups = int(prm["feature_group_count"])
    c_in = x.aval.shape[dn.lhs_spec[1]]
    if groups == 1:
      kind = "conv"
    elif groups == c_in:
      # Depthwise: the kernel is [*spatial, 1, C*M] in the rhs layout; the
      # depthwise block reads it as [*spatial, C, M] (blocks/depthwise.py).
      kind = "depthwise_conv"
    else:
      return self._reject(
          f"grouped convolution (feature_group_count={groups}, {c_in} input "
          "channels) has no block; only 1 (conv) or C_in (depthwise)")
    meta = tags.layer_meta(approx=None, **tags.conv_meta_kwargs(
        window_strides=prm["window_strides"], padding=prm["padding"],
        rhs_dilation=prm["rhs_dilation"], lhs_dilation=prm["lhs_dilation"],
        dimension_numbers=dn, feature_group_count=groups))
    y_shape = self.eqn.outvars[0].aval.shape
    feat = ((y_shape[-1],) if dn.out_spec[1] == len(y_shape) - 1 else None)
    return self._start(kind, p_w, [p_x], lambda read, x=x: (read(x),),
                       (aval(x.aval.shape, x.aval.dtype),), meta, feat)

  # ---- gather embedding --------------------------------------------------
  def _gather(self):
    p_t, p_i = self.ins
    t, ids = self.eqn.invars
    if not p_t.is_view:
      return None
    dn, prm = self.eqn.params["dimension_numbers"], self.eqn.params
    out_nd = len(self.eqn.outvars[0].aval.shape)
    shape = tuple(t.aval.shape)
    row_lookup = (
        p_t.view == "flat" and shape == self.w.base_shape(p_t)
        and len(shape) == 2 and tuple(dn.offset_dims) == (out_nd - 1,)
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and not tuple(dn.operand_batching_dims)
        and tuple(prm["slice_sizes"]) == (1, shape[1])
        and ids.aval.shape and ids.aval.shape[-1] == 1)
    if not row_lookup:
      return self._reject("gather does not look up whole rows of a 2-D "
                          "table by integer ids")
    problem = self._input_problem(p_i)
    if problem:
      return self._reject(f"gather is not an embedding: {problem}")
    return self._start(
        "embedding", p_t, [p_i], lambda read, ids=ids: (read(ids)[..., 0],),
        (aval(ids.aval.shape[:-1], ids.aval.dtype),),
        tags.layer_meta(approx=None), None)

  # ---- scale-and-shift chains and biases ---------------------------------
  def _mul(self):
    (a, b), (pa, pb) = self.eqn.invars, self.ins
    y_shape = tuple(self.eqn.outvars[0].aval.shape)
    for (u, _pu), (v, pv) in (((a, pa), (b, pb)), ((b, pb), (a, pa))):
      d = self.lv.sole_draft(u)
      if (d is not None and d.factors is not None and not pv.is_view
          and tail(y_shape, len(d.feat)) == d.feat):
        return self._move(d, factors=d.factors + ((v, "mul"),),
                          raw_in=d.raw_in | pv.raw,
                          upstream=d.upstream | pv.sites,
                          dep_leaves=d.dep_leaves | pv.leaves,
                          batched=d.batched or pv.batched)
    for (s, ps), (x, px) in (((b, pb), (a, pa)), ((a, pa), (b, pb))):
      if not ps.is_view or px.is_view:
        continue
      feat = strip(self.w.base_shape(ps))
      if (len(y_shape) > len(feat)
          and fits_features(ps, s.aval.shape, feat, y_shape)):
        # The record is built from the final factors when the site is
        # emitted (the chain may still grow).
        return self._start("scale_and_shift", ps, [px], None, (),
                           tags.layer_meta(approx=None), feat,
                           factors=((x, "mul"),), batched=px.batched)
    return None

  def _div(self):
    (a, b), (_, pb) = self.eqn.invars, self.ins
    d = self.lv.sole_draft(a)
    if d is None or d.factors is None or pb.is_view:
      return None
    return self._move(d, factors=d.factors + ((b, "div"),),
                      raw_in=d.raw_in | pb.raw, upstream=d.upstream | pb.sites,
                      dep_leaves=d.dep_leaves | pb.leaves,
                      batched=d.batched or pb.batched)

  def _convert(self):
    (x,), (px,) = self.eqn.invars, self.ins
    if px.data == "onehot":
      return [px]
    d = self.lv.sole_draft(x)
    return None if d is None else self._move(d)

  def _add(self):
    (a, b), (pa, pb) = self.eqn.invars, self.ins
    y_shape = tuple(self.eqn.outvars[0].aval.shape)
    for (u, _), (v, pv) in (((a, pa), (b, pb)), ((b, pb), (a, pa))):
      d = self.lv.sole_draft(u)
      if (d is None or len(d.leaves) != 1 or not pv.is_view
          or pv.leaf in d.leaves or pv.stack != d.stack
          or not fits_features(pv, v.aval.shape, d.feat, y_shape)):
        continue
      if d.factors is not None and strip(
          self.w.base_shape(pv)) != d.feat:
        continue
      return self._move(d, leaves=d.leaves + (pv.leaf,), feat=None,
                        dep_leaves=d.dep_leaves | pv.leaves)
    return None

  # ---- one-hot encodings -------------------------------------------------
  def _iota(self):
    shape = self.eqn.params["shape"]
    if self.eqn.params["dimension"] == len(shape) - 1:
      return [Prov(data="iota")]
    return None

  def _eq(self):
    (a, b), (pa, pb) = self.eqn.invars, self.ins
    for (u, pu), (_, pv) in (((a, pa), (b, pb)), ((b, pb), (a, pa))):
      if (pv.data == "iota" and pu.batched and not pu.leaves
          and u.aval.shape and u.aval.shape[-1] == 1
          and jnp.issubdtype(u.aval.dtype, jnp.integer)):
        return [Prov(batched=True, sites=pu.sites, raw=pu.raw,
                     data="onehot")]
    return None


