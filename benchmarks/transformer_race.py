"""K-FAC against the optimizers a transformer user would pick instead.

On the char GPT of ``examples/char_gpt.py`` (flax nnx) and the same model
written in plain Equinox (``examples/equinox_gpt.py``), both untagged,
each optimizer family runs at each rate of its grid:

* AdamW: ``optax.adamw(lr, weight_decay=0.01)`` at ``--adam-lrs``;
* Muon: ``optax.contrib.muon`` at ``--muon-lrs`` on the blocks' matrices
  (Newton-Schulz orthogonalised Nesterov momentum, ``beta=0.95``) with
  its Adam part (``--muon-adam-lr``) on everything else (embeddings,
  position table, head, biases, LayerNorms), as Jordan et al. run it;
  both parts with AdamW's decoupled decay 0.01;
* PSGD Kron: ``psgd_jax.kron`` (Li 2018; the ``psgd-jax`` package) at
  ``--psgd-lrs`` with ``b1=0.9`` and decay 0.01, when it imports (installed
  by hand for the race, never a dependency of the library; its 0.2.9
  imports ``optax._src.clipping``, which optax 0.2.8 moved: the race
  aliases that module and prints that it did); when it does not import or
  a step fails, the race says so and goes on without it;
* K-FAC: ``kfac_jax_lite.<name>(lr, collection)`` for each name of
  ``--kfac-transform`` (``kfac_adamw`` unless named) at ``--kfac-lrs``,
  every other setting the transform's default, given the whole batch as
  ``batch=``.

Every run starts from the same initialisation and sees the same batches;
the runs alternate in chunks of ``--eval-every`` steps in one process, so
load from other processes hits all of them. Seconds are training seconds
from each run's first call (trace and compile included), evaluation
excluded. The targets are the best AdamW's validation losses after
``--short`` and ``--long`` steps; a run reaches a target at its first
evaluation at or below it. Each family is represented by the rate of its
grid that reaches the target soonest; the table gives its steps and
seconds, the ratio to the best AdamW's seconds to the same loss, and marks
the fastest. Writes a Markdown table (``--markdown``) and a PNG of
validation loss against seconds (``--plot``).

Run::

  python benchmarks/transformer_race.py --smoke       # tiny, ~1 min
  python benchmarks/transformer_race.py --long 600    # the 600-step race
  python benchmarks/transformer_race.py               # 600 and 2000 steps
  python benchmarks/transformer_race.py --models equinox \\
      --kfac-transform kfac_adamw,OTHER --kfac-lrs 2e-3,3e-3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "examples"))
sys.path.insert(0, _HERE)

import jax  # noqa: E402
import optax  # noqa: E402

import kfac_jax_lite  # noqa: E402

import char_gpt  # noqa: E402  pylint: disable=g-import-not-at-top
import equinox_gpt  # noqa: E402  pylint: disable=g-import-not-at-top
import gpt_race  # noqa: E402  pylint: disable=g-import-not-at-top

MODELS = {"nnx": char_gpt.setup, "equinox": equinox_gpt.setup}
# Parameters Muon leaves to its Adam part besides the non-matrices: the
# token and position tables and the head (path substrings), per model; and
# each model's matrix layout (nnx kernels are [d_in, d_out], Equinox
# weights [d_out, d_in]).
MUON_ADAM_PATHS = ("tok", "pos", "head")
MUON_LAYOUT = {"nnx": optax.contrib.MuonDimensionNumbers(0, 1),
               "equinox": optax.contrib.MuonDimensionNumbers(1, 0)}
SMOKE = ["--width", "16", "--heads", "2", "--layers", "1", "--context", "8",
         "--batch-size", "4", "--eval-every", "5", "--eval-batches", "1"]


class Run(char_gpt.Run):
  """``char_gpt.Run`` labelled with its optimizer ``family`` ("AdamW",
  "Muon", ...), the unit the race compares."""

  def __init__(self, family: str, name: str, params, state, step: Callable):
    super().__init__(name, params, state, step)
    self.family = family


def _no_step(*args):
  """The step of a run read back from ``--curves``: it has none."""
  raise RuntimeError(f"a run loaded from --curves cannot advance (got "
                     f"{len(args)} arguments); rerun without --curves.")


def parse_args(argv: Optional[Sequence[str]]):
  p = argparse.ArgumentParser(
      description=(__doc__ or "").split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--models", default="nnx,equinox",
                 help=f"comma-separated, of {sorted(MODELS)}")
  p.add_argument("--short", type=int, default=600)
  p.add_argument("--long", type=int, default=2000)
  p.add_argument("--adam-lrs", default="1e-3,3e-3")
  p.add_argument("--muon-lrs", default="0.02,0.05")
  p.add_argument("--muon-adam-lr", type=float, default=3e-3,
                 help="the rate of Muon's Adam part")
  p.add_argument("--psgd-lrs", default="1e-3,3e-3")
  p.add_argument("--kfac-transform", default="kfac_adamw",
                 help="kfac_jax_lite transforms taking (lr, collection), "
                 "comma-separated; each races at every --kfac-lrs rate")
  p.add_argument("--kfac-lrs", default="2e-3")
  p.add_argument("--smoke", action="store_true",
                 help="a tiny model for 10 and 20 steps, one rate each")
  p.add_argument("--markdown", default="", help="write the tables here")
  p.add_argument("--curves", default="",
                 help="JSON of every run's curve, rewritten after every "
                 "chunk (what a stopped race leaves)")
  p.add_argument("--report", default="",
                 help="no race: the tables and plot of a --curves JSON "
                 "(of a stopped race too: --short/--long at steps it made)")
  p.add_argument("--plot", default="transformer_race.png",
                 help="PNG path ('' off)")
  args, rest = p.parse_known_args(argv)
  if args.smoke:
    args.short, args.long = 10, 20
    args.muon_lrs, args.psgd_lrs, args.kfac_lrs = "0.02", "1e-3", "2e-3"
    args.adam_lrs = "3e-3"
    rest = SMOKE + rest
  args.models = args.models.split(",")
  for m in args.models:
    if m not in MODELS:
      p.error(f"--models: unknown model {m!r}; pick from {sorted(MODELS)}")
  if not 1 <= args.short <= args.long:
    p.error(f"need 1 <= --short ({args.short}) <= --long ({args.long})")
  args.kfac_transform = args.kfac_transform.split(",")
  for name in args.kfac_transform:
    if not callable(getattr(kfac_jax_lite, name, None)):
      p.error(f"--kfac-transform {name!r} is not a function of "
              "kfac_jax_lite; name one such as kfac_adamw")
  for name in ("adam_lrs", "muon_lrs", "psgd_lrs", "kfac_lrs"):
    setattr(args, name, [float(x) for x in getattr(args, name).split(",")
                         if x])
  return args, gpt_race.char_gpt_args(p, args, rest)


# ---------------------------------------------------------- optimizers ----


def muon_dims(params, layout):
  """Muon's dimension numbers: ``layout`` for 2-d parameters outside
  :data:`MUON_ADAM_PATHS`, None (its Adam part) for the rest."""
  def spec(path, x):
    name = jax.tree_util.keystr(path)
    if x.ndim != 2 or any(k in name for k in MUON_ADAM_PATHS):
      return None
    return layout
  return jax.tree_util.tree_map_with_path(spec, params)


def muon(lr: float, adam_lr: float, layout) -> optax.GradientTransformation:
  """``optax.contrib.muon`` on the blocks' matrices, Adam on the rest."""
  return optax.contrib.muon(
      lr, weight_decay=0.01, adam_weight_decay=0.01,
      adam_learning_rate=adam_lr,
      muon_weight_dimension_numbers=lambda p: muon_dims(p, layout))


