"""K-FAC against AdamW at nanoGPT's shakespeare-char configuration.

The anchor is nanoGPT's ``config/train_shakespeare_char.py``: 6 layers,
6 heads, width 384, context 256, batch 64, dropout 0.2, and its AdamW
(learning rate 1e-3, β₁ 0.9, β₂ 0.99, weight decay 0.1 on the matrices
and embeddings only, 100 warm-up steps, then a cosine to 1e-4 at step
5,000, gradient norm clipped to 1.0). nanoGPT's README gives a best
validation loss of 1.4697 for it; the model overfits after roughly
2,000 steps. The model, data, loss and step are those of
``examples/char_gpt.py`` (flax nnx, untagged, 10.8M parameters at this
size; no weight tying), trained on ``examples/data/tinyshakespeare.txt``.

K-FAC is :func:`kfac_jax_lite.kfac_adamw` with the same schedule shape
(warm-up, cosine to a tenth of its peak ``--kfac-lr``), the same β₂,
clipping and masked decoupled decay. Both run in one process on the same
batches and dropout masks, alternating in chunks of ``--eval-every``
steps, so load from other processes hits both.

The target is AdamW's best validation loss of the run. Printed: for each
optimizer its best validation loss, the seconds and steps to the target
(seconds count training steps from the first call on, trace and compile
included, evaluation excluded; also without the first call), the median
step and the first call, and whether JAX's persistent compilation cache
(on by default, ``--no-compilation-cache`` to compile afresh) answered the
first call. A PNG shows validation loss against steps and seconds.

Run::

  python benchmarks/nanogpt_race.py                # 5,000 steps; a GPU job
  python benchmarks/nanogpt_race.py --steps 2500   # past the best loss
  python benchmarks/nanogpt_race.py --steps 600 --kfac-lr 2e-3
  python benchmarks/nanogpt_race.py --smoke        # tiny model, seconds

Any flag of ``examples/char_gpt.py`` (``--kfac-damping``,
``--kfac-stats-fraction``, ``--eval-batches``, ...) overrides the anchor.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from typing import Optional, Sequence

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib.version  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax_lite  # noqa: E402

import char_gpt  # noqa: E402  pylint: disable=g-import-not-at-top

# nanoGPT's shakespeare-char run, as char_gpt.py flags.
ANCHOR = ["--width", "384", "--layers", "6", "--heads", "6", "--context",
          "256", "--batch-size", "64", "--dropout", "0.2", "--adam-lr",
          "1e-3", "--kfac-lr", "1e-3", "--steps", "5000", "--eval-every",
          "50", "--eval-batches", "20"]
# A tiny model that runs in seconds on a CPU.
SMOKE = ["--width", "32", "--layers", "1", "--heads", "2", "--context",
         "16", "--batch-size", "8", "--dropout", "0.2", "--adam-lr", "1e-2",
         "--kfac-lr", "1e-2", "--steps", "40", "--eval-every", "10",
         "--eval-batches", "2"]


def parse_args(argv: Optional[Sequence[str]]):
  """``(args, gpt)``: this script's flags and char_gpt's, anchor first."""
  p = argparse.ArgumentParser(
      description=(__doc__ or "").split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--smoke", action="store_true",
                 help="a tiny model for a few dozen steps (a CPU check)")
  p.add_argument("--warmup", type=int, default=None,
                 help="warm-up steps (default 100; 5 with --smoke)")
  p.add_argument("--decay-steps", type=int, default=None,
                 help="step where the cosine reaches a tenth of the peak "
                 "(default 5000; --steps with --smoke)")
  p.add_argument("--b2", type=float, default=0.99,
                 help="β₂ of both (kfac_adamw's sets its step lengths)")
  p.add_argument("--weight-decay", type=float, default=0.1,
                 help="decoupled decay of both, on matrices and embeddings")
  p.add_argument("--clip", type=float, default=1.0,
                 help="global gradient-norm clip (0: off)")
  p.add_argument("--plot", default="nanogpt_race.png",
                 help="PNG path ('' off)")
  p.add_argument("--compilation-cache",
                 default=char_gpt.DEFAULT_COMPILATION_CACHE,
                 help="JAX's persistent compilation cache directory")
  p.add_argument("--no-compilation-cache", dest="compilation_cache",
                 action="store_const", const=None,
                 help="compile everything afresh, keep nothing")
  args, rest = p.parse_known_args(argv)
  gpt = char_gpt.parse_args((SMOKE if args.smoke else ANCHOR) + list(rest)
                            + ["--plot", ""])
  if args.warmup is None:
    args.warmup = 5 if args.smoke else 100
  if args.decay_steps is None:
    args.decay_steps = gpt.steps if args.smoke else 5000
  if not 0 <= args.warmup < args.decay_steps:
    p.error(f"need 0 <= --warmup ({args.warmup}) < --decay-steps "
            f"({args.decay_steps})")
  if args.clip < 0:
    p.error(f"--clip must be >= 0; got {args.clip}")
  return args, gpt


def schedule(peak: float, args) -> optax.Schedule:
  """nanoGPT's: linear warm-up to ``peak``, cosine to ``peak/10`` at
  ``--decay-steps``, then constant."""
  return optax.warmup_cosine_decay_schedule(
      peak / (args.warmup + 1), peak, args.warmup, args.decay_steps,
      end_value=peak / 10)


def decay_mask(params):
  """nanoGPT decays the matrices and embeddings, not biases or norms."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def masked_decay(learning_rate: optax.Schedule, weight_decay: float
                 ) -> optax.GradientTransformation:
  """``-α_t · η · θ`` on :func:`decay_mask`'s params: AdamW's decoupled
  decay, for adding to an update that has none."""

  def init_fn(params):
    del params
    return optax.ScaleByScheduleState(count=np.zeros([], np.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("masked_decay: params=None; the decay is -α_t·η·θ, "
                       "so pass the parameters to update.")
    rate = -jnp.asarray(learning_rate(state.count)) * weight_decay
    mask = decay_mask(params)
    decay = jax.tree.map(lambda p, m: rate * p if m else 0.0 * p, params,
                         mask)
    return decay, optax.ScaleByScheduleState(
        count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


def with_decay(tx, learning_rate, weight_decay: float):
  """``tx``'s update plus :func:`masked_decay`'s (extra args go to tx)."""
  decay = masked_decay(learning_rate, weight_decay)

  def init_fn(params):
    return tx.init(params), decay.init(params)

  def update_fn(updates, state, params=None, **extra):
    u, tx_state = tx.update(updates, state[0], params, **extra)
    d, decay_state = decay.update(updates, state[1], params)
    return jax.tree.map(lambda a, b: a + b, u, d), (tx_state, decay_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def clipped(tx, clip: float):
  """``tx`` after a clip of the gradient's global norm to ``clip`` (0: tx)."""
  return optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx


def adamw(args, gpt) -> optax.GradientTransformation:
  """nanoGPT's AdamW."""
  return clipped(optax.adamw(schedule(gpt.adam_lr, args), b1=0.9,
                             b2=args.b2, weight_decay=args.weight_decay,
                             mask=decay_mask), args.clip)


def kfac(collection, args, gpt):
  """kfac_adamw with nanoGPT's schedule shape, β₂, clipping and decay."""
  lr = schedule(gpt.kfac_lr, args)
  tx = kfac_jax_lite.kfac_adamw(
      lr, collection, b1=gpt.kfac_momentum, b2=args.b2, weight_decay=0.0,
      damping=gpt.kfac_damping,
      inverse_update_period=gpt.kfac_inverse_period,
      cov_update_period=gpt.kfac_cov_period,
      stats_fraction=gpt.kfac_stats_fraction, seed=gpt.seed)
  return clipped(with_decay(tx, lr, args.weight_decay), args.clip)


# ---------------------------------------------------------- reporting ----


def git_hash() -> str:
  """The checkout's short commit, ``+changes`` if tracked files differ."""
  try:
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, timeout=10,
                         check=False)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain",
                            "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10,
                           check=False)
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  if out.returncode:
    return "unknown"
  return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def environment() -> str:
  """One line: the device and the versions the figures were measured with."""
  d = jax.devices()[0]
  return (f"device: {d.device_kind} ({d.platform}, {jax.device_count()} "
          f"device(s)); jax {jax.__version__}, jaxlib "
          f"{jaxlib.version.__version__}, optax {optax.__version__}, "
          f"python {platform.python_version()}, "
          f"kfac_jax_lite {getattr(kfac_jax_lite, '__version__', '?')} (git "
          f"{git_hash()})")


def cache_entries(path: str) -> set:
  """The names in the persistent cache directory ``path``."""
  path = os.path.expanduser(path)
  return set(os.listdir(path)) if os.path.isdir(path) else set()


class CacheWatch:
  """Wraps a run's step: records whether its first call wrote new entries
  into the persistent cache (a miss: it compiled) or none (a hit)."""

  def __init__(self, step, path: Optional[str]):
    self.step, self.path, self.result = step, path, "off" if not path else None

  def __call__(self, *args):
    if self.result is not None or not self.path:  # measured, or cache off
      return self.step(*args)
    before = cache_entries(self.path)
    out = jax.block_until_ready(self.step(*args))
    new = cache_entries(self.path) - before
    self.result = f"miss ({len(new)} new)" if new else "hit"
    return out


def report(runs, watches) -> dict:
  """Prints the table; returns one dict of figures per run."""
  adam = runs[0]
  best_step, _, target = min(adam.curve, key=lambda c: c[2])
  print(f"\ntarget: AdamW's best validation loss {target:.4f} (step "
        f"{best_step})\n")
  cols = ("optimizer", "best valid", "at step", "steps to target",
          "s to target", "s to target w/o first call", "median step ms",
          "first call s", "first call cache")
  print("| " + " | ".join(cols) + " |")
  print("|" + "---|" * len(cols))
  out = {}
  for r, w in zip(runs, watches):
    step, _, best = min(r.curve, key=lambda c: c[2])
    n, t = (char_gpt.steps_to_loss(r, target),
            char_gpt.seconds_to_loss(r, target))
    out[r.name] = dict(best=best, best_step=step, steps_to_target=n,
                       seconds_to_target=t, median_step=char_gpt.median_step(
                           r), first_call=r.first_call, cache=w.result)
    cells = [r.name, f"{best:.4f}", str(step),
             "-" if n is None else str(n),
             "-" if t is None else f"{t:.2f}",
             "-" if t is None else f"{t - r.first_call:.2f}",
             f"{1e3 * out[r.name]['median_step']:.2f}",
             f"{r.first_call:.2f}", w.result]
    print("| " + " | ".join(cells) + " |")
  a, k = out[adam.name], out[runs[1].name]
  print(f"\nstep: {k['median_step'] / a['median_step']:.2f}x AdamW's; "
        f"first call: {k['first_call'] / a['first_call']:.2f}x")
  if k["seconds_to_target"] is None:
    print(f"{runs[1].name} does not reach {target:.4f} in {runs[1].steps} "
          "steps")
  else:
    ks, as_ = k["seconds_to_target"], a["seconds_to_target"]
    warm = ((ks - k["first_call"]) / (as_ - a["first_call"])
            if as_ > a["first_call"] else float("nan"))
    print(f"{runs[1].name} reaches {target:.4f} in {ks / as_:.2f}x AdamW's "
          f"seconds (first calls in), {warm:.2f}x without them, "
          f"{k['steps_to_target'] / a['steps_to_target']:.2f}x its steps")
  out["target"] = target
  return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Races AdamW and kfac_adamw; returns :func:`report`'s figures and the
  runs under ``"runs"``."""
  args, gpt = parse_args(argv)
  char_gpt.use_compilation_cache(args.compilation_cache)
  print(environment())
  s = char_gpt.setup(gpt)
  n = sum(x.size for x in jax.tree.leaves(s["params"]))
  print(f"{n / 1e6:.2f}M parameters, {gpt.layers} layers, {gpt.heads} heads, "
        f"width {gpt.width}, context {gpt.context}, batch {gpt.batch_size}, "
        f"dropout {gpt.dropout}; {gpt.steps} steps; warm-up {args.warmup}, "
        f"cosine to step {args.decay_steps}; AdamW {gpt.adam_lr:g}, "
        f"kfac_adamw {gpt.kfac_lr:g}\n", flush=True)
  runs, watches = [], []
  for name, tx, fraction in (
      ("adamw", adamw(args, gpt), None),
      ("kfac_adamw", kfac(s["collection"], args, gpt), 1.0)):
    state, step = char_gpt.make_runner(s["loss_fn"], tx, fraction,
                                       s["params"])
    watches.append(CacheWatch(step, args.compilation_cache))
    runs.append(char_gpt.Run(name, s["params"], state, watches[-1]))
  char_gpt.race(runs, s["batch_fn"], s["eval_fn"], gpt.steps, gpt.eval_every)
  out = report(runs, watches)
  if args.plot:
    char_gpt.plot(runs, args.plot, f"char GPT ({n / 1e6:.2f}M params), "
                  f"nanoGPT's shakespeare-char setup, "
                  f"{jax.devices()[0].device_kind}")
    print(f"wrote {args.plot}")
  out["runs"] = runs
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
