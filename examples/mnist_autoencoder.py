"""The deep MNIST autoencoder of Martens & Grosse (2015): K-FAC against Adam.

Model: ``784-1000-500-250-30-250-500-1000-784`` (``--scale`` multiplies the
hidden widths), tanh between layers, a linear 30-unit code, Glorot-uniform
kernels and zero biases. Loss: sigmoid cross-entropy of the reconstruction
logits, summed over the 784 pixels and averaged over the batch, plus
``1e-5 · ½‖θ‖²`` on every weight and bias (TF K-FAC's example, whose L2 term
also covers the biases). The logits are registered as independent Bernoullis
and every layer with :func:`kfac_jax_lite.register_dense`.

Optimizers, on the same batches in the same order:

* :func:`kfac_jax_lite.kfac_optimizer`: the full algorithm (Levenberg-
  Marquardt damping, learning rate and momentum from the quadratic model),
  at its defaults except ``l2_reg=1e-5`` (the regulariser's curvature) and
  ``--kfac-damping``. Its step is ``update(None, state, params,
  batch=batch)``: one forward pass of the batch gives the loss, the
  gradient, the curvature statistics and the Fisher-vector products of the
  quadratic model.
* ``optax.adam`` at ``--adam-lr`` (default ``1e-3``), tuned on 300 steps
  of the default run (batch 500, seed 0) over ``{1e-4, 3e-4, 1e-3, 3e-3}``:
  losses 167.8, 130.7, 114.5 and 147.0 (mean of the last 20 batches).
  ``benchmarks/time_to_loss.py`` finds ``1e-3`` best at 2000 steps too.

By default Adam keeps going after the K-FAC steps until it has used as much
wall-clock time as K-FAC (``--no-match-time`` to stop it at the same step),
so the table can compare the two at equal steps *and* at equal seconds. The
reported loss is the training objective on each step's batch, before that
step's update. A PNG shows both curves against steps and against seconds.

Run::

  python examples/mnist_autoencoder.py             # ~2-3 minutes, 2-core CPU
  python examples/mnist_autoencoder.py --steps 40 --scale 0.25   # ~30 s
  python examples/mnist_autoencoder.py --steps 500 --plot ae500.png
  python examples/mnist_autoencoder.py --paper     # TF's setup: a GPU job
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "data", "mnist.npz")
HIDDEN = (1000, 500, 250, 30, 250, 500, 1000)
L2 = 1e-5

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


# ---------------------------------------------------------------------------
# Model and loss.
# ---------------------------------------------------------------------------


def layer_sizes(scale: float) -> tuple:
  """``(784, *hidden, 784)``; hidden widths scaled, the 30-unit code kept."""
  hidden = tuple(h if h == 30 else max(1, round(h * scale)) for h in HIDDEN)
  return (784,) + hidden + (784,)


def init_params(key, sizes: Sequence[int]) -> list:
  """Glorot-uniform kernels ``[d_in, d_out]`` and zero biases, per layer."""
  params = []
  for d_in, d_out in zip(sizes[:-1], sizes[1:]):
    key, sub = jax.random.split(key)
    limit = math.sqrt(6.0 / (d_in + d_out))
    params.append({"w": jax.random.uniform(sub, (d_in, d_out), jnp.float32,
                                           -limit, limit),
                   "b": jnp.zeros((d_out,), jnp.float32)})
  return params


def reconstruct(params: list, x: jnp.ndarray) -> jnp.ndarray:
  """Logits of the reconstruction; every layer tagged for K-FAC.

  tanh after each layer except the 30-unit code and the output.
  """
  code_layer = len(params) // 2 - 1
  for i, p in enumerate(params):
    y = x @ p["w"] + p["b"]
    y = kfac_jax_lite.register_dense(y, x, p["w"], p["b"])
    last = i == len(params) - 1
    x = y if (last or i == code_layer) else jnp.tanh(y)
  return x


def loss_fn(params: list, images: jnp.ndarray) -> jnp.ndarray:
  """Mean over the batch of the summed pixel cross-entropy, plus L2."""
  logits = reconstruct(params, images)
  logits = kfac_jax_lite.register_multi_bernoulli_predictive_distribution(
      logits, images)
  xent = optax.sigmoid_binary_cross_entropy(logits, images).sum(-1).mean()
  l2 = 0.5 * sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(params))
  return xent + L2 * l2


def squared_error(params: list, images: jnp.ndarray) -> jnp.ndarray:
  """The paper's reported error: ``Σ_pixels (σ(logits) - x)²``, batch mean."""
  recon = jax.nn.sigmoid(reconstruct(params, images))
  return jnp.square(recon - images).sum(-1).mean()