def _import_kron():
  """``psgd_jax.kron.kron``, or why it does not import. psgd-jax 0.2.9
  imports ``optax._src.clipping``, which newer optax moved to
  ``optax.transforms._clipping`` (it uses nothing from it); that one
  module is aliased, and the race prints that it was."""
  try:
    # Optional, not a dependency (the race says when it does not import).
    from psgd_jax.kron import kron  # pyright: ignore[reportMissingImports]
    return kron
  except ImportError as e:
    if "clipping" not in str(e):
      return f"psgd-jax does not import ({e})"
  import optax._src as _src  # pylint: disable=import-outside-toplevel
  from optax.transforms import _clipping  # pylint: disable=g-importing-member
  sys.modules["optax._src.clipping"] = _clipping
  # The alias psgd-jax's import needs: optax._src has no clipping now.
  _src.clipping = _clipping  # pyright: ignore[reportAttributeAccessIssue]
  print("psgd-jax: optax._src.clipping aliased to "
        "optax.transforms._clipping for its import", flush=True)
  try:
    from psgd_jax.kron import kron  # pyright: ignore[reportMissingImports]
    return kron
  except ImportError as e:
    return f"psgd-jax does not import ({e})"


def psgd_kron(lr: float):
  """``psgd_jax.kron`` at ``lr`` (its defaults otherwise), or why not."""
  kron = _import_kron()
  if isinstance(kron, str):
    return kron
  return kron(lr, b1=0.9, weight_decay=0.01)


