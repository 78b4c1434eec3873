"""Sharded curvature: the placement plan and the transforms with ``mesh=``.

4 devices (``helpers.replica_devices``; conftest.py simulates 4 CPU
devices). The reference is always the same transform without a mesh on one
device; the sharded runs jit the step over a mesh with the batch sharded,
the parameters replicated or FSDP-sharded, and the curvature spread over
the mesh by the plan. ``tests/sharded_worker.py`` checks the same on 8
devices in a subprocess.
"""

import math
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import placement
from kfac_jax_lite import routing
from kfac_jax_lite import sharded
from tests import helpers
from tests import mesh_resume_worker
from tests import problems

R = 4
SIZES = (8, 16, 12, 12, 12, 20, 8, 8, 4)  # 8 layers, 3 of them alike


@pytest.fixture(name="devices", scope="module", autouse=True)
def _devices():
  with helpers.on_replica_devices(R) as devices:
    yield devices


@pytest.fixture(name="problem", scope="module")
def _problem():
  return problems.mlp_classifier(SIZES, 32, 5)


def _mesh(devices, shape=(R,), names=("d",)):
  return Mesh(np.array(devices).reshape(shape), names)


def _fsdp(params, mesh, axis):
  """Each leaf sharded over ``axis`` on its first dimension."""
  return jax.tree.map(lambda x: jax.device_put(
      x, NamedSharding(mesh, P(axis))), params)


MAKERS = {
    "kfac": lambda c, **kw: kl.kfac(
        1e-2, c, damping=1e-2, inverse_update_period=3, **kw),
    "kfac_adamw": lambda c, **kw: kl.kfac_adamw(
        1e-2, c, damping=1e-2, inverse_update_period=3, **kw),
    "kfac_optimizer": lambda c, **kw: kl.kfac_optimizer(
        c, initial_damping=1e-1, inverse_update_period=3,
        damping_adaptation_interval=2, **kw),
}


def _train(problem, make, params, batch_sharding=None, out_shardings=None,
           one_pass=False, **kw):
  """5 steps of ``make(collection, **kw)``; the final params and state.
  ``one_pass``: the gradient and the statistics from one linearisation
  (``update(..., linearized=...)``), else ``batch=``."""
  c = problem.scan()
  tx = make(c, **kw)
  state = jax.jit(tx.init)(params)

  @jax.jit
  def step(params, state, batch):
    if one_pass:
      lin = kl.FisherEstimator(c).linearize(params, batch)
      updates, state = tx.update(lin.gradient(), state, params,
                                 linearized=lin)
    else:
      grads = jax.grad(problem.loss)(params, batch)
      updates, state = tx.update(grads, state, params, batch=batch)
    new = jax.tree.map(lambda p, u: p + u, params, updates)
    if out_shardings is not None:
      new = jax.lax.with_sharding_constraint(new, out_shardings)
    return new, state

  for b in problem.batches:
    if batch_sharding is not None:
      b = jax.device_put(b, batch_sharding)
    params, state = step(params, state, b)
  return params, state, tx


def _curvature(state):
  """The first curvature state (the estimator's) inside an optax state."""
  return [s for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, kl.CurvatureState))
          if isinstance(s, kl.CurvatureState)][0].estimator


def _logical_factors(tx_est, state):
  est_state = tx_est.logical(state) if isinstance(
      state, sharded.ShardedState) else state
  return [(b.a, b.g) for b in est_state.blocks]


@pytest.fixture(name="reference", scope="module")
def _reference(problem):
  return {}


# The step comparisons' MLP: 5 layers, 2 of them alike (one stacked group),
# spread over the 4 devices by the plan. Compiling the one-device and the
# sharded steps is the comparisons' time, and it grows with the layers.
STEP_SIZES = (8, 12, 12, 12, 20, 4)


@pytest.fixture(name="step_problem", scope="module")
def _step_problem():
  return problems.mlp_classifier(STEP_SIZES, 32, 5)


@pytest.fixture(name="step_reference", scope="module")
def _step_reference(step_problem):
  return {}


