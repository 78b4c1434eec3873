"""Generated configurations: every layer kind through the whole transform.

A configuration is a *structure* (the compiled part: a small model of one
layer kind from :mod:`kfac_jax_lite.kinds` with one of its approximations,
used once or several times per example, a parameter dtype, a loss with or
without a mask, an estimation mode, data parallelism under ``pmap`` with
``stats_sync`` and ``distributed_inverses``, the refresh period, and
whether statistics come with the batch or from ``value_grad_and_stats``)
and *numbers* drawn by hypothesis for it (parameter, data, sampling and
vector seeds, the damping, the EMA decay). Each structure is compiled once
(:func:`_runner`) and serves all its drawn numbers.

The structures of a tier come from :func:`plan`: every kind of the registry
(default tier), or every (kind, approximation) pair for single- and
multi-use layers (slow tier), with the other fields spread so that each of
their values occurs. A kind added to the registry is planned automatically;
without a model in ``tests/generated_models.py`` it fails
:func:`test_every_registered_kind_has_a_model`.

Invariants checked on each configuration, over two steps of
``scale_by_kfac``:

* finite directions, factors and every other state leaf;
* ``vᵀ F̂⁻¹ v > 0`` and ``multiply(multiply_inverse(v)) = v`` for the
  damped curvature (``v`` in the factors' dtype; the second where the
  approximation has products at exp 1), after a further EMA update at the
  drawn decay and a refresh at the drawn damping; for bf16 and f16
  parameters, ``multiply_inverse`` of a vector in that dtype is the
  product in the factors' dtype rounded once;
* the state's structure, shapes, dtypes and weak types equal ``init``'s
  after each step;
* one trace per structure: the second step, and every later configuration
  of the same structure, reuse the first compilation;
* under ``pmap``: every replica holds the same direction and product, and
  the same state where the factors were synchronised;
* a checkpoint round trip (raw bytes through ``np.savez``) restores the
  state bitwise, and the next step from it is bitwise the next step from
  the original.

Each test asserts how many distinct configurations it ran (each differs
from the others in at least one drawn field), so the figures cannot drop
silently; ``-s`` prints them with the count of compiled structures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import json
import zlib
from typing import Any, Optional

import hypothesis
from hypothesis import strategies as st
import jax
import jax.flatten_util
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import kinds
from kfac_jax_lite import linearization
from tests import generated_models as gm
from tests import helpers

DTYPES = ("float32", "bfloat16", "float16")
SLOW_DTYPES = DTYPES + ("float64",)


@dataclasses.dataclass(frozen=True)
class Dist:
  """Data parallelism: ``replicas`` devices under ``pmap`` (0: ``jit``)."""
  replicas: int = 0
  stats_sync: str = "every_update"
  distributed_inverses: bool = False

  def __str__(self):
    if not self.replicas:
      return "jit"
    return (f"pmap{self.replicas}-{self.stats_sync}"
            + ("-distinv" if self.distributed_inverses else ""))


DISTS = (Dist(), Dist(2), Dist(2, "before_refresh"), Dist(4, "every_update",
                                                          True),
         Dist(2, "before_refresh", True), Dist(4, "before_refresh"))
# What plan() spreads over the structures: every option, and jit (the
# cheapest to compile) three times in eight.
PLANNED_DISTS = DISTS + (Dist(), Dist())


@dataclasses.dataclass(frozen=True)
class Structure:
  """The compiled part of a configuration."""
  model: gm.ModelSpec
  mode: str = "gradients"
  dist: Dist = Dist()
  period: int = 1          # inverse_update_period
  feed: str = "batch"      # update(..., batch=) or (..., stats=)

  def __str__(self):
    m = self.model
    return "-".join(map(str, (
        m.kind, m.approx, m.uses, m.dtype, m.loss + ("+mask" * m.masked),
        self.mode, self.dist, f"p{self.period}", self.feed)))


@functools.cache
def layer_uses(kind: str, uses: str) -> int:
  """Uses per example of the model's layer of ``kind`` (scanned once)."""
  spec = gm.ModelSpec(kind, None, uses)
  loss = gm.make_loss(spec)
  c = kl.scan(loss, gm.make_params(spec, 0), gm.make_batch(spec, 0),
              strict=True)
  layer, = [l for l in c.layers if l.param_paths[0].startswith("['layer']")]
  return layer.num_uses


