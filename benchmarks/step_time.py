"""Step time of K-FAC against Adam, measured side by side in one process.

Two models (``--models``):

* ``mlp``: a tagged ``784-512-512-10`` tanh MLP, batch 256, softmax
  cross-entropy; ``kfac`` at each inverse period;
* ``autoencoder``: the deep autoencoder of ``examples/mnist_autoencoder.py``
  (``784-1000-500-250-30-250-500-1000-784``, sigmoid cross-entropy plus
  L2), batch 500; ``kfac`` and ``kfac_optimizer`` at each inverse period.

Every optimizer runs the same jitted step structure, donating params and
state: loss and gradient (for ``kfac``:
:func:`kfac_jax_lite.value_grad_and_stats`, which also returns the
curvature statistics), ``tx.update``, ``optax.apply_updates``.
``kfac_optimizer`` runs ``tx.update(None, state, params, batch=batch)``:
loss, gradient, statistics and its quadratic model from one forward pass.

Reported per optimizer:

* ``first call``: trace + compile + one step, to ``block_until_ready``,
  in wall-clock seconds and in CPU seconds (all threads; on a busy machine
  the wall clock grows, the CPU time much less). Each optimizer's first
  call runs in a fresh Python process of its own (:func:`cold_first_call`),
  as a user's program meets it: in one process a later optimizer would
  find JAX's tracing and lowering caches warmed by the ones before (on the
  MLP, a second ``kfac`` traces and lowers in 0.11 s where the first took
  0.26 s). Each of those processes warms up first
  (:func:`warm_up_process`): one-time costs of JAX and of its LAPACK
  bindings, which any program pays once whatever its optimizer, are timed
  and printed apart, not charged to the optimizer. With ``--cache-hits``
  a second table gives the first call of a process that finds the step in
  JAX's persistent compilation cache (filled by an earlier process), as a
  program restarted with ``jax_compilation_cache_dir`` set would;
* ``median`` and ``mean`` step time over the timed steps. With
  ``inverse_update_period=k`` one step in ``k`` also refreshes the inverses,
  so the median is the cost of an ordinary step and the mean the amortised
  cost;
* ratios of both against Adam.

To damp the noise of a shared machine the timed steps are interleaved: each
round runs a few steps of every optimizer in turn. A breakdown of the K-FAC
step (each piece jitted alone, with XLA's flop estimate, and the first
call split into tracing/lowering and XLA compilation) follows each table.

Run from the repository root::

  python benchmarks/step_time.py              # ~11 minutes on a 2-core CPU
  python benchmarks/step_time.py --models mlp --rounds 10
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax_lite  # noqa: E402
from kfac_jax_lite import optimizer as optimizer_lib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES = (784, 512, 512, 10)


def load_example(name: str):
  """Imports ``examples/<name>.py`` (examples is not a package)."""
  path = ROOT / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"example_{name}", path)
  if spec is None or spec.loader is None:
    raise ImportError(f"load_example: name={name!r}: {path} is not an "
                      "importable Python file; pass the stem of a file "
                      "in examples/.")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


# ---------------------------------------------------------------------------
# Models: a loss function, initial parameters and a few batches.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
  name: str
  loss_fn: Callable
  params: object
  batches: list


def init_mlp(key, sizes: Sequence[int]) -> dict:
  """LeCun-normal kernels ``[d_in, d_out]`` and zero biases."""
  params = {}
  for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    params[f"dense_{i}"] = {
        "kernel": jax.random.normal(sub, (d_in, d_out)) / np.sqrt(d_in),
        "bias": jnp.zeros((d_out,))}
  return params


def mlp_loss_fn(params: dict, batch: dict):
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


def mlp_problem(batch_size: int) -> Problem:
  """Random batches of MNIST shape (values do not affect timing)."""
  batches = []
  for k in jax.random.split(jax.random.PRNGKey(1), 4):
    kx, ky = jax.random.split(k)
    batches.append({"x": jax.random.uniform(kx, (batch_size, SIZES[0])),
                    "y": jax.random.randint(ky, (batch_size,), 0, SIZES[-1])})
  return Problem(f"MLP {'-'.join(map(str, SIZES))} tanh, batch {batch_size}",
                 mlp_loss_fn, init_mlp(jax.random.PRNGKey(0), SIZES), batches)


def autoencoder_problem(batch_size: int) -> Problem:
  """The example's autoencoder on real MNIST batches."""
  ae = load_example("mnist_autoencoder")
  images = ae.load_images(ae.DEFAULT_DATA)
  sizes = ae.layer_sizes(1.0)
  batches = [jnp.asarray(images[i * batch_size:(i + 1) * batch_size])
             for i in range(4)]
  return Problem(f"autoencoder {'-'.join(map(str, sizes))}, batch "
                 f"{batch_size}", ae.loss_fn,
                 ae.init_params(jax.random.PRNGKey(0), sizes), batches)


