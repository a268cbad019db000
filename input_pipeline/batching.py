"""Length-bucketed batches with a restorable position, and ordered eval batches.

Every batch comes from one length bucket and is padded to the bucket's length,
so the train step compiles once per bucket. Shorter buckets hold more
sequences: each batch carries about `tokens_per_batch` padded tokens.

Training order is a pure function of (seed, epoch): the iterator's whole state
is (epoch, batch index in the epoch) and a hash of what the order was made from
(lengths, buckets, batch sizes, seed), saved with each checkpoint
(`get_state`, `set_state`: the interface of grain's iterators, which the
checkpoint's data item takes), and a restored iterator continues with exactly
the batch that came next. Classification trains from these in-memory batches;
translation streams from records (input_pipeline/streaming.py).

With several processes, every process computes the same global batches (which
pairs, in which order) but pads only its own rows of each (`RowsFn`), the rows
its devices hold; the global batch is assembled on the devices.
"""

import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from absl import logging

from common.errors import UserInputError
from common.special_ids import PAD_ID

# Global batch size -> the rows of each global batch this process materialises.
RowsFn = Callable[[int], slice]


def all_rows(global_rows: int) -> slice:
    """The RowsFn of a single process: every row."""
    return slice(0, global_rows)


@dataclasses.dataclass(frozen=True)
class RaggedIds:
    """Variable-length id sequences stored flat: sequence i is values[offsets[i]:offsets[i+1]]."""

    values: np.ndarray  # [total_ids] int32
    offsets: np.ndarray  # [num_sequences + 1] int64

    @classmethod
    def from_lists(cls, sequences: Sequence[Sequence[int]]) -> "RaggedIds":
        lengths = np.fromiter((len(s) for s in sequences), np.int64, len(sequences))
        offsets = np.zeros(len(sequences) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter((i for s in sequences for i in s), np.int32, offsets[-1])
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def select(self, indices: np.ndarray) -> "RaggedIds":
        """The sequences at `indices`, in that order (one vectorised gather)."""
        indices = np.asarray(indices, np.int64)
        lengths = self.lengths[indices]
        offsets = np.zeros(len(indices) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.repeat(self.offsets[indices] - offsets[:-1], lengths) + np.arange(offsets[-1])
        return RaggedIds(self.values[gather], offsets)

    @classmethod
    def concatenate(cls, parts: Sequence["RaggedIds"]) -> "RaggedIds":
        """The sequences of `parts`, one after another."""
        offsets = [np.zeros(1, np.int64)]
        for part in parts:
            offsets.append(part.offsets[1:] + offsets[-1][-1])
        return cls(np.concatenate([part.values for part in parts]), np.concatenate(offsets))


@dataclasses.dataclass(frozen=True)
class ParallelIds:
    """Tokenized sentence pairs; both sides end with <eos>."""

    sources: RaggedIds
    targets: RaggedIds

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def lengths(self) -> np.ndarray:
        """[num_pairs] the longer side of each pair, which decides its bucket."""
        return np.maximum(self.sources.lengths, self.targets.lengths)

    def padded(self, indices: np.ndarray, length: int, batch_size: int) -> dict[str, np.ndarray]:
        """The pairs at `indices` as a batch: {'inputs', 'targets'}, [batch_size, length] int32 each."""
        return pad_batch(self, indices, length, batch_size)


@dataclasses.dataclass(frozen=True)
class LabelledIds:
    """Tokenized sentences (each ending with <eos>) and their class ids: the examples of classification."""

    sources: RaggedIds
    labels: np.ndarray  # [num_examples] int32 class ids.

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def lengths(self) -> np.ndarray:
        """[num_examples] the sentence lengths, which decide the buckets."""
        return self.sources.lengths

    def padded(self, indices: np.ndarray, length: int, batch_size: int) -> dict[str, np.ndarray]:
        """The examples at `indices` as a batch: 'inputs' [batch_size, length] and 'labels' [batch_size] int32.

        Filler rows past len(indices) are all padding with label 0; a real row always holds
        at least <eos>, so `inputs[:, 0] != PAD_ID` tells them apart.
        """
        labels = np.zeros(batch_size, np.int32)
        labels[: len(indices)] = self.labels[np.asarray(indices, np.int64)]
        return {"inputs": pad_ids(self.sources, indices, length, batch_size, keep_eos=True), "labels": labels}


# What batches are made of: pairs (translation) or labelled sentences (classification).
Examples = ParallelIds | LabelledIds


def bucket_batch_sizes(boundaries: Sequence[int], tokens_per_batch: int, multiple_of: int) -> dict[int, int]:
    """Sequences per batch for each bucket length, a multiple of `multiple_of`.

    `multiple_of` is the number of data shards (devices), so every batch splits
    evenly across them.
    """
    return {length: max(multiple_of, tokens_per_batch // length // multiple_of * multiple_of) for length in boundaries}


def bucket_of(lengths: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """[n] index of the smallest bucket that holds each length (len(boundaries) if none)."""
    return np.searchsorted(np.asarray(boundaries), lengths, side="left")


def cut_keeping_eos(ids: np.ndarray, length: int) -> np.ndarray:
    """A source cut to `length` ids keeping its last, <eos> (the model has only seen inputs that end with it)."""
    return ids if len(ids) <= length else np.concatenate([ids[: length - 1], ids[-1:]])


def pad_ids(side: RaggedIds, indices: np.ndarray, length: int, batch_size: int, *, keep_eos: bool) -> np.ndarray:
    """Pads (or cuts) the sequences at `indices` into [batch_size, length] int32.

    Rows past len(indices) are all padding: filler rows that carry no loss weight and
    that decoding skips. With `keep_eos`, a sequence longer than `length` keeps its last
    id, <eos>, after its first length - 1 (the model has only seen inputs that end with
    it; translate.py cuts its sources the same way); without, it is cut to its first
    `length` (a target's prefix, whose loss needs no <eos>).
    """
    padded = np.full((batch_size, length), PAD_ID, np.int32)
    for row, index in enumerate(indices):
        ids = side[index]
        if len(ids) > length:
            ids = cut_keeping_eos(ids, length) if keep_eos else ids[:length]
        padded[row, : len(ids)] = ids
    return padded


def pad_batch(pairs: ParallelIds, indices: np.ndarray, length: int, batch_size: int) -> dict[str, np.ndarray]:
    """Pads the pairs at `indices` into {'inputs', 'targets'}: [batch_size, length] int32 each."""
    return {
        "inputs": pad_ids(pairs.sources, indices, length, batch_size, keep_eos=True),
        "targets": pad_ids(pairs.targets, indices, length, batch_size, keep_eos=False),
    }


def epoch_batches(
    lengths: np.ndarray, boundaries: Sequence[int], batch_sizes: dict[int, int], seed: int, epoch: int
) -> list[np.ndarray]:
    """The training batches of one epoch, as arrays of example indices.

    Examples are shuffled, grouped by bucket (keeping the shuffled order), cut
    into full batches (a bucket's remainder waits for another epoch's shuffle),
    and the batches are shuffled again so that buckets interleave.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    buckets = bucket_of(lengths[order], boundaries)
    batches = []
    for bucket, length in enumerate(boundaries):
        members = order[buckets == bucket]
        size = batch_sizes[length]
        for start in range(0, len(members) - size + 1, size):
            batches.append(members[start : start + size])
    return [batches[i] for i in rng.permutation(len(batches))]


def _order_fingerprint(lengths: np.ndarray, boundaries: Sequence[int], batch_sizes: dict[int, int], seed: int) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(lengths, np.int64).tobytes())
    digest.update(repr((tuple(boundaries), sorted(batch_sizes.items()), seed)).encode())
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class IteratorState:
    epoch: int = 0
    batch: int = 0  # Batches of `epoch` already produced.
    # What decides the order (data, seed, buckets, batch sizes), hashed: a
    # position is only meaningful in the order it was saved with.
    order: str = ""


class TrainBatches(Iterator[dict[str, np.ndarray]]):
    """An endless, restorable stream of shuffled length-bucketed training batches."""

    def __init__(
        self,
        pairs: Examples,
        boundaries: Sequence[int],
        batch_sizes: dict[int, int],
        seed: int,
        state: IteratorState = IteratorState(),
        rows: RowsFn = all_rows,
    ):
        """The stream of global batches; each one holds only this process's `rows` of it."""
        self._pairs = pairs
        self._rows = rows
        self._lengths = pairs.lengths
        self._boundaries = tuple(boundaries)
        self._batch_sizes = batch_sizes
        self._seed = seed
        self._order = _order_fingerprint(self._lengths, self._boundaries, batch_sizes, seed)
        self.state = state
        if not self._batches:  # Every epoch has as many batches: none, ever.
            raise UserInputError(
                f"{len(pairs)} training pairs do not fill one batch of any length bucket "
                f"(batch sizes {batch_sizes}); lower config.per_device_batch_size."
            )

    @property
    def state(self) -> IteratorState:
        return IteratorState(self._epoch, self._next, self._order)

    @state.setter
    def state(self, state: IteratorState) -> None:
        if state.order not in ("", self._order):
            logging.warning(
                "The data, seed, buckets or batch sizes differ from those the saved position was "
                "taken in: training goes on from epoch %d, batch %d of a different order.",
                state.epoch,
                state.batch,
            )
        self._epoch, self._next = state.epoch, state.batch
        self._batches = epoch_batches(self._lengths, self._boundaries, self._batch_sizes, self._seed, self._epoch)

    def get_state(self) -> dict:
        """The position after the last batch returned, JSON-serialisable (the checkpoint's data item)."""
        return dataclasses.asdict(self.state)

    def set_state(self, state: dict) -> None:
        self.state = IteratorState(**state)

    def close(self) -> None:
        """Nothing to stop (the stream of translation has a thread or worker processes to stop)."""

    def __next__(self) -> dict[str, np.ndarray]:
        if self._next >= len(self._batches):
            self.state = IteratorState(self._epoch + 1, 0, self._order)
        indices = self._batches[self._next]
        self._next += 1
        length = self._boundaries[bucket_of(self._lengths[indices[:1]], self._boundaries)[0]]
        rows = self._rows(len(indices))
        return self._pairs.padded(indices[rows], length, rows.stop - rows.start)


def length_sorted_batches(
    lengths: np.ndarray, boundaries: Sequence[int], batch_sizes: dict[int, int]
) -> Iterator[tuple[int, np.ndarray]]:
    """Every example exactly once, shortest first, in batches of its bucket's size.

    Examples longer than the last bucket go into it (and are cut by the caller).

    Yields:
        (bucket length, example indices); the last batch of a bucket may be short.
    """
    lengths = np.minimum(lengths, boundaries[-1])
    order = np.argsort(lengths, kind="stable")
    buckets = bucket_of(lengths[order], boundaries)
    for bucket, length in enumerate(boundaries):
        members = order[buckets == bucket]
        size = batch_sizes[length]
        for start in range(0, len(members), size):
            yield length, members[start : start + size]


def eval_batches(
    pairs: Examples, boundaries: Sequence[int], batch_sizes: dict[int, int], rows: RowsFn = all_rows
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Every pair exactly once, in batches bucketed by the longer side and padded to full size.

    Pairs longer than the last bucket are cut to it, sources keeping their <eos> (the caller warns).

    Yields:
        (batch, indices): this process's `rows` of the padded global batch, and
        the pair index of each of the global batch's first len(indices) rows.
    """
    for length, indices in length_sorted_batches(pairs.lengths, boundaries, batch_sizes):
        local = rows(batch_sizes[length])
        yield pairs.padded(indices[local], length, local.stop - local.start), indices


def source_batches(
    sources: RaggedIds, boundaries: Sequence[int], batch_sizes: dict[int, int], rows: RowsFn = all_rows
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every source exactly once, bucketed by its own length: the batches to translate.

    Sources longer than the last bucket are cut to it, keeping their <eos> (the caller warns).

    Yields:
        (inputs: this process's `rows` of the padded [batch_size, length] int32 global
        batch, the source index of each of the global batch's first len(indices) rows).
    """
    for length, indices in length_sorted_batches(sources.lengths, boundaries, batch_sizes):
        local = rows(batch_sizes[length])
        yield pad_ids(sources, indices[local], length, local.stop - local.start, keep_eos=True), indices
