"""A small character-level GPT in flax nnx on tiny Shakespeare: K-FAC vs AdamW.

Model: token embedding plus learned positions, ``--layers`` pre-LayerNorm
blocks of causal multi-head self-attention and a GELU MLP (width 4·D), a
final LayerNorm and a dense head over the 65 characters. At the defaults
(``D=128``, ``T=64``, 4 blocks, 4 heads) it has 0.82M parameters.
``--dropout p`` adds dropout where nanoGPT has it (the embeddings' sum,
the attention weights, the outputs of the attention projection and of the
MLP) in training only, each sequence's masks drawn from a seed that comes
with its batch. The model is plain ``nnx.Linear`` / ``nnx.Embed`` /
``nnx.LayerNorm`` with no layer tags: :func:`kfac_jax_lite.scan`
recognises the dense layers, the token embedding and the LayerNorms by
itself and prints what it found.

Loss: the mean over the ``B·T`` positions of the next-character
cross-entropy. The ``[B, T, V]`` logits are registered as a categorical
distribution; a loss tag describes the mean over its leading positions, so
the registered curvature is that of this loss.

Data: ``examples/data/tinyshakespeare.txt`` (provenance in
``examples/data/README.md``), the first 90% for training and the last 10%
for validation. Both optimizers train from the same initialisation on the
same random windows, in alternating chunks of ``--eval-every`` steps in one
process, so a busy machine slows both alike. The validation loss is the
mean over ``--eval-batches`` fixed windows of the validation text; seconds
count training steps only (evaluation excluded), first call included.

Optimizers (the recipe and its measurements: ``docs/transformers.md``):

* AdamW: ``optax.adamw(--adam-lr, weight_decay=0.01)``, constant rate.
* K-FAC (default): :func:`kfac_jax_lite.kfac_adamw`, the direction
  ``F̂⁻¹g`` of :func:`kfac_jax_lite.scale_by_kfac` rescaled per parameter
  tensor to the norm of RMSProp's step (:func:`kfac_jax_lite.graft`), then
  AdamW's momentum, decoupled weight decay and learning rate: AdamW with
  K-FAC's directions, at its defaults and ``--kfac-lr`` (2e-3: of 1e-3,
  1.5e-3, 2e-3 and 3e-3, the rate that reaches AdamW's 600-step and
  2000-step losses soonest). The curvature statistics come from
  the first ``--kfac-stats-fraction`` of each batch's sequences.
  ``--no-graft`` runs :func:`kfac_jax_lite.kfac` instead (heavy-ball
  momentum, KL clipping, optional warm-up).

At the end it prints the validation loss of both at equal steps and at equal
seconds, writes a PNG of both curves against steps and seconds, and prints a
short text sample from each model.

Run::

  python examples/char_gpt.py                        # a few minutes, 2 CPUs
  python examples/char_gpt.py --steps 150 --kfac-damping 1e-2
  python examples/char_gpt.py --steps 2000 --width 256 --layers 6
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "data", "tinyshakespeare.txt")

# Where JAX keeps compiled programs across runs (XDG cache directory).
DEFAULT_COMPILATION_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
    "kfac_jax_lite", "jax")


def use_compilation_cache(path: Optional[str]) -> None:
  """Turns on JAX's persistent compilation cache in ``path`` (None: off).

  A second run of the script loads its compiled steps from there instead
  of compiling them again (docs/performance.md, *Paying the compile
  once*). Every program is kept, however short its compile
  (``jax_persistent_cache_min_compile_time_secs`` 0). Call it before the
  first computation.
  """
  if path:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# ---------------------------------------------------------------- data ----


def load_text(path: str, valid_fraction: float = 0.1):
  """``(train_ids, valid_ids, chars)``: int32 ids, split by position."""
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"Text file {path!r} not found. The repository ships tiny "
        f"Shakespeare at {DEFAULT_DATA!r}; pass --data PATH for another.")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  chars = sorted(set(text))
  lookup = {c: i for i, c in enumerate(chars)}
  ids = np.array([lookup[c] for c in text], np.int32)
  cut = int(len(ids) * (1.0 - valid_fraction))
  return ids[:cut], ids[cut:], chars


def windows(ids: np.ndarray, starts: np.ndarray, context: int) -> dict:
  """Inputs ``ids[s:s+T]`` and next-character targets for each start s."""
  idx = starts[:, None] + np.arange(context)[None]
  return {"x": ids[idx], "y": ids[idx + 1]}


def train_batch(ids: np.ndarray, step: int, batch_size: int, context: int,
                seed: int, dropout_seeds: bool = False) -> dict:
  """The random training windows of step ``step`` (the same for every run);
  with ``dropout_seeds`` also ``"seed"``, one dropout seed per window."""
  rng = np.random.default_rng((seed, step))
  batch = windows(ids, rng.integers(0, len(ids) - context - 1, batch_size),
                  context)
  if dropout_seeds:
    batch["seed"] = rng.integers(0, 2**31 - 1, batch_size, dtype=np.int32)
  return batch


def valid_batches(ids: np.ndarray, count: int, batch_size: int,
                  context: int) -> list:
  """``count`` fixed batches of windows spread evenly over ``ids``."""
  starts = np.linspace(0, len(ids) - context - 2, count * batch_size)
  return [windows(ids, s.astype(np.int64), context)
          for s in np.split(starts, count)]


# --------------------------------------------------------------- model ----


def dropout(x, rate: float, keys, site: int):
  """``x`` with each entry zeroed with probability ``rate`` and the others
  scaled by ``1/(1-rate)`` (inverted dropout); ``x`` itself when ``keys``
  is None or ``rate`` is 0.

  ``keys``: one PRNG key per sequence, ``[B, 2]`` (``x``'s leading axis is
  the batch); ``site`` numbers the dropout layer, folded into each key. A
  sequence's masks depend on its own key only, so a pass over the first
  rows of a batch (K-FAC's statistics) drops what the full pass dropped.
  """
  if keys is None or not rate:
    return x
  keep = jax.vmap(lambda k: jax.random.bernoulli(
      jax.random.fold_in(k, site), 1.0 - rate, x.shape[1:]))(keys)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: causal attention, then a GELU MLP.

  With ``rate > 0`` and per-sequence ``keys``, dropout (nanoGPT's places)
  on the attention weights, the attention's output projection and the
  MLP's output; ``site`` is the first of the three dropout sites it uses.
  """

  def __init__(self, width: int, heads: int, *, rate: float = 0.0,
               rngs: nnx.Rngs):
    self.heads, self.rate = heads, rate
    self.ln1 = nnx.LayerNorm(width, rngs=rngs)
    self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
    self.proj = nnx.Linear(width, width, rngs=rngs)
    self.ln2 = nnx.LayerNorm(width, rngs=rngs)
    self.fc = nnx.Linear(width, 4 * width, rngs=rngs)
    self.out = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x, keys=None, site: int = 0):
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    q, k, v = (z.reshape(b, t, self.heads, d // self.heads)
               for z in (q, k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // self.heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = dropout(jax.nn.softmax(scores, axis=-1), self.rate, keys, site)
    y = jnp.einsum("bhts,bshd->bthd", weights, v)
    x = x + dropout(self.proj(y.reshape(b, t, d)), self.rate, keys, site + 1)
    return x + dropout(self.out(jax.nn.gelu(self.fc(self.ln2(x)))),
                       self.rate, keys, site + 2)


class GPT(nnx.Module):
  """Token and position embeddings, blocks, final LayerNorm, dense head.

  ``dropout``: the rate on the embeddings' sum and in every block (off by
  default); it applies only when the call gets per-sequence ``keys``.
  """

  def __init__(self, vocab: int, context: int, width: int, layers: int,
               heads: int, *, dropout: float = 0.0, rngs: nnx.Rngs):
    if width % heads:
      raise ValueError(f"--width {width} must be a multiple of --heads "
                       f"{heads}.")
    if not 0.0 <= dropout < 1.0:
      raise ValueError(f"--dropout {dropout} must be in [0, 1).")
    self.rate = dropout
    self.tok = nnx.Embed(vocab, width, rngs=rngs)
    self.pos = nnx.Embed(context, width, rngs=rngs)
    self.blocks = nnx.List([Block(width, heads, rate=dropout, rngs=rngs)
                            for _ in range(layers)])
    self.ln = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, ids, keys=None):
    x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))[None]
    x = dropout(x, self.rate, keys, 0)
    for i, block in enumerate(self.blocks):
      x = block(x, keys, 1 + 3 * i)
    return self.head(self.ln(x))


