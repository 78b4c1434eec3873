"""Skipping non-finite steps without copying the curvature state.

``kfac`` and ``kfac_optimizer`` never put the factors or caches inside a
conditional or a select on "the inputs are finite": the curvature state
guards itself (``update_curvature`` gates its counters, key and refresh on
its inputs being finite).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import _xla_cpu
from kfac_jax_lite import trees
from tests import helpers
from tests import problems


@pytest.fixture(name="problem", scope="module")
def _problem():
  params, batches, collection = problems.small_classifier(3)
  vgs = kl.value_grad_and_stats(helpers.classifier_loss, collection)
  return params, batches, collection, vgs


def _kfac_state(state):
  return state.inner[0]


def test_nonfinite_grads_keep_schedule_caches_and_momentum(problem):
  """Non-finite gradients: zero update, counters, key, caches and momentum
  unchanged. Finite statistics of the same batch are still folded in (they
  describe its curvature); non-finite statistics are not."""
  params, batches, c, vgs = problem
  vgs = jax.jit(vgs)
  tx = kl.kfac(0.1, c, damping=1e-2, inverse_update_period=1)
  step = jax.jit(lambda g, s, p, st: tx.update(g, s, p, stats=st))
  state = tx.init(params)
  _, grads, stats = vgs(params, batches[0], jax.random.PRNGKey(0))
  _, state = step(grads, state, params, stats)

  _, grads, stats = vgs(params, batches[1], jax.random.PRNGKey(1))
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  updates, new = step(bad, state, params, stats)
  assert int(new.num_skipped) == 1
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  old_k, new_k = _kfac_state(state), _kfac_state(new)
  for name in ("count", "rng", "num_inverse_updates", "num_cov_updates"):
    np.testing.assert_array_equal(getattr(new_k, name), getattr(old_k, name))
  for ob, nb in zip(old_k.estimator.blocks, new_k.estimator.blocks):
    for key in ob.cache:
      np.testing.assert_array_equal(nb.cache[key], ob.cache[key])
  for o, n in zip(jax.tree.leaves(state.inner[1:]),
                  jax.tree.leaves(new.inner[1:])):
    np.testing.assert_array_equal(n, o)   # momentum
  # Finite statistics were folded into the factors.
  assert not np.array_equal(new_k.estimator.blocks[0].a,
                            old_k.estimator.blocks[0].a)

  nan_stats = jax.tree.map(lambda x: x * jnp.nan, stats)
  _, new = step(grads, state, params, nan_stats)
  assert int(new.num_skipped) == 1
  assert not bool(new.last_finite) and not bool(_kfac_state(new).last_finite)
  for o, n in zip(jax.tree.leaves(_kfac_state(state)._replace(last_finite=0)),
                  jax.tree.leaves(_kfac_state(new)._replace(last_finite=0))):
    np.testing.assert_array_equal(n, o)


def _conds(jaxpr, factor_shapes):
  """``(takes a factor-shaped operand, nested conds that take one)`` per
  top-level cond (small nested conds, such as linalg.opaque_indices', are
  not counted, nor conds on ``jax.lax.platform_dependent``'s platform
  index, which lowering resolves: no conditional at run time)."""
  def takes(eqn):
    return any(getattr(v.aval, "shape", None) in factor_shapes
               for v in eqn.invars)

  def runtime_conds(eqns):
    platform = {v for e in eqns if e.primitive.name == "platform_index"
                for v in e.outvars}
    return [e for e in eqns if e.primitive.name == "cond"
            and e.invars[0] not in platform]

  out = []
  for eqn in runtime_conds(jaxpr.eqns):
    nested = sum(1 for br in eqn.params["branches"]
                 for e in runtime_conds(br.jaxpr.eqns) if takes(e))
    out.append((takes(eqn), nested))
  return out


@pytest.mark.perf
@pytest.mark.parametrize("make", ["kfac", "kfac_optimizer"])
def test_no_conditional_around_the_curvature_state(problem, make):
  """Only the inverse refresh's ``lax.cond`` takes factor-sized operands,
  and it is not nested inside another conditional (as it was when a
  skip-if-non-finite ``cond`` wrapped the whole update)."""
  params, batches, c, vgs = problem
  tx = (kl.kfac(0.1, c, inverse_update_period=5) if make == "kfac"
        else kl.kfac_optimizer(c, damping_adaptation_interval=5))
  state = tx.init(params)
  _, grads, stats = vgs(params, batches[0], jax.random.PRNGKey(0))
  kw = {"stats": stats}
  if make == "kfac_optimizer":
    kw["batch"] = batches[0]
  jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params, **kw))(
      grads, state).jaxpr
  curvature = state.inner[0] if make == "kfac" else state.curvature
  factor_shapes = {x.shape for x in jax.tree.leaves(curvature.estimator)
                   if x.ndim == 2}
  assert factor_shapes == {(7, 7), (8, 8), (9, 9), (3, 3)}
  big = [c for c in _conds(jaxpr, factor_shapes) if c[0]]
  assert len(big) == 1, big
  assert big[0][1] == 0, big


def _copied_parameters(compiled_text):
  """Numbers of the entry computation's parameters that it copies."""
  entry = compiled_text[compiled_text.index("\nENTRY"):]
  names = dict(re.findall(r"%([\w.\-]+) = \S+ parameter\((\d+)\)", entry))
  assert names, "no parameters found in the compiled entry computation"
  return {int(names[n]) for n in re.findall(r" copy\(%([\w.\-]+)\)", entry)
          if n in names}


