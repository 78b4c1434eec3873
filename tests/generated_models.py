"""Small models of every registered layer kind, for the generated suite.

A :class:`ModelSpec` is the static part of a drawn configuration: the layer
kind under test and its approximation, how often the layer is used per
example (``uses``: ``"one"``, ``"sites"`` for two tag sites on the same
parameters, ``"scan"`` for a ``lax.scan`` over two steps), the parameter
dtype, the loss and whether it is masked. :func:`build` turns it into a
:class:`problems.Problem`-like triple: the layer of that kind feeds a tagged
dense head, whose output is the registered loss.

Every kind of :data:`kfac_jax_lite.kinds.KINDS` needs an entry in
:data:`LAYERS`; ``tests/test_generated.py`` fails for a kind without one, so
a new row of the registry cannot go untested. Shapes are fixed per kind
(few compiled programs); the numbers (parameters, data, masks) come from a
seed, so one compiled program serves many drawn configurations.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite as kl

B = 8          # Batch size: divisible by 2 and 4 replicas.
V = 3          # Outputs of the head (classes, regression targets).
VOCAB = 5      # Embedding rows.
USES = ("one", "sites", "scan")
LOSSES = ("categorical", "normal", "bernoulli")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The static (compiled) part of a model configuration."""
  kind: str
  approx: str
  uses: str = "one"
  dtype: str = "float32"
  loss: str = "categorical"
  masked: bool = False

  @property
  def num_uses(self) -> int:
    """Uses per example of the layer under test (tied tables: > 1)."""
    return 1 if self.uses == "one" and self.kind != "tied_embedding" else 2


@dataclasses.dataclass(frozen=True)
class LayerBuilder:
  """How to build one layer of a kind.

  Attributes:
    params: ``(rng: np.random.Generator) -> dict`` of float64 arrays.
    inputs: ``(rng) -> dict`` of the batch entries the layer reads.
    apply: ``(params, inputs, approx, step) -> [B, F]`` features; ``step``
      (0 or 1) selects the input of a second use.
    auto: the layer is found by the scanner (no tag exists for it), so
      its approximation is given to ``scan``.
  """
  params: Callable
  inputs: Callable
  apply: Callable
  auto: bool = False


def _normal(rng, *shape):
  return rng.standard_normal(shape)


def _second(x, step):
  """The input of the second use: a different array of the same shape."""
  return x if step == 0 else jnp.tanh(x)


def _flat(y):
  return y.reshape(y.shape[0], -1)


def _dense(p, inp, approx, step):
  x = _second(inp["x"], step)
  y = x @ p["w"] + p["b"]
  return kl.register_dense(y, x, p["w"], p["b"], approx=approx)


