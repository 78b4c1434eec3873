"""The catalogue of bad inputs: each fails early with a clear message.

Every entry is one wrong call a user can make: a wrong shape or dtype at a
tag, a collection of another model, a bad hyperparameter, a state from
nowhere. Each must fail at ``scan``, at ``init``, at construction or while
the step is traced (never deep inside XLA, never as an ``AttributeError``
or a reshape error), with a message that names the tag or argument, the
offending value, what was expected and how to fix it: the regex of each
entry checks those parts.

The table of docs/reliability.md is generated from this catalogue:
``python -m tests.test_bad_inputs --write-docs`` rewrites it, and each
entry's test checks that its row shows the message it raises now.
"""

import functools
import pathlib
import re
import sys
from typing import Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers
from tests import problems

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
BEGIN, END = "<!-- bad-inputs:begin -->", "<!-- bad-inputs:end -->"
MAX_MESSAGE = 230   # characters of a message shown in the docs table


class Case(NamedTuple):
  id: str          # a stable name (the test id and the docs row)
  input: str       # the wrong call, in words, for the docs table
  call: Callable   # call(world) raises
  exc: type        # the exception type expected
  pattern: str     # a regex the message must match (re.S)


class World(NamedTuple):
  params: dict      # the 6-8-3 MLP
  batch: tuple      # (x [16, 6], y [16])
  collection: kl.LayerCollection
  tx: optax.GradientTransformationExtraArgs   # kfac(0.1, collection)
  state: object     # tx.init(params)
  other: problems.Problem   # a 6-8-5 MLP: same structure, other shapes


@functools.lru_cache(maxsize=None)
def world() -> World:
  p = problems.tiny_classifier()
  c = p.scan()
  tx = kl.kfac(0.1, c)
  return World(p.params, p.batch, c, tx, tx.init(p.params),
               problems.mlp_classifier((6, 8, 5)))


# Small arrays for the tag checks.
_X, _W = jnp.ones((2, 4)), jnp.ones((4, 3))
_IMG, _K = jnp.ones((2, 5, 5, 3)), jnp.ones((3, 3, 3, 4))
_NHWC = ("NHWC", "HWIO", "NHWC")


def _conv_y(strides=(1, 1)):
  return lax.conv_general_dilated(_IMG, _K, strides, "SAME",
                                  dimension_numbers=_NHWC)


def _depthwise(x, w, strides=(1, 1)):
  h, k, c, m = w.shape
  return lax.conv_general_dilated(x, w.reshape(h, k, 1, c * m), strides,
                                  "SAME", dimension_numbers=_NHWC,
                                  feature_group_count=c)


def _scan_loss(layer, params=None, **scan_kw):
  """``scan`` of ``sum(layer(params, x))`` under a Normal loss tag."""
  def loss_fn(p, x):
    out = layer(p, x)
    kl.register_normal_predictive_distribution(out)
    return jnp.sum(out)
  return kl.scan(loss_fn, params if params is not None else {"w": _W}, _X,
                 **scan_kw)


def _dense(p, x):
  return kl.register_dense(x @ p["w"], x, p["w"])


def _step(w, tx=None, state=None, params=None, batch=None, **kw):
  """Traces one jitted ``tx.update`` (the defaults: the world's)."""
  tx = tx or w.tx
  params = w.params if params is None else params
  state = w.state if state is None else state
  batch = w.batch if batch is None else batch
  grads = jax.tree.map(jnp.zeros_like, params)
  return jax.jit(lambda s: tx.update(grads, s, params, batch=batch, **kw))(
      state)


def _est(w, **kw):
  return kl.FisherEstimator(w.collection, **kw)


def _while_tag(p, x):
  return lax.fori_loop(0, jnp.sum(x).astype(jnp.int32),
                       lambda i, h: _dense(p, h[:, :4]) @ jnp.ones((3, 4)),
                       x)


def _two_leaf_tag(p, x):
  w = p["w"] + p["v"]
  return kl.register_dense(x @ w, x, w)


def _not_from_w(p, x):
  return kl.register_dense(x @ p["v"], x, p["w"])


def _two_outputs(p, x):
  out = x @ p["w"]
  kl.register_normal_predictive_distribution(out)
  return out, out


