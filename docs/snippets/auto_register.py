import jax
import jax.numpy as jnp
import optax
import kfac_jax_lite as kl


def loss_fn(params, batch):           # no layer tags at all
  x, labels = batch
  h = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
  h = h * jnp.sin(params["gate"])     # no layer structure: a fallback
  logits = h @ params["head"]["w"]
  kl.register_categorical_predictive_distribution(logits, labels)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()


k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"dense": {"w": jax.random.normal(k1, (16, 32)) / 4,
                    "b": jnp.zeros(32)},
          "gate": jnp.ones(32),
          "head": {"w": jax.random.normal(k2, (32, 4)) / 32 ** 0.5}}
batch = (jax.random.normal(k3, (64, 16)),
         jax.random.randint(k3, (64,), 0, 4))

collection = kl.scan(loss_fn, params, batch)
print(collection.describe())          # "fallbacks:" says why gate is generic
assert [l.found_by for l in collection.layers].count("auto") == 2

# Approximations per kind, or per parameter-path prefix (keystr).
collection = kl.scan(loss_fn, params, batch, approximations={
    "fully_connected": "kron_in_diag", "['gate']": "full"})
print({l.name: l.approx for l in collection.layers})

# strict=True refuses to fall back.
try:
  kl.scan(loss_fn, params, batch, strict=True)
except ValueError as e:
  print("strict:", str(e).splitlines()[0])
else:
  raise AssertionError("strict=True should have raised")
