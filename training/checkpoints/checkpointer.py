"""Orbax checkpoints: the rotation of train states by step, the best parameters beside it, and choosing among them.

Layout under the workdir:

  checkpoints/<step>/{state,data,integrity}  the last `keep` steps. 'state' is the TrainState pytree (params,
                                        Adam moments, step, base RNG key); 'data' the training batches' position,
                                        one data/process_<i>-of-<n>.json per process (data_position.py);
                                        'integrity' the fingerprint of every array (JSON, integrity.py).
  best_checkpoint/<step>/{state,score,integrity}  the parameters ({'params': ...}) of the step with the highest
                                        validation score so far (BLEU, accuracy: the task's) and its
                                        {'step', 'value', 'metric'} (JSON); kept apart from the rotation
                                        above, which may already have deleted it (best.py).
  averaged/<N>_<step>/{state,steps}     on request: the mean of the parameters of the N checkpoints up to
                                        <step> ({'params': ...}) and the steps averaged (JSON).
  damaged_checkpoints/<step>            a damaged step that training resumed past, moved out of the rotation.

A state holding NaN or Inf is never written. Each step is verified when read back (restore.py: files
there, shapes fit, its integrity record there, arrays read, finite, fingerprints as recorded at the save).
Resuming and 'latest' fall back past damaged steps, with one warning each; training moves them to
damaged_checkpoints/. A damaged step named explicitly ('best', a step, a member of 'average:N') is one
error. Which checkpoints a choice names, and averaging, are in choice.py. Saves are asynchronous.
"""

import os
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from common import io_errors
from common.errors import UserInputError
from common.workdir import Workdir
from training.checkpoints import data_position
from training.checkpoints.best import BestCheckpoint
from training.checkpoints.choice import CHECKPOINT_CHOICES, BestScore, Selection, mean_params, resolve_choice
from training.checkpoints.integrity import NonFiniteStateError, finite_summary
from training.checkpoints.restore import DamagedCheckpointError, open_manager, restore_params, restore_verified

if TYPE_CHECKING:  # training.state imports optax, which reading a trained model's parameters does without.
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


class Checkpointer:
    """Saves and restores (TrainState, data position) pairs by step, and keeps the best parameters apart.

    The data position is the batch iterator's `get_state()` (a JSON-able dict), kept per process.
    """

    def __init__(self, workdir: str, *, keep: int = 5, read_only: bool = False):
        self.directory = Workdir(workdir).checkpoints
        self.damaged_directory = Workdir(workdir).damaged_checkpoints
        self._read_only = read_only
        self._manager = open_manager(
            self.directory,
            keep=keep,
            read_only=read_only,
            create=not read_only,
            items={"data": data_position.handler()},
        )
        self._best = BestCheckpoint(Workdir(workdir).best_checkpoint, read_only=read_only)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def best(self) -> BestScore | None:
        """The step kept in best_checkpoint/ and its validation score; None before any check."""
        return self._best.score

    # --- Saving -------------------------------------------------------------------------------------------

    def save(self, state: "TrainState", data_state: dict) -> None:
        """Starts an asynchronous save at state.step (a no-op if that step exists).

        `data_state` is this process's batch position (JSON-able), as the iterator's `get_state()` gives it.

        Raises:
            NonFiniteStateError: the state holds NaN or Inf (nothing is written).
        """
        step = int(state.step)
        if step in self._manager.all_steps():
            return
        summary = finite_summary(state, f"Refusing to save step {step}: the train state holds")
        # The best parameters of this step may still be being written. With several processes two
        # saves of one step would wait at Orbax barriers of the same name and deadlock; that save
        # (parameters only, at a new best) finishes first.
        self._best.wait_until_finished()
        with io_errors.naming(self.directory):  # Raises an earlier asynchronous save's failure.
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(state),
                    data=data_position.save_arg(data_state),
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
        return self._best.save_if_best(step, params, score, metric)

    # --- Restoring ----------------------------------------------------------------------------------------

    def restore(self, step: int, abstract_state: "TrainState") -> tuple["TrainState", dict | None]:
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
        return state, data_position.read_position(os.path.join(self.directory, str(step)), step)

    def restore_latest(self, abstract_state: "TrainState") -> tuple["TrainState", dict | None] | None:
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
        return restore_params(self._manager, step, abstract_params)

    def select(self, choice: str) -> Selection:
        """Resolves a user's checkpoint choice, from metadata only (no array is read).

        Args:
            choice: 'latest', 'best', 'average:N' or a step number.

        Raises:
            UserInputError: the choice is malformed, or names checkpoints the workdir does not hold.
        """
        return resolve_choice(choice, self.all_steps(), self._best.score, self.directory, self._best.directory)

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
                return self._best.read_params(selection.step, abstract_params), selection
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
        """The float32 mean of the parameters saved at `steps` (see choice.mean_params)."""
        return mean_params((self.restore_params(step, abstract_params) for step in steps), abstract_params)

    def wait_until_finished(self) -> None:
        """Waits for the asynchronous saves; raises the failure of one (a full disk, say) naming its folder."""
        # Orbax's metadata writes report a full disk without the file's name.
        with io_errors.naming(self.directory):
            self._manager.wait_until_finished()
        self._best.wait_until_finished()

    def close(self) -> None:
        with io_errors.naming(self.directory):
            self._manager.close()
        self._best.close()

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
