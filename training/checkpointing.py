"""Orbax checkpoints of the train state and the data iterator's position.

Layout: <workdir>/checkpoints/<step>/{state,data}. 'state' is the TrainState
pytree (params, Adam moments, step, base RNG key); 'data' is the iterator
position as JSON. Saves are asynchronous; the last `keep` are kept.
"""

import dataclasses
import os

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
            item_names=("state", "data"),
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
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(dataclasses.asdict(data_state))
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
        if step not in self._manager.all_steps():
            raise UserInputError(
                f"No checkpoint for step {step} in {self.directory}; it has steps {self.all_steps() or 'none'}."
            )
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise UserInputError(
                f"The checkpoint at step {step} in {self.directory} does not fit the "
                "model of this config (was it trained with other model sizes or "
                f"another vocabulary?): {str(e).splitlines()[0][:300]}"
            ) from None
        return restored["state"], IteratorState(**restored["data"])

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
