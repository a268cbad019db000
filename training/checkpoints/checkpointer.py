"""Orbax checkpoints: the train state by step and the best parameters (by a validation score), verified.

Layout under the workdir:

  checkpoints/<step>/{state,data,integrity}  the last `keep` steps. 'state' is the TrainState pytree (params,
                                        Adam moments, step, base RNG key); 'data' the training batches' position,
                                        one data/process_<i>-of-<n>.json per process (grain's Orbax handler);
                                        'integrity' the fingerprint of every array (JSON, checkpoint_integrity).
  best_checkpoint/<step>/{state,score,integrity}  the parameters ({'params': ...}) of the step with the highest
                                        validation score so far (BLEU, accuracy: the task's) and its
                                        {'step', 'value', 'metric'} (JSON); kept apart from the rotation
                                        above, which may already have deleted it.
  averaged/<N>_<step>/{state,steps}     on request: the mean of the parameters of the N checkpoints up to
                                        <step> ({'params': ...}) and the steps averaged (JSON).
  damaged_checkpoints/<step>            a damaged step that training resumed past, moved out of the rotation.

A state holding NaN or Inf is never written. Each step is verified when read back (checkpoint_restore:
files there, shapes fit, arrays read, finite, fingerprints as recorded at the save). Resuming and 'latest'
fall back past damaged steps, with one warning each; training moves them to damaged_checkpoints/. A
damaged step named explicitly ('best', a step, a member of 'average:N') is one error. Which checkpoints a
choice names, and averaging, are in checkpoint_choice. Saves are asynchronous.
"""

import dataclasses
import glob
import json
import math
import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from common import io_errors
from common.errors import UserInputError
from common.workdir import Workdir
from training.checkpoints.choice import CHECKPOINT_CHOICES, BestScore, Selection, mean_params, resolve_choice
from training.checkpoints.integrity import Summary
from training.checkpoints.restore import (
    DamagedCheckpointError,
    one_line,
    restore_verified,
    saved_state_metadata,
    some_names,
)
from training.state import TrainState

__all__ = [
    "CHECKPOINT_CHOICES",
    "BestScore",
    "Checkpointer",
    "DamagedCheckpointError",
    "NonFiniteStateError",
    "Selection",
    "save_params",
]


class NonFiniteStateError(UserInputError):
    """A state or score holding NaN or Inf was about to be saved; nothing was written."""


class _Position:
    """The 'data' item for grain's CheckpointHandler: a batch iterator's position (a JSON-able dict) as bytes.

    The handler writes `get_state()` of any item that is not a grain DatasetIterator as text, one file per
    process (`_position_file`), which `Checkpointer.restore` reads back as JSON. Saves run in Orbax's
    background thread while training goes on, so the position is taken when the save starts, not read
    from the live iterator.
    """

    def __init__(self, state: dict):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()


def _position_file(step_dir: str) -> str:
    """This process's data position file in a step's folder (the name grain's handler uses)."""
    return os.path.join(step_dir, "data", f"process_{jax.process_index()}-of-{jax.process_count()}.json")


