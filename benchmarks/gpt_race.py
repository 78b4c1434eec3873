"""Time to AdamW's validation loss on the char GPT of ``examples/char_gpt.py``.

AdamW (``weight_decay=0.01``, constant rate) runs at each of ``--adam-lrs``
for ``--long`` steps; the best rate after ``--short`` steps and the best
after ``--long`` steps set two targets: their validation losses. K-FAC
(:func:`kfac_jax_lite.kfac_adamw` at the example's settings, its defaults;
every ``char_gpt.py`` flag is accepted) runs until it has reached both
targets or used ``--kfac-max-steps``. Everything runs in one process on the same
batches, the runs alternating in chunks of ``--eval-every`` steps so that
load from other processes hits all of them. Seconds are training seconds
from each optimizer's first call (trace and compile included), evaluation
excluded; a target counts as reached at the first evaluation at or below it.

Printed: each run's validation curve summary, then

* K-FAC's seconds to each target against the best AdamW's seconds to the
  same step count (target ``<= 0.8x``);
* validation loss of K-FAC and the best AdamW at equal wall clock;
* median step time and first-call time against that AdamW (targets
  ``<= 1.5x`` and ``<= 2x``).

Run::

  python benchmarks/gpt_race.py                 # ~25 min on 2 CPUs
  python benchmarks/gpt_race.py --long 600 --adam-lrs 3e-3
  python benchmarks/gpt_race.py --profile       # first call split; parts
                                                # (benchmarks/step_profile.py)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "examples"))

import functools  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax_lite  # noqa: E402

import char_gpt  # noqa: E402  pylint: disable=g-import-not-at-top


def parse_args(argv: Optional[Sequence[str]]):
  p = argparse.ArgumentParser(
      description=(__doc__ or "").split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--short", type=int, default=600)
  p.add_argument("--long", type=int, default=2000)
  p.add_argument("--adam-lrs", default="1e-3,3e-3,1e-2")
  p.add_argument("--kfac-max-steps", type=int, default=2000)
  p.add_argument("--profile", action="store_true",
                 help="only print XLA's flops and the time of each part of "
                 "K-FAC's step")
  args, rest = p.parse_known_args(argv)
  if not 1 <= args.short <= args.long:
    p.error(f"need 1 <= --short ({args.short}) <= --long ({args.long})")
  args.adam_lrs = [float(x) for x in args.adam_lrs.split(",")]
  return args, char_gpt_args(p, args, rest)


def char_gpt_args(p, args, rest):
  """``char_gpt``'s flags from ``rest``; ``p.error`` unless ``args.short``
  and ``args.long`` are multiples of its ``--eval-every``."""
  gpt = char_gpt.parse_args(rest + ["--plot", ""])
  for name in ("short", "long"):
    if getattr(args, name) % gpt.eval_every:
      p.error(f"--{name} {getattr(args, name)} must be a multiple of "
              f"--eval-every {gpt.eval_every}")
  return gpt


def loss_at_step(run: char_gpt.Run, step: int) -> float:
  return next(l for s, _, l in run.curve if s == step)


def seconds_at_step(run: char_gpt.Run, step: int) -> float:
  return next(t for s, t, _ in run.curve if s == step)


def race_until(runs, limits, targets, batch_fn, eval_fn, every) -> None:
  """Like ``char_gpt.race`` with a step limit per run; K-FAC (the last run)
  also stops once its validation loss is at or below every target."""
  for r in runs:
    r.curve.append((0, 0.0, eval_fn(r.params)))
  kfac = runs[-1]
  active = list(zip(runs, limits))
  while active:
    for r, limit in active:
      r.advance(batch_fn, min(every, limit - r.steps))
      r.curve.append((r.steps, r.seconds, eval_fn(r.params)))
    print("\r" + char_gpt.progress([r for r, _ in active],
                                   max(l for _, l in active)),
          end="\n" if not sys.stdout.isatty() else "", flush=True)
    done_kfac = kfac.curve[-1][2] <= min(targets())
    active = [(r, l) for r, l in active if r.steps < l and not (
        r is kfac and done_kfac)]
  print()


def first_call_split(step, args, repeats: int = 5) -> tuple:
  """``(trace, lower, compile, first run, median step)`` seconds of a new
  jit of ``step`` (no cache applies); the median of ``repeats`` further
  steps, each fed the previous step's params and state."""
  import step_profile  # pylint: disable=import-outside-toplevel
  split, compiled, out = step_profile.first_call(step, args)
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = jax.block_until_ready(compiled(*out[:2], *args[2:]))
    times.append(time.perf_counter() - t)
  return (*split, float(np.median(times)))