# ---------------------------------------------------------------------------
# Steps and timing.
# ---------------------------------------------------------------------------


def adam_step(loss_fn, tx) -> Callable:
  def step(params, state, batch, rng):
    del rng
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  return jax.jit(step, donate_argnums=(0, 1))


def kfac_step(loss_fn, tx, collection, pass_batch: bool = False,
              stats_fraction: float = 1.0) -> Callable:
  """K-FAC's step; ``pass_batch`` for kfac_optimizer, whose
  ``update(None, ..., batch=)`` takes loss, gradient, statistics and its
  quadratic model's products from one forward pass."""
  vgs = kfac_jax_lite.value_grad_and_stats(loss_fn, collection,
                                           stats_fraction=stats_fraction)

  def step(params, state, batch, rng):
    if pass_batch:
      updates, state = tx.update(None, state, params, batch=batch)
      return optax.apply_updates(params, updates), state, state.loss
    loss, grads, stats = vgs(params, batch, rng)
    updates, state = tx.update(grads, state, params, stats=stats)
    return optax.apply_updates(params, updates), state, loss
  return jax.jit(step, donate_argnums=(0, 1))


class Runner:
  """One optimizer's jitted step, its current state, and its timings."""

  def __init__(self, name: str, make_step: Callable, tx, params, batches):
    self.name, self.batches = name, batches
    self.make_step, self.step = make_step, make_step()
    self.tx, self.params, self.state = tx, params, None
    self.key, self.count, self.times = jax.random.PRNGKey(1), 0, []
    self.first_call_s = self.first_call_cpu_s = None

  def prepare(self) -> None:
    """Builds the state on first use, outside any timing."""
    if self.state is None:
      # Own copies: the steps donate params and state (as a training loop
      # should), which frees the buffers they were given.
      self.params = jax.tree.map(jnp.copy, self.params)
      self.state = self.tx.init(self.params)
      jax.block_until_ready(self.state)

  def run(self, num: int, record: bool) -> None:
    self.prepare()
    for _ in range(num):
      batch = self.batches[self.count % len(self.batches)]
      rng = jax.random.fold_in(self.key, self.count)
      t0, c0 = time.perf_counter(), time.process_time()
      self.params, self.state, loss = self.step(self.params, self.state,
                                                batch, rng)
      loss.block_until_ready()
      dt = time.perf_counter() - t0
      if self.first_call_s is None:
        self.first_call_s = dt
        self.first_call_cpu_s = time.process_time() - c0
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


def flops_and_compile(fn: Callable, *args) -> tuple:
  """XLA's flop estimate for ``fn(*args)`` (nan if absent), compile seconds.

  The compile time is XLA's alone (``lowered.compile()``), lowering apart;
  a fresh wrapper keeps JAX's caches from answering for an earlier jit.
  """
  lowered = jax.jit(lambda *a: fn(*a)).lower(*args)
  t0 = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", float("nan"))), seconds


def compile_split(runner: Runner, batch) -> tuple:
  """``(trace, lower, XLA compile)`` seconds of a runner's step, cold.

  A new closure, so no trace cache applies.
  """
  step = runner.make_step()
  args = (runner.params, runner.state, batch, jax.random.PRNGKey(0))
  t0 = time.perf_counter()
  traced = step.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  return t1 - t0, t2 - t1, time.perf_counter() - t2


