"""Statistics and EMA computed once per group of same-shaped layers.

The estimator stacks layers whose blocks differ only in their layer and
runs ``compute_stats`` / ``update_curvature`` / ``update_cache`` under one
``jax.vmap`` per group. These tests check that every layer's results are
those of its own block, that a non-finite statistic of one layer leaves
only that layer's factors as they were, and that the number of statistics
``dot_general``s does not grow with the number of same-shaped layers.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import _xla_cpu
from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import grouping
from kfac_jax_lite import keys
from kfac_jax_lite import linearization
from tests import helpers
from tests import problems

# 8 -> 6 (different), three identical 6 -> 6 layers, 6 -> 3 (different).
SIZES = [8, 6, 6, 6, 6, 3]


def _problem(sizes=SIZES, n=5):
  p = problems.mlp_classifier(sizes, n, first_batch_seed=1)
  return p.params, p.batch, p.loss


def _estimator(sizes=SIZES, **kwargs):
  params, batch, loss_fn = _problem(sizes)
  collection = kl.scan(loss_fn, params, batch)
  return kl.FisherEstimator(collection, **kwargs), params, batch


def _per_layer_stats(est, params, batch, rng):
  """Each block's compute_stats on its own LayerData (no grouping)."""
  lin = est.linearize(params, batch)
  p = linearization.statistics_pass(
      lin, est.blocks, rng, est.estimation_mode, est.num_samples, False)
  return tuple(b.compute_stats(d) for b, d in zip(est.blocks, p.layer_data))


def _some_state(est, params, batch):
  """A state with distinct factors per layer (two updates, one refresh)."""
  @jax.jit  # One program, not hundreds of eager op-by-op compiles.
  def run(params, batch):
    state = est.init(params)
    for k in range(2):
      state = est.update_curvature(state, params, batch,
                                   jax.random.PRNGKey(k))
    return est.update_cache(state)
  return run(params, batch)


def _per_layer_product(est, states, v):
  """Each block's inverse product on its own layer's parameters."""
  leaves = jax.tree.leaves(v)
  for layer, b, s in zip(est.collection.layers, est.blocks, states):
    out = b.multiply_inverse(s, tuple(leaves[i] for i in layer.param_indices))
    for i, x in zip(layer.param_indices, out):
      leaves[i] = x
  return jax.tree.unflatten(jax.tree.structure(v), leaves)


def _set_nan(est, stats, layer):
  """``stats`` with one entry of ``layer``'s A statistic set to NaN."""
  k = next(k for k, g in enumerate(est.groups) if layer in g)
  name, st = list(stats.stacked.items())[k]
  at = (0, 1) if len(est.groups[k]) == 1 else (
      est.groups[k].index(layer), 0, 1)
  stacked = dict(stats.stacked)
  stacked[name] = dict(st, a=st["a"].at[at].set(jnp.nan))
  return dataclasses.replace(stats, stacked=stacked)


def test_layers_are_grouped():
  est, params, _ = _estimator()
  state = est.init(params)
  groups = sorted(sorted(g) for g in grouping.find_groups(
      est.blocks, est.per_layer(state)))
  assert groups == [[0], [1, 2, 3], [4]]
  assert sorted(est.groups) == [(0,), (1, 2, 3), (4,)]
  assert list(state.stacked) == [grouping.group_name(g) for g in est.groups]
  # The per-layer view of the state is each block's own initial state.
  for b, s in zip(est.blocks, est.per_layer(state)):
    helpers.assert_trees_close(s, b.init(), 0.0)


def test_grouped_statistics_equal_per_layer_statistics():
  est, params, batch = _estimator()
  rng = jax.random.PRNGKey(3)
  got = jax.jit(lambda p, b: est.compute_stats(p, b, rng))(params, batch)
  want = jax.jit(lambda p, b: _per_layer_stats(est, p, b, rng))(params,
                                                                batch)
  assert list(got.stacked) == list(est.init(params).stacked)
  assert len(got.blocks) == len(want) == 5
  for g, w in zip(got.blocks, want):
    assert jax.tree.structure(g) == jax.tree.structure(w)
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def _per_layer_ema(est, state, stats, decay):
  return tuple(b.update_curvature(s, st, decay) for b, s, st in zip(
      est.blocks, state.blocks, stats.blocks))


@pytest.mark.parametrize(
    "nan_layer", [None, 2, pytest.param(0, marks=pytest.mark.slow)])
