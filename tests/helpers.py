"""Small models and explicit reference computations shared by the tests.

The named problems built from these live in ``tests/problems.py``.
"""

import contextlib
import importlib.util
import pathlib
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl

ROOT = pathlib.Path(__file__).resolve().parents[1]


def replica_devices(n):
  """``n`` devices for a data-parallel test.

  The default backend's first ``n``; where it has fewer (a machine with
  one GPU), ``n`` of the CPU devices ``tests/conftest.py`` simulates. Skips
  the test, naming both counts, where neither has ``n``.
  """
  devices = jax.devices()
  if len(devices) >= n:
    return devices[:n]
  try:
    cpus = jax.devices("cpu")
  except RuntimeError:  # JAX_PLATFORMS without the CPU.
    cpus = []
  if len(cpus) < n:
    pytest.skip(f"needs {n} devices: JAX's default backend "
                f"({jax.default_backend()}) has {len(devices)}, the CPU "
                f"{len(cpus)} (tests/conftest.py asks XLA for 4)")
  return cpus[:n]


@contextlib.contextmanager
def on_replica_devices(n):
  """Runs the block with :func:`replica_devices` ``(n)`` (yielded).

  Where those are CPU devices beside an accelerator, new arrays, eager ops
  and ``jit`` go to the first of them too (``jax.default_device``): the
  one-device reference and the data-parallel run then compute on the same
  platform, and ``pmap(..., devices=...)`` gets arrays it can take.
  """
  devices = replica_devices(n)
  if devices[0] in jax.devices():
    yield devices
  else:
    with jax.default_device(devices[0]):
      yield devices


def load_example(name):
  """Imports ``examples/<name>.py`` as a module (examples is no package)."""
  path = ROOT / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"example_{name}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses (flax modules) look it up.
  spec.loader.exec_module(module)
  return module


def mlp_params(key, sizes, bias=True):
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, k = jax.random.split(key)
    layer = {"w": jax.random.normal(k, (a, b)) / np.sqrt(a)}
    if bias:
      layer["b"] = 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (b,))
    params[f"layer{i}"] = layer
  return params


def mlp_forward(params, x, tag=True, act=jnp.tanh):
  """Returns (logits, [(inputs, pre-activations)] per layer)."""
  n = len(params)
  trace = []
  for i in range(n):
    p = params[f"layer{i}"]
    s = x @ p["w"] + (p["b"] if "b" in p else 0.0)
    if tag:
      s = kl.register_dense(s, x, p["w"], p.get("b"))
    trace.append((x, s))
    x = act(s) if i < n - 1 else s
  return x, trace


def classifier_loss(params, batch):
  x, y = batch
  logits, _ = mlp_forward(params, x)
  kl.register_categorical_predictive_distribution(logits, y)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def classification_batch(key, n, d, classes):
  kx, ky = jax.random.split(key)
  return (jax.random.normal(kx, (n, d)),
          jax.random.randint(ky, (n,), 0, classes))


def per_example_preactivation_grads(loss_fn_single, params, batch):
  """∂ℓ_b/∂s_b for every layer: the gradient of example b's own loss.

  ``loss_fn_single(params, x_b, y_b, perturbations)`` is the loss of one
  example with additive perturbations at each layer's pre-activation.
  """
  x, y = batch

  def one(xb, yb):
    eps0 = loss_fn_single(params, xb, yb, None)
    return jax.grad(lambda e: loss_fn_single(params, xb, yb, e))(eps0)

  return jax.vmap(one)(x, y)


def with_bias_column(x):
  return np.concatenate([x, np.ones((x.shape[0], 1), x.dtype)], axis=1)


def assert_trees_close(a, b, rtol):
  """``‖a − b‖ ≤ rtol · ‖b‖`` per leaf (robust to round-off near zero)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert x.shape == y.shape
    err, ref = np.linalg.norm(x - y), np.linalg.norm(y)
    assert err <= rtol * ref, f"relative error {err / ref:.3g} > {rtol}"


def sub_jaxprs(eqn):
  """The jaxprs in an equation's params (what
  ``jax.extend.core.jaxprs_in_params`` gives from jax 0.10 on)."""
  for p in eqn.params.values():
    for sub in p if isinstance(p, (tuple, list)) else (p,):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        yield inner


def count_primitive(jaxpr, primitive, scope="", *, outside=None,
                    not_into=(), within=(), shapes=None,
                    _entered=False, _outer="") -> int:
  """``primitive`` equations of ``jaxpr`` (recursively, into sub-jaxprs)
  under ``jax.named_scope(scope)`` (any scope by default); with
  ``outside`` (a scope or a tuple of them), only those under none of
  them. Sub-jaxprs of the primitives named in ``not_into`` are not
  entered. With ``within`` (primitive names), only equations inside a
  sub-jaxpr of one of them count (e.g. ``("cond",)``: inside a branch);
  with ``shapes`` (a set of shapes), only those whose first output has
  one of them. A sub-jaxpr's equations are under the scopes of the
  equation holding it too (a cond branch's name stacks start afresh)."""
  outside = (outside,) if isinstance(outside, str) else outside or ()
  counted = _entered or not within
  n = 0
  for eqn in jaxpr.eqns:
    stack = f"{_outer}/{eqn.source_info.name_stack}"
    if (eqn.primitive.name == primitive and counted and scope in stack
        and not any(o in stack for o in outside)
        and (shapes is None or eqn.outvars[0].aval.shape in shapes)):
      n += 1
    if eqn.primitive.name not in not_into:
      for sub in sub_jaxprs(eqn):
        n += count_primitive(
            sub, primitive, scope, outside=outside, not_into=not_into,
            within=within, shapes=shapes,
            _entered=_entered or eqn.primitive.name in within, _outer=stack)
  return n
