"""Jitted decoding made once a test process, for the tests that decode batches with the Transformer.

jax.jit compiles a program per function object and input shapes: tests that decode with equal searches,
models and lengths through `decoding_program` run the program the first of them compiled, instead of
tracing and compiling one each. `cached_step_logits_program` is the check of the key/value cache that
test_decoding and test_positions run on their models: one program where, run eagerly, the model's every
operation compiled a program of its own (some hundreds, seconds, for the first model of a file).
"""

import functools

import jax
import jax.numpy as jnp

from models import Transformer
from models.decoding import decode_batch
from models.search import Search
from models.token_search import sampled_token

# `sampled_token` once per (temperature, top_k): searches built on equal arguments compare equal, so they
# share their programs.
shared_sampled_token = functools.cache(sampled_token)


@functools.cache
def decoding_program(search: Search, model: Transformer, max_length: int, use_cache: bool = True):
    """`decode_batch` of `search` and `model` jitted, as a function of (params, inputs, budgets=, sentences=)."""
    return jax.jit(functools.partial(decode_batch, search, model, max_length=max_length, use_cache=use_cache))


@functools.cache
def cached_step_logits_program(model: Transformer, length: int):
    """The full decoder's logits and the cached decode steps', jitted, as a function of (params, inputs,
    decoder_inputs [batch, length]) returning both [batch, length, vocab].

    The steps run in a scan from `init_cache`, one position a step, the position traced (a loop's, as in decoding);
    step i reads decoder_inputs[:, i] and should give the full decoder's logits at i.
    """

    def logits(params, inputs, decoder_inputs):
        variables = {"params": params}
        encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)
        full = model.apply(variables, encoded, inputs, decoder_inputs, method=Transformer.decode, deterministic=True)

        def step(cache, position):
            token = jax.lax.dynamic_slice_in_dim(decoder_inputs, position, 1, axis=1)
            logits, cache = model.apply(variables, inputs, token, position, cache, method=Transformer.decode_step)
            return cache, logits

        cache = model.apply(variables, encoded, length, method=Transformer.init_cache)
        _, stepped = jax.lax.scan(step, cache, jnp.arange(length, dtype=jnp.int32))
        return full, jnp.moveaxis(stepped, 0, 1)

    return jax.jit(logits)
