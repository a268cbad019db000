"""Orbax managers of verified steps: reading one step back, and telling an intact step from a damaged one.

Checked in order: the step's state/ folder is there; its metadata reads and the saved shapes fit the
model (a misfit is the config's fault, not damage: a plain UserInputError); its integrity record (the
fingerprints taken at the save, integrity.py) is there and reads; the arrays read; they are
finite; their fingerprints equal the recorded ones, for exactly the leaves restored. Anything else that
keeps the step from restoring as saved is a DamagedCheckpointError with a one-line cause.
"""

import logging as logging_std
import os
import re
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp

from common import processes
from common.errors import UserInputError
from training.checkpoints.integrity import Summary, leaf_names, some_names


class DamagedCheckpointError(UserInputError):
    """A checkpoint on disk cannot be restored as saved: files missing or unreadable, or contents altered."""

    def __init__(self, directory: str, step: int, cause: str, message: str | None = None):
        self.directory, self.step, self.cause = directory, step, cause
        super().__init__(message or f"The checkpoint at step {step} in {directory} is damaged: {cause}")


def open_manager(directory: str, *, keep: int, read_only: bool, create: bool, items: dict) -> ocp.CheckpointManager:
    """An Orbax CheckpointManager of steps that hold a 'state' and its 'integrity' record, and `items`.

    Args:
        directory: the folder of the steps (absolute: Orbax requires it).
        keep: the steps kept when saving (read-only: all of them).
        read_only: never writes; `create` is then ignored.
        create: create `directory` now rather than at the first save.
        items: the handlers of the steps' other items, by name.
    """
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep,
        create=create and not read_only,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
    )
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "integrity": ocp.JsonCheckpointHandler(), **items}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def restore_verified(
    manager: ocp.CheckpointManager, step: int, abstract_state: Any, *, partial: bool = False, **other_items
) -> dict:
    """Restores the 'state' item (and `other_items`) of `step`, and verifies what was read.

    Args:
        manager: the CheckpointManager holding the step.
        step: the step.
        abstract_state: the 'state' item's structure, shapes and shardings (jax.ShapeDtypeStructs).
        partial: restore only the leaves of `abstract_state` (e.g. {'params': ...} of a TrainState).
        **other_items: restore args of the step's other items (e.g. data=ocp.args.JsonRestore()).

    Returns:
        The restored items.

    Raises:
        UserInputError: the saved shapes do not fit `abstract_state` (checked on metadata, before any read).
        DamagedCheckpointError: anything else keeps the step from restoring as saved.
    """
    _quiet_abandoned_reads()
    step_dir = os.path.join(str(manager.directory), str(step))

    def damaged(cause: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(str(manager.directory), step, cause)

    _check_fit(manager, step, saved_state_metadata(manager, step), abstract_state, partial=partial)

    if not os.path.isdir(os.path.join(step_dir, "integrity")):
        raise damaged("its integrity/ record is missing, so its arrays cannot be verified")
    try:
        recorded = manager.restore(step, args=ocp.args.Composite(integrity=ocp.args.JsonRestore()))["integrity"]
    except Exception as e:  # pylint: disable=broad-except
        raise damaged(f"its integrity record is unreadable ({one_line(e)})") from None
    state = ocp.args.PyTreeRestore(
        item=abstract_state,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
        partial_restore=partial,
    )
    error = None
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=state, **other_items))
    except Exception as e:  # pylint: disable=broad-except  (TensorStore raises bare Exceptions)
        error = f"reading it failed ({one_line(e)})"
    # Each process reads its own shards: all must agree before the global checks.
    read_everywhere = processes.every_process_answer(error is None)
    if error is None and not read_everywhere:
        error = "reading it failed on another process"
    if error is not None:
        raise damaged(error)

    summary = Summary(restored["state"])
    if summary.nonfinite:
        raise damaged(f"it holds NaN or Inf in {some_names(summary.nonfinite)}")
    if mismatches := summary.mismatches(recorded):
        raise damaged(
            f"the contents of {some_names(mismatches)} differ from those saved (integrity check failed): "
            "its files were altered after the save"
        )
    return restored


def restore_params(manager: ocp.CheckpointManager, step: int, abstract_params: Any) -> Any:
    """The 'params' of the 'state' item saved at `step`, verified (nothing else of the state is read)."""
    return restore_verified(manager, step, {"params": abstract_params}, partial=True)["state"]["params"]


