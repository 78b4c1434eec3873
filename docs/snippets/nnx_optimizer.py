from flax import nnx
import jax
import jax.numpy as jnp
import optax
import kfac_jax_lite as kl


class MLP(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(32, 64, rngs=rngs)
    self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


model = MLP(nnx.Rngs(0))
key = jax.random.PRNGKey(1)
batch = {"image": jax.random.normal(key, (128, 32)),
         "label": jax.random.randint(key, (128,), 0, 10)}

# K-FAC needs a pure loss_fn(params, batch): split the model once.
graphdef, _ = nnx.split(model)


def loss_fn(params, batch):
  logits = nnx.merge(graphdef, params)(batch["image"])
  kl.register_categorical_predictive_distribution(logits, batch["label"])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["label"]).mean()


params = nnx.as_pure(nnx.state(model, nnx.Param))
collection = kl.scan(loss_fn, params, batch)     # the two Linear layers
optimizer = nnx.Optimizer(model, kl.kfac(2e-2, collection, damping=1e-2),
                          wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
  def model_loss(m):
    return loss_fn(nnx.state(m, nnx.Param), batch)
  loss, grads = nnx.value_and_grad(model_loss)(model)
  optimizer.update(model, grads, batch=batch)    # batch= reaches K-FAC
  return loss


first = train_step(model, optimizer, batch)
for _ in range(20):
  loss = train_step(model, optimizer, batch)
print(f"loss {first:.3f} -> {loss:.3f}")
assert loss < first / 2, (first, loss)
