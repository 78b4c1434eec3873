"""The layer-kind registry, what is derived from it, and user blocks."""

import ast
import dataclasses
import importlib
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import blocks
from kfac_jax_lite import collection
from kfac_jax_lite import kinds
from kfac_jax_lite import tags
from kfac_jax_lite.blocks import base
from tests import block_cases as cases
from tests import blocks_helpers as h
from tests import helpers
from tests import problems
from tests.blocks_helpers import x64  # noqa: F401  (fixture)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kfac_jax_lite"


def test_readme_table_is_the_registry_table():
  readme = (ROOT / "README.md").read_text()
  start = readme.index("| kind | approximations |")
  end = readme.index("\n\n", start)
  assert readme[start:end] == kinds.markdown_table()


def test_derived_tables():
  assert tags.LAYER_KINDS == tuple(kinds.KINDS)
  assert "tied_embedding" in tags.LAYER_KINDS
  assert kl.APPROXIMATIONS is kinds.APPROXIMATIONS
  assert collection.APPROXIMATIONS["conv_multi"] == ("kron_indep", "diagonal",
                                                     "ekfac", "kron_reduce")
  for name, row in kinds.KINDS.items():
    assert kl.APPROXIMATIONS[name] == row.approximations
    assert kl.APPROXIMATIONS[f"{name}_multi"] == row.multi_approximations


@pytest.mark.parametrize("kind,uses,asked,want", [
    ("fully_connected", 3, "kron", "kron_indep"),
    ("fully_connected", 1, None, "kron"),
    ("fully_connected", 3, None, "kron_indep"),
    ("depthwise_conv", 2, "kron", "kron"),   # The kind lists kron itself.
    ("separable_conv", 2, "kron", "kron"),
    ("embedding", 2, "kron", "kron_indep"),
])
def test_resolve_approx_uses_the_registry(kind, uses, asked, want):
  assert collection.resolve_approx(kind, uses, asked, ("['w']",), None) == want


def test_layer_bias_comes_from_the_registry():
  layer = cases.dense(0)[0]
  assert layer.has_bias
  assert not dataclasses.replace(layer, param_paths=layer.param_paths[:1]
                                 ).has_bias
  assert not dataclasses.replace(layer, kind="scale_and_shift").has_bias
  assert cases.separable(0)[0].has_bias
  assert not cases.separable(0, bias=False)[0].has_bias


def test_inner_uses_and_joined_kinds():
  assert kinds.inner_uses("fully_connected", ((8, 5, 3),)) == 5
  assert kinds.inner_uses("embedding", ((8, 2, 3),)) == 6
  assert kinds.inner_uses("conv", ((8, 5, 5, 3),)) == 1
  assert kinds.joined_kind(["embedding", "tied_embedding"]) == "tied_embedding"
  assert kinds.joined_kind(["embedding", "conv"]) is None


def test_unknown_kind_names_the_known_ones():
  with pytest.raises(ValueError, match="'fully_connected'"):
    kinds.kind("dense")


def _imports(path: pathlib.Path) -> set:
  """``kfac_jax_lite`` modules imported by the module at ``path``."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  return {m for m in found if m.startswith("kfac_jax_lite")}


def _module_path(name: str):
  if name == "kfac_jax_lite":
    return None   # The root package re-exports everything; not a dependency.
  rel = pathlib.Path(*name.split(".")[1:])
  for p in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
    if p.exists():
      return p
  return None   # An imported name, not a module.


def _closure(start: str) -> set:
  """Modules ``start`` imports, transitively (but not the root package)."""
  seen, todo = set(), [start]
  while todo:
    name = todo.pop()
    path = _module_path(name)
    if name in seen or path is None:
      continue
    seen.add(name)
    todo.extend(_imports(path))
  return seen


@pytest.mark.parametrize("start", [
    "kfac_jax_lite.kinds", "kfac_jax_lite.layer", "kfac_jax_lite.collection",
    "kfac_jax_lite.tags", "kfac_jax_lite.loss_tags",
    "kfac_jax_lite.conv2d_tags", "kfac_jax_lite.scanner.collect",
    "kfac_jax_lite.scanner.walk", "kfac_jax_lite.scanner.match",
    "kfac_jax_lite.scanner.interpret", "kfac_jax_lite.scanner.facts"])
def test_registry_collection_and_scanner_import_no_block_module(start):
  reached = _closure(start)
  assert start in reached
  assert not {m for m in reached if m.startswith("kfac_jax_lite.blocks")}


def test_blocks_do_not_import_the_collection():
  for path in (PACKAGE / "blocks").glob("*.py"):
    assert "kfac_jax_lite.collection" not in _imports(path), path


def test_every_named_factory_resolves_to_its_function():
  """Each registry name ``"module.function"`` gives that function of
  ``kfac_jax_lite.blocks.module``."""
  for kind, spec in kinds.KINDS.items():
    for approx, name in spec.factories:
      module, function = name.rsplit(".", 1)
      factory = blocks.registered_factory(kind, approx)
      assert factory is not None, (kind, approx)
      family = importlib.import_module(f"kfac_jax_lite.blocks.{module}")
      assert factory is getattr(family, function), (kind, approx, name)


# ---------------------------------------------------------------------------
# A user block, plugged in per call.
# ---------------------------------------------------------------------------


class IsotropicState(NamedTuple):
  tau: jnp.ndarray      # [] mean squared per-example gradient entry
  weight: jnp.ndarray   # [] total EMA weight
  damping: jnp.ndarray  # [] damping at the last update_cache


@dataclasses.dataclass(frozen=True)
class IsotropicBlock(base.Shorthands, base.UnfusedProducts, base.FieldFactors):
  """``F ≈ τ I``: a user block built on the protocol's mixins only."""
  layer: kl.collection.Layer
  config: blocks.BlockConfig
  needs_param_grads = True
  factor_fields = ("tau",)

  def init(self):
    z = jnp.zeros((), jnp.float64)
    return IsotropicState(tau=z, weight=z, damping=z)

  def compute_stats(self, data):
    sq = sum(jnp.sum(jnp.square(g)) for g in data.param_grads)
    n = sum(g[0].size for g in data.param_grads)
    return {"tau": sq / (n * data.batch_size)}

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, self.factor_fields, stats, ema_decay)

  def update_cache(self, state, damping):
    return state._replace(damping=jnp.asarray(damping, state.damping.dtype))

  def multiply_matpower(self, state, v, exp):
    exp = base.check_exp(self, exp)
    return tuple(jnp.power(state.tau + state.damping, exp) * x for x in v)

  def full_fisher_block(self, state):
    n = sum(int(np.prod(s)) for s in self.layer.param_shapes)
    return state.tau * jnp.eye(n)


