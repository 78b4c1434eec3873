"""Step time with another Python thread busy on the GIL, side by side.

A training loop queues its steps and waits for the last one; meanwhile a
second Python thread (a data loader, a logger) keeps the GIL busy. A
compiled step that runs no Python does not need the GIL and should not
notice, beyond the CPU the thread takes; a step whose program calls
Python (a host callback, a ctypes handler) waits for the GIL each time it
does.

The second thread does one of:

* ``spin``: a pure-Python loop (the GIL and one core);
* ``hold``: C calls that keep the GIL while they sleep 2 ms (the GIL and
  no core: what a step waits for is the GIL alone).

Rows: ``optax.adam`` and ``kfac`` (the step of ``benchmarks/step_time.py``
on its ``784-512-512-10`` MLP, batch 256) at ``--period``; with
``--before REV`` also ``kfac`` whose refresh is wrapped by
``kfac_jax_lite/_blas_threads.py`` as it was at git revision ``REV``
(``1df8dff``: thread-count handlers in Python, called from the compiled
step), loaded from git into this process, so that both versions are
timed interleaved, under the same load; with ``--unlimited`` also
``kfac`` timed with the LAPACK library at the thread count it had before
``kfac_jax_lite`` set it to one (what the limit saves).

Run from the repository root::

  python benchmarks/gil_contention.py --before 1df8dff --unlimited
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import step_time as st  # noqa: E402

import kfac_jax_lite  # noqa: E402
from kfac_jax_lite import _blas_threads  # noqa: E402
from kfac_jax_lite import estimator as estimator_lib  # noqa: E402

MODES = ("alone", "spin", "hold")
UNLIMITED = "kfac, LAPACK threads not limited"


def load_module_at(rev: str):
  """``kfac_jax_lite/_blas_threads.py`` at git revision ``rev``, as a
  module of its own."""
  source = subprocess.run(
      ["git", "show", f"{rev}:kfac_jax_lite/_blas_threads.py"],
      cwd=st.ROOT, check=True, capture_output=True, text=True).stdout
  path = os.path.join(tempfile.mkdtemp(), f"blas_threads_{rev}.py")
  with open(path, "w", encoding="utf-8") as f:
    f.write(source)
  spec = importlib.util.spec_from_file_location(f"blas_threads_{rev}", path)
  if spec is None or spec.loader is None:
    raise ImportError(f"rev={rev!r}: {path} (its _blas_threads.py) is not "
                      "an importable Python file.")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class Busy:
  """A daemon thread keeping the GIL busy in ``mode`` while enabled."""

  def __init__(self):
    self.mode, self.on = "alone", threading.Event()
    self.sleep = ctypes.PyDLL(None).usleep  # PyDLL: keeps the GIL.
    threading.Thread(target=self._loop, daemon=True).start()

  def _loop(self):
    while True:
      self.on.wait()
      if self.mode == "spin":
        x = 0
        for i in range(10_000):
          x += i
      else:
        self.sleep(2000)

  def set(self, mode: str) -> None:
    self.mode = mode
    (self.on.clear if mode == "alone" else self.on.set)()
    time.sleep(0.05)


def estimator_class(module):
  """FisherEstimator whose refresh is wrapped by ``module.limited`` (the
  current class's when ``module`` is None)."""
  cls = estimator_lib.FisherEstimator
  if module is None:
    return cls
  return type("FisherEstimatorBefore", (cls,), {
      "update_cache": module.limited(cls.update_cache.__wrapped__)})


def runners(problem, collection, period: int, before,
            unlimited: bool) -> list:
  tx = optax.adam(1e-3)
  out = [st.Runner("optax.adam", lambda: st.adam_step(problem.loss_fn, tx),
                   tx, problem.params, problem.batches)]
  versions = [("kfac", None)] + ([(f"kfac, handlers of {before[0]}",
                                   before[1])] if before else []) + (
                                       [(UNLIMITED, None)] if unlimited
                                       else [])
  for name, module in versions:
    est = estimator_class(module)(collection, damping=0.0, exps=(-1,))
    tx = kfac_jax_lite.kfac(1e-2, collection, damping=1e-3,
                            inverse_update_period=period, estimator=est)
    out.append(st.Runner(
        f"{name}, inverse every {period}",
        lambda tx=tx: st.kfac_step(problem.loss_fn, tx, collection),
        tx, problem.params, problem.batches))
  return out


def timed(r, steps: int) -> float:
  """Seconds per step of ``steps`` queued steps, waited for at the end;
  the :data:`UNLIMITED` row with the LAPACK library at its own count."""
  r.prepare()
  applied, control = _blas_threads.applied, _blas_threads.thread_control()
  if control and applied and applied["before"]:
    control[1](applied["before"] if r.name.startswith(UNLIMITED)
               else applied["after"])
  t0 = time.perf_counter()
  for _ in range(steps):
    batch = r.batches[r.count % len(r.batches)]
    r.params, r.state, loss = r.step(r.params, r.state, batch,
                                     jax.random.fold_in(r.key, r.count))
    r.count += 1
  loss.block_until_ready()
  return (time.perf_counter() - t0) / steps


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
  p.add_argument("--period", type=int, default=5)
  p.add_argument("--rounds", type=int, default=8)
  p.add_argument("--before", default="",
                 help="git revision whose _blas_threads wraps a second "
                 "kfac row (1df8dff: handlers in the step)")
  p.add_argument("--unlimited", action="store_true",
                 help="add a kfac row with LAPACK at its own thread count")
  args = p.parse_args(argv)
  st.warm_up_process()
  problem = st.mlp_problem(256)
  collection = kfac_jax_lite.scan(problem.loss_fn, problem.params,
                                  problem.batches[0])
  before = (args.before, load_module_at(args.before)) if args.before else None
  rows = runners(problem, collection, args.period, before,
                 args.unlimited)
  busy, times = Busy(), {}
  load = [os.getloadavg()[0]]
  for r in rows:
    timed(r, 2 * args.period)  # Warm-up.
  for i in range(args.rounds):  # The modes' order rotates: a load trend
    for mode in MODES[i % 3:] + MODES[:i % 3]:  # hits each alike.
      busy.set(mode)
      for r in rows:
        times.setdefault((r.name, mode), []).append(
            timed(r, 2 * args.period))
  busy.set("alone")
  timed(rows[0], 1)  # Adam's row: the LAPACK library back at the limit.
  load.append(os.getloadavg()[0])
  print(f"{problem.name}; {args.rounds} rounds of {2 * args.period} queued "
        f"steps per optimizer and mode, interleaved; median ms per step "
        f"(ratio to alone); load {load[0]:.1f} before, {load[1]:.1f} after; "
        f"{os.cpu_count()} CPUs; {st.blas_environment()}\n")
  print("| optimizer | alone | spinning thread | GIL-holding thread |")
  print("|---|---|---|---|")
  for r in rows:
    alone = statistics.median(times[(r.name, "alone")])
    cells = [f"{alone * 1e3:.2f} ms"]
    for mode in MODES[1:]:
      t = statistics.median(times[(r.name, mode)])
      cells.append(f"{t * 1e3:.2f} ms ({t / alone:.2f}x)")
    print(f"| {r.name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
