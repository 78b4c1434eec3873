"""The Equinox char GPT of examples/equinox_gpt.py: what scan finds in it,
and one kfac_adamw step on it."""

import jax
import numpy as np
import pytest

import kfac_jax_lite
from tests import helpers

eqx = pytest.importorskip("equinox")

TINY = ["--width", "16", "--heads", "2", "--layers", "2", "--context", "8",
        "--batch-size", "4", "--eval-batches", "1", "--plot", ""]


@pytest.fixture(name="gpt", scope="module")
def _gpt(tmp_path_factory):
  pytest.importorskip("flax")  # equinox_gpt reuses char_gpt's data code.
  ex = helpers.load_example("equinox_gpt")
  data = tmp_path_factory.mktemp("gpt") / "text.txt"
  data.write_text("to be or not to be, that is the question.\n" * 50)
  args = ex.char_gpt.parse_args(TINY + ["--data", str(data)])
  return ex, args, ex.setup(args)


def test_same_parameter_count_as_the_nnx_gpt():
  pytest.importorskip("flax")
  from flax import nnx  # pylint: disable=import-outside-toplevel
  if not hasattr(nnx, "List"):
    pytest.skip("examples/char_gpt.py needs nnx.List, flax >= 0.12 (the "
                "examples extra)")
  ex = helpers.load_example("equinox_gpt")
  count = lambda tree: sum(x.size for x in jax.tree.leaves(  # noqa: E731
      eqx.filter(tree, eqx.is_inexact_array)))
  eq = ex.GPT(65, 64, 128, 4, 4, key=jax.random.PRNGKey(0))
  nx = ex.char_gpt.GPT(65, 64, 128, 4, 4, rngs=nnx.Rngs(0))
  assert count(eq) == count(nnx.state(nx, nnx.Param)) == 818241


def test_scan_recognises_every_layer_but_the_position_table(gpt):
  _, args, s = gpt
  c = s["collection"]
  kinds = {l.name: (l.kind, l.num_uses) for l in c.layers}
  t = args.context
  assert kinds[".tok.weight"] == ("embedding", t)
  for i in range(args.layers):
    for proj in ("query_proj", "key_proj", "value_proj", "output_proj"):
      name = next(n for n in kinds if f"[{i}].attn.{proj}" in n)
      assert kinds[name] == ("fully_connected", t), name
    for j in range(2):
      name = next(n for n in kinds if f"[{i}].mlp.layers[{j}]" in n)
      assert kinds[name] == ("fully_connected", t), name
  assert next(v for n, v in kinds.items() if n.startswith(".head")) == (
      "fully_connected", t)
  assert sum(k == "scale_and_shift" for k, _ in kinds.values()) == (
      2 * args.layers + 1)
  # The only fallback: positions(arange(T)) does not depend on the batch.
  generic = [l.name for l in c.layers if l.kind == "generic"]
  assert generic == [".pos.weight"]
  assert "does not depend on the batch" in c.describe()
  # Every parameter belongs to a layer.
  paths = {p for l in c.layers for p in l.param_paths}
  leaves = jax.tree_util.tree_leaves_with_path(s["params"])
  assert len(paths) == len(leaves)


@pytest.mark.slow
def test_one_kfac_adamw_step(gpt):
  ex, _, s = gpt
  tx = kfac_jax_lite.kfac_adamw(2e-3, s["collection"])
  state, step = ex.char_gpt.make_runner(s["loss_fn"], tx, 1.0, s["params"])
  batch = s["batch_fn"](0)
  params, state, loss = step(s["params"], state, batch, 0)
  assert np.isfinite(float(loss))
  np.testing.assert_allclose(float(loss),
                             float(s["loss_fn"](s["params"], batch)),
                             rtol=1e-6)
  # At the first step the grafted direction u has RMSProp's length per
  # tensor, |g / (sqrt(g^2) + eps)| (the norm of the entries' signs), and
  # the update is -lr (u + wd old) (decoupled decay).
  lr, wd = 2e-3, 0.01
  grads = jax.tree.leaves(jax.grad(s["loss_fn"])(s["params"], batch))
  olds, news = jax.tree.leaves(s["params"]), jax.tree.leaves(params)
  turned = checked = 0
  for g, old, new in zip(grads, olds, news):
    g, old, new = (np.asarray(x, np.float64) for x in (g, old, new))
    if np.abs(g).max() < 1e-6:  # The key bias: softmax ignores it, g ~ 0.
      continue
    checked += 1
    u = (old - new) / lr - wd * old
    sign = g / (np.abs(g) + 1e-8)
    np.testing.assert_allclose(np.linalg.norm(u), np.linalg.norm(sign),
                               rtol=1e-4)
    cos = np.sum(u * sign) / (np.linalg.norm(u) * np.linalg.norm(sign))
    turned += cos < 0.99  # K-FAC's direction, not Adam's sign.
  assert checked == len(grads) - 2 and turned >= checked // 2, turned