def breakdown(problem: Problem, collection, damping: float,
              with_optimizer: bool) -> list:
  """Rows ``(part, median ms, GFLOP, compile s)`` of a K-FAC step's pieces."""
  loss_fn, params, batch = problem.loss_fn, problem.params, problem.batches[0]
  rng = jax.random.PRNGKey(0)
  vgs = kfac_jax_lite.value_grad_and_stats(loss_fn, collection)
  est = kfac_jax_lite.FisherEstimator(collection, damping=damping)
  _, grads, stats = jax.jit(vgs)(params, batch, rng)
  est_state = est.update_cache(est.update_curvature(est.init(params),
                                                    stats=stats))
  parts = [
      ("value_and_grad (what Adam computes)", jax.value_and_grad(loss_fn),
       (params, batch)),
      ("value_grad_and_stats (+ A, G statistics)", vgs, (params, batch, rng)),
      ("update_curvature (EMA of the factors)",
       lambda s, st: est.update_curvature(s, stats=st), (est_state, stats)),
      ("update_cache (damped inverses)", est.update_cache, (est_state,)),
      ("multiply_inverse (precondition)", est.multiply_inverse,
       (est_state, grads))]
  if with_optimizer:
    def gram(p, b, u, v):  # kfac_optimizer: one linearisation, two JVPs.
      return optimizer_lib.fisher_gram(est.linearize(p, b), [u, v])
    parts += [
        ("kfac_optimizer: linearize + 2 Fisher JVPs", gram,
         (params, batch, grads, grads)),
        ("kfac_optimizer: loss at θ+u (every 5th step)", loss_fn,
         (params, batch))]
  rows = []
  for name, fn, args in parts:
    gflop, compile_s = flops_and_compile(fn, *args)
    rows.append((name, 1e3 * timeit(jax.jit(fn), *args), gflop / 1e9,
                 compile_s))
  return rows


# ---------------------------------------------------------------------------
# One table per model.
# ---------------------------------------------------------------------------


def make_runners(problem: Problem, collection, periods, damping: float,
                 with_optimizer: bool, fractions: Sequence[float] = ()
                 ) -> list:
  """Adam, then ``kfac`` (and ``kfac_optimizer``) at each inverse period
  with their default ``stats_fraction`` (1 and 0.25); each other
  ``fractions`` entry adds a row at period 5 with that fraction."""
  runners = []
  tx = optax.adam(1e-3)
  runners.append(Runner("optax.adam",
                        lambda tx=tx: adam_step(problem.loss_fn, tx), tx,
                        problem.params, problem.batches))

  def variants(default):
    return [(p, None) for p in periods] + [
        (5, f) for f in fractions if f != default]

  def label(name, period, fraction):
    return f"{name}, inverse every {period}" + (
        "" if fraction is None else f", stats_fraction {fraction:g}")

  for period, fraction in variants(1.0):
    kw = {} if fraction is None else {"stats_fraction": fraction}
    est = None if fraction is None else kfac_jax_lite.FisherEstimator(
        collection, stats_fraction=fraction)
    tx = kfac_jax_lite.kfac(1e-2, collection, damping=damping,
                            inverse_update_period=period, estimator=est)
    runners.append(Runner(
        label("kfac", period, fraction),
        lambda tx=tx, kw=kw: kfac_step(problem.loss_fn, tx, collection,
                                       **kw), tx,
        problem.params, problem.batches))
  if with_optimizer:
    for period, fraction in variants(0.25):
      est = None if fraction is None else kfac_jax_lite.FisherEstimator(
          collection, stats_fraction=fraction)
      tx = kfac_jax_lite.kfac_optimizer(collection,
                                        inverse_update_period=period,
                                        estimator=est)
      runners.append(Runner(
          label("kfac_optimizer", period, fraction),
          lambda tx=tx: kfac_step(problem.loss_fn, tx, collection,
                                  pass_batch=True), tx,
          problem.params, problem.batches))
  return runners


