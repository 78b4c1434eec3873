"""An untagged Equinox convolutional autoencoder on MNIST: K-FAC and Adam.

The model is plain Equinox, written for one example and batched with
``jax.vmap``: two strided ``eqx.nn.Conv2d`` (the encoder), a linear
32-unit ``eqx.nn.Linear`` bottleneck, then ``Linear -> tanh -> Linear`` to
the 784 pixel logits (the decoder). The loss is the sigmoid cross-entropy
of the reconstruction, summed over the pixels and averaged over the batch.
No layer is tagged: :func:`kfac_jax_lite.scan` finds the convolutions
(with their ``[c_out, 1, 1]`` biases) and the ``Linear`` layers (``weight
@ x`` with ``[d_out, d_in]`` weights) by itself; only the loss is tagged,
as independent Bernoullis. The training loop is Equinox's own:
``eqx.partition`` splits the parameters from the static parts,
``eqx.filter_jit`` compiles the step and ``eqx.apply_updates`` applies the
updates.

Both optimizers see the same batches and run the same step:
``eqx.filter_value_and_grad`` for the loss and the gradient, then
``tx.update(grads, state, params, batch=batch)``. K-FAC is
:func:`kfac_jax_lite.kfac_optimizer` (damping, learning rate and momentum
adapted from the quadratic model), whose curvature side (statistics and
Fisher-vector products) runs on ``--kfac-stats-fraction`` of each batch
(a :class:`kfac_jax_lite.FisherEstimator` with that ``stats_fraction``),
whose damping stays above ``--kfac-min-damping``, and whose inverses are
refreshed every ``--kfac-inverse-period`` steps.
Adam is ``optax.adam(--adam-lr)``; Adam ignores ``batch=``
(``optax.with_extra_args_support``). Both run ``--steps`` steps, K-FAC
first. Times are wall-clock from the first call, so compilation is
included (a second run loads the compiled steps from the persistent
compilation cache). The report says when K-FAC reached Adam's final loss
(steps and seconds), prints both losses at equal steps and at equal
seconds, the test-set loss of each, and writes a PNG. Measured results:
docs/guides/equinox.md.

Run::

  python examples/equinox_cnn.py                  # about 1 minute, 2 CPUs
  python examples/equinox_cnn.py --steps 5 --plot ""   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Optional, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "data", "mnist.npz")

# Where JAX keeps compiled programs across runs (XDG cache directory).
DEFAULT_COMPILATION_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
    "kfac_jax_lite", "jax")


def use_compilation_cache(path: Optional[str]) -> None:
  """Turns on JAX's persistent compilation cache in ``path`` (None: off).

  A second run of the script loads its compiled steps from there instead
  of compiling them again (docs/performance.md, *Paying the compile
  once*). Call it before the first computation.
  """
  if path:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# ---------------------------------------------------------------------------
# Model.
# ---------------------------------------------------------------------------


class ConvAutoencoder(eqx.Module):
  """``[1, 28, 28] -> [784]`` reconstruction logits, for one example.

  Encoder: two strided tanh convolutions (``28 -> 13 -> 6``), then a
  linear ``code``-unit bottleneck. Decoder: a tanh ``Linear`` to
  ``hidden`` units and a ``Linear`` to the 784 pixel logits. Batch it with
  ``jax.vmap``.
  """
  conv1: eqx.nn.Conv2d
  conv2: eqx.nn.Conv2d
  encode: eqx.nn.Linear
  decode: eqx.nn.Linear
  output: eqx.nn.Linear

  def __init__(self, key, channels: int = 8, code: int = 32,
               hidden: int = 256):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    self.conv1 = eqx.nn.Conv2d(1, channels, 4, stride=2, key=k1)
    self.conv2 = eqx.nn.Conv2d(channels, 2 * channels, 3, stride=2, key=k2)
    self.encode = eqx.nn.Linear(2 * channels * 36, code, key=k3)
    self.decode = eqx.nn.Linear(code, hidden, key=k4)
    self.output = eqx.nn.Linear(hidden, 28 * 28, key=k5)

  def __call__(self, image):
    h = jnp.tanh(self.conv1(image))
    h = jnp.tanh(self.conv2(h))
    h = jnp.tanh(self.decode(self.encode(h.reshape(-1))))
    return self.output(h)


def reconstruction_loss(logits, images):
  """Sigmoid cross-entropy summed over the 784 pixels, batch mean."""
  return optax.sigmoid_binary_cross_entropy(
      logits, images.reshape(len(images), -1)).sum(-1).mean()


def make_loss_fn(static) -> Callable:
  """``loss_fn(params, batch)``: the reconstruction loss, logits tagged.

  ``params`` is the array half of ``eqx.partition(model,
  eqx.is_inexact_array)`` (an Equinox module with ``None`` leaves) and
  ``static`` the other half. The logits are tagged as independent
  Bernoullis, one per pixel; nothing else is.
  """
  def loss_fn(params, batch):
    model = eqx.combine(params, static)
    logits = jax.vmap(model)(batch["image"])
    kfac_jax_lite.register_multi_bernoulli_predictive_distribution(
        logits, batch["image"].reshape(len(logits), -1))
    return reconstruction_loss(logits, batch["image"])
  return loss_fn


# ---------------------------------------------------------------------------
# Data and training.
# ---------------------------------------------------------------------------


def load_mnist(path: str) -> dict:
  """Train/test images ``[N, 1, 28, 28]`` in ``[0, 1]``, int32 labels."""
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"MNIST file {path!r} not found. The repository ships it at "
        f"{DEFAULT_DATA!r}; pass --data PATH to use another copy.")
  with np.load(path) as d:
    return {"x_train": d["x_train"][:, None].astype(np.float32) / 255.0,
            "y_train": d["y_train"].astype(np.int32),
            "x_test": d["x_test"][:, None].astype(np.float32) / 255.0,
            "y_test": d["y_test"].astype(np.int32)}


def batches(data: dict, batch_size: int, seed: int):
  """Endless shuffled batches (reshuffled every epoch)."""
  rng = np.random.default_rng(seed)
  n = len(data["x_train"])
  order, pos = rng.permutation(n), 0
  while True:
    if pos + batch_size > n:
      order, pos = rng.permutation(n), 0
    idx = order[pos:pos + batch_size]
    pos += batch_size
    yield {"image": data["x_train"][idx], "label": data["y_train"][idx]}


def objective(model, batch):
  """The reconstruction loss of ``model`` (batched with ``vmap``), untagged."""
  return reconstruction_loss(jax.vmap(model)(batch["image"]), batch["image"])


def make_step(tx) -> Callable:
  """``step(model, state, batch) -> (model, state, loss)``: Equinox's loop.

  The same for both optimizers: K-FAC takes ``batch=`` (its statistics,
  Fisher-vector products and damping rule use it); Adam ignores it
  (``optax.with_extra_args_support``).
  """
  @eqx.filter_jit
  def step(model, state, batch):
    loss, grads = eqx.filter_value_and_grad(objective)(model, batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = tx.update(grads, state, params, batch=batch)
    return eqx.apply_updates(model, updates), state, loss

  return step


def train(name: str, step: Callable, model, state, data: dict, *,
          steps: int, batch_size: int, seed: int, log_every: int) -> dict:
  """Runs ``step`` for ``steps`` steps.

  ``times[k]`` is the wall-clock time from the first call (compilation
  included) to the end of step ``k``; the loss of a step is its batch's
  loss before the update.
  """
  losses, times = [], []
  t0 = time.perf_counter()
  for k, batch in enumerate(batches(data, batch_size, seed)):
    if k >= steps:
      break
    model, state, loss = step(model, state, batch)
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
    if log_every and (k + 1) % log_every == 0:
      print(f"  [{name}] step {k + 1:5d}  loss "
            f"{np.mean(losses[-log_every:]):.4f}  {times[-1]:6.1f}s",
            flush=True)
  return {"model": model, "losses": np.array(losses),
          "times": np.array(times), "first_call_s": times[0]}


def smoothed(losses: np.ndarray, window: int) -> np.ndarray:
  """Trailing mean over ``window`` steps (shorter at the start)."""
  c = np.cumsum(np.concatenate([[0.0], losses]))
  idx = np.arange(1, len(losses) + 1)
  lo = np.maximum(idx - window, 0)
  return (c[idx] - c[lo]) / (idx - lo)


def first_reaching(run: dict, target: float, window: int):
  """``(step, seconds)`` when the smoothed loss first reached ``target``
  (``(None, None)`` if it never did)."""
  hit = np.nonzero(smoothed(run["losses"], window) <= target)[0]
  if not len(hit):
    return None, None
  return int(hit[0]) + 1, float(run["times"][hit[0]])


def comparison_rows(kfac: dict, adam: dict, steps: int, window: int):
  """Rows ``(step, seconds, kfac loss, adam loss)``: the smoothed losses
  at equal steps, then at equal seconds (first call included)."""
  sk, sa = smoothed(kfac["losses"], window), smoothed(adam["losses"], window)
  rows = []
  for s in sorted({max(1, round(steps * f)) for f in (0.1, 0.25, 0.5, 1)}):
    rows.append(("step", s, sk[s - 1], sa[s - 1]))
  horizon = min(kfac["times"][-1], adam["times"][-1])
  for f in (0.25, 0.5, 0.75, 1.0):
    t = horizon * f
    ik = np.searchsorted(kfac["times"], t, side="right") - 1
    ia = np.searchsorted(adam["times"], t, side="right") - 1
    rows.append(("seconds", t, sk[ik] if ik >= 0 else np.nan,
                 sa[ia] if ia >= 0 else np.nan))
  return rows


def test_loss(model, images, chunk: int = 2000) -> float:
  """The reconstruction loss on ``images``, evaluated in chunks."""
  evaluate = eqx.filter_jit(
      lambda m, x: objective(m, {"image": x}) * len(x))
  total = sum(float(evaluate(model, images[i:i + chunk]))
              for i in range(0, len(images), chunk))
  return total / len(images)


def plot(runs: dict, path: str, window: int, title: str) -> None:
  """Training loss against steps and against seconds, PNG."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for label, run in runs.items():
    s = smoothed(run["losses"], window)
    axes[0].plot(np.arange(1, len(s) + 1), s, label=label)
    axes[1].plot(run["times"], s, label=label)
  for ax, xlabel in zip(axes, ("step", "seconds (first call included)")):
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"training loss (mean of last {window} batches)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  """Parses and checks the command-line flags (see ``--help``)."""
  p = argparse.ArgumentParser(
      description="Train an untagged Equinox convolutional autoencoder on "
      "MNIST with K-FAC and with Adam on the same batches; compare at "
      "equal steps and seconds.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--data", default=DEFAULT_DATA, help="path to mnist.npz")
  p.add_argument("--steps", type=int, default=400,
                 help="steps per optimizer")
  p.add_argument("--batch-size", type=int, default=1024)
  p.add_argument("--channels", type=int, default=8,
                 help="filters of the first convolution")
  p.add_argument("--code", type=int, default=32,
                 help="width of the bottleneck")
  p.add_argument("--hidden", type=int, default=256,
                 help="width of the decoder's hidden layer")
  p.add_argument("--kfac-damping", type=float, default=10.0,
                 help="kfac_optimizer's initial damping")
  p.add_argument("--kfac-min-damping", type=float, default=0.1,
                 help="floor of the adapted damping (lower lets a step "
                 "blow up late in the run)")
  p.add_argument("--kfac-stats-fraction", type=float, default=0.125,
                 help="fraction of each batch the curvature side uses "
                 "(at least 64 examples)")
  p.add_argument("--kfac-inverse-period", type=int, default=10,
                 help="refresh the factor inverses every N steps")
  p.add_argument("--adam-lr", type=float, default=1e-2)
  p.add_argument("--window", type=int, default=25,
                 help="losses are means over the last N batches")
  p.add_argument("--eval-examples", type=int, default=10000,
                 help="test images used for the test loss")
  p.add_argument("--plot", default="equinox_cnn.png",
                 help="PNG of the losses ('' for none)")
  p.add_argument("--log-every", type=int, default=100,
                 help="progress line every N steps (0: never)")
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
  for name in ("steps", "batch_size", "channels", "code", "hidden", "window",
               "eval_examples", "kfac_inverse_period"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, "
              f"got {getattr(args, name)}")
  if not 0.0 < args.kfac_stats_fraction <= 1.0:
    p.error("--kfac-stats-fraction must be in (0, 1], got "
            f"{args.kfac_stats_fraction}")
  return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Trains with K-FAC, then Adam; prints the comparison, writes the plot.

  Returns:
    ``{"kfac": run, "adam": run, "layers": [...], "reached": (step,
    seconds)}``; a run has ``losses`` and ``times`` (per step, seconds from
    the first call), ``first_call_s`` and ``test_loss``; ``layers``
    lists ``(name, kind, found_by)`` of the collection; ``reached`` is when
    K-FAC's smoothed loss first reached Adam's final one (``None``s if it
    did not).
  """
  args = parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  data = load_mnist(args.data)
  model = ConvAutoencoder(jax.random.PRNGKey(args.seed), args.channels,
                          args.code, args.hidden)
  params, static = eqx.partition(model, eqx.is_inexact_array)
  loss_fn = make_loss_fn(static)
  example = next(batches(data, args.batch_size, args.seed))
  collection = kfac_jax_lite.scan(loss_fn, params, example)  # untagged
  print(collection.describe())
  print(f"\njax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPUs; batch {args.batch_size}\n", flush=True)

  estimator = kfac_jax_lite.FisherEstimator(
      collection, stats_fraction=args.kfac_stats_fraction)
  kfac_tx = kfac_jax_lite.kfac_optimizer(
      collection, initial_damping=args.kfac_damping,
      min_damping=args.kfac_min_damping,
      inverse_update_period=args.kfac_inverse_period, estimator=estimator)
  adam_tx = optax.with_extra_args_support(optax.adam(args.adam_lr))
  runs = {}
  for name, tx in (("kfac", kfac_tx), ("adam", adam_tx)):
    run = train(name, make_step(tx), model, tx.init(params), data,
                steps=args.steps, batch_size=args.batch_size,
                seed=args.seed, log_every=args.log_every)
    run["test_loss"] = test_loss(
        run.pop("model"), data["x_test"][:args.eval_examples])
    print(f"{name}: {len(run['losses'])} steps in {run['times'][-1]:.1f}s "
          f"(first call {run['first_call_s']:.1f}s); test loss "
          f"{run['test_loss']:.2f}\n", flush=True)
    runs[name] = run

  k, a, w = runs["kfac"], runs["adam"], args.window
  print(f"Training loss, mean over the last {w} batches; seconds from the "
        "first call (compilation included):\n")
  print(f"{'':>8} {'at':>8}  {'kfac':>8}  {'adam':>8}")
  for what, at, lk, la in comparison_rows(k, a, args.steps, w):
    at_s = f"{at:8d}" if what == "step" else f"{at:7.1f}s"
    print(f"{what:>8} {at_s}  {lk:8.4f}  {la:8.4f}")
  target = float(smoothed(a["losses"], w)[-1])
  step, seconds = first_reaching(k, target, w)
  print(f"\nAdam's final loss {target:.4f} after {len(a['losses'])} steps, "
        f"{a['times'][-1]:.1f}s; K-FAC reached it "
        + (f"at step {step}, {seconds:.1f}s" if step else "not at all"))
  if args.plot:
    plot({"kfac": k, f"adam {args.adam_lr:g}": a}, args.plot, w,
         f"Equinox convolutional autoencoder on MNIST, batch {args.batch_size}")
    print(f"wrote {args.plot}")
  return {"kfac": k, "adam": a, "reached": (step, seconds),
          "layers": [(l.name, l.kind, l.found_by)
                     for l in collection.layers]}


if __name__ == "__main__":
  main(sys.argv[1:])
