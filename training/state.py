"""The train state (a pytree) and the parameters it starts from."""

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from models.build import Model
from models.classifier import Classifier


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training; saved whole in each checkpoint."""

    step: jax.Array  # [] int32, optimizer updates done.
    params: Any
    opt_state: optax.OptState
    rng: jax.Array  # [2] uint32, the base key that step keys fold in from.


def init_boxed_params(model: Model, rng: jax.Array) -> Any:
    """Float32 parameters in flax `LogicallyPartitioned` boxes naming each dimension's logical axis.

    Shapes do not depend on the dummy sequence lengths.
    """
    dummy = jnp.ones((1, 2), jnp.int32)
    sequences = (dummy,) if isinstance(model, Classifier) else (dummy, dummy)  # Classifier: no target.
    return model.init({"params": rng}, *sequences, deterministic=True)["params"]


def init_params(model: Model, rng: jax.Array) -> Any:
    """Float32 parameters of `model`: a plain pytree of arrays (the checkpointed layout)."""
    return nn.unbox(init_boxed_params(model, rng))


def create_train_state(model: Model, tx: optax.GradientTransformation, seed: int, *, boxed: bool = False) -> TrainState:
    """A fresh state: parameters from `seed`, Adam moments at zero, step 0.

    With `boxed`, parameters and the optimizer moments derived from them stay in
    their logical-axis boxes (for `jax.eval_shape`, to read the shardings off);
    otherwise every leaf is a plain array.
    """
    init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
    params = init_boxed_params(model, init_rng)
    if not boxed:
        params = nn.unbox(params)
    return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params), rng=train_rng)