def bench(model: str, args) -> list:
  """Times one model's optimizers (``kfac_optimizer`` too on the
  autoencoder); prints the table and breakdown."""
  load_before = os.getloadavg()[0]
  with_optimizer = model != "mlp"
  problem, collection, runners = model_runners(model, args)
  periods = [int(s) for s in args.periods.split(",")]
  cached = {}
  for i, r in enumerate(runners):
    r.first_call_s, r.first_call_cpu_s = cold_first_call(model, i, args)
    print(f"  [{model}] {r.name}: first call {r.first_call_s:.2f}s "
          "(fresh process)", flush=True)
    if args.cache_hits:
      with tempfile.TemporaryDirectory() as cache:
        cold_first_call(model, i, args, cache)  # Fills the cache.
        cached[r.name] = cold_first_call(model, i, args, cache)
      print(f"  [{model}] {r.name}: first call {cached[r.name][0]:.2f}s "
            "(fresh process, persistent cache hit)", flush=True)
  for r in runners:  # Compile in this process, then warm up (untimed).
    r.run(1 + args.warmup, record=False)
  for _ in range(args.rounds):
    for r in runners:
      r.run(args.steps_per_round, record=True)

  adam = runners[0]
  base_med = statistics.median(adam.times)
  base_mean = statistics.mean(adam.times)
  load_after = os.getloadavg()[0]
  busy = max(load_before, load_after) > (os.cpu_count() or 1)
  print(f"\n## {problem.name}\n")
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{platform.machine()} ({cpu_model()}), {os.cpu_count()} CPUs; "
        f"{len(adam.times)} timed steps each, interleaved; "
        f"{blas_environment()}; 1-min load average "
        f"{load_before:.1f} before, {load_after:.1f} after"
        + (" (above the CPU count: other processes competed; expect noise)"
           if busy else "") + "\n")
  width = max(34, *(len(r.name) for r in runners))
  header = (f"| {'optimizer':<{width}} | first call | first call CPU | "
            f"{'median':>9} | {'mean':>9} | median/adam | mean/adam | "
            "first/adam |")
  print(header)
  print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1])
        + "|")
  rows = []
  for r in runners:
    med, mean = statistics.median(r.times), statistics.mean(r.times)
    rows.append({"model": problem.name, "name": r.name,
                 "first_call_s": r.first_call_s,
                 "first_call_cpu_s": r.first_call_cpu_s,
                 "median_ms": 1e3 * med,
                 "mean_ms": 1e3 * mean, "median_ratio": med / base_med,
                 "mean_ratio": mean / base_mean,
                 "first_ratio": r.first_call_s / adam.first_call_s})
    print(f"| {r.name:<{width}} | {r.first_call_s:9.2f}s | "
          f"{r.first_call_cpu_s:13.2f}s | {1e3 * med:7.2f}ms | "
          f"{1e3 * mean:7.2f}ms | {med / base_med:10.2f}x | "
          f"{mean / base_mean:8.2f}x | {rows[-1]['first_ratio']:9.2f}x |")
  if cached:
    print("\nFirst call of a fresh process that finds the step in JAX's "
          "persistent compilation cache (jax_compilation_cache_dir, "
          "min compile time 0), against the cold first call above:\n")
    print(f"| {'optimizer':<{width}} | cached first call | cold first call "
          "| cached/adam's cached |")
    print(f"|{'-' * (width + 2)}|{'-' * 19}|{'-' * 17}|{'-' * 22}|")
    for r in runners:
      print(f"| {r.name:<{width}} | {cached[r.name][0]:16.2f}s | "
            f"{r.first_call_s:14.2f}s | "
            f"{cached[r.name][0] / cached[adam.name][0]:19.2f}x |")
  if args.no_breakdown:
    return rows
  print("\nK-FAC step breakdown (each piece jitted alone; GFLOP from XLA's "
        "cost_analysis, which does not count LAPACK calls):\n")
  print(f"| {'part':<46} | {'median':>9} | {'GFLOP':>7} | XLA compile |")
  print(f"|{'-' * 48}|{'-' * 11}|{'-' * 9}|{'-' * 13}|")
  for name, ms, gflop, comp in breakdown(problem, collection, args.damping,
                                         with_optimizer):
    print(f"| {name:<46} | {ms:7.2f}ms | {gflop:7.3f} | {comp:10.2f}s |")
  print("\nFirst call split (a fresh jit of the same step, cold; the "
        "process has traced and compiled it once already, so JAX's own "
        "one-time costs are not in it):\n")
  print(f"| {'optimizer':<34} |   trace |   lower | XLA compile |")
  print(f"|{'-' * 36}|{'-' * 9}|{'-' * 9}|{'-' * 13}|")
  period = 5 if 5 in periods else periods[0]
  chosen = [runners[0]] + [r for r in runners
                           if r.name.endswith(f" every {period}")]
  for r in chosen:
    trace_s, lower_s, compile_s = compile_split(r, problem.batches[0])
    print(f"| {r.name:<34} | {trace_s:6.2f}s | {lower_s:6.2f}s | "
          f"{compile_s:10.2f}s |")
  return rows


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--models", default="mlp,autoencoder",
                 help="comma-separated: mlp, autoencoder")
  p.add_argument("--batch-size", type=int, default=256, help="MLP batch")
  p.add_argument("--ae-batch-size", type=int, default=500,
                 help="autoencoder batch")
  p.add_argument("--periods", default="1,5,10,20",
                 help="K-FAC inverse_update_period values, comma-separated")
  p.add_argument("--warmup", type=int, default=3,
                 help="untimed steps per optimizer after the first call")
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--steps-per-round", type=int, default=10,
                 help="timed steps per optimizer per round (>= 30 in all)")
  p.add_argument("--damping", type=float, default=1e-2,
                 help="kfac's damping (kfac_optimizer adapts its own)")
  p.add_argument("--stats-fractions", default="0.25,1",
                 help="comma-separated stats_fraction values: each adds "
                 "kfac (and kfac_optimizer) rows at inverse period 5 whose "
                 "curvature uses that fraction of each batch, unless it is "
                 "the optimizer's default (kfac 1, kfac_optimizer 0.25); "
                 "'' for none")
  p.add_argument("--no-breakdown", action="store_true",
                 help="skip the per-part breakdown and compile split")
  p.add_argument("--cache-hits", action="store_true",
                 help="also time each first call in a fresh process that "
                 "finds the step in JAX's persistent compilation cache")
  p.add_argument("--first-call-of", nargs=2, metavar=("MODEL", "INDEX"),
                 help=argparse.SUPPRESS)  # cold_first_call's child process.
  p.add_argument("--compilation-cache", default=None,
                 help=argparse.SUPPRESS)  # The child's cache directory.
  args = p.parse_args(argv)
  if args.rounds * args.steps_per_round < 30:
    p.error("time at least 30 steps: rounds * steps-per-round >= 30")
  unknown = set(args.models.split(",")) - {"mlp", "autoencoder"}
  if unknown:
    p.error(f"unknown --models {sorted(unknown)}; use mlp, autoencoder")
  return args


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo`` on Linux, else
  ``platform.processor()``), for the tables' header: ratios against Adam
  are what the benchmarks compare, but the absolute times (and first
  calls in seconds) depend on the machine."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown CPU"


