"""Cached greedy decoding: equal to the full decoder, stops at <eos>, pads after it."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL

from models import Transformer
from models.decoding import greedy_decode, greedy_loop

BOS, EOS, PAD = 2, 3, 0


def _model(dtype="float32", norm_placement="pre", positional_encoding="sinusoidal"):
    config = dataclasses.replace(
        TINY_MODEL,
        vocab_size=40,
        max_len=32,
        norm_placement=norm_placement,
        positional_encoding=positional_encoding,
        dtype=dtype,
    )
    model = Transformer(config)
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(4, 40, (3, 9)), jnp.int32).at[1, 6:].set(PAD)
    params = nn.unbox(model.init(jax.random.PRNGKey(1), inputs, inputs, deterministic=True)["params"])
    return model, params, inputs


@pytest.mark.parametrize("norm_placement", ["pre", "post"])
@pytest.mark.parametrize("positional_encoding", ["sinusoidal", "learned"])
def test_cached_step_logits_equal_full_decoder(norm_placement, positional_encoding):
    model, params, inputs = _model(norm_placement=norm_placement, positional_encoding=positional_encoding)
    variables = {"params": params}
    decoder_inputs = jnp.asarray(np.random.default_rng(2).integers(4, 40, (3, 7)), jnp.int32).at[:, 0].set(BOS)
    encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)
    full = model.apply(variables, encoded, inputs, decoder_inputs, method=Transformer.decode, deterministic=True)

    cache = model.apply(variables, encoded, 7, method=Transformer.init_cache)
    for position in range(7):
        logits, cache = model.apply(
            variables,
            inputs,
            decoder_inputs[:, position : position + 1],
            jnp.int32(position),
            cache,
            method=Transformer.decode_step,
        )
        np.testing.assert_allclose(logits, full[:, position], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_greedy_equals_uncached_greedy(dtype):
    model, params, inputs = _model(dtype=dtype)
    # Larger weights make an untrained model's choices depend on the source and the prefix.
    params = jax.tree.map(lambda x: 5.0 * x, params)
    kwargs = dict(model=model, max_length=10, bos_id=BOS, eos_id=EOS)
    cached = jax.jit(functools.partial(greedy_decode, **kwargs))(params, inputs)
    uncached = jax.jit(functools.partial(greedy_decode, use_cache=False, **kwargs))(params, inputs)
    assert cached.shape == (3, 10)
    assert len(np.unique(np.asarray(cached))) >= 5, cached  # Not one token repeated.
    np.testing.assert_array_equal(cached, uncached)


def test_all_padding_rows_stay_padding():
    model, params, inputs = _model()
    inputs = inputs.at[2].set(PAD)
    out = greedy_decode(params, inputs, model=model, max_length=6, bos_id=BOS, eos_id=EOS)
    np.testing.assert_array_equal(out[2], np.zeros(6))


def test_greedy_loop_stops_at_eos_and_pads_after_it():
    # Row 0 says 5, 6, <eos>, then would go on with 7; row 1 never ends.
    script = jnp.array([[5, 6, EOS, 7, 7, 7], [8, 9, 10, 11, 12, 13]])

    def next_token_logits(position, tokens, calls):
        return jax.nn.one_hot(script[:, position], 20) * 10.0, calls + 1

    out = jax.jit(
        lambda: greedy_loop(next_token_logits, 0, jnp.zeros(2, bool), max_length=6, bos_id=BOS, eos_id=EOS, pad_id=PAD)
    )()
    np.testing.assert_array_equal(out, [[5, 6, EOS, PAD, PAD, PAD], [8, 9, 10, 11, 12, 13]])


def test_greedy_loop_exits_early_once_every_row_has_finished():
    steps_run = []

    def next_token_logits(position, tokens, state):
        jax.debug.callback(lambda p: steps_run.append(int(p)), position)
        return jax.nn.one_hot(jnp.full((2,), EOS), 20) * jnp.where(position >= 1, 10.0, 0.0), state

    greedy_loop(next_token_logits, (), jnp.zeros(2, bool), max_length=8, bos_id=BOS, eos_id=EOS, pad_id=PAD)
    jax.effects_barrier()
    # Step 0 emits token 0 (all-zero logits), step 1 emits <eos> for both rows: two steps of eight.
    assert steps_run == [0, 1]
