"""Sequence losses: a loss tag describes the mean over its leading positions.

Every curvature here is checked against an explicit ``Jᵀ H J`` of the
user's scalar loss (``H`` its Hessian with respect to the model outputs),
for the three loss kinds, registered on ``[B, T, E]`` or on the flattened
``[B·T, E]``, with and without a padding mask.
"""

import functools

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import problems
from kfac_jax_lite import linearization

B, T, D, H, E = problems.SEQUENCE_SHAPE
KINDS = ("categorical", "normal", "multi_bernoulli")


@pytest.fixture(name="x64", autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


_params = problems.sequence_params
_model = problems.sequence_model


@functools.partial(jax.jit, static_argnums=(0, 1))
def _batch(kind, seed=1):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (B, T, D))
  if kind == "categorical":
    y = jax.random.randint(ky, (B, T), 0, E)
  elif kind == "normal":
    y = jax.random.normal(ky, (B, T, E))
  else:
    y = jax.random.bernoulli(ky, 0.5, (B, T, E)).astype(x.dtype)
  lengths = jnp.array([T, 2, 3])
  mask = (jnp.arange(T)[None, :] < lengths[:, None]).astype(x.dtype)
  return {"x": x, "y": y, "mask": mask}


def _per_position(kind, z, y):
  """The user's per-position loss ``[...]`` (the NLL up to a constant)."""
  if kind == "categorical":
    return optax.softmax_cross_entropy_with_integer_labels(z, y)
  if kind == "normal":
    return jnp.sum((z - y) ** 2, axis=-1)
  return jnp.sum(optax.sigmoid_binary_cross_entropy(z, y), axis=-1)


def _user_loss(kind, z, batch, masked):
  """What a user writes: ``.mean()``, or the mean over unmasked positions."""
  per = _per_position(kind, z, batch["y"])
  if not masked:
    return jnp.mean(per)
  return jnp.sum(per * batch["mask"]) / jnp.sum(batch["mask"])


def _register(kind, z, y, mask, weight=1.0):
  fn = {"categorical": kl.register_categorical_predictive_distribution,
        "normal": kl.register_normal_predictive_distribution,
        "multi_bernoulli":
            kl.register_multi_bernoulli_predictive_distribution}[kind]
  return fn(z, y, weight=weight, mask=mask)


def _loss_fn(kind, flat, masked):
  def loss_fn(params, batch):
    z = _model(params, batch["x"])
    y, mask = batch["y"], batch["mask"] if masked else None
    if flat:
      lead = B * T
      zf = z.reshape(lead, E)
      yf = y.reshape(lead) if kind == "categorical" else y.reshape(lead, E)
      _register(kind, zf, yf, None if mask is None else mask.reshape(lead))
    else:
      _register(kind, z, y, mask)
    return _user_loss(kind, z, batch, masked)
  return loss_fn


