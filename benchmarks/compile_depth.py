"""Scan time and compile time against depth: kfac_jax_lite vs optax.adam.

Model: ``Dense(64)``, then ``depth`` residual blocks
``x + relu(LayerNorm(Dense(64)(x)))``, then ``Dense(10)``, untagged (every
layer is found by ``scan(..., auto_register=True)``). Two ways of writing
the blocks:

* ``unrolled``: a Python loop (one parameter leaf per block);
* ``nn.scan``: flax ``nn.scan`` over stacked parameters ``[depth, ...]``,
  which the scanner turns into stacked layers whose blocks are vmapped.

Columns: ``scan`` is one cold ``kfac_jax_lite.scan`` (trace + recognition;
``48 + 2`` dense and ``48`` scale-and-shift layers at depth 48, unrolled);
``adam``/``kfac compile`` the XLA compile of one jitted training step
(``jit(...).lower(...).compile()``, lowering included) in a fresh Python
process, as a user meets it: the median of ``--repeats`` processes of
each, alternating Adam and ``kfac``, with every compile listed below its
row (``--one-process`` compiles them all in this process instead: faster,
but a process that has already compiled large programs compiles the next
ones slower, which favours whichever comes later); ``step`` the median
time of a compiled step. Steps donate their params and state. Every
process pays its one-time warm-up first (``step_time.warm_up_process``:
JAX's and its LAPACK bindings' first-use costs, printed apart for this
one), and ``kfac``'s processes run ``scan`` before the timed compile.

``--gpt`` instead measures the char GPT of ``examples/char_gpt.py`` (its
defaults: D128, 4 heads, T64, B32) at ``--depths`` identical blocks
(default 4 and 12): the first call of AdamW's step and of
``kfac_adamw``'s, as the example jits them (trace, lowering, compile and
the first run, ``jax.stages``), each in a fresh process after its
warm-up, alternating; then how much each optimizer's first call grows
from the smallest depth to the largest, and K-FAC's growth against
AdamW's.

Usage:
  python benchmarks/compile_depth.py [--depths 3 12 48] [--batch 64]
      [--repeats 3]
  python benchmarks/compile_depth.py --gpt [--depths 4 12] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import kfac_jax_lite as kl
# benchmarks/ is this script's path:
from step_time import (blas_environment, cpu_model, run_child,
                       warm_up_process)


class _Block(nn.Module):

  @nn.compact
  def __call__(self, x, _=None):
    h = nn.LayerNorm()(nn.Dense(64)(x))
    return x + nn.relu(h), None


class Residual(nn.Module):
  depth: int
  stacked: bool

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(64)(x)
    if self.stacked:
      blocks = nn.scan(_Block, variable_axes={"params": 0},
                       split_rngs={"params": True}, length=self.depth)
      x, _ = blocks()(x, None)
    else:
      for _ in range(self.depth):
        x, _ = _Block()(x)
    return nn.Dense(10)(x)


def _problem(depth, stacked, batch):
  model = Residual(depth, stacked)
  x = jax.random.normal(jax.random.PRNGKey(0), (batch, 64))
  y = jnp.arange(batch) % 10
  params = model.init(jax.random.PRNGKey(1), x)

  def loss_fn(params, batch):
    logits = model.apply(params, batch[0])
    logits = kl.register_categorical_predictive_distribution(logits, batch[1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch[1][:, None], axis=-1))

  return loss_fn, params, (x, y)


def _timed(fn, repeat=1):
  times = []
  for _ in range(repeat):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
  return out, statistics.median(times)


def _step_fn(loss_fn, tx, collection):
  """Adam: ``jax.grad``; K-FAC (``collection`` given): the one forward pass
  of :func:`kl.value_grad_and_stats` for loss, gradient and statistics."""
  vgs = None if collection is None else kl.value_grad_and_stats(
      collection.loss_fn, collection)

  def step(params, state, batch):
    if vgs is not None:
      _, grads, stats = vgs(params, batch, jax.random.PRNGKey(0))
      updates, state = tx.update(grads, state, params, stats=stats)
    else:
      grads = jax.grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  # Donated, as a training loop should (and as step_time.py does): without
  # donation, state that a step passes through unchanged (K-FAC's cached
  # inverses between refreshes) cannot be the output buffer and XLA copies
  # it every step.
  return jax.jit(step, donate_argnums=(0, 1))


def setup_step(depth, stacked, batch, name):
  """``(step, (params, state, batch))``: a fresh jitted training step of
  ``name`` (``"adam"`` or ``"kfac"``, whose ``scan`` runs here) for the
  model, and its arguments (own copies of the params: the step donates
  them). A new closure: nothing of an earlier trace or compile is
  reused."""
  loss_fn, params, batch = _problem(depth, stacked, batch)
  if name == "adam":
    tx, collection = optax.adam(1e-3), None
  else:
    collection = kl.scan(loss_fn, params, batch, strict=True)
    tx = kl.kfac(1e-3, collection)
  params = jax.tree.map(jnp.copy, params)
  state = tx.init(params)
  return _step_fn(loss_fn, tx, collection), (params, state, batch)


def _step_time(compiled, params, state, batch, steps):
  params, state = compiled(params, state, batch)  # Warm up.
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    params, state = compiled(params, state, batch)
    jax.block_until_ready(params)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _one(depth, stacked, batch, name, steps):
  """One cold ``lower(...).compile()`` of :func:`setup_step`'s step
  (``scan`` runs first, untimed) and its median step time, in seconds."""
  step, (params, state, batch) = setup_step(depth, stacked, batch, name)
  compiled, t = _timed(lambda: step.lower(params, state, batch).compile())
  return t, _step_time(compiled, params, state, batch, steps)


def _fresh(depth, stacked, args, name):
  """:func:`_one` in a fresh Python process (after its warm-up), as a user
  meets the first compile of a step."""
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()),
         "--batch", str(args.batch), "--steps", str(args.steps),
         "--child", str(depth), str(int(stacked)), name]
  got = run_child(cmd, f"{name} at depth {depth}")
  return got["compile_s"], got["step_s"]


def _compare(depth, stacked, args):
  """Adam's and ``kfac``'s compile times, ``args.repeats`` of each
  alternating (Adam, kfac, Adam, kfac, ...), so that a load burst lands
  on either; each in a fresh process unless ``args.one_process``. Returns
  both lists and the last median step times."""
  times = {"adam": [], "kfac": []}
  steps = {}
  for _ in range(args.repeats):
    for name in ("adam", "kfac"):
      if args.one_process:
        t, steps[name] = _one(depth, stacked, args.batch, name, args.steps)
      else:
        t, steps[name] = _fresh(depth, stacked, args, name)
      times[name].append(t)
  return times["adam"], times["kfac"], steps["adam"], steps["kfac"]


def gpt_step(depth: int, name: str) -> tuple:
  """``(step, args)``: the char GPT's step of ``name`` (``"adamw"`` or
  ``"kfac"``) at ``depth`` blocks and its first arguments (not jitted)."""
  here = pathlib.Path(__file__).resolve().parent
  sys.path[:0] = [str(here.parent / "examples")]
  import char_gpt  # pylint: disable=import-outside-toplevel
  gpt = char_gpt.parse_args(["--layers", str(depth), "--plot", ""])
  s = char_gpt.setup(gpt)
  if name == "adamw":
    tx, fraction = char_gpt.adamw_transform(gpt.adam_lr), None
  else:
    tx, fraction = char_gpt.kfac_transform(s["collection"], gpt, gpt.seed)
  params, batch = s["params"], s["batch_fn"](0)
  return (char_gpt.make_step(s["loss_fn"], tx, fraction),
          (params, tx.init(params), batch))


def _gpt_first_call(depth: int, name: str) -> dict:
  """The first call of the char GPT's step at ``depth`` blocks (in this
  process): ``{"trace", "lower", "compile", "run"}`` seconds."""
  sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent)]
  import step_profile  # pylint: disable=import-outside-toplevel
  t, _, _ = step_profile.first_call(*gpt_step(depth, name))
  return dict(zip(("trace", "lower", "compile", "run"), t))


def gpt_depths(args) -> dict:
  """Prints the GPT's first calls at each depth and their growth."""
  calls = {(d, n): [] for d in args.depths for n in ("adamw", "kfac")}
  for _ in range(args.repeats):
    for d in args.depths:
      for n in ("adamw", "kfac"):
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()),
               "--gpt-child", str(d), n]
        calls[d, n].append(run_child(cmd, f"GPT {n} at depth {d}"))
  print(f"{'blocks':>6} {'optimizer':>10} {'trace':>6} {'lower':>6} "
        f"{'compile':>8} {'run':>6} {'first call':>10}  (median of "
        f"{args.repeats}; each)")
  total = {}
  for (d, n), runs in calls.items():
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    total[d, n] = statistics.median(sum(r.values()) for r in runs)
    print(f"{d:>6} {n:>10} {med['trace']:6.2f} {med['lower']:6.2f} "
          f"{med['compile']:8.2f} {med['run']:6.2f} {total[d, n]:10.2f}  "
          + ", ".join(f"{sum(r.values()):.2f}" for r in runs))
  lo, hi = min(args.depths), max(args.depths)
  grow = {n: total[hi, n] - total[lo, n] for n in ("adamw", "kfac")}
  print(f"growth from {lo} to {hi} blocks: AdamW {grow['adamw']:.2f} s, "
        f"kfac_adamw {grow['kfac']:.2f} s = "
        f"{grow['kfac'] / grow['adamw']:.2f}x AdamW's; first-call ratio "
        f"{total[lo, 'kfac'] / total[lo, 'adamw']:.2f}x at {lo}, "
        f"{total[hi, 'kfac'] / total[hi, 'adamw']:.2f}x at {hi}")
  return {"calls": calls, "growth": grow}


