"""Where a first call's time goes: a ``jax.profiler`` trace of one step's
tracing, lowering and XLA:CPU compile, K-FAC against Adam.

Steps (each optimizer's own first call, in a fresh Python process after
``step_time.warm_up_process``, as in ``step_time.py``):

* ``mlp``: ``step_time.py``'s MLP; Adam and ``kfac`` at inverse period 5;
* ``autoencoder``: ``step_time.py``'s autoencoder; Adam, ``kfac`` at
  period 5 and ``kfac_optimizer`` at its defaults (period 10, a quarter of
  each batch for the curvature);
* ``residual``: ``compile_depth.py``'s residual MLP at ``--depth`` (48),
  unrolled; Adam and ``kfac``.

Each process times ``jit(step).trace(...)``, ``.lower()``, ``.compile()``
and the first execution apart, under ``jax.profiler.trace`` (host tracer
on, Python tracer off, so that tracing and lowering are not slowed), and
splits XLA's compile by the events of its compiler thread, which run one
after the other:

* ``HLO passes``: "HLO passes through layout assignment" and "HLO passes
  after layout assignment" (fusion, layout, copy insertion, ...);
* ``emit``: ``ThunkEmitter::EmitEntryComputation``: every fusion becomes
  a kernel (``FusionCompiler::Compile``, counted as ``kernels``);
* ``link``: ``ThunkEmitter::ConsumeKernels``: the kernels' modules are
  gathered for code generation;
* ``codegen``: ``JitCompiler::Compile``: LLVM compiles every kernel module
  to machine code (on XLA's codegen threads);
* ``other``: the rest of ``compile``, XLA's whole compile
  (``PjRtCpuClient::Compile``).

``run`` is the first execution (K-FAC's also refreshes its inverses, as
every first step does) and ``total`` the wall clock from the start of
tracing to the end of that run: the first call of ``step_time.py``.

The event names are XLA:CPU's internals, not a public contract: a phase
whose events a later XLA renames (or another backend does not emit)
prints as ``-`` and its time moves to ``other``. The table gives medians
over ``--repeats`` processes per optimizer (Adam and the K-FAC steps
alternate, so that a load burst lands on any of them), then each K-FAC
step's ratios to Adam's and the compile time per kernel.

Usage::

  python benchmarks/compile_profile.py                 # ~3 min, 2-core CPU
  python benchmarks/compile_profile.py --models mlp --repeats 5
"""

from __future__ import annotations

import argparse
import glob
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

# benchmarks/ is this script's path.
import step_time as st  # isort: skip

import jax  # noqa: E402

import compile_depth as cd  # noqa: E402

PHASES = (("HLO passes", ("HLO passes through layout assignment",
                          "HLO passes after layout assignment")),
          ("emit", ("ThunkEmitter::EmitEntryComputation",)),
          ("link", ("ThunkEmitter::ConsumeKernels",)),
          ("codegen", ("JitCompiler::Compile",)))
COMPILE_EVENT = "PjRtCpuClient::Compile"
KERNEL_EVENT = "FusionCompiler::Compile"

# (model, optimizer label) in table order; the label names the runner.
STEPS = {
    "mlp": ("optax.adam", "kfac, inverse every 5"),
    "autoencoder": ("optax.adam", "kfac, inverse every 5",
                    "kfac_optimizer, inverse every 10"),
    "residual": ("optax.adam", "kfac"),
}


def _step_time_step(model: str, label: str) -> tuple:
  """``(jitted step, its arguments)`` of ``step_time.py``'s runner
  ``label`` for ``model``, its state initialised (outside any timing)."""
  args = st.parse_args(["--periods", "5,10", "--stats-fractions", ""])
  problem, _, runners = st.model_runners(model, args)
  runner = {r.name: r for r in runners}[label]
  runner.prepare()
  return runner.step, (runner.params, runner.state, problem.batches[0],
                       jax.random.PRNGKey(0))


def compile_phases(xplane: str) -> dict:
  """Seconds per :data:`PHASES` entry, ``compile`` (the longest
  :data:`COMPILE_EVENT`: the step's) and the ``kernels`` count, from the
  events of an ``.xplane.pb`` trace that start within that compile."""
  data = jax.profiler.ProfileData.from_file(xplane)
  events = [ev for plane in data.planes for line in plane.lines
            for ev in line.events]
  # Phase names may carry the module's name: "... (jit_step)".
  base = lambda ev: ev.name.split(" (")[0]  # noqa: E731
  compiles = [ev for ev in events if base(ev) == COMPILE_EVENT]
  if not compiles:
    return {name: None for name, _ in PHASES} | {
        "compile": None, "kernels": None, "other": None}
  step = max(compiles, key=lambda ev: ev.duration_ns)
  start, end = step.start_ns, step.start_ns + step.duration_ns
  inside = [ev for ev in events if start <= ev.start_ns <= end]
  out = {}
  for name, names in PHASES:
    hits = [ev.duration_ns * 1e-9 for ev in inside if base(ev) in names]
    out[name] = sum(hits) if hits else None
  total = step.duration_ns * 1e-9
  out.update(compile=total,
             kernels=sum(base(ev) == KERNEL_EVENT for ev in inside) or None,
             other=total - sum(v for v in out.values() if v is not None))
  return out