CASES = [
    # ---- layer tags ------------------------------------------------------
    Case("dense-x-w-mismatch", "register_dense with x [2, 5] and w [4, 3]",
         lambda w: kl.register_dense(jnp.ones((2, 3)), jnp.ones((2, 5)), _W),
         ValueError, r"register_dense: x has shape \(2, 5\), expected "
         r"\(\.\.\., 4\)\. x's last axis must match w's first"),
    Case("dense-y-shape", "register_dense with y [2, 5] for x [2, 4] @ w "
         "[4, 3]", lambda w: kl.register_dense(jnp.ones((2, 5)), _X, _W),
         ValueError, r"register_dense: y has shape \(2, 5\), expected "
         r"\(2, 3\)\. y must be x @ w"),
    Case("dense-kernel-rank", "register_dense with a 3-D kernel",
         lambda w: kl.register_dense(jnp.ones((2, 3)), _X,
                                     jnp.ones((4, 3, 1))),
         ValueError, r"register_dense: w has shape \(4, 3, 1\); a dense "
         r"kernel is \[d_in, d_out\]\. Reshape it, or use register_generic"),
    Case("dense-bias-size", "register_dense with a bias of 4 for 3 outputs",
         lambda w: kl.register_dense(jnp.ones((2, 3)), _X, _W, jnp.ones(4)),
         ValueError, r"register_dense: b has shape \(4,\), expected \(3,\)\."
         r" The bias has one entry per output feature"),
    Case("dense-x-not-array", "register_dense with x a Python list",
         lambda w: kl.register_dense(jnp.ones((2, 3)), [[1.0] * 4] * 2, _W),
         TypeError, r"register_dense: x is a list; expected an array .*"
         r"jnp\.asarray\(x\)"),
    Case("dense-y-not-from-w", "register_dense(x @ v, x, w): the tagged y "
         "is not computed from w",
         lambda w: _scan_loss(_not_from_w, {"w": _W, "v": _W}), ValueError,
         r"fully_connected tag at .*: its output y does not depend on "
         r"parameter \['w'\] \(y depends on \[\"\['v'\]\"\]\).*Pass the value "
         r"computed from these parameters as y"),
    Case("dense-approx-unknown", "register_dense(..., approx='kron_x')",
         lambda w: _scan_loss(lambda p, x: kl.register_dense(
             x @ p["w"], x, p["w"], approx="kron_x")), ValueError,
         r"approx='kron_x' is not an approximation for a 'fully_connected' "
         r"layer with parameters \[\"\['w'\]\"\]; choose one of \['kron'"),
    Case("tag-param-computed", "register_dense with w = p['w'] + p['v'] "
         "(two leaves)", lambda w: _scan_loss(_two_leaf_tag,
                                              {"w": _W, "v": _W}),
         ValueError, r"parameter operand 0 of the fully_connected tag at .* "
         r"is computed by `add` from parameter leaves \[\"\['v'\]\", "
         r"\"\['w'\]\"\]; .*Tag the leaf before combining it"),
    Case("tag-in-while-loop", "a tag inside lax.fori_loop with a dynamic "
         "trip count", lambda w: _scan_loss(_while_tag), ValueError,
         r"K-FAC tags inside `while` .* are not supported; move the tagged "
         r"layer out of the loop, or use lax\.scan"),
    Case("conv-strides", "register_conv with strides (2, 2) for an output "
         "computed with (1, 1)",
         lambda w: kl.register_conv(_conv_y(), _IMG, _K,
                                    window_strides=(2, 2), padding="SAME",
                                    dimension_numbers=_NHWC),
         ValueError, r"register_conv: y has shape \(2, 5, 5, 4\), expected "
         r"\(2, 3, 3, 4\)\. .*window_strides, padding, dilations"),
    Case("conv-not-a-convolution", "register_conv with a 3-D input for a "
         "2-D kernel",
         lambda w: kl.register_conv(_conv_y(), jnp.ones((2, 5, 3)), _K,
                                    window_strides=(1, 1), padding="SAME",
                                    dimension_numbers=_NHWC),
         ValueError, r"register_conv: x \(2, 5, 3\) and w \(3, 3, 3, 4\) are "
         r"not a valid convolution .* x is \[N, \*spatial, C_in\]"),
    Case("conv-bias-size", "register_conv with a bias of 5 for 4 channels",
         lambda w: kl.register_conv(_conv_y(), _IMG, _K, jnp.ones(5),
                                    window_strides=(1, 1), padding="SAME",
                                    dimension_numbers=_NHWC),
         ValueError, r"register_conv: b has 5 entries; expected one per "
         r"output channel \(y \(2, 5, 5, 4\)\)\. Pass the conv's own bias"),
    Case("conv2d-data-format", "register_conv2d(..., data_format='NHCW')",
         lambda w: kl.register_conv2d(_conv_y(), _IMG, _K, strides=1,
                                      padding="SAME", data_format="NHCW"),
         ValueError, r"register_conv2d: data_format='NHCW'; use 'NHWC' or "
         r"'NCHW'"),
    Case("conv2d-strides-length", "register_conv2d(..., strides=(1, 2, 3))",
         lambda w: kl.register_conv2d(_conv_y(), _IMG, _K, strides=(1, 2, 3),
                                      padding="SAME"),
         ValueError, r"register_conv2d: strides=\(1, 2, 3\); expected "
         r"positive ints: one for both axes, 2 spatial values"),
    Case("conv2d-strides-zero", "register_conv2d(..., strides=0)",
         lambda w: kl.register_conv2d(_conv_y(), _IMG, _K, strides=0,
                                      padding="SAME"),
         ValueError, r"register_conv2d: strides=0; expected positive ints"),
    Case("depthwise-kernel-channels", "register_depthwise_conv2d with a "
         "[3, 3, 2, 1] kernel on 3 input channels",
         lambda w: kl.register_depthwise_conv2d(
             _IMG, _IMG, jnp.ones((3, 3, 2, 1)), strides=1, padding="SAME"),
         ValueError, r"register_depthwise_conv2d: the depthwise kernel has "
         r"shape \(3, 3, 2, 1\), expected \(h, w, 3, M\)\. A depthwise "
         r"kernel is \[h, w, C, M\]"),
    Case("depthwise-strides", "register_depthwise_conv2d with strides 2 "
         "for an output computed with stride 1",
         lambda w: kl.register_depthwise_conv2d(
             _depthwise(_IMG, jnp.ones((3, 3, 3, 1))), _IMG,
             jnp.ones((3, 3, 3, 1)), strides=2, padding="SAME"),
         ValueError, r"register_depthwise_conv2d: the depthwise output has "
         r"shape \(2, 5, 5, 3\), expected \(2, 3, 3, 3\)\. .*strides=\(2, 2\)"),
    Case("separable-pointwise-shape", "register_separable_conv2d with a "
         "pointwise kernel of 5 input channels after 3 depthwise channels",
         lambda w: kl.register_separable_conv2d(
             jnp.ones((2, 5, 5, 4)), _IMG, jnp.ones((3, 3, 3, 1)),
             jnp.ones((1, 1, 5, 4)), _depthwise(_IMG, jnp.ones((3, 3, 3, 1))),
             strides=1, padding="SAME"),
         ValueError, r"register_separable_conv2d: pointwise_w has shape "
         r"\(1, 1, 5, 4\), expected \(1, 1, 3, O\)\. The pointwise kernel"),
    Case("separable-y-shape", "register_separable_conv2d with y of 5 "
         "channels for a pointwise kernel of 4",
         lambda w: kl.register_separable_conv2d(
             jnp.ones((2, 5, 5, 5)), _IMG, jnp.ones((3, 3, 3, 1)),
             jnp.ones((1, 1, 3, 4)), _depthwise(_IMG, jnp.ones((3, 3, 3, 1))),
             strides=1, padding="SAME"),
         ValueError, r"register_separable_conv2d: y has shape "
         r"\(2, 5, 5, 5\), expected \(2, 5, 5, 4\)\. y must be the 1x1 "
         r"convolution"),
    Case("embedding-float-ids", "register_embedding with float ids",
         lambda w: kl.register_embedding(jnp.ones((3, 2)), jnp.ones(3),
                                         jnp.ones((5, 2))),
         TypeError, r"register_embedding: ids have dtype float32; embedding "
         r"ids must be integers .*ids\.astype\(jnp\.int32\)"),
    Case("embedding-out-of-range", "register_embedding with id 9 in a "
         "vocabulary of 5",
         lambda w: kl.register_embedding(jnp.ones((3, 2)),
                                         jnp.array([0, 1, 9]),
                                         jnp.ones((5, 2))),
         ValueError, r"register_embedding: ids range over \[0, 9\], outside "
         r"the vocabulary \[0, 5\)\. Clip or remap the ids"),
    Case("embedding-table-rank", "register_embedding with a 3-D table",
         lambda w: kl.register_embedding(jnp.ones((3, 2)), jnp.arange(3),
                                         jnp.ones((5, 2, 1))),
         ValueError, r"register_embedding: table has shape \(5, 2, 1\); "
         r"expected \[vocab, d\]\. Register other lookups with "
         r"register_generic"),
    Case("embedding-y-shape", "register_embedding with y [3, 4] for a "
         "[5, 2] table",
         lambda w: kl.register_embedding(jnp.ones((3, 4)), jnp.arange(3),
                                         jnp.ones((5, 2))),
         ValueError, r"register_embedding: y has shape \(3, 4\), expected "
         r"\(3, 2\)\. y must be table\[ids\]"),
    Case("scale-not-broadcast", "register_scale_and_shift with scale [5] "
         "for x [2, 3]",
         lambda w: kl.register_scale_and_shift(jnp.ones((2, 3)),
                                               jnp.ones((2, 3)), jnp.ones(5)),
         ValueError, r"register_scale_and_shift: scale \(5,\) and x "
         r"\(2, 3\) do not broadcast to y \(2, 3\); expected y = x \* scale "
         r"\+ shift"),
    Case("shift-not-broadcast", "register_scale_and_shift with shift [2] "
         "for x [2, 3]",
         lambda w: kl.register_scale_and_shift(
             jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones(3), jnp.ones(2)),
         ValueError, r"register_scale_and_shift: shift \(2,\) and x \(2, 3\) "
         r"do not broadcast to y \(2, 3\)"),
    Case("generic-no-arrays", "register_generic({})",
         lambda w: kl.register_generic({}), ValueError,
         r"register_generic: params=\{\} holds no arrays; pass the parameter "
         r"array"),
    # ---- loss tags -------------------------------------------------------
    Case("categorical-float-targets", "register_categorical_predictive_"
         "distribution with float class labels",
         lambda w: kl.register_categorical_predictive_distribution(
             jnp.ones((4, 3)), jnp.ones(4)),
         TypeError, r"register_categorical_predictive_distribution: targets "
         r"have dtype float32; expected integer class ids\. Pass "
         r"targets\.astype\(jnp\.int32\)"),
    Case("categorical-one-hot-targets", "register_categorical_predictive_"
         "distribution with one-hot integer targets [4, 3]",
         lambda w: kl.register_categorical_predictive_distribution(
             jnp.ones((4, 3)), jnp.ones((4, 3), jnp.int32)),
         ValueError, r"register_categorical_predictive_distribution: targets "
         r"has shape \(4, 3\), expected \(4,\)\. One class id per position"),
    Case("categorical-logits-1d", "register_categorical_predictive_"
         "distribution with 1-D logits",
         lambda w: kl.register_categorical_predictive_distribution(
             jnp.ones(3)),
         ValueError, r"register_categorical_predictive_distribution: logits "
         r"have shape \(3,\); they need a leading \(batch\) axis"),
    Case("normal-targets-shape", "register_normal_predictive_distribution "
         "with targets [4] for a mean [4, 2]",
         lambda w: kl.register_normal_predictive_distribution(
             jnp.ones((4, 2)), jnp.ones(4)),
         ValueError, r"register_normal_predictive_distribution: targets has "
         r"shape \(4,\), expected \(4, 2\)\. Targets have the shape"),
    Case("bernoulli-targets-shape", "register_multi_bernoulli_predictive_"
         "distribution with targets [4, 3] for logits [4, 2]",
         lambda w: kl.register_multi_bernoulli_predictive_distribution(
             jnp.ones((4, 2)), jnp.ones((4, 3))),
         ValueError, r"register_multi_bernoulli_predictive_distribution: "
         r"targets has shape \(4, 3\), expected \(4, 2\)"),
    Case("mask-not-broadcastable", "a loss mask [3] for logits [4, 5, 3]",
         lambda w: kl.register_categorical_predictive_distribution(
             jnp.ones((4, 5, 3)), mask=jnp.ones(3)),
         ValueError, r"register_categorical_predictive_distribution: mask "
         r"has shape \(3,\), which does not broadcast to the leading shape "
         r"\(4, 5\).*Give one entry per position"),
    Case("loss-weight-negative", "a loss tag with weight=-1.0",
         lambda w: kl.register_categorical_predictive_distribution(
             jnp.ones((2, 3)), weight=-1.0),
         ValueError, r"register_categorical_predictive_distribution: "
         r"weight=-1\.0 must be positive"),
    Case("loss-weight-array", "a loss tag with an array weight",
         lambda w: kl.register_normal_predictive_distribution(
             jnp.ones((2, 3)), weight=np.ones(2)),
         TypeError, r"register_normal_predictive_distribution: "
         r"weight=array\(\[1\., 1\.\]\) must be a Python float"),
    Case("normal-var-zero", "register_normal_predictive_distribution("
         "var=0.0)",
         lambda w: kl.register_normal_predictive_distribution(
             jnp.ones((2, 3)), var=0.0),
         ValueError, r"register_normal_predictive_distribution: var=0\.0 "
         r"must be positive"),
    # ---- scan ------------------------------------------------------------
    Case("params-integer-leaf", "scan with an int32 leaf in params",
         lambda w: _scan_loss(_dense, {"w": _W,
                                       "n": jnp.zeros((), jnp.int32)}),
         TypeError, r"params\['n'\] has dtype int32; K-FAC needs "
         r"floating-point parameters\. Move integer or complex state out"),
    Case("approximations-bad-value", "scan(..., approximations={'conv': "
         "'bad'})",
         lambda w: kl.scan(helpers.classifier_loss, w.params, w.batch,
                           approximations={"conv": "bad"}),
         ValueError, r"approximations\['conv'\]='bad' is unknown; choose one "
         r"of \['kron'"),
    Case("approximations-key-matches-nothing", "scan(..., approximations="
         "{\"['nope']\": 'kron'})",
         lambda w: kl.scan(helpers.classifier_loss, w.params, w.batch,
                           approximations={"['nope']": "kron"}),
         ValueError, r"approximations key \"\['nope'\]\" is neither a layer "
         r"kind .* nor a prefix of a parameter path; paths look like"),
    Case("approximations-not-a-dict", "scan(..., approximations=['kron'])",
         lambda w: kl.scan(helpers.classifier_loss, w.params, w.batch,
                           approximations=["kron"]),
         TypeError, r"approximations must be a dict mapping a layer kind or "
         r"a parameter path prefix to an approximation; got <class 'list'>"),
    Case("no-loss-tag", "scan of a loss_fn without a loss tag",
         lambda w: kl.scan(lambda p, x: jnp.sum(_dense(p, x)), {"w": _W},
                           _X),
         ValueError, r"loss_fn has no loss tag\. Register the model's "
         r"predictive distribution"),
    Case("has-aux-not-a-pair", "scan(..., has_aux=True) of a loss_fn "
         "returning a scalar",
         lambda w: _scan_loss(_dense, has_aux=True), ValueError,
         r"has_aux=True, but loss_fn does not return a \(loss, aux\) pair"),
    Case("loss-not-scalar", "scan of a loss_fn returning (loss, aux) "
         "without has_aux=True",
         lambda w: kl.scan(_two_outputs, {"w": _W}, _X), ValueError,
         r"loss_fn must return a scalar loss; got \(\(2, 3\), \(2, 3\)\)\. "
         r"Set has_aux=True"),
    Case("strict-leftover", "scan(..., strict=True) with an untagged "
         "parameter used by jnp.sin",
         lambda w: _scan_loss(lambda p, x: _dense(p, x) * jnp.sin(p["s"]),
                              {"w": _W, "s": jnp.ones(3)}, strict=True),
         ValueError, r"strict=True, but these parameters have no layer "
         r"structure: \['s'\]: .*Tag them with a register_\* function"),
    # ---- estimator and transformation options ----------------------------
    Case("collection-not-a-collection", "FisherEstimator('not a "
         "collection')", lambda w: kl.FisherEstimator("not a collection"),
         TypeError, r"FisherEstimator\(collection=\.\.\.\) needs the "
         r"LayerCollection returned by kfac_jax_lite\.scan\(\.\.\.\); got "
         r"str"),
    Case("cov-ema-decay", "FisherEstimator(cov_ema_decay=1.5)",
         lambda w: _est(w, cov_ema_decay=1.5), ValueError,
         r"cov_ema_decay=1\.5 must be in \[0, 1\)"),
    Case("estimator-damping-negative", "FisherEstimator(damping=-1.0)",
         lambda w: _est(w, damping=-1.0), ValueError,
         r"damping=-1\.0 must be >= 0"),
    Case("estimation-mode-unknown", "kfac(..., estimation_mode='fisher')",
         lambda w: kl.kfac(0.1, w.collection, estimation_mode="fisher"),
         ValueError, r"estimation_mode='fisher' is unknown; choose one of "
         r"\['gradients', 'empirical'"),
    Case("num-samples-zero", "FisherEstimator(num_samples=0)",
         lambda w: _est(w, num_samples=0), ValueError,
         r"num_samples=0 must be a positive int"),
    Case("damping-type-unknown", "FisherEstimator(damping_type='tikhonov')",
         lambda w: _est(w, damping_type="tikhonov"), ValueError,
         r"damping_type='tikhonov'.*'pi'.*'exact'"),
    Case("stats-fraction-zero", "FisherEstimator(stats_fraction=0.0)",
         lambda w: _est(w, stats_fraction=0.0), ValueError,
         r"stats_fraction=0\.0 must be a number in \(0, 1\]: the fraction of "
         r"each batch"),
    Case("stats-fraction-above-one", "FisherEstimator(stats_fraction=1.5)",
         lambda w: _est(w, stats_fraction=1.5), ValueError,
         r"stats_fraction=1\.5 must be a number in \(0, 1\]"),
    Case("stats-sync-unknown", "kfac(..., stats_sync='never')",
         lambda w: kl.kfac(0.1, w.collection, stats_sync="never"),
         ValueError, r"stats_sync='never'; choose one of \['every_update', "
         r"'before_refresh'\]"),
    Case("distributed-inverses-without-axis", "kfac(..., "
         "distributed_inverses=True) without axis_name",
         lambda w: kl.kfac(0.1, w.collection, distributed_inverses=True),
         ValueError, r"distributed_inverses=True needs axis_name=\.\.\. "
         r"\(the pmap/shard_map axis"),
    Case("damping-string", "kfac(..., damping='1e-3')",
         lambda w: kl.kfac(0.1, w.collection, damping="1e-3"), TypeError,
         r"damping='1e-3' is a str; expected a number, a scalar array or an "
         r"optax schedule .* e\.g\. damping=1e-3"),
    Case("learning-rate-negative", "kfac(-0.1, ...)",
         lambda w: kl.kfac(-0.1, w.collection), ValueError,
         r"learning_rate=-0\.1 must be a number >= 0"),
    Case("learning-rate-nan", "kfac(float('nan'), ...) (a NaN array or "
         "schedule value is skipped and counted instead)",
         lambda w: kl.kfac(float("nan"), w.collection), ValueError,
         r"learning_rate=nan must be a number >= 0"),
    Case("learning-rate-none", "kfac(None, ...)",
         lambda w: kl.kfac(None, w.collection), TypeError,
         r"learning_rate=None is a NoneType; expected a number, a scalar "
         r"array or an optax schedule"),
    Case("momentum-negative", "kfac(..., momentum=-0.9)",
         lambda w: kl.kfac(0.1, w.collection, momentum=-0.9), ValueError,
         r"momentum=-0\.9 must be a number >= 0"),
    Case("inverse-update-period-zero", "kfac(..., inverse_update_period=0)",
         lambda w: kl.kfac(0.1, w.collection, inverse_update_period=0),
         ValueError, r"inverse_update_period=0 must be a positive int \(a "
         r"number of steps\)"),
    Case("cov-update-period-float", "scale_by_kfac(..., "
         "cov_update_period=2.5)",
         lambda w: kl.scale_by_kfac(w.collection, cov_update_period=2.5),
         ValueError, r"cov_update_period=2\.5 must be a positive int"),
    Case("power-positive", "scale_by_kfac(..., power=0.5)",
         lambda w: kl.scale_by_kfac(w.collection, power=0.5), ValueError,
         r"power=0\.5 must be a static negative number \(-1, -0\.5\)"),
    Case("norm-constraint-negative", "scale_by_kfac(..., "
         "norm_constraint=-1.0)",
         lambda w: kl.scale_by_kfac(w.collection, norm_constraint=-1.0),
         ValueError, r"norm_constraint=-1\.0 must be a number >= 0"),
    Case("estimator-and-its-options", "kfac(..., estimator=est, "
         "cov_ema_decay=0.9)",
         lambda w: kl.kfac(0.1, w.collection, estimator=_est(w),
                           cov_ema_decay=0.9),
         ValueError, r"cov_ema_decay=0\.9 given with estimator=\.\.\.: set "
         r"these on the FisherEstimator instead"),
    Case("estimator-of-another-collection", "kfac(..., estimator=) of "
         "another model's collection",
         lambda w: kl.kfac(0.1, w.collection, estimator=kl.FisherEstimator(
             w.other.scan())),
         ValueError, r"estimator=\.\.\. was built for another collection "
         r"than the one given; pass the estimator's own"),
    Case("power-not-cached", "est.multiply_matpower(state, v, 0.5) with "
         "exps=(-1,)",
         lambda w: _est(w).multiply_matpower(_est(w).init(w.params),
                                             w.params, 0.5),
         ValueError, r"exps=\[-1\]"),
    Case("optimizer-decay", "kfac_optimizer(..., damping_adaptation_decay="
         "2.0)",
         lambda w: kl.kfac_optimizer(w.collection,
                                     damping_adaptation_decay=2.0),
         ValueError, r"damping_adaptation_decay=2\.0 must be in \(0, 1\)"),
    # ---- init and update -------------------------------------------------
    Case("init-collection-of-another-model", "tx.init(params) with a "
         "collection scanned from another model (its last layer 8x5, "
         "params 8x3)",
         lambda w: kl.kfac(0.1, w.other.scan()).init(w.params), ValueError,
         r"params\['layer1'\]\['b'\] has shape \(3,\), but the "
         r"LayerCollection was scanned with \(5,\) \(layer "
         r"\"\['layer1'\]\"\): the collection belongs to another model\. "
         r"Scan this model's parameters"),
    Case("update-state-of-another-model", "tx.update with the state of "
         "another model's transformation",
         lambda w: _step(w, state=kl.kfac(0.1, w.other.scan()).init(
             w.other.params)),
         ValueError, r"state=\.\.\. holds .* of shape \(5, 5\) for the layers "
         r"\[\"\['layer1'\]\"\]; this estimator's have \(3, 3\): the state "
         r"belongs to another model\. Pass the state made by this estimator"),
    Case("update-before-init", "tx.update(grads, None, params, batch=...)",
         lambda w: w.tx.update(w.params, None, w.params, batch=w.batch),
         TypeError, r"kfac\.update: state is a NoneType, not this "
         r"transformation's state\. Create it with state = tx\.init\(params\)"),
    Case("update-batch-and-stats", "tx.update(..., batch=b, stats=s)",
         lambda w: w.tx.update(w.params, w.state, w.params, batch=w.batch,
                               stats={}),
         ValueError, r"update\(\) needs exactly one of batch=\.\.\. .* or "
         r"stats=\.\.\. .*; got both batch and stats"),
    Case("update-neither-batch-nor-stats", "tx.update(grads, state, "
         "params)", lambda w: w.tx.update(w.params, w.state, w.params),
         ValueError, r"update\(\) needs exactly one of batch=\.\.\. .*; got "
         r"neither batch nor stats"),
    Case("update-params-of-another-structure", "tx.update with a params "
         "pytree of another structure",
         lambda w: w.tx.update({"x": jnp.ones(3)}, w.state,
                               {"x": jnp.ones(3)}, batch=w.batch),
         ValueError, r"params does not match the parameters the "
         r"LayerCollection was scanned with \(missing .*Pass the same "
         r"parameter pytree"),
    Case("update-grads-of-another-structure", "tx.update with gradients of "
         "one layer only",
         lambda w: w.tx.update({"layer0": w.params["layer0"]}, w.state,
                               w.params, batch=w.batch),
         ValueError, r"updates does not match the parameters the "
         r"LayerCollection was scanned with \(missing \[\"\['layer1'\]"),
    Case("update-batch-of-another-structure", "tx.update(..., batch=(x,)) "
         "where loss_fn unpacks (x, y)",
         lambda w: _step(w, batch=(w.batch[0],)), ValueError,
         r"batch=\.\.\. has structure PyTreeDef\(\(\*,\)\), but scan\(\) "
         r"traced "
         r"loss_fn with a batch of structure PyTreeDef\(\(\*, \*\)\), and "
         r"loss_fn fails on it .*Pass update\(\) the batch loss_fn takes"),
    Case("axis-name-outside-pmap", "kfac(..., axis_name='i') stepped under "
         "jit without pmap/shard_map",
         lambda w: _step(w, tx=kl.kfac(0.1, w.collection, axis_name="i")),
         ValueError, r"axis_name='i' is not a mapped axis where K-FAC runs\. "
         r"Call the step inside jax\.pmap\(\.\.\., axis_name=\.\.\.\)"),
]


