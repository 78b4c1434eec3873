"""Data-parallel K-FAC step time against the number of devices.

For each device count in ``--devices`` (1, 2, 4), a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before JAX is
imported (on a CPU host the devices are simulated and share its cores)
times, on the same fixed *global* batch split over the devices by
``jax.shard_map``:

* ``optax.adam``: loss and gradient, gradient averaged over the devices;
* ``kfac``, ``distributed_inverses=False``: ``value_grad_and_stats``
  (statistics averaged over the devices), ``pmean`` of the gradient,
  ``kfac.update`` with ``inverse_update_period=1`` (every step refreshes
  every inverse, so the inverse cost shows), ``apply_updates``; every device
  computes every inverse;
* ``kfac``, ``distributed_inverses=True`` (from 2 devices; its "vs 1
  device" ratio is against the 1-device ``kfac``): the same, each device
  inverting a share of the layers and one ``psum`` sharing the results.

Per optimizer: the first call (trace + compile + one step; wall-clock and
CPU seconds) and the median step time, with steps interleaved between the
optimizers in rounds so that a burst of load hits all of them (model,
timing loop and helpers are ``step_time.py``'s). For K-FAC also the median
time of the inverse refresh alone (``FisherEstimator.update_cache`` under
the same ``shard_map``).

Simulated devices share the host's cores: per-device work falls with more
devices, but the total work does not (collectives and replicated work add
to it), and one device already uses every core through XLA's thread pool,
so the wall time is not expected to fall; what ``distributed_inverses``
removes (every device computing every inverse) can show as a saving
against replicated inverses. On real accelerators each device has its own
compute, and per-device work is what sets the step time.

Run from the repository root::

  python benchmarks/device_scaling.py                 # ~2-3 min, 2 CPUs
  python benchmarks/device_scaling.py --devices 1,2,4,8 --width 768
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NAMES = ("optax.adam", "kfac", "kfac, distributed inverses")


def sizes(args: argparse.Namespace) -> list:
  """``input, width, width + 32, ..., 10``: distinct widths on purpose.

  Every layer is then its own unit of inverse work, so the split across
  devices is by layer (same-shaped layers would be one vmapped refresh).
  """
  return ([args.input] + [args.width + 32 * i for i in range(args.depth)]
          + [10])


def estimator_state(state):
  """The ``EstimatorState`` inside a ``kfac`` state (wrapped and chained)."""
  has = lambda x: hasattr(x, "estimator")  # noqa: E731
  import jax  # pylint: disable=g-import-not-at-top
  return next(x for x in jax.tree.leaves(state, is_leaf=has)
              if has(x)).estimator


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Worker: one device count (set by XLA_FLAGS), every optimizer.
# ---------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> dict:
  """Times the three optimizers on this process's devices; returns rows."""
  sys.path.insert(0, HERE)
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import numpy as np
  import optax
  import kfac_jax_lite as kl
  import step_time as st

  n = jax.device_count()
  if args.batch_size % n:
    raise SystemExit(f"--batch-size {args.batch_size} is not divisible by "
                     f"{n} devices")
  mesh = Mesh(np.array(jax.devices()), ("d",))
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
  params = st.init_mlp(jax.random.PRNGKey(0), sizes(args))
  batches = []
  for k in jax.random.split(jax.random.PRNGKey(1), 2):
    kx, ky = jax.random.split(k)
    batches.append({"x": jax.random.normal(kx, (args.batch_size, args.input)),
                    "y": jax.random.randint(ky, (args.batch_size,), 0, 10)})
  collection = kl.scan(st.mlp_loss_fn, params, batches[0])
  params = jax.device_put(params, rep)
  batches = jax.device_put(batches, split)

  def data_parallel(step):
    return jax.jit(jax.shard_map(step, mesh=mesh,
                                 in_specs=(P(), P(), P("d"), P()),
                                 out_specs=(P(), P(), P())))

  def adam_step(tx):
    def step(params, state, batch, rng):
      del rng
      loss, grads = jax.value_and_grad(st.mlp_loss_fn)(params, batch)
      # shard_map sums the gradient of replicated params over the axis.
      grads = jax.tree.map(lambda g: g / lax.axis_size("d"), grads)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, lax.pmean(loss,
                                                                     "d")
    return data_parallel(step)

  def kfac_step(tx):
    vgs = kl.value_grad_and_stats(st.mlp_loss_fn, collection, axis_name="d")

    def step(params, state, batch, rng):
      loss, grads, stats = vgs(params, batch, rng)  # Local loss and grads.
      loss, grads = lax.pmean((loss, grads), "d")
      updates, state = tx.update(grads, state, params, stats=stats)
      return optax.apply_updates(params, updates), state, loss
    return data_parallel(step)

  adam = optax.adam(1e-3)
  runners = [st.Runner(NAMES[0], lambda: adam_step(adam), adam, params,
                       batches)]
  refreshes = {}
  # On one device a distributed refresh is the local one: not timed.
  for name, dist in zip(NAMES[1:], (False, True)[:1 if n == 1 else 2]):
    tx = kl.kfac(1e-2, collection, damping=1e-2, inverse_update_period=1,
                 axis_name="d", distributed_inverses=dist)
    runners.append(st.Runner(name, lambda tx=tx: kfac_step(tx), tx, params,
                             batches))
    est = kl.FisherEstimator(collection, damping=1e-2, axis_name="d",
                             distributed_inverses=dist)
    refresh = jax.jit(jax.shard_map(est.update_cache, mesh=mesh,
                                    in_specs=P(), out_specs=P()))
    refreshes[name] = (refresh, runners[-1])
  for r in runners:
    r.run(1 + args.warmup, record=False)
    log(f"  {n} device(s): {r.name}: first call {r.first_call_s:.1f} s "
        f"({r.first_call_cpu_s:.1f} s CPU)")
  log(f"  {n} device(s): timing {args.rounds} rounds")
  refresh_times = {name: [] for name in refreshes}
  for _ in range(args.rounds):
    for r in runners:
      r.run(args.steps_per_round, record=True)
    for name, (refresh, r) in refreshes.items():
      est_state = estimator_state(r.state)  # After real statistics.
      refresh_times[name].append(1e3 * st.timeit(
          refresh, est_state, repeats=args.steps_per_round))
  return {"devices": n, "environment": st.blas_environment(), "rows": [
      {"name": r.name, "first_s": r.first_call_s,
       "first_cpu_s": r.first_call_cpu_s,
       "median_ms": 1e3 * statistics.median(r.times),
       "refresh_ms": (statistics.median(refresh_times[r.name])
                      if r.name in refresh_times else None)}
      for r in runners]}


