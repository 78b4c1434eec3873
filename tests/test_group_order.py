"""An estimator state keeps working after jax.jit sorts its group dict."""

import jax
import numpy as np

import kfac_jax_lite as kl
from tests import helpers


def test_state_with_groups_in_sorted_key_order_is_read_by_group():
  # 13 dense layers whose groups, in order of first occurrence, are not in
  # sorted string order ('2,4,...' before '12'): what a pytree round trip
  # (jit, tree.map, a checkpoint) returns.
  sizes = (3, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 6, 2)
  rng = np.random.default_rng(0)  # numpy: no per-layer eager dispatch.
  params = {f"layer{i}": {"w": rng.normal(size=(a, b)).astype(np.float32),
                          "b": np.zeros(b, np.float32)}
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
  batch = (rng.normal(size=(4, 3)).astype(np.float32),
           np.arange(4, dtype=np.int32) % 2)
  est = kl.FisherEstimator(kl.scan(helpers.classifier_loss, params, batch))
  state = est.init(params)
  names = list(state.stacked)
  assert names != sorted(names), names  # The case this test is about.
  round_trip = jax.tree.map(lambda x: x, state)
  assert list(round_trip.stacked) == sorted(names)
  # Every layer gets its own block state (its shapes tell them apart).
  for got, want in zip(est.per_layer(round_trip), est.per_layer(state)):
    jax.tree.map(np.testing.assert_array_equal, got, want)
