"""Training batches from a stream of chunks of tokenized pairs: packed rows, or one pair per row.

A grain transformation (an `IterDataset`) written here rather than taken from grain, because
on a CPU the stream's time is taken from the train step's cores. Fed one pair at a time,
`grain.experimental.FirstFitPackIterDataset` and its per-element bookkeeping cost several times
what chunks of pairs through the loop below cost, where reading and tokenizing dominate. Grain's
packers also place each pair as it comes, which leaves a few percent of the target positions
empty; choosing among pairs kept waiting fills nearly all of them. The pairs' lengths are kept
and the rows written as lists, so placing and writing stay a small part of the stream's time.

How pairs are placed, with `lookahead` pairs in view per row of a batch:

- 0: first fit as it comes, row for row grain's: each pair goes into the first row where both of
  its sides still fit; the first pair that fits no row closes the batch and opens the next.
- n >= 1: the packer keeps n x rows pairs in view, read ahead from the stream. It places them
  longest first (both sides' lengths summed), each into the row that it leaves least room in
  (best fit), reads more as it places, and closes the batch once none of those in view fits.
  Pairs passed over in OVERDUE_AFTER batches go before all others, the longest waiting first, so
  that no pair waits much longer (a few more batches where many are overdue at once, as with rows
  few for their lengths) and the epochs keep their order.

A batch is {'inputs', 'targets', 'inputs_segment_ids', 'targets_segment_ids',
'inputs_positions', 'targets_positions'}, each [rows, max_length] int32: segments are
numbered 1, 2, ... in each row (0 is padding), positions restart at 0 in each segment, and
segment k of an inputs row is the source of segment k of the targets row. Without packing,
a batch is {'inputs', 'targets'}, one pair a row in the stream's order, padded. Where a finite
stream ends, its last batch holds what is left.

The position is the chunk the next unread pair is in (the parent iterator's state before it),
the pair's index in it, and the pairs read but not yet placed, each named the same way with the
batches it has waited: a batch is never half-made at a checkpoint, and a restored iterator makes
the same next batch, or with other `rows` or another `lookahead` the batches from the same pairs
on (none skipped or repeated).
"""

import dataclasses
from typing import Any

import grain
import numpy as np

from common.errors import UserInputError
from input_pipeline.rows import Pair, write_rows

# Batches a pair may be passed over before it goes first (with lookahead >= 1).
OVERDUE_AFTER = 4
# More room than any row has: where a pair does not fit (best fit's search).
_NO_ROOM = float("inf")


class RowBatchIterDataset(grain.IterDataset):
    """Batches of `rows` rows of `max_length` from a stream of lists of pairs (the module docstring).

    Pairs with a side longer than `max_length` are left out; once `give_up_after` pairs in a
    row were left out (the caller makes it a run long enough that none or almost none fits), or
    `give_up_after_empty_chunks` chunks in a row held no pair (the caller's chunks leave out pairs
    with an empty side), UserInputError, where the stream would otherwise search forever.
    """

    def __init__(
        self,
        parent: grain.IterDataset,
        *,
        max_length: int,
        rows: int,
        packing: bool = True,
        lookahead: int = 0,
        give_up_after: int | None = None,
        give_up_after_empty_chunks: int | None = None,
    ):
        super().__init__(parent)
        if rows < 1 or max_length < 1 or lookahead < 0:
            raise ValueError(f"rows ({rows}) and max_length ({max_length}) must be >= 1, lookahead ({lookahead}) >= 0.")
        self._options = dict(
            max_length=max_length,
            rows=rows,
            packing=packing,
            lookahead=lookahead,
            give_up_after=give_up_after,
            give_up_after_empty_chunks=give_up_after_empty_chunks,
        )

    def __iter__(self) -> grain.DatasetIterator:
        return _RowBatchIterator(self._parent.__iter__(), **self._options)

    def __str__(self) -> str:
        return f"RowBatchIterDataset({self._options})"