@pytest.mark.parametrize("name,layout", [
    ("kfac", "fsdp"),
    pytest.param("kfac", "replicated", marks=pytest.mark.slow),
    pytest.param("kfac_adamw", "fsdp", marks=pytest.mark.slow),
    pytest.param("kfac_adamw", "replicated", marks=pytest.mark.slow),
    pytest.param("kfac_optimizer", "replicated", marks=pytest.mark.slow),
    pytest.param("kfac_optimizer", "fsdp", marks=pytest.mark.slow),
    pytest.param("kfac", "2d", marks=pytest.mark.slow)])
def test_sharded_steps_match_one_device(step_problem, devices,
                                        step_reference, name, layout):
  problem, reference, make = step_problem, step_reference, MAKERS[name]
  if name not in reference:
    reference[name] = _train(problem, make, problem.params)
  want_params, want_state, _ = reference[name]
  if layout == "2d":  # Batch over "data", params over "model", curvature
    mesh = _mesh(devices, (2, 2), ("data", "model"))  # over both.
    batch, fsdp, axis = P("data"), "model", ("data", "model")
  else:
    mesh = _mesh(devices)
    batch, fsdp, axis = P("d"), "d", "d"
  params, shardings = problem.params, None
  if layout != "replicated":
    params = _fsdp(params, mesh, fsdp)
    shardings = jax.tree.map(lambda x: x.sharding, params)
  got_params, got_state, tx = _train(
      problem, make, params, NamedSharding(mesh, batch), shardings,
      mesh=mesh, curvature_axis=axis, param_shardings=shardings)
  helpers.assert_trees_close(got_params, want_params, rtol=1e-5)
  est = _layout_of(problem.scan(), mesh, axis)
  got = _curvature(got_state)
  assert isinstance(got, sharded.ShardedState)
  helpers.assert_trees_close(_logical_factors(est, got),
                             _logical_factors(None, _curvature(want_state)),
                             rtol=1e-5)
  if layout != "replicated":
    for x, s in zip(jax.tree.leaves(got_params), jax.tree.leaves(shardings)):
      assert x.sharding.is_equivalent_to(s, x.ndim)


def _layout_of(collection, mesh, axis):
  """A sharded estimator with the transforms' layout (the plan depends on
  the blocks only), to read their states with."""
  return sharded.place(kl.FisherEstimator(collection), mesh, axis)


# ---- the plan ---------------------------------------------------------------
def test_plan_is_longest_first_and_packs_each_device_row(problem):
  est = kl.FisherEstimator(problem.scan())
  plan = placement.make_plan(est, 3, ("d",))
  nbytes = [u.nbytes for u in plan.units]
  # Each block's bytes: its factors, EMA weights and cached inverses.
  shapes = [jax.eval_shape(b.init) for b in est.blocks]
  assert nbytes == [sum(x.size * 4 for x in jax.tree.leaves(s))
                    for s in shapes]
  # Greedy longest first, by hand: the largest block to the least loaded
  # device (ties: lowest device, earlier layer).
  load, want = [0, 0, 0], [None] * len(nbytes)
  for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
    d = min(range(3), key=lambda d: (load[d], d))
    want[i], load[d] = d, load[d] + nbytes[i]
  assert plan.owners == tuple(want)
  assert plan.loads() == load
  assert max(load) <= sum(load) / 3 + max(nbytes)  # Graham's bound.
  text = plan.describe()
  assert repr(plan) == text and "device 2:" in text
  for u in plan.units:
    assert u.name in text
  # Packing a device's row and unpacking it gives its blocks back.
  layout = placement.make_layout(plan, est)
  states = {i: jax.tree.map(lambda x, i=i: x + i, s) for i, s in
            enumerate(est.per_layer(est.init(problem.params)))}
  for r in range(3):
    row = layout.pack(r, states)
    assert {k: v.shape for k, v in row.items()} == {
        k: (w,) for k, w in layout.widths.items()}
    back = layout.unpack(r, row)
    assert sorted(back) == list(plan.layers_of(r))
    for i, s in back.items():
      for x, y in zip(jax.tree.leaves(s), jax.tree.leaves(states[i])):
        np.testing.assert_array_equal(x, y)


