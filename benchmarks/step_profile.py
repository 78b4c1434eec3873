"""Where the char GPT's jitted step goes: AdamW against ``kfac_adamw``.

Both optimizers' whole steps, as ``examples/char_gpt.py`` runs them (one
``jax.jit`` of loss, gradient, ``tx.update`` and ``apply_updates``; the
gradient over the whole batch, K-FAC's statistics from its first
``⌈f·B⌉`` sequences), in one process, interleaved:

* **first call**: a new ``jax.jit`` traced, lowered, compiled and run once
  (``jax.stages``), AdamW and K-FAC alternating ``--repeats`` times; each
  row the median;
* **program size**: the compiled module's instructions and its kernels
  (fusions, custom calls: what XLA:CPU emits code for), by part;
* **median step**: ``--steps`` steps of each, interleaved in rounds;
* **where the step goes**: ``--profile-steps`` steps of each under
  ``jax.profiler``, whose trace has one event per kernel that XLA:CPU
  runs. Each kernel belongs to the part of the JAX scope (``op_name``) of
  its instruction in the compiled module; the wall clock of a step is
  shared out among the kernels running at each instant (equal shares
  while several run at once), a gap between kernels goes to the kernel
  that starts after it (the executor's cost of reaching it), and the time
  before and after the program runs is *dispatch* (Python, argument
  handling, the wait for the result). The parts add up to the profiled
  steps' wall clock by construction; the profiled median is printed next
  to the unprofiled one.

The parts are JAX scopes: the benchmark names the loss and gradient
(``loss_and_grad``), ``tx.update`` (``optimizer``) and ``apply_updates``;
the library names its own (``kfac_pass``: the statistics' forward and
sampled backward pass; ``kfac_stats``: the factors' outer products;
``kfac_ema``; ``kfac_refresh``; ``kfac_inputs``: ``[W; b]`` of the
gradient; ``kfac_precondition``; ``kfac_finite``). What ``tx.update``
computes outside those (grafting's norms, RMSProp's second moment,
momentum, decay, the skip's selects) is the *optimizer tail*. An
instruction with no scope (a copy XLA added) goes to the part of its
first operand that has one; one that reads a step input directly is a
copy XLA makes of an input it may not overwrite (``--donate`` donates
params and state, as a training loop should; ``char_gpt``'s runner does
not).

Run::

  python benchmarks/step_profile.py                 # the example's GPT
  python benchmarks/step_profile.py --layers 12     # any char_gpt flag
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import sys
import tempfile
import time
from typing import Optional, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import char_gpt  # noqa: E402  pylint: disable=g-import-not-at-top

# (part, op_name pattern), the first match wins.
PARTS = (
    ("refresh (every 10th step)", "kfac_refresh"),
    ("statistics: outer products", "kfac_stats"),
    ("statistics: forward + sampled backward", "kfac_pass"),
    ("EMA of the factors", "kfac_ema"),
    ("preconditioning", "kfac_precondition"),
    ("[W; b] of the gradient", "kfac_inputs"),
    ("finiteness check", "kfac_finite"),
    ("loss and gradient", "loss_and_grad"),
    ("apply_updates", "apply_updates"),
    ("optimizer tail", "optimizer"),
)
# An unscoped instruction reading a step input directly: a copy of an
# input that is not donated (K-FAC's caches between refreshes, ...).
INPUTS = "copies of the inputs (not donated)"
CONTAINERS = ("while", "conditional", "call", "async-start", "async-done")


def parse_hlo(text: str) -> dict:
  """``{instruction: (opcode, op_name or None, operands, kernel key)}`` of
  the instructions of a compiled module's text outside fusion bodies; the
  kernel key of a fusion is its body's text without names and metadata
  (identical bodies compile once), None for other instructions."""
  bodies, current, fused = {}, None, set()
  pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) "
                       r"([\w\-]+)\(([^)]*)\)")
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      current = head.group(1)
      bodies[current] = []
      continue
    if current is not None:
      bodies[current].append(line)
    fused.update(re.findall(r"fusion\(.*calls=%([\w.\-]+)", line))
    fused.update(re.findall(r"to_apply=%([\w.\-]+)", line))

  def key(body):
    body = "\n".join(re.sub(r", metadata=\{[^}]*\}", "", l) for l in body)
    return re.sub(r"%[\w.\-]+", "%", body)

  out = {}
  for comp, lines in bodies.items():
    if comp in fused:
      continue
    for line in lines:
      m = pattern.match(line)
      if not m:
        continue
      name = re.search(r'op_name="([^"]*)"', line)
      operands = re.findall(r"%([\w.\-]+)", m.group(3))
      calls = re.search(r"calls=%([\w.\-]+)", line)
      k = (key(bodies.get(calls.group(1), [])) if m.group(2) == "fusion"
           and calls else None)
      if m.group(2) == "custom-call":
        k = re.sub(r"%[\w.\-]+|, metadata=\{[^}]*\}", "", line)
      out[m.group(1)] = (m.group(2), name.group(1) if name else None,
                         operands, k)
  return out


def part_of(instr: str, hlo: dict, seen=None) -> str:
  """The part of an instruction: by its scope, else its operands'."""
  opcode, name, operands, _ = hlo.get(instr, (None, None, (), None))
  if opcode == "parameter":
    return INPUTS
  if name is not None:
    return next((p for p, key in PARTS if key in name), "outside the step")
  seen = seen or set()
  seen.add(instr)
  for o in operands:
    if o not in seen and o in hlo:
      got = part_of(o, hlo, seen)
      if got != "unscoped":
        return got
  return "unscoped"


