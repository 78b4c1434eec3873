"""Where XLA:CPU's compile of the char GPT's step goes, part by part.

XLA:CPU compiles a program in three stages: its HLO passes (fusion,
layout, ...), then every fusion becomes a kernel (``FusionCompiler``:
MLIR emitters, one module per kernel) and LLVM turns the kernels into
machine code (``JitCompiler``). Identical kernels are compiled once, so
the kernel count is that of the distinct fusions: same-shaped layers
share theirs, and each distinct shape of a part costs that part's kernels
again. This script counts the kernels of each part of the step and the
``FusionCompiler`` seconds they took, AdamW's step against
``kfac_adamw``'s, as ``benchmarks/compile_depth.py --gpt`` compiles them
(the char GPT of ``examples/char_gpt.py`` at its defaults).

Parts are the step's named scopes, read from each kernel's fusion in the
optimized HLO (``compiled.as_text()``, its ``op_name`` metadata), first
match wins:

* ``refresh``: ``kfac_refresh`` (the inverses' refresh, a ``lax.cond``
  branch);
* ``statistics pass``: ``kfac_pass`` (the sampled loss's forward and
  backward on the statistics' share of the batch);
* ``EMA``, ``preconditioning``, ``layer inputs``, ``finite check``:
  ``kfac_ema``, ``kfac_precondition``, ``kfac_inputs``, ``kfac_finite``;
* ``grafting norms``: ``jit(norm)`` under ``optimizer`` (the per-tensor
  norms of :func:`kfac_jax_lite.graft`);
* ``per-tensor optimizer``: the rest of ``optimizer`` (Adam's moments,
  the grafted product, weight decay, the skip of non-finite steps);
* ``apply_updates``, ``gradient`` (``loss_and_grad``: the model's
  forward and backward);
* ``unnamed``: kernels without metadata (layout copies XLA adds, e.g.
  around LAPACK's column-major calls, and broadcasts of constants).

Each optimizer's first call runs in a fresh process after
``step_time.warm_up_process``; the compile runs under ``jax.profiler``
(``compile_profile.compile_phases`` gives the phases). The event names
are XLA:CPU's internals, not a public contract.

Usage::

  python benchmarks/compile_parts.py [--depths 4 12] [--repeats 1]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

import jax

# benchmarks/ is this script's path.
import compile_depth  # isort: skip
import compile_profile as cp  # isort: skip
import step_time as st  # noqa: E402

PARTS = (("refresh", "kfac_refresh"), ("statistics pass", "kfac_pass"),
         ("EMA", "kfac_ema"), ("preconditioning", "kfac_precondition"),
         ("layer inputs", "kfac_inputs"), ("finite check", "kfac_finite"),
         ("grafting norms", "optimizer/jit(norm)"),
         ("per-tensor optimizer", "optimizer"),
         ("apply_updates", "apply_updates"), ("gradient", "loss_and_grad"))
UNNAMED = "unnamed"


def part_of(op_name: str) -> str:
  """The :data:`PARTS` entry of a fusion's ``op_name`` (scopes joined by
  ``/``, ``jit(step)`` first), or :data:`UNNAMED` for none."""
  if not op_name:
    return UNNAMED
  for part, scope in PARTS:
    if scope in op_name:
      return part
  return "other"


def _op_names(hlo: str) -> dict:
  """``{instruction name: op_name}`` of an optimized HLO module's text."""
  out = {}
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if m:
      op = re.search(r'op_name="([^"]*)"', line)
      out[m.group(1)] = op.group(1) if op else ""
  return out


def _kernel_name(module: str) -> str:
  """The fusion behind a ``FusionCompiler`` module name."""
  return re.sub(r"_kernel_module$", "",
                re.sub(r"^__compute_module_", "", module))