def saved_state_metadata(manager: ocp.CheckpointManager, step: int) -> Any:
    """The tree metadata of the 'state' item saved at `step` (names, shapes, dtypes; no array is read).

    Raises:
        DamagedCheckpointError: the state/ folder is missing, or its metadata unreadable.
    """
    if not os.path.isdir(os.path.join(str(manager.directory), str(step), "state")):
        raise DamagedCheckpointError(str(manager.directory), step, "its state/ folder is missing")
    try:
        return manager.item_metadata(step)["state"].tree
    except Exception as e:  # pylint: disable=broad-except  (garbled metadata fails in many ways)
        raise DamagedCheckpointError(
            str(manager.directory), step, f"its metadata is unreadable ({one_line(e)})"
        ) from None


def _check_fit(manager: ocp.CheckpointManager, step: int, saved_tree: Any, abstract: Any, *, partial: bool) -> None:
    """Raises UserInputError naming the first array the checkpoint lacks or shapes otherwise.

    Checked on the saved metadata, before any array is read. With `partial`, arrays the checkpoint
    holds beyond `abstract` (the optimizer state, when restoring parameters) are fine.
    """
    saved = _shapes_by_name(saved_tree)
    wanted = _shapes_by_name(abstract)
    problems = [
        f"{name} is {saved.get(name, 'missing')} in the checkpoint but {shape} in this model"
        for name, shape in wanted.items()
        if saved.get(name) != shape
    ]
    prefixes = {name.split("/")[0] for name in wanted}
    extra = [name for name in saved.keys() - wanted.keys() if not partial or name.split("/")[0] in prefixes]
    problems += [f"{name} is in the checkpoint but not in this model" for name in extra]
    if problems:
        raise UserInputError(
            f"The checkpoint at step {step} in {manager.directory} does not fit the model of this config "
            f"(trained with other model sizes, another vocabulary or optimizer?): {sorted(problems)[0]}; "
            f"{len(problems)} arrays differ."
        )


def _shapes_by_name(tree: Any) -> dict[str, tuple[int, ...]]:
    """{'params/encoder/layers_0/.../kernel': shape} of a pytree (arrays, structs or metadata)."""
    return {name: tuple(leaf.shape) for name, leaf in zip(leaf_names(tree), jax.tree.leaves(tree))}


def one_line(error: BaseException) -> str:
    """The innermost cause's first line: TensorStore's reason, not the long array spec wrapped around it."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = (lines[0] if lines else type(error).__name__).split(" [tensorstore_spec=")[0]
    text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)  # The step's folder, named already.
    return text if len(text) <= 250 else text[:247] + "..."


def _quiet_abandoned_reads() -> None:
    """Drops the reports of reads abandoned by a failed restore; the restore's own error says what failed.

    When one array fails to read, Orbax closes its asyncio loop while TensorStore completes the other
    reads. Each then reports a long traceback outside the call that failed: through sys.unraisablehook
    ("Event loop is closed", "Exception ignored in <coroutine ...>") and asyncio's logger ("exception was
    never retrieved"), hundreds of lines for a small model. Reports of anything else pass on.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_reads", False):
        return

    def hook(unraisable):
        if not _is_abandoned_read(unraisable.exc_value):
            previous(unraisable)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook
    logging_std.getLogger("asyncio").addFilter(
        lambda record: not (record.exc_info and _is_abandoned_read(record.exc_info[1]))
    )


# How TensorStore words a failed read (its status code first), e.g. 'NOT_FOUND: Error opening "zarr" driver...'.
_TENSORSTORE_STATUS = re.compile(r"^(NOT_FOUND|OUT_OF_RANGE|DATA_LOSS|INVALID_ARGUMENT|FAILED_PRECONDITION|INTERNAL): ")


def _is_abandoned_read(error: BaseException | None) -> bool:
    """Whether `error` is the aftermath of a failed Orbax read (raised in Orbax, or on its closed loop)."""
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    if isinstance(error, ValueError) and _TENSORSTORE_STATUS.match(str(error)):
        return True  # A TensorStore read of a damaged file, left to be collected; the restore reports it.
    while error is not None:
        frame = error.__traceback__
        while frame is not None:
            if f"{os.sep}orbax{os.sep}" in frame.tb_frame.f_code.co_filename:
                return True
            frame = frame.tb_next
        error = error.__cause__ or error.__context__
    return False
