"""scale_by_kfac_eigen_adam / kfac_soap: Adam in K-FAC's eigenbasis.

The reference is written out in numpy (float64): the eigendecompositions
of the factors the state holds at each refresh, SOAP's Algorithm 1 with
the first moment kept in the parameters' coordinates, and optax's Adam for
the leaves outside dense layers.
"""

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers

B1, B2, EPS = 0.9, 0.8, 1e-8


def _loss(params, batch):
  """Dense 5 -> 4 (bias, tanh), a generic scale, dense 4 -> 3 (no bias),
  squared error."""
  x, y = batch
  p = params["l0"]
  h = jnp.tanh(kl.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"]))
  h = h * kl.register_generic(params["scale"])
  out = kl.register_dense(h @ params["l1"]["w"], h, params["l1"]["w"])
  # A Gaussian output: its G has no null direction (a softmax's has one,
  # where the rotated gradient is round-off that Adam scales to O(1)).
  target = jax.nn.one_hot(y, 3)
  kl.register_normal_predictive_distribution(out, target)
  return 0.5 * jnp.mean(jnp.sum(jnp.square(out - target), -1))


def _problem(num_batches=5, batch_size=16):
  k = jax.random.PRNGKey(0)
  params = {"l0": {"w": jax.random.normal(k, (5, 4)) / 2,
                   "b": 0.1 * jax.random.normal(jax.random.fold_in(k, 1),
                                                (4,))},
            "scale": 1.0 + 0.1 * jax.random.normal(jax.random.fold_in(k, 2),
                                                   (4,)),
            "l1": {"w": jax.random.normal(jax.random.fold_in(k, 3), (4, 3))}}
  batches = [helpers.classification_batch(jax.random.PRNGKey(10 + i),
                                          batch_size, 5, 3)
             for i in range(num_batches)]
  return params, batches, kl.scan(_loss, params, batches[0])


def _run(tx, params, batches):
  """Directions and states of ``tx`` at fixed params, one per batch."""
  update = jax.jit(lambda g, s, b: tx.update(g, s, params, batch=b))
  state, dirs, states = tx.init(params), [], []
  for b in batches:
    d, state = update(jax.grad(_loss)(params, b), state, b)
    dirs.append(d)
    states.append(state)
  return dirs, states


def _power_step(f, q):
  """SOAP's basis update (its Algorithm 4): the columns of ``q`` sorted by
  ``diag(qᵀ f q)``, largest first, then ``qr(f q)``; and that order."""
  order = np.argsort(-np.diag(q.T @ f @ q), kind="stable")
  return np.linalg.qr(f @ q[:, order])[0], order


def _reference(grads, factors, period, rotate_nu, basis):
  """SOAP's Algorithm 1 on one layer's ``[d_a, d_g]`` gradients.

  ``factors[t]``: the ``(A, G)`` the state held after step ``t``; the basis
  is their eigenvectors at step 0, and at steps ``p, 2p, ...`` their
  eigenvectors again (``basis="eigh"``) or one :func:`_power_step` from
  the last basis (``"qr"``; ``V``'s rows and columns follow the sort when
  it is not rotated). ``M`` is kept in the parameters' coordinates and
  rotated in every step; ``V`` in the basis.
  """
  m = np.zeros_like(grads[0])
  v = np.zeros_like(grads[0])
  qa = qg = None
  out = []
  for t, (g, (a, gf)) in enumerate(zip(grads, factors)):
    if t % period == 0:
      if qa is None or basis == "eigh":
        na, ng = np.linalg.eigh(a)[1], np.linalg.eigh(gf)[1]
      else:
        (na, oa), (ng, og) = _power_step(a, qa), _power_step(gf, qg)
        if not rotate_nu:
          v = v[oa][:, og]
      if qa is not None and rotate_nu:
        v = np.square(qa.T @ na).T @ v @ np.square(qg.T @ ng)
      qa, qg = na, ng
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * np.square(qa.T @ g @ qg)
    n = t + 1
    mhat = (qa.T @ m @ qg) / (1 - B1 ** n)
    out.append(qa @ (mhat / (np.sqrt(v / (1 - B2 ** n)) + EPS)) @ qg.T)
  return out


@pytest.mark.parametrize("rotate_nu,basis", [
    (False, "qr"), (True, "eigh"),
    pytest.param(True, "qr", marks=pytest.mark.slow),
    pytest.param(False, "eigh", marks=pytest.mark.slow)])
def test_rotated_moments_match_a_dense_reference(rotate_nu, basis):
  params, batches, c = _problem()
  tx = kl.scale_by_kfac_eigen_adam(
      c, b1=B1, b2=B2, eps=EPS, refresh_period=2, cov_ema_decay=0.5,
      rotate_second_moments=rotate_nu, basis_update=basis)
  assert kl.rotated_layers(c) == tuple(
      c.layers[i].name for i in (0, 2))
  dirs, states = _run(tx, params, batches)
  f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  grads = [jax.grad(_loss)(params, b) for b in batches]
  for i, (key, bias) in enumerate((("l0", True), ("l1", False))):
    layer = 2 * i  # Layer order: l0, the generic scale, l1.
    gmat = [f64(g[key]["w"]) if not bias else np.concatenate(
        [f64(g[key]["w"]), f64(g[key]["b"])[None]]) for g in grads]
    facts = [(f64(s.curvature.estimator.blocks[layer].a),
              f64(s.curvature.estimator.blocks[layer].g)) for s in states]
    want = _reference(gmat, facts, 2, rotate_nu, basis)
    for t, d in enumerate(dirs):
      got = f64(d[key]["w"])
      if bias:
        got = np.concatenate([got, f64(d[key]["b"])[None]])
      np.testing.assert_allclose(got, want[t], rtol=2e-4, atol=2e-5)
  # The generic scale (no Kronecker block) takes optax's Adam.
  adam = optax.scale_by_adam(B1, B2, EPS)
  st = adam.init(params["scale"])
  for g, d in zip(grads, dirs):
    want, st = adam.update(g["scale"], st)
    np.testing.assert_allclose(d["scale"], want, rtol=1e-6)


def _spd(d, seed):
  """A symmetric PSD ``[d, d]`` matrix with eigenvalues ``1, 2, ..., d``
  and its eigenvectors (columns)."""
  q = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))[0]
  return (q * np.arange(1.0, d + 1)) @ q.T, q


