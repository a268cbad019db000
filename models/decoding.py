"""Greedy autoregressive decoding, jitted, with a key/value cache and an early exit.

The encoder runs once per batch, cross-attention keys/values are computed once
per sentence, and each step runs the decoder for one new position only
(`Transformer.decode_step`). With `use_cache=False` the decoder reruns over the
whole prefix at every step: the reference the cached path is tested and
benchmarked against.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from models.transformer import Transformer

# (position [], tokens [batch, max_length + 1], state) -> (logits [batch, vocab] of
# the token after `position`, state); tokens[:, 0] is <bos>.
NextTokenLogits = Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def greedy_loop(
    next_token_logits: NextTokenLogits,
    state: Any,
    finished: jax.Array,
    *,
    max_length: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
) -> jax.Array:
    """Runs greedy steps until every row has emitted <eos> or max_length is reached.

    Args:
        next_token_logits: the model's next-token logits given the tokens so far.
        state: whatever next_token_logits carries (the cache, or nothing).
        finished: [batch] bool, rows that need no decoding (all-padding filler rows):
            they stay padding and do not hold up the early exit.
        max_length, bos_id, eos_id, pad_id: as in `greedy_decode`.

    Returns:
        [batch, max_length] int32 ids, padded after each row's first <eos>.
    """
    # tokens[:, 0] is <bos>; tokens[:, i + 1] is the token generated at step i.
    tokens = jnp.full((finished.shape[0], max_length + 1), pad_id, jnp.int32).at[:, 0].set(bos_id)

    def not_done(carry):
        position, _, finished, _ = carry
        return (position < max_length) & ~jnp.all(finished)

    def step(carry):
        position, tokens, finished, state = carry
        logits, state = next_token_logits(position, tokens, state)
        next_token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        next_token = jnp.where(finished, pad_id, next_token)
        tokens = tokens.at[:, position + 1].set(next_token)
        return position + 1, tokens, finished | (next_token == eos_id), state

    carry = (jnp.array(0, jnp.int32), tokens, finished, state)
    _, tokens, _, _ = jax.lax.while_loop(not_done, step, carry)
    return tokens[:, 1:]


def greedy_decode(
    params,
    inputs: jax.Array,
    *,
    model: Transformer,
    max_length: int,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    use_cache: bool = True,
) -> jax.Array:
    """Translates a batch by picking the most likely token at every step.

    Args:
        params: the model parameters.
        inputs: [batch, src_len] int32 source ids, pad_id-padded.
        model: the Transformer.
        max_length: the most tokens to generate (static).
        bos_id, eos_id, pad_id: special ids.
        use_cache: run the decoder for the new position only, on cached keys and
            values (the default); False reruns it on the whole prefix at every step,
            the reference the cache is tested and benchmarked against.

    Returns:
        [batch, max_length] int32 output ids: each row ends at its first <eos>
        (included) and is padded after it.
    """
    variables = {"params": params}
    encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)

    def cached_logits(position, tokens, cache):
        last = jax.lax.dynamic_slice_in_dim(tokens, position, 1, axis=1)  # [batch, 1]
        return model.apply(variables, inputs, last, position, cache, method=Transformer.decode_step)

    def uncached_logits(position, tokens, state):
        logits = model.apply(variables, encoded, inputs, tokens[:, :-1], method=Transformer.decode, deterministic=True)
        return jax.lax.dynamic_index_in_dim(logits, position, axis=1, keepdims=False), state

    if use_cache:
        next_token_logits = cached_logits
        state = model.apply(variables, encoded, max_length, method=Transformer.init_cache)
    else:
        next_token_logits, state = uncached_logits, ()
    return greedy_loop(
        next_token_logits,
        state,
        jnp.all(inputs == pad_id, axis=1),
        max_length=max_length,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
    )