def test_grouped_ema_equals_per_layer_ema(nan_layer):
  est, params, batch = _estimator()
  state = _some_state(est, params, batch)
  stats = jax.jit(lambda p, b: est.compute_stats(p, b, jax.random.PRNGKey(7)))(
      params, batch)
  if nan_layer is not None:
    stats = _set_nan(est, stats, nan_layer)
    assert np.isnan(stats.blocks[nan_layer]["a"][0, 1])

  got = jax.jit(lambda s, st: est.update_curvature(
      s, stats=st, ema_decay=0.9))(state, stats).blocks
  want = jax.jit(lambda s, st: _per_layer_ema(est, s, st, 0.9))(state, stats)
  for i, (g, w, old) in enumerate(zip(got, want, state.blocks)):
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    if i == nan_layer:  # Only this layer keeps its old factors and weight.
      np.testing.assert_array_equal(g.a, old.a)
      np.testing.assert_array_equal(g.g, old.g)
      np.testing.assert_array_equal(g.weight, old.weight)
    else:
      assert np.all(np.isfinite(g.a))
      assert not np.array_equal(g.a, old.a)
      assert g.weight > old.weight


@pytest.mark.parametrize("layers", [None, (0, 2), (1, 2, 3)])
def test_grouped_state_refresh_and_products_equal_per_layer(layers):
  est, params, batch = _estimator()

  @jax.jit  # One program, not hundreds of eager op-by-op compiles.
  def run(params, batch):
    state = est.init(params)
    state = est.update_curvature(state, params, batch, jax.random.PRNGKey(0))
    damping = jnp.asarray(1e-2, jnp.float32)
    want = [b.update_cache(s, damping) if layers is None or i in layers else s
            for i, (b, s) in enumerate(zip(est.blocks, state.blocks))]
    got = est.update_cache(state, 1e-2, layers)
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    return (state, want, got, est.multiply_inverse(got, grads),
            _per_layer_product(est, want, grads))
  state, want, got, product, want_product = run(params, batch)
  for i, (g, w) in enumerate(zip(got.blocks, want)):
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    if layers is not None and i not in layers:
      for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(state.blocks[i])):
        np.testing.assert_array_equal(x, y)
  helpers.assert_trees_close(product, want_product, 1e-5)


def test_transform_step_matches_ungrouped_reference():
  """kfac() (grouped state inside its step) against the estimator used
  layer by layer: same preconditioned direction after a few steps."""
  params, batch, loss_fn = _problem()
  collection = kl.scan(loss_fn, params, batch)
  tx = kl.scale_by_kfac(collection, damping=1e-2, inverse_update_period=1)
  state = jax.jit(tx.init)(params)
  est = kl.FisherEstimator(collection, damping=1e-2, cov_ema_decay=0.95)
  ref = est.per_layer(jax.jit(est.init)(params))
  # Jitted once for both steps: not op by op, not one compile a step.
  step = jax.jit(lambda g, s: tx.update(g, s, params, batch=batch))

  @jax.jit
  def reference(ref, key):
    grads = jax.grad(loss_fn)(params, batch)
    stats = _per_layer_stats(est, params, batch, key)
    ref = [b.update_curvature(s, st, 0.95)
           for b, s, st in zip(est.blocks, ref, stats)]
    ref = [b.update_cache(s, 1e-2) for b, s in zip(est.blocks, ref)]
    return grads, ref, _per_layer_product(est, ref, grads)
  for _ in range(2):
    key = keys.step_keys(state.rng)[0]
    grads, ref, want = reference(ref, key)
    direction, state = step(grads, state)
    helpers.assert_trees_close(direction, want, 1e-4)


@pytest.mark.perf
def test_statistics_dots_do_not_grow_with_same_shaped_layers():
  counts = []
  for depth in (2, 6):
    sizes = [8] + [6] * depth + [3]
    params, batch, loss_fn = _problem(sizes)
    collection = kl.scan(loss_fn, params, batch)
    vgs = kl.value_grad_and_stats(loss_fn, collection)
    jaxpr = jax.make_jaxpr(vgs)(params, batch, jax.random.PRNGKey(0))
    counts.append(helpers.count_primitive(jaxpr.jaxpr, "dot_general",
                                          "kfac_stats"))
  # A and G of 3 groups (first, the same-shaped middle ones, last), once
  # in each platform's branch of the position stride (the CPU's every
  # row, the others' every 4th), chosen when the program is lowered.
  assert counts[0] == counts[1] == 2 * 6, counts


@pytest.mark.perf
def test_ema_checks_do_not_grow_with_same_shaped_layers():
  counts = []
  for depth in (2, 6):
    est, params, batch = _estimator([8] + [6] * depth + [3])
    state = est.init(params)
    stats = est.compute_stats(params, batch, jax.random.PRNGKey(0))
    jaxpr = jax.make_jaxpr(lambda s, st: est.update_curvature(
        s, stats=st))(state, stats)
    counts.append(helpers.count_primitive(jaxpr.jaxpr, "is_finite", "kfac_ema"))
  assert counts[0] == counts[1] == 3, counts


