"""training/flops.py: the model FLOPs of a step equal the FLOPs of the matmuls XLA is given."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import TINY_MODEL

from models import Transformer
from models.classifier import Classifier, ClassifierConfig
from training import flops
from training.state import create_train_state
from training.steps import train_step, translation_loss

# stablehlo.dot_general %a, %b, [batching_dims = [..] x [..], ]contracting_dims = [i, ..] x [..] : (lhs, rhs) -> out
DOT_GENERAL = re.compile(
    r"stablehlo\.dot_general .*contracting_dims = \[([\d, ]*)\] x \[[\d, ]*\].*"
    r": \(tensor<([\dx]+)x\w+>, tensor<[\dx]+x\w+>\) -> tensor<([\dx]+)x\w+>"
)


def matmul_flops(stablehlo: str) -> int:
    """2 x (output elements) x (contracted elements), summed over every dot_general of a program."""
    total = 0
    for contracting, lhs_shape, out_shape in DOT_GENERAL.findall(stablehlo):
        lhs = [int(d) for d in lhs_shape.split("x")]
        contracted = math.prod(lhs[int(axis)] for axis in contracting.split(","))
        total += 2 * math.prod(int(d) for d in out_shape.split("x")) * contracted
    return total


# key_dim 4 (d_k != d_v) and untied embeddings; source and target of different lengths.
CONFIGS = {
    "tiny": dataclasses.replace(TINY_MODEL, dropout_rate=0.0, attention_dropout_rate=0.0),
    "small_keys": dataclasses.replace(TINY_MODEL, key_dim=4, tie_embeddings=False, num_decoder_layers=1),
}
ROWS, SOURCE_LENGTH, TARGET_LENGTH = 3, 11, 7


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_flops_equal_the_models_matmuls(name):
    config = CONFIGS[name]
    model = Transformer(config)
    inputs, targets = jnp.ones((ROWS, SOURCE_LENGTH), jnp.int32), jnp.ones((ROWS, TARGET_LENGTH), jnp.int32)
    params = model.init(jax.random.key(0), inputs, targets, deterministic=True)
    lowered = jax.jit(functools.partial(model.apply, deterministic=True)).lower(params, inputs, targets)
    expected = matmul_flops(lowered.as_text())
    assert expected > 0
    assert flops.forward_flops(config, ROWS, SOURCE_LENGTH, TARGET_LENGTH) == expected


def test_train_step_flops_equal_the_train_steps_matmuls():
    config = dataclasses.replace(CONFIGS["tiny"], dtype="bfloat16", dropout_rate=0.1)
    model = Transformer(config)
    tx = optax.adam(1e-3)
    state = create_train_state(model, tx, seed=0)
    batch = {
        "inputs": jnp.ones((ROWS, SOURCE_LENGTH), jnp.int32),
        "targets": jnp.ones((ROWS, TARGET_LENGTH), jnp.int32),
    }
    step = functools.partial(
        train_step,
        loss_fn=functools.partial(translation_loss, model=model, label_smoothing=0.1),
        tx=tx,
        learning_rate_fn=lambda count: 1e-3,
    )
    lowered = jax.jit(step).lower(state, batch, jax.random.key(0)).as_text()
    assert flops.train_step_flops(config, ROWS, SOURCE_LENGTH, TARGET_LENGTH) == matmul_flops(lowered)


def test_encoder_only_flops_equal_the_classifiers_matmuls_but_its_head():
    encoder = dataclasses.replace(CONFIGS["tiny"], num_decoder_layers=0)
    num_classes = 3
    model = Classifier(ClassifierConfig(encoder, num_classes))
    inputs = jnp.ones((ROWS, SOURCE_LENGTH), jnp.int32)
    params = model.init(jax.random.key(0), inputs, deterministic=True)
    lowered = jax.jit(functools.partial(model.apply, deterministic=True)).lower(params, inputs)
    head = 2 * ROWS * encoder.d_model * num_classes
    assert flops.forward_flops(encoder, ROWS, SOURCE_LENGTH) == matmul_flops(lowered.as_text()) - head


def test_config_r_step_is_96_gflop():
    # The figure benchmarks/peer_throughput.py reports for config R: 32 x 64 tokens a side.
    config_r = dataclasses.replace(
        TINY_MODEL, vocab_size=8000, d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3
    )
    assert flops.train_step_flops(config_r, 32, 64, 64) == 96_435_437_568


def test_peak_comes_from_the_config_the_table_or_a_measurement():
    assert flops.peak_flops_per_device("bfloat16", configured=1e15) == (1e15, "config")
    # This CPU is in no table: its peak is measured.
    peak, source = flops.peak_flops_per_device("float32")
    assert source == "measured" and peak > 1e8
    assert all(set(peaks) == {"bfloat16", "float32"} for peaks in flops.ACCELERATOR_PEAKS.values())