def test_power_basis_step_keeps_an_eigenbasis_and_sorts_it():
  f, q = _spd(6, 0)
  new, order, r = kl.linalg.power_basis_step(jnp.asarray(f, jnp.float32),
                                             jnp.asarray(q, jnp.float32))
  np.testing.assert_array_equal(order, np.arange(6)[::-1])
  np.testing.assert_allclose(r, np.arange(6.0, 0, -1), rtol=1e-5)
  # The same columns, largest eigenvalue first, up to their signs.
  np.testing.assert_allclose(np.abs(np.sum(np.asarray(new) * q[:, ::-1], 0)),
                             np.ones(6), rtol=1e-5)


def test_power_basis_steps_converge_to_the_eigenbasis():
  """Orthogonal iteration from a random basis: each column's Rayleigh
  quotient reaches its eigenvalue (ratios ``λ_{i+1}/λ_i`` at most 5/6)."""
  f, q = _spd(6, 1)
  basis = jnp.asarray(np.linalg.qr(
      np.random.default_rng(2).normal(size=(6, 6)))[0], jnp.float32)
  step = jax.jit(kl.linalg.power_basis_step)
  for _ in range(300):
    basis, _, r = step(jnp.asarray(f, jnp.float32), basis)
  np.testing.assert_allclose(r, np.arange(6.0, 0, -1), rtol=1e-3)
  np.testing.assert_allclose(np.abs(np.sum(np.asarray(basis) * q[:, ::-1],
                                           0)), np.ones(6), atol=1e-3)


def test_second_moments_are_those_of_the_rotated_gradients():
  """``V`` in the state is the EMA of ``(Q_Aᵀ ∇W Q_G)²`` (one basis, no
  refresh after step 0)."""
  params, batches, c = _problem(3)
  tx = kl.scale_by_kfac_eigen_adam(c, b1=B1, b2=B2, refresh_period=100)
  _, states = _run(tx, params, batches)
  blk = states[0].curvature.estimator.blocks[2]
  qa, qg = (np.asarray(blk.cache[k], np.float64)
            for k in ("a_eigvec", "g_eigvec"))
  v = 0.0
  for b in batches:
    g = np.asarray(jax.grad(_loss)(params, b)["l1"]["w"], np.float64)
    v = B2 * v + (1 - B2) * np.square(qa.T @ g @ qg)
  name = [n for n in states[-1].nu if n.split(",") == ["2"]][0]
  np.testing.assert_allclose(states[-1].nu[name], v, rtol=1e-4, atol=1e-9)