def profile_first_call(step: Callable, args: tuple) -> dict:
  """Times trace, lower, compile and the first run of ``step(*args)``
  under the profiler; returns them with :func:`compile_phases`."""
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  with tempfile.TemporaryDirectory(prefix="compile_profile_") as log_dir:
    with jax.profiler.trace(log_dir, profiler_options=options):
      t0 = time.perf_counter()
      traced = step.trace(*args)
      t1 = time.perf_counter()
      lowered = traced.lower()
      t2 = time.perf_counter()
      compiled = lowered.compile()
      t3 = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      t4 = time.perf_counter()
    planes = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
    if not planes:
      raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {log_dir}")
    phases = compile_phases(planes[0])
  return {"trace": t1 - t0, "lower": t2 - t1, "compile_wall": t3 - t2,
          "run": t4 - t3, "total": t4 - t0, **phases}


def _child(model: str, label: str, args) -> None:
  st.warm_up_process()
  if model == "residual":
    step, step_args = cd.setup_step(
        args.depth, False, args.batch,
        "adam" if label == "optax.adam" else "kfac")
  else:
    step, step_args = _step_time_step(model, label)
  print(json.dumps(profile_first_call(step, step_args)))


def fresh(model: str, label: str, args) -> dict:
  """:func:`profile_first_call` of one step in a fresh Python process."""
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()),
         "--depth", str(args.depth), "--batch", str(args.batch),
         "--child", model, label]
  return st.run_child(cmd, f"profile of {model} / {label}")


COLUMNS = ("trace", "lower", "HLO passes", "emit", "link", "codegen",
           "other", "compile", "run", "total", "kernels")


def _median(rows: list, key: str):
  vals = [r[key] for r in rows if r.get(key) is not None]
  return statistics.median(vals) if vals else None


def _ratio(value: Optional[float], base: Optional[float]) -> str:
  """``value / base`` as ``"2.0x"``; ``"-"`` where either is missing."""
  return "-" if not base or value is None else f"{value / base:.1f}x"


def table(results: dict) -> list:
  """Markdown lines: one row of medians per optimizer, then each K-FAC
  step's ratios to Adam's, then the compile milliseconds per kernel."""
  rows = {label: {c: _median(rs, c) for c in COLUMNS}
          for label, rs in results.items()}
  base = rows["optax.adam"]
  cells = {}
  for label, m in rows.items():
    cells[label] = ["-" if m[c] is None else
                    f"{m[c]:.0f}" if c == "kernels" else f"{m[c]:.2f}"
                    for c in COLUMNS]
  for label, m in rows.items():
    if label != "optax.adam":
      cells[f"{label} / adam"] = [_ratio(m[c], base[c]) for c in COLUMNS]
  width = max(len(k) for k in cells)
  widths = [max(len(c), 5) for c in COLUMNS]
  lines = ["| " + "optimizer".ljust(width) + " | " + " | ".join(
      c.rjust(w) for c, w in zip(COLUMNS, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in [width] + widths) + "|"]
  for label, row in cells.items():
    lines.append("| " + label.ljust(width) + " | " + " | ".join(
        v.rjust(w) for v, w in zip(row, widths)) + " |")
  lines.append("")
  for label, m in rows.items():
    emit, link, codegen, kernels = (
        m[c] for c in ("emit", "link", "codegen", "kernels"))
    if (kernels and emit is not None and link is not None
        and codegen is not None):
      per = 1e3 * (emit + link + codegen) / kernels
      lines.append(f"- {label}: emit + link + codegen {per:.1f} ms per "
                   f"kernel ({kernels:.0f} kernels)")
  return lines


def main(argv: Optional[Sequence[str]] = None) -> dict:
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--models", default="mlp,autoencoder,residual",
                 help="comma-separated: mlp, autoencoder, residual")
  p.add_argument("--repeats", type=int, default=3,
                 help="fresh processes per optimizer (medians reported)")
  p.add_argument("--depth", type=int, default=48,
                 help="residual blocks of the residual model")
  p.add_argument("--batch", type=int, default=64,
                 help="batch of the residual model")
  p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats {args.repeats}: give at least 1 process per "
            "optimizer")
  if args.child:
    _child(args.child[0], args.child[1], args)
    return {}
  models = args.models.split(",")
  unknown = set(models) - set(STEPS)
  if unknown:
    p.error(f"unknown --models {sorted(unknown)}; use "
            f"{', '.join(STEPS)}")
  print(f"jax {jax.__version__}, {jax.default_backend()}, "
        f"{st.cpu_model()}; seconds, medians of {args.repeats} fresh "
        f"processes per optimizer\n{st.blas_environment()}")
  out = {}
  for model in models:
    results = {label: [] for label in STEPS[model]}
    for i in range(args.repeats):
      for label in STEPS[model]:
        r = fresh(model, label, args)
        results[label].append(r)
        print(f"  [{model} {i + 1}/{args.repeats}] {label}: trace "
              f"{r['trace']:.2f}s lower {r['lower']:.2f}s compile "
              f"{r['compile_wall']:.2f}s run {r['run']:.2f}s", flush=True)
    name = (f"residual MLP, depth {args.depth}, unrolled, batch {args.batch}"
            if model == "residual" else model)
    print(f"\n## {name}\n")
    print("\n".join(table(results)) + "\n", flush=True)
    out[model] = results
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
