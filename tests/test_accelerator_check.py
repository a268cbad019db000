"""benchmarks/accelerator_check.py keeps its promises on a CPU: every section measured, no data stack imported."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO_ROOT

from benchmarks import accelerator_step
from common.special_ids import EOS_ID
from input_pipeline import synthetic
from models.build import make_model
from models.packing import BATCH_KEYS, Packing

# What a GPU image without the data stack lacks; the check must not need any of it.
DATA_STACK = ("tensorflow", "tensorflow_datasets", "grain", "sentencepiece")


def test_packed_copy_rows_are_in_the_streams_format():
    batch = synthetic.packed_copy_batch(np.random.default_rng(0), 6, 40, num_symbols=10, min_length=4, max_length=12)
    assert set(batch) == {"inputs", "targets", *BATCH_KEYS}
    assert all(array.shape == (6, 40) and array.dtype == np.int32 for array in batch.values())
    np.testing.assert_array_equal(batch["inputs"], batch["targets"])
    for side in ("inputs", "targets"):
        ids, segments, positions = batch[side], batch[f"{side}_segment_ids"], batch[f"{side}_positions"]
        for row in range(6):
            real = segments[row] > 0
            assert np.all(ids[row][~real] == 0) and np.all(positions[row][~real] == 0)
            for segment in range(1, segments[row].max() + 1):
                (where,) = np.nonzero(segments[row] == segment)
                assert 4 <= len(where) <= 12
                np.testing.assert_array_equal(where, np.arange(where[0], where[0] + len(where)))  # Contiguous.
                np.testing.assert_array_equal(positions[row][where], np.arange(len(where)))
                assert ids[row][where[-1]] == EOS_ID
                symbols = ids[row][where[:-1]]
                assert np.all((symbols >= synthetic.FIRST_SYMBOL) & (symbols < synthetic.FIRST_SYMBOL + 10))
            # Filled until the next pair did not fit: the room left is under the longest pair.
            assert 40 - real.sum() < 12


def test_a_blind_model_cannot_beat_log_of_the_symbols():
    assert synthetic.blind_nll(64) == pytest.approx(math.log(64))


def test_the_unregularised_variant_turns_off_dropout_and_label_smoothing_only():
    paper = accelerator_step.make_size("base")
    bare = accelerator_step.without_regularisation(paper)
    assert (bare.config.model.dropout_rate, bare.config.model.attention_dropout_rate) == (0.0, 0.0)
    assert bare.config.optimizer.label_smoothing == 0.0
    assert paper.config.model.dropout_rate == 0.1 and paper.config.optimizer.label_smoothing == 0.1  # Untouched.
    expected = paper.config.to_dict()  # Everything else as it was.
    expected["model"].update(dropout_rate=0.0, attention_dropout_rate=0.0)
    expected["optimizer"]["label_smoothing"] = 0.0
    assert bare.config.to_dict() == expected
    assert bare.name == "base no reg" and bare.rows == paper.rows


def test_the_copy_control_learns_nothing_from_the_source():
    size = accelerator_step.make_size("tiny")
    model = make_model(size.config, size.config.tokenizer.vocab_size)
    batch = synthetic.packed_copy_batch(np.random.default_rng(0), 4, 64, num_symbols=64, min_length=4, max_length=16)
    # Every source symbol replaced by the next one, the targets kept: a model that reads the source scores it otherwise.
    symbol = batch["inputs"] - synthetic.FIRST_SYMBOL
    other = {**batch, "inputs": np.where(symbol >= 0, synthetic.FIRST_SYMBOL + (symbol + 1) % 64, batch["inputs"])}

    def logits(params, batch):
        packing = Packing.from_batch(batch)
        return model.apply(params, batch["inputs"], batch["targets"], packing=packing, deterministic=True)

    params = jax.jit(model.init, static_argnames="deterministic")(
        jax.random.key(0), batch["inputs"], batch["targets"], packing=Packing.from_batch(batch), deterministic=True
    )
    seeing, blind = jax.jit(logits), jax.jit(accelerator_step.without_cross_attention(logits))
    assert np.any(seeing(params, batch) != seeing(params, other))  # The model reads the source...
    np.testing.assert_array_equal(blind(params, batch), blind(params, other))  # ... the control does not.
    assert np.any(blind(params, batch) != seeing(params, batch))


@pytest.mark.parametrize(
    ("final_nll", "control_final_nll", "passed"),
    [
        (0.5, 4.0, True),
        (2.0, 4.0, False),  # The model did not learn to copy.
        (0.5, 0.5, False),  # The control learned it blind: the step leaks the target, the pass means nothing.
        (math.nan, 4.0, False),
        (0.5, math.nan, False),
    ],
)
def test_the_copy_section_passes_only_where_the_model_learns_and_the_control_does_not(
    final_nll, control_final_nll, passed
):
    from benchmarks import accelerator_check  # Defines absl flags: imported by this test alone.

    assert accelerator_check.copy_passed(final_nll, control_final_nll, bar=1.0) is passed


@pytest.mark.slow
def test_tiny_check_measures_every_section_without_the_data_stack(tmp_path):
    output = tmp_path / "check.json"
    command = [
        sys.executable,
        "benchmarks/accelerator_check.py",
        "--sizes=tiny",
        "--steps=5",
        "--memory_limit_mib=64",  # A CPU has no device memory limit: the search fills this much.
        "--attention_length=32",
        f"--output={output}",
    ]
    environment = {**os.environ, "PYTHONPATH": REPO_ROOT}  # As on a GPU machine: the repository not installed.
    subprocess.run(command, cwd=REPO_ROOT, env=environment, check=True, timeout=600)
    record = json.loads(output.read_text())
    assert output.with_suffix(".md").exists()
    assert not set(DATA_STACK) & set(record["loaded_modules"])
    assert record["accelerator"]["device_kind"] and record["software"]["jax"]
    tiny = record["figures"]["tiny"]
    assert [name for name in tiny] == ["step", "dtypes", "copy", "attention", "max_batch"]
    assert not [name for name, figures in tiny.items() if "error" in figures], tiny

    assert tiny["step"]["target_tokens_per_s"] > 0 and 0 < tiny["step"]["mfu"] < 1
    assert tiny["step"]["compiled_memory"]["total_bytes"] > 0
    # The policy of models/precision.py holds for every product of the step on a CPU too.
    assert tiny["dtypes"]["all_on_policy"] and tiny["dtypes"]["by_dtypes"] == {
        "bf16 x bf16 -> f32": tiny["dtypes"]["dot_generals"]
    }
    copy = tiny["copy"]
    assert copy["passed"] and copy["final_nll"] < copy["pass_below"] < copy["blind_nll"] < copy["first_nll"]
    assert copy["steps"] == 300 and copy["control"]["final_nll"] > copy["pass_below"]  # Blind, it cannot copy.
    attention = tiny["attention"]
    assert attention["compared"] == "explicit vs xla" and attention["length"] == 32 and attention["agree"]
    search = tiny["max_batch"]
    assert search["rows"] == search["tried_rows"][-1] >= tiny["step"]["rows"]
    assert search["compiled_memory"]["total_bytes"] <= 64 * 2**20
