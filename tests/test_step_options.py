"""training/step_options.py: the train step's speed options change its speed, not what it trains."""

import functools

import jax
import numpy as np
import pytest
from conftest import random_params, tiny_config
from tolerances import BFLOAT16_EPS, loss_rtol, rounding_tolerance, transformer_operations
from train_programs import fresh_train_state

from common.errors import UserInputError
from models.build import make_model
from training import step_options
from training.optimizer import make_optimizer
from training.steps import train_step, translation_loss

_LENGTH = 8


def _model(dtype="float32", **model_overrides):
    config = tiny_config(**{"dataset.max_length": _LENGTH, "model.dtype": dtype})
    config.model.update(model_overrides)
    return make_model(config, vocab_size=64), config


def _batch(rows=4, seed=0):
    """Rows ending in padding: the loss's weights matter."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, 64, size=(2, rows, _LENGTH)).astype(np.int32)
    ids[:, :, -2:] = 0
    return {"inputs": ids[0], "targets": ids[1]}


def _loss_and_grads(model, params, batch, loss_chunks):
    loss_fn = functools.partial(translation_loss, model=model, label_smoothing=0.1, loss_chunks=loss_chunks)
    (_, sums), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch, jax.random.PRNGKey(3))
    return sums, grads


def _gradient_rtol(config, tokens: int, eps: float) -> float:
    """Two orders of the step's backward pass: the forward path and back again, a sum over tokens and vocabulary."""
    operations = 2 * transformer_operations(config, _LENGTH, _LENGTH) + config.vocab_size + tokens
    return rounding_tolerance(operations, eps=eps)


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_the_chunked_loss_equals_the_whole_one_within_float32_rounding(tie_embeddings):
    model, _ = _model(tie_embeddings=tie_embeddings)  # Dropout 0.1: both draw the same masks.
    batch = _batch()
    params = random_params(model, batch["inputs"], batch["targets"])  # NumPy: no init to compile.
    whole_sums, whole_grads = _loss_and_grads(model, params, batch, loss_chunks=1)
    chunked_sums, chunked_grads = _loss_and_grads(model, params, batch, loss_chunks=4)
    rtol = loss_rtol(model.config, _LENGTH, batch["targets"].size)
    for key in ("loss", "nll"):
        np.testing.assert_allclose(chunked_sums[key], whole_sums[key], rtol=rtol)
    assert float(chunked_sums["correct"]) == float(whole_sums["correct"])
    assert float(chunked_sums["tokens"]) == float(whole_sums["tokens"]) == batch["targets"].size * 6 / 8
    rtol = _gradient_rtol(model.config, batch["targets"].size, np.finfo(np.float32).eps)
    for chunked, whole in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(whole_grads), strict=True):
        # Relative to the leaf's largest gradient: a small one may be a difference of large terms.
        np.testing.assert_allclose(chunked, whole, rtol=rtol, atol=rtol * float(np.max(np.abs(whole))))


def test_the_chunked_loss_keeps_the_bfloat16_precision_policy():
    model, _ = _model("bfloat16")
    batch = _batch()
    params = random_params(model, batch["inputs"], batch["targets"])  # NumPy: no init to compile.
    whole_sums, whole_grads = _loss_and_grads(model, params, batch, loss_chunks=1)
    chunked_sums, chunked_grads = _loss_and_grads(model, params, batch, loss_chunks=2)
    np.testing.assert_allclose(
        chunked_sums["loss"], whole_sums["loss"], rtol=loss_rtol(model.config, _LENGTH, batch["targets"].size)
    )
    # Both round the same float32 products to bf16; where the float32 sums differ in their last bits a
    # rounding can go the other way, by one bf16 unit, at each bf16 operand of the backward path.
    rtol = _gradient_rtol(model.config, batch["targets"].size, BFLOAT16_EPS)
    for chunked, whole in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(whole_grads), strict=True):
        assert np.max(np.abs(chunked - whole)) <= rtol * np.max(np.abs(whole))


def test_each_prng_impl_draws_a_steps_dropout_key_from_the_base_key_alone():
    base = jax.random.PRNGKey(0)
    assert step_options.dropout_key(base, "threefry2x32") is base  # Earlier runs' keys, unchanged.
    for impl in ("rbg", "unsafe_rbg"):
        key = step_options.dropout_key(jax.random.fold_in(base, 5), impl)
        again = step_options.dropout_key(jax.random.fold_in(base, 5), impl)
        other_step = step_options.dropout_key(jax.random.fold_in(base, 6), impl)
        assert jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0, impl=impl))
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(again))
        assert not np.array_equal(jax.random.key_data(key), jax.random.key_data(other_step))


def test_a_cheaper_prng_trains_deterministically_and_keeps_the_checkpointed_key():
    model, config = _model()
    batch = _batch()
    tx, schedule = make_optimizer(config.optimizer, d_model=config.model.d_model)
    loss_fn = functools.partial(translation_loss, model=model, label_smoothing=0.1)
    state = fresh_train_state(model, tx, 0)  # Not donated: each impl's step starts from it.
    new_params = {}
    for impl in ("threefry2x32", "rbg"):
        step = jax.jit(functools.partial(train_step, loss_fn=loss_fn, tx=tx, learning_rate_fn=schedule, prng_impl=impl))
        # The state (what a checkpoint holds) is the same whatever the impl: any checkpoint restores under any.
        assert state.rng.shape == (2,) and state.rng.dtype == np.uint32
        key = jax.random.fold_in(state.rng, 1)
        again, _ = step(state, batch, key)  # The step run again (as after a resume): bitwise the same.
        new_state, metrics = step(state, batch, key)
        jax.tree.map(np.testing.assert_array_equal, new_state.params, again.params)
        assert np.isfinite(float(metrics["loss"]))
        new_params[impl] = jax.tree.leaves(new_state.params)[0]
    assert not np.array_equal(new_params["rbg"], new_params["threefry2x32"])  # Its dropout draws other bits.


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"prng_impl": "philox"}, r"config\.prng_impl is 'philox'; choose one of"),
        ({"loss_chunks": 3}, r"config\.loss_chunks is 3; it must divide config\.dataset\.max_length \(32\)"),
        ({"loss_chunks": 0}, r"config\.loss_chunks is 0; it must be a positive integer"),
        ({"loss_chunks": 2, "task": "classification"}, r"translation only"),
    ],
)
def test_options_that_cannot_work_are_refused_naming_the_field(overrides, message):
    with pytest.raises(UserInputError, match=message):
        step_options.check_step_options(tiny_config(**overrides))


def test_a_run_saved_before_the_options_existed_gets_their_defaults():
    config = tiny_config()
    del config["prng_impl"], config["loss_chunks"]  # As an earlier run's config.json has it.
    assert step_options.option(config, "prng_impl") == "threefry2x32"
    assert step_options.option(config, "loss_chunks") == 1
    step_options.check_step_options(config)