def program_size(hlo: dict) -> dict:
  """``{part: [instructions, kernels, distinct kernels]}`` (instructions
  outside fusion bodies; a distinct kernel counts in the part that first
  has it)."""
  out = collections.defaultdict(lambda: [0, 0, 0])
  seen = set()
  for instr, (opcode, _, _, key) in hlo.items():
    part = part_of(instr, hlo)
    out[part][0] += 1
    out[part][1] += int(opcode in ("fusion", "custom-call"))
    if key is not None and key not in seen:
      seen.add(key)
      out[part][2] += 1
  return out


def first_call(step, args, donate: bool = False) -> tuple:
  """``(trace, lower, compile, run)`` seconds of a new jit, and its
  compiled executable and outputs (``donate``: of params and state)."""
  t0 = time.perf_counter()
  traced = jax.jit(step, donate_argnums=(0, 1) if donate else ()).trace(
      *args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3 = time.perf_counter()
  out = jax.block_until_ready(compiled(*args))
  t4 = time.perf_counter()
  return (t1 - t0, t2 - t1, t3 - t2, t4 - t3), compiled, out


def _events(trace_dir: str) -> list:
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                          recursive=True))[-1]
  with gzip.open(path) as f:
    return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def attribute(events: list, hlo: dict, windows: list) -> dict:
  """``{part: seconds}`` summed over the step ``windows`` ``(t0, t1)`` (µs
  on the trace's clock): kernels share each instant equally, gaps go to
  the next kernel, time outside the program to dispatch."""
  kernels = [(e["ts"], e["ts"] + e["dur"], part_of(e["name"], hlo))
             for e in events if e["name"] in hlo
             and hlo[e["name"]][0] not in CONTAINERS]
  runs = [(e["ts"], e["ts"] + e["dur"]) for e in events
          if e["name"] == "ThunkExecutor::Execute"]
  out = collections.defaultdict(float)
  for t0, t1 in windows:
    inside = sorted(k for k in kernels if t0 <= k[0] and k[1] <= t1)
    execute = [r for r in runs if t0 <= r[0] and r[1] <= t1]
    if not inside or not execute:
      out["dispatch"] += (t1 - t0) * 1e-6
      continue
    start = min(r[0] for r in execute)
    end = max(max(r[1] for r in execute), max(k[1] for k in inside))
    out["dispatch"] += ((start - t0) + (t1 - end)) * 1e-6
    cuts = sorted({start, end, *(k[0] for k in inside),
                   *(k[1] for k in inside)})
    pending = 0.0
    for a, b in zip(cuts, cuts[1:]):
      live = [k[2] for k in inside if k[0] <= a and b <= k[1]]
      if not live:
        pending += b - a
        continue
      for part in live:
        out[part] += (b - a + pending) / len(live) * 1e-6
      pending = 0.0
    if pending:  # After the last kernel: the executor's wind-down.
      out[inside[-1][2]] += pending * 1e-6
  return out


def profile_steps(compiled, args, steps: int, hlo: dict) -> tuple:
  """``({part: ms per step}, mean profiled step ms)``: the parts are
  means over the steps too, so they add up to the mean."""
  params, state, batch = args
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp)
    walls = []
    for _ in range(steps):
      t0 = time.perf_counter()
      with jax.profiler.TraceAnnotation("profiled_step"):
        params, state, _ = jax.block_until_ready(
            compiled(params, state, batch))
      walls.append(time.perf_counter() - t0)
    jax.profiler.stop_trace()
    events = _events(tmp)
  windows = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e["name"] == "profiled_step"]
  parts = attribute(events, hlo, windows)
  return ({p: 1e3 * s / len(windows) for p, s in parts.items()},
          1e3 * float(np.mean(walls)))