def optimizers(args, model: str, collection) -> list:
  """``[(family, name, tx or reason, fraction)]``: every run of the race;
  ``fraction`` 1.0 passes ``batch=`` to the transform, None does not."""
  out = [("AdamW", f"adamw {lr:g}", char_gpt.adamw_transform(lr), None)
         for lr in args.adam_lrs]
  out += [("Muon", f"muon {lr:g}/{args.muon_adam_lr:g}",
           muon(lr, args.muon_adam_lr, MUON_LAYOUT[model]), None)
          for lr in args.muon_lrs]
  out += [("PSGD Kron", f"psgd {lr:g}", psgd_kron(lr), None)
          for lr in args.psgd_lrs]
  for name in args.kfac_transform:
    make = getattr(kfac_jax_lite, name)
    out += [(name, f"{name} {lr:g}", make(lr, collection), 1.0)
            for lr in args.kfac_lrs]
  return out


# ---------------------------------------------------------------- race ----


def save_curves(path: str, model: str, runs) -> None:
  """Adds ``model``'s runs (curve, step seconds) to the JSON at ``path``."""
  old = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
  old[model] = {r.name: dict(curve=r.curve, step_seconds=r.step_seconds,
                             load=os.getloadavg()) for r in runs}
  with open(path, "w", encoding="utf-8") as f:
    json.dump(old, f)


