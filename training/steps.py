"""Pure train and eval steps: teacher forcing and label-smoothed cross-entropy.

Both are plain functions of pytrees with no host-side state; `jax.jit` (or any
other transform) compiles them, and the batch may be sharded across devices:
sums over the batch are global whatever the sharding.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from input_pipeline.tokenizer import PAD_ID
from models import Transformer
from training.state import TrainState

Batch = dict[str, jax.Array]  # 'inputs', 'targets': [batch, length] int32


def _token_losses(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> tuple[jax.Array, jax.Array]:
    """Per-token NLL and label-smoothed loss, [batch, length] each, from one log-softmax.

    The smoothed target gives the true token 1 - label_smoothing and every other
    token label_smoothing / (vocab - 1); its cross-entropy is
    (confidence - low) * nll - low * sum(log_probs), with no [batch, length, vocab]
    one-hot built. Subtracting the entropy of the target distribution makes a
    perfect prediction score 0 (the loss is the KL divergence), whatever the smoothing.
    """
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    if label_smoothing == 0:
        return nll, nll
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    minimum = -(confidence * jnp.log(confidence) + (vocab_size - 1) * low * jnp.log(low))
    smoothed = (confidence - low) * nll - low * jnp.sum(log_probs, axis=-1) - minimum
    return nll, smoothed


def smoothed_cross_entropy(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> jax.Array:
    """Per-token KL divergence from the label-smoothed targets to the prediction.

    Args:
        logits: [batch, length, vocab] float32.
        targets: [batch, length] int32 token ids.
        label_smoothing: in [0, 1).

    Returns:
        [batch, length] float32 losses; 0 for a prediction equal to the smoothed targets.
    """
    return _token_losses(logits, targets, label_smoothing)[1]


def token_metrics(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> dict[str, jax.Array]:
    """Sums over non-padding tokens: 'loss' (smoothed), 'nll', 'correct', 'tokens'."""
    weights = (targets != PAD_ID).astype(jnp.float32)
    nll, loss = _token_losses(logits, targets, label_smoothing)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {
        "loss": jnp.sum(loss * weights),
        "nll": jnp.sum(nll * weights),
        "correct": jnp.sum(correct * weights),
        "tokens": jnp.sum(weights),
    }


def train_step(
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    *,
    model: Transformer,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    label_smoothing: float,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update on a batch, with teacher forcing.

    Args:
        state: the current TrainState.
        batch: 'inputs' (source) and 'targets' (target), [batch, length] int32,
            0-padded, each sentence ending with <eos>.
        rng: the dropout key of this step.
        model, tx, learning_rate_fn, label_smoothing: static; bind with
            functools.partial before jitting.

    Returns:
        The new state and per-batch metrics: mean 'loss', 'nll' and 'accuracy' over
        target tokens, 'tokens', 'learning_rate' and the gradient's 'grad_norm'.
    """

    def loss_fn(params):
        logits = model.apply(
            {"params": params}, batch["inputs"], batch["targets"], deterministic=False, rngs={"dropout": rng}
        )
        sums = token_metrics(logits, batch["targets"], label_smoothing)
        return sums["loss"] / jnp.maximum(sums["tokens"], 1.0), sums

    grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    tokens = jnp.maximum(sums["tokens"], 1.0)
    metrics = {
        "loss": sums["loss"] / tokens,
        "nll": sums["nll"] / tokens,
        "accuracy": sums["correct"] / tokens,
        "tokens": sums["tokens"],
        "learning_rate": learning_rate_fn(state.step),
        "grad_norm": optax.tree.norm(grads),
    }
    return new_state, metrics


def jit_train_step(
    model: Transformer,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    label_smoothing: float,
):
    """`train_step` compiled, with its static arguments bound and the old state's buffers donated."""
    return jax.jit(
        functools.partial(
            train_step, model=model, tx=tx, learning_rate_fn=learning_rate_fn, label_smoothing=label_smoothing
        ),
        donate_argnums=0,
    )


def eval_step(params: Any, batch: Batch, *, model: Transformer) -> dict[str, jax.Array]:
    """Sums of 'nll', 'correct' and 'tokens' on a batch, without dropout or smoothing."""
    logits = model.apply({"params": params}, batch["inputs"], batch["targets"], deterministic=True)
    sums = token_metrics(logits, batch["targets"], label_smoothing=0.0)
    del sums["loss"]  # Equal to 'nll' without smoothing.
    return sums
