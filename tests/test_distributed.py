"""Data parallelism: pmap, shard_map, sharded jit, distributed inverses.

4 devices (``helpers.replica_devices``: the default backend's, or where it
has fewer, the 4 CPU devices conftest.py simulates; the whole module then
runs on the CPU). The reference is always one device with the whole batch;
the data-parallel runs give each of the 4 devices a quarter of it.
"""

import os

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import distributed
from tests import helpers
from tests import problems

R = 4  # devices


def _loss(params, batch):
  """A 4-layer tanh MLP with a generic (diagonal-block) scale after layer 0.

  Layers 1 and 2 have the same shapes (one vmapped group); the generic
  block's statistic is a square of sums, not a mean over examples.
  """
  x, y = batch
  h = x
  for i in range(4):
    p = params[f"layer{i}"]
    s = kl.register_dense(h @ p["w"] + p["b"], h, p["w"], p["b"])
    h = jnp.tanh(s) if i < 3 else s
    if i == 0:
      h = h * kl.register_generic(params["scale"])
  kl.register_categorical_predictive_distribution(h, y)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h, y))


@pytest.fixture(name="devices", scope="module", autouse=True)
def _devices():
  with helpers.on_replica_devices(R) as devices:
    yield devices


def _pmap(fn, **kwargs):
  """``jax.pmap`` over the module's devices, axis ``"d"``."""
  return jax.pmap(fn, axis_name="d", devices=helpers.replica_devices(R),
                  **kwargs)


@pytest.fixture(name="problem", scope="module")
def _problem():
  params, batches, _ = problems.mlp_classifier((6, 8, 8, 8, 3), 16, 3)
  params["scale"] = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(9),
                                                  (8,))
  collection = kl.scan(_loss, params, batches[0])
  return params, batches, collection


@pytest.fixture(name="mesh", scope="module")
def _mesh(devices):
  return Mesh(np.array(devices), ("d",))


def _split(tree):
  """``[B, ...]`` -> ``[R, B / R, ...]`` for pmap."""
  return jax.tree.map(lambda x: x.reshape((R, -1) + x.shape[1:]), tree)


@jax.jit  # Jitted and on host: not one eager compile per leaf shape.
def _stack(tree):
  return jax.tree.map(lambda x: jnp.stack([x] * R), tree)


def _identity(tree):
  return tree


def _replicate(tree):
  """``tree`` stacked ``R`` times and laid out over the devices as a
  pmapped step returns its outputs: each step then compiles once, not a
  second time for inputs of another layout."""
  return _pmap(_identity)(_stack(tree))


def _on_mesh(mesh, tree):
  """``tree`` replicated over ``mesh`` (``P()``), as a ``shard_map`` step
  with ``out_specs=P()`` returns it."""
  return jax.device_put(tree, NamedSharding(mesh, P()))


def _first(tree):
  return jax.tree.map(lambda x: np.asarray(x)[0], tree)


def _mean_grad(mapping):
  """The gradient of the global mean loss, per mapping.

  Under pmap ``jax.grad`` is per replica (average it); under shard_map
  (check_vma) the gradient of replicated parameters is already *summed*
  over the axis, so divide by the axis size.
  """
  def grad(params, batch):
    g = jax.grad(_loss)(params, batch)
    if mapping == "pmap":
      g = lax.pmean(g, "d")
    elif mapping == "shard_map":
      g = jax.tree.map(lambda x: x / lax.axis_size("d"), g)
    return g
  return grad


def _steps(mapping, make_tx, params, batches, mesh):
  """Runs ``tx.update`` once per batch (fixed params); returns the
  directions and the final state (replica 0's under pmap)."""
  tx = make_tx(None if mapping in ("one", "jit") else "d")
  grad = _mean_grad(mapping)

  def step(state, params, batch):
    return tx.update(grad(params, batch), state, params, batch=batch)

  state = jax.jit(tx.init)(params)
  if mapping == "pmap":
    fn = _pmap(step, in_axes=(0, None, 0))
    state, prep = _replicate(state), _split
  elif mapping == "shard_map":
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("d")),
                               out_specs=(P(), P())))
    prep = lambda b: b  # noqa: E731
    # Placed as the step returns them: one compile, not a second one for
    # the state the first step hands back replicated over the mesh.
    state, params = _on_mesh(mesh, (state, params))
  else:
    fn = jax.jit(step)
    sharding = NamedSharding(mesh, P("d"))
    prep = ((lambda b: jax.device_put(b, sharding)) if mapping == "jit"
            else (lambda b: b))
  directions = []
  for b in batches:
    d, state = fn(state, params, prep(b))
    directions.append(d)
  if mapping == "pmap":
    for x in jax.tree.leaves((directions, state)):
      x = np.asarray(x)
      for r in range(1, R):
        np.testing.assert_array_equal(x[r], x[0])
    directions, state = _first(directions), _first(state)
  return directions, state


