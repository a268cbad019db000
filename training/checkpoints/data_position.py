"""The 'data' item of a checkpoint step: each process's batch position, data/process_<i>-of-<n>.json."""

import glob
import json
import os

import grain
import jax
from absl import logging

from training.checkpoints.restore import one_line


def handler() -> grain.checkpoint.CheckpointHandler:
    """The 'data' item's handler for an Orbax CheckpointManager."""
    return grain.checkpoint.CheckpointHandler()


def save_arg(position: dict) -> grain.checkpoint.CheckpointSave:
    """The 'data' item's save argument: this process's batch position (JSON-able), as `get_state()` gives it."""
    return grain.checkpoint.CheckpointSave(_Position(position))


class _Position:
    """The 'data' item for grain's CheckpointHandler: a batch iterator's position (a JSON-able dict) as bytes.

    The handler writes `get_state()` of any item that is not a grain DatasetIterator as text, one file per
    process (`_position_file`), which `read_position` reads back as JSON. Saves run in Orbax's background
    thread while training goes on, so the position is taken when the save starts, not read from the live
    iterator.
    """

    def __init__(self, state: dict):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()


def _position_file(step_dir: str) -> str:
    """This process's data position file in a step's folder (the name grain's handler uses)."""
    return os.path.join(step_dir, "data", f"process_{jax.process_index()}-of-{jax.process_count()}.json")


def read_position(step_dir: str, step: int) -> dict | None:
    """This process's data position saved in `step_dir` (the folder of `step`), or None with a warning saying why.

    Where the step was saved by another number of processes, so that this process has no file of its own:
    a warning, and the first process's position. Where this process's file is missing or unreadable: a
    warning, and None. That costs the position, not the step, whose state is verified apart: the run
    resumes from the step, and the batches decide what to do without a position.
    """
    position_file = _position_file(step_dir)
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
