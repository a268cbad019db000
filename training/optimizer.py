"""Adam with the paper's warm-up + inverse-square-root learning rate (section 5.3)."""

import jax.numpy as jnp
import ml_collections
import optax

from common.config_fields import require_choice
from common.errors import UserInputError

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
    return rsqrt_schedule(paper_peak(d_model, warmup_steps, scale), warmup_steps)


def paper_peak(d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """The learning rate the paper's schedule reaches at step == warmup_steps."""
    return scale * (d_model * max(warmup_steps, 1)) ** -0.5


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


def check_optimizer(config: ml_collections.ConfigDict, d_model: int) -> None:
    """Raises UserInputError naming the first field of config.optimizer that cannot work.

    Args:
        config: config.optimizer.
        d_model: the model's width, which the 'paper' schedule's peak depends on.
    """
    require_choice("optimizer.schedule", config.schedule, SCHEDULES)
    if not 0.0 <= config.label_smoothing < 1.0:
        raise UserInputError("config.optimizer.label_smoothing must be in [0, 1).")
    if config.warmup_steps < 0 or config.grad_clip_norm < 0:
        raise UserInputError("config.optimizer.warmup_steps and grad_clip_norm must be >= 0.")
    _check_schedule(config, d_model)


def _check_schedule(config: ml_collections.ConfigDict, d_model: int) -> None:
    """The learning rate of config.schedule is given by its own fields, and only by them."""
    peak, scale = config.peak_learning_rate, config.learning_rate_scale
    if config.schedule == "rsqrt":
        if peak is None or not peak > 0:
            raise UserInputError(
                f"config.optimizer.peak_learning_rate is {peak!r}; schedule 'rsqrt' needs a positive peak."
            )
        if scale != 1.0:
            raise UserInputError(
                f"config.optimizer.learning_rate_scale is {scale!r} but applies to schedule 'paper' only; "
                "with schedule 'rsqrt', scale config.optimizer.peak_learning_rate instead."
            )
        return
    if not scale > 0:
        raise UserInputError(f"config.optimizer.learning_rate_scale is {scale!r}; it must be positive.")
    if peak is not None:
        paper = paper_peak(d_model, config.warmup_steps, scale)
        raise UserInputError(
            f"config.optimizer.peak_learning_rate is {peak!r} but schedule 'paper' takes its peak from "
            f"config.model.d_model and warmup_steps ({paper:.2e} here): use --config.optimizer.schedule=rsqrt "
            "for a peak of your own, or config.optimizer.learning_rate_scale to scale the paper's."
        )