# ---------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------


def load_images(path: str) -> np.ndarray:
  """MNIST training images as float32 ``[60000, 784]`` in ``[0, 1]``."""
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"MNIST file {path!r} not found. The repository ships it at "
        f"{DEFAULT_DATA!r}; pass --data PATH to use another copy.")
  with np.load(path) as d:
    x = d["x_train"]
  return (x.reshape(len(x), -1) / np.float32(255.0)).astype(np.float32)


def paper_batch_size(step: int, num_examples: int) -> int:
  """TF's growing batch, piecewise constant to bound recompilations.

  TF uses ``min(⌊2^{k/d}·1000⌋, N)`` with ``d = 499 / log2(N / 1000)``
  (the full set at step 500); here the exponent is floored, so the batch
  doubles every ``d`` steps: 1000, 2000, ..., 32000, then ``N`` from step
  500 on (7 distinct sizes, 7 compilations).
  """
  d = 499 / math.log2(num_examples / 1000)
  if step >= 500:
    return num_examples
  return min(1000 * 2 ** int(step / d), num_examples)


def batch_stream(images: np.ndarray, steps: int,
                 batch_size: int | Callable[[int], int], seed: int
                 ) -> Iterator[np.ndarray]:
  """``steps`` batches, drawn without replacement within each epoch.

  ``batch_size`` is an int or a function of the step. The same seed gives
  both optimizers the same batches.
  """
  rng = np.random.default_rng(seed)
  order, pos = rng.permutation(len(images)), 0
  for k in range(steps):
    size = batch_size(k) if callable(batch_size) else batch_size
    if pos + size > len(order):
      order, pos = rng.permutation(len(images)), 0
    yield images[order[pos:pos + size]]
    pos += size


# ---------------------------------------------------------------------------
# Training steps.
# ---------------------------------------------------------------------------


def make_kfac_step(collection, tx) -> Callable:
  """Jitted ``step(params, state, batch, rng) -> (params, state, loss)``.

  ``tx.update(None, ...)``: ``kfac_optimizer`` takes loss, gradient,
  statistics and its Fisher-vector products from one forward pass of the
  batch (it samples with the key in its state, so ``rng`` is unused).
  """
  del collection  # tx was built from it.

  def step(params, state, batch, rng):
    del rng
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, state.loss

  return jax.jit(step, donate_argnums=(0, 1))


def make_adam_step(tx) -> Callable:
  """The same step for optax.adam (``rng`` unused)."""
  def step(params, state, batch, rng):
    del rng
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def warm_up(step: Callable, params, state, batch, repeats: int = 3
            ) -> tuple:
  """Compiles ``step`` and times it on copies of the inputs (donated).

  Returns ``(first call seconds, median seconds of the later calls)``; the
  first call includes tracing and XLA compilation.
  """
  params, state = jax.tree.map(jnp.copy, (params, state))
  times = []
  for k in range(repeats):
    t0 = time.perf_counter()
    params, state, loss = step(params, state, batch, jax.random.PRNGKey(k))
    loss.block_until_ready()
    times.append(time.perf_counter() - t0)
  return times[0], float(np.median(times[1:]))


