"""The train state (a pytree), how it starts, and its layout on a device mesh.

The builders here (`state_shardings`, `initial_state`, `abstract_state`) need no data: the
training loop and benchmarks/accelerator_check.py build the same state from them.
"""

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from models.build import Model, init_boxed_params
from training.runtime import sharding


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training; saved whole in each checkpoint."""

    step: jax.Array  # [] int32, optimizer updates done.
    params: Any
    opt_state: optax.OptState
    rng: jax.Array  # [2] uint32, the base key that step keys fold in from.


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


def state_shardings(
    config: ml_collections.ConfigDict, model: Model, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh
) -> TrainState:
    """NamedShardings of the train state on `mesh`: parameters and Adam moments as config.mesh.rules say."""
    boxed = jax.eval_shape(lambda: create_train_state(model, tx, config.seed, boxed=True))
    return sharding.shardings_from_boxes(boxed, mesh, config.mesh.rules)


def initial_state(
    config: ml_collections.ConfigDict, model: Model, tx: optax.GradientTransformation, shardings: TrainState
) -> TrainState:
    """A fresh state from config.seed, laid out as `shardings`; each device computes only its own shards."""
    return jax.jit(lambda: create_train_state(model, tx, config.seed), out_shardings=shardings)()


def abstract_state(
    config: ml_collections.ConfigDict, model: Model, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh
) -> TrainState:
    """The train state's structure as jax.ShapeDtypeStructs with shardings, without computing it: a restore target."""
    like = jax.eval_shape(lambda: create_train_state(model, tx, config.seed))
    return sharding.with_shardings(like, state_shardings(config, model, tx, mesh))
