"""Adam with the paper's warm-up + inverse-square-root learning rate (section 5.3)."""

import jax.numpy as jnp
import ml_collections
import optax

# config.optimizer.schedule: how the warm-up + inverse-square-root learning rate gets its peak.
SCHEDULES = ("paper", "rsqrt")


def rsqrt_schedule(peak_learning_rate: float, warmup_steps: int) -> optax.Schedule:
    """lr(step) = peak * min(step / warmup, sqrt(warmup / step)), step counted from 1.

    Linear warm-up to `peak_learning_rate` at step == warmup_steps, then decay as 1 / sqrt(step).
    """
    warmup = max(warmup_steps, 1)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0  # Optax counts updates from 0.
        return peak_learning_rate * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

    return schedule


def paper_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
    """lr(step) = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1 (section 5.3).

    The rsqrt schedule with the peak the formula reaches at step == warmup_steps,
    scale * (d_model * warmup_steps)^-0.5: 7.0e-4 for Transformer-base (d_model 512, warm-up 4000).
    `scale` is the constant t5x and tensor2tensor multiply it by (1 in the paper).
    """
    warmup = max(warmup_steps, 1)
    return rsqrt_schedule(scale * (d_model * warmup) ** -0.5, warmup)


def make_schedule(config: ml_collections.ConfigDict, d_model: int) -> optax.Schedule:
    """The learning rate config.optimizer asks for ('paper' needs the model's d_model)."""
    if config.schedule == "paper":
        return paper_schedule(d_model, config.warmup_steps, config.learning_rate_scale)
    if config.schedule == "rsqrt":
        return rsqrt_schedule(config.peak_learning_rate, config.warmup_steps)
    raise ValueError(f"Unknown learning rate schedule {config.schedule!r}; choose one of {SCHEDULES}.")


def make_optimizer(
    config: ml_collections.ConfigDict, *, d_model: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Adam (β₂ 0.98, ε 1e-9 in the paper) with optional global-norm clipping, and its schedule.

    Args:
        config: config.optimizer.
        d_model: the model's width, which the 'paper' schedule's peak depends on.
    """
    schedule = make_schedule(config, d_model)
    adam = optax.adam(schedule, b1=config.b1, b2=config.b2, eps=config.eps)
    if config.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam), schedule
    return adam, schedule
