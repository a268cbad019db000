"""Damaged checkpoints: resume and 'latest' fall back past them, a named one is one error, nothing non-finite is saved.

The damage is done to the files Orbax wrote, in each of the ways of issue 8: a truncated array file,
a missing manifest.ocdbt, a garbled _METADATA, a missing state/ folder, flipped bytes, NaN values.
"""

import glob
import logging
import os
import re
import shutil
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import copy_of_trained_tiny_run, run_entry_point, tiny_config
from jax.sharding import NamedSharding, PartitionSpec

from common.errors import UserInputError
from common.workdir import Workdir
from training import inference
from training.checkpoints import checkpointer as checkpointer_module
from training.checkpoints.checkpointer import (
    Checkpointer,
    DamagedCheckpointError,
    NonFiniteStateError,
)
from training.checkpoints.integrity import Summary
from training.runtime import sharding
from training.state import TrainState

# --- Tiny states built in-process -------------------------------------------------------------------------


def _params(step: int) -> dict:
    """A few KB of parameters that differ at every step (random floats: zstd leaves them near raw)."""
    rng = np.random.default_rng(step)
    return {
        "encoder": {"kernel": rng.normal(size=(32, 48)).astype(np.float32)},
        "bias": rng.uniform(-1, 1, size=(48,)).astype(np.float32),
    }


def _state(step: int, params: dict | None = None) -> TrainState:
    params = _params(step) if params is None else params
    adam, *rest = optax.adam(1e-3).init(params)
    # Adam moments as after some updates: as large as the parameters, and as incompressible.
    adam = adam._replace(
        count=jnp.array(step, jnp.int32), mu=jax.tree.map(lambda p: 0.1 * p, params), nu=jax.tree.map(np.square, params)
    )
    opt_state = (adam, *rest)
    state = TrainState(step=jnp.array(step, jnp.int32), params=params, opt_state=opt_state, rng=jax.random.PRNGKey(0))
    return sharding.replicate(state, sharding.make_mesh())


def _replicated_structs(tree):
    replicated = NamedSharding(sharding.make_mesh(), PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree)


def _abstract_state():
    return _replicated_structs(jax.eval_shape(lambda: _state(0)))


def _save_steps(workdir: str, steps, *, keep: int = 5, best: int | None = None) -> None:
    checkpointer = Checkpointer(workdir, keep=keep)
    for step in steps:
        checkpointer.save(_state(step), {"epoch": 0, "batch": step})
        if step == best:
            checkpointer.save_if_best(step, _params(step), 10.0)
    checkpointer.wait_until_finished()
    checkpointer.close()


def _assert_params_equal(got, step: int) -> None:
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), _params(step))


# --- The damage, done to the files on disk ----------------------------------------------------------------


def _state_dir(workdir: str, step: int) -> str:
    return os.path.join(Workdir(workdir).checkpoints, str(step), "state")


def _array_files(workdir: str, step: int) -> list[str]:
    """The OCDBT data files holding the arrays' values, largest first."""
    files = glob.glob(os.path.join(_state_dir(workdir, step), "ocdbt.process_*", "d", "*"))
    return sorted(files, key=lambda f: (-os.path.getsize(f), f))


