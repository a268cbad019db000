"""Label-smoothed cross-entropy (Vaswani et al., 2017, section 5.4) and the metric sums of a batch.

The loss reads the [batch, length, vocab] logits, the largest tensor of a translation step,
as few times as it can: the forward pass takes the maximum, the log-sum-exp, the sum and
the target's logit in reductions over the vocabulary, and the backward pass writes the
gradient softmax - smoothed target in one elementwise pass (`_token_losses`' custom
gradient), where automatic differentiation of a log-softmax would materialise the
log-probabilities, a one-hot scatter and their sum.
"""

import functools
import math

import jax
import jax.numpy as jnp

from common.special_ids import PAD_ID
from models.precision import float32_accumulating_einsum


def _smoothing_constants(label_smoothing: float, vocab_size: int) -> tuple[float, float, float]:
    """(confidence, low, minimum): the smoothed target's probabilities and its entropy.

    The smoothed target gives the true token confidence = 1 - label_smoothing and every
    other token low = label_smoothing / (vocab - 1).
    """
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    entropy = -confidence * math.log(confidence)
    if low > 0:
        entropy -= (vocab_size - 1) * low * math.log(low)
    return confidence, low, entropy


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _token_losses(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> tuple[jax.Array, jax.Array]:
    """Per-token NLL and label-smoothed loss, [...] each, of logits [..., vocab].

    With log p = logits - logsumexp(logits), the cross-entropy to the smoothed target is
    (confidence - low) * nll - low * sum(log p); minus that target's entropy it is the KL
    divergence, 0 for a perfect prediction whatever the smoothing.
    """
    return _token_losses_forward(logits, targets, label_smoothing)[0]


def _token_losses_forward(logits, targets, label_smoothing):
    confidence, low, entropy = _smoothing_constants(label_smoothing, logits.shape[-1])
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    nll = log_normalizer - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    if label_smoothing == 0:
        smoothed = nll
    else:
        sum_log_probs = jnp.sum(logits, axis=-1) - logits.shape[-1] * log_normalizer
        smoothed = (confidence - low) * nll - low * sum_log_probs - entropy
    return (nll, smoothed), (logits, targets, log_normalizer)


def _token_losses_backward(label_smoothing, residuals, cotangents):
    # d nll / d logits = p - onehot; d smoothed / d logits = p - (low + (confidence - low) * onehot).
    logits, targets, log_normalizer = residuals
    nll_cotangent, smoothed_cotangent = cotangents
    confidence, low, _ = _smoothing_constants(label_smoothing, logits.shape[-1])
    if label_smoothing == 0:
        nll_cotangent, smoothed_cotangent = nll_cotangent + smoothed_cotangent, jnp.zeros_like(smoothed_cotangent)
    probs = jnp.exp(logits - log_normalizer[..., None])
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]  # Compared in place: no one-hot is stored.
    target_weight = nll_cotangent + (confidence - low) * smoothed_cotangent
    total = (nll_cotangent + smoothed_cotangent)[..., None]
    target_part = jnp.where(is_target, target_weight[..., None], 0.0)
    logits_grad = probs * total - target_part - low * smoothed_cotangent[..., None]
    return logits_grad, None


_token_losses.defvjp(_token_losses_forward, _token_losses_backward)


def weighted_metrics(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, label_smoothing: float
) -> dict[str, jax.Array]:
    """Weighted sums: 'loss' (smoothed), 'nll', 'correct' (the target scored highest) and 'tokens' (the weights).

    A token's smoothed loss is the KL divergence from its label-smoothed target to the prediction:
    0 for a prediction equal to the smoothed target.

    Args:
        logits: [..., classes] float32.
        targets: [...] int32 class ids (tokens, or labels).
        weights: [...] 1 for what counts, 0 for padding.
        label_smoothing: in [0, 1).
    """
    nll, loss = _token_losses(logits, targets, label_smoothing)
    return _weighted_sums(nll, loss, _is_correct(logits, targets), weights)


