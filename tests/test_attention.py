"""Tests for models/attention.py: scaled dot-product attention, masks, multi-head attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from tolerances import BFLOAT16_EPS, rounding_tolerance

from models.attention import (
    MultiHeadAttention,
    causal_mask,
    dot_product_attention,
    fused_dot_product_attention,
    padding_mask,
    segment_mask,
)
from models.precision import float32_accumulating_dot_general, float32_accumulating_einsum

BATCH, Q_LEN, KV_LEN, HEADS, HEAD_DIM = 2, 3, 5, 4, 8


def numpy_attention(query, key, value, mask):
    """softmax(Q K^T / sqrt(d_k)) V per batch element and head, written out with loops."""
    batch, q_len, heads, head_dim = query.shape
    output = np.zeros(query.shape)
    weights = np.zeros((batch, heads, q_len, key.shape[1]))
    for b in range(batch):
        for h in range(heads):
            logits = query[b, :, h, :] @ key[b, :, h, :].T / np.sqrt(head_dim)  # [q, k]
            logits = np.where(mask[b, 0], logits, -1e30)  # Fully masked rows become uniform.
            probabilities = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probabilities /= probabilities.sum(axis=-1, keepdims=True)
            weights[b, h] = probabilities
            output[b, :, h, :] = probabilities @ value[b, :, h, :]
    return output, weights


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    shape_q, shape_kv = (BATCH, Q_LEN, HEADS, HEAD_DIM), (BATCH, KV_LEN, HEADS, HEAD_DIM)
    return rng.normal(size=shape_q), rng.normal(size=shape_kv), rng.normal(size=shape_kv)


# Source 0 has 5 real keys, source 1 only 2; query 2 of example 1 is padding.
KEY_VALID = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=bool)
QUERY_VALID = np.array([[1, 1, 1], [1, 1, 0]], dtype=bool)


def test_attention_matches_numpy_reference(qkv):
    query, key, value = qkv
    key_only_mask = padding_mask(np.ones((BATCH, Q_LEN), bool), KEY_VALID)
    output, weights = dot_product_attention(*(jnp.asarray(x, jnp.float32) for x in qkv), key_only_mask)
    expected_output, expected_weights = numpy_attention(query, key, value, np.asarray(key_only_mask))
    assert output.shape == (BATCH, Q_LEN, HEADS, HEAD_DIM)
    assert weights.shape == (BATCH, HEADS, Q_LEN, KV_LEN)
    # float32 against a float64 reference: the inputs' rounding, the HEAD_DIM-term scores, softmax's max and
    # KV_LEN-term sum, and the KV_LEN-term weighted sum; a score's error moves its weight relatively.
    scores = np.abs(np.einsum("bqhd,bkhd->bhqk", query, key)).max() / np.sqrt(HEAD_DIM)
    weight_tolerance = rounding_tolerance(HEAD_DIM + 2 * KV_LEN + 1, magnitude=max(1.0, scores))
    np.testing.assert_allclose(weights, expected_weights, rtol=weight_tolerance, atol=0)
    output_tolerance = (
        rounding_tolerance(KV_LEN, magnitude=np.abs(value).max()) + weight_tolerance * np.abs(value).max() * KV_LEN
    )
    np.testing.assert_allclose(output, expected_output, rtol=0, atol=output_tolerance)


def test_weights_are_distributions_and_masked_keys_get_exactly_zero(qkv):
    mask = padding_mask(QUERY_VALID, KEY_VALID)
    _, weights = dot_product_attention(*(jnp.asarray(x, jnp.float32) for x in qkv), mask)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-6)
    assert np.all(np.asarray(weights)[1, :, :2, 2:] == 0.0)  # Real queries, padded keys.
    assert np.all(np.asarray(weights)[1, :, :2, :2] > 0.0)
    # A fully masked (padding) query stays finite: uniform over all keys.
    np.testing.assert_allclose(weights[1, :, 2, :], 1.0 / KV_LEN, rtol=1e-6)


def test_causal_mask():
    mask = causal_mask(4)
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == jnp.bool_
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(mask[0, 0], expected)


def test_padding_mask():
    mask = padding_mask(jnp.asarray(QUERY_VALID), jnp.asarray(KEY_VALID))
    assert mask.shape == (BATCH, 1, Q_LEN, KV_LEN) and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask[0, 0], np.ones((Q_LEN, KV_LEN), bool))
    expected = np.array([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=bool)
    np.testing.assert_array_equal(mask[1, 0], expected)


def test_attention_dropout_zeroes_and_rescales_weights(qkv):
    query, key, _ = (jnp.asarray(x, jnp.float32) for x in qkv)
    # With value = identity per key position, the output exposes the dropped-out weights.
    value = jnp.broadcast_to(jnp.eye(KV_LEN)[None, :, None, :], (BATCH, KV_LEN, HEADS, KV_LEN))
    query = query[..., :KV_LEN]
    key = key[..., :KV_LEN]
    kwargs = dict(dropout_rng=jax.random.key(0), dropout_rate=0.5)
    dropped, weights = dot_product_attention(query, key, value, None, deterministic=False, **kwargs)
    dropped = np.asarray(dropped).transpose(0, 2, 1, 3)  # [b, h, q, k]
    kept = dropped != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(dropped[kept], 2.0 * np.asarray(weights)[kept], rtol=1e-6)
    undropped, _ = dot_product_attention(query, key, value, None, deterministic=True, **kwargs)
    np.testing.assert_allclose(np.asarray(undropped).transpose(0, 2, 1, 3), weights, rtol=1e-6)


def _init_multi_head_attention(d_model=32):
    rng = np.random.default_rng(1)
    inputs_q = jnp.asarray(rng.normal(size=(BATCH, Q_LEN, d_model)), jnp.float32)
    inputs_kv = jnp.asarray(rng.normal(size=(BATCH, KV_LEN, d_model)), jnp.float32)
    mask = padding_mask(jnp.asarray(QUERY_VALID), jnp.asarray(KEY_VALID))
    layer = MultiHeadAttention(num_heads=HEADS, d_model=d_model)
    params = nn.unbox(layer.init(jax.random.key(0), inputs_q, inputs_kv, mask, deterministic=True)['params'])
    return layer, params, inputs_q, inputs_kv, mask


def test_multi_head_attention_is_concatenated_heads_through_output_projection():
    layer, params, inputs_q, inputs_kv, mask = _init_multi_head_attention()
    assert params['query']['kernel'].shape == (32, HEADS, 32 // HEADS)
    assert params['output']['kernel'].shape == (HEADS, 32 // HEADS, 32)
    output = layer.apply({'params': params}, inputs_q, inputs_kv, mask, deterministic=True)
    assert output.shape == (BATCH, Q_LEN, 32) and output.dtype == jnp.float32

    p = jax.tree_util.tree_map(np.asarray, params)
    x_q, x_kv = np.asarray(inputs_q), np.asarray(inputs_kv)
    heads = []
    for h in range(HEADS):  # head_h = Attention(x_q W_h^Q, x_kv W_h^K, x_kv W_h^V)

        def project(x, name):
            return (x @ p[name]['kernel'][:, h, :])[:, :, None, :]

        head, _ = numpy_attention(project(x_q, 'query'), project(x_kv, 'key'), project(x_kv, 'value'), np.asarray(mask))
        heads.append(head[:, :, 0, :])
    concatenated = np.concatenate(heads, axis=-1)  # [b, q, h * d]
    expected = concatenated @ p['output']['kernel'].reshape(HEADS * (32 // HEADS), 32)
    # Both are float32 in other orders: projections (32 terms), scores (head_dim), softmax and weighted sum
    # (KV_LEN each), output projection (32 terms), on values of unit scale (normal inputs, LeCun kernels).
    operations = 32 + 32 // HEADS + 3 * KV_LEN + 32
    np.testing.assert_allclose(
        output, expected, rtol=0, atol=rounding_tolerance(operations, max(1.0, np.abs(expected).max()))
    )


def test_heads_are_independent():
    layer, params, inputs_q, inputs_kv, mask = _init_multi_head_attention()

    def attention_weights(params):
        _, state = layer.apply(
            {'params': params}, inputs_q, inputs_kv, mask, deterministic=True, mutable=['intermediates']
        )
        (weights,) = state['intermediates']['attention_weights']
        return np.asarray(weights)  # [b, h, q, k]

    perturbed = jax.tree_util.tree_map(lambda x: x, params)
    perturbed['query']['kernel'] = params['query']['kernel'].at[:, 1, :].multiply(3.0)
    before, after = attention_weights(params), attention_weights(perturbed)
    changed_heads = np.abs(after - before).max(axis=(0, 2, 3)) > 1e-4
    np.testing.assert_array_equal(changed_heads, [False, True, False, False])


@pytest.mark.parametrize(
    'subscripts, lhs_shape, rhs_shape',
    [
        ('bld,df->blf', (2, 3, 8), (8, 6)),  # Dense.
        ('bqhd,bkhd->bhqk', (2, 3, 4, 8), (2, 5, 4, 8)),  # Attention logits.
        ('bhqk,bkhd->bqhd', (2, 4, 3, 5), (2, 5, 4, 8)),  # Attention output.
        ('bld,vd->blv', (2, 3, 8), (7, 8)),  # Tied output projection.
        ('bk,bk->b', (3, 8), (3, 8)),  # No free dimension on either side.
        ('bld,d->bl', (2, 3, 8), (8,)),  # No free dimension on the right.
    ],
)
def test_bfloat16_einsum_value_and_gradients_match_float32(subscripts, lhs_shape, rhs_shape):
    rng = np.random.default_rng(2)
    lhs = jnp.asarray(rng.normal(size=lhs_shape), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=rhs_shape), jnp.float32)
    probe = jnp.asarray(rng.normal(size=jnp.einsum(subscripts, lhs, rhs).shape), jnp.float32)

    def loss(lhs, rhs, dtype):
        return jnp.sum(float32_accumulating_einsum(subscripts, lhs, rhs, dtype=dtype) * probe)

    assert float32_accumulating_einsum(subscripts, lhs, rhs, dtype=jnp.bfloat16).dtype == jnp.float32
    value_16, grads_16 = jax.value_and_grad(loss, argnums=(0, 1))(lhs, rhs, jnp.bfloat16)
    value_32, grads_32 = jax.value_and_grad(loss, argnums=(0, 1))(lhs, rhs, jnp.float32)
    np.testing.assert_allclose(value_16, value_32, rtol=0.05, atol=0.2)
    for grad_16, grad_32 in zip(grads_16, grads_32):
        assert grad_16.dtype == jnp.float32
        np.testing.assert_allclose(grad_16, grad_32, rtol=0.05, atol=0.1)


def test_dot_general_replacement_matches_lax_for_dense_general():
    rng = np.random.default_rng(3)
    heads = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(4, 8, 32)), jnp.float32)
    dimension_numbers = (((2, 3), (0, 1)), ((), ()))  # DenseGeneral(axis=(-2, -1)).
    np.testing.assert_allclose(
        float32_accumulating_dot_general(heads, kernel, dimension_numbers),
        lax.dot_general(heads, kernel, dimension_numbers),
        rtol=1e-5,
    )


# --------------------------------------------------------------------------- #
# jax.nn.dot_product_attention (the 'xla' implementation runs on the CPU) against the formula.
# --------------------------------------------------------------------------- #

SEGMENTS = np.array([[1, 1, 2, 2, 2], [1, 2, 2, 3, 0]])  # Two packed rows; the last key of row 1 is padding.


def _parity_masks():
    return {
        "padding": padding_mask(QUERY_VALID, KEY_VALID),
        "causal": causal_mask(KV_LEN),
        "packed_causal": causal_mask(KV_LEN) & segment_mask(SEGMENTS, SEGMENTS),
        "packed_cross": segment_mask(SEGMENTS[:, :Q_LEN], SEGMENTS),
    }


@pytest.mark.parametrize("mask_name", ["padding", "causal", "packed_causal", "packed_cross"])
def test_jax_nn_attention_equals_the_formula_with_its_gradients(mask_name):
    mask = _parity_masks()[mask_name]
    q_len = mask.shape[2]
    rng = np.random.default_rng(1)
    query, key, value = (
        jnp.asarray(rng.normal(size=(BATCH, length, HEADS, HEAD_DIM)), jnp.float32)
        for length in (q_len, KV_LEN, KV_LEN)
    )
    cotangent = jnp.asarray(rng.normal(size=(BATCH, q_len, HEADS, HEAD_DIM)), jnp.float32)

    def explicit(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, mask)[0] * cotangent)

    def fused(q, k, v):
        return jnp.sum(fused_dot_product_attention(q, k, v, mask, implementation="xla", dtype=jnp.float32) * cotangent)

    # Same formula, other evaluation order: HEAD_DIM-term scores, a KV_LEN softmax and
    # weighted sum, of values up to ~|q||k|; gradients add the backward products.
    tolerance = rounding_tolerance(2 * (HEAD_DIM + 3 * KV_LEN), magnitude=HEAD_DIM * 4.0)
    np.testing.assert_allclose(fused(query, key, value), explicit(query, key, value), rtol=tolerance)
    for fused_grad, explicit_grad in zip(
        jax.grad(fused, argnums=(0, 1, 2))(query, key, value), jax.grad(explicit, argnums=(0, 1, 2))(query, key, value)
    ):
        np.testing.assert_allclose(fused_grad, explicit_grad, atol=tolerance)


def test_bfloat16_jax_nn_attention_stays_within_bfloat16_rounding_of_the_formula():
    mask = _parity_masks()["packed_causal"]
    rng = np.random.default_rng(2)
    query, key, value = (jnp.asarray(rng.normal(size=(BATCH, KV_LEN, HEADS, HEAD_DIM)), jnp.float32) for _ in range(3))
    expected = dot_product_attention(query, key, value, mask, dtype=jnp.bfloat16)[0]
    actual = fused_dot_product_attention(query, key, value, mask, implementation="xla", dtype=jnp.bfloat16)
    # Both round the operands to bf16; jax.nn also rounds its weights and output to bf16:
    # outputs are weighted means of |values| <~ 4.
    np.testing.assert_allclose(actual, expected, atol=3 * BFLOAT16_EPS * 4.0)


@pytest.mark.parametrize("implementation", ["explicit", "xla"])
def test_multi_head_attention_uses_the_formula_where_weights_or_dropout_are_needed(implementation):
    layer = MultiHeadAttention(
        num_heads=HEADS, d_model=HEADS * HEAD_DIM, dropout_rate=0.5, implementation=implementation
    )
    x = jnp.asarray(np.random.default_rng(3).normal(size=(BATCH, KV_LEN, HEADS * HEAD_DIM)), jnp.float32)
    mask = causal_mask(KV_LEN)
    params = layer.init(jax.random.key(0), x, x, mask, deterministic=True)
    plain = layer.apply(params, x, x, mask, deterministic=True)
    # Collecting the weights (attention maps) takes the formula, with the same output.
    with_weights, state = layer.apply(params, x, x, mask, deterministic=True, mutable=["intermediates"])
    np.testing.assert_allclose(with_weights, plain, atol=rounding_tolerance(4 * HEAD_DIM * HEADS))
    assert state["intermediates"]["attention_weights"][0].shape == (BATCH, HEADS, KV_LEN, KV_LEN)
    # Attention dropout takes the formula too: some weights are dropped, so the output changes.
    dropped = layer.apply(params, x, x, mask, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert not np.allclose(dropped, plain)