def profile(s: dict, gpt) -> None:
  """``step_profile``'s tables (the first calls of AdamW's and K-FAC's
  whole steps split into trace, lowering, compile and first run, their
  program sizes and their steps' milliseconds by part, which add up to
  the step); then XLA's flop estimate, compile seconds and median of 5
  runs of each part of K-FAC's step, each jitted alone (LAPACK calls are
  not counted in the flops), and the first call of ``kfac_optimizer``."""
  import step_profile  # pylint: disable=import-outside-toplevel
  step_profile.run(step_profile.parse_args([])[0], gpt, s)
  params, loss_fn = s["params"], s["loss_fn"]
  batch = s["batch_fn"](0)
  rows = max(1, math.ceil(gpt.kfac_stats_fraction * gpt.batch_size))
  head = jax.tree.map(lambda x: x[:rows], batch)
  key = jax.random.PRNGKey(0)
  est = kfac_jax_lite.FisherEstimator(s["collection"], damping=0.0)
  stats = jax.jit(est.compute_stats)(params, head, key)
  state = jax.jit(lambda st: est.update_curvature(st, stats=stats))(
      est.init(params))
  damping = gpt.kfac_damping
  state = jax.jit(lambda st: est.update_cache(st, damping))(state)
  grads = jax.grad(loss_fn)(params, batch)
  rms = optax.scale_by_rms(0.999, eps_in_sqrt=False, bias_correction=True)
  tail = optax.chain(optax.ema(gpt.kfac_momentum, debias=True),
                     optax.add_decayed_weights(gpt.kfac_weight_decay),
                     optax.scale_by_learning_rate(gpt.kfac_lr))

  def graft_tail(d, g, st):  # kfac_adamw after the K-FAC direction d.
    grafted = kfac_jax_lite.graft(optax.stateless(lambda u, p: d), rms)
    u, graft_st = grafted.update(g, st[0], params)
    u, tail_st = tail.update(u, st[1], params)
    return optax.apply_updates(params, u), (graft_st, tail_st)

  optimizer = kfac_jax_lite.kfac_optimizer(s["collection"])
  step = functools.partial(char_gpt.make_step, loss_fn)

  print(f"{'first call (s)':24} {'trace':>6} {'lower':>6} {'compile':>8} "
        f"{'run':>6} {'total':>6} {'step ms':>8}")
  for name, fn, args in (
      ("kfac_optimizer step", step(optimizer, 1.0),
       (params, optimizer.init(params), batch)),):
    t = first_call_split(fn, args)
    print(f"{name:24} {t[0]:6.2f} {t[1]:6.2f} {t[2]:8.2f} {t[3]:6.2f} "
          f"{sum(t[:4]):6.2f} {1e3 * t[4]:8.1f}", flush=True)
  parts = [
      ("loss and gradient", jax.value_and_grad(loss_fn), (params, batch)),
      (f"statistics, first {rows} sequences", est.compute_stats,
       (params, head, key)),
      (f"statistics, all {gpt.batch_size} sequences", est.compute_stats,
       (params, batch, key)),
      ("EMA of the factors", lambda st, x: est.update_curvature(
          st, stats=x), (state, stats)),
      ("preconditioning", est.multiply_inverse, (state, grads)),
      ("refresh (update_cache)", lambda st: est.update_cache(st, damping),
       (state,)),
      ("graft, momentum, decay", graft_tail,
       (grads, grads, (kfac_jax_lite.graft(optax.identity(), rms).init(
           params), tail.init(params)))),
  ]
  print(f"\n{'part':36} {'GFLOP':>8} {'compile':>8} {'ms':>8}")
  for name, fn, args in parts:
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if cost is None:
      raise RuntimeError(f"{name}: XLA gave no cost analysis on "
                         f"{jax.default_backend()}; drop --profile.")
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - t0)
    print(f"{name:36} {cost.get('flops', float('nan')) / 1e9:8.2f} "
          f"{seconds:7.1f}s {1e3 * np.median(times):8.1f}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> dict:
  args, gpt = parse_args(argv)
  s = char_gpt.setup(gpt)
  if args.profile:
    profile(s, gpt)
    return {}
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; "
        f"{gpt.batch_size}x{gpt.context} characters a step\n", flush=True)
  runs = []
  for lr in args.adam_lrs:
    state, step = char_gpt.make_adamw_runner(s["loss_fn"], lr, s["params"])
    runs.append(char_gpt.Run(f"adamw{lr:g}", s["params"], state, step))
  state, step = char_gpt.make_kfac_runner(
      s["loss_fn"], *char_gpt.kfac_transform(s["collection"], gpt, gpt.seed),
      s["params"])
  kfac = char_gpt.Run("kfac", s["params"], state, step)
  adams = list(runs)
  runs.append(kfac)

  def targets():
    return [min(loss_at_step(a, n) for a in adams if a.steps >= n)
            if all(a.steps >= n for a in adams) else float("-inf")
            for n in (args.short, args.long)]

  race_until(runs, [args.long] * len(adams) + [args.kfac_max_steps],
             targets, s["batch_fn"], s["eval_fn"], gpt.eval_every)
  return report(args, adams, kfac)