def _bytes_round_trip(tree):
  leaves, treedef = jax.tree.flatten(tree)
  raw = [(np.asarray(x).tobytes(), np.asarray(x).dtype, np.shape(x))
         for x in leaves]
  return jax.tree.unflatten(treedef, [
      jnp.asarray(np.frombuffer(b, dt).reshape(s)) for b, dt, s in raw])


@pytest.mark.parametrize("basis", ["eigh", "qr"])
def test_checkpoint_and_resume_is_bitwise(basis):
  params, batches, c = _problem(6)
  tx = kl.kfac_soap(1e-2, c, refresh_period=2, stats_fraction=1.0,
                    basis_update=basis)
  step = jax.jit(lambda p, s, b: tx.update(jax.grad(_loss)(p, b), s, p,
                                           batch=b))

  def train(p, s, bs):
    for b in bs:
      u, s = step(p, s, b)
      p = optax.apply_updates(p, u)
    return p, s

  p3, s3 = train(params, tx.init(params), batches[:3])
  want = train(p3, s3, batches[3:])
  got = train(_bytes_round_trip(p3), _bytes_round_trip(s3), batches[3:])
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(x, y)
  assert isinstance(s3.inner[0], kl.EigenAdamState)
  assert int(s3.inner[0].curvature.num_inverse_updates) == 2


def test_skips_a_nonfinite_step_and_keeps_its_moments():
  params, batches, c = _problem(1)
  tx = kl.kfac_soap(1e-2, c, stats_fraction=1.0)
  update = jax.jit(lambda g, s: tx.update(g, s, params, batch=batches[0]))
  grads = jax.grad(_loss)(params, batches[0])
  _, state = update(grads, tx.init(params))
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  updates, new = update(bad, state)
  assert int(new.num_skipped) == 1
  assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
  old, now = state.inner[0], new.inner[0]
  for x, y in zip(jax.tree.leaves((old.count, old.mu, old.nu, old.rest_mu,
                                   old.rest_nu)),
                  jax.tree.leaves((now.count, now.mu, now.nu, now.rest_mu,
                                   now.rest_nu))):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "basis", ["eigh", pytest.param("qr", marks=pytest.mark.slow)])
def test_data_parallel_matches_one_device(basis):
  """shard_map over 4 devices (a quarter of the batch each, gradients
  averaged, factors averaged over the axis) gives the one-device run."""
  params, batches, c = _problem(4, batch_size=32)

  def make(axis):
    est = kl.FisherEstimator(c, damping_type="exact", axis_name=axis,
                             estimation_mode="empirical")
    return kl.scale_by_kfac_eigen_adam(None, refresh_period=2,
                                       estimator=est, basis_update=basis)

  with helpers.on_replica_devices(4) as devices:
    mesh = Mesh(np.array(devices), ("d",))
    want, want_states = _run(make(None), params, batches)
    tx = make("d")

    def step(state, batch):
      g = jax.grad(_loss)(params, batch)
      g = jax.tree.map(lambda x: x / lax.axis_size("d"), g)
      return tx.update(g, state, params, batch=batch)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d")),
                               out_specs=(P(), P())))
    # Placed as the step returns it (replicated over the mesh): one
    # compile, not a second one for the state the first step hands back.
    state = jax.device_put(jax.jit(tx.init)(params),
                           NamedSharding(mesh, P()))
    got = []
    for b in batches:
      d, state = fn(state, b)
      got.append(d)
  helpers.assert_trees_close(got, want, rtol=1e-4)
  helpers.assert_trees_close(
      [state.mu, state.nu], [want_states[-1].mu, want_states[-1].nu],
      rtol=1e-4)