@functools.lru_cache(maxsize=None)
def message_of(case_id: str) -> str:
  """The message the case raises now (it must raise)."""
  case = {c.id: c for c in CASES}[case_id]
  try:
    case.call(world())
  except Exception as e:  # pylint: disable=broad-except
    return str(e)
  raise AssertionError(f"{case_id}: no exception")


def _cell(text: str) -> str:
  text = " ".join(str(text).split())
  if len(text) > MAX_MESSAGE:
    text = text[:MAX_MESSAGE].rstrip() + " …"
  # Escaped so Markdown reads no link (`['w']` after `[...]`) in a message.
  for c in "|[]":
    text = text.replace(c, "\\" + c)
  return text


def table_row(case: Case, message: str) -> str:
  return (f"| `{case.id}` | {_cell(case.input)} | {case.exc.__name__}: "
          f"{_cell(message)} |")


def render_table() -> str:
  lines = ["| id | input | error and message |", "|---|---|---|"]
  lines += [table_row(c, message_of(c.id)) for c in CASES]
  return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def docs_rows() -> dict:
  """``id -> row`` of the table in docs/reliability.md."""
  text = DOCS.read_text(encoding="utf-8")
  table = text.split(BEGIN, 1)[1].split(END, 1)[0]
  rows = {}
  for line in table.strip().splitlines()[2:]:
    m = re.match(r"\| `([^`]+)` \|", line)
    if m:
      rows[m.group(1)] = line
  return rows