@dataclasses.dataclass
class _Chunk:
    """A chunk of pairs and the parent's state before it was read (which reads it again)."""

    state: dict[str, Any]
    pairs: list[Pair]


@dataclasses.dataclass(slots=True)
class _Waiting:
    """A pair read but not placed yet: chunk.pairs[offset], passed over in `waited` batches."""

    chunk: _Chunk
    offset: int
    waited: int = 0
    lengths: tuple[int, int] = dataclasses.field(init=False)  # Of its source and its target.
    size: int = dataclasses.field(init=False)  # Both sides' lengths summed.

    def __post_init__(self):
        source, target = self.chunk.pairs[self.offset]
        self.lengths = (len(source), len(target))
        self.size = self.lengths[0] + self.lengths[1]

    @property
    def pair(self) -> Pair:
        return self.chunk.pairs[self.offset]


class _RowBatchIterator(grain.DatasetIterator):
    def __init__(
        self,
        parent: grain.DatasetIterator,
        *,
        max_length: int,
        rows: int,
        packing: bool,
        lookahead: int,
        give_up_after: int | None,
        give_up_after_empty_chunks: int | None,
    ):
        super().__init__(parent)
        self._max_length = max_length
        self._rows = rows
        self._packing = packing
        self._best_fit = packing and lookahead > 0
        self._in_view = rows * lookahead if self._best_fit else 1
        self._give_up_after = give_up_after
        self._give_up_after_empty_chunks = give_up_after_empty_chunks
        self._empty_chunks_in_a_row = 0
        self._misfits_in_a_row = 0
        self._chunk = _Chunk(parent.get_state(), [])  # The chunk of the next unread pair.
        self._offset = 0  # The next unread pair: _chunk.pairs[_offset].
        self._waiting: list[_Waiting] = []  # In the order read.

    def get_state(self) -> dict[str, Any]:
        waiting, chunk = [], None  # Grouped by chunk, in the order read.
        for entry in self._waiting:
            if entry.chunk is not chunk:
                chunk = entry.chunk
                waiting.append({"chunk": chunk.state, "pairs": []})
            waiting[-1]["pairs"].append([entry.offset, entry.waited])
        if self._offset >= len(self._chunk.pairs):
            # Every pair of the chunk was read (placed, or waiting): name the next one, so that a
            # restore does not read and tokenize a chunk only to skip it.
            return {"parent": self._parent.get_state(), "offset": 0, "waiting": waiting}
        return {"parent": self._chunk.state, "offset": self._offset, "waiting": waiting}

    def set_state(self, state: dict[str, Any]) -> None:
        self._waiting, chunk = [], None
        for group in state["waiting"]:
            self._parent.set_state(group["chunk"])
            chunk = _Chunk(group["chunk"], next(self._parent))
            entries = (_Waiting(chunk, offset, waited) for offset, waited in group["pairs"])
            # Saved under a larger max_length, a pair may no longer fit: it is left out as if read now.
            self._waiting.extend(entry for entry in entries if self._fits(entry))
        if chunk is not None and chunk.state == state["parent"]:
            self._chunk = chunk  # The next unread pair is in the last waiting pair's chunk: read once.
        else:
            self._parent.set_state(state["parent"])
            # A finite parent may be used up there (a position saved after its last chunk): then so is this.
            self._chunk = _Chunk(state["parent"], next(self._parent, []))
        self._offset = state["offset"]
        self._misfits_in_a_row = self._empty_chunks_in_a_row = 0

    def _read_pair(self) -> _Waiting:
        """The next unread pair that fits max_length (StopIteration where a finite parent ends)."""
        while True:
            while self._offset >= len(self._chunk.pairs):
                chunk_state = self._parent.get_state()  # Kept only once the chunk is read.
                self._chunk, self._offset = _Chunk(chunk_state, next(self._parent)), 0
                self._empty_chunks_in_a_row = 0 if self._chunk.pairs else self._empty_chunks_in_a_row + 1
                if self._empty_chunks_in_a_row == self._give_up_after_empty_chunks:
                    raise UserInputError(
                        f"The last {self._empty_chunks_in_a_row} chunks of training records read held no pair with "
                        "text on both sides: check that config.dataset.source_lang and target_lang name the "
                        "dataset's two languages and that its sentences are not empty."
                    )
            entry = _Waiting(self._chunk, self._offset)
            self._offset += 1
            if self._fits(entry):
                self._misfits_in_a_row = 0
                return entry
            self._misfits_in_a_row += 1
            if self._give_up_after is not None and self._misfits_in_a_row >= self._give_up_after:
                raise UserInputError(
                    f"The last {self._misfits_in_a_row} training pairs read were all longer than "
                    f"config.dataset.max_length={self._max_length} (none or almost none fits); raise it."
                )

    def _fits(self, entry: _Waiting) -> bool:
        return max(entry.lengths) <= self._max_length

    def _fill_view(self) -> None:
        """Reads pairs until `_in_view` are waiting, or the parent ends."""
        try:
            while len(self._waiting) < self._in_view:
                self._waiting.append(self._read_pair())
        except StopIteration:
            pass

    def _in_placing_order(self) -> list[_Waiting]:
        if not self._best_fit:
            return self._waiting
        return sorted(
            self._waiting,  # A stable sort: ties keep the order read.
            key=lambda entry: (
                -entry.waited if entry.waited >= OVERDUE_AFTER else 0,  # Overdue: the longest waiting first.
                -entry.size,
            ),
        )

    def _row_for(self, entry: _Waiting, free: tuple[list[int], list[int]], rows_used: int) -> int | None:
        """The row `entry`'s pair goes into, or None.

        Args:
            entry: the pair and its sides' lengths.
            free: positions still free per row, of the sources' and of the targets' rows.
            rows_used: rows holding a pair already (without packing).
        """
        if not self._packing:
            return rows_used if rows_used < self._rows else None
        need_source, need_target = entry.lengths
        # Plain lists, not NumPy: on 16 rows, NumPy's per-call costs are several times the search (quick-start
        # stream).
        if not self._best_fit:
            return next(
                (
                    row
                    for row, (source, target) in enumerate(zip(*free))
                    if source >= need_source and target >= need_target
                ),
                None,
            )
        # The room each row would have left, _NO_ROOM where the pair does not fit; the first of the least wins.
        rooms = [
            source + target if source >= need_source and target >= need_target else _NO_ROOM
            for source, target in zip(*free)
        ]
        least = min(rooms)
        return None if least == _NO_ROOM else rooms.index(least)

    def __next__(self) -> dict[str, np.ndarray]:
        rows, length = self._rows, self._max_length
        free = ([length] * rows, [length] * rows)  # Positions still free per row, of the sources and targets.
        row_pairs: list[list[Pair]] = [[] for _ in range(rows)]  # Each row's pairs, in the order placed.
        placed = 0
        while self._packing or placed < rows:
            self._fill_view()
            if not self._waiting and not placed:
                raise StopIteration
            placed_now = set()
            # The most room any row has left: most pairs in view fit no row once a batch fills up, and
            # this tells them apart without a search.
            most_source, most_target = max(free[0]), max(free[1])
            for entry in self._in_placing_order():
                if entry.lengths[0] > most_source or entry.lengths[1] > most_target:
                    continue
                row = self._row_for(entry, free, placed)
                if row is None:
                    continue
                row_pairs[row].append(entry.pair)
                placed += 1
                free[0][row] -= entry.lengths[0]
                free[1][row] -= entry.lengths[1]
                most_source, most_target = max(free[0]), max(free[1])
                placed_now.add(id(entry))
            if not placed_now:
                break  # None of the pairs in view fits: the batch is as full as it gets.
            self._waiting = [entry for entry in self._waiting if id(entry) not in placed_now]
        for entry in self._waiting:
            entry.waited += 1
        return write_rows(row_pairs, length, with_segments=self._packing)