def test_transform_state_stays_stacked():
  """The optax state keeps same-shaped blocks stacked across steps: no
  per-layer split (and re-stack) of the curvature state in the step, and
  the per-layer view equals the ungrouped state."""
  params, batch, loss_fn = _problem()
  collection = kl.scan(loss_fn, params, batch)
  tx = kl.kfac(0.1, collection, damping=1e-2, inverse_update_period=1)
  state = tx.init(params)
  est_state = state.inner[0].estimator
  assert isinstance(est_state, kl.EstimatorState)
  assert sorted(est_state.groups) == [(0,), (1, 2, 3), (4,)]
  grads = jax.grad(loss_fn)(params, batch)
  _, state = jax.jit(lambda g, s: tx.update(g, s, params, batch=batch))(
      grads, state)
  est_state = state.inner[0].estimator
  assert isinstance(est_state, kl.EstimatorState)
  stacked = est_state.stacked["1,2,3"]
  assert stacked.a.shape == (3, 7, 7) and stacked.g.shape == (3, 6, 6)
  view = est_state.blocks
  assert len(view) == 5
  for i in (1, 2, 3):
    np.testing.assert_array_equal(view[i].a, stacked.a[i - 1])
    np.testing.assert_array_equal(view[i].cache["a^-1"],
                                  stacked.cache["a^-1"][i - 1])
  # Restored from flax's serialisation with the same structure.
  from flax import serialization  # pylint: disable=import-outside-toplevel
  back = serialization.from_bytes(tx.init(params),
                                  serialization.to_bytes(state))
  assert jax.tree.structure(back) == jax.tree.structure(state)


@pytest.mark.perf
def test_the_step_splits_nothing_per_layer():
  """The optax step keeps same-shaped blocks stacked: its per-layer slices
  do not grow with the number of same-shaped layers."""
  counts = []
  for depth in (2, 6):
    sizes = [8] + [6] * depth + [3]
    params, batch, loss_fn = _problem(sizes)
    collection = kl.scan(loss_fn, params, batch)
    tx = kl.kfac(0.1, collection, damping=1e-2)
    vgs = kl.value_grad_and_stats(loss_fn, collection)

    def step(params, state, batch, tx=tx, vgs=vgs):
      _, grads, stats = vgs(params, batch, jax.random.PRNGKey(0))
      return tx.update(grads, state, params, stats=stats)

    jaxpr = jax.make_jaxpr(step)(params, tx.init(params), batch)
    # Nothing is split per layer, the statistics included (they are
    # computed per group, as the state holds them); the direction is cut
    # per parameter by the estimator's merge, where the slices fuse with
    # the momentum update (not counted).
    counts.append(helpers.count_primitive(
        jaxpr.jaxpr, "slice", outside=("kfac_merge",), not_into=("cond",)))
  assert counts[0] == counts[1], counts


def test_finite_marker_stands_for_the_statistics():
  est, params, batch = _estimator()
  stats = jax.jit(lambda p: est.compute_stats(p, batch, jax.random.PRNGKey(
      0)))(params)
  assert float(stats.finite_marker) == 0.0
  # A NaN weight in a layer of the stacked group: statistics of the group,
  # hence the marker, are NaN.
  bad = jax.tree.map(lambda x: x, params)
  bad["layer2"]["w"] = bad["layer2"]["w"].at[0, 0].set(jnp.nan)
  bad_stats = jax.jit(lambda p: est.compute_stats(p, batch, jax.random.PRNGKey(
      0)))(bad)
  assert not all(np.all(np.isfinite(x))
                 for x in jax.tree.leaves(bad_stats.blocks[1:4]))
  assert np.isnan(bad_stats.finite_marker)
  grads = jax.grad(helpers.classifier_loss)(params, batch)
  from kfac_jax_lite import transform  # pylint: disable=import-outside-toplevel
  assert bool(transform.inputs_finite(grads, stats))
  assert not bool(transform.inputs_finite(grads, bad_stats))
  # The marker of an average of statistics is the average of the markers.
  mean = jax.tree.map(lambda x, y: (x + y) / 2, stats, bad_stats)
  assert isinstance(mean, kl.Stats) and np.isnan(mean.finite_marker)
  assert not bool(transform.inputs_finite(grads, mean))
  # Stats without a marker are checked leaf by leaf.
  bare = bad_stats.stacked
  assert not bool(transform.inputs_finite(grads, bare))


@pytest.mark.perf
def test_the_finiteness_check_reads_the_marker():
  """The check reads the marker, not every layer's statistics."""
  est, params, batch = _estimator()
  stats = est.compute_stats(params, batch, jax.random.PRNGKey(0))
  grads = jax.grad(helpers.classifier_loss)(params, batch)
  from kfac_jax_lite import transform  # pylint: disable=import-outside-toplevel
  jaxpr = jax.make_jaxpr(transform.inputs_finite)(grads, stats)
  assert helpers.count_primitive(jaxpr.jaxpr, "reduce_sum") <= len(
      jax.tree.leaves(grads)), jaxpr