def _factors(state, replicated=False):
  """The factor fields of every block (no caches). A replicated state
  (leading replica axis) is split per layer under ``vmap``, so that the
  stacked groups are split past the replica axis."""
  blocks = (jax.vmap(lambda e: e.blocks)(state.estimator) if replicated
            else state.estimator.blocks)
  return [{k: v for k, v in b._asdict().items() if k in ("a", "g", "diag")}
          for b in blocks]


@pytest.fixture(name="one_device", scope="module")
def _one_device():
  return {}  # estimation mode -> (directions, state), filled once per mode


@pytest.mark.parametrize("mapping,mode", [
    pytest.param(m, e, marks=() if (m, e) == ("shard_map", "empirical")
                 else pytest.mark.slow)   # The sweep: slow tier.
    for e in ("empirical", "exact") for m in ("pmap", "shard_map", "jit")])
def test_data_parallel_matches_one_device(problem, mesh, one_device, mapping,
                                          mode):
  params, batches, c = problem
  make = lambda axis: kl.scale_by_kfac(  # noqa: E731
      c, damping=1e-2, estimation_mode=mode, inverse_update_period=1,
      axis_name=axis)
  if mode not in one_device:
    one_device[mode] = _steps("one", make, params, batches, mesh)
  want_dirs, want = one_device[mode]
  got_dirs, got = _steps(mapping, make, params, batches, mesh)
  assert len(_factors(want)) == 5 and "diag" in _factors(want)[1]
  helpers.assert_trees_close(_factors(got), _factors(want), rtol=1e-5)
  helpers.assert_trees_close(got_dirs, want_dirs, rtol=1e-5)


def test_one_pass_stats_under_shard_map_match_one_device(problem, mesh):
  """value_grad_and_stats(axis_name=...): the gradient is per replica (not
  summed, unlike jax.grad under shard_map) and the statistics global."""
  params, batches, c = problem

  def run(axis):
    fn = kl.value_grad_and_stats(_loss, c, estimation_mode="exact",
                                 axis_name=axis)
    tx = kl.kfac(0.1, c, estimation_mode="exact", axis_name=axis)

    def step(params, state, batch):
      loss, grads, stats = fn(params, batch, jax.random.PRNGKey(0))
      if axis:
        loss, grads = lax.pmean((loss, grads), axis)
      updates, state = tx.update(grads, state, params, stats=stats)
      return optax.apply_updates(params, updates), state, loss
    if axis:
      step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(axis)),
                           out_specs=(P(), P(), P()))
    step = jax.jit(step)
    p, s, losses = params, jax.jit(tx.init)(params), []
    if axis:  # Placed as the step returns them (one compile).
      p, s = _on_mesh(mesh, (p, s))
    for b in batches:
      p, s, loss = step(p, s, b)
      losses.append(loss)
    return p, losses

  want, want_losses = run(None)
  got, got_losses = run("d")
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
  helpers.assert_trees_close(got, want, rtol=1e-5)


