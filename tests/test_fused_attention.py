"""What the model hands a fused attention kernel (cuDNN's), checked on the CPU.

cuDNN runs only on NVIDIA GPUs, so these tests check its contract instead: a stand-in for
`jax.nn.dot_product_attention` records every mask and log-sum-exp that a kernel would be given
(computing with the 'xla' implementation), while the model is built with
attention_implementation='cudnn' and run on packed and unpacked rows that end in padding.
A query row with no key gets a log-sum-exp of about -2^41 in cuDNN (JAX turns the mask into a
bias), and cuDNN's sm90 backward overflows on such rows at some key lengths: the README's main
command stopped at step 1 on an H100 with non-finite gradients.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL, pretend_gpu
from test_packing import pack

from configs import default
from models import Packing, Transformer, build
from models.attention import (
    MultiHeadAttention,
    cudnn_has_known_defect,
    fused_dot_product_attention,
    padding_mask,
    segment_mask,
)
from training.losses import token_metrics

# exp(lse) of a row must be a finite float32 for a kernel that recomputes exp(logit - lse).
LOWEST_SAFE_LOG_SUM_EXP = -float(np.log(np.finfo(np.float32).max))

CONFIG = dataclasses.replace(TINY_MODEL, dropout_rate=0.0, attention_dropout_rate=0.0)
# Sources and targets of different lengths, so that the three kinds of attention differ in shape.
PAIRS = [
    ([5, 6, 7, 3], [11, 12, 3]),
    ([8, 9, 3], [13, 14, 15, 16, 3]),
    ([10, 11, 12, 13, 14, 3], [17, 3]),
]
SOURCE_LENGTH, TARGET_LENGTH = 12, 9


def _batches() -> dict[str, tuple[dict, Packing | None]]:
    """Packed rows (pairs 0 and 2 share a row) and unpacked rows, each ending in padding.

    The unpacked batch also holds a row of padding only, as evaluation fills its last batch.
    """
    packed = pack(PAIRS, [[0, 2], [1]], SOURCE_LENGTH)
    packed['targets'] = packed['targets'][:, :TARGET_LENGTH]
    for key in ('targets_segment_ids', 'targets_positions'):
        packed[key] = packed[key][:, :TARGET_LENGTH]
    unpacked = pack(PAIRS + [([], [])], [[0], [1], [2], [3]], SOURCE_LENGTH)
    unpacked = {'inputs': unpacked['inputs'], 'targets': unpacked['targets'][:, :TARGET_LENGTH]}
    return {'packed': (packed, Packing.from_batch(packed)), 'unpacked': (unpacked, None)}


def _recording_kernel(calls: list[dict]):
    """A stand-in for `jax.nn.dot_product_attention` that records what each call is handed."""
    real = jax.nn.dot_product_attention

    def kernel(query, key, value, *, mask=None, implementation=None, **kwargs):
        assert implementation == 'cudnn'
        output, log_sum_exp = real(
            query, key, value, mask=mask, implementation='xla', return_residual=True, **kwargs
        )  # log_sum_exp: [batch, q_len, heads].

        def record(mask, log_sum_exp):
            calls.append({'shape': (query.shape[1], key.shape[1]), 'mask': mask, 'log_sum_exp': log_sum_exp})

        jax.debug.callback(record, mask, log_sum_exp.astype(jnp.float32))
        return output

    return kernel


@pytest.mark.parametrize('batching', ['packed', 'unpacked'])
def test_no_query_row_without_a_key_reaches_the_fused_kernel(monkeypatch, batching):
    calls = []
    monkeypatch.setattr(jax.nn, 'dot_product_attention', _recording_kernel(calls))
    batch, packing = _batches()[batching]
    # One layer of each stack: every kind of attention, each layer handed the same masks.
    config = dataclasses.replace(CONFIG, attention_implementation='cudnn', num_encoder_layers=1, num_decoder_layers=1)
    model = Transformer(config)
    # Compiled as a train step is (op by op, the model's many small operations took ~20 times as long).
    init = jax.jit(model.init, static_argnames='deterministic')
    params = nn.unbox(init(jax.random.key(0), batch['inputs'], batch['targets'], deterministic=True)['params'])
    jax.effects_barrier()

    def loss(params):
        logits = model.apply({'params': params}, batch['inputs'], batch['targets'], packing=packing, deterministic=True)
        return token_metrics(logits, batch['targets'], 0.1)['loss']

    calls.clear()  # Initialisation ran the kernel too; check the forward and backward of a step.
    grads = jax.jit(jax.grad(loss))(params)
    jax.effects_barrier()

    layers = config.num_encoder_layers + 2 * config.num_decoder_layers
    assert len(calls) == layers
    kinds = {(SOURCE_LENGTH, SOURCE_LENGTH), (TARGET_LENGTH, TARGET_LENGTH), (TARGET_LENGTH, SOURCE_LENGTH)}
    assert {call['shape'] for call in calls} == kinds  # Encoder, decoder self- and cross-attention.
    for call in calls:
        assert np.all(np.any(call['mask'], axis=-1)), f"a query row with no key, attention of shape {call['shape']}"
        assert np.all(call['log_sum_exp'] > LOWEST_SAFE_LOG_SUM_EXP), call['shape']
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def _attention_inputs(dtype=jnp.float32):
    """Queries, keys and values [2, 6 or 5, 4, 8] and a padding mask whose last query row has no key."""
    rng = np.random.default_rng(0)
    query, key, value = (jnp.asarray(rng.normal(size=(2, n, 4, 8)), dtype) for n in (6, 5, 5))
    mask = padding_mask(
        jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], bool), jnp.asarray([[1] * 5, [0] * 5], bool)
    )
    return query, key, value, mask


def test_rows_with_a_key_get_the_kernels_output_bit_for_bit_and_rows_without_the_mean_of_the_values():
    query, key, value, mask = _attention_inputs()
    output = fused_dot_product_attention(query, key, value, mask, implementation='xla', dtype=jnp.float32)
    kernel = jax.nn.dot_product_attention(query, key, value, mask=mask, implementation='xla')
    has_key = np.asarray(jnp.any(mask, axis=-1))[:, 0]  # [batch, q_len]
    assert has_key[0].all() and not has_key[1].any()  # Example 1's keys are all padding.
    np.testing.assert_array_equal(np.asarray(output)[has_key], np.asarray(kernel)[has_key])
    # The explicit formula's meaning: equal logits, a uniform softmax, the mean of every value.
    expected = np.broadcast_to(np.mean(np.asarray(value[1]), axis=0), output[1].shape)
    np.testing.assert_allclose(output[1], expected, rtol=1e-6, atol=1e-6)


def test_the_fused_paths_gradients_are_finite_where_rows_have_no_key():
    query, key, value, mask = _attention_inputs()

    def summed(query, key, value):
        return jnp.sum(fused_dot_product_attention(query, key, value, mask, implementation='xla', dtype=jnp.float32))

    for grad in jax.grad(summed, argnums=(0, 1, 2))(query, key, value):
        assert np.all(np.isfinite(grad))


@pytest.mark.parametrize(
    'key_length, defective',
    [(64, True), (192, True), (704, True), (128, False), (256, False), (96, False), (63, False), (8, False)],
)
def test_known_cudnn_defect_is_at_key_lengths_of_64_mod_128(key_length, defective):
    assert cudnn_has_known_defect(key_length) == defective


@pytest.mark.parametrize('key_length, expected_kernel_calls', [(8, 1), (64, 0)])
def test_cudnn_where_safe_falls_back_to_the_formula_at_defective_key_lengths(
    monkeypatch, key_length, expected_kernel_calls
):
    calls = []
    monkeypatch.setattr(jax.nn, 'dot_product_attention', _recording_kernel(calls))
    attention = MultiHeadAttention(num_heads=4, d_model=32, implementation='cudnn_where_safe')
    inputs = jnp.ones((1, key_length, 32))
    mask = segment_mask(jnp.ones((1, key_length), jnp.int32), jnp.ones((1, key_length), jnp.int32))
    variables = attention.init(jax.random.key(0), inputs, inputs, mask, deterministic=True)
    calls.clear()
    attention.apply(variables, inputs, inputs, mask, deterministic=True)
    jax.effects_barrier()
    assert len(calls) == expected_kernel_calls


def test_auto_picks_cudnn_where_safe_on_gpus_in_bfloat16_only(monkeypatch):
    assert build.attention_implementation('auto', 'bfloat16', 64) == 'explicit'  # This CPU.
    monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
    assert build.attention_implementation('auto', 'bfloat16', 64) == 'cudnn_where_safe'
    assert build.attention_implementation('auto', 'float32', 64) == 'explicit'
    assert build.attention_implementation('auto', 'bfloat16', 256) == 'explicit'  # head_dim > 128.
    assert build.attention_implementation('cudnn', 'bfloat16', 64) == 'cudnn'  # What a config names stands.


def test_auto_keeps_the_explicit_formula_on_rocm_gpus_which_have_no_cudnn(monkeypatch):
    """ROCm's backend is 'gpu' too: its platform version tells it from CUDA's."""
    pretend_gpu(monkeypatch, platform_version='rocm 60300')
    assert build.attention_implementation('auto', 'bfloat16', 64) == 'explicit'
    assert build.cudnn_applies('gpu', 'cuda 13000', 'bfloat16', 64)
    assert not build.cudnn_applies('gpu', 'ROCm 6.3.0', 'bfloat16', 64)
    assert not build.cudnn_applies('cpu', 'cpu', 'bfloat16', 64)


def test_the_papers_config_trains_in_bfloat16_with_cudnn_on_a_gpu(monkeypatch):
    config = default.get_config()
    assert config.model.dtype == 'auto'
    pretend_gpu(monkeypatch, compute_capability='9.0')  # An H100.
    model = build.make_model(config, vocab_size=24)
    assert (model.config.dtype, model.config.attention_implementation) == ('bfloat16', 'cudnn_where_safe')