def test_the_plan_names_the_arrays_that_enter_whole(problem):
  """A gradient none of whose axes the device count divides is not split:
  the plan lists each such parameter leaf, and only those."""
  est = kl.FisherEstimator(problem.scan())
  leaves = jax.tree_util.tree_flatten_with_path(problem.params)[0]
  for devices in (3, 4):
    want = [jax.tree_util.keystr(p) for p, x in leaves
            if not any(n % devices == 0 for n in x.shape)]
    plan = placement.make_plan(est, devices, ("d",))
    assert list(plan.whole) == want
    text = plan.describe()
    assert ("whole on every device" in text) == bool(want), text
    assert all(p in text for p in want)
  assert placement.make_plan(est, 3, ("d",)).whole  # Some, at 3 devices.


def test_each_device_holds_its_share_of_the_curvature(problem, devices):
  c = problem.scan()
  mesh = _mesh(devices)
  tx = kl.kfac(1e-2, c, mesh=mesh, curvature_axis="d")
  state = _curvature(jax.jit(tx.init)(problem.params))
  plan = _layout_of(c, mesh, "d").plan
  total = sum(u.nbytes for u in plan.units)
  per_device = {d: 0 for d in devices}
  for x in state.rows.values():
    assert x.sharding.spec == P("d")
    for shard in x.addressable_shards:
      assert shard.data.shape[0] == 1  # One row: its own blocks only.
      per_device[shard.device] += shard.data.nbytes
  assert max(per_device.values()) <= 1.15 * total / R, (
      per_device, total, plan.describe())


@pytest.mark.slow
def test_one_pass_fsdp_steps_match_one_device(problem, devices, reference):
  """``kfac`` given the gradient's own linearisation (``linearized=``, one
  forward pass) with FSDP parameters and the curvature over the mesh
  equals ``batch=`` on one device (the same sampling key each step)."""
  if "kfac" not in reference:
    reference["kfac"] = _train(problem, MAKERS["kfac"], problem.params)
  mesh = _mesh(devices)
  params = _fsdp(problem.params, mesh, "d")
  shardings = jax.tree.map(lambda x: x.sharding, params)
  got, _, _ = _train(problem, MAKERS["kfac"], params,
                     NamedSharding(mesh, P("d")), shardings, one_pass=True,
                     mesh=mesh, curvature_axis="d", param_shardings=shardings)
  helpers.assert_trees_close(got, reference["kfac"][0], rtol=1e-5)


def _compiled_kfac_step(problem, devices, period, one_pass=False,
                        fsdp=False, **jit_kwargs):
  """``(hlo, width)``: the compiled text of a sharded ``kfac`` step (batch
  split over the mesh; ``one_pass``: ``linearized=``, else ``batch=``;
  ``fsdp``: FSDP parameters) and the width of a device's float32 row."""
  mesh = _mesh(devices)
  c = problem.scan()
  params, kw = problem.params, {}
  if fsdp:
    params = _fsdp(params, mesh, "d")
    kw["param_shardings"] = jax.tree.map(lambda x: x.sharding, params)
  tx = kl.kfac(1e-2, c, inverse_update_period=period, mesh=mesh,
               curvature_axis="d", **kw)
  state = jax.jit(tx.init)(params)

  def step(params, state, batch):
    if one_pass:
      lin = kl.FisherEstimator(c).linearize(params, batch)
      return tx.update(lin.gradient(), state, params, linearized=lin)
    grads = jax.grad(problem.loss)(params, batch)
    return tx.update(grads, state, params, batch=batch)

  batch = jax.device_put(problem.batch, NamedSharding(mesh, P("d")))
  hlo = jax.jit(step, **jit_kwargs).lower(params, state,
                                          batch).compile().as_text()
  return hlo, _curvature(state).rows["float32"].shape[1]


def test_no_collective_moves_the_curvature(problem, devices):
  """The compiled step's collectives carry statistics inputs, gradients and
  updates, never a device's row of curvature: no collective has the row's
  width in its shape, and the exchange to the owners is an all-to-all."""
  hlo, width = _compiled_kfac_step(problem, devices, 1)
  shapes = re.findall(r"= (.*?) (?:all-gather|all-reduce|all-to-all|"
                      r"reduce-scatter|collective-permute)(?:-start)?\(", hlo)
  assert "all-to-all(" in hlo and shapes
  dims = {int(n) for s in shapes for d in re.findall(r"\[([\d,]*)\]", s)
          for n in d.split(",") if n}
  assert width not in dims, (width, shapes)


