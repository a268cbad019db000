"""Adam with the paper's warm-up + inverse-square-root learning rate."""

import jax.numpy as jnp
import ml_collections
import optax


def rsqrt_schedule(peak_learning_rate: float, warmup_steps: int) -> optax.Schedule:
    """lr(step) = peak * min(step / warmup, sqrt(warmup / step)), step counted from 1.

    This is the paper's d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) with its
    constant folded into the peak, reached at step == warmup_steps.
    """
    warmup = max(warmup_steps, 1)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0  # Optax counts updates from 0.
        return peak_learning_rate * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

    return schedule


def make_optimizer(config: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Adam (β₂ 0.98, ε 1e-9 in the paper) with optional global-norm clipping."""
    schedule = rsqrt_schedule(config.peak_learning_rate, config.warmup_steps)
    adam = optax.adam(schedule, b1=config.b1, b2=config.b2, eps=config.eps)
    if config.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam), schedule
    return adam, schedule
