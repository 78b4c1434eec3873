"""Where XLA:CPU's compile of the char GPT's step goes, by source scope.

For AdamW's step and K-FAC's (``kfac_adamw``, as ``examples/char_gpt.py``
runs them), a child process compiles the jitted step with XLA's VLOG on
(``TF_CPP_MAX_VLOG_LEVEL=1``), which logs the code-generation seconds of
every kernel module ("Compiled LLVM module: <kernel> time: ..."). Each
kernel is attributed to the JAX scope (``op_name``) of the HLO
instruction it was emitted for, in the compiled module's text, and the
seconds are summed by part:

* ``refresh``: kernels inside the refresh's ``lax.cond`` branch;
* ``K-FAC scopes``: ``kfac_stats``, ``kfac_ema``, ``kfac_merge``, ... (the
  statistics' outer products, the EMA, the product's merge);
* ``model passes``: ``jvp`` / ``transpose(jvp)``: the loss and gradient,
  and K-FAC's statistics pass (a second forward and sampled backward);
* ``optimizer tail``: every other scope of the step (the optax chain:
  Adam's moments, or grafting, momentum, decay; ``apply_updates``);
* ``unmapped``: kernels XLA added (copies, broadcasts) with no scope.

It also counts the fusions XLA:CPU did not compile because an identical
kernel was already compiled ("Reusing kernel" in its log).

The kernel seconds are summed over XLA's code-generation threads, so they
exceed the wall-clock ``compile`` (also printed). The log lines are
XLA:CPU internals, not a public contract: a later XLA may print them
differently (the script then finds no kernels).

Usage::

  python benchmarks/gpt_compile_scopes.py          # ~1 min, 2-core CPU
  python benchmarks/gpt_compile_scopes.py --layers 2
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

PARTS = ("refresh", "K-FAC scopes", "model passes", "optimizer tail",
         "unmapped")


def part_of(op_name) -> str:
  """The part of a kernel whose instruction has scope ``op_name``."""
  if op_name is None:
    return "unmapped"
  if "/cond/branch" in op_name:
    return "refresh"
  if "/kfac_" in op_name:
    return "K-FAC scopes"
  if "jvp(" in op_name:
    return "model passes"
  return "optimizer tail"


def kernel_seconds(log: str) -> dict:
  """``{kernel instruction name: seconds}`` from XLA's VLOG output."""
  out = collections.defaultdict(float)
  scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
  for m in re.finditer(r"Compiled (?:LLVM|MLIR) module: (\S+) time: "
                       r"([0-9.]+) ?(s|ms|us)\b", log):
    name = re.sub(r"^(__compute_module_)+", "", m.group(1))
    out[re.sub(r"_kernel_module$", "", name)] += (
        float(m.group(2)) * scale[m.group(3)])
  return out


def op_names(hlo: str) -> dict:
  """``{instruction name: op_name}`` of the compiled HLO text."""
  out = {}
  pattern = r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\""
  for m in re.finditer(pattern, hlo, re.M):
    out.setdefault(m.group(1), m.group(2))
  return out


def child(which: str, argv, hlo_path: str) -> None:
  """Compiles one step (in the child process) and writes its HLO."""
  sys.path[:0] = [os.path.join(HERE, "..", "examples")]
  import jax  # pylint: disable=import-outside-toplevel
  import char_gpt  # pylint: disable=import-outside-toplevel
  args = char_gpt.parse_args(list(argv) + ["--plot", ""])
  s = char_gpt.setup(args)
  params, batch = s["params"], s["batch_fn"](0)
  if which == "adamw":
    tx, fraction = char_gpt.adamw_transform(args.adam_lr), None
  else:
    tx, fraction = char_gpt.kfac_transform(s["collection"], args, args.seed)
  # The step the example's runners jit.
  step = jax.jit(char_gpt.make_step(s["loss_fn"], tx, fraction))
  lowered = step.lower(params, tx.init(params), batch)
  print("COMPILE START", flush=True)
  t0 = time.perf_counter()
  compiled = lowered.compile()
  print(f"COMPILE SECONDS {time.perf_counter() - t0:.3f}", flush=True)
  hlo = compiled.as_text()
  if hlo is None:
    raise RuntimeError(f"which={which!r}: the compiled step has no HLO "
                       f"text on {jax.default_backend()}; run on CPU.")
  with open(hlo_path, "w", encoding="utf-8") as f:
    f.write(hlo)


def measure(which: str, argv) -> tuple:
  """``(compile wall seconds, {part: (seconds, kernels)})``."""
  with tempfile.TemporaryDirectory() as tmp:
    hlo_path = os.path.join(tmp, "step.hlo")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_MAX_VLOG_LEVEL="1")
    proc = subprocess.run(
        [sys.executable, __file__, "--child", which, hlo_path, *argv],
        env=env, capture_output=True, text=True, check=True)
    log = proc.stdout + proc.stderr
    log = log.split("COMPILE START", 1)[-1]
    seconds = re.search(r"COMPILE SECONDS ([0-9.]+)", log)
    if seconds is None:
      raise RuntimeError(f"which={which!r}: the child printed no COMPILE "
                         f"SECONDS line; its output ends:\n{log[-2000:]}")
    wall = float(seconds.group(1))
    with open(hlo_path, encoding="utf-8") as f:
      names = op_names(f.read())
  parts = {p: [0.0, 0] for p in PARTS}
  for kernel, seconds in kernel_seconds(log).items():
    entry = parts[part_of(names.get(kernel))]
    entry[0] += seconds
    entry[1] += 1
  parts["reused kernels"] = [0.0, log.count("Reusing kernel")]
  return wall, parts


def main(argv) -> dict:
  results = {w: measure(w, argv) for w in ("adamw", "kfac")}
  print(f"{'part':16} " + " ".join(f"{w + ' s':>9} {'kernels':>7}"
                                   for w in results))
  for p in PARTS:
    print(f"{p:16} " + " ".join(
        f"{r[1][p][0]:9.2f} {r[1][p][1]:7d}" for r in results.values()))
  print(f"{'sum of kernels':16} " + " ".join(
      f"{sum(r[1][p][0] for p in PARTS):9.2f} "
      f"{sum(r[1][p][1] for p in PARTS):7d}" for r in results.values()))
  print(f"{'reused kernels':16} " + " ".join(
      f"{'':9} {r[1]['reused kernels'][1]:7d}" for r in results.values()))
  print(f"{'compile (wall)':16} " + " ".join(
      f"{r[0]:9.2f} {'':7}" for r in results.values()))
  return results


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    child(sys.argv[2], sys.argv[4:], sys.argv[3])
  else:
    main(sys.argv[1:])
