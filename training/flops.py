"""Model FLOPs of a train step and model FLOPs utilisation (MFU).

Counted as the model's matmuls need them, whatever the implementation runs: 2 FLOPs per
multiply-add, for every projection, feed-forward layer, attention product and the output
projection; the backward pass twice the forward (gradients of activations and of weights),
so a train step is 3x the forward pass. Attention products count the whole [q_len, kv_len]
matrix, as the masked (causal, packed) attention computes it. Elementwise work (softmax,
LayerNorm, dropout, the optimizer) is left out, as in the usual MFU convention (PaLM,
Chowdhery et al., 2022, appendix B).

MFU is model FLOPs per second over the devices' peak: `peak_flops_per_device` gives the
dense matmul peak of the run's devices, from a table of accelerators or, on a CPU, from a
matmul measured on the spot.
"""

import functools
import time

import jax
import jax.numpy as jnp

from models.transformer import TransformerConfig


def _attention_flops(config: TransformerConfig, queries: int, keys: int, *, project_keys: bool = True) -> int:
    """Forward FLOPs of one attention of `queries` positions over `keys` positions.

    `project_keys` False leaves out the key and value projections (cross-attention counts
    them once per source position: `_cross_attention_key_value_flops`).
    """
    heads, d_k, d_v, d_model = config.num_heads, config.d_k, config.d_v, config.d_model
    flops = 2 * queries * d_model * heads * d_k  # Queries.
    flops += 2 * queries * heads * d_v * d_model  # Output projection.
    if project_keys:
        flops += 2 * keys * d_model * heads * (d_k + d_v)
    flops += 2 * queries * keys * heads * (d_k + d_v)  # Scores QK^T and the weighted values.
    return flops


def _feed_forward_flops(config: TransformerConfig, positions: int) -> int:
    return 2 * 2 * positions * config.d_model * config.d_ff


def forward_flops(config: TransformerConfig, rows: int, source_length: int, target_length: int = 0) -> int:
    """Matmul FLOPs of one forward pass over `rows` rows of the given lengths.

    Args:
        config: the model (for the encoder classifier: its encoder's config).
        rows: rows in the batch.
        source_length: source (encoder) positions per row.
        target_length: target (decoder) positions per row; 0 counts the encoder only
            (classification, whose linear head is negligible).
    """
    encoder_layer = _attention_flops(config, source_length, source_length) + _feed_forward_flops(config, source_length)
    flops = config.num_encoder_layers * encoder_layer
    if target_length:
        decoder_layer = (
            _attention_flops(config, target_length, target_length)
            + _attention_flops(config, target_length, source_length, project_keys=False)
            + 2 * source_length * config.d_model * config.num_heads * (config.d_k + config.d_v)
            + _feed_forward_flops(config, target_length)
        )
        flops += config.num_decoder_layers * decoder_layer
        flops += 2 * target_length * config.d_model * config.vocab_size  # Output projection.
    return rows * flops


def train_step_flops(config: TransformerConfig, rows: int, source_length: int, target_length: int = 0) -> int:
    """Model FLOPs of a train step on the batch: the forward pass and the backward pass's two products per matmul."""
    return 3 * forward_flops(config, rows, source_length, target_length)


# Dense matmul peaks per device, FLOP/s, by compute dtype, from the vendors' data sheets (no
# sparsity). float32 matmuls run as JAX runs them by default: TF32 on NVIDIA tensor cores,
# bfloat16 passes on TPUs. Keys are prefixes of `jax.Device.device_kind`; longer first.
ACCELERATOR_PEAKS = {
    "NVIDIA H200": {"bfloat16": 989e12, "float32": 495e12},
    "NVIDIA H100 PCIe": {"bfloat16": 756e12, "float32": 378e12},
    "NVIDIA H100": {"bfloat16": 989e12, "float32": 495e12},  # SXM.
    "NVIDIA A100": {"bfloat16": 312e12, "float32": 156e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},  # v5e.
    "TPU v5e": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v5": {"bfloat16": 459e12, "float32": 459e12},  # v5p reports 'TPU v5'.
}


def measured_matmul_peak(dtype: str, size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a [size, size] x [size, size] matmul on the default device, the best of `repeats`.

    The best, not the median: a peak, on shared machines where a neighbour's load comes and goes
    (there a median can read half the peak or less, and an MFU above 100%).

    bfloat16 operands are multiplied into float32, as the model's matmuls are
    (models/precision.py); XLA:CPU's fast bf16 kernels need that.
    """
    operand = jnp.ones((size, size), jnp.dtype(dtype))
    matmul = jax.jit(functools.partial(jnp.matmul, preferred_element_type=jnp.float32))
    matmul(operand, operand).block_until_ready()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(operand, operand).block_until_ready()
        seconds.append(time.perf_counter() - start)
    return 2 * size**3 / min(seconds)


def peak_flops_per_device(dtype: str, configured: float = 0.0) -> tuple[float, str]:
    """The dense matmul peak of one of this run's devices for `dtype`, and where it comes from.

    Args:
        dtype: the model's compute dtype, 'float32' or 'bfloat16'.
        configured: FLOP/s from the config; > 0 overrides the table and the measurement.

    Returns:
        (FLOP/s, source): the source is 'config', the device kind of the table, or
        'measured' (a CPU, or an accelerator missing from the table: a 2048^2 matmul).
    """
    if configured > 0:
        return configured, "config"
    device = jax.local_devices()[0]
    for kind, peaks in ACCELERATOR_PEAKS.items():
        if device.device_kind.startswith(kind):
            return peaks[dtype], kind
    # CPU devices share the host's cores: the matmul runs on one device, using all of them.
    return measured_matmul_peak(dtype) / jax.local_device_count(), "measured"