def _balanced(values, n, rng):
  """``n`` values: concatenated random permutations (each value occurs)."""
  out = []
  while len(out) < n:
    out.extend(rng.permutation(len(values)))
  return [values[i] for i in out[:n]]


def plan(tier: str) -> list:
  """The structures of a tier, derived from the registry of kinds.

  ``"default"``: one structure per kind (its approximation, uses and every
  other field spread over the kinds). ``"slow"``: every (kind,
  approximation) pair used once, and every pair used several times per
  example (two tag sites or a ``lax.scan``, alternating).
  """
  rng = np.random.default_rng(0 if tier == "default" else 1)
  pairs = []
  multi = itertools.cycle(("sites", "scan"))
  # A kind without a model fails test_every_registered_kind_has_a_model.
  for kind in [k for k in kinds.KINDS if k in gm.LAYERS]:
    if tier == "default":
      uses = gm.USES[len(pairs) % len(gm.USES)]
      approxes = kinds.approximations(kind, layer_uses(kind, uses))
      pairs.append((kind, approxes[rng.integers(len(approxes))], uses))
      continue
    for approx in kinds.approximations(kind, layer_uses(kind, "one")):
      pairs.append((kind, approx, "one"))
    for approx in kinds.approximations(kind, 2):
      uses = next(multi)
      assert layer_uses(kind, uses) > 1, (kind, uses)
      pairs.append((kind, approx, uses))
  n = len(pairs)
  fields = dict(
      dtype=_balanced(DTYPES if tier == "default" else SLOW_DTYPES, n, rng),
      loss=_balanced(gm.LOSSES, n, rng),
      masked=_balanced((False, True), n, rng),
      mode=_balanced(linearization.MODES, n, rng),
      dist=_balanced(PLANNED_DISTS, n, rng),
      period=_balanced((1, 2), n, rng),
      feed=_balanced(("batch", "stats"), n, rng))
  out = []
  for i, (kind, approx, uses) in enumerate(pairs):
    f = {k: v[i] for k, v in fields.items()}
    dist = f["dist"] if f["dtype"] != "float64" else Dist()
    out.append(Structure(
        gm.ModelSpec(kind, approx, uses, f["dtype"], f["loss"], f["masked"]),
        f["mode"], dist, f["period"], f["feed"]))
  return out


# ---------------------------------------------------------------------------
# One compiled step per structure.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Runner:
  """A structure's model, transform and compiled step (``traces`` counts
  the times the step was traced)."""
  structure: Structure
  loss: Any
  collection: Any
  estimator: Any
  tx: Any
  fn: Any
  exp1: bool = True
  traces: int = 0
  first_traces: Optional[int] = None
  trace_avals: list = dataclasses.field(default_factory=list)

  def retrace_diff(self) -> str:
    """The step's inputs whose types differ between the last two traces."""
    if len(self.trace_avals) < 2:
      return ""
    return "; ".join(
        f"{jax.tree_util.keystr(p)}: {jax.typeof(x)} then {jax.typeof(y)}"
        for (p, x), (_, y) in zip(*self.trace_avals[-2:])
        if jax.typeof(x) != jax.typeof(y))


def _x64(structure: Structure):
  if structure.model.dtype == "float64":
    return jax.enable_x64(True)
  return contextlib.nullcontext()


