"""User blocks through block_factories: the example of docs/custom_blocks.md,
every estimator verb against its explicit matrix, and data parallelism."""

import dataclasses
import pathlib
import re
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite.blocks import base
from tests import helpers

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "custom_blocks.md"
R = 4  # replicas (helpers.replica_devices)


def _doc_example() -> dict:
  """Runs the example block's code block of the docs page."""
  code = [c for c in re.findall(r"```python\n(.*?)```", DOC.read_text(),
                                re.S) if "class IsotropicKronBlock" in c]
  assert len(code) == 1
  namespace = {}
  # pylint: disable-next=exec-used
  exec(compile(code[0], str(DOC), "exec"), namespace)
  return namespace


EXAMPLE = _doc_example()
isotropic_kron = EXAMPLE["isotropic_kron"]


@pytest.fixture(name="x64", autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


class TauState(NamedTuple):
  tau: jnp.ndarray      # [] mean squared summed-gradient entry
  weight: jnp.ndarray   # [] total EMA weight
  damping: jnp.ndarray  # [] damping at the last update_cache


@dataclasses.dataclass(frozen=True)
class TauBlock(base.Shorthands, base.UnfusedProducts, base.FieldFactors):
  """``F ≈ τ I`` from the summed parameter gradients (needs_param_grads)."""
  layer: kl.Layer
  config: kl.blocks.BlockConfig
  needs_param_grads = True
  factor_fields = ("tau",)

  def init(self):
    z = jnp.zeros(())
    return TauState(tau=z, weight=z, damping=z)

  def compute_stats(self, data):
    sq = sum(jnp.sum(jnp.square(g)) for g in data.param_grads)
    return {"tau": sq / (self.layer.num_params * data.batch_size)}

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, self.factor_fields, stats, ema_decay)

  def update_cache(self, state, damping):
    return state._replace(damping=jnp.asarray(damping, state.damping.dtype))

  def multiply_matpower(self, state, v, exp):
    exp = base.check_exp(self, exp)
    return tuple(jnp.power(state.tau + state.damping, exp) * x for x in v)

  def full_fisher_block(self, state):
    return state.tau * jnp.eye(self.layer.num_params)


def _tau(layer, config):
  return TauBlock(layer=layer, config=config)


FACTORIES = {("fully_connected", "kron"): isotropic_kron,
             "['layer1']": _tau}


def _problem():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [6, 8, 8, 3])
  batches = [helpers.classification_batch(jax.random.PRNGKey(i), 16, 6, 3)
             for i in range(3)]
  return params, batches, kl.scan(helpers.classifier_loss, params,
                                  batches[0])


def _ravel_indices(params, layer):
  """The positions of the layer's leaves in ``ravel_pytree(params)``."""
  sizes = [x.size for x in jax.tree.leaves(params)]
  starts = np.cumsum([0] + sizes)
  return np.concatenate([np.arange(starts[i], starts[i + 1])
                         for i in layer.param_indices])


def _flat(tree, layer):
  leaves = jax.tree.leaves(tree)
  return jnp.concatenate([leaves[i].reshape(-1) for i in layer.param_indices])


def test_every_verb_is_the_explicit_isotropic_kronecker_block():
  params, batches, col = _problem()
  est = kl.FisherEstimator(col, estimation_mode="exact",
                           block_factories={("fully_connected", "kron"):
                                            isotropic_kron}, exps=(-1, -0.5),
                           compute_cholesky=True,
                           compute_cholesky_inverse=True)
  ref = kl.FisherEstimator(col, estimation_mode="exact")
  kinds_ = [type(b).__name__ for b in est.blocks]
  assert kinds_ == ["IsotropicKronBlock"] * 3
  lam = 0.3

  def run(e, p):
    s = e.update_curvature(e.init(p), p, batches[0])
    return e.update_cache(s, damping=lam)
  state = jax.jit(run, static_argnums=0)(est, params)
  ref_state = jax.jit(run, static_argnums=0)(ref, params)
  v = jax.tree.map(lambda x: jnp.cos(jnp.arange(x.size).reshape(x.shape)
                                     + 1.0), params)
  exps = {"multiply": 1.0, "inverse": -1.0, "matpower": -0.5,
          "cholesky": 0.5, "cholesky_inverse": -0.5}

  @jax.jit
  def verbs(state, v):
    return est.full_fisher(state), {
        "multiply": est.multiply(state, v),
        "inverse": est.multiply_inverse(state, v),
        "matpower": est.multiply_matpower(state, v, -0.5),
        "cholesky": est.multiply_cholesky(state, v),
        "cholesky_inverse": est.multiply_cholesky_inverse(state, v)}
  full, products = verbs(state, v)
  for i in range(3):
    layer, mine, kron = (col.layers[i], est.per_layer(state)[i],
                         ref.per_layer(ref_state)[i])
    alpha = np.trace(kron.a) / kron.a.shape[0]
    beta = np.trace(kron.g) / kron.g.shape[0]
    np.testing.assert_allclose([mine.alpha, mine.beta], [alpha, beta],
                               rtol=1e-12)
    for name, got in products.items():
      np.testing.assert_allclose(
          _flat(got, layer),
          (alpha * beta + lam) ** exps[name] * _flat(v, layer),
          rtol=1e-12, err_msg=name)
    idx = _ravel_indices(params, layer)
    np.testing.assert_allclose(full[np.ix_(idx, idx)],
                               alpha * beta * np.eye(len(idx)), rtol=1e-12)