def _update_and_velocity(problem, make):
  """``(tx, update, velocity)``: ``update(params, state, batch) ->
  (updates, state)`` of ``make`` (``kfac`` from ``value_grad_and_stats``,
  ``kfac_optimizer`` from its own pass), and ``velocity(state)`` its
  velocity leaves."""
  c, vgs = problem[2], problem[3]
  if make == "kfac":
    tx = kl.kfac(0.1, c, weight_decay=1e-3)

    def update(p, s, b):
      _, grads, stats = vgs(p, b, jax.random.PRNGKey(0))
      return tx.update(grads, s, p, stats=stats)
    return tx, update, lambda s: s.inner[-2].trace
  tx = kl.kfac_optimizer(c)
  return (tx, lambda p, s, b: tx.update(None, s, p, batch=b),
          lambda s: s.velocity)


@pytest.mark.perf
@pytest.mark.parametrize("make", ["kfac", "kfac_optimizer"])
def test_velocity_is_updated_in_place(problem, make):
  """With params and state donated, the compiled step writes the new
  velocity over the old one without copying the old one first: the
  update handed to ``apply_updates`` is read from the new velocity, not
  recomputed from the old (which XLA did, and then copied every velocity
  leaf, a parameter-sized copy per step)."""
  params, batches = problem[:2]
  tx, update, velocity = _update_and_velocity(problem, make)

  def step(p, s, b):
    u, s = update(p, s, b)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  leaves = jax.tree.leaves((params, state, batches[0]))
  ids = {id(x) for x in jax.tree.leaves(velocity(state))}
  numbers = {i for i, x in enumerate(leaves) if id(x) in ids}
  assert len(numbers) == len(jax.tree.leaves(params))
  text = jax.jit(step, donate_argnums=(0, 1), keep_unused=True).lower(
      params, state, batches[0]).compile().as_text()
  assert not numbers & _copied_parameters(text)


def _ancestors(jaxpr, var):
  """Top-level variables ``var`` is computed from (itself included)."""
  producer = {o: e for e in jaxpr.eqns for o in e.outvars}
  seen, todo = set(), [var]
  while todo:
    v = todo.pop()
    if v in seen:
      continue
    seen.add(v)
    if v in producer:
      todo.extend(i for i in producer[v].invars if not hasattr(i, "val"))
  return seen


@pytest.mark.perf
@pytest.mark.parametrize("make", ["kfac", "kfac_optimizer"])
def test_update_is_read_from_the_new_velocity(problem, make):
  """Each returned update leaf is computed from the state's new velocity
  leaf (the selected one), so the step needs one kernel per parameter for
  the velocity and none of its own for the update, which fuses into
  ``apply_updates``; computed beside it from the unselected velocity, XLA
  recomputed ``μv + d`` there from the old velocity."""
  params, batches = problem[:2]
  tx, update, velocity = _update_and_velocity(problem, make)
  fn = lambda s: update(params, s, batches[0])  # noqa: E731
  state = tx.init(params)
  closed = jax.make_jaxpr(fn)(state)
  updates, new = jax.tree.unflatten(
      jax.tree.structure(jax.eval_shape(fn, state)), closed.jaxpr.outvars)
  for u, v in zip(jax.tree.leaves(updates), jax.tree.leaves(velocity(new))):
    assert v in _ancestors(closed.jaxpr, u)