def _flip_bytes(path: str, offset: int, count: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(workdir, step):
    """Cuts the array files to a tenth (which arrays share a file varies from save to save)."""
    for path in _array_files(workdir, step):
        os.truncate(path, os.path.getsize(path) // 10)


def _remove_manifest(workdir, step):
    os.remove(os.path.join(_state_dir(workdir, step), "manifest.ocdbt"))


def _garble_metadata(workdir, step):
    with open(os.path.join(_state_dir(workdir, step), "_METADATA"), "r+b") as f:
        f.seek(40)
        f.write(b"\x00\xff garbled \xfe" * 4)


def _remove_state(workdir, step):
    shutil.rmtree(_state_dir(workdir, step))


def _flip_bytes_throughout(workdir, step):
    """64 flipped bytes at 8 places inside every array file: the parameters and the Adam moments are hit."""
    for path in _array_files(workdir, step):
        size = os.path.getsize(path)
        for k in range(8):
            _flip_bytes(path, min(size * (2 * k + 1) // 16, max(size - 64, 0)))


def _write_nan_state(workdir, step):
    """Replaces the step by one whose parameters hold a NaN, written past the Checkpointer's refusal."""
    shutil.rmtree(os.path.join(Workdir(workdir).checkpoints, str(step)))
    params = _params(step)
    params["bias"][3] = np.nan
    checkpointer = Checkpointer(workdir)
    with mock.patch.object(checkpointer_module, "finite_summary", lambda tree, refusal: Summary(tree)):
        checkpointer.save(_state(step, params), {"epoch": 0, "batch": step})
    checkpointer.wait_until_finished()
    checkpointer.close()


def _remove_integrity(workdir, step):
    shutil.rmtree(os.path.join(Workdir(workdir).checkpoints, str(step), "integrity"))


DAMAGE = {
    "truncated array files": (_truncate, "reading it failed"),
    "missing manifest.ocdbt": (_remove_manifest, "metadata is unreadable"),
    "garbled _METADATA": (_garble_metadata, "metadata is unreadable"),
    "missing state/": (_remove_state, "state/ folder is missing"),
    # Whichever check meets the damage first: zstd's frame checks, finiteness or the fingerprint.
    "flipped bytes": (_flip_bytes_throughout, "integrity check failed|reading it failed|holds NaN or Inf"),
    "NaN values": (_write_nan_state, "holds NaN or Inf in params/bias"),
    "missing integrity/": (_remove_integrity, "its integrity/ record is missing, so its arrays cannot be verified"),
}


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "read only" not in r.getMessage()
    ]


@pytest.fixture
def workdir(tmp_path):
    """A workdir whose rotation holds steps 1, 2, 3."""
    path = str(tmp_path / "run")
    _save_steps(path, (1, 2, 3))
    return path


# --- Resume and 'latest' fall back --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_falls_back_and_moves_the_damaged_step_aside(workdir, kind, caplog):
    damage, cause = DAMAGE[kind]
    damage(workdir, 3)
    checkpointer = Checkpointer(workdir, keep=3)
    with caplog.at_level(logging.WARNING):
        state, data_state = checkpointer.restore_latest(_abstract_state())

    assert int(state.step) == 2 and data_state == {"epoch": 0, "batch": 2}
    _assert_params_equal(state.params, 2)
    moved = os.path.join(Workdir(workdir).damaged_checkpoints, "3")
    [warning] = _warnings(caplog)
    assert warning.startswith(f"The checkpoint at step 3 in {Workdir(workdir).checkpoints} is damaged: ")
    assert re.search(cause, warning) and warning.endswith(f"; moved it to {moved} and resumed from step 2.")
    assert "\n" not in warning
    # Moved, not deleted; the rotation no longer counts it, so step 3 is saved again and nothing good goes.
    assert os.path.isdir(moved) and checkpointer.all_steps() == [1, 2]
    for step in (3, 4):
        checkpointer.save(_state(step), {"epoch": 0, "batch": step})
    checkpointer.wait_until_finished()
    assert checkpointer.all_steps() == [2, 3, 4]
    _assert_params_equal(checkpointer.restore(3, _abstract_state())[0].params, 3)
    checkpointer.close()


@pytest.mark.parametrize("kind", DAMAGE)
def test_latest_parameters_skip_a_damaged_step_and_leave_it(workdir, kind, caplog):
    damage, cause = DAMAGE[kind]
    damage(workdir, 3)
    checkpointer = Checkpointer(workdir, read_only=True)
    with caplog.at_level(logging.WARNING):
        params, selection = checkpointer.load_params("latest", _replicated_structs(_params(0)))
    checkpointer.close()

    assert selection.description == "step 2"
    _assert_params_equal(params, 2)
    [warning] = _warnings(caplog)
    assert warning.startswith(f"The checkpoint at step 3 in {Workdir(workdir).checkpoints} is damaged: ")
    assert re.search(cause, warning) and warning.endswith("; skipped it, using step 2.")
    assert sorted(os.listdir(Workdir(workdir).checkpoints)) == ["1", "2", "3"]
    assert not os.path.exists(Workdir(workdir).damaged_checkpoints)


def test_several_damaged_steps_each_get_one_line(workdir, caplog):
    _remove_state(workdir, 3)
    _garble_metadata(workdir, 2)
    checkpointer = Checkpointer(workdir)
    with caplog.at_level(logging.WARNING):
        state, _ = checkpointer.restore_latest(_abstract_state())
    checkpointer.close()
    assert int(state.step) == 1
    assert [w.split(" is damaged")[0] for w in _warnings(caplog)] == [
        f"The checkpoint at step {step} in {Workdir(workdir).checkpoints}" for step in (3, 2)
    ]
    assert sorted(os.listdir(Workdir(workdir).damaged_checkpoints)) == ["2", "3"]


def test_no_intact_step_is_one_error_and_moves_nothing(tmp_path):
    workdir = str(tmp_path / "run")
    _save_steps(workdir, (1, 2))
    _remove_state(workdir, 2)
    _truncate(workdir, 1)
    checkpointer = Checkpointer(workdir)
    with pytest.raises(DamagedCheckpointError) as error:
        checkpointer.restore_latest(_abstract_state())
    checkpointer.close()
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        f"No intact checkpoint in {Workdir(workdir).checkpoints}, nothing was changed: step 2: its state/ folder is "
        "missing; step 1: reading it failed ("
    )
    assert message.endswith(f"Move {Workdir(workdir).checkpoints} away to train from step 0.")
    assert sorted(os.listdir(Workdir(workdir).checkpoints)) == ["1", "2"]


def test_a_misfit_is_an_error_not_damage(workdir):
    """A checkpoint of another model is the config's fault: no fallback, nothing moved."""
    abstract = _abstract_state()
    abstract = abstract.replace(params={**abstract.params, "bias": jax.ShapeDtypeStruct((7,), jnp.float32)})
    checkpointer = Checkpointer(workdir)
    with pytest.raises(UserInputError, match=r"step 3 .* does not fit the model .*: params/bias is \(48,\)") as error:
        checkpointer.restore_latest(abstract)
    checkpointer.close()
    assert not isinstance(error.value, DamagedCheckpointError)
    assert sorted(os.listdir(Workdir(workdir).checkpoints)) == ["1", "2", "3"]


# --- A damaged checkpoint named explicitly is one error ------------------------------------------------------


@pytest.mark.parametrize(
    "choice, damaged_step, others",
    # A damaged best leaves the same step of the rotation (its intact copy) among the choices.
    [
        ("3", 3, "steps 1, 2"),
        ("average:2", 3, "steps 1, 2"),
        ("average:3", 2, "steps 1, 3"),
        ("best", 2, "steps 1, 2, 3"),
    ],
)
def test_a_damaged_chosen_checkpoint_is_one_error(tmp_path, choice, damaged_step, others):
    workdir = str(tmp_path / "run")
    _save_steps(workdir, (1, 2, 3), best=2)
    if choice == "best":
        shutil.rmtree(os.path.join(Workdir(workdir).best_checkpoint, "2", "state"))
        directory = Workdir(workdir).best_checkpoint
    else:
        _truncate(workdir, damaged_step)
        directory = Workdir(workdir).checkpoints
    checkpointer = Checkpointer(workdir, read_only=True)
    with pytest.raises(DamagedCheckpointError) as error:
        checkpointer.load_params(choice, _replicated_structs(_params(0)))
    checkpointer.close()
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"The checkpoint at step {damaged_step} in {directory} is damaged: ")
    assert message.endswith(
        f"Choose another checkpoint: 'latest' (the newest intact step) or a step (the workdir also holds {others})."
    )


def test_a_best_with_damaged_parameters_is_replaced_at_the_next_validation_after_a_restart(tmp_path, caplog):
    """Its score alone is intact: a resumed run must not keep comparing with parameters it cannot load."""
    workdir = str(tmp_path / "run")
    _save_steps(workdir, (1, 2), best=2)  # Score 10.0.
    shutil.rmtree(os.path.join(Workdir(workdir).best_checkpoint, "2", "state"))
    checkpointer = Checkpointer(workdir)
    with caplog.at_level(logging.WARNING):
        assert checkpointer.best().step == 2  # Still what 'best' names until replaced.
    [warning] = _warnings(caplog)
    assert warning == (
        f"The checkpoint at step 2 in {Workdir(workdir).best_checkpoint} is damaged: its state/ folder is missing; "
        "the next validation score replaces it as the best."
    )
    checkpointer.save(_state(3), {"epoch": 0, "batch": 3})
    assert checkpointer.save_if_best(3, _params(3), 9.5)  # Lower than the damaged best's 10.0.
    assert not checkpointer.save_if_best(4, _params(4), 9.5)  # A tie keeps the earlier, as ever.
    checkpointer.wait_until_finished()
    assert sorted(os.listdir(Workdir(workdir).best_checkpoint)) == ["3"]
    params, selection = checkpointer.load_params("best", _replicated_structs(_params(0)))
    checkpointer.close()
    assert selection.step == 3
    _assert_params_equal(params, 3)


# --- Silent corruption ------------------------------------------------------------------------------------


def test_flipped_bytes_in_any_array_file_never_pass_silently(tmp_path):
    """Bytes flipped anywhere in the files Orbax wrote: the restore fails as damaged, or reads what was saved.

    Several flips read back without an error from TensorStore or zstd, as finite values: only the
    fingerprints catch those.
    """
    pristine = str(tmp_path / "pristine")
    _save_steps(pristine, (1,))
    abstract = _abstract_state()
    caught_by_fingerprint, caught_by_fingerprint_only = set(), 0
    files = _array_files(pristine, 1)
    assert files
    for index, path in enumerate(files):
        size = os.path.getsize(path)
        for offset in sorted({size * k // 12 for k in range(12)}):
            workdir = str(tmp_path / f"flip_{index}_{offset}")
            shutil.copytree(pristine, workdir)
            _flip_bytes(os.path.join(workdir, os.path.relpath(path, pristine)), offset)
            checkpointer = Checkpointer(workdir, read_only=True)
            try:
                state, _ = checkpointer.restore(1, abstract)
            except DamagedCheckpointError as e:
                # The arrays read and were finite: only the comparison with the record caught the change.
                if "integrity check failed" in e.cause:
                    caught_by_fingerprint.add(e.cause.removeprefix("the contents of ").split("/")[0])
                    caught_by_fingerprint_only += 1
            else:  # Bytes no reader looks at (an OCDBT node superseded by the merged root).
                jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), jax.device_get(_state(1)))
            finally:
                checkpointer.close()
    # Which arrays share a data file, and where zstd's own checks fire first, varies from save to save:
    # the fingerprints must catch at least what zstd and TensorStore let through.
    assert caught_by_fingerprint and caught_by_fingerprint <= {"params", "opt_state"}
    assert caught_by_fingerprint_only >= 3


def test_a_failed_read_prints_no_traceback(workdir, capfd):
    """TensorStore's abandoned reads report through sys.unraisablehook and asyncio's logger: silenced."""
    _truncate(workdir, 3)
    checkpointer = Checkpointer(workdir, read_only=True)
    for _ in range(2):
        with pytest.raises(DamagedCheckpointError, match="reading it failed"):
            checkpointer.restore(3, _abstract_state())
    checkpointer.close()
    jax.effects_barrier()
    assert "Traceback" not in capfd.readouterr().err


# --- Non-finite states are never saved --------------------------------------------------------------------


def test_nonfinite_state_is_refused_and_nothing_changes(workdir):
    checkpointer = Checkpointer(workdir, keep=3)
    params = _params(4)
    params["encoder"]["kernel"][5, 7] = np.inf
    with pytest.raises(NonFiniteStateError, match=r"^Refusing to save step 4: the train state holds NaN or Inf in"):
        checkpointer.save(_state(4, params), {"epoch": 0, "batch": 4})
    checkpointer.wait_until_finished()
    assert checkpointer.all_steps() == [1, 2, 3]  # Nothing written; no good step rotated out.

    assert checkpointer.save_if_best(3, _params(3), 5.0)
    checkpointer.wait_until_finished()
    with pytest.raises(NonFiniteStateError, match=r"keep step 4 as the best: its parameters hold NaN or Inf in "):
        checkpointer.save_if_best(4, params, 9.0)
    for score in (float("nan"), float("inf")):
        with pytest.raises(NonFiniteStateError, match=r"keep step 4 as the best: its validation bleu is"):
            checkpointer.save_if_best(4, _params(4), score)
    checkpointer.wait_until_finished()
    assert checkpointer.best().step == 3 and os.listdir(Workdir(workdir).best_checkpoint) == ["3"]
    checkpointer.close()


# --- End to end: train.py resumes past a damaged step, --mode=eval and translate.py skip it ----------------


@pytest.mark.slow
def test_cli_falls_back_past_a_damaged_latest_step(small_corpus, trained_tiny_run, tmp_path):
    workdir = copy_of_trained_tiny_run(trained_tiny_run, tmp_path)  # Checkpoints at steps 3 and 6.
    config = tiny_config(small_corpus, **{"eval.num_bleu_sentences": 0, "eval.split": "valid"})
    common = ["--config=configs/tiny.py", f"--workdir={workdir}", f"--config.dataset.path={small_corpus}"]
    common += ["--config.eval.num_bleu_sentences=0", "--config.eval.split=valid"]
    _flip_bytes_throughout(workdir, 6)

    # Read-only uses warn and take step 3; the damaged step stays where it is.
    trained = inference.load_trained_model(config, workdir, "latest")
    assert trained.selection.description == "step 3"
    with pytest.raises(DamagedCheckpointError, match=r"^The checkpoint at step 6 in .* is damaged: "):
        inference.load_trained_model(config, workdir, "6")
    evaluated = run_entry_point("train.py", *common, "--mode=eval")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "Traceback" not in evaluated.stderr
    [warning] = [line for line in evaluated.stderr.splitlines() if "damaged" in line]
    assert warning.startswith("W") and "step 6" in warning and warning.endswith("; skipped it, using step 3.")
    assert os.path.isdir(os.path.join(Workdir(workdir).checkpoints, "6"))

    # Training moves it aside, resumes from step 3 and saves a new step 6.
    resumed = run_entry_point("train.py", *common, "--config.num_train_steps=7")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    moved = os.path.join(Workdir(workdir).damaged_checkpoints, "6")
    [warning] = [line for line in resumed.stderr.splitlines() if "damaged" in line]
    assert warning.endswith(f"; moved it to {moved} and resumed from step 3.")
    assert "Resumed from step 3" in resumed.stderr
    assert config.keep_checkpoints == 2
    assert os.path.isdir(moved) and sorted(os.listdir(Workdir(workdir).checkpoints)) == ["6", "7"]


# --- The data position: one file per process (grain's handler) --------------------------------------------


def test_data_position_is_kept_per_process_and_a_missing_one_is_the_first_processes_with_a_warning(tmp_path, caplog):
    workdir = str(tmp_path / "run")
    position = {"stream": {"process_count": 1, "seed": 3}, "grain": {"parent": {"next_index": 17}, "offset": 0}}
    checkpointer = Checkpointer(workdir)
    checkpointer.save(_state(1), position)
    checkpointer.save(_state(2), {**position, "grain": {"parent": {"next_index": 29}, "offset": 0}})
    checkpointer.wait_until_finished()
    data_dir = os.path.join(Workdir(workdir).checkpoints, "1", "data")
    assert os.path.isfile(os.path.join(data_dir, "process_0-of-1.json"))
    assert checkpointer.restore(1, _abstract_state())[1] == position

    # As if saved by two processes: this (single) process has no file of its own; the state still restores,
    # with the first process's position.
    os.rename(os.path.join(data_dir, "process_0-of-1.json"), os.path.join(data_dir, "process_0-of-2.json"))
    with caplog.at_level(logging.WARNING):
        state, data_state = checkpointer.restore(1, _abstract_state())
    assert data_state == position
    _assert_params_equal(state.params, 1)
    [warning] = _warnings(caplog)
    assert "no data position for process 0 of 1" in warning and "Handing on process_0-of-2.json" in warning
    os.remove(os.path.join(data_dir, "process_0-of-2.json"))
    assert checkpointer.restore(1, _abstract_state())[1] is None
    assert checkpointer.restore_latest(_abstract_state())[1]["grain"]["parent"]["next_index"] == 29
    checkpointer.close()


@pytest.mark.parametrize("damage", ["missing", "only another process's", "empty", "garbled"])
def test_a_lost_data_position_costs_the_position_not_the_step(tmp_path, caplog, damage):
    """The state is intact: the run resumes from the step without its position (the batches start afresh)."""
    workdir = str(tmp_path / "run")
    _save_steps(workdir, (1, 2))
    position_file = os.path.join(Workdir(workdir).checkpoints, "2", "data", "process_0-of-1.json")
    if damage == "missing":
        os.remove(position_file)
    elif damage == "only another process's":  # Saved by this number of processes: not another count's.
        os.rename(position_file, position_file.replace("process_0-of-1", "process_1-of-1"))
    else:
        with open(position_file, "w", encoding="utf-8") as f:
            f.write("" if damage == "empty" else '{"epoch": 0, "ba')
    checkpointer = Checkpointer(workdir)
    with caplog.at_level(logging.WARNING):
        state, data_state = checkpointer.restore_latest(_abstract_state())
    checkpointer.close()

    assert int(state.step) == 2 and data_state is None
    _assert_params_equal(state.params, 2)
    [warning] = _warnings(caplog)
    reason = "is unreadable (" if damage in ("empty", "garbled") else "is missing"
    assert warning.startswith(f"The data position of step 2, {position_file}, {reason}")
    assert warning.endswith(": resuming without it.") and "\n" not in warning
    assert not os.path.exists(Workdir(workdir).damaged_checkpoints)
    assert sorted(os.listdir(Workdir(workdir).checkpoints)) == ["1", "2"]