def make_loss_fn(graphdef) -> Callable:
  """``loss_fn(params, batch)``: mean next-character cross-entropy.

  A batch with ``"seed"`` (one int per sequence) trains with the model's
  dropout, each sequence's masks drawn from its own seed; without it
  (evaluation, sampling) the model runs without dropout.
  """
  def loss_fn(params, batch):
    keys = (jax.vmap(jax.random.PRNGKey)(batch["seed"]) if "seed" in batch
            else None)
    logits = nnx.merge(graphdef, params)(batch["x"], keys)
    logits = kfac_jax_lite.register_categorical_predictive_distribution(
        logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()
  return loss_fn


# ---------------------------------------------------------- optimizers ----


def kfac_transform(collection, args: argparse.Namespace, seed: int = 0):
  """``(tx, fraction)``: the K-FAC optimizer of ``args`` (descent updates;
  takes ``batch=``) and the share of each batch the runner must pass as
  ``batch=`` (1: the optimizer cuts it itself).

  Default: :func:`kfac_jax_lite.kfac_adamw`, AdamW whose per-tensor
  directions are K-FAC's (``F̂⁻¹g`` grafted onto RMSProp's norm).
  ``--no-graft``: :func:`kfac_jax_lite.kfac` (heavy-ball momentum on the
  natural gradient, KL clipping).
  """
  warmup = max(args.kfac_warmup, 0)
  lr = (optax.linear_schedule(args.kfac_lr / max(warmup, 1), args.kfac_lr,
                              warmup) if warmup else args.kfac_lr)
  curvature = dict(damping=args.kfac_damping,
                   inverse_update_period=args.kfac_inverse_period,
                   cov_update_period=args.kfac_cov_period, seed=seed)
  if args.graft:
    return kfac_jax_lite.kfac_adamw(
        lr, collection, b1=args.kfac_momentum,
        weight_decay=args.kfac_weight_decay,
        stats_fraction=args.kfac_stats_fraction, **curvature), 1.0
  return kfac_jax_lite.kfac(
      lr, collection, momentum=args.kfac_momentum,
      weight_decay=args.kfac_weight_decay,
      norm_constraint=args.kfac_norm_constraint or None,
      **curvature), args.kfac_stats_fraction


def make_step(loss_fn: Callable, tx, fraction: Optional[float] = None
              ) -> Callable:
  """``step(params, state, batch) -> (params, state, loss)``, not jitted.

  The gradient is that of the whole batch. With ``fraction`` the optimizer
  also gets ``batch=``: the first ``⌈f·B⌉`` sequences, from which K-FAC
  runs its statistics pass (the whole batch for ``f = 1``). The three
  stages run in named scopes (``loss_and_grad``, ``optimizer``,
  ``apply_updates``), which a profile shows (``benchmarks/step_profile.py``).
  """

  def step(params, state, batch):
    with jax.named_scope("loss_and_grad"):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    extra = {}
    if fraction is not None:
      rows = max(1, math.ceil(fraction * batch["x"].shape[0]))
      extra["batch"] = (batch if fraction >= 1 else
                        jax.tree.map(lambda x: x[:rows], batch))
    with jax.named_scope("optimizer"):
      updates, state = tx.update(grads, state, params, **extra)
    with jax.named_scope("apply_updates"):
      params = optax.apply_updates(params, updates)
    return params, state, loss

  return step


def make_runner(loss_fn: Callable, tx, fraction: Optional[float], params):
  """``(state, run)`` with ``run(params, state, batch, count)``, jitted:
  :func:`make_step` of ``tx`` with ``fraction`` (None: no ``batch=``)."""
  step = jax.jit(make_step(loss_fn, tx, fraction))

  def run(params, state, batch, count):
    del count
    return step(params, state, batch)
  return tx.init(params), run


def make_kfac_runner(loss_fn: Callable, tx, fraction: float, params):
  """``(state, step)`` with ``step(params, state, batch, count)``, jitted:
  :func:`make_step` with ``fraction``."""
  return make_runner(loss_fn, tx, fraction, params)


def adamw_transform(lr: float) -> optax.GradientTransformation:
  """The baseline: ``optax.adamw(lr, weight_decay=0.01)``, constant rate."""
  return optax.adamw(lr, weight_decay=0.01)


def make_adamw_runner(loss_fn: Callable, lr: float, params):
  """``(state, step)`` for :func:`adamw_transform`, jitted."""
  return make_runner(loss_fn, adamw_transform(lr), None, params)


def make_eval_fn(loss_fn: Callable, batches: list) -> Callable:
  """``eval_fn(params) -> float``: mean loss over the validation batches."""
  stacked = jax.tree.map(lambda *x: np.stack(x), *batches)
  one = jax.jit(lambda p, b: jax.lax.map(lambda bb: loss_fn(p, bb), b).mean())
  return lambda params: float(one(params, stacked))


# ------------------------------------------------------------ training ----


class Run:
  """One optimizer's params, state, step function and measured curve."""

  def __init__(self, name: str, params, state, step: Callable):
    self.name, self.params, self.state, self.step = name, params, state, step
    self.steps, self.seconds, self.first_call = 0, 0.0, None
    self.curve = []  # (step, seconds, validation loss)
    self.train_losses, self.step_seconds = [], []

  def advance(self, batch_fn: Callable, count: int) -> None:
    """``count`` steps on ``batch_fn(step)``; seconds exclude batch making."""
    for _ in range(count):
      batch = batch_fn(self.steps)
      t0 = time.perf_counter()
      self.params, self.state, loss = self.step(self.params, self.state,
                                                batch, self.steps)
      loss = float(loss)  # waits for the step
      dt = time.perf_counter() - t0
      self.seconds += dt
      self.step_seconds.append(dt)
      if self.first_call is None:
        self.first_call = dt
      self.steps += 1
      self.train_losses.append(loss)


def progress(runs: Sequence[Run], total: int, width: int = 24) -> str:
  """One progress-bar line for the runs (steps done of ``total``)."""
  done = min(r.steps for r in runs)
  bar = "#" * (width * done // total) + "." * (width - width * done // total)
  parts = [f"{r.name} {r.curve[-1][2]:.3f} ({r.seconds:5.1f}s)"
           for r in runs if r.curve]
  return f"[{bar}] {done:5d}/{total}  valid " + "  ".join(parts)


def race(runs: Sequence[Run], batch_fn: Callable, eval_fn: Callable,
         steps: int, eval_every: int, show: bool = True) -> None:
  """Alternates the runs in chunks of ``eval_every`` steps up to ``steps``."""
  for r in runs:
    r.curve.append((0, 0.0, eval_fn(r.params)))
  while min(r.steps for r in runs) < steps:
    for r in runs:
      r.advance(batch_fn, min(eval_every, steps - r.steps))
      r.curve.append((r.steps, r.seconds, eval_fn(r.params)))
    if show:
      end = "\n" if not sys.stdout.isatty() else ""
      print("\r" + progress(runs, steps), end=end, flush=True)
  if show and sys.stdout.isatty():
    print()


def loss_at_seconds(run: Run, seconds: float) -> float:
  """Validation loss interpolated at ``seconds`` of training."""
  _, secs, losses = zip(*run.curve)
  return float(np.interp(seconds, secs, losses))


def median_step(run: Run) -> float:
  """Median seconds of the steps after the first call."""
  return float(np.median(run.step_seconds[1:] or run.step_seconds))


def _reached(run: Run, target: float) -> Optional[tuple]:
  """The first ``(step, seconds, loss)`` of the curve with loss <= target."""
  return next((c for c in run.curve if c[2] <= target), None)


def seconds_to_loss(run: Run, target: float) -> Optional[float]:
  """First measured training seconds at which validation loss <= target."""
  hit = _reached(run, target)
  return None if hit is None else hit[1]


def steps_to_loss(run: Run, target: float) -> Optional[int]:
  """First evaluated step at which validation loss <= target."""
  hit = _reached(run, target)
  return None if hit is None else hit[0]


# ------------------------------------------------------------- outputs ----


def generate(model: GPT, chars: Sequence[str], context: int, length: int,
             seed: int, prompt: str = "\n") -> str:
  """``length`` characters sampled from ``model`` after ``prompt``."""
  lookup = {c: i for i, c in enumerate(chars)}
  ids = [lookup[c] for c in prompt if c in lookup] or [0]
  forward = nnx.jit(lambda m, x: m(x))
  key = jax.random.PRNGKey(seed)
  for _ in range(length):
    window = ids[-context:]
    x = np.zeros((1, context), np.int32)
    x[0, :len(window)] = window
    logits = forward(model, x)[0, len(window) - 1]
    key, sub = jax.random.split(key)
    ids.append(int(jax.random.categorical(sub, logits)))
  return "".join(chars[i] for i in ids[len(prompt):])


def plot(runs: Sequence[Run], path: str, title: str) -> None:
  """Validation loss against steps and against seconds, one PNG."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for r in runs:
    steps, secs, losses = zip(*r.curve)
    axes[0].plot(steps, losses, label=r.name)
    axes[1].plot(secs, losses, label=r.name)
  for ax, xlabel in zip(axes, ("step", "training seconds (first call in)")):
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ---------------------------------------------------------------- main ----


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description="Train an untagged flax nnx char-level GPT on tiny "
      "Shakespeare with K-FAC and with AdamW, side by side.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--data", default=DEFAULT_DATA, help="a text file")
  p.add_argument("--steps", type=int, default=600, help="steps per optimizer")
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--context", type=int, default=64, help="T, characters")
  p.add_argument("--width", type=int, default=128, help="D")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--dropout", type=float, default=0.0,
                 help="dropout rate in training (nanoGPT's places; "
                 "never at evaluation)")
  p.add_argument("--adam-lr", type=float, default=3e-3)
  p.add_argument("--kfac-lr", type=float, default=2e-3,
                 help="kfac_adamw's rate (best of 1e-3, 1.5e-3, 2e-3 and "
                 "3e-3 over 2000 steps: docs/transformers.md)")
  p.add_argument("--graft", action=argparse.BooleanOptionalAction,
                 default=True, help="graft K-FAC's direction onto RMSProp's "
                 "per-tensor norm (--no-graft: kfac_jax_lite.kfac)")
  p.add_argument("--kfac-warmup", type=int, default=0,
                 help="steps of linear learning-rate warm-up")
  p.add_argument("--kfac-damping", type=float, default=1e-3)
  p.add_argument("--kfac-momentum", type=float, default=0.9)
  p.add_argument("--kfac-weight-decay", type=float, default=0.01)
  p.add_argument("--kfac-norm-constraint", type=float, default=1e-3,
                 help="KL clipping C with --no-graft (0: off)")
  p.add_argument("--kfac-inverse-period", type=int, default=10)
  p.add_argument("--kfac-cov-period", type=int, default=1,
                 help="update the curvature statistics every N steps")
  p.add_argument("--kfac-stats-fraction", type=float, default=0.125,
                 help="share of each batch's sequences the statistics use")
  p.add_argument("--approx", action="append", default=[],
                 metavar="KEY=APPROX", help="an approximation for a layer "
                 "kind or parameter-path prefix, e.g. "
                 "scale_and_shift=diagonal (repeatable)")
  p.add_argument("--eval-every", type=int, default=25)
  p.add_argument("--eval-batches", type=int, default=8)
  p.add_argument("--sample-length", type=int, default=200)
  p.add_argument("--plot", default="char_gpt.png", help="PNG path ('' off)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--compilation-cache",
                 default=DEFAULT_COMPILATION_CACHE if argv is None else None,
                 help="JAX's persistent compilation cache directory: a "
                 "second run loads its compiled steps from it (on by "
                 "default from the command line; off for main(argv))")
  p.add_argument("--no-compilation-cache", dest="compilation_cache",
                 action="store_const", const=None,
                 help="compile everything afresh, keep nothing")
  args = p.parse_args(argv)
  for name in ("steps", "batch_size", "context", "width", "layers", "heads",
               "eval_every", "eval_batches"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  if not 0.0 <= args.dropout < 1.0:
    p.error(f"--dropout must be in [0, 1); got {args.dropout}")
  if any("=" not in a for a in args.approx):
    p.error(f"--approx takes KEY=APPROX; got {args.approx}")
  args.approx = dict(a.split("=", 1) for a in args.approx)
  return args


def setup(args: argparse.Namespace) -> dict[str, Any]:
  """Data, model factory, loss and the scanned collection."""
  train_ids, valid_ids, chars = load_text(args.data)
  new_model = lambda: GPT(len(chars), args.context, args.width,  # noqa: E731
                          args.layers, args.heads, dropout=args.dropout,
                          rngs=nnx.Rngs(args.seed))
  graphdef, _ = nnx.split(new_model(), nnx.Param)
  loss_fn = make_loss_fn(graphdef)
  params = nnx.as_pure(nnx.state(new_model(), nnx.Param))
  batch_fn = lambda k: train_batch(train_ids, k, args.batch_size,  # noqa
                                   args.context, args.seed,
                                   dropout_seeds=args.dropout > 0)
  collection = kfac_jax_lite.scan(loss_fn, params, batch_fn(0),
                                  approximations=args.approx or None)
  eval_fn = make_eval_fn(loss_fn, valid_batches(
      valid_ids, args.eval_batches, args.batch_size, args.context))
  return dict(chars=chars, new_model=new_model, graphdef=graphdef,
              loss_fn=loss_fn, params=params, batch_fn=batch_fn,
              collection=collection, eval_fn=eval_fn)


def race_kfac_and_adamw(setup_fn: Callable,
                        argv: Optional[Sequence[str]]) -> tuple:
  """Parses ``argv``, builds the model with ``setup_fn(args)`` (this
  module's :func:`setup` or another GPT's), races K-FAC against AdamW on it
  and prints the report; returns ``(args, setup, parameter count, runs)``."""
  args = parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  s = setup_fn(args)
  print(s["collection"].describe())
  n = sum(x.size for x in jax.tree.leaves(s["params"]))
  print(f"\n{n / 1e6:.2f}M parameters; jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; {args.steps} steps of "
        f"{args.batch_size}x{args.context} characters\n", flush=True)
  kfac_state, kfac_step = make_kfac_runner(
      s["loss_fn"], *kfac_transform(s["collection"], args, args.seed),
      s["params"])
  adam_state, adam_step = make_adamw_runner(s["loss_fn"], args.adam_lr,
                                            s["params"])
  runs = [Run("kfac", s["params"], kfac_state, kfac_step),
          Run("adamw", s["params"], adam_state, adam_step)]
  race(runs, s["batch_fn"], s["eval_fn"], args.steps, args.eval_every)
  report(runs, args)
  return args, s, n, runs


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Races K-FAC against AdamW; returns ``{"kfac": Run, "adamw": Run}``."""
  args, s, n, runs = race_kfac_and_adamw(setup, argv)
  if args.plot:
    plot(runs, args.plot, f"char GPT ({n / 1e6:.2f}M params), tiny "
         "Shakespeare")
    print(f"wrote {args.plot}")
  for r in runs:
    model = s["new_model"]()
    nnx.update(model, r.params)
    text = generate(model, s["chars"], args.context, args.sample_length,
                    args.seed)
    print(f"\n--- {r.name} sample ---\n{text}")
  return {r.name: r for r in runs}


def report(runs: Sequence[Run], args: argparse.Namespace) -> None:
  """Validation loss at equal steps and at equal seconds; step times."""
  k, a = runs
  print(f"\n{'':>6} {'valid':>7} {'seconds':>8} {'ms/step':>8} "
        f"{'first call':>10}")
  for r in runs:
    per_step = 1e3 * median_step(r)
    print(f"{r.name:>6} {r.curve[-1][2]:7.3f} {r.seconds:8.1f} "
          f"{per_step:8.1f} {r.first_call:9.2f}s")
  equal = min(k.seconds, a.seconds)
  print(f"at {args.steps} steps: K-FAC {k.curve[-1][2]:.3f}, AdamW "
        f"{a.curve[-1][2]:.3f}")
  print(f"at {equal:.1f} s: K-FAC {loss_at_seconds(k, equal):.3f}, AdamW "
        f"{loss_at_seconds(a, equal):.3f}")
  t = seconds_to_loss(k, a.curve[-1][2])
  print(f"K-FAC reaches AdamW's final {a.curve[-1][2]:.3f} "
        + (f"after {t:.1f} s ({t / a.seconds:.2f}x AdamW's {a.seconds:.1f} s)"
           if t is not None else "not within its steps"))


if __name__ == "__main__":
  main()