def main():
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  parser.add_argument("--depths", type=int, nargs="+", default=None)
  parser.add_argument("--gpt", action="store_true",
                      help="the char GPT at --depths blocks (default 4 12)")
  parser.add_argument("--gpt-child", nargs=2, help=argparse.SUPPRESS)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument(
      "--repeats", type=int, default=3,
      help="compiles of each step, alternating Adam and kfac; the table "
           "gives medians and the ratio of the medians (default 3)")
  parser.add_argument(
      "--one-process", action="store_true",
      help="compile every step in this process instead of one fresh "
           "process per compile (faster; a process that has already "
           "compiled large programs compiles the next ones slower)")
  parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.depths is None:
    args.depths = [4, 12] if args.gpt else [3, 12, 48]
  warm = warm_up_process()
  if args.gpt_child:
    print(json.dumps(_gpt_first_call(int(args.gpt_child[0]),
                                     args.gpt_child[1])))
    return
  if args.gpt:
    print(f"load {os.getloadavg()[0]:.1f}")
    gpt_depths(args)
    print(f"load {os.getloadavg()[0]:.1f}")
    return
  if args.child:
    depth, stacked, name = args.child
    t, step = _one(int(depth), bool(int(stacked)), args.batch, name,
                   args.steps)
    print(json.dumps({"compile_s": t, "step_s": step}))
    return
  print(f"one-time process warm-up, not in any compile time: JAX "
        f"{warm['jax']:.2f}s, LAPACK bindings {warm['lapack']:.2f}s, "
        f"first xᵀx {warm['gram']:.2f}s")
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.device_count()} device(s), {cpu_model()}\n"
        f"{blas_environment()}")
  header = (f"{'depth':>5}  {'blocks':<9} {'layers':>6} {'scan s':>7} "
            f"{'adam compile s':>14} {'kfac compile s':>14} {'ratio':>6} "
            f"{'adam step ms':>12} {'kfac step ms':>12}")
  print(header)
  print("-" * len(header))
  for depth in args.depths:
    for stacked in (False, True):
      loss_fn, params, batch = _problem(depth, stacked, args.batch)
      collection, t_scan = _timed(
          lambda: kl.scan(loss_fn, params, batch, strict=True))
      adam_cs, kfac_cs, adam_s, kfac_s = _compare(depth, stacked, args)
      adam_c, kfac_c = statistics.median(adam_cs), statistics.median(kfac_cs)
      print(f"{depth:>5}  {'nn.scan' if stacked else 'unrolled':<9} "
            f"{len(collection.layers):>6} {t_scan:>7.3f} "
            f"{adam_c:>14.2f} "
            f"{kfac_c:>14.2f} {kfac_c / adam_c:>6.1f} {1e3 * adam_s:>12.2f} "
            f"{1e3 * kfac_s:>12.2f}", flush=True)
      if args.repeats > 1:
        print(f"{'':>7}compiles (s): adam "
              f"{', '.join(f'{t:.2f}' for t in adam_cs)}; kfac "
              f"{', '.join(f'{t:.2f}' for t in kfac_cs)}; ratios "
              f"{', '.join(f'{k / a:.2f}' for a, k in zip(adam_cs, kfac_cs))}",
              flush=True)


if __name__ == "__main__":
  main()