def blas_environment() -> str:
  """What the timings ran under: the BLAS/OpenMP environment variables
  that are set (none, as a user's program would have them), and the
  library that runs jaxlib's CPU LAPACK kernels, with its build string
  and its thread count now (``kfac_jax_lite`` sets it to one when it
  traces a refresh on the CPU, see ``kfac_jax_lite/_blas_threads.py``).
  Call it after a LAPACK kernel ran (:func:`warm_up_process`)."""
  import ctypes  # pylint: disable=import-outside-toplevel
  from kfac_jax_lite import _blas_threads  # pylint: disable=g-import-not-at-top
  names = sorted(k for k in os.environ if k.startswith(
      ("OPENBLAS", "OMP_", "MKL_", "GOTO_", "BLIS_", "XLA_FLAGS")))
  env = ", ".join(f"{k}={os.environ[k]}" for k in names) or "none"
  path = _blas_threads.lapack_library()
  control = _blas_threads.thread_control()
  lib = "LAPACK library not found"
  if path is not None:
    lib = f"LAPACK {os.path.basename(path)}"
    for name in ("scipy_openblas_get_config", "openblas_get_config"):
      try:
        get = getattr(ctypes.CDLL(path), name)
      except AttributeError:
        continue
      get.restype = ctypes.c_char_p
      lib += f" ({get().decode().strip()})"
      break
    if control is not None:
      applied = _blas_threads.applied
      lib += f", {control[0]()} thread(s)" + (
          "" if applied is None else
          f" (kfac_jax_lite set {applied['after']}; it had "
          f"{applied['before']})")
  return f"environment variables: {env}; {lib}"