# ---------------------------------------------------------------------------
# Launcher: one subprocess per device count, then the table.
# ---------------------------------------------------------------------------


def run_count(n: int, argv: Sequence[str], timeout: int) -> dict:
  """Runs the worker with ``n`` host devices; returns its JSON result."""
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                 env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"
  env["PYTHONPATH"] = os.pathsep.join(
      [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--worker", *argv],
      env=env, stdout=subprocess.PIPE, stderr=None, text=True,
      timeout=timeout, check=False)
  if proc.returncode:
    raise SystemExit(f"the {n}-device worker failed (exit "
                     f"{proc.returncode}); its stderr is above")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(args: argparse.Namespace, results: dict, loads: tuple):
  counts = sorted(results)
  base = {r["name"]: r["median_ms"] for r in results[counts[0]]["rows"]}
  base.setdefault(NAMES[2], base.get(NAMES[1]))  # Absent on one device.
  cpus = os.cpu_count() or 1
  print(f"MLP {'-'.join(map(str, sizes(args)))} tanh, global batch "
        f"{args.batch_size}, kfac inverse_update_period=1; "
        f"{platform.machine()}, {cpus} CPUs (simulated devices share them); "
        f"{results[counts[0]]['environment']}; "
        f"{args.rounds * args.steps_per_round} timed steps each, "
        f"interleaved; 1-min load average {loads[0]:.1f} before, "
        f"{loads[1]:.1f} after"
        + (" (above the CPU count: expect noise)" if max(loads) > cpus
           else "") + "\n")
  print(f"| devices | {'optimizer':<26} | first call (CPU) | median step | "
        f"vs adam | vs {counts[0]} device(s) | inverse refresh alone |")
  print(f"|---|{'-' * 28}|---|---|---|---|---|")
  for n in counts:
    rows = results[n]["rows"]
    adam = rows[0]["median_ms"]
    for r in rows:
      refresh = ("" if r["refresh_ms"] is None
                 else f"{r['refresh_ms']:.1f} ms")
      print(f"| {n} | {r['name']:<26} | {r['first_s']:.1f} s "
            f"({r['first_cpu_s']:.1f} s) | "
            f"{r['median_ms']:.1f} ms | {r['median_ms'] / adam:.2f}x | "
            f"{r['median_ms'] / base[r['name']]:.2f}x | {refresh} |")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=(__doc__ or "").split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--devices", default="1,2,4",
                 help="comma-separated device counts, one subprocess each")
  p.add_argument("--batch-size", type=int, default=256,
                 help="global batch (divisible by every device count)")
  p.add_argument("--input", type=int, default=256, help="input width")
  p.add_argument("--width", type=int, default=512,
                 help="first hidden width (then +32 per layer)")
  p.add_argument("--depth", type=int, default=3, help="hidden layers")
  p.add_argument("--warmup", type=int, default=2,
                 help="untimed steps per optimizer after the first call")
  p.add_argument("--rounds", type=int, default=4)
  p.add_argument("--steps-per-round", type=int, default=5,
                 help="timed steps (and refreshes) per optimizer per round")
  p.add_argument("--timeout", type=int, default=600,
                 help="seconds per device count")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Prints the table (stdout; progress on stderr); returns the results."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.worker:
    out = worker(args)
    print(json.dumps(out), flush=True)
    return out
  loads, results = [os.getloadavg()[0]], {}
  for n in [int(c) for c in args.devices.split(",")]:
    t0 = time.perf_counter()
    log(f"{n} device(s): starting a worker")
    results[n] = run_count(n, argv, args.timeout)
    log(f"{n} device(s): done in {time.perf_counter() - t0:.0f} s")
  print_table(args, results, (loads[0], os.getloadavg()[0]))
  return results


if __name__ == "__main__":
  main()
