"""Tolerances derived from floating-point arithmetic, for two computations of the same value.

Two evaluations of one formula in different orders (another CPU's XLA kernels, the
cached decoder against the full one, sharded against one device) each differ from
the exact result by at most n * u times the magnitude of the terms involved, for
n rounded operations in sequence on the value's path (a sum of n terms: Higham,
"Accuracy and Stability of Numerical Algorithms", 2002, section 4.2), with u = eps / 2
the unit roundoff; so they differ from each other by at most n * eps times that
magnitude. That is a worst case (errors typically grow like sqrt(n)): tests pass
by a wide margin on any IEEE-754 machine, while the bugs they look for (a wrong
mask, a stale cache, a missed shard) change values by their own order.
"""

import numpy as np

from models import TransformerConfig

FLOAT32_EPS = float(np.finfo(np.float32).eps)  # 2^-23: float32's spacing at 1.
BFLOAT16_EPS = 2.0**-7  # bfloat16 keeps 8 significant bits.


def rounding_tolerance(operations: int, magnitude: float = 1.0, eps: float = FLOAT32_EPS) -> float:
    """The most two orders of `operations` rounded operations on values of `magnitude` can differ by."""
    return operations * eps * magnitude


def _attention(config: TransformerConfig, keys: int) -> int:
    head_dim = config.d_model // config.num_heads
    # Projection, scores q.k, softmax's max and sum, the weighted sum of values, output projection.
    return config.d_model + head_dim + 2 * keys + keys + config.d_model


def _layer_norm(config: TransformerConfig) -> int:
    return 2 * config.d_model + 2  # Mean, variance; scale and shift.


def transformer_operations(config: TransformerConfig, source_length: int, target_length: int) -> int:
    """Rounded operations in sequence from the embeddings to one output logit of the Transformer.

    Each layer adds its sub-layers' reduction lengths (attention over the keys,
    the two feed-forward matmuls), its layer norms and residual sums; then the
    final norm and the output projection.
    """
    feed_forward = config.d_model + config.d_ff
    encoder_layer = _attention(config, source_length) + feed_forward + 2 * _layer_norm(config) + 2
    decoder_layer = (
        _attention(config, target_length)
        + _attention(config, source_length)
        + feed_forward
        + 3 * _layer_norm(config)
        + 3
    )
    return (
        config.num_encoder_layers * encoder_layer
        + config.num_decoder_layers * decoder_layer
        + 2 * _layer_norm(config)  # Pre-LN's final norms (post-LN has none: an overestimate).
        + config.d_model  # The output projection.
        + 2  # Embedding scale and positions.
    )


def loss_rtol(config: TransformerConfig, length: int, tokens: int, steps: int = 1) -> float:
    """Relative tolerance of a mean token loss computed two ways (devices, micro-batches, padding rows).

    Each token's loss carries the model's path and a log-sum-exp over the
    vocabulary; the mean adds `tokens` of them; after `steps` training steps, each
    earlier update carried its own rounding of the same order into the parameters.
    """
    per_step = transformer_operations(config, length, length) + config.vocab_size + tokens
    return rounding_tolerance(steps * per_step)
