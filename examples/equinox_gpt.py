"""The char GPT of ``char_gpt.py`` written in plain Equinox: K-FAC vs AdamW.

The same model as ``examples/char_gpt.py`` (token embedding plus learned
positions, ``--layers`` pre-LayerNorm blocks of causal multi-head attention
and a GELU MLP of width 4·D, a final LayerNorm and a dense head; 0.82M
parameters at ``D=128``, ``T=64``, 4 blocks, 4 heads), written the way
Equinox layers are: for one sequence, from ``eqx.nn.Embedding``,
``eqx.nn.MultiheadAttention`` (separate query, key, value and output
projections, all with biases), ``eqx.nn.LayerNorm``, ``eqx.nn.MLP`` and
``eqx.nn.Linear``, each applied to the ``T`` positions with ``jax.vmap``;
the loss function ``vmap``\\ s the model over the sequences of the batch.
Only the loss is tagged (the ``[B, T, V]`` logits as a categorical
distribution); :func:`kfac_jax_lite.scan` finds the rest by itself.

The parameter count matches the nnx model's; the initialisation is
Equinox's own, so the curves differ from ``char_gpt.py``'s. The data,
batches, validation windows, training loop and race are ``char_gpt.py``'s
(imported), and so are its flags. ``benchmarks/transformer_race.py``
races this model and the nnx one against the peer optimizers.

Run::

  python examples/equinox_gpt.py                    # a few minutes, 2 CPUs
  python examples/equinox_gpt.py --steps 100 --plot ""
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import kfac_jax_lite

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import char_gpt  # noqa: E402  pylint: disable=g-import-not-at-top


# --------------------------------------------------------------- model ----


class Block(eqx.Module):
  """Pre-LayerNorm block for one sequence ``[T, D]``: causal attention,
  then a GELU MLP, each added to the residual stream."""

  ln1: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  ln2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP

  def __init__(self, width: int, heads: int, *, key):
    k1, k2 = jax.random.split(key)
    self.ln1 = eqx.nn.LayerNorm(width)
    self.attn = eqx.nn.MultiheadAttention(
        heads, width, use_query_bias=True, use_key_bias=True,
        use_value_bias=True, use_output_bias=True, key=k1)
    self.ln2 = eqx.nn.LayerNorm(width)
    self.mlp = eqx.nn.MLP(width, width, 4 * width, 1,
                          activation=jax.nn.gelu, key=k2)

  def __call__(self, x):
    t = x.shape[0]
    h = jax.vmap(self.ln1)(x)
    x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((t, t), bool)))
    return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class GPT(eqx.Module):
  """Token and position embeddings, blocks, final LayerNorm, dense head;
  ``GPT(...)(ids)`` maps one sequence of ``T`` ids to ``[T, vocab]``
  logits."""

  tok: eqx.nn.Embedding
  pos: eqx.nn.Embedding
  blocks: list
  ln: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, vocab: int, context: int, width: int, layers: int,
               heads: int, *, key):
    if width % heads:
      raise ValueError(f"--width {width} must be a multiple of --heads "
                       f"{heads}.")
    keys = jax.random.split(key, layers + 3)
    self.tok = eqx.nn.Embedding(vocab, width, key=keys[0])
    self.pos = eqx.nn.Embedding(context, width, key=keys[1])
    self.blocks = [Block(width, heads, key=k) for k in keys[3:]]
    self.ln = eqx.nn.LayerNorm(width)
    self.head = eqx.nn.Linear(width, vocab, key=keys[2])

  def __call__(self, ids):
    x = jax.vmap(self.tok)(ids) + jax.vmap(self.pos)(
        jnp.arange(ids.shape[0]))
    for block in self.blocks:
      x = block(x)
    return jax.vmap(self.head)(jax.vmap(self.ln)(x))


def make_loss_fn(static) -> Callable:
  """``loss_fn(params, batch)``: mean next-character cross-entropy of the
  model ``eqx.combine(params, static)`` over the ``B·T`` positions."""
  def loss_fn(params, batch):
    logits = jax.vmap(eqx.combine(params, static))(batch["x"])
    logits = kfac_jax_lite.register_categorical_predictive_distribution(
        logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()
  return loss_fn


# ---------------------------------------------------------------- main ----


def setup(args) -> dict[str, Any]:
  """Data, loss, parameters and the scanned collection, as
  ``char_gpt.setup`` returns them for the nnx model (``--dropout`` is not
  supported here)."""
  if args.dropout:
    raise ValueError(f"--dropout {args.dropout}: the Equinox GPT has no "
                     "dropout; pass --dropout 0.")
  train_ids, valid_ids, chars = char_gpt.load_text(args.data)
  model = GPT(len(chars), args.context, args.width, args.layers, args.heads,
              key=jax.random.PRNGKey(args.seed))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  loss_fn = make_loss_fn(static)
  batch_fn = lambda k: char_gpt.train_batch(  # noqa: E731
      train_ids, k, args.batch_size, args.context, args.seed)
  collection = kfac_jax_lite.scan(loss_fn, params, batch_fn(0),
                                  approximations=args.approx or None)
  eval_fn = char_gpt.make_eval_fn(loss_fn, char_gpt.valid_batches(
      valid_ids, args.eval_batches, args.batch_size, args.context))
  return dict(chars=chars, static=static, loss_fn=loss_fn, params=params,
              batch_fn=batch_fn, collection=collection, eval_fn=eval_fn)


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Races K-FAC against AdamW on the Equinox GPT; returns the runs."""
  args, _, n, runs = char_gpt.race_kfac_and_adamw(setup, argv)
  if args.plot:
    char_gpt.plot(runs, args.plot, f"Equinox char GPT ({n / 1e6:.2f}M "
                  "params), tiny Shakespeare")
    print(f"wrote {args.plot}")
  return {r.name: r for r in runs}


if __name__ == "__main__":
  main()