def _count(jaxpr, name):
  """Top-level equations of primitive ``name`` (branches not entered)."""
  return sum(1 for e in jaxpr.eqns if e.primitive.name == name)


def test_kfac_optimizer_grads_none_is_one_forward_pass(problem):
  """``update(None, ...)`` takes the gradient from the optimizer's own
  linearisation: the same updates and state as with ``jax.grad``, and one
  forward pass (one ``tanh`` per hidden layer) where the two-pass step
  traces two."""
  params, batches, c, _ = problem
  tx = kl.kfac_optimizer(c, damping_adaptation_interval=2)

  def one_pass(p, s, b):
    return tx.update(None, s, p, batch=b)

  def two_pass(p, s, b):
    return tx.update(jax.grad(helpers.classifier_loss)(p, b), s, p, batch=b)

  results = []
  for fn in (one_pass, two_pass):
    p, s = params, tx.init(params)
    step = jax.jit(fn)
    for b in batches:
      u, s = step(p, s, b)
      p = jax.tree.map(lambda x, d: x + d, p, u)
    results.append((p, s))
  helpers.assert_trees_close(results[0], results[1], rtol=1e-5)
  assert float(results[0][1].loss) > 0   # the loss of the last batch
  s0 = tx.init(params)
  assert _count(jax.make_jaxpr(one_pass)(params, s0, batches[0]).jaxpr,
                "tanh") == 1
  assert _count(jax.make_jaxpr(two_pass)(params, s0, batches[0]).jaxpr,
                "tanh") == 2


@pytest.mark.perf
def test_kfac_reads_each_gradient_leaf_once(problem):
  """``kfac`` checks the gradients as its product reads them (the ``[W;
  b]`` matrices, ``FisherEstimator.product_inputs``), so each gradient
  leaf has one reader in the update: whatever computed it (an L2 term's
  ``2λW``) fuses into the kernel that builds the matrix instead of being
  materialised for a finiteness check of its own. Unclipped: KL clipping
  (``kfac``'s default ``norm_constraint``) reads the gradient a second
  time for its inner product ``gᵀF̂⁻¹g``."""
  params, batches, c, vgs = problem
  tx = kl.kfac(0.1, c, damping=1e-2, norm_constraint=None)
  _, grads, stats = vgs(params, batches[0], jax.random.PRNGKey(0))
  jaxpr = jax.make_jaxpr(lambda g, s, p, st: tx.update(g, s, p, stats=st))(
      grads, tx.init(params), params, stats).jaxpr
  for v in jaxpr.invars[:len(jax.tree.leaves(grads))]:
    readers = [e.primitive.name for e in jaxpr.eqns
               if any(x is v for x in e.invars)]
    assert len(readers) == 1, readers


@pytest.mark.slow
def test_product_inputs_equal_the_plain_product(problem):
  """``multiply_matpower(..., inputs=)`` multiplies the stacked groups'
  inputs; a state of another estimator is refused with the fix."""
  params, batches, c, vgs = problem
  est = kl.FisherEstimator(c, damping=1e-2)
  _, grads, _ = vgs(params, batches[0], jax.random.PRNGKey(0))
  state = est.init(params)
  inputs = est.product_inputs(state, grads)
  wrong = state._replace(stacked={"99": state.stacked[next(iter(
      state.stacked))]})
  with pytest.raises(ValueError, match="does not match this estimator"):
    est.multiply_matpower(wrong, grads, -1, inputs=inputs)
  grouped = est.update_cache(state)
  helpers.assert_trees_close(
      est.multiply_matpower(grouped, grads, -1, inputs=inputs),
      est.multiply_matpower(grouped, grads, -1), rtol=1e-6)


