"""Recognising untagged layers, one jaxpr equation at a time."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from kfac_jax_lite import tags
from kfac_jax_lite.scanner import forms
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
          "eq": self._eq, "transpose": self._transpose,
          "reshape": self._reshape, "squeeze": self._reshape,
          "expand_dims": self._reshape}.get(self.name)
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
    p_l, p_r = self.ins
    if p_l.is_view and p_r.is_view:
      return self._reject("a product of two parameters is not a layer")
    if not (p_l.is_view or p_r.is_view):
      return None
    left = p_l.is_view
    if left:
      (w, x), (p_w, p_x), wc, xc = self.eqn.invars, (p_l, p_r), lc, rc
    else:
      (x, w), (p_x, p_w), xc, wc = self.eqn.invars, (p_l, p_r), lc, rc
    problem = self._input_problem(p_x)
    if problem:
      return self._reject(f"dot_general is not a dense layer: {problem}")
    if lb or rb:
      return self._reject(
          "dot_general with batch dimensions on a parameter is not a dense "
          "layer (each batch entry would have its own weights)")
    if p_w.view not in ("flat", "T"):
      return self._reject("the kernel is a broadcast or reshaped view of the "
                          "parameter, not its elements in order")
    nx, k = len(x.aval.shape), len(wc)
    trailing = tuple(xc) == tuple(range(nx - k, nx)) and nx > k
    base = self.w.base_shape(p_w)
    if (not left and p_w.view == "flat" and trailing
        and tuple(wc) == tuple(range(k))):
      return self._dense_leading(p_w, p_x, w, x, k, base)
    return self._dense_any(p_w, p_x, w, x, wc, xc, left, base)

  def _dense_leading(self, p_w, p_x, w, x, k, base):
    """``x @ w``: the input's trailing axes with the kernel's leading ones
    (flax ``Dense``/``DenseGeneral``; a one-hot ``x`` is an embedding)."""
    nx = len(x.aval.shape)
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
          "axes; tag the layer with register_dense(y, x, w, b) on a 2-D "
          "view of the kernel")
    extra = {} if (len(base), in_axes) == (2, 1) else {
        "kernel_in_axes": in_axes}
    meta = tags.layer_meta(approx=None, **extra)
    return self._start(
        "fully_connected", p_w, [p_x],
        lambda read, x=x, shape=shape: (read(x).reshape(shape),),
        (aval(shape, x.aval.dtype),), meta, tuple(w.aval.shape[k:]))

  def _dense_any(self, p_w, p_x, w, x, wc, xc, left, base):
    """A dense layer in any operand order and contraction layout.

    ``w @ x`` (Equinox's ``Linear``, per example under ``vmap``), ``x @
    w.T``, ``einsum("oi,...i->...o", w, x)``: the site records the input as
    ``[..., d_in]`` (its free axes, then its contracted ones in the
    kernel's order) and perturbs the output through ``Site.to_out``, so
    that the statistics are those of ``x @ W`` with ``W`` the kernel's
    axes ordered ``[*contracted, *free]`` (``kernel_perm``).
    """
    nw = len(w.aval.shape)
    if tuple(w.aval.shape) != tuple(base if p_w.view == "flat"
                                    else base[::-1]):
      return self._reject(
          f"the kernel of shape {tuple(w.aval.shape)} is a reshape of the "
          f"parameter {base} contracted on axes {tuple(wc)}; tag the layer "
          "with register_dense(y, x, w, b) on a 2-D view of the kernel")
    leaf_axis = (1, 0) if p_w.view == "T" else tuple(range(nw))
    w_free = [a for a in range(nw) if a not in wc]
    perm = tuple(leaf_axis[a] for a in wc) + tuple(
        leaf_axis[a] for a in w_free)
    nx = len(x.aval.shape)
    x_free = [a for a in range(nx) if a not in xc]
    if not x_free:
      return self._reject("dot_general is not a dense layer: its input has "
                          "no axis besides the contracted ones (no batch "
                          "axis)")
    x_perm = tuple(x_free) + tuple(xc)
    lead = tuple(x.aval.shape[a] for a in x_free)
    shape = lead + (math.prod(x.aval.shape[a] for a in xc),)
    feat = tuple(w.aval.shape[a] for a in w_free)
    canon = lead + feat
    out_perm = None
    if left:  # dot_general's output is [*w_free, *x_free].
      nl, nf = len(lead), len(feat)
      out_perm = tuple(nl + i for i in range(nf)) + tuple(range(nl))

    def record(read, x=x, x_perm=x_perm, shape=shape):
      v = read(x)
      if x_perm != tuple(range(len(x_perm))):
        v = jnp.transpose(v, x_perm)
      return (v.reshape(shape),)

    if perm == (1, 0):
      # A [d_out, d_in] kernel: a dense layer, or the output projection of
      # a tied embedding if the table is also looked up (facts.retype_sites).
      kind, meta = "tied_embedding", tags.layer_meta(approx=None)
    else:
      extra: dict[str, Any] = ({} if perm == tuple(range(nw))
                               else {"kernel_perm": perm})
      if (nw, len(wc)) != (2, 1):
        extra["kernel_in_axes"] = len(wc)
      kind, meta = "fully_connected", tags.layer_meta(approx=None, **extra)
    outs = self._start(kind, p_w, [p_x], record,
                       (aval(shape, x.aval.dtype),), meta, feat)
    d = self.lv.drafts[self.eqn.outvars[0]]
    d.canon, d.perm = canon, out_perm
    d.feat_at = 0 if left else None
    if out_perm is None:
      d.canon = None
    return outs

  # ---- moving a site through layout ops ----------------------------------
  def _transpose(self):
    """A transpose of a site's output (``vmap`` of ``w @ x`` puts the batch
    axis last): the site moves onto it, its layout composed."""
    (x,) = self.eqn.invars
    d = self.lv.sole_draft(x)
    if d is None or d.factors is not None:
      return None
    in_shape = tuple(x.aval.shape)
    canon = d.canon or in_shape
    old = d.perm or tuple(range(len(in_shape)))
    if tuple(canon[a] for a in old) != in_shape:
      return None   # A reshape is pending: not composable with a transpose.
    p = tuple(self.eqn.params["permutation"])
    perm = tuple(old[i] for i in p)
    feat, feat_at = _moved_features(d, in_shape, p.index)
    return self._move(d, feat=feat, **self._layout(canon, perm, feat_at))

  def _reshape(self):
    """A reshape that only adds or drops unit axes of a site's output
    (Equinox's vmapped conv): the site moves onto it."""
    (x,) = self.eqn.invars[:1]
    d = self.lv.sole_draft(x)
    if d is None or d.factors is not None:
      return None
    if self.name == "reshape" and self.eqn.params.get("dimensions"):
      return None
    in_shape = tuple(x.aval.shape)
    out_shape = tuple(self.eqn.outvars[0].aval.shape)
    big_in = [i for i, n in enumerate(in_shape) if n != 1]
    big_out = [i for i, n in enumerate(out_shape) if n != 1]
    if [in_shape[i] for i in big_in] != [out_shape[i] for i in big_out]:
      return None
    canon = d.canon or in_shape
    feat, feat_at = _moved_features(d, in_shape,
                                    dict(zip(big_in, big_out)).get)
    perm = d.perm or tuple(range(len(canon)))
    return self._move(d, feat=feat, **self._layout(canon, perm, feat_at))

  def _layout(self, canon, perm, feat_at):
    """Draft fields for output ``canon.transpose(perm).reshape(y)``."""
    y_shape = tuple(self.eqn.outvars[0].aval.shape)
    ident = perm == tuple(range(len(perm)))
    if ident and tuple(canon) == y_shape:
      canon = None
    return {"canon": canon, "perm": None if ident else perm,
            "feat_at": feat_at}

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
    c = dn.out_spec[1]   # The channel axis (last for flax, 1 for Equinox).
    outs = self._start(kind, p_w, [p_x], lambda read, x=x: (read(x),),
                       (aval(x.aval.shape, x.aval.dtype),), meta,
                       (y_shape[c],))
    self.lv.drafts[self.eqn.outvars[0]].feat_at = c
    return outs

  # ---- gather embedding --------------------------------------------------
  def _gather(self):
    p_t, p_i = self.ins
    t, ids = self.eqn.invars
    if not p_t.is_view:
      return None
    dn, prm = self.eqn.params["dimension_numbers"], self.eqn.params
    out_nd = len(self.eqn.outvars[0].aval.shape)
    shape = tuple(t.aval.shape)
    whole = (p_t.view == "flat" and shape == self.w.base_shape(p_t)
             and len(shape) == 2 and not tuple(dn.operand_batching_dims)
             and tuple(prm["slice_sizes"]) == (1, shape[1])
             and ids.aval.shape)
    row_lookup = (
        whole and tuple(dn.offset_dims) == (out_nd - 1,)
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,) and ids.aval.shape[-1] == 1)
    # Equinox's Embedding (weight[x] per example, under vmap): indices
    # (row, column) with a [1, d] slice: the column start can only be 0
    # (clamped, or promised in bounds).
    pair_lookup = (
        whole and tuple(dn.offset_dims) == (out_nd - 2, out_nd - 1)
        and not tuple(dn.collapsed_slice_dims)
        and tuple(dn.start_index_map) == (0, 1) and ids.aval.shape[-1] == 2
        and forms.gather_keeps_slices_in_bounds(self.eqn))
    if not (row_lookup or pair_lookup):
      return self._reject("gather does not look up whole rows of a 2-D "
                          "table by integer ids")
    problem = self._input_problem(p_i)
    if problem:
      return self._reject(f"gather is not an embedding: {problem}")
    outs = self._start(
        "embedding", p_t, [p_i], lambda read, ids=ids: (read(ids)[..., 0],),
        (aval(ids.aval.shape[:-1], ids.aval.dtype),),
        tags.layer_meta(approx=None), None)
    if pair_lookup:   # Output [..., 1, d]: canonical [..., d].
      self.lv.drafts[self.eqn.outvars[0]].canon = (
          tuple(ids.aval.shape[:-1]) + (shape[1],))
    return outs

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
          or not fits_features(pv, v.aval.shape, d.feat, y_shape,
                               d.feat_at)):
        continue
      if d.factors is not None and strip(
          self.w.base_shape(pv)) != d.feat:
        continue
      return self._move(d, leaves=d.leaves + (pv.leaf,), feat=None,
                        feat_at=None, dep_leaves=d.dep_leaves | pv.leaves)
    out = self._sum_of_layers(a, b, y_shape)
    if out is not None:
      return out
    for (u, pu), (_, pv) in (((a, pa), (b, pb)), ((b, pb), (a, pa))):
      if (pv.is_view and not pu.is_view and pu.sites and pu.batched
          and self.lv.sole_draft(u) is None and u not in self.lv.drafts):
        path = self.w.found.leaf_paths[pv.leaf]
        return self._reject(
            "added to a value computed from the output of the layer at "
            f"{sorted(pu.sites)[0]}, not to that output itself (e.g. to one "
            "gate's slice, as GRUCell's bias_n), so it is no layer's bias; "
            "a generic block serves it (approximations="
            f"{{{path!r}: 'full'}} for a dense one)")
    return None

  def _sum_of_layers(self, a, b, y_shape):
    """``W_1 x_1 + W_2 x_2`` (Equinox's ``LSTMCell``): the first layer's
    site moves onto the sum, so that a bias added next is its bias. The
    sum is linear with unit Jacobian in each term, so its output gradient
    is each layer's; the second layer's site stays where it is."""
    da, db = self.lv.sole_draft(a), self.lv.sole_draft(b)
    if (da is None or db is None or da is db or da.factors is not None
        or db.factors is not None or da.feat is None or da.feat != db.feat
        or da.feat_at != db.feat_at or da.canon != db.canon
        or da.perm != db.perm or da.stack != db.stack
        or not tuple(a.aval.shape) == tuple(b.aval.shape) == y_shape):
      return None
    return self._move(da, dep_leaves=da.dep_leaves | db.dep_leaves,
                      also=da.also | {db.key} | db.also)

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


def _moved_features(d: Draft, in_shape: tuple, new_axis) -> tuple:
  """``(feat, feat_at)`` of draft ``d`` once its output's axes move
  (``new_axis(a)``: where input axis ``a`` goes, None if dropped): the
  feature axes stay the layer's only while they stay together, in order."""
  if d.feat is None:
    return None, None
  m = len(d.feat)
  at = len(in_shape) - m if d.feat_at is None else d.feat_at
  pos = [new_axis(a) for a in range(at, at + m)]
  first = pos[0]
  if first is None or pos != list(range(first, first + m)):
    return None, None
  return d.feat, first