def train(name: str, step: Callable, params, state, batches, *,
          total: int, time_budget: Optional[float], log_every: int,
          window: int, seed: int, describe_state: Callable = lambda s: ""
          ) -> dict:
  """Runs ``step`` over ``batches``; records loss and elapsed time per step.

  Stops after ``total`` steps, or, with ``time_budget``, once that many
  seconds have passed (``total`` is then only a cap). The loss of a step is
  its batch's loss before the update. Every step is synchronised (the loss
  is read back), so ``times`` are wall-clock seconds since the start; call
  :func:`warm_up` first to keep compilation out of them.
  """
  key = jax.random.PRNGKey(seed)
  params, state = jax.tree.map(jnp.copy, (params, state))  # step donates.
  losses, times = [], []
  t0 = time.perf_counter()
  for k, batch in enumerate(batches):
    if k >= total or (time_budget is not None and times
                      and times[-1] >= time_budget):
      break
    params, state, loss = step(params, state, batch,
                               jax.random.fold_in(key, k))
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
    if not math.isfinite(losses[-1]):
      print(f"  [{name}] non-finite loss at step {k}; stopping", flush=True)
      break
    if log_every and (k + 1) % log_every == 0:
      print(f"  [{name}] step {k + 1:5d}  loss "
            f"{np.mean(losses[-window:]):8.3f}  {times[-1]:6.1f}s"
            f"{describe_state(state)}", flush=True)
  return {"params": params, "state": state, "losses": np.array(losses),
          "times": np.array(times)}


def smoothed(losses: np.ndarray, window: int = 20) -> np.ndarray:
  """Trailing mean over ``window`` steps (shorter at the start)."""
  c = np.cumsum(np.concatenate([[0.0], losses]))
  idx = np.arange(1, len(losses) + 1)
  lo = np.maximum(idx - window, 0)
  return (c[idx] - c[lo]) / (idx - lo)


def loss_at_step(run: dict, step: int, window: int) -> float:
  """Smoothed loss after ``step`` steps (nan if the run is shorter)."""
  s = smoothed(run["losses"], window)
  return float(s[step - 1]) if 0 < step <= len(s) else float("nan")


def loss_at_time(run: dict, seconds: float, window: int) -> float:
  """Smoothed loss of the last step finished by ``seconds`` (nan if none)."""
  s = smoothed(run["losses"], window)
  i = np.searchsorted(run["times"], seconds, side="right") - 1
  return float(s[i]) if i >= 0 else float("nan")


# ---------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------


def comparison_tables(kfac: dict, adam: dict, window: int) -> tuple:
  """Rows ``(step, kfac, adam)`` and ``(seconds, kfac, adam)``."""
  n = len(kfac["losses"])
  steps = sorted({max(1, round(n * f)) for f in (0.1, 0.25, 0.5, 0.75, 1.0)})
  by_step = [(s, loss_at_step(kfac, s, window), loss_at_step(adam, s, window))
             for s in steps]
  horizon = min(kfac["times"][-1], adam["times"][-1])
  secs = [horizon * f for f in (0.1, 0.25, 0.5, 0.75, 1.0)]
  by_time = [(t, loss_at_time(kfac, t, window), loss_at_time(adam, t, window))
             for t in secs]
  return by_step, by_time


