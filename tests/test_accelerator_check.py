"""benchmarks/accelerator_check.py keeps its promises on a CPU: every section measured, no data stack imported."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO_ROOT

from common.special_ids import EOS_ID
from input_pipeline import synthetic
from models.packing import BATCH_KEYS

# What a machine lent without the data stack lacks; the check must not need any of it.
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
    from benchmarks import accelerator_check  # Defines absl flags: imported by this test alone.

    paper = accelerator_check.make_size("base")
    bare = accelerator_check.without_regularisation(paper)
    assert (bare.config.model.dropout_rate, bare.config.model.attention_dropout_rate) == (0.0, 0.0)
    assert bare.config.optimizer.label_smoothing == 0.0
    assert paper.config.model.dropout_rate == 0.1 and paper.config.optimizer.label_smoothing == 0.1  # Untouched.
    expected = paper.config.to_dict()  # Everything else as it was.
    expected["model"].update(dropout_rate=0.0, attention_dropout_rate=0.0)
    expected["optimizer"]["label_smoothing"] = 0.0
    assert bare.config.to_dict() == expected
    assert bare.name == "base no reg" and bare.rows == paper.rows


@pytest.mark.slow
def test_tiny_check_measures_every_section_without_the_data_stack(tmp_path):
    output = tmp_path / "check.json"
    command = [
        sys.executable,
        "benchmarks/accelerator_check.py",
        "--sizes=tiny",
        "--steps=5",
        "--memory_limit_mib=64",  # A CPU has no device memory limit: the search fills this much.
        f"--output={output}",
    ]
    environment = {**os.environ, "PYTHONPATH": REPO_ROOT}  # As on the lent machine: the repository not installed.
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
    assert tiny["attention"]["compared"] == "explicit vs xla" and tiny["attention"]["agree"]
    search = tiny["max_batch"]
    assert search["rows"] == search["tried_rows"][-1] >= tiny["step"]["rows"]
    assert search["compiled_memory"]["total_bytes"] <= 64 * 2**20
