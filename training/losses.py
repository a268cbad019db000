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
    weights = weights.astype(jnp.float32)
    nll, loss = _token_losses(logits, targets, label_smoothing)
    # argmax == target, but from two reductions XLA fuses with the loss's instead of an
    # (index, value) reduction over the vocabulary; a tie for the top also counts.
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = (target_logits >= jnp.max(logits, axis=-1)).astype(jnp.float32)
    return {
        "loss": jnp.sum(loss * weights),
        "nll": jnp.sum(nll * weights),
        "correct": jnp.sum(correct * weights),
        "tokens": jnp.sum(weights),
    }


def token_metrics(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> dict[str, jax.Array]:
    """Sums over non-padding tokens: 'loss' (smoothed), 'nll', 'correct', 'tokens'."""
    return weighted_metrics(logits, targets, targets != PAD_ID, label_smoothing)
