"""Training batches from a stream of chunks of tokenized pairs: packed first-fit, or one pair per row.

A grain transformation (an `IterDataset`) written here rather than taken from grain, because
the stream's CPU time is taken from the train step on a 2-core machine. Fed one pair at a time,
`grain.experimental.FirstFitPackIterDataset` and its per-element bookkeeping made the
quick-start's pipeline cost ~57 ms of CPU per 64-row batch (~200 µs a pair, measured on the
2-core AMD EPYC, 2026-11-23); chunks of pairs, the loop below and one thread bring it to
16-20 ms, most of it reading and tokenizing.

The packing is grain's first fit, row for row: each pair goes into the first row where both
of its sides still fit; the first pair that fits no row closes the batch and opens the next.
A batch is {'inputs', 'targets', 'inputs_segment_ids', 'targets_segment_ids',
'inputs_positions', 'targets_positions'}, each [rows, max_length] int32: segments are
numbered 1, 2, ... in each row (0 is padding), positions restart at 0 in each segment, and
segment k of an inputs row is the source of segment k of the targets row. Without packing,
a batch is {'inputs', 'targets'}, one pair a row, padded.

The position is the chunk the next pair is in (the parent iterator's state before it) and
the pair's index in it: a batch is never half-made at a checkpoint, and a restored iterator
makes the same next batch, or with other `rows` the batches from the same pair on.
"""

from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from common.errors import UserInputError
from common.special_ids import PAD_ID

# A pair: (source ids, target ids), each ending in <eos>.
Pair = tuple[Sequence[int], Sequence[int]]
# Where a pair goes: (row, its segment number in the row, where each side starts in the row).
Placement = tuple[int, int, tuple[int, int]]
_SIDES = ("inputs", "targets")


class RowBatchIterDataset(grain.IterDataset):
    """Batches of `rows` rows of `max_length` from a stream of lists of pairs (the module docstring).

    Pairs with a side longer than `max_length` are left out; once `give_up_after` pairs in a
    row were left out (the caller makes it a run long enough that none or almost none fits),
    UserInputError, where the stream would otherwise search forever.
    """

    def __init__(
        self,
        parent: grain.IterDataset,
        *,
        max_length: int,
        rows: int,
        packing: bool = True,
        give_up_after: int | None = None,
    ):
        super().__init__(parent)
        if rows < 1 or max_length < 1:
            raise ValueError(f"rows ({rows}) and max_length ({max_length}) must be at least 1.")
        self._options = dict(max_length=max_length, rows=rows, packing=packing, give_up_after=give_up_after)

    def __iter__(self) -> grain.DatasetIterator:
        return _RowBatchIterator(self._parent.__iter__(), **self._options)

    def __str__(self) -> str:
        return f"RowBatchIterDataset({self._options})"


class _RowBatchIterator(grain.DatasetIterator):
    def __init__(
        self, parent: grain.DatasetIterator, *, max_length: int, rows: int, packing: bool, give_up_after: int | None
    ):
        super().__init__(parent)
        self._max_length = max_length
        self._rows = rows
        self._packing = packing
        self._give_up_after = give_up_after
        self._misfits_in_a_row = 0
        self._chunk_state = parent.get_state()  # The parent's state before `_chunk` was read.
        self._chunk: list[Pair] = []
        self._offset = 0  # The next pair: _chunk[_offset].

    def get_state(self) -> dict[str, Any]:
        if self._offset >= len(self._chunk):
            # The chunk is used up (an unpacked batch can end with it): name the next one, so
            # that a restore does not read and tokenize a chunk only to skip it.
            return {"parent": self._parent.get_state(), "offset": 0}
        return {"parent": self._chunk_state, "offset": self._offset}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        # A finite parent may be used up there (a position saved after its last chunk): then so is this.
        self._chunk_state, self._chunk, self._offset = state["parent"], next(self._parent, []), state["offset"]
        self._misfits_in_a_row = 0

    def _next_pair(self) -> Pair:
        """The next pair that fits max_length, without consuming it."""
        while True:
            while self._offset >= len(self._chunk):
                chunk_state = self._parent.get_state()  # Kept only once the chunk is read.
                self._chunk_state, self._chunk, self._offset = chunk_state, next(self._parent), 0
            source, target = self._chunk[self._offset]
            if len(source) <= self._max_length and len(target) <= self._max_length:
                self._misfits_in_a_row = 0
                return source, target
            self._offset += 1
            self._misfits_in_a_row += 1
            if self._give_up_after is not None and self._misfits_in_a_row >= self._give_up_after:
                raise UserInputError(
                    f"The last {self._misfits_in_a_row} training pairs read were all longer than "
                    f"config.dataset.max_length={self._max_length} (none or almost none fits); raise it."
                )

    def __next__(self) -> dict[str, np.ndarray]:
        rows, length = self._rows, self._max_length
        # Positions used per side and row, and segments per row; a row takes a pair where both sides fit.
        used = np.zeros((2, rows), np.int64)
        segments = np.zeros(rows, np.int64)
        placed: list[tuple[Placement, Pair]] = []
        while True:
            pair = self._next_pair()
            if self._packing:
                fitting = np.flatnonzero((used[0] + len(pair[0]) <= length) & (used[1] + len(pair[1]) <= length))
                if not fitting.size:
                    break  # The pair opens the next batch.
                row = int(fitting[0])
            else:
                row = len(placed)
            segments[row] += 1
            placed.append(((row, int(segments[row]), (int(used[0, row]), int(used[1, row]))), pair))
            used[0, row] += len(pair[0])
            used[1, row] += len(pair[1])
            self._offset += 1
            if not self._packing and len(placed) == rows:
                break
        return _write_rows(placed, rows, length, with_segments=self._packing)


def _write_rows(
    placed: list[tuple[Placement, Pair]], rows: int, length: int, *, with_segments: bool
) -> dict[str, np.ndarray]:
    """The batch arrays of pairs written where they were placed."""
    batch = {side: np.full((rows, length), PAD_ID, np.int32) for side in _SIDES}
    if with_segments:
        for side in _SIDES:
            batch[f"{side}_segment_ids"] = np.zeros((rows, length), np.int32)
            batch[f"{side}_positions"] = np.zeros((rows, length), np.int32)
    positions = np.arange(length, dtype=np.int32)
    for (row, segment, starts), pair in placed:
        for side, start, ids in zip(_SIDES, starts, pair):
            end = start + len(ids)
            batch[side][row, start:end] = ids
            if with_segments:
                batch[f"{side}_segment_ids"][row, start:end] = segment
                batch[f"{side}_positions"][row, start:end] = positions[: len(ids)]
    return batch
