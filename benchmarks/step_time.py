"""Step time of K-FAC against Adam, measured side by side in one process.

Model: a tagged ``784-512-512-10`` tanh MLP, batch 256, softmax
cross-entropy. Every optimizer runs the same jitted step structure: loss and
gradient (for K-FAC: :func:`kfac_jax_lite.value_grad_and_stats`, which also
returns the curvature statistics), ``tx.update``, ``optax.apply_updates``.

Reported per optimizer:

* ``first call``: trace + compile + one step, to ``block_until_ready``;
* ``median`` and ``mean`` step time over the timed steps. With
  ``inverse_update_period=k`` one step in ``k`` also refreshes the inverses,
  so the median is the cost of an ordinary step and the mean the amortised
  cost;
* ratios of both against Adam.

To damp the noise of a shared machine the timed steps are interleaved: each
round runs a few steps of every optimizer in turn. A breakdown of the K-FAC
step (forward/backward alone, with statistics, the inverse refresh alone, and
XLA's flop estimate) follows the table.

Run from the repository root::

  python benchmarks/step_time.py              # ~1 minute on a 2-core CPU
  python benchmarks/step_time.py --rounds 10 --steps-per-round 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite

SIZES = (784, 512, 512, 10)


def init_mlp(key, sizes: Sequence[int]) -> dict:
  """LeCun-normal kernels ``[d_in, d_out]`` and zero biases."""
  params = {}
  for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    params[f"dense_{i}"] = {
        "kernel": jax.random.normal(sub, (d_in, d_out)) / np.sqrt(d_in),
        "bias": jnp.zeros((d_out,))}
  return params


def loss_fn(params: dict, batch: dict):
  """Mean softmax cross-entropy of the tanh MLP; every layer tagged."""
  x, n = batch["x"], len(params)
  for i in range(n):
    p = params[f"dense_{i}"]
    y = kfac_jax_lite.register_dense(x @ p["kernel"] + p["bias"], x,
                                     p["kernel"], p["bias"])
    x = jnp.tanh(y) if i < n - 1 else y
  logits = kfac_jax_lite.register_categorical_predictive_distribution(
      x, batch["y"])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()


def make_batches(key, num: int, batch_size: int) -> list:
  """``num`` random batches of MNIST shape (values do not affect timing)."""
  out = []
  for k in jax.random.split(key, num):
    kx, ky = jax.random.split(k)
    out.append({"x": jax.random.uniform(kx, (batch_size, SIZES[0])),
                "y": jax.random.randint(ky, (batch_size,), 0, SIZES[-1])})
  return out


def adam_step(tx) -> Callable:
  def step(params, state, batch, rng):
    del rng
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  return jax.jit(step)


def kfac_step(tx, collection) -> Callable:
  vgs = kfac_jax_lite.value_grad_and_stats(loss_fn, collection)

  def step(params, state, batch, rng):
    loss, grads, stats = vgs(params, batch, rng)
    updates, state = tx.update(grads, state, params, stats=stats)
    return optax.apply_updates(params, updates), state, loss
  return jax.jit(step)


class Runner:
  """One optimizer's jitted step, its current state, and its timings."""

  def __init__(self, name: str, step: Callable, tx, params, batches):
    self.name, self.step, self.batches = name, step, batches
    self.params, self.state = params, tx.init(params)
    self.key, self.count, self.times = jax.random.PRNGKey(1), 0, []
    self.first_call_s = None

  def run(self, num: int, record: bool) -> None:
    for _ in range(num):
      batch = self.batches[self.count % len(self.batches)]
      rng = jax.random.fold_in(self.key, self.count)
      t0 = time.perf_counter()
      self.params, self.state, loss = self.step(self.params, self.state,
                                                batch, rng)
      loss.block_until_ready()
      dt = time.perf_counter() - t0
      if self.first_call_s is None:
        self.first_call_s = dt
      elif record:
        self.times.append(dt)
      self.count += 1


def timeit(fn: Callable, *args, repeats: int = 20) -> float:
  """Median seconds of ``fn(*args)`` (already compiled) over ``repeats``."""
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def flops(fn: Callable, *args) -> float:
  """XLA's flop estimate for the compiled ``fn(*args)`` (nan if absent)."""
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", float("nan")))