@pytest.mark.parametrize("first", [0.0, 1.0])
def test_opaque_indices_are_exact(first):
  like = jnp.full((2, 3), first)
  got = jax.jit(lambda x: _xla_cpu.opaque_indices(4, x))(like)
  assert [int(i) for i in got] == [0, 1, 2, 3]
  empty = jax.jit(lambda x: _xla_cpu.opaque_indices(2, x))(jnp.zeros((0, 3)))
  assert [int(i) for i in empty] == [0, 1]


def test_split_at_runtime_indices_equals_static_split():
  tree = {"a": jnp.arange(24.0).reshape(4, 3, 2), "b": jnp.arange(4.0)}
  static = grouping.unstack(tree, 4)
  fn = lambda t: grouping.unstack(t, 4, runtime_index=True)  # noqa: E731
  for g, w in zip(jax.jit(fn)(tree), static):
    helpers.assert_trees_close(g, w, 0.0)


@pytest.mark.perf
def test_split_at_runtime_indices_is_one_conditional():
  """Each index is an output of one conditional, not a literal."""
  tree = {"a": jnp.arange(24.0).reshape(4, 3, 2), "b": jnp.arange(4.0)}
  fn = lambda t: grouping.unstack(t, 4, runtime_index=True)  # noqa: E731
  jaxpr = jax.make_jaxpr(fn)(tree).jaxpr
  assert helpers.count_primitive(jaxpr, "dynamic_slice") == 8
  # One static slice: the element read by the conditional's predicate.
  assert helpers.count_primitive(jaxpr, "slice") == 1
  # The CPU's conditional, inside the CPU branch of the choice made when
  # the program is lowered (other platforms get constants:
  # tests/test_platform_lowering.py).
  assert helpers.count_primitive(jaxpr, "cond") == 2
  assert helpers.count_primitive(jaxpr, "cond", within=("cond",)) == 1


@dataclasses.dataclass(frozen=True)
class _MeanBlock:
  """A block whose statistics' shape follows its inputs' (``per_row``) or
  not: enough to drive the grouping of statistics."""
  per_row: bool
  layer: object = None

  def compute_stats(self, data):
    x = data.inputs[0][0]
    return {"m": jnp.mean(x, 0) if self.per_row else jnp.mean(x)}


def _data(width, fill):
  return blocks_lib.LayerData(inputs=((jnp.full((4, width), fill),),),
                              grads=(), params=(), param_grads=(),
                              batch_size=4)


@pytest.mark.parametrize("per_row", [False, True])
def test_group_statistics_over_different_data_shapes(per_row):
  """Layers of one group whose data differ in shape are computed per data
  shape, then stacked in the group's order when their statistics agree in
  shape, else kept per layer (``Unstacked``) and folded in layer by
  layer."""
  b = _MeanBlock(per_row)
  data = [_data(3, 1.0), _data(5, 2.0), _data(3, 3.0)]
  (got,) = grouping.group_stats([b] * 3, ((0, 1, 2),), data)
  want = [b.compute_stats(d) for d in data]
  if per_row:
    assert isinstance(got, grouping.Unstacked)
    for g, w in zip(got.members, want):
      helpers.assert_trees_close(g, w, 0.0)
    state = jnp.zeros((3,))
    new = grouping.map_group(lambda _, s, x: s + jnp.sum(x["m"]), b, 3,
                             state, got)
    np.testing.assert_array_equal(new, [3.0, 10.0, 9.0])
  else:
    np.testing.assert_array_equal(got["m"], [1.0, 2.0, 3.0])


def test_statistics_of_another_estimator_are_refused():
  est, params, batch = _estimator()
  stats = jax.jit(est.compute_stats)(params, batch, jax.random.PRNGKey(0))
  state = jax.jit(est.init)(params)
  other, p2, b2 = _estimator([8, 6, 6, 3])
  with pytest.raises(ValueError, match="does not match this estimator"):
    est.update_curvature(state, stats=jax.jit(other.compute_stats)(
        p2, b2, jax.random.PRNGKey(0)))
  with pytest.raises(TypeError, match="must be the Stats"):
    est.update_curvature(state, stats=stats.stacked)
  reduced = dataclasses.replace(stats, reduction=("d", "every_update"))
  with pytest.raises(ValueError, match="were reduced for"):
    est.update_curvature(state, stats=reduced)
  for a, b in zip(jax.jit(est.per_layer)(stats), stats.blocks, strict=True):
    helpers.assert_trees_close(a, b, 0.0)