def _user(layer, config):
  return IsotropicBlock(layer=layer, config=config)


def test_overrides_pick_user_blocks_by_path_then_kind():
  layer = cases.dense(0)[0]   # param paths "['p0']", "['p1']"
  config = blocks.BlockConfig()
  builtin = blocks.make_block(layer, config)
  assert isinstance(builtin, blocks.kronecker.KroneckerBlock)
  by_kind = blocks.make_block(
      layer, config, overrides={("fully_connected", "kron"): _user})
  assert isinstance(by_kind, IsotropicBlock)
  other = blocks.make_block(
      layer, config, overrides={("fully_connected", "full"): _user})
  assert other == builtin
  by_path = blocks.make_block(layer, config, overrides={
      ("fully_connected", "kron"): blocks.registered_factory(
          "fully_connected", "diagonal"),
      "['p": _user})
  assert isinstance(by_path, IsotropicBlock)
  stacked = blocks.make_block(
      dataclasses.replace(layer, stack=2, param_shapes=tuple(
          (2,) + s for s in layer.param_shapes)),
      config, overrides={"['p0']": _user})
  assert isinstance(stacked.inner, IsotropicBlock)
  with pytest.raises(TypeError, match="overrides key"):
    blocks.make_block(layer, config, overrides={("fully_connected",): _user})


@pytest.mark.usefixtures("x64")
def test_user_block_follows_the_protocol():
  layer, data, params = cases.generic(2)[:3]
  block = blocks.make_block(layer, blocks.BlockConfig(),
                            overrides={("generic", "diagonal"): _user})
  assert isinstance(block, base.Block)
  assert not isinstance(block, base.CholeskyProducts)
  assert not isinstance(block, base.FactorBucketed)
  h.check_protocol(block, data, params)


def test_no_block_overrides_a_shared_method():
  """Blocks are final: a mixin's method is used as is or not inherited."""
  mixins = (base.Shorthands, base.UnfusedProducts, base.FieldFactors,
            blocks.per_example.FromSource)
  checked = 0
  for module in vars(blocks).values():
    for cls in vars(module).values() if hasattr(module, "__file__") else ():
      if isinstance(cls, type) and cls not in mixins and any(
          issubclass(cls, m) for m in mixins):
        checked += 1
        for m in mixins:
          shared = {k for k in vars(m) if not k.startswith("__")}
          if issubclass(cls, m):
            assert not shared & set(vars(cls)), cls
  assert checked >= 8


@pytest.mark.usefixtures("x64")
def test_estimator_and_kfac_use_a_user_block_per_call():
  """``block_factories=`` puts a user block on one layer, through the
  estimator's verbs and through ``kfac(estimator=...)``."""
  params, batches, col = problems.small_classifier(2)
  first = col.layers[0].param_paths[0]
  est = kl.FisherEstimator(col, estimation_mode="empirical",
                           block_factories={first: _user})
  assert isinstance(est.blocks[0], IsotropicBlock)
  assert not isinstance(est.blocks[1], IsotropicBlock)
  assert not any(isinstance(b, IsotropicBlock)
                 for b in kl.FisherEstimator(col).blocks)
  # Jitted programs, not hundreds of eager op-by-op compiles.
  state = jax.jit(lambda p, b: est.update_cache(est.update_curvature(
      est.init(p), p, b, ema_decay=0.0), damping=0.5))(params, batches[0])
  tau = est.per_layer(state)[0].tau
  assert float(tau) > 0
  v = jax.tree.map(jnp.ones_like, params)
  got = jax.jit(est.multiply_inverse)(state, v)
  layer0 = [jax.tree_util.keystr(p) for p, _ in
            jax.tree_util.tree_flatten_with_path(params)[0]]
  mine = [g for path, g in zip(layer0, jax.tree.leaves(got))
          if path in col.layers[0].param_paths]
  assert len(mine) == 2
  for g in mine:
    np.testing.assert_allclose(g, 1.0 / (float(tau) + 0.5), rtol=1e-12)
  tx = kl.kfac(0.1, col, estimator=est)
  opt = jax.jit(tx.init)(params)
  vgs = kl.value_grad_and_stats(helpers.classifier_loss, col, estimator=est)

  @jax.jit
  def step(opt, params, batch, key):
    _, grads, stats = vgs(params, batch, key)
    return tx.update(grads, opt, params, stats=stats)
  for i, batch in enumerate(batches):
    updates, opt = step(opt, params, batch, jax.random.PRNGKey(i))
  curvature = opt.inner[0]
  assert isinstance(est.per_layer(curvature.estimator)[0], IsotropicState)
  assert float(est.per_layer(curvature.estimator)[0].tau) > 0