def test_kfac_optimizer_data_parallel_matches_one_device(problem, mesh):
  """The quadratic model's Fisher Gram and the LM rule's losses are
  averaged over the axis: α, μ, ρ, λ and the params match one device.

  A 2-layer MLP (the optimizer's own reductions do not depend on the
  blocks) under shard_map (pmap is covered by the bitwise-identical test
  below): compiling ``kfac_optimizer`` is most of the test's time.
  """
  _, batches, _ = problem
  loss = helpers.classifier_loss
  params = helpers.mlp_params(jax.random.PRNGKey(0), [6, 8, 3])
  c = kl.scan(loss, params, batches[0])

  def run(axis):
    tx = kl.kfac_optimizer(c, initial_damping=1e-2, estimation_mode="exact",
                           damping_adaptation_interval=1, axis_name=axis)

    def step(params, state, batch):
      grads = jax.grad(loss)(params, batch)
      if axis:  # shard_map sums the gradient of replicated params.
        grads = jax.tree.map(lambda g: g / lax.axis_size(axis), grads)
      updates, state = tx.update(grads, state, params, batch=batch)
      return optax.apply_updates(params, updates), state

    if axis:
      step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(axis)),
                           out_specs=(P(), P()))
    step, p, s = jax.jit(step), params, jax.jit(tx.init)(params)
    if axis:  # Placed as the step returns them (one compile).
      p, s = _on_mesh(mesh, (p, s))
    for b in batches:
      p, s = step(p, s, b)
    return p, s

  want_p, want_s = run(None)
  got_p, got_s = run("d")
  assert float(want_s.momentum) != 0.0  # Both coefficients were adapted.
  for name in ("learning_rate", "momentum", "rho", "damping", "loss",
               "new_loss", "qmodel_change"):
    np.testing.assert_allclose(getattr(got_s, name), getattr(want_s, name),
                               rtol=1e-4, err_msg=name)
  helpers.assert_trees_close(got_p, want_p, rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda c, axis: kl.kfac(0.1, c, damping=1e-2, inverse_update_period=3,
                            axis_name=axis),
    pytest.param(lambda c, axis: kl.kfac_optimizer(
        c, initial_damping=1e-2, damping_adaptation_interval=2,
        inverse_update_period=3, axis_name=axis), marks=pytest.mark.slow)],
    ids=["kfac", "kfac_optimizer"])
def test_replica_states_stay_bitwise_identical(problem, make):
  """20 steps in ``gradients`` mode (sampled targets differ per replica)."""
  params, _, c = problem
  tx = make(c, "d")

  def step(params, state, batch):
    grads = lax.pmean(jax.grad(_loss)(params, batch), "d")
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  step = _pmap(step)
  p, s = _replicate(params), _replicate(jax.jit(tx.init)(params))
  for i in range(20):
    b = helpers.classification_batch(jax.random.PRNGKey(100 + i), 16, 6, 3)
    p, s = step(p, s, _split(b))
  leaves = jax.tree.leaves((p, s))
  for x in leaves:
    x = np.asarray(x)
    assert np.all(np.isfinite(x))
    for r in range(1, R):
      np.testing.assert_array_equal(x[r], x[0])
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a)[0] - b).max(), p,
                       params)
  assert min(jax.tree.leaves(moved)) > 0  # It trained.


def test_replicas_draw_different_targets(problem):
  """Same data and key on every replica: with axis_name the sampled
  targets (hence local output-gradient factors) differ, inputs agree."""
  params, batches, c = problem
  same = _replicate(batches[0])

  def local_factors(axis):
    est = kl.FisherEstimator(c, axis_name=axis, stats_sync="before_refresh")
    fn = _pmap(lambda b: est.update_curvature(
        est.init(params), params, b, jax.random.PRNGKey(0)).blocks[0])
    return fn(same)

  folded = local_factors("d")
  np.testing.assert_array_equal(folded.a[1], folded.a[0])
  assert not np.allclose(folded.g[1], folded.g[0])
  unfolded = local_factors(None)
  np.testing.assert_array_equal(unfolded.g[1], unfolded.g[0])


@pytest.mark.slow
def test_stats_synced_before_refresh(problem):
  """Per-replica EMAs between refreshes; at a refresh their average, which
  equals the factors of averaging at every update (the EMA is linear)."""
  params, batches, c = problem
  batches = batches + [helpers.classification_batch(
      jax.random.PRNGKey(50), 16, 6, 3)]  # Refreshes at steps 0 and 3.

  def run(sync):
    tx = kl.scale_by_kfac(c, damping=1e-2, inverse_update_period=3,
                          axis_name="d", stats_sync=sync)
    grad = _mean_grad("pmap")
    fn = _pmap(lambda s, b: tx.update(grad(params, b), s, params,
                                      batch=b))
    s, out = _replicate(tx.init(params)), []
    for b in batches:
      d, s = fn(s, _split(b))
      out.append((d, s))
    return out

  every, before = run("every_update"), run("before_refresh")
  for step, ((d_e, s_e), (d_b, s_b)) in enumerate(zip(every, before)):
    f_e, f_b = _factors(s_e, True), _factors(s_b, True)
    # The average of the local factors is the globally averaged EMA.
    helpers.assert_trees_close(jax.tree.map(lambda x: x.mean(0), f_b),
                               _first(f_e), rtol=1e-5)
    helpers.assert_trees_close(d_b, d_e, rtol=1e-5)
    kron = f_b[0]["g"]
    if step % 3 == 0:  # Refreshed: the average was written back.
      np.testing.assert_array_equal(kron[1], kron[0])
    else:
      assert not np.allclose(kron[1], kron[0])
    # The generic block is reduced at every update in both modes.
    np.testing.assert_array_equal(f_b[1]["diag"][1], f_b[1]["diag"][0])


