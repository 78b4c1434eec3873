"""Soak run: thousands of K-FAC steps with poisoned batches and kills.

A ``784-H-10`` tanh MLP trains on MNIST with ``kfac_jax_lite.kfac`` (the
one-pass path: ``value_grad_and_stats``, then ``update(..., stats=...)``).
A fixed fraction of the batches is poisoned, cycling through four faults:

* ``nan``: one pixel of one example is NaN;
* ``inf``: one pixel of one example is +Inf;
* ``huge``: one example is scaled by 1e25 (finite, but its squares
  overflow float32, so the curvature statistics are Inf);
* ``zeros``: every input is 0 (finite and legitimate: applied, not
  skipped; the run must stay finite through it).

The faulted run is trained by worker subprocesses that save an orbax
checkpoint every ``--ckpt-every`` steps; the parent kills the worker with
SIGKILL at random steps (``--kills`` times, without warning) and starts a
fresh one, which restores the latest checkpoint and
goes on. An in-process twin trains on the same batches without
interruption. The invariants:

1. the final parameters and optimizer state of the faulted, killed run are
   bitwise equal to the twin's;
2. the skip counter equals the number of non-finite batches (``nan``,
   ``inf``, ``huge``), in both runs;
3. every skipped step leaves the parameters bitwise as they were;
4. every parameter is finite;
5. the resident set size grows by less than ``--rss-tolerance`` after the
   warm-up (the median of the last quarter of the samples against that of
   the first quarter), in the twin and in the last worker (psutil, else
   ``/proc/self/status``).

``--left-out-twin`` also trains a twin that never runs the non-finite
steps and reports whether it matches bitwise. It does only where every
statistic of a skipped batch is non-finite: the factors fold in each
finite statistic of a skipped step (``skip_nonfinite``), and an Inf or
overflowing input leaves all but the first layer's input statistics finite.

It prints progress, then a summary table, and exits 1 when an invariant
fails. Not part of the default test tier (``tests/test_soak.py`` runs a
tiny size in the slow tier).

Run::

  python benchmarks/soak.py                          # 5,000 steps
  python benchmarks/soak.py --steps 200 --kills 2 --ckpt-every 20
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, cast

# One BLAS/LAPACK thread in every process (the parent's twin and the
# workers), so that the same program computes the same bits everywhere.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
  os.environ.setdefault(_var, "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kfac_jax_lite as kl  # noqa: E402
# benchmarks/ is this script's path: the tagged tanh MLP of the optimizer
# benchmark.
from optimizer_vs_adam import init_params, loss_fn  # noqa: E402

DEFAULT_DATA = os.path.join(ROOT, "examples", "data", "mnist.npz")
FAULTS = ("nan", "inf", "huge", "zeros")
NONFINITE = ("nan", "inf", "huge")


# ---------------------------------------------------------------------------
# The model, the data and the faults: pure functions of the flags and the
# step index, so every process builds the same batches.
# ---------------------------------------------------------------------------


def load_data(path):
  with np.load(path) as d:
    return d["x_train"].reshape(len(d["x_train"]), -1), d["y_train"]


def fault_schedule(args) -> dict:
  """``step -> fault``: ``round(fraction · steps)`` distinct steps in
  ``[1, steps - 1)`` (the first and last steps are clean), faults cycling."""
  n = max(len(FAULTS), round(args.poison_fraction * args.steps))
  rng = np.random.default_rng(args.seed + 1)
  steps = sorted(rng.choice(np.arange(1, args.steps - 1), n, replace=False))
  return {int(s): FAULTS[i % len(FAULTS)] for i, s in enumerate(steps)}


@functools.lru_cache(maxsize=2)
def _permutation(seed, n):
  return np.random.default_rng(seed).permutation(n)


def batch_at(data, step, args, fault=None):
  """Batch ``step``: a slice of epoch ``step // steps_per_epoch``'s
  permutation, scaled to [0, 1], poisoned by ``fault``."""
  x_all, y_all = data
  per_epoch = len(x_all) // args.batch_size
  epoch, i = divmod(step, per_epoch)
  perm = _permutation(args.seed * 1000 + epoch, len(x_all))
  idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
  x = x_all[idx].astype(np.float32) / 255.0
  r = np.random.default_rng(step)
  row, col = r.integers(args.batch_size), r.integers(x.shape[1])
  if fault == "nan":
    x[row, col] = np.nan
  elif fault == "inf":
    x[row, col] = np.inf
  elif fault == "huge":
    x[row] *= 1e25
  elif fault == "zeros":
    x[:] = 0.0
  return jnp.asarray(x), jnp.asarray(y_all[idx].astype(np.int32))


def build(args, data):
  """``(params, opt_state, step_fn)`` of the run."""
  params = init_params(jax.random.PRNGKey(args.seed),
                       [784, args.hidden, 10])
  collection = kl.scan(loss_fn, params, batch_at(data, 0, args))
  tx = kl.kfac(args.learning_rate, collection, damping=args.damping,
               inverse_update_period=args.inverse_update_period)
  vgs = kl.value_grad_and_stats(loss_fn, collection)
  base = jax.random.PRNGKey(args.seed + 2)

  @jax.jit
  def step_fn(params, opt_state, batch, step):
    loss, grads, stats = vgs(params, batch, jax.random.fold_in(base, step))
    updates, opt_state = tx.update(grads, opt_state, params, stats=stats)
    # kfac's state is a SkipNonFiniteState (optax types it as any state).
    return (optax.apply_updates(params, updates),
            cast(kl.SkipNonFiniteState, opt_state), loss)

  return params, cast(kl.SkipNonFiniteState, tx.init(params)), step_fn


class RSS:
  """Resident set size samples in MiB (psutil, else /proc/self/status)."""

  def __init__(self):
    try:
      # Optional, not a dependency: /proc/self/status without it.
      import psutil  # pyright: ignore[reportMissingImports]
      proc = psutil.Process()
      self._read = lambda: proc.memory_info().rss / 2**20
      self.source = "psutil"
    except ImportError:
      self._read = self._proc_status
      self.source = "/proc/self/status"
    self.samples = []   # (step, MiB)

  @staticmethod
  def _proc_status():
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
    return float("nan")

  def sample(self, step):
    self.samples.append((step, self._read()))


def rss_growth(samples, warmup_steps):
  """``(early, late, peak, growth)`` of the samples after ``warmup_steps``
  steps: the median of their first and of their last quarter, the largest,
  and ``late / early - 1``. Medians of quarters measure the trend; single
  samples swing by a few percent with the allocator and the checkpointer's
  buffers."""
  after = [m for s, m in samples if s >= warmup_steps]
  if len(after) < 8:
    return (float("nan"),) * 4
  q = len(after) // 4
  early, late = float(np.median(after[:q])), float(np.median(after[-q:]))
  return early, late, max(after), late / early - 1


def tree_leaves_named(tree):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


# ---------------------------------------------------------------------------
# The worker: one process of the faulted run.
# ---------------------------------------------------------------------------


def worker(args):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  data = load_data(args.data)
  faults = fault_schedule(args)
  params, opt_state, step_fn = build(args, data)
  ckpt_dir = os.path.join(os.path.abspath(args.workdir), "ckpt")
  mngr = ocp.CheckpointManager(
      ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2))
  start = mngr.latest_step() or 0
  state = {"params": params, "opt": opt_state}
  if start:
    state = mngr.restore(start, args=ocp.args.StandardRestore(
        jax.eval_shape(lambda: state)))
  print(f"resumed {start}", flush=True)
  rss = RSS()
  params, opt_state = state["params"], state["opt"]
  for step in range(start, args.steps):
    batch = batch_at(data, step, args, faults.get(step))
    params, opt_state, _ = step_fn(params, opt_state, batch, step)
    if (step + 1) % args.report_every == 0:
      jax.block_until_ready(params)
      rss.sample(step + 1 - start)
      print(f"step {step + 1}", flush=True)
    if (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
      mngr.save(step + 1, args=ocp.args.StandardSave(
          {"params": params, "opt": opt_state}))
  mngr.wait_until_finished()
  final = tree_leaves_named({"params": params, "opt": opt_state})
  arrays: dict[str, Any] = {f"{i:04d}": v for i, v in enumerate(final.values())}
  np.savez(os.path.join(args.workdir, "final.npz"), **arrays)
  with open(os.path.join(args.workdir, "final.json"), "w",
            encoding="utf-8") as f:
    json.dump({"names": list(final), "start": start,
               "rss": rss.samples, "rss_source": rss.source}, f)
  print("done", flush=True)


# ---------------------------------------------------------------------------
# The parent: the twin in process, the workers killed at random steps.
# ---------------------------------------------------------------------------


def twin(args, data, faults, leave_out=False):
  """The uninterrupted run, in process: fed the same (poisoned) batches, or
  with ``leave_out`` never running the non-finite steps at all. Checks at
  each non-finite step that the parameters stay bitwise as they were and
  the skip counter counts it; returns ``(state, rss, seconds, violations)``.
  """
  params, opt_state, step_fn = build(args, data)
  rss, bad = RSS(), []
  t0 = time.perf_counter()
  for step in range(args.steps):
    fault = faults.get(step)
    if fault in NONFINITE and leave_out:
      continue
    before = (params, opt_state.num_skipped) if fault in NONFINITE else None
    params, opt_state, _ = step_fn(params, opt_state,
                                   batch_at(data, step, args, fault), step)
    if before is not None and not (
        int(opt_state.num_skipped) == int(before[1]) + 1 and all(
            np.array_equal(a, b) for a, b in zip(
                jax.tree.leaves(params), jax.tree.leaves(before[0])))):
      bad.append(step)
    if (step + 1) % args.report_every == 0:
      jax.block_until_ready(params)
      rss.sample(step + 1)
    if (step + 1) % max(1, args.steps // 5) == 0:
      print(f"  step {step + 1}/{args.steps} "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
  jax.block_until_ready(params)
  return ({"params": params, "opt": opt_state}, rss,
          time.perf_counter() - t0, bad)


def worker_command(args):
  cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
  for k, v in vars(args).items():
    if k not in ("worker", "keep_workdir", "left_out_twin"):
      cmd += [f"--{k.replace('_', '-')}", str(v)]
  return cmd


def faulted_run(args):
  """Workers until one finishes; ``--kills`` of them are killed at random
  steps. Returns the kill log ``[(killed_at, resumed_from_next)]``."""
  rng = np.random.default_rng(args.seed + 3)
  lo, hi = max(1, args.steps // 20), max(2, int(0.7 * args.steps))
  targets = sorted(int(t) for t in rng.integers(lo, hi, args.kills))
  kills, resumed = [], []
  t0 = time.perf_counter()
  while True:
    proc = subprocess.Popen(worker_command(args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    if proc.stdout is None or proc.stderr is None:
      raise RuntimeError("worker_command: Popen gave no stdout/stderr pipe")
    target = targets[len(kills)] if len(kills) < len(targets) else None
    last = None
    for line in proc.stdout:
      if line.startswith("resumed"):
        resumed.append(int(line.split()[1]))
      elif line.startswith("step"):
        last = int(line.split()[1])
        if target is not None and last >= target:
          proc.send_signal(signal.SIGKILL)
          break
    proc.wait()
    if target is not None and proc.returncode == -signal.SIGKILL:
      kills.append(last)
      print(f"  faulted: killed at step {last} (resumed from "
            f"{resumed[-1]}; {time.perf_counter() - t0:.0f} s)", flush=True)
      continue
    if proc.returncode != 0:
      sys.stderr.write(proc.stderr.read())
      raise SystemExit(f"worker failed with return code {proc.returncode}")
    print(f"  faulted: finished from step {resumed[-1]} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return list(zip(kills, resumed[1:])), time.perf_counter() - t0


def load_final(workdir):
  with open(os.path.join(workdir, "final.json"), encoding="utf-8") as f:
    info = json.load(f)
  got = np.load(os.path.join(workdir, "final.npz"))
  return {n: got[f"{i:04d}"] for i, n in enumerate(info["names"])}, info


def differing(got, want, ignore=()):
  """Names of the leaves of ``want`` that ``got`` lacks or holds with other
  bits (or dtype); names ending in one of ``ignore`` are not compared."""
  return [n for n in want if not n.endswith(tuple(ignore)) and not (
      n in got and got[n].dtype == want[n].dtype and np.array_equal(
          got[n], want[n], equal_nan=True))] + [
              n for n in got if n not in want]


def main(argv=None):
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--steps", type=int, default=5000)
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--learning-rate", type=float, default=0.05)
  p.add_argument("--damping", type=float, default=1e-2)
  p.add_argument("--inverse-update-period", type=int, default=10)
  p.add_argument("--poison-fraction", type=float, default=0.02)
  p.add_argument("--kills", type=int, default=6)
  p.add_argument("--ckpt-every", type=int, default=250)
  p.add_argument("--report-every", type=int, default=10)
  p.add_argument("--warmup-fraction", type=float, default=0.1,
                 help="steps of each process before its RSS baseline")
  p.add_argument("--rss-tolerance", type=float, default=0.05)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--data", default=DEFAULT_DATA)
  p.add_argument("--workdir", default=None,
                 help="checkpoints and worker outputs (default: a temp dir)")
  p.add_argument("--keep-workdir", action="store_true")
  p.add_argument("--left-out-twin", action="store_true",
                 help="also run a twin that never runs the non-finite "
                 "steps and report whether it matches bitwise")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    return worker(args)

  own_dir = args.workdir is None
  args.workdir = args.workdir or tempfile.mkdtemp(prefix="kfac_soak_")
  shutil.rmtree(os.path.join(args.workdir, "ckpt"), ignore_errors=True)
  os.makedirs(args.workdir, exist_ok=True)
  data = load_data(args.data)
  faults = fault_schedule(args)
  counts = {f: sum(v == f for v in faults.values()) for f in FAULTS}
  print(f"soak: {args.steps} steps, batch {args.batch_size}, 784-"
        f"{args.hidden}-10 MLP, {len(faults)} poisoned batches {counts}, "
        f"{args.kills} kills, checkpoint every {args.ckpt_every} steps",
        flush=True)
  print("twin run (in process, the same batches, no kills):", flush=True)
  twin_state, twin_rss, twin_s, twin_bad = twin(args, data, faults)
  print("faulted run (worker subprocesses, SIGKILL at random steps):",
        flush=True)
  kill_log, faulted_s = faulted_run(args)
  got, info = load_final(args.workdir)
  want = tree_leaves_named(twin_state)
  diff = differing(got, want)
  skipped = int(got["['opt'].num_skipped"])
  finite = all(np.isfinite(v).all() for n, v in got.items()
               if n.startswith("['params']"))
  left_out = None
  if args.left_out_twin:
    print("left-out twin (in process, non-finite steps never run):",
          flush=True)
    lo_state = twin(args, data, faults, leave_out=True)[0]
    left_out = differing(got, tree_leaves_named(lo_state),
                         ignore=(".num_skipped",))
  expected_skips = sum(counts[f] for f in NONFINITE)
  t_early, t_late, t_peak, t_growth = rss_growth(
      twin_rss.samples, int(args.warmup_fraction * args.steps))
  segment = args.steps - info["start"]
  w_early, w_late, w_peak, w_growth = rss_growth(
      info["rss"], int(args.warmup_fraction * segment))
  tol = f"{100 * args.rss_tolerance:g}%"
  checks = [
      ("killed-and-resumed run bitwise equal to the uninterrupted twin "
       f"(parameters and optimizer state, {len(want)} leaves)", not diff),
      (f"skip counter {skipped} == non-finite batches {expected_skips} "
       f"(twin: {int(twin_state['opt'].num_skipped)})",
       skipped == expected_skips == int(twin_state["opt"].num_skipped)),
      ("every skipped step left the parameters bitwise unchanged",
       not twin_bad),
      ("parameters finite", finite),
      (f"kill/resume cycles {len(kill_log)} >= {args.kills}",
       len(kill_log) >= args.kills),
      (f"twin RSS growth after warm-up {100 * t_growth:+.2f}% < {tol}",
       t_growth < args.rss_tolerance),
      (f"last worker RSS growth after warm-up {100 * w_growth:+.2f}% < "
       f"{tol}", w_growth < args.rss_tolerance),
  ]
  rows = [
      ("steps", f"{args.steps}"),
      ("poisoned batches", f"{len(faults)} ("
       f"{100 * len(faults) / args.steps:.2f}%): " + ", ".join(
           f"{f} {counts[f]}" for f in FAULTS)),
      ("skipped (skip counter)", f"{skipped}"),
      ("kills (step killed -> step resumed)",
       ", ".join(f"{k}->{r}" for k, r in kill_log)),
      ("steps recomputed after kills", f"{sum(k - r for k, r in kill_log)}"),
      ("twin RSS MiB (first -> last quarter after warm-up; peak)",
       f"{t_early:.1f} -> {t_late:.1f}; {t_peak:.1f} ({twin_rss.source})"),
      (f"last worker RSS MiB ({segment} steps)",
       f"{w_early:.1f} -> {w_late:.1f}; {w_peak:.1f}"),
      ("twin wall time", f"{twin_s:.0f} s"),
      ("faulted run wall time (all workers)", f"{faulted_s:.0f} s"),
  ]
  if left_out is not None:
    rows.append(("equal to a run without the non-finite steps",
                 "yes" if not left_out else
                 f"no: {len(left_out)} leaves differ, e.g. {left_out[0]}"))
  width = max(len(r[0]) for r in rows)
  print("\nsummary")
  for k, v in rows:
    print(f"  {k.ljust(width)}  {v}")
  print("\ninvariants")
  for text, ok in checks:
    print(f"  [{'ok' if ok else 'FAIL'}] {text}")
  if diff:
    print(f"  differing leaves: {diff[:5]}")
  if twin_bad:
    print(f"  skipped steps that moved the parameters: {twin_bad[:5]}")
  if own_dir and not args.keep_workdir:
    shutil.rmtree(args.workdir, ignore_errors=True)
  if all(ok for _, ok in checks):
    print("all invariants hold")
    return 0
  print("INVARIANT FAILED")
  return 1


if __name__ == "__main__":
  sys.exit(main())