def _train(axis_name, distributed_inverses=False, devices=None):
  """Three kfac steps with the user blocks: on one device with the whole
  batch, or under pmap over R replicas (``devices``) of B / R examples
  each."""
  params, batches, col = _problem()
  est = kl.FisherEstimator(col, estimation_mode="exact", damping=0.0,
                           block_factories=FACTORIES, axis_name=axis_name,
                           distributed_inverses=distributed_inverses)
  tx = kl.kfac(0.1, col, estimator=est, damping=0.05,
               inverse_update_period=1)

  def step(params, state, batch):
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    if axis_name is not None:
      grads = lax.pmean(grads, axis_name)
    updates, state = tx.update(grads, state, params, batch=batch)
    return jax.tree.map(jnp.add, params, updates), state

  state = tx.init(params)
  if axis_name is None:
    fn = jax.jit(step)
  else:
    fn = jax.pmap(step, axis_name=axis_name, devices=devices)
    params, state = (jax.tree.map(lambda x: jnp.stack([x] * R), t)
                     for t in (params, state))
    batches = [jax.tree.map(lambda x: x.reshape((R, -1) + x.shape[1:]), b)
               for b in batches]
  for b in batches:
    params, state = fn(params, state, b)
  if axis_name is not None:
    for x in jax.tree.leaves((params, state)):
      for r in range(1, R):
        np.testing.assert_array_equal(x[r], x[0])
    params, state = jax.tree.map(lambda x: x[0], (params, state))
  (curv,) = [x for x in jax.tree.leaves(
      state, is_leaf=lambda n: isinstance(n, kl.CurvatureState))
              if isinstance(x, kl.CurvatureState)]
  return params, est.per_layer(curv.estimator)


@pytest.mark.parametrize("distributed_inverses", [
    False, pytest.param(True, marks=pytest.mark.slow)])
def test_pmap_with_axis_name_is_one_device_on_the_whole_batch(
    distributed_inverses):
  with helpers.on_replica_devices(R) as devices:
    want_params, want_blocks = _train(None)
    got_params, got_blocks = _train("batch", distributed_inverses, devices)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10,
                                                       atol=1e-13),
               got_params, want_params)
  for got, want in zip(got_blocks, want_blocks):
    for k in got._fields:
      np.testing.assert_allclose(getattr(got, k), getattr(want, k),
                                 rtol=1e-10, err_msg=k)
  assert float(got_blocks[1].tau) > 0 and float(got_blocks[0].alpha) > 0


def test_block_factories_are_checked():
  _, _, col = _problem()
  with pytest.raises(ValueError, match="matches no layer"):
    kl.FisherEstimator(col, block_factories={"['layer9']": _tau})
  with pytest.raises(ValueError, match="matches no layer"):
    kl.FisherEstimator(col, block_factories={("conv", "kron"): _tau})
  with pytest.raises(TypeError, match="without .*multiply_matpower"):
    kl.FisherEstimator(col, block_factories={
        "['layer0']": lambda layer, config: object()})
  with pytest.raises(TypeError, match="must be a function"):
    kl.FisherEstimator(col, block_factories={"['layer0']": 3})
  est = kl.FisherEstimator(col, block_factories=FACTORIES,
                           compute_cholesky=True)
  with pytest.raises(ValueError, match="layer1.*TauBlock.*no Cholesky"):
    est.multiply_cholesky(est.init(_problem()[0]), _problem()[0])
  with pytest.raises(ValueError, match="used once per example"):
    isotropic_kron(dataclasses.replace(col.layers[0], num_uses=2), None)