@functools.cache
def _runner(structure: Structure) -> Runner:
  """Builds (once) the step of ``structure``:

  ``fn(params, state, batch, rng, decay, damping, v) -> (direction, state,
  products)``: one ``scale_by_kfac`` update on ``batch``; then, from its
  new estimator state, one more EMA update at ``decay`` with the same
  statistics, a refresh at ``damping``, ``products["quad"] = vᵀ F̂⁻¹ v``
  and ``products["back"] = F̂ (F̂⁻¹ v)`` (where the approximation has
  products at exp 1) for ``v`` in the factors' dtype; for a low-precision
  ``v`` also ``F̂⁻¹ v`` in both dtypes (``inv_low``, ``inv``).
  """
  s, m = structure, structure.model
  loss = gm.make_loss(m)
  collection = gm.scan_collection(m, loss, gm.make_params(m, 0),
                                  gm.make_batch(m, 0))
  axis = "d" if s.dist.replicas else None
  est = kl.FisherEstimator(
      collection, exps=(-1,), estimation_mode=s.mode, axis_name=axis,
      stats_sync=s.dist.stats_sync if axis else "every_update",
      distributed_inverses=s.dist.distributed_inverses)
  tx = kl.scale_by_kfac(collection, estimator=est, damping=1e-2,
                        inverse_update_period=s.period)
  vgs = kl.value_grad_and_stats(loss, collection, estimator=est)
  runner = Runner(s, loss, collection, est, tx, None)
  try:  # Products at exp 1, unless the approximation says it has none.
    plain = kl.FisherEstimator(collection)   # No axis: traced outside pmap.
    jax.eval_shape(lambda p: plain.multiply(plain.init(p), p),
                   gm.make_params(m, 0))
  except ValueError as e:
    if "supports exp" not in str(e):
      raise
    runner.exp1 = False

  def step(params, state, batch, rng, decay, damping, v):
    runner.traces += 1
    runner.trace_avals.append(jax.tree_util.tree_flatten_with_path(
        (params, state, batch, rng, decay, damping, v))[0])
    _, grads, stats = vgs(params, batch, rng)
    if axis:
      grads = lax.pmean(grads, axis)
    feed = dict(stats=stats) if s.feed == "stats" else dict(batch=batch)
    direction, state = tx.update(grads, state, params, **feed)
    es = est.update_curvature(state.estimator, stats=stats, ema_decay=decay)
    es = est.update_cache(es, damping)
    wide = jax.tree.map(lambda x: x.astype(_wide(x.dtype)), v)
    inv = est.multiply_inverse(es, wide)
    products = {"quad": sum(jnp.vdot(a, b) for a, b in zip(
        jax.tree.leaves(wide), jax.tree.leaves(inv)))}
    if runner.exp1:
      products["back"] = est.multiply(es, inv)
      products["dense"] = _dense(lambda u: est.multiply(es, u), wide)
    if m.dtype in LOW:
      products.update(inv=inv, inv_low=est.multiply_inverse(es, v))
    return direction, state, products

  if axis:
    runner.fn = jax.pmap(step, axis,
                         devices=helpers.replica_devices(s.dist.replicas))
  else:
    runner.fn = jax.jit(step)
  return runner


# ---------------------------------------------------------------------------
# Invariants.
# ---------------------------------------------------------------------------


def _avals(tree):
  return [(x.shape, x.dtype, jax.typeof(x).weak_type)
          for x in jax.tree.leaves(tree)]


def _assert_same_avals(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for i, (g, w) in enumerate(zip(_avals(got), _avals(want))):
    assert g == w, f"{what}: leaf {i} is {g}, was {w}"


def _assert_finite(tree, what):
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    x = np.asarray(x)
    if x.dtype.kind == "f" or x.dtype.name in ("bfloat16",):
      assert np.all(np.isfinite(x.astype(np.float64))), (
          f"{what}{jax.tree_util.keystr(path)} is not finite")


def checkpoint(tree) -> bytes:
  """``tree``'s leaves as raw bytes in an ``.npz`` (bitwise, any dtype)."""
  leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
  header = [(x.dtype.name, x.shape) for x in leaves]
  buf = io.BytesIO()
  np.savez(buf, header=np.frombuffer(json.dumps(header).encode(), np.uint8),
           **{f"l{i}": np.frombuffer(x.tobytes(), np.uint8)
              for i, x in enumerate(leaves)})
  return buf.getvalue()


def restore(data: bytes, like):
  """The tree saved by :func:`checkpoint`, with ``like``'s structure and
  shardings (as orbax restores to a target)."""
  with np.load(io.BytesIO(data)) as z:
    header = json.loads(z["header"].tobytes())
    leaves = [np.frombuffer(z[f"l{i}"].tobytes(), jnp.dtype(d)).reshape(shape)
              for i, (d, shape) in enumerate(header)]
  targets = jax.tree.leaves(like)
  return jax.tree.unflatten(jax.tree.structure(like), [
      jax.device_put(x, t.sharding) for x, t in zip(leaves, targets,
                                                    strict=True)])


def _assert_bitwise(got, want, what):
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got),
                                 jax.tree.leaves(want), strict=True)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape, (what, i)
    assert g.tobytes() == w.tobytes(), f"{what}: leaf {i} differs"


