"""The best checkpoint: the parameters of the step with the highest validation score so far, and that score."""

import dataclasses
import math
from typing import Any

import orbax.checkpoint as ocp
from absl import logging

from common import io_errors
from training.checkpoints.choice import BestScore
from training.checkpoints.integrity import NonFiniteStateError, finite_summary
from training.checkpoints.restore import (
    DamagedCheckpointError,
    one_line,
    open_manager,
    restore_params,
    saved_state_metadata,
)


class BestCheckpoint:
    """best_checkpoint/<step>/{state,score,integrity}: {'params': ...} of the best step, its BestScore (JSON)
    and fingerprints; kept apart from the rotation, which may already have deleted that step.

    The score is read back at start, so that a resumed run compares with the best of the steps before the
    restart.
    """

    def __init__(self, directory: str, *, read_only: bool):
        # create=False: the folder appears with the first save, so a run without BLEU checks leaves none.
        self._manager = open_manager(
            directory, keep=1, read_only=read_only, create=False, items={"score": ocp.JsonCheckpointHandler()}
        )
        self.score = self._read_score()
        # A best whose state/ is missing or whose metadata is unreadable (checked without reading an
        # array: damage inside the array files shows only when 'best' is loaded) stays what 'best'
        # names, loading it being one clear error, but a resumed run replaces it at its next validation.
        self._damaged = self.score is not None and not read_only and not self._state_readable()

    @property
    def directory(self) -> str:
        return str(self._manager.directory)

    def save_if_best(self, step: int, params: Any, score: float, metric: str) -> bool:
        """Keeps `params` if `score` beats every earlier step's (a tie keeps the earlier); see `Checkpointer`."""
        if not math.isfinite(score):
            raise NonFiniteStateError(f"Refusing to keep step {step} as the best: its validation {metric} is {score}.")
        if self.score is not None and not self._damaged and score <= self.score.value:
            return False
        tree = {"params": params}
        summary = finite_summary(tree, f"Refusing to keep step {step} as the best: its parameters hold")
        # After a restart a step can be evaluated again. Where its score differs (nondeterministic
        # accelerators, a changed eval config) a later or equal step may be on disk: Orbax neither
        # overwrites a step nor saves one older than its latest.
        for stale in self._manager.all_steps():
            if stale >= step:
                self._manager.delete(stale)
        self.score, self._damaged = BestScore(step, float(score), metric), False
        with io_errors.naming(self.directory):
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(tree),
                    score=ocp.args.JsonSave(dataclasses.asdict(self.score)),
                    integrity=ocp.args.JsonSave(summary.record()),
                ),
            )
        return True

    def read_params(self, step: int, abstract_params: Any) -> Any:
        """The parameters kept at `step`, verified (restore.restore_params)."""
        return restore_params(self._manager, step, abstract_params)

    def wait_until_finished(self) -> None:
        # Orbax's metadata writes report a full disk without the file's name.
        with io_errors.naming(self.directory):
            self._manager.wait_until_finished()

    def close(self) -> None:
        with io_errors.naming(self.directory):
            self._manager.close()

    def _read_score(self) -> BestScore | None:
        step = self._manager.latest_step()
        if step is None:
            return None
        try:
            score = self._manager.restore(step, args=ocp.args.Composite(score=ocp.args.JsonRestore()))["score"]
            return BestScore(**score)
        except Exception as e:  # pylint: disable=broad-except  (any damage: the best is then unknown)
            logging.warning(
                "The best checkpoint (step %d) in %s is damaged: %s; it counts as no best.",
                step,
                self.directory,
                one_line(e),
            )
            return None

    def _state_readable(self) -> bool:
        """Whether the best checkpoint's state/ is there with readable metadata; warns where not."""
        try:
            saved_state_metadata(self._manager, self.score.step)
        except DamagedCheckpointError as e:
            logging.warning("%s; the next validation score replaces it as the best.", e)
            return False
        return True
