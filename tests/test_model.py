"""Tests for models/embeddings.py and models/transformer.py on a tiny configuration."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL as TINY
from tolerances import FLOAT32_EPS, rounding_tolerance, transformer_operations

from models import Transformer
from models.embeddings import sinusoidal_positions
from models.transformer import shift_right

# Pad 0 trails the real tokens; every sequence ends with eos 3.
INPUTS = jnp.array([[5, 6, 7, 8, 3, 0], [9, 10, 3, 0, 0, 0]], dtype=jnp.int32)
TARGETS = jnp.array([[11, 12, 13, 3, 0], [14, 3, 0, 0, 0]], dtype=jnp.int32)


def reordering_tolerance(values, source_length: int = 10, target_length: int = 5) -> float:
    """How far two evaluation orders of the tiny model can move `values` (logits or hidden states).

    Hidden states are layer-normalized to unit scale; logits may be larger.
    """
    operations = transformer_operations(TINY, source_length, target_length)
    return rounding_tolerance(operations, magnitude=max(1.0, float(np.abs(values).max())))


def init(config=TINY, inputs=INPUTS, targets=TARGETS):
    model = Transformer(config)
    # Unboxed from their logical-axis (sharding) annotations, as training stores them.
    params = nn.unbox(model.init(jax.random.key(0), inputs, targets, deterministic=True)['params'])
    return model, params


@pytest.fixture(scope='module')
def tiny():
    return init()


def test_sinusoidal_positions_match_paper_formula():
    d_model = 8
    table = sinusoidal_positions(10, d_model)
    assert table.shape == (10, d_model) and table.dtype == np.float32
    for pos in [0, 1, 5, 9]:
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            # Computed in float64, then rounded once to float32 (half a float32 ulp of values <= 1).
            assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=FLOAT32_EPS)
            assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=FLOAT32_EPS)


def test_shift_right():
    np.testing.assert_array_equal(shift_right(TARGETS, bos_id=2), [[2, 11, 12, 13, 3], [2, 14, 3, 0, 0]])


def test_decoder_is_causal(tiny):
    model, params = tiny
    logits = model.apply({'params': params}, INPUTS, TARGETS, deterministic=True)
    t = 2
    changed_targets = TARGETS.at[:, t].set(20)
    changed_logits = model.apply({'params': params}, INPUTS, changed_targets, deterministic=True)
    # Logits at position i see targets[:, :i]: positions <= t are unaffected by target t ...
    np.testing.assert_allclose(
        changed_logits[:, : t + 1], logits[:, : t + 1], rtol=0, atol=reordering_tolerance(logits)
    )
    # ... and position t + 1 is (so the check above is not vacuous).
    assert np.abs(changed_logits[:, t + 1] - logits[:, t + 1]).max() > 1e-3


def test_extra_source_padding_changes_nothing(tiny):
    model, params = tiny
    padded_inputs = jnp.pad(INPUTS, ((0, 0), (0, 4)))  # Four more pad tokens.

    def encode(x):
        return model.apply({'params': params}, x, method=Transformer.encode, deterministic=True)

    encoded, padded_encoded = encode(INPUTS), encode(padded_inputs)
    valid = np.asarray(INPUTS != 0)
    np.testing.assert_allclose(padded_encoded[:, :6][valid], encoded[valid], rtol=0, atol=reordering_tolerance(encoded))
    logits = model.apply({'params': params}, INPUTS, TARGETS, deterministic=True)
    padded_logits = model.apply({'params': params}, padded_inputs, TARGETS, deterministic=True)
    np.testing.assert_allclose(padded_logits, logits, rtol=0, atol=reordering_tolerance(logits))


def test_call_equals_encode_then_decode(tiny):
    model, params = tiny
    variables = {'params': params}
    encoded = model.apply(variables, INPUTS, method=Transformer.encode, deterministic=True)
    assert encoded.shape == (2, 6, 32)
    decoded = model.apply(
        variables, encoded, INPUTS, shift_right(TARGETS, 2), method=Transformer.decode, deterministic=True
    )
    whole = model.apply(variables, INPUTS, TARGETS, deterministic=True)
    np.testing.assert_allclose(decoded, whole, rtol=0, atol=reordering_tolerance(whole))


def test_dropout_is_active_only_when_not_deterministic(tiny):
    model, params = tiny
    train_apply = jax.jit(
        lambda rng: model.apply({'params': params}, INPUTS, TARGETS, deterministic=False, rngs={'dropout': rng})
    )

    def run(seed):
        return train_apply(jax.random.key(seed))

    assert np.abs(run(1) - run(2)).max() > 1e-3
    np.testing.assert_array_equal(run(1), run(1))


@pytest.mark.parametrize('norm_placement', ['post', 'pre'])
@pytest.mark.parametrize('tie_embeddings', [True, False])
@pytest.mark.parametrize('positional_encoding', ['sinusoidal', 'learned'])
def test_variants_run_with_expected_params(norm_placement, tie_embeddings, positional_encoding):
    config = dataclasses.replace(
        TINY,
        norm_placement=norm_placement,
        tie_embeddings=tie_embeddings,
        positional_encoding=positional_encoding,
    )
    model, params = init(config)
    logits = model.apply({'params': params}, INPUTS, TARGETS, deterministic=False, rngs={'dropout': jax.random.key(1)})
    assert logits.shape == (2, 5, 50) and logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))

    embeddings = (
        {'shared_embedding'} if tie_embeddings else {'source_embedding', 'target_embedding', 'output_projection'}
    )
    assert set(params) == {'encoder', 'decoder'} | embeddings
    assert ('final_norm' in params['encoder']) == (norm_placement == 'pre')
    assert ('final_norm' in params['decoder']) == (norm_placement == 'pre')
    assert ('position_embedding' in params['encoder']) == (positional_encoding == 'learned')


def test_param_names(tiny):
    _, params = tiny
    names = {'/'.join(key.key for key in path) for path, _ in jax.tree_util.tree_leaves_with_path(params)}
    for expected in [
        'shared_embedding/embedding',
        'encoder/layers_0/self_attention/query/kernel',
        'encoder/layers_0/self_attention/key/kernel',
        'encoder/layers_0/self_attention/value/kernel',
        'encoder/layers_0/self_attention/output/kernel',
        'encoder/layers_1/self_attention_norm/scale',
        'encoder/layers_1/feed_forward/hidden/kernel',
        'encoder/layers_1/feed_forward/output/bias',
        'encoder/layers_1/feed_forward_norm/bias',
        'decoder/layers_1/self_attention/query/kernel',
        'decoder/layers_1/cross_attention/key/kernel',
        'decoder/layers_1/cross_attention_norm/scale',
        'decoder/layers_1/feed_forward/output/kernel',
    ]:
        assert expected in names
    assert not any(name.startswith(('encoder/layers_2', 'decoder/layers_2')) for name in names)


def test_every_parameter_names_a_logical_axis_per_dimension():
    config = dataclasses.replace(TINY, tie_embeddings=False, positional_encoding='learned')
    init = functools.partial(Transformer(config).init, deterministic=True)
    boxed = jax.eval_shape(init, jax.random.key(0), INPUTS, TARGETS)['params']  # The boxes, shapes alone.
    leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert all(isinstance(leaf, nn.LogicallyPartitioned) for leaf in leaves)
    assert all(len(leaf.names) == leaf.value.ndim for leaf in leaves)
    query = boxed['encoder']['layers_0']['self_attention']['query']['kernel']
    assert query.names == ('embed', 'heads', 'kv') and query.value.shape == (32, 4, 8)
    assert boxed['output_projection']['kernel'].names == ('embed', 'vocab')


def test_bfloat16_computes_float32_logits_with_float32_params(tiny):
    model_32, params = tiny
    model_16 = Transformer(dataclasses.replace(TINY, dtype='bfloat16'))
    # The dtypes its init gives, read off an abstract init (a real one would compile a program of its own).
    init_16 = functools.partial(model_16.init, deterministic=True)
    params_16 = nn.unbox(jax.eval_shape(init_16, jax.random.key(0), INPUTS, TARGETS)['params'])
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params_16))

    def loss(p):
        logits = model_16.apply({'params': p}, INPUTS, TARGETS, deterministic=True)
        return logits.mean(), logits

    # The logits and their gradient in one program: the backward pass runs the forward one anyway.
    (_, logits_16), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    logits_32 = model_32.apply({'params': params}, INPUTS, TARGETS, deterministic=True)
    assert logits_16.dtype == jnp.float32
    np.testing.assert_allclose(logits_16, logits_32, atol=0.1)  # Same function, bf16 rounding.
    assert all(g.dtype == jnp.float32 and np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