def test_the_statistics_inputs_enter_split_on_their_last_axis(
    devices, monkeypatch):
  """The one-pass FSDP step sends each layer's statistics inputs (its
  inputs and output gradients, the batch axis ``B`` split over the mesh)
  to their owner split on their last axis that the mesh divides, not on
  the batch where a feature axis divides: entering the exchange split on
  the batch, they pin the backward pass's cotangents to the batch layout
  and XLA then holds every all-gathered FSDP weight from the forward pass
  to the backward (at GPT-2-medium width; ``docs/guides/sharding.md``)."""
  routes = []
  make_route = routing.make_route

  def spy(plan, leaves, *args, **kwargs):
    route = make_route(plan, leaves, *args, **kwargs)
    routes.append(route)
    return route

  monkeypatch.setattr(routing, "make_route", spy)
  problem = problems.mlp_classifier((8, 16, 4), 32, 1)
  mesh = _mesh(devices)
  c = problem.scan()
  params = _fsdp(problem.params, mesh, "d")
  tx = kl.kfac(1e-2, c, mesh=mesh, curvature_axis="d",
               param_shardings=jax.tree.map(lambda x: x.sharding, params))

  def step(params, state, batch):
    lin = kl.FisherEstimator(c).linearize(params, batch)
    return tx.update(lin.gradient(), state, params, linearized=lin)

  batch = jax.device_put(problem.batch, NamedSharding(mesh, P("d")))
  jax.jit(step).lower(params, jax.eval_shape(tx.init, params), batch)
  b = problem.batch[0].shape[0]
  got = [(s, a) for r in routes for ss, aa in zip(r.shapes, r.axes)
         for s, a in zip(ss, aa) if b in s]
  last = lambda s: max(k for k, n in enumerate(s) if n % R == 0)  # noqa: E731
  assert any(last(s) != s.index(b) for s, _ in got), got
  assert all(a == last(s) for s, a in got), got


@pytest.mark.slow
def test_the_one_pass_step_runs_the_model_forward_once(problem, devices):
  """With FSDP parameters and ``linearized=`` the compiled step has no
  statistics pass of its own (no op under its ``kfac_pass`` scope; the
  ``batch=`` step has one) and fewer matrix products than the ``batch=``
  step (one forward pass over the batch, not two): the second pass's
  saved activations are what the one-pass step does not hold."""
  twice, _ = _compiled_kfac_step(problem, devices, 1, fsdp=True)
  once, _ = _compiled_kfac_step(problem, devices, 1, one_pass=True,
                                fsdp=True)
  assert "kfac_pass" in twice and "kfac_pass" not in once
  dots = lambda hlo: len(re.findall(r" dot\(", hlo))  # noqa: E731
  assert dots(once) < dots(twice), (dots(once), dots(twice))


def test_the_step_keeps_one_row_per_device(problem, devices):
  """The EMA and the refresh (under its schedule's cond) write their
  windows of the row in place: the compiled step has no copy of a buffer
  of the row's width."""
  hlo, width = _compiled_kfac_step(problem, devices, 3, donate_argnums=1)
  copies = re.findall(rf"= f32\[(?:1,)?{width}\]\S* copy\(", hlo)
  assert f",{width}]" in hlo and not copies, copies


def _compiled_refresh(estimator, params):
  """The compiled ``update_cache`` of ``estimator`` (its state donated,
  as in a step)."""
  state = jax.eval_shape(estimator.init, params)
  return jax.jit(estimator.update_cache, donate_argnums=0).lower(
      state).compile()


def _largest_leaf(estimator) -> int:
  return max(math.prod(x.shape) for b in estimator.blocks
             for x in jax.tree.leaves(jax.eval_shape(b.init)))


def test_the_refresh_copies_no_window(problem, devices):
  """Each device's refresh materialises the window of new caches it
  writes into its row once, as one concatenation of its pieces: the
  compiled refresh copies no 1-D buffer longer than a block's largest
  leaf (only a window is; a window sliced from the row and then copied
  to be written into is held twice)."""
  est = kl.FisherEstimator(problem.scan())
  sh = sharded.place(est, _mesh(devices), "d")
  copies = [int(n) for n in re.findall(
      r"= f32\[(\d+)\]\S* copy\(",
      _compiled_refresh(sh, problem.params).as_text())]
  assert all(n <= _largest_leaf(est) for n in copies), copies