def warm_up_process() -> dict:
  """Pays the process's one-time costs before any first call is timed.

  Returns their wall-clock seconds: ``jax`` (the first compile and run of
  anything), ``lapack`` (compiling and running a 2 x 2 Cholesky): the
  first LAPACK call lowered on CPU makes jaxlib load its LAPACK kernels,
  which imports ``scipy.linalg`` (0.11-0.13 s here), and ``gram``
  (compiling and running an 8 x 8 ``xᵀx``): the first matrix product
  with a transposed left operand that XLA:CPU runs in a process takes
  about 21 ms more than the next ones, whatever its size and program
  (``xxᵀ`` does not). Adam's steps have neither; K-FAC's refresh and
  its statistics' Gram products ``aᵀa`` have both, so without this the
  first K-FAC first call in a process would carry them.
  """
  t0 = time.perf_counter()
  jax.jit(lambda x: x + 1)(jnp.ones(())).block_until_ready()
  t1 = time.perf_counter()
  jax.jit(jnp.linalg.cholesky)(jnp.eye(2)).block_until_ready()
  t2 = time.perf_counter()
  jax.jit(lambda x: x.T @ x)(jnp.ones((8, 8))).block_until_ready()
  return {"jax": t1 - t0, "lapack": t2 - t1,
          "gram": time.perf_counter() - t2}


def _problem(model: str, args) -> Problem:
  return (mlp_problem(args.batch_size) if model == "mlp"
          else autoencoder_problem(args.ae_batch_size))


def _runners(model: str, args, problem: Problem, collection) -> list:
  """:func:`make_runners` for ``model`` with the command line's periods,
  damping and stats fractions (``kfac_optimizer`` on the autoencoder)."""
  return make_runners(
      problem, collection, [int(s) for s in args.periods.split(",")],
      args.damping, model != "mlp",
      [float(f) for f in args.stats_fractions.split(",") if f])


def model_runners(model: str, args) -> tuple:
  """``(problem, collection, runners)`` for ``model``: its problem, the
  layers ``kfac_jax_lite.scan`` finds in it, and :func:`_runners`."""
  problem = _problem(model, args)
  collection = kfac_jax_lite.scan(problem.loss_fn, problem.params,
                                  problem.batches[0])
  return problem, collection, _runners(model, args, problem, collection)


def run_child(cmd: list, what: str) -> dict:
  """Runs a benchmark's child process; returns the JSON object on the last
  line of its output (raises with its stderr's end if it failed)."""
  out = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def cold_first_call(model: str, index: int, args,
                    cache: Optional[str] = None) -> tuple:
  """``(wall, cpu)`` seconds of the first call of ``make_runners``' entry
  ``index`` for ``model``, in a fresh Python process (after its
  :func:`warm_up_process`); ``cache``: a persistent compilation cache
  directory for that process to read and fill."""
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()),
         "--batch-size", str(args.batch_size),
         "--ae-batch-size", str(args.ae_batch_size),
         "--periods", args.periods, "--stats-fractions",
         args.stats_fractions, "--damping", repr(args.damping),
         "--first-call-of", model, str(index)]
  if cache is not None:
    cmd += ["--compilation-cache", cache]
  got = run_child(cmd, f"first call of {model} #{index}")
  return got["wall_s"], got["cpu_s"]


def _first_call_child(args) -> None:
  model, index = args.first_call_of[0], int(args.first_call_of[1])
  if args.compilation_cache is not None:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  warm_up_process()
  runner = model_runners(model, args)[2][index]
  runner.run(1, record=False)
  print(json.dumps({"wall_s": runner.first_call_s,
                    "cpu_s": runner.first_call_cpu_s}))


def main(argv: Optional[Sequence[str]] = None) -> list:
  """Prints one timing table (and breakdown) per model; returns the rows."""
  args = parse_args(argv)
  if args.first_call_of:
    _first_call_child(args)
    return []
  warm = warm_up_process()
  print(f"one-time process warm-up, not in any first call: JAX "
        f"{warm['jax']:.2f}s, LAPACK bindings {warm['lapack']:.2f}s, "
        f"first xᵀx {warm['gram']:.2f}s")
  rows = []
  for model in args.models.split(","):
    rows += bench(model, args)
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