def _assert_replicas_equal(tree, what):
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    x = np.asarray(x)
    for r in range(1, x.shape[0]):
      assert x[r].tobytes() == x[0].tobytes(), (
          f"{what}{jax.tree_util.keystr(path)}: replica {r} differs from 0")


LOW = ("bfloat16", "float16")
# multiply ∘ multiply_inverse = id, for vectors in the factors' dtype:
# float32 round-off times the damped blocks' condition number, up to
# ROUNDTRIP_COND (most drawn models stay below it at the smallest drawn
# damping); past it, the bound grows with the measured condition number.
ROUNDTRIP_RTOL = {"float64": 1e-9, "float32": 1e-3}
ROUNDTRIP_COND = 1e4


def _wide(dtype):
  """The factors' dtype for parameters of ``dtype``."""
  return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _assert_rounded_once(low, wide, what):
  """``low`` (bf16/f16) is ``wide`` rounded once: within the unit roundoff
  ``u`` of the low dtype, elementwise (and ``u`` times a thousandth of the
  largest entry, for entries near zero)."""
  for (path, lo), wi in zip(jax.tree_util.tree_leaves_with_path(low),
                            jax.tree.leaves(wide), strict=True):
    u = float(jnp.finfo(lo.dtype).eps) / 2
    name = lo.dtype.name
    lo, wi = (np.asarray(x, np.float64) for x in (lo, wi))
    bad = np.abs(lo - wi) > u * (np.abs(wi) + 1e-3 * np.abs(wi).max())
    assert not bad.any(), (
        f"{what}{jax.tree_util.keystr(path)}: the {name} product is not "
        f"the wide one rounded once: {lo[bad][:3]} vs {wi[bad][:3]}")


def _dense(multiply, like):
  """The dense matrix of the damped curvature ``multiply`` applies (one
  product per parameter: the generated models are small)."""
  flat, unravel = jax.flatten_util.ravel_pytree(like)
  return jax.vmap(lambda e: jax.flatten_util.ravel_pytree(
      multiply(unravel(e)))[0])(jnp.eye(flat.size, dtype=flat.dtype))


def _condition_number(dense) -> float:
  """The largest 2-norm condition number of ``dense`` (``[..., P, P]``,
  one matrix per replica), in float64."""
  dense = np.asarray(dense, np.float64).reshape((-1,) + dense.shape[-2:])
  eig = np.linalg.eigvalsh(0.5 * (dense + np.swapaxes(dense, -1, -2)))
  return float(np.max(eig[:, -1] / eig[:, 0]))


def _relative_error(got, want):
  got = np.concatenate([np.asarray(x, np.float64).ravel()
                        for x in jax.tree.leaves(got)])
  want = np.concatenate([np.asarray(x, np.float64).ravel()
                         for x in jax.tree.leaves(want)])
  return np.linalg.norm(got - want) / np.linalg.norm(want)


@dataclasses.dataclass(frozen=True)
class Numbers:
  """The drawn numbers of one configuration."""
  param_seed: int
  data_seeds: tuple
  rng_seed: int
  v_seed: int
  decay: float
  damping: float


def numbers():
  """Seeds, an EMA decay in [0, 0.99] and a damping in [1e-3, 1]."""
  seed = st.integers(0, 2 ** 31 - 1)
  return st.builds(
      Numbers, seed, st.tuples(seed, seed), seed, seed,
      st.floats(0.0, 0.99),
      st.floats(-3.0, 0.0).map(lambda e: float(10.0 ** e)))


