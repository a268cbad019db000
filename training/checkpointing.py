"""Orbax checkpoints: the train state by step, the best parameters (by a validation score), and averages.

Layout under the workdir:

  checkpoints/<step>/{state,data}       the last `keep` steps. 'state' is the TrainState pytree (params,
                                        Adam moments, step, base RNG key); 'data' the iterator position (JSON).
  best_checkpoint/<step>/{state,score}  the parameters ({'params': ...}) of the step with the highest
                                        validation score so far (BLEU, accuracy: the task's) and its
                                        {'step', 'value', 'metric'} (JSON); kept apart from the rotation
                                        above, which may already have deleted it.
  averaged/<N>_<step>/{state,steps}     on request: the mean of the parameters of the N checkpoints up to
                                        <step> ({'params': ...}) and the steps averaged (JSON).

Saves to checkpoints/ and best_checkpoint/ are asynchronous. Evaluation restores parameters alone, chosen
by `Checkpointer.select` from 'latest', 'best', 'average:N' or a step; a checkpoint that does not fit the
model is reported by parameter name before any array is read.
"""

import dataclasses
import os
import re
from typing import Any, Literal

import jax
import numpy as np
import orbax.checkpoint as ocp

from input_pipeline.batching import IteratorState
from training.errors import UserInputError
from training.state import TrainState

CHECKPOINT_CHOICES = "'latest', 'best', 'average:N' (the mean of the last N checkpoints) or a step number"


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def best_checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "best_checkpoint")


def averaged_checkpoint_dir(workdir: str, steps: tuple[int, ...]) -> str:
    """<workdir>/averaged/<N>_<last step>: where the average of `steps` is saved."""
    return os.path.join(os.path.abspath(workdir), "averaged", f"{len(steps)}_{steps[-1]}")


@dataclasses.dataclass(frozen=True)
class BestScore:
    """The step whose parameters have the highest validation score so far."""

    step: int
    value: float
    metric: str = "bleu"  # The validation score's name ('bleu', 'accuracy').

    @property
    def description(self) -> str:
        """'valid BLEU 17.20', 'valid accuracy 0.8123'."""
        if self.metric == "bleu":
            return f"valid BLEU {self.value:.2f}"
        return f"valid {self.metric} {self.value:.4f}"

    @classmethod
    def from_json(cls, score: dict) -> "BestScore":
        if "valid_bleu" in score:  # Written before the metric was a parameter.
            return cls(score["step"], score["valid_bleu"], "bleu")
        return cls(**score)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The checkpoints a user's choice stands for (resolved from metadata; no array read yet)."""

    kind: Literal["step", "best", "average"]
    steps: tuple[int, ...]  # One step, or the steps to average (ascending).
    description: str  # 'step 800', 'best (step 400, valid BLEU 17.20)', 'average of steps 400, 800'.

    @property
    def step(self) -> int:
        """The step the parameters stand for (the last one of an average)."""
        return self.steps[-1]