def plot(runs: dict, path: str, window: int, title: str) -> None:
  """Training loss against steps and against seconds (log scale), PNG."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for label, run in runs.items():
    s = smoothed(run["losses"], window)
    axes[0].plot(np.arange(1, len(s) + 1), s, label=label)
    axes[1].plot(run["times"], s, label=label)
  for ax, xlabel in zip(axes, ("step", "seconds (compilation excluded)")):
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"training loss (mean of last {window} batches)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  """Parses and checks the command-line flags (see ``--help``)."""
  p = argparse.ArgumentParser(
      description="Train Martens & Grosse's deep MNIST autoencoder with "
      "kfac_optimizer and with Adam on the same batches; compare the "
      "training loss at equal steps and at equal seconds.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--data", default=DEFAULT_DATA, help="path to mnist.npz")
  p.add_argument("--steps", type=int, default=300,
                 help="K-FAC steps (Adam: the same, or more with time "
                 "matching)")
  p.add_argument("--batch-size", type=int, default=500,
                 help="examples per step (ignored with --paper)")
  p.add_argument("--scale", type=float, default=1.0,
                 help="multiplies the hidden widths (the 30-unit code stays)")
  p.add_argument("--paper", action="store_true",
                 help="TF K-FAC's setup: full size, 10000 steps unless "
                 "--steps is given, batch growing from 1000 to 60000 "
                 "(initial damping 150 unless --kfac-damping is given)")
  p.add_argument("--no-match-time", dest="match_time", action="store_false",
                 help="stop Adam after --steps instead of running it for "
                 "K-FAC's wall-clock time")
  p.add_argument("--adam-lr", type=float, default=1e-3,
                 help="Adam learning rate")
  p.add_argument("--kfac-damping", type=float, default=None,
                 help="kfac_optimizer's initial damping (default: its own, "
                 "1.0; 150 with --paper)")
  p.add_argument("--window", type=int, default=20,
                 help="steps averaged in the reported losses")
  p.add_argument("--log-every", type=int, default=20,
                 help="print a progress line every N steps (0: never)")
  p.add_argument("--seed", type=int, default=0,
                 help="seeds initialisation, batches and sampling")
  p.add_argument("--plot", default="autoencoder.png",
                 help="PNG path for the loss curves ('' to skip)")
  p.add_argument("--compilation-cache",
                 default=DEFAULT_COMPILATION_CACHE if argv is None else None,
                 help="JAX's persistent compilation cache directory: a "
                 "second run loads its compiled steps from it (on by "
                 "default from the command line; off for main(argv))")
  p.add_argument("--no-compilation-cache", dest="compilation_cache",
                 action="store_const", const=None,
                 help="compile everything afresh, keep nothing")
  args = p.parse_args(argv)
  if args.paper and "--steps" not in (argv if argv is not None
                                      else sys.argv[1:]):
    args.steps = 10000
  if args.paper and args.kfac_damping is None:
    args.kfac_damping = 150.0
  for name in ("steps", "batch_size", "window"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, "
              f"got {getattr(args, name)}")
  if args.scale <= 0:
    p.error(f"--scale must be > 0, got {args.scale}")
  return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Trains with kfac_optimizer, then Adam; prints tables, writes the plot.

  Returns:
    ``{"kfac": run, "adam": run, "by_step": rows, "by_time": rows}``; a run
    has ``losses`` and ``times`` (per step), ``steps``, ``seconds``,
    ``first_call_s`` (compile + one step) and ``squared_error`` (on the
    first 10000 training images); rows are ``(step or seconds, kfac loss,
    adam loss)``.
  """
  args = parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  images = load_images(args.data)
  sizes = layer_sizes(args.scale)
  batch_size: int | Callable[[int], int]
  if args.paper:
    batch_size = lambda k: paper_batch_size(k, len(images))  # noqa: E731
  else:
    batch_size = args.batch_size
  first = batch_size(0) if callable(batch_size) else batch_size
  params = init_params(jax.random.PRNGKey(args.seed), sizes)
  collection = kfac_jax_lite.scan(loss_fn, params, images[:first])
  print(collection.describe())
  print(f"\nautoencoder {'-'.join(map(str, sizes))}; batch "
        f"{'1000 -> 60000' if args.paper else first}; {args.steps} K-FAC "
        f"steps; jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPUs\nprogress lines: loss = mean of the last "
        f"{args.window} batch losses; seconds since the end of compilation"
        "\n", flush=True)

  kfac_kw = {} if args.kfac_damping is None else {
      "initial_damping": args.kfac_damping}
  kfac_tx = kfac_jax_lite.kfac_optimizer(collection, l2_reg=L2, **kfac_kw)
  adam_tx = optax.adam(args.adam_lr)
  state_line = lambda s: (f"  damping {float(s.damping):.3g} lr "  # noqa: E731
                          f"{float(s.learning_rate):.3g} momentum "
                          f"{float(s.momentum):.3g}")
  runs = {}
  for name, step, tx, extra in (
      ("kfac", make_kfac_step(collection, kfac_tx), kfac_tx,
       {"describe_state": state_line}),
      ("adam", make_adam_step(adam_tx), adam_tx, {})):
    state = tx.init(params)
    first_call, step_s = warm_up(step, params, state, images[:first])
    budget, total, log_every = None, args.steps, args.log_every
    if name == "adam" and args.match_time:
      budget, total = runs["kfac"]["seconds"], 100 * args.steps
      # About as many progress lines as K-FAC printed.
      log_every *= max(1, round(budget / step_s / args.steps))
    print(f"{name}: " + ("kfac_optimizer" if name == "kfac" else
                         f"optax.adam({args.adam_lr:g})")
          + (f" for {budget:.1f}s (K-FAC's time)" if budget else
             f" for {total} steps")
          + f"; compile + first step {first_call:.1f}s, then "
          f"{1e3 * step_s:.0f} ms/step", flush=True)
    run = train(name, step, params, state,
                batch_stream(images, total, batch_size, args.seed),
                total=total, time_budget=budget, log_every=log_every,
                window=args.window, seed=args.seed, **extra)
    run["steps"] = len(run["losses"])
    run["seconds"] = float(run["times"][-1])
    run["first_call_s"] = first_call
    run["squared_error"] = float(jax.jit(squared_error)(run.pop("params"),
                                                        images[:10000]))
    print(f"{name}: {run['steps']} steps in {run['seconds']:.1f}s; final "
          f"loss {loss_at_step(run, run['steps'], args.window):.3f}, "
          f"squared error {run['squared_error']:.3f}\n", flush=True)
    runs[name] = run

  k, a = runs["kfac"], runs["adam"]
  k_state = k.pop("state")
  a.pop("state")
  by_step, by_time = comparison_tables(k, a, args.window)
  w = args.window
  print(f"Training loss (mean over the last {w} batches); seconds exclude "
        f"compilation (first call: K-FAC {k['first_call_s']:.1f}s, Adam "
        f"{a['first_call_s']:.1f}s):\n")
  print(f"{'step':>8}  {'kfac_optimizer':>14}  {'adam':>10}")
  for s, lk, la in by_step:
    print(f"{s:8d}  {lk:14.3f}  {la:10.3f}")
  print(f"\n{'seconds':>8}  {'kfac_optimizer':>14}  {'adam':>10}")
  for t, lk, la in by_time:
    print(f"{t:8.1f}  {lk:14.3f}  {la:10.3f}")
  n = min(k["steps"], a["steps"])
  lk, la = loss_at_step(k, n, w), loss_at_step(a, n, w)
  t = min(k["seconds"], a["seconds"])
  tk, ta = loss_at_time(k, t, w), loss_at_time(a, t, w)
  print(f"\nat step {n}: K-FAC {lk:.3f} vs Adam {la:.3f} -> "
        f"{'K-FAC' if lk < la else 'Adam'} lower; at {t:.1f}s: K-FAC "
        f"{tk:.3f} vs Adam {ta:.3f} -> {'K-FAC' if tk < ta else 'Adam'} "
        f"lower")
  print(f"kfac_optimizer final damping {float(k_state.damping):.3g}, "
        f"learning rate {float(k_state.learning_rate):.3g}, momentum "
        f"{float(k_state.momentum):.3g}")
  if args.plot:
    plot({"kfac_optimizer": k, f"adam {args.adam_lr:g}": a}, args.plot, w,
         f"MNIST autoencoder {'-'.join(map(str, sizes))}, "
         f"batch {'1000->60000' if args.paper else first}")
    print(f"wrote {args.plot}")
  return {"kfac": k, "adam": a, "by_step": by_step, "by_time": by_time}


if __name__ == "__main__":
  main(sys.argv[1:])