@pytest.mark.slow
def test_a_device_refresh_holds_less_than_the_whole_refresh(devices):
  """With one block dominating (64 x 64 factors) a device's refresh
  holds fewer temporaries than the same refresh without a mesh: both
  hold about the working set of that block's refresh; the one without a
  mesh holds every block's new caches besides, a device one window of
  its own (held twice, it would hold more)."""
  problem = problems.mlp_classifier((8, 64, 8, 4), 32, 1)
  est = kl.FisherEstimator(problem.scan())
  sh = sharded.place(est, _mesh(devices), "d")
  temp = _compiled_refresh(sh, problem.params).memory_analysis(
      ).temp_size_in_bytes
  alone = _compiled_refresh(est, problem.params).memory_analysis(
      ).temp_size_in_bytes
  assert temp < alone, (temp, alone)


# ---- bad input --------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(curvature_axis="d"), r"curvature_axis='d' needs mesh="),
    (dict(mesh="mesh", curvature_axis="d"), r"mesh='mesh' is a str"),
    (dict(mesh=True), r"mesh= is given without curvature_axis"),
    (dict(mesh=True, curvature_axis="x"),
     r"curvature_axis='x': 'x' is not an axis of the mesh, whose axes are "
     r"\['d'\]"),
    (dict(mesh=True, curvature_axis=("d", "d")), r"names an axis twice"),
    (dict(mesh=True, curvature_axis="d", axis_name="d"),
     r"axis_name='d' is given with mesh="),
    (dict(param_shardings={}), r"param_shardings=\.\.\. is given without "
     r"mesh= and curvature_axis="),
    (dict(mesh=True, curvature_axis="d", param_shardings={"w": "d"}),
     r"param_shardings\['w'\]='d' is a str; pass a pytree like params of "
     r"shardings"),
])
def test_bad_mesh_arguments(problem, devices, kwargs, match):
  if kwargs.get("mesh") is True:
    kwargs["mesh"] = _mesh(devices)
  for make in (lambda **kw: kl.kfac(1e-2, problem.scan(), **kw),
               lambda **kw: kl.kfac_optimizer(problem.scan(), **kw)):
    with pytest.raises((ValueError, TypeError), match=match):
      make(**kwargs)


def test_params_off_the_mesh_are_reported(problem, devices):
  mesh = _mesh(devices[:2], (2,))
  params = jax.device_put(problem.params, devices[3])
  tx = kl.kfac(1e-2, problem.scan(), mesh=mesh, curvature_axis="d")
  with pytest.raises(ValueError, match=r"params\['layer0'\]\['b'\] lies on "
                     r"devices \[\d+\], but mesh= has devices"):
    tx.init(params)


def test_a_state_of_another_layout_is_reported(problem, devices):
  c = problem.scan()
  tx = kl.scale_by_kfac(c, mesh=_mesh(devices), curvature_axis="d")
  plain = kl.scale_by_kfac(c).init(problem.params)
  grads = jax.tree.map(jnp.zeros_like, problem.params)
  with pytest.raises(ValueError, match="not the state of this sharded"):
    tx.update(grads, plain, problem.params, batch=problem.batch)


