"""The train step: label-smoothed loss, the schedule, learning on a fixed batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compiled_programs
from tolerances import loss_rtol
from train_programs import fresh_train_state

from configs import default
from models.build import make_model
from training.optimizer import make_optimizer, rsqrt_schedule
from training.runtime import sharding
from training.state import initial_state, state_shardings
from training.steps import compile_train_step, eval_step, train_step, translation_loss


def test_rsqrt_schedule_warms_up_linearly_then_decays_as_inverse_sqrt():
    schedule = rsqrt_schedule(peak_learning_rate=1e-3, warmup_steps=100)
    # Optax passes the count of updates done: update n (from 1) sees count n - 1.
    np.testing.assert_allclose(schedule(0), 1e-5, rtol=1e-6)
    np.testing.assert_allclose(schedule(49), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(schedule(99), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(schedule(399), 5e-4, rtol=1e-6)  # sqrt(100 / 400) of the peak.


@functools.cache  # The state is immutable, and the tests of one setup share its compiled step.
def _setup(grad_accumulation_steps=1, **model_overrides):
    """One layer a stack unless `model_overrides` say otherwise: what the step does with a loss does not depend
    on the depth, and each layer adds to the compile of every setup's step."""
    config = default.get_config()
    config.dataset.max_length = 16
    config.eval.max_decode_length = 16
    model_config = dict(
        d_model=32, num_heads=4, d_ff=64, num_layers=1, dropout_rate=0.0, norm_placement="pre", dtype="float32"
    )
    model_config.update(model_overrides)
    config.model.update(model_config)
    config.optimizer.update(schedule="rsqrt", peak_learning_rate=3e-3, warmup_steps=10)
    model = make_model(config, vocab_size=24)
    tx, schedule = make_optimizer(config.optimizer, d_model=config.model.d_model)
    state = fresh_train_state(model, tx, 0)
    step = jax.jit(
        functools.partial(
            train_step,
            loss_fn=functools.partial(translation_loss, model=model, label_smoothing=0.0),
            tx=tx,
            learning_rate_fn=schedule,
            grad_accumulation_steps=grad_accumulation_steps,
        )
    )
    return model, state, step


def _copy_task_batch(num_pairs=8, length=10):
    """Targets are the sources reversed: learnable, and the model must use the source."""
    rng = np.random.default_rng(0)
    inputs = np.zeros((num_pairs, length), np.int32)
    targets = np.zeros((num_pairs, length), np.int32)
    for row in range(num_pairs):
        n = rng.integers(3, length - 1)
        words = rng.integers(4, 24, n)
        inputs[row, : n + 1] = [*words, 3]
        targets[row, : n + 1] = [*words[::-1], 3]
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


def test_train_step_lowers_the_loss_on_a_fixed_batch():
    _, state, step = _setup(dropout_rate=0.1)
    batch = _copy_task_batch()
    losses = []
    for i in range(5):
        state, metrics = step(state, batch, jax.random.fold_in(state.rng, i))
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 5
    assert losses[-1] < losses[0] - 0.1, losses
    assert np.isclose(metrics["tokens"], np.count_nonzero(batch["targets"]))


@pytest.mark.slow  # A training run: 250 steps.
@pytest.mark.parametrize("norm_placement", ["pre", "post"])
def test_train_step_overfits_a_handful_of_pairs(norm_placement):
    model, state, step = _setup(norm_placement=norm_placement)
    batch = _copy_task_batch()
    for i in range(250):
        state, metrics = step(state, batch, jax.random.fold_in(state.rng, i))
    assert float(metrics["loss"]) < 0.05, float(metrics["loss"])
    assert float(metrics["accuracy"]) == 1.0
    sums = eval_step(state.params, batch, model=model)
    assert float(sums["correct"]) == float(sums["tokens"]) == np.count_nonzero(batch["targets"])


def test_padding_rows_carry_no_loss_and_no_gradient():
    model, state, step = _setup()
    batch = _copy_task_batch(num_pairs=4)
    padded = {key: jnp.concatenate([value, jnp.zeros_like(value)]) for key, value in batch.items()}
    rng = jax.random.PRNGKey(3)
    state_a, metrics_a = step(state, batch, rng)
    state_b, metrics_b = step(state, padded, rng)
    rtol = loss_rtol(model.config, length=10, tokens=2 * batch["targets"].size)
    np.testing.assert_allclose(metrics_a["loss"], metrics_b["loss"], rtol=rtol)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state_a.params, state_b.params)


def _train(step, state, batch, num_steps=5):
    losses = []
    for i in range(num_steps):
        state, metrics = step(state, batch, jax.random.fold_in(state.rng, i))
        losses.append(float(metrics["loss"]))
    return state, losses