def _key(seed: int):
  """``jax.random.PRNGKey(seed)`` (a raw threefry key), made in numpy."""
  return jnp.asarray(np.array([0, seed], np.uint32))


def check(structure: Structure, nums: Numbers) -> None:
  """Two steps of ``structure`` on ``nums``, and every invariant."""
  with _x64(structure):
    _check(structure, nums)


def _check(structure: Structure, nums: Numbers) -> None:
  m, r = structure.model, structure.dist.replicas
  runner = _runner(structure)
  # The collection describes the drawn approximation.
  layer, = [l for l in runner.collection.layers
            if l.param_paths[0].startswith("['layer']")]
  assert (layer.kind, layer.approx) == (m.kind, m.approx), layer
  params = gm.make_params(m, nums.param_seed)
  state0 = runner.tx.init(params)
  state0 = state0._replace(rng=_key(nums.rng_seed))
  v_rng = np.random.default_rng(nums.v_seed)
  v = jax.tree.map(lambda p: jnp.asarray(v_rng.standard_normal(p.shape).astype(
      p.dtype)), params)
  batches = [gm.make_batch(m, s) for s in nums.data_seeds]
  fdtype = jnp.float64 if m.dtype == "float64" else jnp.float32
  decay, damping = fdtype(nums.decay), fdtype(nums.damping)
  rngs = [_key(nums.rng_seed + i) for i in (1, 2)]
  if r:
    # Placed as pmap places its outputs, so that a state coming out of a
    # step is passed in as the initial state was.
    sharding = NamedSharding(Mesh(np.array(helpers.replica_devices(r)),
                                  ("d",)),
                             PartitionSpec("d"))
    rep = lambda t: jax.device_put(jax.tree.map(  # noqa: E731
        lambda a: np.stack([np.asarray(a)] * r), t), sharding)
    split = lambda t: jax.device_put(jax.tree.map(  # noqa: E731
        lambda a: np.asarray(a).reshape((r, -1) + a.shape[1:]), t), sharding)
    params, state0, v = rep(params), rep(state0), rep(v)
    batches = [split(b) for b in batches]
    decay, damping, rngs = rep(decay), rep(damping), [rep(k) for k in rngs]

  def run(state, i):
    out = runner.fn(params, state, batches[i], rngs[i], decay, damping, v)
    if runner.first_traces is None:
      # jit traces once; pmap may trace more than once on its first call.
      runner.first_traces = runner.traces
      assert r or runner.traces == 1, f"{structure}: traced {runner.traces}"
    assert runner.traces == runner.first_traces, (
        f"{structure}: traced again ({runner.traces} traces, "
        f"{runner.first_traces} on the first call): "
        f"{runner.retrace_diff()}")
    return out

  state = state0
  for i in range(2):
    direction, new_state, products = run(state, i)
    what = f"{structure} step {i}"
    _assert_same_avals(new_state, state0, f"{what}: state")
    _assert_same_avals(direction, params, f"{what}: direction")
    _assert_finite((direction, new_state, products), f"{what}: ")
    assert np.all(np.asarray(products["quad"]) > 0), (
        f"{what}: v^T F^-1 v <= 0")
    if runner.exp1:
      err = _relative_error(products["back"], v)
      cond = _condition_number(products["dense"])
      rtol = ROUNDTRIP_RTOL["float64" if m.dtype == "float64"
                            else "float32"] * max(1.0, cond / ROUNDTRIP_COND)
      assert err <= rtol, (
          f"{what}: |F(F^-1 v) - v| / |v| = {err:.3g} > {rtol:.3g} at "
          f"damping {nums.damping:.3g}, condition number {cond:.3g}")
    if m.dtype in LOW:
      _assert_rounded_once(products["inv_low"], products["inv"], what)
    if r:
      _assert_replicas_equal((direction, products), f"{what}: ")
      refreshed = i % structure.period == 0
      if structure.dist.stats_sync == "every_update" or refreshed:
        _assert_replicas_equal(new_state, f"{what}: state")
    if i == 0:
      restored = restore(checkpoint(new_state), new_state)
      _assert_bitwise(restored, new_state, f"{what}: restored state")
      again = run(restored, 1)
    state = new_state
  _assert_bitwise(again, (direction, new_state, products),
                  f"{structure}: the step after a restore")


