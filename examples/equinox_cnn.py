"""An untagged Equinox CNN on MNIST, trained with K-FAC and with Adam.

The model is plain Equinox, written for one example and batched with
``jax.vmap``: ``eqx.nn.Conv2d`` -> ``eqx.nn.Conv2d`` -> ``eqx.nn.LayerNorm``
-> ``eqx.nn.MLP``. No layer is tagged: :func:`kfac_jax_lite.scan` finds the
convolutions (with their ``[c_out, 1, 1]`` biases), the layer norm's scale
and shift and the MLP's ``Linear`` layers (``weight @ x`` with ``[d_out,
d_in]`` weights) by itself; only the loss is tagged. The training loop is
Equinox's own: ``eqx.partition`` splits the parameters from the static
parts, ``eqx.filter_jit`` compiles the step and ``eqx.apply_updates``
applies K-FAC's updates.

Both optimizers see the same batches and run the same step:
``eqx.filter_value_and_grad`` for the loss and the gradient, then
``tx.update(grads, state, params, batch=batch)``. K-FAC is
:func:`kfac_jax_lite.kfac`, which computes its curvature statistics from
``batch`` every ``--kfac-cov-period`` steps and refreshes its inverses
every ``--kfac-inverse-period`` steps. Both run ``--steps`` steps. Times
are wall-clock from the first call, so compilation is included (a second
run loads the compiled steps from the persistent compilation cache). The
report says when K-FAC reached Adam's final loss (steps and seconds),
prints both losses at equal steps and at equal seconds and writes a PNG.
Measured results: docs/guides/equinox.md.

Run::

  python examples/equinox_cnn.py                  # 20-40 s on 2 CPUs
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


class CNN(eqx.Module):
  """``[1, 28, 28] -> 10`` logits, for one example (batch it with vmap).

  Two strided tanh convolutions, a layer norm over the ``[2c, 5, 5]``
  feature map and a one-hidden-layer ReLU MLP.
  """
  conv1: eqx.nn.Conv2d
  conv2: eqx.nn.Conv2d
  norm: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP

  def __init__(self, key, channels: int = 4, hidden: int = 64):
    k1, k2, k3 = jax.random.split(key, 3)
    self.conv1 = eqx.nn.Conv2d(1, channels, 5, stride=2, key=k1)
    self.conv2 = eqx.nn.Conv2d(channels, 2 * channels, 3, stride=2, key=k2)
    self.norm = eqx.nn.LayerNorm((2 * channels, 5, 5))
    self.mlp = eqx.nn.MLP(2 * channels * 25, 10, hidden, 1, key=k3)

  def __call__(self, image):
    h = jnp.tanh(self.conv1(image))
    h = jnp.tanh(self.norm(self.conv2(h)))
    return self.mlp(h.reshape(-1))


def make_loss_fn(static) -> Callable:
  """``loss_fn(params, batch)``: mean cross-entropy, the logits tagged.

  ``params`` is the array half of ``eqx.partition(model,
  eqx.is_inexact_array)`` (an Equinox module with ``None`` leaves) and
  ``static`` the other half.
  """
  def loss_fn(params, batch):
    model = eqx.combine(params, static)
    logits = jax.vmap(model)(batch["image"])
    kfac_jax_lite.register_categorical_predictive_distribution(
        logits, batch["label"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["label"]).mean()
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


def cross_entropy(model, batch):
  """Mean cross-entropy of ``model`` (batched with ``vmap``), untagged."""
  return optax.softmax_cross_entropy_with_integer_labels(
      jax.vmap(model)(batch["image"]), batch["label"]).mean()


def make_step(tx) -> Callable:
  """``step(model, state, batch) -> (model, state, loss)``: Equinox's loop.

  The same for both optimizers: K-FAC takes ``batch=`` and computes its
  statistics from it on the steps they are due (``cov_update_period``);
  Adam ignores it (``optax.with_extra_args_support``).
  """
  @eqx.filter_jit
  def step(model, state, batch):
    loss, grads = eqx.filter_value_and_grad(cross_entropy)(model, batch)
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


def accuracy(model, images, labels, chunk: int = 2000) -> float:
  """Fraction of correct predictions, evaluated in chunks."""
  predict = eqx.filter_jit(lambda m, x: jnp.argmax(jax.vmap(m)(x), axis=-1))
  correct = sum(int(jnp.sum(predict(model, images[i:i + chunk])
                            == labels[i:i + chunk]))
                for i in range(0, len(images), chunk))
  return correct / len(images)


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
      description="Train an untagged Equinox CNN on MNIST with K-FAC and "
      "with Adam on the same batches; compare at equal steps and seconds.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--data", default=DEFAULT_DATA, help="path to mnist.npz")
  p.add_argument("--steps", type=int, default=400,
                 help="steps per optimizer")
  p.add_argument("--batch-size", type=int, default=512)
  p.add_argument("--channels", type=int, default=4,
                 help="filters of the first convolution")
  p.add_argument("--hidden", type=int, default=64,
                 help="width of the MLP's hidden layer")
  p.add_argument("--kfac-lr", type=float, default=0.3)
  p.add_argument("--kfac-damping", type=float, default=0.3)
  p.add_argument("--kfac-momentum", type=float, default=0.5)
  p.add_argument("--kfac-cov-period", type=int, default=5,
                 help="update the curvature statistics every N steps")
  p.add_argument("--kfac-inverse-period", type=int, default=10,
                 help="refresh the factor inverses every N steps")
  p.add_argument("--adam-lr", type=float, default=1e-2)
  p.add_argument("--window", type=int, default=25,
                 help="losses are means over the last N batches")
  p.add_argument("--eval-examples", type=int, default=10000,
                 help="test images used for the accuracy")
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
  for name in ("steps", "batch_size", "channels", "hidden", "window",
               "eval_examples", "kfac_cov_period", "kfac_inverse_period"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, "
              f"got {getattr(args, name)}")
  return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Trains with K-FAC, then Adam; prints the comparison, writes the plot.

  Returns:
    ``{"kfac": run, "adam": run, "layers": [...], "reached": (step,
    seconds)}``; a run has ``losses`` and ``times`` (per step, seconds from
    the first call), ``first_call_s`` and ``test_accuracy``; ``layers``
    lists ``(name, kind, found_by)`` of the collection; ``reached`` is when
    K-FAC's smoothed loss first reached Adam's final one (``None``s if it
    did not).
  """
  args = parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  data = load_mnist(args.data)
  model = CNN(jax.random.PRNGKey(args.seed), args.channels, args.hidden)
  params, static = eqx.partition(model, eqx.is_inexact_array)
  loss_fn = make_loss_fn(static)
  example = next(batches(data, args.batch_size, args.seed))
  collection = kfac_jax_lite.scan(loss_fn, params, example)  # untagged
  print(collection.describe())
  print(f"\njax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPUs; batch {args.batch_size}\n", flush=True)

  kfac_tx = kfac_jax_lite.kfac(
      args.kfac_lr, collection, momentum=args.kfac_momentum,
      damping=args.kfac_damping, cov_update_period=args.kfac_cov_period,
      inverse_update_period=args.kfac_inverse_period, seed=args.seed)
  adam_tx = optax.with_extra_args_support(optax.adam(args.adam_lr))
  runs = {}
  for name, tx in (("kfac", kfac_tx), ("adam", adam_tx)):
    run = train(name, make_step(tx), model, tx.init(params), data,
                steps=args.steps, batch_size=args.batch_size,
                seed=args.seed, log_every=args.log_every)
    run["test_accuracy"] = accuracy(
        run.pop("model"), data["x_test"][:args.eval_examples],
        data["y_test"][:args.eval_examples])
    print(f"{name}: {len(run['losses'])} steps in {run['times'][-1]:.1f}s "
          f"(first call {run['first_call_s']:.1f}s); test accuracy "
          f"{run['test_accuracy']:.4f}\n", flush=True)
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
         f"Equinox CNN on MNIST, batch {args.batch_size}")
    print(f"wrote {args.plot}")
  return {"kfac": k, "adam": a, "reached": (step, seconds),
          "layers": [(l.name, l.kind, l.found_by)
                     for l in collection.layers]}


if __name__ == "__main__":
  main(sys.argv[1:])