def test_catalogue_is_large_and_named_uniquely():
  ids = [c.id for c in CASES]
  assert len(ids) == len(set(ids)) >= 40


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_early_with_a_clear_message(case):
  with pytest.raises(Exception) as info:
    case.call(world())
  err = info.value
  # Never an AttributeError, an XLA error or a reshape error.
  assert type(err) is case.exc, (type(err), err)  # pylint: disable=C0123
  message = str(err)
  for low_level in ("cannot reshape", "incompatible shapes", "has no "
                    "attribute", "XlaRuntimeError", "INVALID_ARGUMENT"):
    assert low_level not in message, message
  assert re.search(case.pattern, message, re.S), message
  # The docs table shows this very message.
  assert docs_rows().get(case.id) == table_row(case, message), (
      "docs/reliability.md is stale; run python -m tests.test_bad_inputs "
      "--write-docs")


def test_docs_table_lists_the_catalogue_in_order():
  assert list(docs_rows()) == [c.id for c in CASES]


def test_nan_learning_rate_schedule_is_skipped_and_counted():
  """A schedule that turns NaN (at step 3 on) skips those steps: the
  parameters stay finite and the skip counter counts each one."""
  w = world()
  tx = kl.kfac(lambda n: jnp.where(n < 3, 0.1, jnp.nan), w.collection)
  step = jax.jit(lambda p, s: tx.update(
      jax.grad(helpers.classifier_loss)(p, w.batch), s, p, batch=w.batch))
  params, state = w.params, tx.init(w.params)
  for _ in range(5):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
  assert int(state.num_skipped) == 2 and not bool(state.last_finite)


def write_docs() -> None:
  text = DOCS.read_text(encoding="utf-8")
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  DOCS.write_text(f"{head}{BEGIN}\n{render_table()}\n{END}{tail}",
                  encoding="utf-8")


if __name__ == "__main__":
  if sys.argv[1:] == ["--write-docs"]:
    write_docs()
  else:
    print(render_table())
