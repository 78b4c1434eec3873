"""Tree reductions (trees, _xla_cpu): chunks and inner products."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from kfac_jax_lite import _xla_cpu
from kfac_jax_lite import trees as trees_lib


def _tree(seed):
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  return {"small": [jax.random.normal(k[0], (3, 4)),
                    jax.random.normal(k[1], (7,))],
          "large": jax.random.normal(k[2], (_xla_cpu.FINITE_ALONE + 3,)),
          "matrix": jax.random.normal(k[3], (300, 250)),
          "half": jax.random.normal(k[4], (5,)).astype(jnp.bfloat16)}


def test_flat_chunks_are_aligned_and_keep_every_element():
  a, b = _tree(0), _tree(1)
  ca, cb = _xla_cpu.flat_chunks(a), _xla_cpu.flat_chunks(b)
  assert [c.shape for c in ca] == [c.shape for c in cb]
  # Two large leaves alone, small float32 leaves together, bf16 apart.
  assert len(ca) == 4
  assert sum(c.size for c in ca) == sum(x.size for x in jax.tree.leaves(a))
  assert _xla_cpu.flat_chunks({"ints": jnp.arange(4)}) == []


@pytest.mark.parametrize("pairs", [((0, 1),), ((0, 0), (0, 1), (1, 1),
                                               (2, 0), (2, 1))])
def test_inner_products_match_optax_tree_vdot(pairs):
  trees = [_tree(i) for i in range(3)]
  up = [jax.tree.map(lambda x: x.astype(jnp.float32), t) for t in trees]
  got = jax.jit(lambda ts: trees_lib.inner_products(ts, pairs))(trees)
  want = [optax.tree.vdot(up[i], up[j]) for i, j in pairs]
  assert got.dtype == jnp.float32 and got.shape == (len(pairs),)
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_inner_products_of_trees_with_different_dtypes():
  """A bf16 direction against a float32 gradient: both are cast to the
  factor dtype before chunking, so their chunks stay aligned."""
  g = _tree(0)
  d = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _tree(1))
  got = trees_lib.inner_products((g, d), ((0, 1),))[0]
  up = jax.tree.map(lambda x: x.astype(jnp.float32), d)
  g32 = jax.tree.map(lambda x: x.astype(jnp.float32), g)
  np.testing.assert_allclose(got, optax.tree.vdot(g32, up), rtol=1e-4)