def test_qr_bases_move_alike_when_factors_sync_before_refresh():
  """``stats_sync="before_refresh"`` under ``pmap`` (each replica folds its
  own quarter of the batch): the QR step averages the factors first, as
  the ``eigh`` refresh does, so every replica moves the same bases, and
  those of one device fed the whole batch (the EMA is linear)."""
  params, batches, c = _problem(5, batch_size=32)

  def make(axis, sync):
    est = kl.FisherEstimator(c, damping_type="exact", axis_name=axis,
                             estimation_mode="empirical", stats_sync=sync)
    return kl.scale_by_kfac_eigen_adam(None, refresh_period=2,
                                       estimator=est, basis_update="qr")

  _, want = _run(make(None, "every_update"), params, batches)
  with helpers.on_replica_devices(4) as devices:
    tx = make("d", "before_refresh")

    def step(state, batch):
      g = lax.pmean(jax.grad(_loss)(params, batch), "d")
      return tx.update(g, state, params, batch=batch)[1]

    fn = jax.pmap(step, axis_name="d", devices=devices)
    state = jax.tree.map(lambda x: jnp.stack([x] * 4), tx.init(params))
    for b in batches:
      state = fn(state, jax.tree.map(
          lambda x: x.reshape((4, -1) + x.shape[1:]), b))
  assert int(state.curvature.num_inverse_updates[0]) == 3
  for layer in (0, 2):
    for key in ("a_eigvec", "g_eigvec"):
      got = np.asarray(state.curvature.estimator.blocks[layer].cache[key])
      ref = np.asarray(want[-1].curvature.estimator.blocks[layer].cache[key])
      for r in range(4):
        np.testing.assert_allclose(np.abs(got[r]), np.abs(ref), atol=1e-4)


@pytest.mark.parametrize("kwargs,words", [
    (dict(b1=1.0), ["b1=1.0", "[0, 1)"]),
    (dict(b2=-0.1), ["b2=-0.1", "[0, 1)"]),
    (dict(eps=0.0), ["eps=0.0", "> 0"]),
    (dict(refresh_period=0), ["refresh_period=0", "positive int"]),
    (dict(cov_ema_decay=1.0), ["cov_ema_decay=1.0", "[0, 1)"]),
    (dict(cov_update_period=2.5), ["cov_update_period=2.5", "positive"]),
    (dict(rotate_second_moments="yes"), ["rotate_second_moments='yes'",
                                         "True or False"]),
    (dict(basis_update="QR"), ["basis_update='QR'", "'qr'", "'eigh'"]),
])
def test_bad_arguments_name_the_argument_and_value(kwargs, words):
  _, _, c = _problem(1)
  for make in (kl.scale_by_kfac_eigen_adam,
               lambda c, **kw: kl.kfac_soap(1e-3, c, **kw)):
    if "cov_update_period" in kwargs and make is not (
        kl.scale_by_kfac_eigen_adam):
      continue
    with pytest.raises(ValueError) as err:
      make(c, **kwargs)
    for w in words:
      assert w in str(err.value)


def test_bad_estimator_and_collection():
  _, _, c = _problem(1)
  with pytest.raises(ValueError, match="damping_type='pi'.*'exact'"):
    kl.scale_by_kfac_eigen_adam(None, estimator=kl.FisherEstimator(c))
  est = kl.FisherEstimator(c, damping_type="exact")
  with pytest.raises(ValueError, match="axis_name='d' given with estimator"):
    kl.scale_by_kfac_eigen_adam(None, estimator=est, axis_name="d")
  with pytest.raises(TypeError, match="collection=.*LayerCollection.*dict"):
    kl.scale_by_kfac_eigen_adam({})
  with pytest.raises(TypeError, match="estimator=.*FisherEstimator"):
    kl.scale_by_kfac_eigen_adam(None, estimator="est")


@pytest.mark.parametrize("kwargs,words", [
    (dict(stats_fraction=0.0), ["stats_fraction", "0.0"]),
    (dict(weight_decay=-1.0), ["weight_decay=-1.0", ">= 0"]),
    (dict(learning_rate=-1.0), ["learning_rate=-1.0", ">= 0"]),
])
def test_kfac_soap_bad_arguments(kwargs, words):
  _, _, c = _problem(1)
  kwargs = {"learning_rate": 1e-3, **kwargs}
  with pytest.raises(ValueError) as err:
    kl.kfac_soap(collection=c, **kwargs)
  for w in words:
    assert w in str(err.value)


def test_update_without_params_says_so():
  params, batches, c = _problem(1)
  tx = kl.scale_by_kfac_eigen_adam(c)
  with pytest.raises(ValueError, match="needs params="):
    tx.update(params, tx.init(params), batch=batches[0])
