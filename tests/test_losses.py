"""training/losses.py: label-smoothed cross-entropy, its hand-written gradient, and the metric sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import rounding_tolerance

from training.losses import weighted_metrics

VOCAB = 7


def _example(seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = (3 * rng.normal(size=(2, 3, VOCAB))).astype(np.float32)
    targets = rng.integers(0, VOCAB, (2, 3))
    return logits, targets


def _smoothed_targets(targets: np.ndarray, smoothing: float) -> np.ndarray:
    soft = np.full((*targets.shape, VOCAB), smoothing / (VOCAB - 1))
    np.put_along_axis(soft, targets[..., None], 1 - smoothing, axis=-1)
    return soft


def _softmax(logits: np.ndarray) -> np.ndarray:
    exp = np.exp(logits - logits.max(-1, keepdims=True))
    return exp / exp.sum(-1, keepdims=True)


# A log-softmax over the vocabulary and a sum of VOCAB terms, of magnitude up to ~|logits|.
TOLERANCE = rounding_tolerance(operations=4 * VOCAB, magnitude=10.0)


def _token_losses(logits, targets, smoothing):
    """[...] each token's smoothed loss, as the 'loss' sum of `weighted_metrics` over that token alone."""
    per_token = jax.vmap(lambda z, t: weighted_metrics(z, t, jnp.ones(()), smoothing)["loss"])
    flat = per_token(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return flat.reshape(targets.shape)


@pytest.mark.parametrize("smoothing", [0.1, 0.3])
def test_smoothed_loss_is_kl_to_smoothed_targets(smoothing):
    logits, targets = _example()
    soft = _smoothed_targets(targets, smoothing)
    log_probs = np.log(_softmax(logits.astype(np.float64)))
    expected_kl = (soft * (np.log(soft) - log_probs)).sum(-1)
    actual = _token_losses(jnp.asarray(logits), jnp.asarray(targets), smoothing)
    np.testing.assert_allclose(actual, expected_kl, atol=TOLERANCE)
    # A prediction equal to the smoothed targets scores zero.
    perfect = _token_losses(jnp.log(jnp.asarray(soft, jnp.float32)), jnp.asarray(targets), smoothing)
    np.testing.assert_allclose(perfect, 0, atol=TOLERANCE)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_gradient_is_softmax_minus_smoothed_targets(smoothing):
    # d KL(q || softmax(z)) / dz = softmax(z) - q, for each token, times its weight.
    logits, targets = _example(1)
    weights = np.random.default_rng(2).normal(size=targets.shape).astype(np.float32)

    def weighted_loss(z):
        return weighted_metrics(z, jnp.asarray(targets), jnp.asarray(weights), smoothing)["loss"]

    gradient = jax.grad(weighted_loss)(jnp.asarray(logits))
    expected = weights[..., None] * (_softmax(logits.astype(np.float64)) - _smoothed_targets(targets, smoothing))
    np.testing.assert_allclose(gradient, expected, atol=TOLERANCE)


def test_metric_gradients_add_the_nll_and_smoothed_parts():
    # 'nll' and 'loss' both depend on the logits; the custom gradient must combine both cotangents.
    logits, targets = _example(3)
    smoothing = 0.2
    weights = jnp.ones(targets.shape)

    def mixed(z):
        sums = weighted_metrics(z, jnp.asarray(targets), weights, smoothing)
        return 2.0 * sums["nll"] + 3.0 * sums["loss"]

    onehot = _smoothed_targets(targets, 0.0)
    softmax = _softmax(logits.astype(np.float64))
    expected = 2.0 * (softmax - onehot) + 3.0 * (softmax - _smoothed_targets(targets, smoothing))
    np.testing.assert_allclose(jax.grad(mixed)(jnp.asarray(logits)), expected, atol=4 * TOLERANCE)


def test_correct_counts_the_tokens_whose_target_scores_highest():
    logits, targets = _example(4)
    targets[0, :2] = logits[0, :2].argmax(-1)  # At least two hits.
    weights = np.ones(targets.shape, np.float32)
    weights[1, 0] = 0.0
    sums = weighted_metrics(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), 0.1)
    assert sums["correct"] == np.sum((logits.argmax(-1) == targets) * weights)
    assert sums["correct"] >= 2
    assert sums["tokens"] == weights.sum()
