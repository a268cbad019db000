"""Pure train and eval steps: teacher forcing and label-smoothed cross-entropy (training/losses.py).

Both are plain functions of pytrees with no host-side state. The train step takes
its loss as a function of (params, batch, rng) (`LossFn`), chosen by the task:
`translation_loss` here, `training.tasks.classification.classification_loss` for
the encoder classifier. `compile_train_step` compiles the train step with `jax.jit`
over a device mesh (the batch, parameters and optimizer state sharded as
training/runtime/sharding.py lays them out) or with `jax.pmap`; either way it
equals the one-device step up to rounding.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from common.mesh_axes import LogicalRules
from models import Packing, Transformer
from training import step_options
from training.losses import chunked_token_metrics, token_metrics
from training.runtime import sharding
from training.state import TrainState
from training.step_options import PRNG_IMPLS, dropout_key

# Translation: 'inputs', 'targets' [batch, length] int32; packed rows add models.packing.BATCH_KEYS.
Batch = dict[str, jax.Array]
# (params, batch, dropout rng) -> (summed loss to differentiate, sums of 'loss', 'nll', 'correct', 'tokens').
# Sums, not means: they add up across micro-batches and devices; 'tokens' is what the
# train step divides them by (target tokens, or examples for classification).
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def translation_loss(
    params: Any, batch: Batch, rng: jax.Array, *, model: Transformer, label_smoothing: float, loss_chunks: int = 1
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The `LossFn` of translation: teacher-forced, label-smoothed, summed over target tokens.

    A batch of packed rows (`Packing.from_batch`) scores each pair as if it had a row of its own.
    `loss_chunks` > 1 computes the logits that many slices of positions at a time
    (`chunked_token_metrics`); 1 all at once.
    """
    apply = functools.partial(
        model.apply,
        {"params": params},
        batch["inputs"],
        batch["targets"],
        packing=Packing.from_batch(batch),
        deterministic=False,
        rngs={"dropout": rng},
    )
    if loss_chunks > 1:
        states, matrix = apply(method=Transformer.output_states)
        sums = chunked_token_metrics(
            states, matrix, batch["targets"], label_smoothing, dtype=model.config.dtype, num_chunks=loss_chunks
        )
    else:
        sums = token_metrics(apply(), batch["targets"], label_smoothing)
    return sums["loss"], sums


def _summed_loss_grads(
    params: Any, batch: Batch, rng: jax.Array, *, loss_fn: LossFn
) -> tuple[Any, dict[str, jax.Array]]:
    """Gradient of the batch's summed (not averaged) loss, and the batch's metric sums.

    Sums, unlike means, add up across micro-batches and devices whatever their token
    counts; the caller divides by the total tokens once.
    """
    return jax.grad(loss_fn, has_aux=True)(params, batch, rng)


def _accumulated_loss_grads(
    params: Any, batch: Batch, rng: jax.Array, *, num_micro_batches: int, **loss_kwargs
) -> tuple[Any, dict[str, jax.Array]]:
    """`_summed_loss_grads` over `num_micro_batches` slices of the batch in turn, summed.

    Only one micro-batch's activations are alive at a time (`lax.scan`), so the
    batch may be `num_micro_batches` times larger than fits in memory at once.
    Micro-batch i draws its dropout from fold_in(rng, i).
    """
    if num_micro_batches == 1:
        return _summed_loss_grads(params, batch, rng, **loss_kwargs)
    # Micro-batch m takes rows m, m + M, m + 2M, ...: each device's block of rows
    # holds a share of every micro-batch, so all devices work on each of them.
    micro_batches = jax.tree.map(lambda x: x.reshape(-1, num_micro_batches, *x.shape[1:]).swapaxes(0, 1), batch)

    def micro_batch_grads(micro_batch, index):
        return _summed_loss_grads(params, micro_batch, jax.random.fold_in(rng, index), **loss_kwargs)

    def add_micro_batch(totals, micro_batch_and_index):
        return jax.tree.map(jnp.add, totals, micro_batch_grads(*micro_batch_and_index)), None

    first = jax.tree.map(lambda x: x[0], micro_batches)
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(micro_batch_grads, first, 0))
    totals, _ = lax.scan(add_micro_batch, zeros, (micro_batches, jnp.arange(num_micro_batches)))
    return totals