# ---------------------------------------------------------------------------
# The tiers.
# ---------------------------------------------------------------------------

# Drawn configurations per structure, and the tier totals they must reach.
PER_STRUCTURE = {"default": 10, "slow": 47}
TARGET = {"default": 80, "slow": 2000}
SEEN = {"default": set(), "slow": set()}


def _run_tier(tier: str, structure: Structure) -> None:
  """``PER_STRUCTURE[tier]`` configurations of ``structure``. A structure
  under ``pmap`` runs on ``helpers.replica_devices`` (the simulated CPU
  devices beside one GPU), with its arrays and eager ops there too."""
  replicas = structure.dist.replicas
  with (helpers.on_replica_devices(replicas) if replicas
        else contextlib.nullcontext()):
    _run_configurations(tier, structure)


def _run_configurations(tier: str, structure: Structure) -> None:
  seen = set()

  # A fixed seed per structure: a reproducible run, and different numbers
  # for different structures. Spare examples stand in for the duplicates
  # hypothesis may draw (those are not run again); each structure runs
  # PER_STRUCTURE distinct configurations.
  @hypothesis.seed(zlib.crc32(str(structure).encode()))
  @hypothesis.settings(
      max_examples=PER_STRUCTURE[tier] + 5, database=None,
      deadline=None, phases=(hypothesis.Phase.generate,),
      suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(nums=numbers())
  def prop(nums):
    if nums not in seen and len(seen) < PER_STRUCTURE[tier]:
      check(structure, nums)
      seen.add(nums)

  prop()
  # Distinct drawn numbers of one structure: distinct configurations.
  assert len(seen) == PER_STRUCTURE[tier], (
      f"{structure}: only {len(seen)} distinct configurations ran")
  SEEN[tier].update((structure, n) for n in seen)
  print(f"\n{tier}: {structure}: {len(seen)} configurations; in this "
        f"process {len(SEEN[tier])} configurations of "
        f"{_runner.cache_info().currsize} compiled structures")


DEFAULT = plan("default")
SLOW = plan("slow")


def test_plans_cover_the_registry_and_reach_the_targets():
  for tier, structures in (("default", DEFAULT), ("slow", SLOW)):
    assert len(set(structures)) == len(structures)
    assert {s.model.kind for s in structures} == set(kinds.KINDS), tier
    for field, values in (("dtype", DTYPES), ("loss", gm.LOSSES),
                          ("uses", gm.USES), ("masked", (False, True))):
      assert {getattr(s.model, field) for s in structures} >= set(values), (
          tier, field)
    assert {s.mode for s in structures} == set(linearization.MODES), tier
    assert {s.dist for s in structures} >= set(DISTS), tier
    # Each structure must run PER_STRUCTURE distinct configurations.
    assert len(structures) * PER_STRUCTURE[tier] >= TARGET[tier], tier
  # Slow: every (kind, approximation) pair, single- and multi-use.
  pairs = {(s.model.kind, s.model.approx,
            layer_uses(s.model.kind, s.model.uses) > 1) for s in SLOW}
  for kind, row in kinds.KINDS.items():
    for n in (1, 2):
      if kind == "tied_embedding" and n == 1:
        continue   # A tied table is always used several times.
      for approx in row.allowed(n):
        assert (kind, approx, n > 1) in pairs, (kind, approx, n)


def test_every_registered_kind_has_a_model():
  missing = set(kinds.KINDS) - set(gm.LAYERS)
  assert not missing, (
      f"layer kinds {sorted(missing)} have no model in "
      "tests/generated_models.py LAYERS: add one, so the generated suite "
      "covers them")


@pytest.mark.parametrize("structure", DEFAULT, ids=str)
def test_generated_default(structure):
  _run_tier("default", structure)


@pytest.mark.slow
@pytest.mark.parametrize("structure", SLOW, ids=str)
def test_generated_slow(structure):
  _run_tier("slow", structure)