def kernel_parts(xplane: str, hlo: str) -> dict:
  """``{part: [kernels, FusionCompiler seconds]}`` of the longest compile
  in an ``.xplane.pb`` trace, whose optimized HLO text is ``hlo``."""
  names = _op_names(hlo)
  data = jax.profiler.ProfileData.from_file(xplane)
  out = collections.defaultdict(lambda: [0, 0.0])
  for plane in data.planes:
    for line in plane.lines:
      for ev in line.events:
        if ev.name.split(" (")[0] != cp.KERNEL_EVENT:
          continue
        module = dict(ev.stats).get("module", "")
        part = part_of(names.get(_kernel_name(str(module)), ""))
        out[part][0] += 1
        out[part][1] += ev.duration_ns * 1e-9
  return dict(out)


def child(depth: int, name: str) -> dict:
  """The first call of one step, its compile under the profiler."""
  st.warm_up_process()
  step, args = compile_depth.gpt_step(depth, name)
  t0 = time.perf_counter()
  lowered = jax.jit(step).trace(*args).lower()
  t1 = time.perf_counter()
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  with tempfile.TemporaryDirectory(prefix="compile_parts_") as log_dir:
    with jax.profiler.trace(log_dir, profiler_options=options):
      t2 = time.perf_counter()
      compiled = lowered.compile()
      t3 = time.perf_counter()
    xplane = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)[0]
    phases = cp.compile_phases(xplane)
    hlo = compiled.as_text()
    if hlo is None:
      raise RuntimeError(f"compiled.as_text() gave no HLO for {name} at "
                         f"{depth} blocks: its kernels cannot be named")
    parts = kernel_parts(xplane, hlo)
  t4 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  run = time.perf_counter() - t4
  return {"trace+lower": t1 - t0, "compile": t3 - t2, "run": run,
          "phases": phases, "parts": parts}


def _fresh(depth: int, name: str) -> dict:
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()),
         "--child", str(depth), name]
  return st.run_child(cmd, f"compile parts of {name} at {depth} blocks")


def _row(label: str, runs: list) -> str:
  """One markdown row: medians of the timings and the phases."""
  med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
  ph = lambda k: med(lambda r: r["phases"][k] or 0.0)  # noqa: E731
  return (f"| {label} | {med(lambda r: r['trace+lower']):.2f} | "
          f"{med(lambda r: r['compile']):.2f} | {ph('HLO passes'):.2f} | "
          f"{ph('emit'):.2f} | {ph('link'):.2f} | {ph('codegen'):.2f} | "
          f"{med(lambda r: r['run']):.2f} | "
          f"{med(lambda r: r['phases']['kernels'] or 0):.0f} |")


def report(calls: dict) -> list:
  """Markdown: the phases per step, then kernels and FusionCompiler
  seconds per part (medians over the runs)."""
  lines = ["| step | trace + lower s | XLA compile s | HLO passes | emit | "
           "link | codegen | first run | kernels |", "|---" * 9 + "|"]
  for (d, n), runs in calls.items():
    lines.append(_row(f"{n}, {d} blocks", runs))
  labels = [f"{n} {d}" for d, n in calls]
  lines += ["", "| part | " + " | ".join(labels) + " |",
            "|---" * (len(labels) + 1) + "|"]
  names = [p for p, _ in PARTS] + ["other", UNNAMED]
  for part in names:
    cells = []
    for runs in calls.values():
      got = [r["parts"].get(part, [0, 0.0]) for r in runs]
      cells.append(f"{statistics.median(g[0] for g in got):.0f} / "
                   f"{statistics.median(g[1] for g in got):.2f} s")
    if any(not c.startswith("0 /") for c in cells):
      lines.append(f"| {part} | " + " | ".join(cells) + " |")
  return lines


def main() -> None:
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--depths", type=int, nargs="+", default=[4, 12])
  p.add_argument("--repeats", type=int, default=1,
                 help="fresh processes per step (medians reported)")
  p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    print(json.dumps(child(int(args.child[0]), args.child[1])))
    return
  print(f"jax {jax.__version__}, {st.cpu_model()}; load "
        f"{os.getloadavg()[0]:.1f}; kernels / FusionCompiler seconds "
        "(summed over XLA's codegen threads)")
  calls = {(d, n): [] for d in args.depths for n in ("adamw", "kfac")}
  for _ in range(args.repeats):
    for key in calls:
      calls[key].append(_fresh(*key))
  print("\n".join(report(calls)))
  print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