def test_fsdp_updates_leave_the_owners_split(problem, devices):
  """With ``param_shardings`` the product's program gathers nothing: each
  layer's update leaves its owner split and lands as the parameters are
  sharded; without, it is whole on every device. Equal values."""
  c = problem.scan()
  mesh = _mesh(devices)
  params = _fsdp(problem.params, mesh, "d")
  shardings = jax.tree.map(lambda x: x.sharding, params)
  grads = jax.jit(jax.grad(problem.loss))(params, problem.batch)
  got = {}
  for name, kw in (("split", dict(param_shardings=shardings)),
                   ("whole", {})):
    est = sharded.place(kl.FisherEstimator(c), mesh, "d", **kw)
    state = jax.jit(est.init)(params)
    product = jax.jit(est.multiply_inverse)
    hlo = product.lower(state, grads).compile().as_text()
    got[name] = product(state, grads)
    gathers = re.findall(r"= \S+ all-gather(?:-start)?\(", hlo)
    assert (not gathers) == (name == "split"), (name, gathers)
  for x, s in zip(jax.tree.leaves(got["split"]), jax.tree.leaves(shardings)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  for x in jax.tree.leaves(got["whole"]):
    assert x.sharding.is_fully_replicated
  helpers.assert_trees_close(got["split"], got["whole"], rtol=1e-6)


def test_param_shardings_of_another_tree_are_reported(problem, devices):
  c, mesh = problem.scan(), _mesh(devices)
  tx = kl.kfac(1e-2, c, mesh=mesh, curvature_axis="d",
               param_shardings={"w": P("d")})
  with pytest.raises(ValueError, match=r"param_shardings= has the structure "
                     r".*, but the parameters \(and their updates\) have"):
    tx.init(problem.params)


# ---- checkpoints ------------------------------------------------------------
@pytest.mark.slow
def test_checkpoint_resumes_bitwise_and_onto_another_mesh(problem, devices,
                                                          tmp_path):
  """4 devices to 2, in-process (``tests/mesh_resume_worker.py``)."""
  pytest.importorskip("orbax.checkpoint")
  mesh_resume_worker.check_resume(problem, devices, devices[:2],
                                  tmp_path / "ckpt")


@pytest.mark.slow
def test_checkpoint_of_8_devices_resumes_on_4(tmp_path):
  """8 devices to 4: the same checks in a process of 8 simulated CPU
  devices."""
  pytest.importorskip("orbax.checkpoint")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  run = subprocess.run(
      [sys.executable, "tests/mesh_resume_worker.py", "8", "4",
       str(tmp_path)], cwd=helpers.ROOT,
      env={**env, "PYTHONPATH": str(helpers.ROOT)}, capture_output=True,
      text=True, timeout=900, check=False)
  assert run.returncode == 0, run.stdout + run.stderr[-4000:]
  assert "device 7:" in run.stdout, run.stdout  # The 8-device plan.
  assert "resumed 8 -> 4 devices" in run.stdout, run.stdout


@pytest.mark.slow
def test_fsdp_gpt_example_on_8_devices():
  """The example in a process of its own with 8 simulated devices: the
  sharded run against one device, and each device's share."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  run = subprocess.run(
      [sys.executable, "examples/fsdp_gpt.py", "--compare", "--width", "32",
       "--heads", "2", "--blocks", "2", "--context", "8", "--vocab", "32",
       "--steps", "5"], cwd=helpers.ROOT, env={**env, "PYTHONPATH": str(
           helpers.ROOT)}, capture_output=True, text=True, timeout=1200,
      check=False)
  assert run.returncode == 0, run.stdout + run.stderr[-4000:]
  out = run.stdout
  assert "8 cpu devices" in out and "device 7:" in out, out
  share = float(re.search(r"\(([\d.]+) x total / devices\)", out).group(1))
  err = float(re.search(r"largest relative difference ([\d.e+-]+)",
                        out).group(1))
  assert share <= 1.25, out  # The plan's max/mean, printed above it.
  assert err <= 2e-5, out


@pytest.mark.slow
def test_two_processes_of_four_devices_match_one_device(problem, tmp_path):
  """jax.distributed on loopback (gloo): 2 processes x 4 CPU devices, the
  curvature over all 8 (``tests/sharded_worker.py``), against one device."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "PYTHONPATH": str(helpers.ROOT)}
  out = str(tmp_path / "out")
  procs = [subprocess.Popen(
      [sys.executable, "tests/sharded_worker.py", str(i), "2",
       f"127.0.0.1:{port}", out], cwd=helpers.ROOT, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    logs = [p.communicate(timeout=900)[0] for p in procs]
  finally:
    for p in procs:  # Only our own children, by handle.
      if p.poll() is None:
        p.kill()
        p.wait()
  assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-6000:]
  want, _, _ = _train(problem, MAKERS["kfac"], problem.params)
  est = kl.FisherEstimator(problem.scan())
  layout = placement.make_layout(placement.make_plan(est, 8), est)
  row = sum(w * 4 for w in layout.widths.values())  # float32 rows
  for i in range(2):
    with np.load(f"{out}.{i}.npz") as d:
      got = [d[f"arr_{k}"] for k in range(len(jax.tree.leaves(want)))]
      assert list(d["bytes"]) == [row] * 4  # One row per local device.
    helpers.assert_trees_close(got, jax.tree.leaves(want), rtol=1e-5)