def _is_correct(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """[...] float32: 1 where the target scores highest (a tie for the top counts), of logits [..., vocab]."""
    # argmax == target, but from two reductions XLA fuses with the loss's instead of an
    # (index, value) reduction over the vocabulary.
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (target_logits >= jnp.max(logits, axis=-1)).astype(jnp.float32)


def _weighted_sums(nll: jax.Array, loss: jax.Array, correct: jax.Array, weights: jax.Array) -> dict[str, jax.Array]:
    weights = weights.astype(jnp.float32)
    return {
        "loss": jnp.sum(loss * weights),
        "nll": jnp.sum(nll * weights),
        "correct": jnp.sum(correct * weights),
        "tokens": jnp.sum(weights),
    }


def token_metrics(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> dict[str, jax.Array]:
    """Sums over non-padding tokens: 'loss' (smoothed), 'nll', 'correct', 'tokens'."""
    return weighted_metrics(logits, targets, targets != PAD_ID, label_smoothing)


# The scope of the chunked loss's operations: profiles (benchmarks/hlo_buckets.py) put its matmuls with the
# vocabulary projection and the rest with the loss, as they do the model's `_logits` and `_token_losses`.
_SCOPE = "chunked_logits"


def _chunk_logits(states: jax.Array, matrix: jax.Array, dtype) -> jax.Array:
    """[batch, positions, vocab] float32 logits of states [batch, positions, d_model], as the model computes them."""
    return float32_accumulating_einsum("bld,vd->blv", states, matrix, dtype=dtype)


def _chunks(length: int, num_chunks: int) -> list[slice]:
    size = length // num_chunks
    return [slice(start, start + size) for start in range(0, length, size)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked_token_losses(states, matrix, targets, label_smoothing, dtype, num_chunks):
    """(nll, smoothed, correct), [batch, length] each, of logits states @ matrix^T computed a slice at a time."""
    return _chunked_token_losses_forward(states, matrix, targets, label_smoothing, dtype, num_chunks)[0]


def _chunked_token_losses_forward(states, matrix, targets, label_smoothing, dtype, num_chunks):
    outputs = []
    for chunk in _chunks(targets.shape[1], num_chunks):
        with jax.named_scope(_SCOPE):
            logits = _chunk_logits(states[:, chunk], matrix, dtype)
            (nll, smoothed), (_, _, log_normalizer) = _token_losses_forward(logits, targets[:, chunk], label_smoothing)
            outputs.append((nll, smoothed, _is_correct(logits, targets[:, chunk]), log_normalizer))
    nll, smoothed, correct, log_normalizer = (jnp.concatenate(parts, axis=1) for parts in zip(*outputs))
    return (nll, smoothed, correct), (states, matrix, targets, log_normalizer)


def _chunked_token_losses_backward(label_smoothing, dtype, num_chunks, residuals, cotangents):
    # Each slice's logits again, their gradient as _token_losses' backward gives it, then the
    # projection's gradients as models/precision.py takes them: the cotangent cast to `dtype`,
    # products accumulated in float32, each gradient rounded to `dtype` (the matrix's once, whole).
    states, matrix, targets, log_normalizer = residuals
    nll_cotangent, smoothed_cotangent, _ = cotangents
    matrix_operand = matrix.astype(dtype)
    states_grads, matrix_grad = [], jnp.zeros(matrix.shape, jnp.float32)
    for chunk in _chunks(targets.shape[1], num_chunks):
        with jax.named_scope(_SCOPE):
            logits = _chunk_logits(states[:, chunk], matrix, dtype)
            residual = (logits, targets[:, chunk], log_normalizer[:, chunk])
            logits_grad, _ = _token_losses_backward(
                label_smoothing, residual, (nll_cotangent[:, chunk], smoothed_cotangent[:, chunk])
            )
            logits_grad = logits_grad.astype(dtype)
            states_grads.append(
                float32_accumulating_einsum("blv,vd->bld", logits_grad, matrix_operand, dtype=dtype).astype(dtype)
            )
            matrix_grad += float32_accumulating_einsum(
                "bld,blv->vd", states[:, chunk].astype(dtype), logits_grad, dtype=dtype
            )
    states_grad = jnp.concatenate(states_grads, axis=1).astype(states.dtype)
    return states_grad, matrix_grad.astype(dtype).astype(matrix.dtype), None


_chunked_token_losses.defvjp(_chunked_token_losses_forward, _chunked_token_losses_backward)


def chunked_token_metrics(
    states: jax.Array, matrix: jax.Array, targets: jax.Array, label_smoothing: float, *, dtype, num_chunks: int
) -> dict[str, jax.Array]:
    """`token_metrics` of the logits states @ matrix^T, never holding more than one slice of them.

    The target positions are split into `num_chunks` equal slices; each slice's float32 logits
    [batch, length / num_chunks, vocab] are computed, reduced to per-token losses and dropped,
    and computed again in the backward pass for their gradient. Equal to `token_metrics` on the
    whole logits up to float32 rounding (the matrix's gradient sums the slices' in another order).

    Args:
        states: [batch, length, d_model] float32, the decoder's final states (`Transformer.output_states`).
        matrix: [vocab, d_model] float32, the output projection.
        targets: [batch, length] int32 token ids, pad_id where padding.
        label_smoothing: in [0, 1).
        dtype: the model's compute dtype (the projection's operands).
        num_chunks: slices of the length; must divide it.
    """
    nll, loss, correct = _chunked_token_losses(states, matrix, targets, label_smoothing, jnp.dtype(dtype), num_chunks)
    return _weighted_sums(nll, loss, correct, targets != PAD_ID)