@pytest.mark.parametrize("mapping,kwargs", [
    ("pmap", {}),
    # At the suite's fast compile settings this one is 1.5e-6 apart.
    pytest.param("pmap", {"damping_type": "exact",
                          "stagger_inverse_updates": True,
                          "inverse_update_period": 2},
                 marks=(pytest.mark.slow, pytest.mark.xla_defaults)),
    # With LAPACK at one thread for the whole process, this one is 1.4e-6
    # apart at the suite's fast compile settings.
    pytest.param("pmap", {"stats_sync": "before_refresh", "exps": (-1, -0.5),
                          "compute_cholesky": True},
                 marks=(pytest.mark.slow, pytest.mark.xla_defaults)),
    pytest.param("shard_map", {}, marks=pytest.mark.slow)])
def test_distributed_inverses_match_local(problem, mesh, mapping, kwargs):
  params, batches, c = problem
  batches = batches[:2]
  kwargs = {"inverse_update_period": 1, **kwargs}
  fields = ("damping_type", "exps", "compute_cholesky", "stats_sync")
  est = {k: v for k, v in kwargs.items() if k in fields}
  kwargs = {k: v for k, v in kwargs.items() if k not in fields}

  def make(dist):
    return lambda axis: kl.scale_by_kfac(
        c, damping=1e-2, **kwargs, estimator=kl.FisherEstimator(
            c, estimation_mode="empirical", axis_name=axis,
            distributed_inverses=dist, **est))

  want_dirs, want = _steps(mapping, make(False), params, batches, mesh)
  got_dirs, got = _steps(mapping, make(True), params, batches, mesh)
  helpers.assert_trees_close(got_dirs, want_dirs, rtol=1e-6)
  caches = lambda s: [b.cache for b in s.estimator.blocks  # noqa: E731
                      if hasattr(b, "cache")]
  assert jax.tree.leaves(caches(want))
  helpers.assert_trees_close(caches(got), caches(want), rtol=1e-6)


def test_plan_spreads_the_refresh_over_devices(problem):
  _, _, c = problem
  est = kl.FisherEstimator(c)
  # layer0, scale, (layer1, layer2), layer3: groups of one member each but
  # the third, of two.
  assert est.groups == ((0,), (1,), (2, 3), (4,))
  members = [est.blocks[g[0]].init() for g in est.groups]
  units, owners = distributed.plan(
      [distributed.refresh_cost(m) for m in members],
      [len(g) for g in est.groups], R)
  assert sorted(est.groups[k][j] for k, u in units for j in u) == [
      0, 1, 2, 3, 4]
  assert (2, (0,)) in units and (2, (1,)) in units  # The group is split.
  assert len(set(owners)) == R
  # Equal costs: round robin; unequal: longest first, least loaded.
  assert distributed.assign([1.0] * 6, 4) == (0, 1, 2, 3, 0, 1)
  assert distributed.assign([1.0, 5.0, 2.0, 2.0], 2) == (1, 0, 1, 1)
  assert distributed.assign([3.0, 3.0], 1) == (0, 0)


@pytest.mark.perf
def test_distributed_refresh_communicates_only_new_leaves(problem):
  """Factors pass through the refresh: only caches and damping are psummed
  (counted in the jaxpr)."""
  params, _, c = problem
  est = kl.FisherEstimator(c, axis_name="d", distributed_inverses=True)
  state = est.init(params)
  jaxpr = jax.make_jaxpr(lambda s: est.update_cache(s, 1e-2),
                         axis_env=[("d", R)])(state)
  sent = sum(int(np.prod(v.aval.shape)) for e in jaxpr.eqns
             if e.primitive.name == "psum" for v in e.invars)
  cache = sum(int(np.prod(x.shape)) for b in state.blocks
              for x in jax.tree.leaves(getattr(b, "cache", {})))
  damping = len(state.blocks)
  assert sent == cache + damping