def _conv(p, inp, approx, step):
  x = _second(inp["img"], step)
  y = lax.conv_general_dilated(
      x, p["w"], (1, 1), "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]
  return _flat(kl.register_conv2d(y, x, p["w"], p["b"], strides=1,
                                  padding="SAME", approx=approx))


def _depthwise_y(x, w):
  c, m = w.shape[2], w.shape[3]
  return lax.conv_general_dilated(
      x, w.reshape(w.shape[:2] + (1, c * m)), (1, 1), "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=c)


def _depthwise(p, inp, approx, step):
  x = _second(inp["img"], step)
  y = _depthwise_y(x, p["w"])
  return _flat(kl.register_depthwise_conv2d(y, x, p["w"], strides=1,
                                            padding="SAME", approx=approx))


def _separable(p, inp, approx, step):
  x = _second(inp["img"], step)
  dy = _depthwise_y(x, p["dw"])
  y = jnp.einsum("bhwc,co->bhwo", dy, p["pw"][0, 0]) + p["b"]
  return _flat(kl.register_separable_conv2d(
      y, x, p["dw"], p["pw"], dy, p["b"], strides=1, padding="SAME",
      approx=approx))


def _ids(inp, step):
  return inp["ids"] if step == 0 else (inp["ids"] + 1) % VOCAB


def _embedding(p, inp, approx, step):
  ids = _ids(inp, step)
  return _flat(kl.register_embedding(p["table"][ids], ids, p["table"],
                                     approx=approx))


def _tied(p, inp, approx, step):
  del approx  # Given to scan: tied tables are found by the scanner.
  h = jnp.tanh(p["table"][_ids(inp, step)])   # Lookup: [B, 2, d].
  return _flat(h @ p["table"].T)               # Attend: [B, 2, VOCAB].


def _scale_and_shift(p, inp, approx, step):
  x = _second(inp["seq"], step)
  y = x * p["scale"] + p["shift"]
  return _flat(kl.register_scale_and_shift(y, x, p["scale"], p["shift"],
                                           approx=approx))


def _generic(p, inp, approx, step):
  x = _second(inp["x"], step)
  return x * kl.register_generic(p["g"], approx=approx)


_IMG = lambda r: {"img": _normal(r, B, 4, 4, 2)}  # noqa: E731
_IDS = lambda r: {"ids": r.integers(0, VOCAB, (B, 2))}  # noqa: E731

LAYERS = {
    "fully_connected": LayerBuilder(
        lambda r: {"w": _normal(r, 4, 3) / 2, "b": 0.1 * _normal(r, 3)},
        lambda r: {"x": _normal(r, B, 4)}, _dense),
    "conv": LayerBuilder(
        lambda r: {"w": _normal(r, 2, 2, 2, 3) / 3, "b": 0.1 * _normal(r, 3)},
        _IMG, _conv),
    "depthwise_conv": LayerBuilder(
        lambda r: {"w": _normal(r, 2, 2, 2, 2) / 2}, _IMG, _depthwise),
    "separable_conv": LayerBuilder(
        lambda r: {"dw": _normal(r, 2, 2, 2, 2) / 2,
                   "pw": _normal(r, 1, 1, 4, 3) / 2, "b": 0.1 * _normal(r, 3)},
        _IMG, _separable),
    "embedding": LayerBuilder(
        lambda r: {"table": _normal(r, VOCAB, 3)},
        lambda r: {"ids": r.integers(0, VOCAB, (B,))}, _embedding),
    "tied_embedding": LayerBuilder(
        lambda r: {"table": _normal(r, VOCAB, 3)}, _IDS, _tied, auto=True),
    "scale_and_shift": LayerBuilder(
        lambda r: {"scale": 1 + 0.1 * _normal(r, 4),
                   "shift": 0.1 * _normal(r, 4)},
        lambda r: {"seq": _normal(r, B, 3, 4)}, _scale_and_shift),
    "generic": LayerBuilder(
        lambda r: {"g": 1 + 0.1 * _normal(r, 4)},
        lambda r: {"x": _normal(r, B, 4)}, _generic),
}


def features(spec: ModelSpec, params, inputs):
  """The layer under test, used as ``spec.uses`` says: ``[B, F]``."""
  layer = LAYERS[spec.kind]
  apply = lambda step, inp=inputs: layer.apply(  # noqa: E731
      params["layer"], inp, spec.approx, step)
  if spec.uses == "one":
    return apply(0)
  if spec.uses == "sites":
    return apply(0) + apply(1)
  # "scan": the layer inside lax.scan over two steps of stacked inputs.
  stacked = jax.tree.map(
      lambda a: jnp.stack([a, a]) if a.dtype.kind in "iu" else jnp.stack(
          [a, jnp.tanh(a)]), inputs)
  ids_shift = jnp.array([0, 1])

  def body(acc, xs):
    inp, shift = xs
    if "ids" in inp:
      inp = dict(inp, ids=(inp["ids"] + shift) % VOCAB)
    return acc + layer.apply(params["layer"], inp, spec.approx, 0), None

  init = jax.eval_shape(lambda: apply(0))
  out, _ = lax.scan(body, jnp.zeros(init.shape, init.dtype),
                    (stacked, ids_shift))
  return out


def _nll(spec: ModelSpec, z, y):
  z = z.astype(jnp.float32)
  if spec.loss == "categorical":
    return optax.softmax_cross_entropy_with_integer_labels(z, y)
  if spec.loss == "normal":
    return jnp.sum((z - y) ** 2, axis=-1)
  return jnp.sum(optax.sigmoid_binary_cross_entropy(z, y), axis=-1)


_LOSS_TAGS = {
    "categorical": kl.register_categorical_predictive_distribution,
    "normal": kl.register_normal_predictive_distribution,
    "bernoulli": kl.register_multi_bernoulli_predictive_distribution,
}


def make_loss(spec: ModelSpec) -> Callable[[Any, Any], jax.Array]:
  """``loss(params, batch)``: the layer, a tagged dense head, the loss."""

  def loss(params, batch):
    h = features(spec, params, batch["inputs"])
    hd = params["head"]
    z = kl.register_dense(h @ hd["w"] + hd["b"], h, hd["w"], hd["b"])
    mask = batch.get("mask")
    _LOSS_TAGS[spec.loss](z, batch["y"], mask=mask)
    nll = _nll(spec, z, batch["y"])
    if mask is None:
      return jnp.mean(nll)
    return jnp.sum(mask * nll) / jnp.maximum(jnp.sum(mask), 1.0)

  return loss


@functools.cache
def feature_size(spec: ModelSpec) -> int:
  """``F``: the features the layer of ``spec`` gives the head."""
  inputs = LAYERS[spec.kind].inputs(np.random.default_rng(0))
  params = _cast(LAYERS[spec.kind].params(np.random.default_rng(0)),
                 spec.dtype)
  out = jax.eval_shape(lambda: LAYERS[spec.kind].apply(
      params, _cast(inputs, spec.dtype), None, 0))
  return out.shape[-1]


def _cast(tree, dtype):
  """Float leaves to ``dtype``, integer leaves to int32 (cast in numpy: no
  compiled conversion per shape)."""
  return jax.tree.map(lambda a: jnp.asarray(np.asarray(a).astype(
      jnp.dtype(dtype) if np.asarray(a).dtype.kind == "f" else np.int32)),
                      tree)


def make_params(spec: ModelSpec, seed: int):
  """The parameters of ``spec`` from ``seed`` (in ``spec.dtype``)."""
  rng = np.random.default_rng(seed)
  f = feature_size(spec)
  params = {"layer": LAYERS[spec.kind].params(rng),
            "head": {"w": _normal(rng, f, V) / np.sqrt(f),
                     "b": 0.1 * _normal(rng, V)}}
  return _cast(params, spec.dtype)


def make_batch(spec: ModelSpec, seed: int):
  """A batch of ``B`` examples from ``seed``: inputs, targets, mask."""
  rng = np.random.default_rng(seed)
  batch = {"inputs": _cast(LAYERS[spec.kind].inputs(rng), spec.dtype)}
  if spec.loss == "categorical":
    batch["y"] = jnp.asarray(rng.integers(0, V, (B,)).astype(np.int32))
  elif spec.loss == "normal":
    batch["y"] = jnp.asarray(_normal(rng, B, V).astype(np.float32))
  else:
    batch["y"] = jnp.asarray(rng.integers(0, 2, (B, V)).astype(np.float32))
  if spec.masked:
    mask = rng.integers(0, 2, (B,)).astype(np.float32)
    mask[rng.integers(0, B)] = 1.0   # At least one example counts.
    batch["mask"] = jnp.asarray(mask)
  return batch


def scan_collection(spec: ModelSpec, loss, params, batch):
  """The collection of ``loss``; a scanned kind gets ``spec.approx`` by
  its parameter path."""
  approximations = None
  if LAYERS[spec.kind].auto:
    approximations = {"['layer']": spec.approx}
  return kl.scan(loss, params, batch, approximations=approximations,
                 strict=True)
