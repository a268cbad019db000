"""Jitted decoding made once a test process, for the tests that decode batches with the Transformer.

jax.jit compiles a program per function object and input shapes: tests that decode with equal searches,
models and lengths through `decoding_program` run the program the first of them compiled, instead of
tracing and compiling one each.
"""

import functools

import jax

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