def test_nonfinite_gradient_outside_every_layer_skips_the_step():
  """A parameter in no layer (excluded by ``params_filter``) is
  preconditioned by nothing, but its gradient is still checked: a NaN
  there skips the step like a NaN in a layer's."""
  params = helpers.mlp_params(jax.random.PRNGKey(0), [6, 8, 3])
  params["scale"] = jnp.ones(())

  def loss(p, b):
    return p["scale"] * helpers.classifier_loss(
        {k: v for k, v in p.items() if k != "scale"}, b)

  batch = helpers.classification_batch(jax.random.PRNGKey(1), 16, 6, 3)
  c = kl.scan(loss, params, batch,
              params_filter=lambda path: "scale" not in path)
  tx = kl.kfac(0.1, c, damping=1e-2)
  state = tx.init(params)
  _, grads, stats = kl.value_grad_and_stats(loss, c)(
      params, batch, jax.random.PRNGKey(2))
  for bad, skipped in ((False, 0), (True, 1)):
    g = dict(grads, scale=jnp.where(bad, jnp.nan, grads["scale"]))
    updates, new = jax.jit(tx.update)(g, state, params, stats=stats)
    assert int(new.num_skipped) == skipped
    assert all(bool(jnp.all(jnp.isfinite(u)))
               for u in jax.tree.leaves(updates))
    if bad:
      helpers.assert_trees_close(updates, jax.tree.map(jnp.zeros_like,
                                                       updates), rtol=0)


def test_replicas_skip_together(problem):
  """Under ``stats_sync="before_refresh"`` each replica folds its own
  statistics; when one replica's are not finite, every replica skips, so
  the counters (and the schedule) stay identical."""
  params, batches, c, _ = problem
  axis = "d"
  tx = kl.kfac(0.1, c, damping=1e-2, inverse_update_period=2,
               axis_name=axis, stats_sync="before_refresh")
  vgs = kl.value_grad_and_stats(helpers.classifier_loss, c, axis_name=axis,
                                stats_sync="before_refresh")

  def step(p, s, b, poison):
    _, grads, stats = vgs(p, b, jax.random.PRNGKey(0))
    grads = jax.lax.pmean(grads, axis)
    bad = poison & (jax.lax.axis_index(axis) == 0)
    stats = jax.tree.map(lambda x: jnp.where(bad, jnp.nan, x), stats)
    return tx.update(grads, s, p, stats=stats)

  n = 2
  rep = lambda t: jax.tree.map(lambda x: jnp.stack([x] * n), t)  # noqa: E731
  with helpers.on_replica_devices(n) as devices:
    x, y = batches[0]
    split = (x.reshape(n, -1, x.shape[-1]), y.reshape(n, -1))
    pstep = jax.pmap(step, axis_name=axis, devices=devices)
    state = rep(tx.init(params))
    for poison in (False, True):
      _, state = pstep(rep(params), state, split,
                       jnp.array([poison] * n))
  np.testing.assert_array_equal(state.num_skipped, [1, 1])
  np.testing.assert_array_equal(state.inner[0].count, [1, 1])
  np.testing.assert_array_equal(state.inner[0].num_inverse_updates, [1, 1])


@pytest.mark.parametrize(
    "where", ["none", "huge", "small", "large", "bf16", "inf", "-inf large",
              "complex"])
def test_all_finite_checks_every_float_leaf(where):
  """Every float leaf kind, NaN and ±inf; finite values near the float32
  maximum (whose plain sum overflows) are finite."""
  scale = 3e38 / 40 if where == "huge" else 1.0
  small = [jnp.ones((3, 4)) * i * scale for i in range(40)]  # concatenated
  large = jnp.ones((_xla_cpu.FINITE_ALONE + 5,)) * scale        # checked alone
  half = jnp.ones((7,), jnp.bfloat16)                        # its own chunk
  cplx = jnp.ones((6,), jnp.complex64)
  ints = jnp.arange(5)                                       # always finite
  bad = {"small": ("small", 17), "large": ("large", None),
         "bf16": ("half", None), "inf": ("small", 3),
         "-inf large": ("large", None), "complex": ("cplx", None)}.get(where)
  value = {"inf": jnp.inf, "-inf large": -jnp.inf}.get(where, jnp.nan)
  if bad and bad[0] == "small":
    small[bad[1]] = small[bad[1]].at[1, 2].set(value)
  elif bad and bad[0] == "large":
    large = large.at[-1].set(value)
  elif bad and bad[0] == "cplx":
    cplx = cplx.at[2].set(1j * jnp.inf)
  elif bad:
    half = half.at[3].set(value)
  tree = {"s": small, "l": large, "h": half, "c": cplx, "i": ints}
  got = jax.jit(trees.all_finite)(tree)
  assert bool(got) == (where in ("none", "huge"))
  assert bool(trees.all_finite({})) and bool(trees.all_finite([ints]))