def test_gradient_accumulation_equals_the_full_batch():
    # Micro-batches of 2 pairs with different numbers of real tokens: a mean of
    # per-micro-batch means would differ from the full batch's mean; sums do not.
    batch = _copy_task_batch(num_pairs=8)
    model, state, step = _setup()
    full_state, full_losses = _train(step, state, batch)
    _, state, accumulating_step = _setup(grad_accumulation_steps=4)
    accumulated_state, accumulated_losses = _train(accumulating_step, state, batch)
    rtol = loss_rtol(model.config, length=10, tokens=batch["targets"].size, steps=len(full_losses))
    np.testing.assert_allclose(accumulated_losses, full_losses, rtol=rtol)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), accumulated_state.params, full_state.params
    )


def test_bfloat16_step_tracks_the_float32_step():
    batch = _copy_task_batch()
    _, state, step = _setup()
    _, float32_losses = _train(step, state, batch)
    _, state, step = _setup(dtype="bfloat16")
    _, bfloat16_losses = _train(step, state, batch)
    # bf16 operands carry 8 significant bits; float32 accumulation keeps the loss within 2%.
    np.testing.assert_allclose(bfloat16_losses, float32_losses, rtol=2e-2)
    assert bfloat16_losses[-1] < bfloat16_losses[0] - 0.1, bfloat16_losses


def _compiled_step(compilation: str, peak_learning_rate: float = 3e-3):
    """The train step as the loop compiles it, on a one-device mesh, and a fresh state in its layout."""
    config = default.get_config()
    config.dataset.max_length = config.eval.max_decode_length = 16
    config.model.update(d_model=32, num_heads=4, d_ff=64, num_layers=1, dropout_rate=0.0, dtype="float32")
    config.optimizer.update(schedule="rsqrt", peak_learning_rate=peak_learning_rate, warmup_steps=1)
    model = make_model(config, vocab_size=24)
    tx, schedule = make_optimizer(config.optimizer, d_model=config.model.d_model)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    shardings = state_shardings(config, model, tx, mesh)
    step = compile_train_step(
        compilation,
        mesh,
        config.mesh.rules,
        shardings,
        loss_fn=functools.partial(translation_loss, model=model, label_smoothing=0.1),
        tx=tx,
        learning_rate_fn=schedule,
    )
    return step, step.enter(initial_state(config, model, tx, shardings))


def _run(step, state, batch):
    """One step; returns the states before and after (on the host) and the metrics."""
    before = jax.device_get(step.leave(state))  # The step donates `state`.
    state, metrics = step.run(state, step.place_batch(batch), jax.random.PRNGKey(1))
    return before, jax.device_get(step.leave(state)), jax.device_get(metrics), state


def _assert_same_update_state(a, b):
    jax.tree.map(np.testing.assert_array_equal, (a.params, a.opt_state), (b.params, b.opt_state))


@pytest.mark.parametrize("compilation", ["jit", "pmap"])
def test_a_step_with_a_non_finite_loss_changes_nothing_but_the_step_count(compilation):
    step, state = _compiled_step(compilation)
    batch = jax.tree.map(np.asarray, _copy_task_batch())
    bad = {**batch, "targets": batch["targets"].copy()}
    bad["targets"][0, 0] = 24  # Outside the vocabulary: the gathers fill in NaN.

    before, after, metrics, state = _run(step, state, bad)
    assert not metrics["finite"] and not np.isfinite(metrics["loss"])
    _assert_same_update_state(before, after)
    assert int(after.step) == 1

    before, after, metrics, _ = _run(step, state, batch)  # The next good batch trains as usual.
    assert metrics["finite"] and np.isfinite(metrics["loss"])
    assert int(after.step) == 2
    # At the rate of the optimizer's first update (the skipped step did not advance its schedule).
    assert metrics["learning_rate"] == pytest.approx(rsqrt_schedule(peak_learning_rate=3e-3, warmup_steps=1)(0))
    assert not np.array_equal(
        before.params["shared_embedding"]["embedding"], after.params["shared_embedding"]["embedding"]
    )


@pytest.mark.parametrize("compilation", ["jit", "pmap"])
def test_the_second_step_runs_the_program_the_first_compiled(compilation):
    """The state a step returns comes back in the layout the first step was handed, so nothing compiles again."""
    step, state = _compiled_step(compilation)
    batch = jax.tree.map(np.asarray, _copy_task_batch())
    state, _ = step.run(state, step.place_batch(batch), jax.random.PRNGKey(1))
    placed = step.place_batch(batch)
    with compiled_programs() as programs:
        jax.block_until_ready(step.run(state, placed, jax.random.PRNGKey(2)))
    assert programs == []


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # The learning rate, on purpose.
@pytest.mark.parametrize("compilation", ["jit", "pmap"])
def test_an_update_that_overflows_the_parameters_is_not_applied(compilation):
    # 1e39 is beyond float32 (its largest is 3.4e38): the loss and gradients are finite, the new parameters not.
    step, state = _compiled_step(compilation, peak_learning_rate=1e39)
    before, after, metrics, _ = _run(step, state, jax.tree.map(np.asarray, _copy_task_batch()))
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    assert not metrics["finite"]
    _assert_same_update_state(before, after)