def _explicit_ggn(loss_of_z, params, batch):
  """``Jᵀ H J`` in ``ravel_pytree(params)`` order, ``H = ∇²_z loss``."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)

  @jax.jit  # One program, not hundreds of eager op-by-op compiles.
  def ggn(flat, x):
    z_of = lambda p: _model(unravel(p), x).reshape(-1)  # noqa: E731
    jac = jax.jacobian(z_of)(flat)
    z = z_of(flat)
    hess = jax.hessian(lambda zz: loss_of_z(zz.reshape(B, T, E)))(z)
    return jac.T @ hess @ jac
  return ggn(flat, batch["x"])


def _block_diagonal(m, params):
  """``m`` with the entries between different layers zeroed."""
  sizes = [sum(x.size for x in jax.tree.leaves(params[k]))
           for k in sorted(params)]
  owner = np.repeat(np.arange(len(sizes)), sizes)
  return np.where(owner[:, None] == owner[None, :], m, 0.0)


def _full_fisher(loss_fn, params, batch, mode="exact_GGN", approx="full",
                 **kw):
  collection = kl.scan(loss_fn, params, batch, approximations={
      "fully_connected_multi": approx})
  assert {l.approx for l in collection.layers} == {approx}
  est = kl.FisherEstimator(collection, estimation_mode=mode, **kw)
  return np.asarray(jax.jit(lambda p, b: est.full_fisher(est.update_curvature(
      est.init(p), p, b, jax.random.PRNGKey(5))))(params, batch))


@pytest.mark.parametrize(
    "masked", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", KINDS)
def test_exact_ggn_is_that_of_the_users_mean_loss(kind, masked):
  params, batch = _params(), _batch(kind)
  want = _explicit_ggn(lambda z: _user_loss(kind, z, batch, masked),
                       params, batch)
  flat = _full_fisher(_loss_fn(kind, True, masked), params, batch)
  nested = _full_fisher(_loss_fn(kind, False, masked), params, batch)
  np.testing.assert_allclose(nested, _block_diagonal(want, params),
                             rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(flat, nested, rtol=1e-9, atol=1e-12)
  # The mean over positions, not the sum over the T positions of a row.
  assert not np.allclose(nested, T * _block_diagonal(want, params))


@pytest.mark.parametrize("mode", ["gradients", "curvature_prop", "empirical",
                                  "exact"])
@pytest.mark.parametrize(
    "approx", ["kron_indep", pytest.param("full", marks=pytest.mark.slow)])
def test_flattened_and_nested_tags_give_the_same_statistics(mode, approx):
  params, batch = _params(), _batch("categorical")
  got = [_full_fisher(_loss_fn("categorical", flat, True), params, batch,
                      mode=mode, approx=approx, num_samples=3)
         for flat in (True, False)]
  np.testing.assert_allclose(got[0], got[1], rtol=1e-9, atol=1e-12)
  assert np.abs(got[0]).max() > 1e-3


@pytest.mark.parametrize("masked", [False, True])
def test_sampled_fisher_converges_to_the_users_ggn(masked):
  params, batch = _params(), _batch("categorical")
  want = _block_diagonal(_explicit_ggn(
      lambda z: _user_loss("categorical", z, batch, masked), params, batch),
                         params)
  got = _full_fisher(_loss_fn("categorical", True, masked), params, batch,
                     mode="gradients", num_samples=4000)
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err < 0.05, err


def test_empirical_fisher_uses_each_examples_summed_position_gradients():
  """``(1/N) Σ_b ĝ_b ĝ_bᵀ``, ``ĝ_b`` the gradient of example ``b``'s
  masked summed loss."""
  kind, params, batch = "categorical", _params(), _batch("categorical")
  got = _full_fisher(_loss_fn(kind, True, True), params, batch,
                     mode="empirical")

  def example_sum(p, xb, yb, mb):
    z = _model(p, xb[None])[0]
    return jnp.sum(_per_position(kind, z, yb) * mb)

  @jax.jit
  def explicit(params, batch):
    per_example = jax.vmap(jax.grad(example_sum), (None, 0, 0, 0))(
        params, batch["x"], batch["y"], batch["mask"])
    flat = jax.vmap(lambda g: jax.flatten_util.ravel_pytree(g)[0])(
        per_example)
    return flat.T @ flat / jnp.sum(batch["mask"])
  want = explicit(params, batch)
  np.testing.assert_allclose(got, _block_diagonal(want, params), rtol=1e-9,
                             atol=1e-12)


def test_loss_weights_and_several_tags_add_their_means():
  """``mean_lm + 0.5 · mean_cls``: a ``[B, T, E]`` tag and a ``[B, E]`` one
  (different position counts) sum their own means."""
  params, batch = _params(), _batch("categorical")
  cls_y = jnp.array([0, 2, 1])

  def loss_fn(params, batch):
    z = _model(params, batch["x"])
    _register("categorical", z, batch["y"], batch["mask"])
    pooled = _register("categorical", z[:, 0], cls_y, None, weight=0.5)
    return (_user_loss("categorical", z, batch, True) + 0.5 * jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(pooled, cls_y)))

  def of_z(z):
    return _user_loss("categorical", z, batch, True) + 0.5 * jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(z[:, 0], cls_y))
  want = _explicit_ggn(of_z, params, batch)
  got = _full_fisher(loss_fn, params, batch)
  np.testing.assert_allclose(got, _block_diagonal(want, params), rtol=1e-9,
                             atol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_quadratic_model_gram_is_the_users_ggn(masked):
  kind, params, batch = "categorical", _params(), _batch("categorical")
  want = _explicit_ggn(lambda z: _user_loss(kind, z, batch, masked), params,
                       batch)
  for flat in (True, False):
    collection = kl.scan(_loss_fn(kind, flat, masked), params, batch)
    est = kl.FisherEstimator(collection)
    vs = [jax.tree.map(lambda x, i=i: jnp.sin((i + 1.0) * x + i), params)
          for i in range(2)]

    def gram(p, b, vs=vs, est=est):
      lin = est.linearize(p, b, with_jvp=True)
      jvs = jax.tree.map(lambda *x: jnp.stack(x),
                         *[lin.output_jvp(v) for v in vs])
      return linearization.output_fisher_gram(lin, jvs)
    got = jax.jit(gram)(params, batch)
    flat_vs = jnp.stack([jax.flatten_util.ravel_pytree(v)[0] for v in vs])
    np.testing.assert_allclose(got, flat_vs @ want @ flat_vs.T, rtol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_total_loss_is_the_users_loss(kind):
  params, batch = _params(), _batch(kind)
  z = _model(params, batch["x"])
  spec = kl.LossSpec(kind=kind)
  nll_const = {"categorical": 0.0,
               "normal": 0.5 * np.log(2 * np.pi * 0.5) * E,
               "multi_bernoulli": 0.0}[kind]
  for masked in (False, True):
    mask = batch["mask"] if masked else None
    got = kl.losses.total_loss([spec], [z], [batch["y"]], [mask])
    want = _user_loss(kind, z, batch, masked) + nll_const
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_stats_fraction_keeps_whole_sequences_of_a_flattened_tag():
  params, batch = _params(), _batch("categorical")
  batch = jax.tree.map(lambda x: jnp.concatenate([x, x[::-1]]), batch)
  collection = kl.scan(_flat_masked, params, batch)
  est = kl.FisherEstimator(collection, estimation_mode="exact",
                           stats_fraction=0.5, stats_min_examples=1)
  key = jax.random.PRNGKey(0)
  first = jax.tree.map(lambda x: x[:B], batch)
  one = kl.FisherEstimator(kl.scan(_flat_masked, params, first),
                           estimation_mode="exact")

  @jax.jit  # One program, not hundreds of eager op-by-op compiles.
  def run(params, batch, first, key):
    lin = est.linearize(params, batch)
    head = est.linearize_head(params, batch, lin)
    assert head is not lin and head.zs[0].shape == (B * T, E)
    want = one.compute_stats(params, first, key)
    # Cut in the pass (the whole batch linearised) or by a head pass.
    return want, (est.stats_from(lin, key), est.stats_from(head, key))
  want, both = run(params, batch, first, key)
  for stats in both:
    for got, ref in zip(stats.blocks, want.blocks):
      for k in ("a", "g"):
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-9, atol=1e-12)


def _flat_masked(params, batch):
  """A flattened masked categorical tag, for any number of sequences."""
  z = _model(params, batch["x"])
  _register("categorical", z.reshape(-1, E), batch["y"].reshape(-1),
            batch["mask"].reshape(-1))
  return _user_loss("categorical", z, batch, True)


def test_a_fully_masked_batch_gives_zero_statistics():
  params, batch = _params(), _batch("categorical")
  batch["mask"] = jnp.zeros_like(batch["mask"])
  got = _full_fisher(_loss_fn("categorical", True, True), params, batch,
                     mode="gradients")
  assert np.all(np.isfinite(got)) and np.all(got == 0.0)


def test_mask_of_a_wrong_shape_is_refused():
  with pytest.raises(ValueError, match=r"mask has shape \(3,\).*\(2, 4\)"):
    kl.register_categorical_predictive_distribution(
        jnp.zeros((2, 4, 5)), mask=jnp.ones((3,)))
  with pytest.raises(ValueError, match="class axis last"):
    kl.register_categorical_predictive_distribution(jnp.zeros((5,)))


def _nested_masked(params, batch):
  z = _model(params, batch["x"])
  _register("categorical", z, batch["y"], batch["mask"])
  return _user_loss("categorical", z, batch, True)


def _one_update(tx, params, batch):
  updates, _ = jax.jit(lambda p, b: tx.update(
      jax.grad(_flat_masked)(p, b), tx.init(p), p, batch=b))(params, batch)
  return updates


def test_scale_by_kfac_is_the_same_for_flattened_and_nested_tags():
  params, batch = _params(), _batch("categorical")
  got = [_one_update(kl.scale_by_kfac(kl.scan(fn, params, batch),
                                      estimation_mode="exact"),
                     params, batch)
         for fn in (_flat_masked, _nested_masked)]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
               *got)


def test_kfac_optimizer_is_the_same_for_flattened_and_nested_tags():
  params, batch = _params(), _batch("categorical")
  batch = jax.tree.map(lambda x: jnp.concatenate([x, x[::-1]] * 2), batch)
  got = [_one_update(kl.kfac_optimizer(kl.scan(fn, params, batch),
                                       estimation_mode="exact"),
                     params, batch)
         for fn in (_flat_masked, _nested_masked)]
  for g in got:
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(g))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
               *got)
