"""Non-finite losses and gradients: never applied, never saved, never the best; the run stops as configured."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import run_entry_point, tiny_config

from common.errors import TrainingStopped, UserInputError
from common.workdir import Workdir
from training.config_checks import validate_config
from training.divergence import EXIT_STATUS, NonFiniteGuard
from training.reporting.scores import nulls_for_nonfinite


def _guard(mode: str, max_in_a_row: int = 3) -> NonFiniteGuard:
    return NonFiniteGuard(mode, max_in_a_row, lambda: "step 2 in /runs/a/checkpoints")


def _check(guard: NonFiniteGuard, first_step: int, flags: list[bool]) -> None:
    for step, finite in enumerate(flags, first_step):
        guard.record(step, jnp.asarray(finite))
    guard.check()


def test_stop_mode_stops_at_the_first_non_finite_step_naming_it_and_the_last_checkpoint():
    guard = _guard("stop")
    _check(guard, 1, [True, True])
    with pytest.raises(TrainingStopped) as stopped:
        _check(guard, 3, [True, False, True])
    message = str(stopped.value)
    assert stopped.value.exit_status == EXIT_STATUS == 3
    assert message.startswith("error: the loss or gradients of step 4 are not finite") and "\n" not in message
    assert "step 2 in /runs/a/checkpoints" in message and "--config.nonfinite=skip" in message


def test_skip_mode_counts_streaks_across_checks_and_stops_after_max_in_a_row():
    guard = _guard("skip", max_in_a_row=3)
    _check(guard, 1, [False, True, False, False, True])  # Streaks of 1 and 2: skipped, training goes on.
    assert guard.skipped == 3
    _check(guard, 6, [False, False])
    with pytest.raises(TrainingStopped) as stopped:
        _check(guard, 8, [False, True])  # Steps 6-8: three in a row, seen over two checks.
    assert guard.skipped == 6
    assert "steps 6 to 8 had a non-finite loss or gradients, 3 in a row" in str(stopped.value)
    assert "6 skipped in all" in str(stopped.value)


def test_non_finite_scores_become_null_and_are_named():
    scores = {"split": "valid", "loss": math.nan, "perplexity": math.inf, "bleu": 0.0, "num_sentences": 4}
    safe = nulls_for_nonfinite(scores)
    assert safe == {**scores, "loss": None, "perplexity": None, "not_finite": ["loss", "perplexity"]}
    assert json.loads(json.dumps(safe, allow_nan=False)) == safe
    assert nulls_for_nonfinite({"loss": 1.5}) == {"loss": 1.5}


def _saved_params(directory: str) -> list[tuple[int, list[np.ndarray]]]:
    """(step, parameter arrays) of every checkpoint under `directory`."""
    saved = []
    for name in sorted(os.listdir(directory), key=int):
        tree = ocp.PyTreeCheckpointer().restore(os.path.join(directory, name, "state"))
        saved.append((int(name), jax.tree.leaves(tree["params"])))
    return saved


def _train(corpus: str, workdir: str, *overrides: str):
    return run_entry_point(
        "train.py",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--config.dataset.path={corpus}",
        "--config.num_train_steps=12",
        "--config.eval_every_steps=1",  # Every step is evaluated and saved, unless it should not be.
        "--config.checkpoint_every_steps=1",
        "--config.keep_checkpoints=20",
        "--config.eval.split=valid",
        "--config.eval.num_bleu_sentences=4",
        "--config.optimizer.peak_learning_rate=1e38",  # The parameters overflow within a few steps.
        *overrides,
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # Restored here without a target.
@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_diverging_run_stops_with_one_line_and_keeps_only_finite_checkpoints(small_corpus, tmp_path, mode):
    workdir = str(tmp_path / "run")
    result = _train(small_corpus, workdir, f"--config.nonfinite={mode}", "--config.max_nonfinite_in_a_row=3")
    print(result.stderr.strip().splitlines()[-1])
    assert result.returncode == EXIT_STATUS, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ")
    saved = _saved_params(Workdir(workdir).checkpoints)
    assert saved, "the steps before the first non-finite one are saved"
    for step, leaves in saved:
        assert all(np.isfinite(leaf).all() for leaf in leaves), f"step {step} holds non-finite parameters"
    if os.path.isdir(Workdir(workdir).best_checkpoint):
        for step, leaves in _saved_params(Workdir(workdir).best_checkpoint):
            assert all(np.isfinite(leaf).all() for leaf in leaves), f"the best, step {step}, is not finite"
    latest = saved[-1][0]
    assert f"The last checkpoint, step {latest} in {Workdir(workdir).checkpoints}, is good" in last_line
    if mode == "stop":
        assert last_line.startswith(f"error: the loss or gradients of step {latest + 1} are not finite")
    else:  # Skipped steps leave the last good parameters, which are saved; the third in a row stops the run.
        assert "3 in a row" in last_line
        np.testing.assert_array_equal(saved[-1][1][0], saved[-2][1][0])


@pytest.mark.parametrize(("field", "value"), [("nonfinite", "ignore"), ("max_nonfinite_in_a_row", 0)])
def test_the_config_check_names_a_bad_nonfinite_field(field, value):
    config = tiny_config(**{field: value})
    with pytest.raises(UserInputError, match=f"config.{field} is {value!r}"):
        validate_config(config, num_devices=1)
