"""The shared problem zoo: small named models with their batches.

Every test that needs "a small tagged model and some data" takes one from
here, so each model is defined once. A problem is a :class:`Problem`:
parameters, a list of batches and the tagged loss ``loss(params, batch)``;
``scan()`` traces its layer collection on the first batch. The builders
are deterministic (fixed ``PRNGKey`` seeds), so tests comparing against
fixed values keep bitwise-identical inputs.

Named problems:

* :func:`mlp_classifier`: a tanh MLP with a categorical loss, any sizes.
* :func:`small_classifier`: the 6-8-3 MLP, batches of 16 (``PRNGKey(i)``).
* :func:`tiny_classifier`: the same 6-8-3 MLP on one batch from
  ``PRNGKey(1)``.
* :func:`rnn_classifier`: a tanh RNN cell under ``lax.scan`` (one
  multi-use dense layer) and a dense readout.
"""

import functools
from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite as kl
from tests import helpers


class Problem(NamedTuple):
  """``params``, ``batches`` (a list) and the tagged ``loss``."""
  params: Any
  batches: list
  loss: Callable[[Any, Any], jax.Array]

  @property
  def batch(self):
    """The first batch."""
    return self.batches[0]

  def scan(self):
    """The layer collection, traced on the first batch."""
    return kl.scan(self.loss, self.params, self.batch)


def mlp_classifier(sizes=(6, 8, 3), batch_size=16, num_batches=1, *,
                   seed=0, first_batch_seed=0, dtype=None) -> Problem:
  """A tanh MLP (``helpers.mlp_params``) with a softmax cross-entropy.

  Batch ``i`` comes from ``PRNGKey(first_batch_seed + i)``; ``dtype``
  casts the parameters and the inputs (``None``: keep float32)."""
  params = helpers.mlp_params(jax.random.PRNGKey(seed), list(sizes))
  batches = [helpers.classification_batch(
      jax.random.PRNGKey(first_batch_seed + i), batch_size, sizes[0],
      sizes[-1]) for i in range(num_batches)]
  if dtype is not None:
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    batches = [(x.astype(dtype), y) for x, y in batches]
  return Problem(params, batches, helpers.classifier_loss)


def small_classifier(num_batches):
  """``(params, batches, collection)``: the tagged 6-8-3 MLP classifier and
  ``num_batches`` batches of 16."""
  p = mlp_classifier((6, 8, 3), 16, num_batches)
  return p.params, p.batches, p.scan()


def tiny_classifier() -> Problem:
  """The 6-8-3 MLP on one batch of 16 from ``PRNGKey(1)``."""
  return mlp_classifier((6, 8, 3), 16, first_batch_seed=1)


def rnn_loss(params, batch):
  """A tanh RNN over T steps, then a dense readout of the last state."""
  xs, y = batch  # xs: [T, B, d]

  def cell(h, x):
    z = jnp.concatenate([h, x], axis=-1)
    s = kl.register_dense(z @ params["cell"]["w"] + params["cell"]["b"], z,
                          params["cell"]["w"], params["cell"]["b"])
    return jnp.tanh(s), None

  h0 = jnp.zeros((xs.shape[1], params["cell"]["w"].shape[1]))
  h, _ = lax.scan(cell, h0, xs)
  o = params["out"]
  logits = kl.register_dense(h @ o["w"] + o["b"], h, o["w"], o["b"])
  kl.register_categorical_predictive_distribution(logits, y)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def rnn_setup(t=5, b=4, d=3, h=6, classes=2):
  """``(params, batch)`` for :func:`rnn_loss`: ``T`` steps of ``[B, d]``."""
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"cell": {"w": 0.5 * jax.random.normal(k[0], (h + d, h)),
                     "b": jnp.zeros(h)},
            "out": {"w": jax.random.normal(k[1], (h, classes)),
                    "b": jnp.zeros(classes)}}
  batch = (jax.random.normal(k[2], (t, b, d)),
           jax.random.randint(k[3], (b,), 0, classes))
  return params, batch


def rnn_classifier(t=5, b=4, d=3, h=6, classes=2) -> Problem:
  """:func:`rnn_setup` and :func:`rnn_loss` as a :class:`Problem`."""
  params, batch = rnn_setup(t, b, d, h, classes)
  return Problem(params, [batch], rnn_loss)


# A two-layer model ``[B, T, D] -> [B, T, E]`` whose time mean mixes the
# positions: the sequence-loss tests' problem.
SEQUENCE_SHAPE = (3, 4, 3, 5, 4)  # B, T, D, H, E


@functools.partial(jax.jit, static_argnums=0)  # One compile, not one a draw.
def sequence_params(seed=0):
  """The parameters of :func:`sequence_model`, drawn from ``seed``."""
  _, _, d, h, e = SEQUENCE_SHAPE
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return {"l1": {"b": 0.1 * jax.random.normal(ks[0], (h,)),
                 "w": jax.random.normal(ks[1], (d, h)) / np.sqrt(d)},
          "l2": {"b": 0.1 * jax.random.normal(ks[2], (e,)),
                 "w": jax.random.normal(ks[3], (h, e)) / np.sqrt(h)}}


def sequence_model(params, x):
  """``[B, T, D] -> [B, T, E]``; the time mean mixes the positions."""
  h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
  h = h + jnp.mean(h, axis=1, keepdims=True)
  return h @ params["l2"]["w"] + params["l2"]["b"]