def gflop(fn, *args) -> float:
  """XLA's flop count of ``fn`` lowered alone (before optimisation; LAPACK
  calls count nothing), in GFLOP."""
  cost = jax.jit(fn).lower(*args).cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  if cost is None:
    raise RuntimeError(f"gflop: XLA gave no cost analysis of {fn} on "
                       f"{jax.default_backend()}; drop --flops.")
  return cost.get("flops", float("nan")) / 1e9


def flops(gpt, s: dict) -> dict:
  """Prints and returns the GFLOP of each part of ``kfac_adamw``'s step,
  and of the statistics at other numbers of sequences and strides."""
  from kfac_jax_lite import linearization  # pylint: disable=g-import-not-at-top
  import kfac_jax_lite as kl  # pylint: disable=g-import-not-at-top
  params, loss_fn, batch = s["params"], s["loss_fn"], s["batch_fn"](0)
  key = jax.random.PRNGKey(0)
  rows = max(1, math.ceil(gpt.kfac_stats_fraction * gpt.batch_size))
  head = lambda n: jax.tree.map(lambda x: x[:n], batch)  # noqa: E731
  est = kl.FisherEstimator(s["collection"], damping=0.0)

  def model_passes(p, b, k):  # The statistics pass without the products.
    out = linearization.statistics_pass(
        est.linearize(p, b), est.blocks, k, est.estimation_mode, 1, False)
    return [(d.inputs, d.grads, d.param_grads) for d in out.layer_data]

  stats = jax.eval_shape(est.compute_stats, params, head(rows), key)
  state = jax.eval_shape(est.init, params)
  grads = jax.eval_shape(jax.grad(loss_fn), params, batch)
  out = {"loss and gradient": gflop(jax.value_and_grad(loss_fn), params,
                                    batch)}
  for n, k in ((rows, 1), (rows, 4), (max(1, rows // 2), 1),
               (max(1, rows // 2), 4)):
    strided = kl.FisherEstimator(s["collection"], damping=0.0,
                                 stats_position_stride=k)
    out[f"statistics, {n} sequences, stride {k}"] = gflop(
        strided.compute_stats, params, head(n), key)
  out[f"  forward and sampled backward, {rows} sequences"] = gflop(
      model_passes, params, head(rows), key)
  out["EMA"] = gflop(lambda st, x: est.update_curvature(st, stats=x),
                     state, stats)
  out["preconditioning"] = gflop(est.multiply_inverse, state, grads)
  out["refresh"] = gflop(lambda st: est.update_cache(st, 1e-3), state)
  print(f"\n{'part (lowered alone)':44} {'GFLOP':>8}")
  for name, g in out.items():
    print(f"{name:44} {g:8.2f}")
  return out


def parse_args(argv):
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--repeats", type=int, default=2,
                 help="first calls of each optimizer, alternating")
  p.add_argument("--steps", type=int, default=30,
                 help="timed steps of each, interleaved in rounds of 5")
  p.add_argument("--profile-steps", type=int, default=10)
  p.add_argument("--sizes-only", action="store_true",
                 help="first calls and program sizes only")
  p.add_argument("--flops", action="store_true",
                 help="only XLA's flop count of each part")
  p.add_argument("--donate", action="store_true",
                 help="jit the steps with their params and state donated "
                 "(char_gpt's runner does not donate)")
  args, rest = p.parse_known_args(argv)
  return args, char_gpt.parse_args(rest + ["--plot", ""])


def main(argv: Optional[Sequence[str]] = None) -> dict:
  args, gpt = parse_args(argv)
  if args.flops:
    return flops(gpt, char_gpt.setup(gpt))
  return run(args, gpt, char_gpt.setup(gpt))


def run(args, gpt, s: dict) -> dict:
  """Prints the tables for ``char_gpt.setup``'s ``s``; returns them."""
  params, batch = s["params"], s["batch_fn"](0)
  kfac_tx, fraction = char_gpt.kfac_transform(s["collection"], gpt, gpt.seed)
  adamw = char_gpt.adamw_transform(gpt.adam_lr)
  opts = {"AdamW": (adamw, None), "kfac_adamw": (kfac_tx, fraction)}
  print(f"jax {jax.__version__}; D{gpt.width} L{gpt.layers} H{gpt.heads} "
        f"T{gpt.context} B{gpt.batch_size}; donated: {args.donate}; load "
        f"{os.getloadavg()[0]:.1f}", flush=True)
  calls = collections.defaultdict(list)
  compiled, outs = {}, {}
  for _ in range(args.repeats):
    for name, (tx, fraction) in opts.items():
      # A new closure each time: no trace or compile is reused.
      step = char_gpt.make_step(s["loss_fn"], tx, fraction)
      mine = jax.tree.map(jax.numpy.copy, params)
      t, compiled[name], outs[name] = first_call(
          step, (mine, tx.init(mine), batch), args.donate)
      calls[name].append(t)
  print(f"\n{'first call (s)':14} {'trace':>6} {'lower':>6} {'compile':>8} "
        f"{'run':>6} {'total':>6}  (median of {args.repeats}; each total)")
  med = {}
  for name, ts in calls.items():
    m = np.median(np.asarray(ts), axis=0)
    med[name] = m
    print(f"{name:14} " + " ".join(f"{x:6.2f}" for x in m[:2])
          + f" {m[2]:8.2f} {m[3]:6.2f} {m.sum():6.2f}  "
          + ", ".join(f"{sum(t):.2f}" for t in ts))
  ratio = med["kfac_adamw"].sum() / med["AdamW"].sum()
  print(f"first call ratio {ratio:.2f}x; load {os.getloadavg()[0]:.1f}")
  hlos = {n: parse_hlo(c.as_text()) for n, c in compiled.items()}
  sizes = {n: program_size(h) for n, h in hlos.items()}
  names = sorted({p for v in sizes.values() for p in v},
                 key=lambda p: ([q for q, _ in PARTS] + [INPUTS]).index(p)
                 if p in dict(PARTS) or p == INPUTS else 99)
  print(f"\n{'program size':40} " + " ".join(
      f"{n + ' instr':>17} {'kernels':>7} {'distinct':>8}" for n in sizes))
  for p in names + ["total"]:
    row = [tuple(sum(v[i] for v in sz.values()) for i in range(3))
           if p == "total" else tuple(sz.get(p, (0, 0, 0))) for sz in
           sizes.values()]
    print(f"{p:40} " + " ".join(f"{a:17d} {b:7d} {c:8d}" for a, b, c in row))
  if args.sizes_only:
    return dict(first_call=med, sizes=sizes)
  state = {n: outs[n][1] for n in opts}
  cur = {n: outs[n][0] for n in opts}
  times = collections.defaultdict(list)
  for _ in range(max(1, args.steps // 5)):
    for n in opts:
      for _ in range(5):
        t0 = time.perf_counter()
        cur[n], state[n], _ = jax.block_until_ready(
            compiled[n](cur[n], state[n], batch))
        times[n].append(time.perf_counter() - t0)
  step_ms = {n: 1e3 * float(np.median(t)) for n, t in times.items()}
  print(f"\nmedian step: AdamW {step_ms['AdamW']:.1f} ms, kfac_adamw "
        f"{step_ms['kfac_adamw']:.1f} ms = "
        f"{step_ms['kfac_adamw'] / step_ms['AdamW']:.2f}x; load "
        f"{os.getloadavg()[0]:.1f}")
  prof = {}
  for n in opts:
    prof[n] = profile_steps(compiled[n], (cur[n], state[n], batch),
                            args.profile_steps, hlos[n])
  parts = sorted({p for v, _ in prof.values() for p in v},
                 key=lambda p: ([q for q, _ in PARTS] + [INPUTS, "dispatch"]
                                ).index(p)
                 if p in dict(PARTS) or p in (INPUTS, "dispatch") else 99)
  print(f"\n{'where the step goes (ms)':40} " + " ".join(
      f"{n:>11}" for n in prof))
  for p in parts:
    print(f"{p:40} " + " ".join(f"{v.get(p, 0.0):11.1f}"
                                for v, _ in prof.values()))
  print(f"{'sum of the parts':40} " + " ".join(
      f"{sum(v.values()):11.1f}" for v, _ in prof.values()))
  print(f"{'mean profiled step (timed)':40} " + " ".join(
      f"{m:11.1f}" for _, m in prof.values()))
  print(f"{'median step (not profiled)':40} " + " ".join(
      f"{step_ms[n]:11.1f}" for n in prof))
  print(f"load {os.getloadavg()[0]:.1f}")
  return dict(first_call=med, step_ms=step_ms, parts=prof, sizes=sizes)


if __name__ == "__main__":
  main(sys.argv[1:])