def train_step(
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    grad_accumulation_steps: int = 1,
    axis_name: str | None = None,
    prng_impl: str = PRNG_IMPLS[0],
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update on a batch, of the task's `loss_fn`.

    The update is that of the mean loss over the batch's tokens (the 'tokens' that
    `loss_fn` counts: target tokens, or examples for classification), however the
    batch is split: into `grad_accumulation_steps` micro-batches run one after the
    other, and (under `jax.pmap`) over the devices of `axis_name`. Each part
    contributes its summed loss gradient and token count, and the total is divided by
    the total token count, so the result equals the plain step on the whole batch up
    to rounding (a mean of per-part means would weight a part with fewer real tokens
    as much as a full one).

    Args:
        state: the current TrainState.
        batch: what `loss_fn` reads, e.g. 'inputs' (source) and 'targets' (target),
            [batch, length] int32, 0-padded, each sentence ending with <eos>. Under
            `pmap`, this device's share.
        rng: the dropout key of this step.
        loss_fn, tx, learning_rate_fn: static; bind with functools.partial before
            compiling. `loss_fn` is the task's (`translation_loss` for translation).
        grad_accumulation_steps: micro-batches per update; must divide the batch.
        axis_name: the `pmap` axis to sum gradients and metrics over; None under
            `jit` (there the arrays are global and the sums already are).
        prng_impl: the kind of key dropout draws from (training/step_options.py).

    Returns:
        The new state and per-batch metrics: mean 'loss', 'nll' and 'accuracy' over
        the tokens, 'tokens', 'learning_rate', the gradient's 'grad_norm', and
        'finite' (whether the update was applied: see `_is_finite`; if not, the new
        state holds the old parameters and optimizer state, with the step counted).
    """
    if axis_name is not None:
        rng = jax.random.fold_in(rng, lax.axis_index(axis_name))  # Different dropout on each device.
    rng = dropout_key(rng, prng_impl)
    grads, sums = _accumulated_loss_grads(
        state.params,
        batch,
        rng,
        num_micro_batches=grad_accumulation_steps,
        loss_fn=loss_fn,
    )
    if axis_name is not None:
        grads, sums = lax.psum((grads, sums), axis_name)
    tokens = jnp.maximum(sums["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = _is_finite(sums["loss"], grad_norm, params)
    # A non-finite update is never applied: the state keeps its parameters and optimizer
    # state (so Adam's count, which drives the schedule, stays too); the step count
    # moves on, as the batch has been consumed.
    keep_if_not_finite = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    new_state = state.replace(
        step=state.step + 1,
        params=keep_if_not_finite(params, state.params),
        opt_state=keep_if_not_finite(opt_state, state.opt_state),
    )
    metrics = {
        "loss": sums["loss"] / tokens,
        "nll": sums["nll"] / tokens,
        "accuracy": sums["correct"] / tokens,
        "tokens": sums["tokens"],
        "learning_rate": learning_rate_fn(_schedule_count(state.opt_state, state.step)),  # The rate applied.
        "grad_norm": grad_norm,
        "finite": finite,
    }
    return new_state, metrics


def _schedule_count(opt_state: Any, step: jax.Array) -> jax.Array:
    """The count the optimizer's learning-rate schedule is at: behind the step after skipped updates.

    `step` where the optimizer keeps no schedule count (a constant learning rate).
    """
    found = optax.tree_utils.tree_get_all_with_path(
        opt_state,
        "count",
        filtering=lambda path, _: getattr(path[-1], "tuple_name", None) == optax.ScaleByScheduleState.__name__,
    )
    return found[0][1] if found else step


def _is_finite(loss: jax.Array, grad_norm: jax.Array, new_params: Any) -> jax.Array:
    """[] bool: whether an update may be applied, its loss, gradients and resulting parameters all finite.

    The gradient's L2 norm is finite only if every squared gradient is, and then so
    are Adam's moments; the parameters are checked too, as a finite update can still
    overflow them (a huge learning rate). The checks are reductions XLA fuses into
    the step; nothing leaves the device.
    """
    params_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(new_params)]))
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm) & params_finite


def eval_step(params: Any, batch: Batch, *, model: Transformer) -> dict[str, jax.Array]:
    """Sums of 'nll', 'correct' and 'tokens' on a batch, without dropout or smoothing."""
    logits = model.apply({"params": params}, batch["inputs"], batch["targets"], deterministic=True)
    sums = token_metrics(logits, batch["targets"], label_smoothing=0.0)
    del sums["loss"]  # Equal to 'nll' without smoothing.
    return sums


@dataclasses.dataclass(frozen=True)
class CompiledTrainStep:
    """The train step compiled one way, with how the state and batches enter and leave it.

    Between steps the state lives in the step's layout (`enter`); `leave` gives it
    back as a TrainState on the mesh, to checkpoint or evaluate.
    """

    run: Callable  # (state in the step's layout, placed batch, rng) -> (state, metrics)
    place_batch: Callable  # host batch (the task's arrays: 'inputs', 'targets' or 'labels', ...) -> step input
    enter: Callable  # TrainState on the mesh -> the step's layout
    leave: Callable  # the step's layout -> TrainState on the mesh


PMAP_AXIS = "devices"


def compile_train_step(
    compilation: str,
    mesh: Mesh,
    rules: LogicalRules,
    state_shardings: Any,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    grad_accumulation_steps: int = 1,
    prng_impl: str = PRNG_IMPLS[0],
) -> CompiledTrainStep:
    """`train_step` compiled as `compilation` says, its static arguments bound, the old state donated.

    'jit': one program over `mesh`; the state and batch come in sharded (by
    `state_shardings` and the 'batch' rule of `rules`) and XLA partitions the step
    to match. The new state keeps `state_shardings`; the metrics come out replicated.

    'pmap': one copy of the program per device of `mesh` (data parallel: the mesh's
    model axes must have size 1). The state is stacked with one copy per device, the
    batch reshaped to [devices, batch / devices, ...]; every device gets the same rng.
    """
    step = functools.partial(
        train_step,
        loss_fn=loss_fn,
        tx=tx,
        learning_rate_fn=learning_rate_fn,
        grad_accumulation_steps=grad_accumulation_steps,
        prng_impl=prng_impl,
    )
    if compilation == "pmap":
        # Metrics are equal on every device after the sums over devices: returned once.
        run = jax.pmap(
            functools.partial(step, axis_name=PMAP_AXIS),
            axis_name=PMAP_AXIS,
            in_axes=(0, 0, None),
            out_axes=(0, None),
            donate_argnums=0,
        )
        return CompiledTrainStep(
            run=run,
            place_batch=lambda batch: sharding.split_for_pmap(batch, mesh, PMAP_AXIS),
            enter=lambda state: sharding.stack_for_pmap(state, mesh, PMAP_AXIS),
            leave=lambda state: sharding.unstack_from_pmap(state, mesh),
        )
    replicated = NamedSharding(mesh, PartitionSpec())
    return CompiledTrainStep(
        run=jax.jit(step, out_shardings=(state_shardings, replicated), donate_argnums=0),
        place_batch=lambda batch: sharding.shard_batch(batch, mesh, rules),
        enter=lambda state: state,
        leave=lambda state: state,
    )


def configured_train_step(
    config: ml_collections.ConfigDict,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    mesh: Mesh,
    shardings: Any,
) -> CompiledTrainStep:
    """The train step of `loss_fn` as config asks for it (jit or pmap, micro-batches), for `mesh` and `shardings`."""
    return compile_train_step(
        config.step_compilation,
        mesh,
        config.mesh.rules,
        shardings,
        loss_fn=loss_fn,
        tx=tx,
        learning_rate_fn=learning_rate_fn,
        grad_accumulation_steps=config.grad_accumulation_steps,
        prng_impl=step_options.option(config, "prng_impl"),
    )
