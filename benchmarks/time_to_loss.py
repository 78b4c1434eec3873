"""Time to a training loss: kfac_optimizer (defaults) against tuned Adam.

Problem: the deep MNIST autoencoder of ``examples/mnist_autoencoder.py``
(``784-1000-500-250-30-250-500-1000-784``, summed sigmoid cross-entropy
plus ``1e-5 · ½‖θ‖²``), batch 500, the same batch sequence for every run.

1. Adam runs ``--adam-steps`` steps (default 2000) at each learning rate of
   ``--adam-lrs`` (default ``3e-4, 1e-3, 3e-3``); the best is the one with
   the lowest loss at the end.
2. The targets are the best Adam's loss after each of ``--checkpoints``
   steps (default 600 and 2000; those beyond ``--adam-steps`` are dropped).
3. ``kfac_optimizer`` at its defaults (plus ``l2_reg=1e-5``, the
   regulariser's curvature) runs until it is below every target, or for
   ``--kfac-max-steps`` steps (its default ``stats_fraction=0.25``: the
   curvature from a quarter of each batch); so does each other
   ``--stats-fractions`` entry (default ``1``: the whole batch), and each
   ``--inverse-periods`` entry (none by default; e.g. ``10,20``: the
   inverses refreshed every 10 or 20 steps); ``--ekfac`` adds a
   ``kfac_optimizer`` run at its defaults with every layer's block the
   eigenvalue-corrected ``"ekfac"`` (George et al., 2018).
4. Each ``--kfac LR:DAMPING`` entry (none by default) adds runs of
   ``kfac`` (momentum 0.9, fixed learning rate and damping; loss, gradient
   and statistics from ``value_grad_and_stats``), one per
   ``--kfac-stats-fractions`` entry (default ``1,0.25``): what a quarter
   of the batch for the curvature costs ``kfac`` at equal steps.

"Loss" is the trailing mean of the last ``--window`` batch losses (each
measured before its step's update). A run reaches a target at the first
step whose loss is at or below it. Times are wall-clock seconds of the
training loop after compilation (every step synchronised); the first call
(trace + compile + one step) is reported apart. Writes a PNG of the curves
against steps and seconds, with the targets marked.

Run from the repository root::

  python benchmarks/time_to_loss.py                     # ~10-15 min, 2 CPUs
  python benchmarks/time_to_loss.py --adam-steps 600    # a shorter run
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Optional, Sequence

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax_lite  # noqa: E402
# benchmarks/ is this script's path: kfac_step is step_time's kfac step
# (loss, gradient and statistics from value_grad_and_stats).
from step_time import (blas_environment, cpu_model, kfac_step,  # noqa: E402
                       load_example)

ae = load_example("mnist_autoencoder")


def run_until(name, step, params, state, images, args, *, max_steps: int,
              stop_below: Optional[float] = None) -> dict:
  """Trains for ``max_steps`` or until the smoothed loss <= ``stop_below``."""
  first_call, step_s = ae.warm_up(step, params, state,
                                  images[:args.batch_size])
  params, state = jax.tree.map(jnp.copy, (params, state))  # donated
  key = jax.random.PRNGKey(args.seed)
  losses, times = [], []
  t0 = time.perf_counter()
  for k, batch in enumerate(ae.batch_stream(images, max_steps,
                                            args.batch_size, args.seed)):
    params, state, loss = step(params, state, batch,
                               jax.random.fold_in(key, k))
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
    smooth = np.mean(losses[-args.window:])
    if (k + 1) % args.log_every == 0:
      print(f"  [{name}] step {k + 1:5d}  loss {smooth:8.3f}  "
            f"{times[-1]:6.1f}s", flush=True)
    if not np.isfinite(losses[-1]):
      print(f"  [{name}] non-finite loss at step {k}", flush=True)
      break
    if stop_below is not None and len(losses) >= args.window and (
        smooth <= stop_below):
      break
  print(f"  [{name}] {len(losses)} steps, {times[-1]:.1f}s (+ first call "
        f"{first_call:.1f}s; {1e3 * step_s:.0f} ms/step after it)",
        flush=True)
  return {"losses": np.array(losses), "times": np.array(times),
          "first_call_s": first_call}


def interleaved_step_times(steps: dict, params, images, args,
                           rounds: int = 5, per_round: int = 10) -> dict:
  """Mean seconds per step of each ``(step, tx)``, timed side by side.

  Rounds of ``per_round`` synchronised steps alternate between the
  optimizers, so a burst of load from other processes hits all of them;
  ``per_round`` is a multiple of K-FAC's inverse and damping periods (5),
  so the mean includes their refreshes.
  """
  bs = args.batch_size
  batches = [images[i * bs:(i + 1) * bs] for i in range(4)]
  states = {n: jax.tree.map(jnp.copy, (params, tx.init(params)))
            for n, (_, tx) in steps.items()}
  times = {n: [] for n in steps}
  key = jax.random.PRNGKey(args.seed)
  for name, (step, _) in steps.items():  # Compile outside the timing.
    states[name] = step(*states[name], batches[0], key)[:2]
  for _ in range(rounds):
    for name, (step, _) in steps.items():
      p, s = states[name]
      t0 = time.perf_counter()
      for j in range(per_round):
        p, s, loss = step(p, s, batches[j % 4], jax.random.fold_in(key, j))
        float(loss)
      times[name].append((time.perf_counter() - t0) / per_round)
      states[name] = (p, s)
  return {n: float(np.mean(t)) for n, t in times.items()}


def reach(run: dict, target: float, window: int) -> tuple:
  """``(steps, seconds)`` to the first smoothed loss <= target (or nans)."""
  s = ae.smoothed(run["losses"], window)
  hits = np.nonzero(s[window - 1:] <= target)[0]
  if not len(hits):
    return float("nan"), float("nan")
  i = hits[0] + window - 1
  return i + 1, float(run["times"][i])


def plot(curves: dict, targets: list, path: str, window: int) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for label, run in curves.items():
    s = ae.smoothed(run["losses"], window)
    axes[0].plot(np.arange(1, len(s) + 1), s, label=label)
    axes[1].plot(run["times"], s, label=label)
  for ax, xlabel in zip(axes, ("step", "seconds (compilation excluded)")):
    for name, t in targets:
      ax.axhline(t, color="grey", lw=0.8, ls="--")
      ax.annotate(name, (0, t), fontsize=7, va="bottom")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"training loss (mean of last {window} batches)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.suptitle("MNIST autoencoder, batch 500: time to Adam's loss")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0],
                              formatter_class=(
                                  argparse.ArgumentDefaultsHelpFormatter))
  p.add_argument("--adam-steps", type=int, default=2000)
  p.add_argument("--adam-lrs", default="3e-4,1e-3,3e-3")
  p.add_argument("--checkpoints", default="600,2000",
                 help="Adam step counts whose losses are the targets")
  p.add_argument("--kfac-max-steps", type=int, default=1000)
  p.add_argument("--batch-size", type=int, default=500)
  p.add_argument("--stats-fractions", default="0.25,1",
                 help="one kfac_optimizer run per stats_fraction (0.25: its "
                 "default; 1: the whole batch)")
  p.add_argument("--inverse-periods", default="",
                 help="comma-separated inverse_update_period values: each "
                 "adds a kfac_optimizer run at its default stats_fraction")
  p.add_argument("--ekfac", action="store_true",
                 help="add a kfac_optimizer (defaults) run with EK-FAC blocks")
  p.add_argument("--kfac", default="",
                 help="comma-separated LR:DAMPING pairs: each adds kfac runs "
                 "(one per --kfac-stats-fractions entry), e.g. 0.03:10")
  p.add_argument("--kfac-stats-fractions", default="1,0.25",
                 help="comma-separated stats_fraction values, one kfac run "
                 "each per --kfac entry (also given to value_grad_and_stats)")
  p.add_argument("--window", type=int, default=20)
  p.add_argument("--log-every", type=int, default=100)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="time_to_loss.png", help="PNG path")
  return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
  args = parse_args(argv)
  load_before = os.getloadavg()[0]
  images = ae.load_images(ae.DEFAULT_DATA)
  params = ae.init_params(jax.random.PRNGKey(args.seed), ae.layer_sizes(1.0))
  curves = {}
  for lr in (float(x) for x in args.adam_lrs.split(",")):
    tx = optax.adam(lr)
    print(f"adam {lr:g}", flush=True)
    curves[f"adam {lr:g}"] = run_until(
        "adam", ae.make_adam_step(tx), params, tx.init(params), images, args,
        max_steps=args.adam_steps)
  best = min(curves, key=lambda k: np.nan_to_num(ae.loss_at_step(
      curves[k], args.adam_steps, args.window), nan=np.inf))
  checkpoints = [int(c) for c in args.checkpoints.split(",")
                 if int(c) <= args.adam_steps]
  targets = [(f"{best} @ {c}", ae.loss_at_step(curves[best], c, args.window))
             for c in checkpoints]

  collection = kfac_jax_lite.scan(ae.loss_fn, params,
                                  images[:args.batch_size])
  kfac_names, kfac_steps = [], {}

  def optimizer_run(name, **kwargs):
    tx = kfac_jax_lite.kfac_optimizer(collection, l2_reg=ae.L2, **kwargs)
    return name, f"{name}, l2_reg=1e-5", tx, ae.make_kfac_step(collection, tx)

  def kfac_run(setting, fraction):
    lr_damping = setting.split(":")
    if len(lr_damping) != 2:
      raise ValueError(f"--kfac {args.kfac!r}: {setting!r} is not an "
                       "LR:DAMPING pair; pass e.g. --kfac 0.03:10.")
    lr, damping = (float(v) for v in lr_damping)
    name = f"kfac lr={lr:g} damping={damping:g} stats_fraction={fraction:g}"
    tx = kfac_jax_lite.kfac(lr, collection, damping=damping,
                            estimator=kfac_jax_lite.FisherEstimator(
                                collection, stats_fraction=fraction))
    return name, name, tx, kfac_step(ae.loss_fn, tx, collection,
                                     stats_fraction=fraction)

  # (name, header printed before the run, tx, jitted step)
  runs = [optimizer_run("kfac_optimizer" + (
      " (defaults)" if f == 0.25 else f" stats_fraction={f:g}"),
                        estimator=kfac_jax_lite.FisherEstimator(
                            collection, stats_fraction=f))
          for f in (float(x) for x in args.stats_fractions.split(",") if x)]
  runs += [optimizer_run(f"kfac_optimizer inverse_update_period={k}",
                         inverse_update_period=k)
           for k in (int(x) for x in args.inverse_periods.split(",") if x)]
  if args.ekfac:
    ek = kfac_jax_lite.scan(ae.loss_fn, params, images[:args.batch_size],
                            approximations={"fully_connected": "ekfac"})
    tx = kfac_jax_lite.kfac_optimizer(ek, l2_reg=ae.L2)
    runs.append(("kfac_optimizer ekfac", "kfac_optimizer (defaults), ekfac, "
                 "l2_reg=1e-5", tx, ae.make_kfac_step(ek, tx)))
  runs += [kfac_run(setting, f)
           for setting in args.kfac.split(",") if setting
           for f in (float(x) for x in args.kfac_stats_fractions.split(",")
                     if x)]
  for name, header, tx, step in runs:
    print(header, flush=True)
    curves[name] = run_until(
        name, step, params, tx.init(params), images, args,
        max_steps=args.kfac_max_steps, stop_below=min(t for _, t in targets))
    kfac_names.append(name)
    kfac_steps[name] = (step, tx)
  best_lr = float(best.split()[1])
  adam_tx = optax.adam(best_lr)
  per_step = interleaved_step_times(
      {**kfac_steps, "adam": (ae.make_adam_step(adam_tx), adam_tx)},
      params, images, args)

  print(f"\nautoencoder, batch {args.batch_size}; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}, {platform.machine()} "
        f"({cpu_model()}), {os.cpu_count()} CPUs; {blas_environment()}; "
        f"1-min load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")
  print(f"| adam lr | loss @ {args.adam_steps} | seconds | first call |")
  print("|---|---|---|---|")
  for name, run in curves.items():
    if name.startswith("adam"):
      print(f"| {name[5:]}{' (best)' if name == best else ''} | "
            f"{ae.loss_at_step(run, args.adam_steps, args.window):.2f} | "
            f"{run['times'][-1]:.1f} | {run['first_call_s']:.1f}s |")
  a = curves[best]
  print(f"\n| K-FAC | target ({best} loss) | adam steps | adam s | K-FAC "
        "steps | K-FAC s | time ratio K-FAC/adam | steps ratio | ratio from "
        "interleaved step times |")
  print("|---|---|---|---|---|---|---|---|---|")
  rows = []
  for kname in kfac_names:
    k = curves[kname]
    for name, target in targets:
      sa, ta = reach(a, target, args.window)
      sk, tk = reach(k, target, args.window)
      rows.append({"kfac": kname, "target": name, "loss": target,
                   "adam_steps": sa, "adam_s": ta, "kfac_steps": sk,
                   "kfac_s": tk, "time_ratio": tk / ta,
                   "steps_ratio": sk / sa,
                   "interleaved_ratio": sk * per_step[kname] / (
                       sa * per_step["adam"])})
      print(f"| {kname} | {name}: {target:.2f} | {sa} | {ta:.1f} | {sk} | "
            f"{tk:.1f} | {tk / ta:.2f}x | {sk / sa:.3f} | "
            f"{rows[-1]['interleaved_ratio']:.2f}x |")
  print("\nmean step time, interleaved (5 rounds of 10 steps each): "
        + ", ".join(f"{n} {1e3 * per_step[n]:.0f} ms ("
                    f"{per_step[n] / per_step['adam']:.2f}x)"
                    for n in kfac_names)
        + f", adam {1e3 * per_step['adam']:.0f} ms; last column: steps "
        "ratio x step-time ratio, which load bursts during one run do not "
        "skew")
  print("first call (trace + compile + one step): "
        + ", ".join(f"{n} {curves[n]['first_call_s']:.1f}s"
                    for n in kfac_names)
        + f", adam {a['first_call_s']:.1f}s (not in the times above)")
  plot(curves, targets, args.out, args.window)
  print(f"wrote {args.out}")
  return {"curves": curves, "targets": targets, "rows": rows,
          "per_step": per_step}


if __name__ == "__main__":
  main(sys.argv[1:])