def test_wrong_axis_name_is_reported(problem):
  params, batches, c = problem
  tx = kl.kfac(0.1, c, axis_name="batch")
  state = _replicate(tx.init(params))
  step = _pmap(lambda s, b: tx.update(params, s, params, batch=b))
  with pytest.raises(ValueError, match="axis_name='batch' is not a mapped"):
    step(state, _split(batches[0]))
  with pytest.raises(ValueError, match="axis_name='batch'"):
    jax.jit(lambda s, b: tx.update(params, s, params, batch=b))(
        tx.init(params), batches[0])


def test_stats_reduced_differently_are_rejected(problem):
  params, batches, c = problem
  fn = kl.value_grad_and_stats(_loss, c)  # No axis_name.
  tx = kl.kfac(0.1, c, axis_name="d")

  def step(s, b):
    _, grads, stats = fn(params, b, jax.random.PRNGKey(0))
    return tx.update(grads, s, params, stats=stats)
  with pytest.raises(ValueError, match="axis_name='d'"):
    _pmap(step)(_replicate(tx.init(params)), _split(batches[0]))


@pytest.mark.parametrize("kwargs,match", [
    ({"stats_sync": "sometimes"}, "stats_sync='sometimes'"),
    ({"distributed_inverses": True}, "distributed_inverses=True needs"),
])
def test_bad_options(problem, kwargs, match):
  with pytest.raises(ValueError, match=match):
    kl.scale_by_kfac(problem[2], **kwargs)


# ---------------------------------------------------------------------------
# Examples and multiple processes.
# ---------------------------------------------------------------------------


def _example(name):
  return helpers.load_example(name)


@pytest.mark.slow
@pytest.mark.parametrize("name,flags", [
    ("pmap_data_parallel", ["--distributed-inverses"]),
    ("shard_map_data_parallel", ["--stats-sync", "before_refresh"])])
def test_data_parallel_examples_run(name, flags, capsys):
  """The example picks the devices helpers.replica_devices does: the
  default backend's, or the simulated CPU devices beside one GPU."""
  platform = helpers.replica_devices(R)[0].platform
  res = _example(name).main(
      ["--devices", str(R), "--steps", "3", "--hidden", "16", "--depth", "1",
       "--batch-size", "32", "--train-size", "256", "--inverse-period", "2",
       "--log-every", "1", *flags])
  assert res["devices"] == R and res["steps"] == 3
  assert len(res["losses"]) == 3 and all(np.isfinite(res["losses"]))
  assert 0.0 <= res["test_accuracy"] <= 1.0
  out = capsys.readouterr().out
  assert f"{R} of " in out and f" {platform} devices" in out, out
  assert "final loss" in out


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  """jax.distributed on loopback (gloo), 2 processes x 1 CPU device, 5
  steps, against one process with the combined batch."""
  mp = _example("multiprocess_data_parallel")
  out = mp.main(["--num-processes", "2", "--steps", "5", "--timeout", "240",
                 "--estimation-mode", "empirical",
                 "--out", str(tmp_path / "result.npz")])
  batches = mp.synthetic_batches(0, 5, 64, 8, 4)
  cpu = jax.devices("cpu")[0]  # The workers' platform.
  with jax.default_device(cpu):
    ref = mp.train(Mesh(np.array([cpu]), (mp.AXIS,)), batches,
                   estimation_mode="empirical")
  assert ref["losses"][-1] < ref["losses"][0]
  np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-5)
  helpers.assert_trees_close(out["params"], ref["params"], rtol=1e-5)


@pytest.mark.slow
def test_launcher_kills_workers_on_timeout():
  mp = _example("multiprocess_data_parallel")
  with pytest.raises(mp.LaunchError, match="failed") as info:
    mp.main(["--num-processes", "2", "--steps", "5", "--timeout", "1"])
  assert len(info.value.pids) == 2
  for pid in info.value.pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)
