"""Options of the train step that change its speed, not what it trains: each off by default.

- `config.prng_impl`: the PRNG of dropout's random bits. 'threefry2x32' (JAX's default, as
  every earlier run); 'rbg' or 'unsafe_rbg' draw the bits with XLA's RngBitGenerator, far
  fewer instructions per bit on GPUs and TPUs. Only each step's dropout key is of this kind:
  the base key in the train state (and so in checkpoints) stays a threefry key whatever the
  option, so a checkpoint restores and resumes under any of them; a run resumed under another
  one draws other dropout masks from then on.
- `config.loss_chunks`: the label-smoothed loss over the vocabulary computed this many slices
  of target positions at a time, each slice's float32 logits recomputed in the backward pass
  instead of kept (training/losses.py's `chunked_token_metrics`); 1 computes all logits at once.

A run's config.json written before these fields existed gets `DEFAULTS`, its run's behaviour.
"""

import jax
import jax.numpy as jnp
import ml_collections

from common.config_fields import is_int, require_choice
from common.errors import UserInputError

PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
DEFAULTS = {"prng_impl": "threefry2x32", "loss_chunks": 1}


def option(config: ml_collections.ConfigDict, name: str):
    """config.<name>, or its default where the config (an earlier run's) has no such field."""
    return config.get(name, DEFAULTS[name])


def check_step_options(config: ml_collections.ConfigDict) -> None:
    """Raises UserInputError naming the option that cannot work."""
    require_choice("prng_impl", option(config, "prng_impl"), PRNG_IMPLS)
    chunks = option(config, "loss_chunks")
    if not is_int(chunks) or chunks < 1:
        raise UserInputError(f"config.loss_chunks is {chunks!r}; it must be a positive integer (1: no chunks).")
    if chunks > 1 and config.task != "translation":
        raise UserInputError("config.loss_chunks > 1 applies to translation only; set it to 1.")
    if config.dataset.max_length % chunks:
        raise UserInputError(
            f"config.loss_chunks is {chunks}; it must divide config.dataset.max_length ({config.dataset.max_length})."
        )


def dropout_key(rng: jax.Array, prng_impl: str) -> jax.Array:
    """A step's dropout key of kind `prng_impl`, made from the step's threefry key `rng` ([2] uint32).

    'threefry2x32' returns `rng` itself (every earlier run's keys); another kind takes its key
    data from threefry bits of `rng`, so it too is a pure function of the base key and the step.
    """
    if prng_impl == PRNG_IMPLS[0]:
        return rng
    shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=prng_impl))).shape
    return jax.random.wrap_key_data(jax.random.bits(rng, shape, jnp.uint32), impl=prng_impl)