class Checkpointer:
    """Saves and restores (TrainState, data position) pairs by step, and keeps the best parameters apart.

    The data position is the batch iterator's `get_state()` (a JSON-able dict), kept per process.
    """

    def __init__(self, workdir: str, *, keep: int = 5, read_only: bool = False):
        self.directory = Workdir(workdir).checkpoints
        self.damaged_directory = Workdir(workdir).damaged_checkpoints
        self._read_only = read_only
        self._manager = _manager(
            self.directory,
            keep=keep,
            read_only=read_only,
            create=not read_only,
            items={"data": grain.checkpoint.CheckpointHandler()},
        )
        # create=False: the folder appears with the first save, so a run without BLEU checks leaves none.
        self._best_manager = _manager(
            Workdir(workdir).best_checkpoint,
            keep=1,
            read_only=read_only,
            create=False,
            items={"score": ocp.JsonCheckpointHandler()},
        )
        # Read back, so a resumed run compares with the best of the steps before the restart.
        self._best = self._read_best_score()
        # A best whose state/ is missing or whose metadata is unreadable (checked without reading an
        # array: damage inside the array files shows only when 'best' is loaded) stays what 'best'
        # names, loading it being one clear error, but a resumed run replaces it at its next validation.
        self._best_is_damaged = self._best is not None and not read_only and not self._best_state_readable()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def best(self) -> BestScore | None:
        """The step kept in best_checkpoint/ and its validation score; None before any check."""
        return self._best

    # --- Saving -------------------------------------------------------------------------------------------

    def save(self, state: TrainState, data_state: dict) -> None:
        """Starts an asynchronous save at state.step (a no-op if that step exists).

        `data_state` is this process's batch position (JSON-able), as the iterator's `get_state()` gives it.

        Raises:
            NonFiniteStateError: the state holds NaN or Inf (nothing is written).
        """
        step = int(state.step)
        if step in self._manager.all_steps():
            return
        summary = _finite_summary(state, f"Refusing to save step {step}: the train state holds")
        # The best parameters of this step may still be being written. With several processes two
        # saves of one step would wait at Orbax barriers of the same name and deadlock; that save
        # (parameters only, at a new best) finishes first.
        self._wait(self._best_manager)
        with io_errors.naming(self.directory):  # Raises an earlier asynchronous save's failure.
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(state),
                    data=grain.checkpoint.CheckpointSave(_Position(data_state)),
                    integrity=ocp.args.JsonSave(summary.record()),
                ),
            )

    def save_if_best(self, step: int, params: Any, score: float, metric: str = "bleu") -> bool:
        """Keeps `params` in best_checkpoint/ if `score` beats every earlier step's (a tie keeps the earlier).

        `score` is the validation `metric` (higher is better), e.g. BLEU or accuracy.

        The save is asynchronous; the previous best is deleted once it completes.

        Returns:
            Whether `step` is the new best.

        Raises:
            NonFiniteStateError: the score or the parameters are NaN or Inf (nothing is written or deleted).
        """
        if not math.isfinite(score):
            raise NonFiniteStateError(f"Refusing to keep step {step} as the best: its validation {metric} is {score}.")
        if self._best is not None and not self._best_is_damaged and score <= self._best.value:
            return False
        tree = {"params": params}
        summary = _finite_summary(tree, f"Refusing to keep step {step} as the best: its parameters hold")
        # After a restart a step can be evaluated again. Where its score differs (nondeterministic
        # accelerators, a changed eval config) a later or equal step may be on disk: Orbax neither
        # overwrites a step nor saves one older than its latest.
        for stale in self._best_manager.all_steps():
            if stale >= step:
                self._best_manager.delete(stale)
        self._best, self._best_is_damaged = BestScore(step, float(score), metric), False
        with io_errors.naming(str(self._best_manager.directory)):
            self._best_manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(tree),
                    score=ocp.args.JsonSave(dataclasses.asdict(self._best)),
                    integrity=ocp.args.JsonSave(summary.record()),
                ),
            )
        return True

    # --- Restoring ----------------------------------------------------------------------------------------

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict | None]:
        """Restores `step` into the structure, shapes and shardings of `abstract_state`, verified.

        Returns:
            The state, and this process's data position. Where the step was saved by another number of
            processes, so that this process has no file of its own: a warning, and the first process's
            position. Where this process's file is missing or unreadable: a warning, and None; the intact
            state still restores. The batches decide what a position (or none) means: classification's
            are the same in every process; translation's stream starts afresh where it does not fit
            (input_pipeline/streaming.TrainStream).

        Args:
            step: the checkpoint's step.
            abstract_state: a TrainState of jax.ShapeDtypeStructs with shardings.

        Raises:
            UserInputError: the step does not exist, or the checkpoint does not fit
                the model the config describes.
            DamagedCheckpointError: the checkpoint cannot be restored as it was saved.
        """
        self._require_step(step)
        state = restore_verified(self._manager, step, abstract_state)["state"]
        return state, self._data_position(step)

    def _data_position(self, step: int) -> dict | None:
        """This process's data position saved at `step` (see `restore`), or None with a warning saying why.

        A position file that is missing or unreadable where the step's state is intact costs the
        position, not the step: the run resumes from the step, and the batches decide what to do
        without a position, as for one saved by another number of processes.
        """
        position_file = _position_file(os.path.join(self.directory, str(step)))
        data_dir = os.path.dirname(position_file)
        saved = sorted(glob.glob(os.path.join(data_dir, "process_*-of-*.json")))
        by_this_count = any(path.endswith(f"-of-{jax.process_count()}.json") for path in saved)
        if os.path.exists(position_file):
            path = position_file
        elif saved and not by_this_count:
            path = saved[0]
            logging.warning(
                "The checkpoint at step %d holds no data position for process %d of %d (%s has %s): it was saved "
                "by another number of processes. Handing on %s (the batches decide whether it fits).",
                step,
                jax.process_index(),
                jax.process_count(),
                data_dir,
                ", ".join(os.path.basename(f) for f in saved),
                os.path.basename(path),
            )
        else:
            path = position_file  # Saved by this number of processes (or with no position at all): lost.
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            reason = "is missing" if isinstance(e, FileNotFoundError) else f"is unreadable ({one_line(e)})"
            logging.warning("The data position of step %d, %s, %s: resuming without it.", step, path, reason)
            return None

    def restore_latest(self, abstract_state: TrainState) -> tuple[TrainState, dict | None] | None:
        """The newest intact step's state, for resuming; None if there is no checkpoint.

        Damaged steps after it are moved to damaged_checkpoints/ (so that the rotation and the no-op
        save of an existing step do not count them), each with one warning saying why and where.

        Raises:
            UserInputError: the checkpoints do not fit the model.
            DamagedCheckpointError: every step is damaged (then nothing is moved).
        """
        found = self._newest_intact(lambda step: self.restore(step, abstract_state))
        return None if found is None else found[1]

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Restores only the parameters saved at `step` (no optimizer state): for evaluation.

        Args:
            step: the checkpoint's step.
            abstract_params: the parameter pytree as jax.ShapeDtypeStructs with shardings.

        Raises:
            UserInputError, DamagedCheckpointError: as `restore`.
        """
        self._require_step(step)
        return self._read_params(self._manager, step, abstract_params)

    def select(self, choice: str) -> Selection:
        """Resolves a user's checkpoint choice, from metadata only (no array is read).

        Args:
            choice: 'latest', 'best', 'average:N' or a step number.

        Raises:
            UserInputError: the choice is malformed, or names checkpoints the workdir does not hold.
        """
        return resolve_choice(choice, self.all_steps(), self._best, self.directory, self._best_manager.directory)

    def load_params(self, choice: str, abstract_params: Any) -> tuple[Any, Selection]:
        """The parameters of a user's checkpoint choice ('latest', 'best', 'average:N' or a step).

        'latest' is the newest intact step: damaged later ones are skipped with a warning each (and left
        where they are). A damaged checkpoint chosen by 'best', a step or an average is an error.

        Args:
            choice: as in `select`.
            abstract_params: the parameter pytree as jax.ShapeDtypeStructs with shardings.

        Returns:
            The parameters, and the selection (its `description` says what they are).

        Raises:
            UserInputError: as `select`, or a checkpoint does not fit the model.
            DamagedCheckpointError: every step is damaged ('latest'), or the chosen checkpoint is.
        """
        selection = self.select(choice)
        if selection.kind == "latest":
            step, params = self._newest_intact(lambda step: self.restore_params(step, abstract_params))
            return params, Selection("step", (step,), f"step {step}")
        try:
            if selection.kind == "best":
                return self._read_params(self._best_manager, selection.step, abstract_params), selection
            if selection.kind == "average":
                return self.average_params(selection.steps, abstract_params), selection
            return self.restore_params(selection.step, abstract_params), selection
        except DamagedCheckpointError as e:
            # A damaged best leaves the same step of the rotation (the same parameters) a choice.
            others = [str(step) for step in self.all_steps() if step != e.step or e.directory != self.directory]
            holds = f"step{'s' if len(others) > 1 else ''} {', '.join(others)}" if others else "no other step"
            raise DamagedCheckpointError(
                e.directory,
                e.step,
                f"{e.cause}. Choose another checkpoint: 'latest' (the newest intact step) or a step "
                f"(the workdir also holds {holds}).",
            ) from None

    def average_params(self, steps: tuple[int, ...], abstract_params: Any) -> Any:
        """The float32 mean of the parameters saved at `steps` (see checkpoint_choice.mean_params)."""
        return mean_params((self.restore_params(step, abstract_params) for step in steps), abstract_params)

    def wait_until_finished(self) -> None:
        """Waits for the asynchronous saves; raises the failure of one (a full disk, say) naming its folder."""
        self._wait(self._manager)
        self._wait(self._best_manager)

    def close(self) -> None:
        for manager in (self._manager, self._best_manager):
            with io_errors.naming(str(manager.directory)):
                manager.close()

    @staticmethod
    def _wait(manager: ocp.CheckpointManager) -> None:
        # Orbax's metadata writes report a full disk without the file's name.
        with io_errors.naming(str(manager.directory)):
            manager.wait_until_finished()

    @staticmethod
    def _read_params(manager: ocp.CheckpointManager, step: int, abstract_params: Any) -> Any:
        """The 'params' of the 'state' item saved at `step` (nothing else of it is read)."""
        return restore_verified(manager, step, {"params": abstract_params}, partial=True)["state"]["params"]

    def _newest_intact(self, restore_step) -> tuple[int, Any] | None:
        """(step, restore_step(step)) for the newest step that restores; warns of each damaged one after it.

        When writable, the damaged steps are moved out of the rotation once an intact one is found.
        """
        damaged: list[DamagedCheckpointError] = []
        for step in reversed(self.all_steps()):
            try:
                restored = restore_step(step)
            except DamagedCheckpointError as e:
                damaged.append(e)
                continue
            for error in damaged:
                if self._read_only:
                    logging.warning("%s; skipped it, using step %d.", error, step)
                else:
                    moved = self._set_aside(error.step)
                    logging.warning("%s; moved it to %s and resumed from step %d.", error, moved, step)
            return step, restored
        if not damaged:
            return None
        causes = "; ".join(f"step {e.step}: {e.cause}" for e in damaged)
        advice = "" if self._read_only else f" Move {self.directory} away to train from step 0."
        raise DamagedCheckpointError(
            self.directory,
            damaged[0].step,
            causes,
            f"No intact checkpoint in {self.directory}, nothing was changed: {causes}.{advice}",
        )

    def _set_aside(self, step: int) -> str:
        """Moves the damaged `step` to damaged_checkpoints/ (never deleting it); returns where it went."""
        target = os.path.join(self.damaged_directory, str(step))
        suffix = 1
        while os.path.exists(target):
            target, suffix = os.path.join(self.damaged_directory, f"{step}.{suffix}"), suffix + 1
        if jax.process_count() > 1:  # Every process has chosen `target` before process 0 moves the step.
            multihost_utils.sync_global_devices(f"checkpointing: set step {step} aside")
        if jax.process_index() == 0:
            os.makedirs(self.damaged_directory, exist_ok=True)
            os.rename(os.path.join(self.directory, str(step)), target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpointing: step {step} was set aside")
        self._manager.reload()
        return target

    def _read_best_score(self) -> BestScore | None:
        step = self._best_manager.latest_step()
        if step is None:
            return None
        try:
            score = self._best_manager.restore(step, args=ocp.args.Composite(score=ocp.args.JsonRestore()))["score"]
            return BestScore(**score)
        except Exception as e:  # pylint: disable=broad-except  (any damage: the best is then unknown)
            logging.warning(
                "The best checkpoint (step %d) in %s is damaged: %s; it counts as no best.",
                step,
                self._best_manager.directory,
                one_line(e),
            )
            return None

    def _best_state_readable(self) -> bool:
        """Whether the best checkpoint's state/ is there with readable metadata; warns where not."""
        try:
            saved_state_metadata(self._best_manager, self._best.step)
        except DamagedCheckpointError as e:
            logging.warning("%s; the next validation score replaces it as the best.", e)
            return False
        return True

    def _require_step(self, step: int) -> None:
        if step not in self._manager.all_steps():
            raise UserInputError(
                f"No checkpoint for step {step} in {self.directory}; it has steps "
                f"{', '.join(map(str, self.all_steps())) or 'none'}."
            )


def save_params(directory: str, params: Any, steps: tuple[int, ...]) -> None:
    """Writes `params` as a parameters-only checkpoint ({'params': ...}) and the steps they come from.

    Synchronous; replaces what `directory` held. Read it back with
    `ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(directory)`.
    """
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    checkpointer.save(
        directory,
        ocp.args.Composite(state=ocp.args.PyTreeSave({"params": params}), steps=ocp.args.JsonSave(list(steps))),
        force=True,
    )
    checkpointer.close()


def _manager(directory: str, *, keep: int, read_only: bool, create: bool, items: dict) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep,
        create=create and not read_only,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
    )
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "integrity": ocp.JsonCheckpointHandler(), **items}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _finite_summary(tree: Any, refusal: str) -> Summary:
    """`tree`'s Summary; if a leaf holds NaN or Inf, raises NonFiniteStateError: '<refusal> NaN or Inf in <leaf>...'."""
    summary = Summary(tree)
    if summary.nonfinite:
        raise NonFiniteStateError(
            f"{refusal} NaN or Inf in {some_names(summary.nonfinite)}. Nothing was written; the checkpoints "
            "on disk are intact. The run diverged: lower the learning rate and rerun (it resumes from the last "
            "checkpoint)."
        )
    return summary