def breakdown(collection, params, batch, damping: float) -> list:
  """Rows ``(part, median ms, GFLOP)`` of the pieces of a K-FAC step."""
  rng = jax.random.PRNGKey(0)
  vgs = kfac_jax_lite.value_grad_and_stats(loss_fn, collection)
  est = kfac_jax_lite.FisherEstimator(collection, damping=damping)
  _, grads, stats = jax.jit(vgs)(params, batch, rng)
  est_state = est.update_cache(est.update_curvature(est.init(params),
                                                    stats=stats))
  parts = (
      ("value_and_grad (what Adam computes)", jax.value_and_grad(loss_fn),
       (params, batch)),
      ("value_grad_and_stats (+ A, G statistics)", vgs, (params, batch, rng)),
      ("update_curvature (EMA of the factors)",
       lambda s, st: est.update_curvature(s, stats=st), (est_state, stats)),
      ("update_cache (damped inverses)", est.update_cache, (est_state,)),
      ("multiply_inverse (precondition)", est.multiply_inverse,
       (est_state, grads)),
  )
  return [(name, 1e3 * timeit(jax.jit(fn), *args), flops(fn, *args) / 1e9)
          for name, fn, args in parts]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--periods", default="1,5,20",
                 help="K-FAC inverse_update_period values, comma-separated")
  p.add_argument("--warmup", type=int, default=5,
                 help="untimed steps per optimizer after the first call")
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--steps-per-round", type=int, default=20,
                 help="timed steps per optimizer per round (>= 30 in all)")
  p.add_argument("--damping", type=float, default=1e-2)
  args = p.parse_args(argv)
  if args.rounds * args.steps_per_round < 30:
    p.error("time at least 30 steps: rounds * steps-per-round >= 30")
  return args


def main(argv: Optional[Sequence[str]] = None) -> list:
  """Prints the timing table and the K-FAC breakdown; returns the rows."""
  args = parse_args(argv)
  load_before = os.getloadavg()[0]
  key = jax.random.PRNGKey(0)
  params = init_mlp(key, SIZES)
  batches = make_batches(jax.random.PRNGKey(1), 4, args.batch_size)
  collection = kfac_jax_lite.scan(loss_fn, params, batches[0])
  jax.jit(lambda x: x + 1)(jnp.ones(())).block_until_ready()  # Warm JAX up.

  runners = []
  tx = optax.adam(1e-3)
  runners.append(Runner("optax.adam", adam_step(tx), tx, params, batches))
  for period in [int(s) for s in args.periods.split(",")]:
    tx = kfac_jax_lite.kfac(1e-2, collection, damping=args.damping,
                            inverse_update_period=period)
    runners.append(Runner(f"kfac, inverse every {period}",
                          kfac_step(tx, collection), tx, params, batches))
  for r in runners:  # First call: trace + compile + run.
    r.run(1 + args.warmup, record=False)
  for _ in range(args.rounds):
    for r in runners:
      r.run(args.steps_per_round, record=True)

  adam = runners[0]
  base_med = statistics.median(adam.times)
  base_mean = statistics.mean(adam.times)
  print(f"MLP {'-'.join(map(str, SIZES))} tanh, batch {args.batch_size}; "
        f"jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs; {len(adam.times)} "
        f"timed steps each, interleaved; OPENBLAS_NUM_THREADS="
        f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}\n"
        f"1-min load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (above the CPU count: other "
        "processes competed; expect noise)\n")
  header = (f"{'optimizer':<24} {'first call':>10} {'median':>9} "
            f"{'mean':>9} {'median/adam':>11} {'mean/adam':>9}")
  print(header)
  print("-" * len(header))
  rows = []
  for r in runners:
    med, mean = statistics.median(r.times), statistics.mean(r.times)
    rows.append({"name": r.name, "first_call_s": r.first_call_s,
                 "median_ms": 1e3 * med, "mean_ms": 1e3 * mean,
                 "median_ratio": med / base_med,
                 "mean_ratio": mean / base_mean})
    print(f"{r.name:<24} {r.first_call_s:9.2f}s {1e3 * med:7.2f}ms "
          f"{1e3 * mean:7.2f}ms {med / base_med:10.2f}x "
          f"{mean / base_mean:8.2f}x")

  print("\nK-FAC step breakdown (each piece jitted alone):\n")
  print(f"{'part':<42} {'median':>9} {'GFLOP':>7}")
  for name, ms, gflop in breakdown(collection, params, batches[0],
                                   args.damping):
    print(f"{name:<42} {ms:7.2f}ms {gflop:7.3f}")
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
