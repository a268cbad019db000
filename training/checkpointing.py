"""Orbax checkpoints of the train state and the data iterator's position.

Layout: <workdir>/checkpoints/<step>/{state,data}. 'state' is the TrainState
pytree (params, Adam moments, step, base RNG key); 'data' is the iterator
position as JSON. Saves are asynchronous; the last `keep` are kept. Evaluation
restores the parameters alone; a checkpoint that does not fit the model is
reported by parameter name before any array is read.
"""

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from input_pipeline.batching import IteratorState
from training.errors import UserInputError
from training.state import TrainState


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


class Checkpointer:
    """Saves and restores (TrainState, IteratorState) pairs by step."""

    def __init__(self, workdir: str, *, keep: int = 5, read_only: bool = False):
        self.directory = checkpoint_dir(workdir)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only),
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

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

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, IteratorState]:
        """Restores `step` into the structure, shapes and shardings of `abstract_state`.

        Args:
            step: the checkpoint's step.
            abstract_state: a TrainState of jax.ShapeDtypeStructs with shardings.

        Raises:
            UserInputError: the step does not exist, or the checkpoint does not fit
                the model the config describes.
        """
        self._check_params_fit(step, abstract_state.params)
        restored = self._restore(step, abstract_state, data=ocp.args.JsonRestore())
        return restored["state"], IteratorState(**restored["data"])

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Restores only the parameters saved at `step` (no optimizer state): for evaluation.

        Args:
            step: the checkpoint's step.
            abstract_params: the parameter pytree as jax.ShapeDtypeStructs with shardings.

        Raises:
            UserInputError: as `restore`.
        """
        self._check_params_fit(step, abstract_params)
        return self._restore(step, {"params": abstract_params}, partial=True)["state"]["params"]

    def _check_params_fit(self, step: int, abstract_params: Any) -> None:
        """Raises UserInputError naming the first parameter the checkpoint lacks or shapes otherwise.

        Checked on the saved metadata, before any array is read.
        """
        if step not in self._manager.all_steps():
            raise UserInputError(
                f"No checkpoint for step {step} in {self.directory}; it has steps {self.all_steps() or 'none'}."
            )
        saved = _shapes_by_name(self._manager.item_metadata(step)["state"].tree["params"])
        wanted = _shapes_by_name(abstract_params)
        problems = [
            f"{name} is {saved.get(name, 'missing')} in the checkpoint but {shape} in this model"
            for name, shape in wanted.items()
            if saved.get(name) != shape
        ] + [f"{name} is in the checkpoint but not in this model" for name in saved.keys() - wanted.keys()]
        if problems:
            raise UserInputError(
                f"The checkpoint at step {step} in {self.directory} does not fit the model of this config "
                f"(trained with other model sizes or another vocabulary?): parameter {sorted(problems)[0]}; "
                f"{len(problems)} parameters differ."
            )

    def _restore(self, step: int, abstract_state: Any, *, partial: bool = False, **other_items) -> dict:
        state = ocp.args.PyTreeRestore(
            item=abstract_state,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
            partial_restore=partial,
        )
        try:
            return self._manager.restore(step, args=ocp.args.Composite(state=state, **other_items))
        except (ValueError, KeyError, TypeError) as e:
            raise UserInputError(
                f"The checkpoint at step {step} in {self.directory} does not fit the "
                "model of this config (was it trained with other model sizes or "
                f"another vocabulary?): {str(e).splitlines()[0][:300]}"
            ) from None

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _shapes_by_name(params: Any) -> dict[str, tuple[int, ...]]:
    """{'encoder/layers_0/.../kernel': shape} of a parameter tree (arrays, structs or metadata)."""
    return {
        "/".join(str(getattr(key, "key", key)) for key in path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
