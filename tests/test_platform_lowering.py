"""Which program each platform gets: lowered on the CPU, for cpu and cuda.

The XLA:CPU workarounds (``kfac_jax_lite._xla_cpu``) are chosen when the
program is lowered: a ``lax.map`` loop around each LAPACK call of a stacked
group and conditionals that hide indices from XLA:CPU's constant folding
belong to the CPU program only. A program lowered for cuda gets one batched
cuSOLVER factorisation per stack of same-shaped factors, no loop, no
conditional but the refresh schedule's, and no host callback. The refresh's
matmuls are float32 ``HIGHEST`` on every platform; the statistics' follow
JAX's default precision. Lowering for cuda needs no GPU: jaxlib's CPU wheel
holds the cuda lowering rules (``jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))``).
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import linalg
from tests import helpers
from tests import problems

# Sizes of the residual model: inputs, width, hidden, classes, depth.
D_IN, WIDTH, HIDDEN, CLASSES, DEPTH = 5, 8, 16, 3, 3


def _residual_params(key):
  keys = jax.random.split(key, 2 * DEPTH + 2)
  dense = lambda k, a, b: {  # noqa: E731
      "w": jax.random.normal(k, (a, b)) / a ** 0.5, "b": jnp.zeros((b,))}
  params = {"embed": dense(keys[0], D_IN, WIDTH),
            "head": dense(keys[1], WIDTH, CLASSES)}
  for i in range(DEPTH):
    params[f"up{i}"] = dense(keys[2 + 2 * i], WIDTH, HIDDEN)
    params[f"down{i}"] = dense(keys[3 + 2 * i], HIDDEN, WIDTH)
  return params


def _dense(p, x):
  return kl.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"])


def _residual_loss(params, batch):
  """A transformer's MLP stack: ``DEPTH`` same-shaped residual blocks
  ``x + down(tanh(up(x)))`` between an input and an output layer (two
  stacked groups of ``DEPTH`` layers, two singleton layers)."""
  x, y = batch
  x = _dense(params["embed"], x)
  for i in range(DEPTH):
    x = x + _dense(params[f"down{i}"], jnp.tanh(_dense(params[f"up{i}"], x)))
  logits = _dense(params["head"], x)
  kl.register_categorical_predictive_distribution(logits, y)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _lowered_step(loss_fn, tx, params, batch, platform) -> str:
  """The stablehlo text of one optimiser step, lowered for ``platform``."""
  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  state = jax.eval_shape(tx.init, params)
  traced = jax.jit(step).trace(params, state, batch)
  return traced.lower(lowering_platforms=(platform,)).as_text()


def _definition(text, pos, name):
  """The line defining SSA value ``name`` nearest before ``pos``."""
  found = None
  for m in re.finditer(rf"^\s*{re.escape(name)}(?::\d+)? = (.*)$",
                       text[:pos], re.M):
    found = m.group(1)
  return found or ""


def _conditionals(text) -> list:
  """``(regions, selector is a constant)`` of every ``stablehlo.case``
  (``lax.cond`` lowers to a case on a converted predicate)."""
  out = []
  for m in re.finditer(r'"stablehlo\.case"\((%[\w#]+)\)\s*\(', text):
    depth, regions, i = 0, 0, m.end()
    while not (depth == 0 and text[i] == ")"):
      if text[i] == "{":
        regions += depth == 0
        depth += 1
      elif text[i] == "}":
        depth -= 1
      i += 1
    constant = "stablehlo.constant" in _definition(text, m.start(),
                                                   m.group(1))
    out.append((regions, constant))
  return out


def _real_conditionals(text) -> int:
  """Conditionals that choose at run time. ``lax.platform_dependent``
  leaves two cases per call in a program lowered for one platform: one
  on a constant platform index, and one with only that platform's
  branch. The first selects on a constant and yields the second's
  selector; XLA inlines both."""
  return sum(1 for regions, constant in _conditionals(text)
             if regions > 1 and not constant)


def _custom_calls(text) -> list:
  return re.findall(r"custom_call @(\w+)\(", text)


def _potrf_shapes(text) -> list:
  """The operand shape of every Cholesky lowered for the GPU, e.g.
  ``"3x9x9"``: a cuSOLVER custom call where jaxlib registers its GPU
  lowering rules without a GPU (jax 0.10), else XLA's own
  ``stablehlo.cholesky``, which XLA:GPU rewrites into the same cuSOLVER
  call (jax 0.7)."""
  return re.findall(r"custom_call @cusolver_potrf_ffi\(%[^)]*\).*?:\s*"
                    r"\(tensor<([0-9x]+)xf32>", text) + re.findall(
                        r"stablehlo\.cholesky %\S+, lower = true : "
                        r"tensor<([0-9x]+)xf32>", text)


def _dot_precisions(text) -> list:
  """The ``precision`` of every ``dot_general`` (``None``: not printed)."""
  out = []
  for line in text.splitlines():
    if "stablehlo.dot_general" in line:
      m = re.search(r"precision = \[(\w+), (\w+)\]", line)
      out.append(m.groups() if m else None)
  return out


@pytest.fixture(name="residual", scope="module")
def _residual():
  params = _residual_params(jax.random.PRNGKey(0))
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 16, D_IN,
                                       CLASSES)
  collection = kl.scan(_residual_loss, params, batch)
  tx = kl.kfac_adamw(1e-3, collection, stats_fraction=0.5)
  return {p: _lowered_step(_residual_loss, tx, params, batch, p)
          for p in ("cpu", "cuda")}


@pytest.fixture(name="mlp", scope="module")
def _mlp():
  # Two same-shaped 8 -> 8 layers (a stacked group) and two singletons.
  p = problems.mlp_classifier((6, 8, 8, 8, 3), 16)
  tx = kl.kfac(0.1, p.scan())
  return {pl: _lowered_step(p.loss, tx, p.params, p.batch, pl)
          for pl in ("cpu", "cuda")}


def test_cuda_program_has_no_cpu_workarounds(residual, mlp):
  for text in (residual["cuda"], mlp["cuda"]):
    # The models have no loop: every loop was a CPU workaround.
    assert text.count("stablehlo.while") == 0
    # The refresh schedule's lax.cond is the one runtime choice left.
    assert _real_conditionals(text) == 1
    # No host round-trip (callbacks) and no LAPACK call.
    calls = _custom_calls(text)
    assert not [c for c in calls if "callback" in c or "lapack" in c
                or "blas_threads" in c], calls


def test_cpu_program_keeps_its_workarounds(residual, mlp):
  for text in (residual["cpu"], mlp["cpu"]):
    # A lax.map per stacked group's factor, one LAPACK matrix at a time.
    assert text.count("stablehlo.while") >= 2
    assert _real_conditionals(text) > 1   # the opaque indices' conds
    calls = _custom_calls(text)
    assert "lapack_spotrf_ffi" in calls
    assert "kfac_jax_lite_blas_threads_enter" in calls


def test_cuda_factorisations_are_batched_per_stack(residual, mlp):
  """One cuSOLVER Cholesky per factor of a stacked group, batched over the
  stack; the singleton layers' factors go one at a time through their
  padded size buckets."""
  a_up, g_up = WIDTH + 1, HIDDEN          # up: WIDTH -> HIDDEN (+ bias)
  a_down, g_down = HIDDEN + 1, WIDTH      # down: HIDDEN -> WIDTH
  stacked = {f"{DEPTH}x{n}x{n}" for n in (a_up, g_up, a_down, g_down)}
  shapes = _potrf_shapes(residual["cuda"])
  assert sorted(s for s in shapes if s.count("x") == 2) == sorted(stacked)
  # embed (A 6, G 8) and head (A 9, G 3): 9 and 8 share a padded bucket.
  assert sorted(s for s in shapes if s.count("x") == 1) == [
      "3x3", "6x6", "9x9", "9x9"]
  # The MLP: layers 1 and 2 (8 -> 8, A 9 x 9, G 8 x 8) are one stack.
  shapes = _potrf_shapes(mlp["cuda"])
  assert sorted(s for s in shapes if s.count("x") == 2) == ["2x8x8",
                                                            "2x9x9"]


def _refresh_and_stats(platform):
  p = problems.mlp_classifier((6, 8, 8, 8, 3), 16)
  est = kl.FisherEstimator(p.scan(), damping=1e-6)
  state = jax.eval_shape(est.init, p.params)
  refresh = jax.jit(est.update_cache).trace(state).lower(
      lowering_platforms=(platform,)).as_text()
  stats = jax.jit(lambda s, prm, b: est.update_curvature(
      s, prm, b, jax.random.PRNGKey(0))).trace(state, p.params, p.batch)
  return refresh, stats.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_refresh_matmuls_are_highest_precision(platform):
  refresh, stats = _refresh_and_stats(platform)
  highest = ("HIGHEST", "HIGHEST")
  dots = _dot_precisions(refresh)
  assert dots and all(d == highest for d in dots), dots
  dots = _dot_precisions(stats)
  assert dots and not any(d == highest for d in dots), dots


def test_refresh_precision_leaves_the_default_as_it_was():
  refresh, _ = _refresh_and_stats("cuda")
  del refresh
  assert jax.config.jax_default_matmul_precision is None
  a = jnp.ones((4, 4))
  text = jax.jit(jnp.matmul).lower(a, a).as_text()
  assert _dot_precisions(text) in ([None], [("DEFAULT", "DEFAULT")])



def test_one_program_for_both_platforms_holds_both_choices():
  """Chosen at lowering, not by a flag: lowered for cpu and cuda at once,
  the program holds the CPU loop and the batched cuSOLVER call, behind a
  conditional on the platform (jax then lowers every primitive inside
  for both platforms too, so each branch also holds the other platform's
  kernels, which never run)."""
  spd = jnp.broadcast_to(2.0 * jnp.eye(5), (3, 5, 5))
  traced = jax.jit(jax.vmap(linalg.cholesky_inverse)).trace(spd)
  both = traced.lower(lowering_platforms=("cpu", "cuda")).as_text()
  assert both.count("stablehlo.while") >= 1
  assert "3x5x5" in _potrf_shapes(both)
  assert "lapack_spotrf_ffi" in _custom_calls(both)
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert cuda.count("stablehlo.while") == 0
  assert _potrf_shapes(cuda) == ["3x5x5"]
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert cpu.count("stablehlo.while") == 1
  assert not _potrf_shapes(cpu)