class Checkpointer:
    """Saves and restores (TrainState, IteratorState) pairs by step, and keeps the best parameters apart."""

    def __init__(self, workdir: str, *, keep: int = 5, read_only: bool = False):
        self.directory = checkpoint_dir(workdir)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only),
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
        )
        # create=False: the folder appears with the first save, so a run without BLEU checks leaves none.
        self._best_manager = ocp.CheckpointManager(
            best_checkpoint_dir(workdir),
            options=ocp.CheckpointManagerOptions(max_to_keep=1, create=False, read_only=read_only),
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "score": ocp.JsonCheckpointHandler()},
        )
        # Read back, so a resumed run compares with the best of the steps before the restart.
        self._best = self._read_best_score()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def best(self) -> BestScore | None:
        """The step kept in best_checkpoint/ and its validation score; None before any check."""
        return self._best

    def save(self, state: TrainState, data_state: IteratorState) -> None:
        """Starts an asynchronous save at state.step (a no-op if that step exists)."""
        step = int(state.step)
        if step in self._manager.all_steps():
            return
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(dataclasses.asdict(data_state))
            ),
        )

    def save_if_best(self, step: int, params: Any, score: float, metric: str = "bleu") -> bool:
        """Keeps `params` in best_checkpoint/ if `score` beats every earlier step's (a tie keeps the earlier).

        `score` is the validation `metric` (higher is better), e.g. BLEU or accuracy.

        The save is asynchronous; the previous best is deleted once it completes.

        Returns:
            Whether `step` is the new best.
        """
        if self._best is not None and score <= self._best.value:
            return False
        # After a restart a step can be evaluated again. Where its BLEU differs (nondeterministic
        # accelerators, a changed eval config) a later or equal step may be on disk: Orbax neither
        # overwrites a step nor saves one older than its latest.
        for stale in self._best_manager.all_steps():
            if stale >= step:
                self._best_manager.delete(stale)
        self._best = BestScore(step, float(score), metric)
        self._best_manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave({"params": params}),
                score=ocp.args.JsonSave(dataclasses.asdict(self._best)),
            ),
        )
        return True

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, IteratorState]:
        """Restores `step` into the structure, shapes and shardings of `abstract_state`.

        Args:
            step: the checkpoint's step.
            abstract_state: a TrainState of jax.ShapeDtypeStructs with shardings.

        Raises:
            UserInputError: the step does not exist, or the checkpoint does not fit
                the model the config describes.
        """
        self._require_step(step)
        _check_params_fit(self._manager, step, abstract_state.params)
        restored = _restore(self._manager, step, abstract_state, data=ocp.args.JsonRestore())
        return restored["state"], IteratorState(**restored["data"])

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Restores only the parameters saved at `step` (no optimizer state): for evaluation.

        Args:
            step: the checkpoint's step.
            abstract_params: the parameter pytree as jax.ShapeDtypeStructs with shardings.

        Raises:
            UserInputError: as `restore`.
        """
        self._require_step(step)
        return _restore_params(self._manager, step, abstract_params)

    def select(self, choice: str) -> Selection:
        """Resolves a user's checkpoint choice, from metadata only (no array is read).

        Args:
            choice: 'latest', 'best', 'average:N' or a step number.

        Raises:
            UserInputError: the choice is malformed, or names checkpoints the workdir does not hold.
        """
        text = choice.strip().lower()
        steps = self.all_steps()
        if text == "best":
            if self._best is None:
                raise UserInputError(
                    f"No best checkpoint in {self._best_manager.directory}: it is kept during training when "
                    "the validation score is computed (for translation: config.eval.num_bleu_sentences > 0), "
                    f"or choose {CHECKPOINT_CHOICES}."
                )
            best = self._best
            return Selection("best", (best.step,), f"best (step {best.step}, {best.description})")
        if text == "latest" or re.fullmatch(r"[0-9]+", text):
            if not steps:
                raise UserInputError(f"No complete checkpoint in {self.directory}; train first.")
            step = steps[-1] if text == "latest" else int(text)
            self._require_step(step)
            return Selection("step", (step,), f"step {step}")
        if match := re.fullmatch(r"average:(\d+)", text):
            num = int(match[1])
            if num < 1:
                raise UserInputError(f"Checkpoint {choice!r}: the number of checkpoints to average must be >= 1.")
            if len(steps) < num:
                raise UserInputError(
                    f"Checkpoint {choice!r} averages the last {num} checkpoints, but {self.directory} holds "
                    f"{len(steps)} (steps {', '.join(map(str, steps)) or 'none'}); choose a smaller N, or keep "
                    "more checkpoints during training with config.keep_checkpoints."
                )
            chosen = tuple(steps[-num:])
            return Selection("average", chosen, f"average of steps {', '.join(map(str, chosen))}")
        raise UserInputError(f"Unknown checkpoint {choice!r}: choose {CHECKPOINT_CHOICES}.")

    def restore_selection(self, selection: Selection, abstract_params: Any) -> Any:
        """The parameters `selection` stands for, restored onto the shardings of `abstract_params`."""
        if selection.kind == "best":
            return _restore_params(self._best_manager, selection.step, abstract_params)
        if selection.kind == "average":
            return self.average_params(selection.steps, abstract_params)
        return self.restore_params(selection.step, abstract_params)

    def load_params(self, choice: str, abstract_params: Any) -> tuple[Any, Selection]:
        """The parameters of a user's checkpoint choice ('latest', 'best', 'average:N' or a step).

        Args:
            choice: as in `select`.
            abstract_params: the parameter pytree as jax.ShapeDtypeStructs with shardings.

        Returns:
            The parameters, and the selection (its `description` says what they are).

        Raises:
            UserInputError: as `select`, or a checkpoint does not fit the model.
        """
        selection = self.select(choice)
        return self.restore_selection(selection, abstract_params), selection

    def average_params(self, steps: tuple[int, ...], abstract_params: Any) -> Any:
        """The mean of the parameters saved at `steps`, leaf by leaf (fairseq's average_checkpoints).

        Checkpoints are restored one at a time into a float32 running sum on the host, so memory
        holds two copies of the parameters, not len(steps). The sum and the division are numpy's:
        XLA turns division by a scalar into multiplication by its rounded reciprocal, an ulp off
        the mean. The mean has the dtypes and shardings of `abstract_params`.
        """
        total = None
        for step in steps:
            params = jax.tree.map(lambda x: np.asarray(x, np.float32), self.restore_params(step, abstract_params))
            total = params if total is None else jax.tree.map(np.add, total, params)
        return jax.tree.map(
            lambda x, like: jax.device_put((x / np.float32(len(steps))).astype(like.dtype), like.sharding),
            total,
            abstract_params,
        )

    def _read_best_score(self) -> BestScore | None:
        step = self._best_manager.latest_step()
        if step is None:
            return None
        score = self._best_manager.restore(step, args=ocp.args.Composite(score=ocp.args.JsonRestore()))["score"]
        return BestScore.from_json(score)

    def _require_step(self, step: int) -> None:
        if step not in self._manager.all_steps():
            raise UserInputError(
                f"No checkpoint for step {step} in {self.directory}; it has steps "
                f"{', '.join(map(str, self.all_steps())) or 'none'}."
            )

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()
        self._best_manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
        self._best_manager.close()


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


def _restore_params(manager: ocp.CheckpointManager, step: int, abstract_params: Any) -> Any:
    """The 'params' of the 'state' item saved at `step` (nothing else of it is read)."""
    _check_params_fit(manager, step, abstract_params)
    return _restore(manager, step, {"params": abstract_params}, partial=True)["state"]["params"]


def _check_params_fit(manager: ocp.CheckpointManager, step: int, abstract_params: Any) -> None:
    """Raises UserInputError naming the first parameter the checkpoint lacks or shapes otherwise.

    Checked on the saved metadata, before any array is read.
    """
    saved = _shapes_by_name(manager.item_metadata(step)["state"].tree["params"])
    wanted = _shapes_by_name(abstract_params)
    problems = [
        f"{name} is {saved.get(name, 'missing')} in the checkpoint but {shape} in this model"
        for name, shape in wanted.items()
        if saved.get(name) != shape
    ] + [f"{name} is in the checkpoint but not in this model" for name in saved.keys() - wanted.keys()]
    if problems:
        raise UserInputError(
            f"The checkpoint at step {step} in {manager.directory} does not fit the model of this config "
            f"(trained with other model sizes or another vocabulary?): parameter {sorted(problems)[0]}; "
            f"{len(problems)} parameters differ."
        )


def _restore(
    manager: ocp.CheckpointManager, step: int, abstract_state: Any, *, partial: bool = False, **other_items
) -> dict:
    state = ocp.args.PyTreeRestore(
        item=abstract_state,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
        partial_restore=partial,
    )
    try:
        return manager.restore(step, args=ocp.args.Composite(state=state, **other_items))
    except (ValueError, KeyError, TypeError) as e:
        raise UserInputError(
            f"The checkpoint at step {step} in {manager.directory} does not fit the "
            "model of this config (was it trained with other model sizes or "
            f"another vocabulary?): {str(e).splitlines()[0][:300]}"
        ) from None


def _shapes_by_name(params: Any) -> dict[str, tuple[int, ...]]:
    """{'encoder/layers_0/.../kernel': shape} of a parameter tree (arrays, structs or metadata)."""
    return {
        "/".join(str(getattr(key, "key", key)) for key in path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
