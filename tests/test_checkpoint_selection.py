"""Choosing the parameters to evaluate: a step, the latest, the best validation BLEU, an average."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import copy_of_trained_tiny_run, run_entry_point, tiny_config
from jax.sharding import NamedSharding, PartitionSpec
from test_bad_input import snapshot

from common.errors import UserInputError
from common.workdir import Workdir
from input_pipeline.tokenizer import load_tokenizer
from models.build import init_params, make_model
from training import loop
from training.checkpoints.checkpointer import (
    CHECKPOINT_CHOICES,
    BestScore,
    Checkpointer,
    save_params,
)
from training.runtime import sharding
from training.state import TrainState


def _params(step: int) -> dict:
    """Parameters that differ at every step, with values whose float32 sums round."""
    rng = np.random.default_rng(step)
    return {
        "encoder": {"kernel": (rng.normal(size=(3, 5)) * 10**step).astype(np.float32)},
        "bias": rng.uniform(-1, 1, size=(7,)).astype(np.float32) / 3,
    }


def _save(checkpointer: Checkpointer, step: int) -> dict:
    params = _params(step)
    tx = optax.adam(1e-3)
    state = TrainState(
        step=jnp.array(step, jnp.int32), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(0)
    )
    checkpointer.save(sharding.replicate(state, sharding.make_mesh()), {"epoch": 0, "batch": step})
    return params


def _replicated_structs(tree):
    """Restore targets: the shapes and dtypes of `tree`, replicated on every device."""
    replicated = NamedSharding(sharding.make_mesh(), PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree)


def _abstract_params() -> dict:
    return _replicated_structs(_params(0))


@pytest.fixture
def workdir_with_steps(tmp_path):
    """A workdir whose rotation holds steps 1..4 (keep=5), without a best checkpoint."""
    workdir = str(tmp_path / "run")
    checkpointer = Checkpointer(workdir, keep=5)
    for step in range(1, 5):
        _save(checkpointer, step)
    checkpointer.wait_until_finished()
    checkpointer.close()
    return workdir


def test_average_is_the_float32_mean_of_the_last_n(workdir_with_steps):
    checkpointer = Checkpointer(workdir_with_steps, read_only=True)
    params, selection = checkpointer.load_params("average:3", _abstract_params())
    checkpointer.close()

    assert selection.steps == (2, 3, 4) and selection.step == 4
    assert selection.description == "average of steps 2, 3, 4"
    expected = jax.tree.map(lambda *leaves: np.mean(np.stack(leaves), axis=0), _params(2), _params(3), _params(4))
    jax.tree.map(lambda got, want: np.testing.assert_array_equal(np.asarray(got), want), params, expected)
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(params))


def test_saved_average_reads_back(workdir_with_steps, tmp_path):
    checkpointer = Checkpointer(workdir_with_steps, read_only=True)
    params, selection = checkpointer.load_params("average:2", _abstract_params())
    checkpointer.close()
    path = Workdir(workdir_with_steps).averaged(selection.steps)
    assert path.endswith(os.path.join("averaged", "2_4"))

    save_params(path, params, selection.steps)
    restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(path)
    assert restored["steps"] == [3, 4]
    jax.tree.map(np.testing.assert_array_equal, restored["state"]["params"], jax.device_get(params))


def test_latest_and_a_step(workdir_with_steps):
    checkpointer = Checkpointer(workdir_with_steps, read_only=True)
    latest, latest_selection = checkpointer.load_params("latest", _abstract_params())
    second, second_selection = checkpointer.load_params(" 2 ", _abstract_params())
    checkpointer.close()
    assert latest_selection.description == "step 4" and second_selection.description == "step 2"
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(latest), _params(4))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(second), _params(2))


@pytest.mark.parametrize(
    "choice, message",
    [
        (
            "average:5",
            r"averages the last 5 checkpoints, but .*/checkpoints holds 4 \(steps 1, 2, 3, 4\).*"
            r"config\.keep_checkpoints",
        ),
        ("average:0", r"must be >= 1"),
        ("7", r"No checkpoint for step 7 in .*/checkpoints; it has steps 1, 2, 3, 4\."),
        ("best", r"No best checkpoint in .*/best_checkpoint: .*config\.eval\.num_bleu_sentences > 0"),
        ("bset", r"Unknown checkpoint 'bset': choose 'latest', 'best', 'average:N' .* or a step number\."),
        ("average:", r"Unknown checkpoint 'average:'"),
        ("-3", r"Unknown checkpoint '-3'"),
        ("²", r"Unknown checkpoint '²'"),
    ],
)
def test_bad_choice_is_one_clear_error(workdir_with_steps, choice, message):
    checkpointer = Checkpointer(workdir_with_steps, read_only=True)
    with pytest.raises(UserInputError, match=message) as error:
        checkpointer.select(choice)
    checkpointer.close()
    assert "\n" not in str(error.value)


def test_unknown_choice_lists_every_form():
    assert all(form in CHECKPOINT_CHOICES for form in ("'latest'", "'best'", "'average:N'", "step number"))


def test_best_is_kept_apart_from_the_rotation_and_survives_a_restart(tmp_path):
    workdir = str(tmp_path / "run")
    checkpointer = Checkpointer(workdir, keep=1)
    kept = []
    for step, bleu in ((1, 5.0), (2, 9.0), (3, 7.0)):
        _save(checkpointer, step)
        kept.append(checkpointer.save_if_best(step, _params(step), bleu))
    checkpointer.wait_until_finished()
    checkpointer.close()
    assert kept == [True, True, False]
    assert os.listdir(os.path.join(workdir, "checkpoints")) == ["3"]
    assert os.listdir(Workdir(workdir).best_checkpoint) == ["2"]

    restarted = Checkpointer(workdir, keep=1)
    assert restarted.best() == BestScore(step=2, value=9.0)
    assert not restarted.save_if_best(4, _params(4), 9.0)  # A tie keeps the earlier step.
    params, selection = restarted.load_params("best", _abstract_params())
    assert selection.description == "best (step 2, valid BLEU 9.00)" and selection.step == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), _params(2))

    assert restarted.save_if_best(5, _params(5), 9.5)
    restarted.wait_until_finished()
    assert os.listdir(Workdir(workdir).best_checkpoint) == ["5"]
    restarted.close()


def test_best_replaces_a_later_stale_step(tmp_path):
    """A step evaluated again after a restart may score higher than the later step on disk."""
    workdir = str(tmp_path / "run")
    checkpointer = Checkpointer(workdir)
    checkpointer.save_if_best(6, _params(6), 10.0)
    checkpointer.wait_until_finished()
    checkpointer.close()

    restarted = Checkpointer(workdir)
    assert restarted.save_if_best(6, _params(1), 10.5)  # The same step, now better.
    restarted.wait_until_finished()
    assert restarted.save_if_best(4, _params(4), 11.0)  # An earlier step than the one on disk.
    restarted.wait_until_finished()
    restarted.close()
    assert os.listdir(Workdir(workdir).best_checkpoint) == ["4"]
    reread = Checkpointer(workdir, read_only=True)
    assert reread.best() == BestScore(step=4, value=11.0)
    params, _ = reread.load_params("best", _abstract_params())
    reread.close()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), _params(4))


# --- End to end: the training loop keeps the best, the command line evaluates it ----------------------------


@pytest.fixture(scope="module")
def trained(small_corpus, trained_tiny_run, tmp_path_factory):
    """The shared tiny run (checkpoints at steps 3 and 6, BLEU checked at both), copied, and the config these
    tests evaluate it with."""
    config = tiny_config(small_corpus, **{"eval.split": "valid"})
    return config, copy_of_trained_tiny_run(trained_tiny_run, tmp_path_factory.mktemp("selection"))


def _run_eval(config, workdir, *args):
    return run_entry_point(
        "train.py",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--config.dataset.path={config.dataset.path}",
        "--config.eval.split=valid",
        "--mode=eval",
        *args,
    )


def _abstract_model_params(config, workdir):
    vocab_size = load_tokenizer(os.path.join(workdir, "tokenizer.model")).vocab_size()
    abstract = jax.eval_shape(lambda: init_params(make_model(config, vocab_size), jax.random.PRNGKey(0)))
    return _replicated_structs(abstract)


def _scores(workdir, split="valid"):
    with open(os.path.join(workdir, "eval", split, "scores.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_cli_evaluates_the_best_checkpoint(trained):
    config, workdir = trained
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]
    assert _scores(workdir, "test")["checkpoint"] == "step 6"  # The evaluation after training.
    checkpointer = Checkpointer(workdir, read_only=True)
    best = checkpointer.best()
    checkpointer.close()
    assert best is not None and best.step in (3, 6)
    assert os.listdir(Workdir(workdir).best_checkpoint) == [str(best.step)]

    result = _run_eval(config, workdir, "--checkpoint=best")
    assert result.returncode == 0, result.stderr[-3000:]
    # Long targets are named too: the loss is over truncated pairs (the tiny vocabulary makes many long).
    assert re.search(r"valid: \d+ source and [1-9]\d* target sentences are longer than 32 subwords", result.stderr)
    scores = _scores(workdir)
    assert scores["checkpoint"] == f"best (step {best.step}, valid BLEU {best.value:.2f})"
    assert scores["step"] == best.step
    # The kept parameters are those the rotation saved at that step.
    checkpointer = Checkpointer(workdir, read_only=True)
    abstract = _abstract_model_params(config, workdir)
    best_params, _ = checkpointer.load_params("best", abstract)
    step_params = checkpointer.restore_params(best.step, abstract)
    checkpointer.close()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(best_params), jax.device_get(step_params))


@pytest.mark.slow
def test_cli_evaluates_and_saves_an_average(trained):
    config, workdir = trained
    result = _run_eval(config, workdir, "--checkpoint=average:2", "--save_average")
    assert result.returncode == 0, result.stderr[-3000:]
    scores = _scores(workdir)
    assert scores["checkpoint"] == "average of steps 3, 6" and scores["step"] == 6

    saved = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(os.path.join(workdir, "averaged", "2_6"))
    assert saved["steps"] == [3, 6]
    checkpointer = Checkpointer(workdir, read_only=True)
    abstract = _abstract_model_params(config, workdir)
    step_3, step_6 = (jax.device_get(checkpointer.restore_params(step, abstract)) for step in (3, 6))
    checkpointer.close()
    expected = jax.tree.map(lambda a, b: np.mean(np.stack([a, b]), axis=0), step_3, step_6)
    jax.tree.map(np.testing.assert_array_equal, saved["state"]["params"], expected)


@pytest.mark.slow
def test_evaluating_a_bad_choice_writes_nothing(trained):
    config, workdir = trained
    before = snapshot(os.path.join(workdir, "eval"))
    with pytest.raises(UserInputError, match=r"Checkpoint 'average:3' averages the last 3 checkpoints"):
        loop.evaluate_checkpoint(config, workdir, "average:3")
    with pytest.raises(UserInputError, match=r"needs the checkpoint choice 'average:N', not 'best'"):
        loop.evaluate_checkpoint(config, workdir, "best", save_average=True)
    assert snapshot(os.path.join(workdir, "eval")) == before
