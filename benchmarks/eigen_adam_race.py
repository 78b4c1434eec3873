"""Steps and seconds to AdamW's validation loss: ``kfac_soap`` settings.

On the char GPT of ``examples/char_gpt.py`` (every flag of it accepted
after ``--``), AdamW (``weight_decay=0.01``, constant rate, best of
``--adam-lrs`` after ``--steps`` steps) sets the target; each
``--config`` runs :func:`kfac_jax_lite.kfac_soap` (or ``kfac_adamw`` with
``kind=adamw``) on the same batches, alternating in chunks of
``--eval-every`` steps in one process, until it reaches the target or
``--max-steps``. Seconds are training seconds from each run's first call
(compile included), evaluation excluded.

A config is ``name:key=value,...`` with keys ``lr``, ``b1``, ``b2``,
``period`` (refresh), ``decay`` (factor EMA), ``rotate`` (0/1: carry the
second moments), ``frac`` (stats fraction), ``wd``, ``warmup`` (linear
warm-up steps), ``basis`` (``qr`` or ``eigh``: ``basis_update``),
``kind`` (``soap``, ``adamw`` for ``kfac_adamw``, or ``plain`` for
``optax.adamw`` itself, to time it beside the others).

Run::

  python benchmarks/eigen_adam_race.py --steps 600 --max-steps 400 \\
      --config base:lr=3e-3 --config p5:lr=3e-3,period=5
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "examples"))

import optax  # noqa: E402

import kfac_jax_lite  # noqa: E402

import char_gpt  # noqa: E402  pylint: disable=g-import-not-at-top

KEYS = {"lr": float, "b1": float, "b2": float, "period": int,
        "decay": float, "rotate": int, "frac": float, "wd": float,
        "warmup": int, "kind": str, "basis": str}


def parse_config(text: str) -> tuple:
  name, _, body = text.partition(":")
  cfg = {}
  for item in filter(None, body.split(",")):
    key, _, value = item.partition("=")
    if key not in KEYS:
      raise SystemExit(f"--config {text!r}: unknown key {key!r}; "
                       f"known: {sorted(KEYS)}")
    cfg[key] = KEYS[key](value)
  return name, cfg


def make_tx(cfg: dict, collection):
  lr = cfg.get("lr", 3e-3)
  if cfg.get("warmup"):
    lr = optax.linear_schedule(lr / cfg["warmup"], lr, cfg["warmup"])
  if cfg.get("kind", "soap") == "adamw":
    return kfac_jax_lite.kfac_adamw(lr, collection)
  if cfg.get("kind") == "plain":  # optax.adamw, for step times beside
    return optax.adamw(lr, weight_decay=0.01)
  keys = dict(b1="b1", b2="b2", period="refresh_period",
              decay="cov_ema_decay", frac="stats_fraction",
              wd="weight_decay", basis="basis_update")
  kw = {keys[k]: v for k, v in cfg.items() if k in keys}
  return kfac_jax_lite.kfac_soap(
      lr, collection, rotate_second_moments=bool(cfg.get("rotate", 0)),
      **kw)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--max-steps", type=int, default=400)
  p.add_argument("--adam-lrs", default="3e-3")
  p.add_argument("--config", action="append", default=[])
  p.add_argument("--target", type=float, default=None,
                 help="AdamW's loss from an earlier run (no AdamW runs)")
  args, rest = p.parse_known_args(argv)
  gpt = char_gpt.parse_args([a for a in rest if a != "--"])
  s = char_gpt.setup(gpt)
  adams = []
  for lr in map(float, args.adam_lrs.split(",") if args.target is None
                else ()):
    state, step = char_gpt.make_adamw_runner(s["loss_fn"], lr, s["params"])
    adams.append(char_gpt.Run(f"adamw{lr:g}", s["params"], state, step))
  cands = []
  for text in args.config:
    name, cfg = parse_config(text)
    state, step = char_gpt.make_runner(
        s["loss_fn"], make_tx(cfg, s["collection"]),
        None if cfg.get("kind") == "plain" else 1.0, s["params"])
    cands.append(char_gpt.Run(name, s["params"], state, step))
  runs = adams + cands
  for r in runs:
    r.curve.append((0, 0.0, s["eval_fn"](r.params)))
  target = float("-inf") if args.target is None else args.target
  while True:
    active = [r for r in adams if r.steps < args.steps] + [
        r for r in cands if r.steps < args.max_steps
        and r.curve[-1][2] > target]
    if not active:
      break
    for r in active:
      r.advance(s["batch_fn"], gpt.eval_every)
      r.curve.append((r.steps, r.seconds, s["eval_fn"](r.params)))
    if adams and all(a.steps >= args.steps for a in adams):
      target = min(a.curve[-1][2] for a in adams)
    print(" ".join(f"{r.name}@{r.steps}={r.curve[-1][2]:.3f}"
                   for r in active), flush=True)
  t_adam = float("nan")
  if adams:
    best = min(adams, key=lambda a: a.curve[-1][2])
    t_adam = best.seconds
    print(f"\ntarget: {best.name} {target:.4f} after {args.steps} steps "
          f"in {t_adam:.1f} s ({1e3 * char_gpt.median_step(best):.1f} "
          f"ms/step, first call {best.first_call:.2f} s)")
    print("curve: " + " ".join(f"{n}:{l:.3f}" for n, _, l in best.curve))
  out = {}
  for r in cands:
    n = char_gpt.steps_to_loss(r, target)
    t = char_gpt.seconds_to_loss(r, target)
    out[r.name] = (n, t)
    last = r.curve[-1]
    if n is None or t is None:
      print(f"{r.name:>12}: not reached in {r.steps} steps (valid "
            f"{last[2]:.4f}), {1e3 * char_gpt.median_step(r):.1f} ms/step")
    else:
      print(f"{r.name:>12}: step {n} = {n / args.steps:.2f}x steps, "
            f"{t:.1f} s = {t / t_adam:.2f}x AdamW's seconds; "
            f"{1e3 * char_gpt.median_step(r):.1f} ms/step, first call "
            f"{r.first_call:.2f} s")
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
