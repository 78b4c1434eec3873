"""Where ``kl.kfac``'s step goes, against Adam's, on the defaults' models.

The models, data and steps of ``benchmarks/kfac_defaults.py`` (the
Equinox conv autoencoder, the README's MNIST autoencoder, the flax CNN
classifier). For each, in one process: ``optax.adam``, ``kl.kfac`` with no
refresh after the first step (``inverse_update_period`` huge, no warm-up:
the step between refreshes) and ``kl.kfac`` refreshing at every step. Per
optimizer it prints the first call (trace, lower, compile, one run) and
the mean of ``--steps`` profiled steps split into parts by JAX scope, as
``benchmarks/step_profile.py`` attributes a ``jax.profiler`` trace
(kernels share each instant, gaps go to the next kernel). The steps are
the examples' own, so the loss, gradient and the statistics' forward and
sampled backward passes are "outside the step" (the library's scopes are
named: outer products, EMA, refresh, preconditioning); the second
``kfac`` row's refresh part is what one refresh costs.

  python benchmarks/kfac_step_parts.py
  python benchmarks/kfac_step_parts.py --models flax_cnn --steps 20
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import jax
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import kfac_defaults  # noqa: E402
import step_profile  # noqa: E402

import kfac_jax_lite as kl  # noqa: E402

NEVER = 10 ** 9
OPTIMIZERS = {
    "adam": None,
    "kfac, no refresh": dict(inverse_update_period=NEVER,
                             inverse_update_warmup=0),
    "kfac, refresh every step": dict(inverse_update_period=1,
                                     inverse_update_warmup=0),
}


def profile_model(name, steps, seed=0):
  """``{optimizer: (first call seconds, mean step ms, {part: ms})}``."""
  model, to_params, collection, (make_step, batches) = getattr(
      kfac_defaults, name)(kfac_defaults.BATCH_SIZES[name], 2, seed)
  key = jax.random.PRNGKey(seed)
  out = {}
  for label, options in OPTIMIZERS.items():
    kfac = options is not None
    tx = kl.kfac(1e-3, collection, **options) if kfac else optax.adam(1e-3)
    inner = make_step(tx, kfac)
    step = lambda p, s, b, inner=inner: inner(p, s, b, key)  # noqa: E731
    args = (model, tx.init(to_params(model)), batches[0])
    times, compiled, res = step_profile.first_call(step, args)
    hlo = step_profile.parse_hlo(compiled.as_text())
    args = (res[0], res[1], batches[1])
    for _ in range(3):  # Past the first step's refresh.
      args = (*jax.block_until_ready(compiled(*args))[:2], batches[1])
    parts, mean = step_profile.profile_steps(compiled, args, steps, hlo)
    out[label] = (sum(times), mean, parts)
  return out


def print_parts(name, out):
  adam = out["adam"][1]
  print(f"\n{name} (batch {kfac_defaults.BATCH_SIZES[name]}; load "
        f"{os.getloadavg()[0]:.1f})")
  for label, (first, mean, parts) in out.items():
    print(f"  {label}: first call {first:.2f} s, step {mean:.1f} ms "
          f"({mean / adam:.2f}x Adam's)")
    for part, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
      if ms >= 0.5:  # step_profile's GPT refreshes every 10th step.
        part = part.replace(" (every 10th step)", "")
        print(f"    {part:40s} {ms:7.1f} ms")


def main(argv=None):
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  p.add_argument("--models", default=",".join(kfac_defaults.MODELS))
  p.add_argument("--steps", type=int, default=10)
  args = p.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPUs", flush=True)
  for name in args.models.split(","):
    print_parts(name, profile_model(name, args.steps))


if __name__ == "__main__":
  main(sys.argv[1:])