def race(runs, batch_fn, eval_fn, steps: int, every: int,
         save=lambda: None) -> dict:
  """``char_gpt.race`` that survives a run failing: alternates the runs in
  chunks of ``every`` steps up to ``steps``, calling ``save()`` after each
  round; a run whose step raises drops out. Returns ``{name: error}`` of
  the runs that failed."""
  failed = {}
  for r in runs:
    r.curve.append((0, 0.0, eval_fn(r.params)))
  active = list(runs)
  t0 = time.perf_counter()
  while active:
    for r in list(active):
      try:
        r.advance(batch_fn, min(every, steps - r.steps))
      except Exception as e:  # pylint: disable=broad-except
        failed[r.name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        active.remove(r)
        continue
      r.curve.append((r.steps, r.seconds, eval_fn(r.params)))
    save()
    if active:
      print(f"{time.perf_counter() - t0:6.0f}s "
            + char_gpt.progress(active, steps), flush=True)
    active = [r for r in active if r.steps < steps]
  return failed


def race_model(args, gpt, model: str) -> dict:
  """Sets up ``model``, races every optimizer on it; returns the results."""
  s = MODELS[model](gpt)
  generic = [l.name for l in s["collection"].layers if l.kind == "generic"]
  n = sum(x.size for x in jax.tree.leaves(s["params"]))
  print(f"\n=== {model}: {n / 1e6:.2f}M parameters, "
        f"{len(s['collection'].layers)} layers, generic: {generic or 'none'}",
        flush=True)
  runs, skipped = [], {}
  for family, name, tx, fraction in optimizers(args, model,
                                               s["collection"]):
    if isinstance(tx, str):
      skipped[name] = tx
      continue
    state, step = char_gpt.make_runner(s["loss_fn"], tx, fraction,
                                       s["params"])
    run = Run(family, name, s["params"], state, step)
    runs.append(run)
  save = ((lambda: save_curves(args.curves, model, runs)) if args.curves
          else (lambda: None))
  skipped.update(race(runs, s["batch_fn"], s["eval_fn"], args.long,
                      gpt.eval_every, save))
  runs = [r for r in runs if r.name not in skipped]
  return dict(model=model, params=n, generic=generic, runs=runs,
              skipped=skipped, **summarise(args, runs))


# ------------------------------------------------------------- results ----


def summarise(args, runs) -> dict:
  """Targets, and per family the best run to each target."""
  adams = [r for r in runs if r.family == "AdamW"]
  marks = sorted({args.short, args.long})
  targets = {}
  for n in marks:
    best = min(adams, key=lambda a, n=n: gpt_race.loss_at_step(a, n))
    targets[n] = dict(adam=best.name, loss=gpt_race.loss_at_step(best, n),
                      seconds=gpt_race.seconds_at_step(best, n),
                      first_call=best.first_call)
  families = {}
  for r in runs:
    families.setdefault(r.family, []).append(r)
  best = {}
  for family, members in families.items():
    for n, t in targets.items():
      timed = [(char_gpt.seconds_to_loss(r, t["loss"]), r) for r in members]
      hits = [(sec, r) for sec, r in timed if sec is not None]
      if not hits:
        best[family, n] = dict(run=None, seconds=None, steps=None,
                               ratio=None, warm=None)
        continue
      sec, r = min(hits, key=lambda h: h[0])
      best[family, n] = dict(
          run=r, seconds=sec, steps=char_gpt.steps_to_loss(r, t["loss"]),
          ratio=sec / t["seconds"],
          warm=(sec - r.first_call) / (t["seconds"] - t["first_call"]))
  fastest = {n: min((f for f in families if best[f, n]["seconds"]),
                    key=lambda f, n=n: best[f, n]["seconds"], default=None)
             for n in marks}
  return dict(targets=targets, best=best, fastest=fastest,
              families=list(families))


def _cell(b, adam_steps: int, bold: bool) -> str:
  """Steps (and their share of AdamW's), seconds and ratio to AdamW's."""
  if b["seconds"] is None:
    return "not reached | | | "
  ratio = f"**{b['ratio']:.2f}×**" if bold else f"{b['ratio']:.2f}×"
  return (f"{b['steps']} ({b['steps'] / adam_steps:.2f}×) | "
          f"{b['seconds']:.1f} | {ratio} | {b['warm']:.2f}×")


def markdown(args, res: dict) -> str:
  """The race table of one model, then every run's numbers."""
  marks = sorted(res["targets"])
  head = "| optimizer | " + " | ".join(
      f"steps to {n}-step loss | seconds | ratio | ratio, first calls "
      "left out" for n in marks) + " |"
  lines = [f"**{res['model']}**; "
           + "; ".join(f"AdamW's {n}-step loss {t['loss']:.4f} "
                       f"({t['adam']}, {t['seconds']:.1f} s)"
                       for n, t in res["targets"].items()),
           "", head, "|---|" + "---|---|---|---|" * len(marks)]
  for f in res["families"]:
    cells = []
    for n in marks:
      b = res["best"][f, n]
      cells.append(_cell(b, n, f == res["fastest"][n])
                   + (f" ({b['run'].name})" if b["run"] else ""))
    lines.append(f"| {f} | " + " | ".join(cells) + " |")
  for name, why in res["skipped"].items():
    lines.append(f"| {name} | did not run: {why} |")
  lines += ["", "| run | " + " | ".join(f"valid@{n}" for n in marks)
            + " | ms/step (median) | first call |", "|---|"
            + "---|" * (len(marks) + 2)]
  for r in res["runs"]:
    vals = " | ".join(f"{gpt_race.loss_at_step(r, n):.4f}"
                      if r.steps >= n else "-" for n in marks)
    lines.append(f"| {r.name} | {vals} | "
                 f"{1e3 * char_gpt.median_step(r):.1f} | "
                 f"{r.first_call:.2f} s |")
  fast = ", ".join(f"{n} steps: {res['fastest'][n]}" for n in marks)
  lines += ["", f"Fastest to AdamW's loss: {fast}."]
  return "\n".join(lines)


def plot(results: list, path: str) -> None:
  """Validation loss against seconds, a panel per model; dashed lines at
  AdamW's targets."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5),
                           squeeze=False)
  for ax, res in zip(axes[0], results):
    for r in res["runs"]:
      _, secs, losses = zip(*r.curve)
      ax.plot(secs, losses, label=r.name)
    for n, t in res["targets"].items():
      ax.axhline(t["loss"], ls="--", lw=0.8, color="gray")
      ax.annotate(f"AdamW @{n}", (0, t["loss"]), fontsize=7,
                  va="bottom", color="gray")
    ax.set_ylim(top=min(3.5, max(ax.get_ylim()[1], 2.0)))
    ax.set_title(f"{res['model']} GPT")
    ax.set_xlabel("training seconds (first call included)")
    ax.set_ylabel("validation loss (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def from_curves(args, path: str) -> list:
  """The results of every model in a ``--curves`` JSON."""
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  names = {"adamw": "AdamW", "muon": "Muon", "psgd": "PSGD Kron"}
  results = []
  for model, entries in saved.items():
    runs = []
    for name, e in entries.items():
      first = name.split()[0]
      r = Run(names[first] if first in names else first, name, None, None,
              _no_step)
      r.curve = [tuple(c) for c in e["curve"]]
      r.step_seconds = e["step_seconds"]
      r.first_call, r.steps = r.step_seconds[0], len(r.step_seconds)
      runs.append(r)
    results.append(dict(model=model, params=0, runs=runs, skipped={},
                        **summarise(args, runs)))
  return results


def main(argv: Optional[Sequence[str]] = None) -> list:
  args, gpt = parse_args(argv)
  if args.report:
    results = from_curves(args, args.report)
    print("\n\n".join(markdown(args, res) for res in results))
    if args.plot:
      plot(results, args.plot)
    return results
  print(f"jax {jax.__version__}, optax {optax.__version__} on "
        f"{jax.devices()[0].platform}; {gpt.batch_size}x{gpt.context} "
        f"characters a step; load average {os.getloadavg()}", flush=True)
  results, text = [], []
  for model in args.models:
    res = race_model(args, gpt, model)
    results.append(res)
    text.append(markdown(args, res))
    print("\n" + text[-1], flush=True)
    if args.markdown:
      with open(args.markdown, "w", encoding="utf-8") as f:
        f.write("\n\n".join(text) + "\n")
  print(f"load average {os.getloadavg()}")
  if args.plot:
    plot(results, args.plot)
    print(f"wrote {args.plot}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