def report(args, adams, kfac) -> dict:
  """Prints the tables; returns the measured ratios."""
  marks = sorted({args.short, args.long})
  print(f"{'run':>10} " + " ".join(f"{'valid@' + str(n):>10}"
                                   for n in marks)
        + f" {'ms/step':>8} {'first call':>10}")
  for r in adams + [kfac]:
    cells = [f"{loss_at_step(r, n):10.3f}" if r.steps >= n else
             f"{'-':>10}" for n in marks]
    print(f"{r.name:>10} " + " ".join(cells)
          + f" {1e3 * char_gpt.median_step(r):8.1f} {r.first_call:9.2f}s")
  out = {}
  for n in marks:
    best = min(adams, key=lambda a, n=n: loss_at_step(a, n))
    target, budget = loss_at_step(best, n), seconds_at_step(best, n)
    t = char_gpt.seconds_to_loss(kfac, target)
    ratio = None if t is None else t / budget
    out[n] = dict(adam=best.name, target=target, adam_seconds=budget,
                  kfac_seconds=t, ratio=ratio,
                  kfac_at_equal_seconds=char_gpt.loss_at_seconds(kfac, budget)
                  if kfac.seconds >= budget else None)
    reached = (f"in {t:.1f} s = {ratio:.2f}x (target <= 0.8x)"
               if t is not None else
               f"not reached in {kfac.steps} steps ({kfac.seconds:.1f} s)")
    print(f"\nAdamW's best after {n} steps: {best.name}, {target:.3f} in "
          f"{budget:.1f} s. K-FAC reaches it {reached}.")
    if out[n]["kfac_at_equal_seconds"] is not None:
      print(f"  at {budget:.1f} s: K-FAC {out[n]['kfac_at_equal_seconds']:.3f}"
            f", {best.name} {target:.3f}")
  best = min(adams, key=lambda a: loss_at_step(a, args.short))
  out["step_ratio"] = char_gpt.median_step(kfac) / char_gpt.median_step(best)
  out["first_call_ratio"] = kfac.first_call / best.first_call
  print(f"\nstep: K-FAC {1e3 * char_gpt.median_step(kfac):.1f} ms, "
        f"{best.name} {1e3 * char_gpt.median_step(best):.1f} ms = "
        f"{out['step_ratio']:.2f}x (target <= 1.5x)")
  print(f"first call: K-FAC {kfac.first_call:.2f} s, {best.name} "
        f"{best.first_call:.2f} s = {out['first_call_ratio']:.2f}x "
        "(target <= 2x)")
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
