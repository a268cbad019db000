"""The training stream of translation: grain from a random-access source of records to packed, batched rows.

The flow, per process (no process holds the corpus's text or all of its ids):

  records       the train split as a random-access source: len(), [i] -> {source_lang: bytes, target_lang: bytes}
                (`input_pipeline/datasets.records`: the split's ArrayRecord files, read a record at a time;
                only the records read are in memory)
  shuffle       a global permutation of all records from the seed, another one every epoch
  [p::n]        share p of n keeps every n-th record of the permutation: the shares are disjoint and their
                union is the whole epoch; each process reads its own and never touches the others' (n counts
                distinct row ranges of the batch: processes that hold the same rows read the same share)
  repeat        forever (epoch e is the e-th permutation)
  chunk         CHUNK_RECORDS records at a time, each chunk read and tokenized in one call (SentencePiece ids +
                <eos> of each side; each worker loads the tokenizer from its model file); pairs with an
                empty side are left out
  batch         input_pipeline/row_packing.py: pairs with a side longer than max_length are left out; the others
                are packed into this process's rows of the global batch, [rows, max_length], with segment ids
                1, 2, ... and positions restarting in each segment: best fit among packing_lookahead x rows
                pairs kept in view (0: first fit as they come); without packing, one pair per row, padded.
                ONE shape, so the step compiles once
  prefetch      a background thread (or `num_workers` processes that each run the pipeline on every
                num_workers-th chunk of the permutation), so that the next batches are made while the
                device runs the step

A batch (packed) is {'inputs', 'targets', 'inputs_segment_ids', 'targets_segment_ids', 'inputs_positions',
'targets_positions'}, each [rows, max_length] int32 (unpacked, only the first two). Segment k of an inputs
row is the source of segment k of the targets row.

The position in the stream is grain's iterator state (a JSON dict: the chunk of records reached, the next
pair in it and the up to packing_lookahead x rows pairs in view, waiting to be placed); `TrainStream.get_state`
wraps it with what it is only valid for (the process and its share, workers, chunk size, records), and the
checkpoint keeps it per process (training/checkpoints/checkpointer.py). Restoring it continues with exactly the batch
that came next. Resuming where it does not fit, see `TrainStream`.
"""

import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np
import sentencepiece as spm
from absl import logging

from common import processes
from common.errors import UserInputError
from common.special_ids import EOS_ID
from input_pipeline.row_packing import Pair, RowBatchIterDataset
from input_pipeline.tokenizer import load_tokenizer

Batch = dict[str, np.ndarray]
# Batches made ahead of the step by the prefetch thread (or each worker process).
_PREFETCH_BATCHES = 2
# Records read and tokenized in one call (about one quick-start batch of pairs). In-process, the
# whole pipeline runs in the one prefetch thread: map threads would only contend for the GIL and
# the cores (two map threads cost more CPU a batch than one).
CHUNK_RECORDS = 256
# The order a position indexes: 2 shuffles with the hashed seed (`process_record_indices`). A position saved
# for another order does not fit.
SHUFFLE_VERSION = 2
# Records whose content the position's fingerprint samples (evenly spaced, first and last included).
_SAMPLED_RECORDS = 8


class ReadAndTokenizeChunk(grain.transforms.Map):
    """A chunk of record indices -> its pairs with text on both sides, [(source ids, target ids)], each side's
    SentencePiece ids followed by <eos>.

    It reads the records itself: read through grain's source, each record would pay grain's per-element
    bookkeeping (statistics, metrics), a large share of the stream's CPU. Picklable for worker processes: each
    loads the tokenizer from `tokenizer_path` at its first chunk.
    """

    def __init__(self, records: Sequence[dict], tokenizer_path: str, source_lang: str, target_lang: str):
        self._records = records
        self._path = tokenizer_path
        self._keys = (source_lang, target_lang)
        self._tokenizer: spm.SentencePieceProcessor | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": None}  # A worker loads its own.

    def map(self, indices: list[int]) -> list[Pair]:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._path)
        records = [self._records[index] for index in indices]
        sources, targets = (self._encode([_text(record[key]) for record in records]) for key in self._keys)
        # A pair with an empty side (only <eos>) stays in the records, for evaluation, but is not trained on.
        return [(source, target) for source, target in zip(sources, targets) if min(len(source), len(target)) > 1]

    def _encode(self, sentences: list[str]) -> list[list[int]]:
        # All of a side's sentences in one call, in this thread (num_threads=1; by default encode() of a
        # list starts threads, far slower for a pair), as lists: less CPU than one sentence a call into
        # NumPy arrays.
        ids = self._tokenizer.encode(sentences, num_threads=1)
        for sentence in ids:
            sentence.append(EOS_ID)
        return ids


def _text(value: Any) -> str:
    """A record's sentence as str (sources give bytes; a Python list of dicts may hold str)."""
    return value.decode("utf-8") if isinstance(value, bytes | np.bytes_) else str(value)


def process_record_indices(num_records: int, seed: int, share_index: int, share_count: int) -> "ShareOrder":
    """A share's record indices, epoch after epoch, forever: the p-th of every n of each epoch's permutation.

    Epoch e is a permutation of all `num_records` records from (seed, e); the `share_count` shares of it
    are disjoint and together hold every record once.
    """
    # grain seeds epoch e's permutation with its seed + e: seeds s and s + 1 given as they are would
    # share every epoch's order but one, shifted by an epoch (a sweep's seeds would not be independent).
    return ShareOrder(num_records, _mixed_seed(seed), share_index, share_count)


class ShareOrder(grain.MapDataset):
    """Index i -> the record that a share reads i-th: `grain.MapDataset.range(num_records).shuffle(seed)
    [share_index::share_count].repeat()`, the order that saved positions index, computed directly.

    grain's chain pays its per-element bookkeeping in each of its four steps: computed directly, the
    order costs less than half of that CPU.
    """

    def __init__(self, num_records: int, shuffle_seed: int, share_index: int, share_count: int):
        super().__init__()
        if not 0 <= share_index < share_count <= num_records:
            raise ValueError(f"Share {share_index} of {share_count} of {num_records} records.")
        self._num_records = num_records
        self._seed = shuffle_seed
        self._share_index = share_index
        self._share_count = share_count
        self._share_length = len(range(share_index, num_records, share_count))  # Records a share reads an epoch.

    def __len__(self) -> int:
        return sys.maxsize  # Forever, as grain's repeat().

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, offset = divmod(index, self._share_length)
        return grain.experimental.index_shuffle(
            self._share_index + offset * self._share_count,
            max_index=self._num_records - 1,
            seed=(self._seed + epoch) % 2**32,
            rounds=4,
        )

    def __str__(self) -> str:
        return f"ShareOrder(share {self._share_index} of {self._share_count} of {self._num_records} records)"


def train_dataset(
    records: Sequence[dict],
    *,
    tokenizer_path: str,
    source_lang: str,
    target_lang: str,
    max_length: int,
    rows: int,
    seed: int,
    packing: bool = True,
    packing_lookahead: int = 0,
    share_index: int = 0,
    share_count: int = 1,
    num_workers: int = 0,
) -> grain.IterDataset:
    """The endless stream of this process's training batches (the flow in the module docstring).

    Args:
        records: the train split, random access (len(), [i] -> {source_lang: bytes, target_lang: bytes}).
        tokenizer_path: the SentencePiece model file (worker processes load it).
        source_lang, target_lang: the record keys of the two sides.
        max_length: the row length; pairs with a longer side (or an empty one) are left out.
        rows: this process's rows of each global batch.
        seed: the shuffle's seed (hashed, then each epoch adds its number).
        packing: several pairs per row with segment ids and positions; else one pair per row.
        packing_lookahead: pairs in view per row, from which the packer picks (best fit, longest first);
            0: first fit, each pair as it comes (input_pipeline/row_packing.py).
        share_index, share_count: this process's share of the records: processes that hold the same rows of
            the global batch read the same share (training/runtime/sharding.data_share).
        num_workers: 0: read, tokenize and pack in a background thread of this process; > 0: that
            many worker processes run the whole pipeline (each on every num_workers-th chunk of
            records), their batches interleaved in turn.

    Returns:
        A grain.IterDataset of batches: {'inputs', 'targets'} and, with packing, the segment ids and
        positions of both sides, each [rows, max_length] int32.
    """
    dataset = process_record_indices(len(records), seed, share_index, share_count)
    # Misfits in a row before giving up: twice the split. One reader (one process, no workers) has then
    # read two whole epochs, and a run that long without a fit (it could straddle two permutations)
    # proves that none fits. Several readers each get a share that changes every epoch, so a pair that
    # fits can miss one reader's shares for a few epochs: there it is ~2n epochs of shares, not a proof.
    give_up_after = 2 * len(records)
    # Chunks of records, read and tokenized in one call each: grain's per-element costs are paid per chunk.
    read_and_tokenize = ReadAndTokenizeChunk(records, tokenizer_path, source_lang, target_lang)
    dataset = dataset.batch(CHUNK_RECORDS, batch_fn=list).map(read_and_tokenize)
    dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    dataset = RowBatchIterDataset(
        dataset,
        max_length=max_length,
        rows=rows,
        packing=packing,
        lookahead=packing_lookahead,
        give_up_after=give_up_after,
        # The same run of records, where every pair read has an empty side (chunks hold no pair).
        give_up_after_empty_chunks=-(-give_up_after // CHUNK_RECORDS),
    )
    if num_workers > 0:
        options = grain.MultiprocessingOptions(num_workers=num_workers, per_worker_buffer_size=_PREFETCH_BATCHES)
        return dataset.mp_prefetch(options)
    return grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=_PREFETCH_BATCHES)


def records_digest(records: Sequence[dict]) -> str:
    """A short hash of the content of _SAMPLED_RECORDS records spread over `records`, and of their number.

    A position indexes records by number: resumed on another corpus of the same size it would read
    other pairs as if they were the next ones. Sampling a few records tells corpora apart in
    microseconds (ArrayRecord reads), where hashing all of them would read the whole split.
    """
    digest = hashlib.sha256(str(len(records)).encode())
    for index in np.linspace(0, len(records) - 1, num=min(_SAMPLED_RECORDS, len(records)), dtype=np.int64):
        record = records[int(index)]
        for key in sorted(record):
            digest.update(f"{key}\0{_text(record[key])}\0".encode())
    return digest.hexdigest()[:16]


def fold_seed(seed: int, step: int) -> int:
    """A seed for a stream restarted at `step` without its position: fresh, and the same in every process."""
    return _mixed_seed(seed, step)


def _mixed_seed(*values: int) -> int:
    """A 32-bit seed hashed from `values` (NumPy's SeedSequence): nearby values give unrelated seeds."""
    return int(np.random.SeedSequence(list(values)).generate_state(1)[0])


class TrainStream:
    """The training batches of `train_dataset` with a position to checkpoint and restore.

    The position (`get_state`) is only valid for the process that saved it (its index among as many
    processes), the same share of the same records, number of workers, chunk size and shuffle (it carries
    its shuffle seed): it fits where those fields of its fingerprint equal this run's. Batch size, max_length
    and the packing lookahead may change (the stream goes on from the same pairs). Resuming:

    - with this process's saved position (same processes, shares and workers): exactly the batch that came
      next; on another number of devices (other `rows`) or with another packing lookahead, the batches from
      the same pairs on, of the new size (no record skipped or repeated, but grouped into other batches);
    - without a usable position in every process (`state` None at a step > 0, as where a process's position
      file is lost, or one saved by another process or process count, for another share, another
      `num_workers`, other records, another chunk size or another shuffle: a checkpoint saved by another
      number of processes hands on the first process's): a warning, and in every process a fresh
      stream shuffled with the seed folded with the step (`fold_seed`), so that the shares stay disjoint
      and processes holding the same rows agree. Records seen since the last epoch boundary may come again
      sooner than a full epoch later.
    """

    def __init__(
        self,
        records: Sequence[dict],
        *,
        seed: int,
        state: dict | None = None,
        step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        every_process_fits: Callable[[bool], bool] = processes.every_process_answer,
        **options,
    ):
        """`options`: the keyword arguments of `train_dataset` other than records and seed.

        Args:
            process_index, process_count: this process among the run's (`jax.process_index()`, `count()`),
                which a position names: a process never resumes another's, nor one saved by another
                number of processes (the shares of `options` may then hold other processes' rows).
            every_process_fits: whether every process's position fits, given this one's (at a `step` > 0,
                the same in every process, every process calls it once; at step 0 none does).

        Raises:
            UserInputError: `records` is empty or holds fewer records than there are shares.
        """
        if not len(records):
            raise UserInputError("The training split holds no pairs.")
        share_count = options.get("share_count", 1)
        if len(records) < share_count:
            raise UserInputError(
                f"The training split holds {len(records)} pairs, fewer than the {share_count} shares that the "
                "processes read (one each, or one for each group holding the same rows): train on more pairs or "
                "with fewer processes."
            )
        fits = {
            "process_index": process_index,
            "process_count": process_count,
            "share_index": options.get("share_index", 0),
            "share_count": share_count,
            "num_workers": options.get("num_workers", 0),
            "records": len(records),
            "chunk_records": CHUNK_RECORDS,
            "shuffle_version": SHUFFLE_VERSION,
            "records_digest": records_digest(records),
        }
        saved = None if state is None else state["stream"]
        fits_here = saved is not None and saved.items() >= fits.items()  # Every field as this run's (and its seed).
        # One process starting afresh while the others resume would read records of their shares (or, holding
        # the same rows as another, other rows than it): all resume, or none. At step 0 (the same in every
        # process) none resumes, and no process need ask the others.
        resume = step > 0 and every_process_fits(fits_here)
        if resume:
            seed = saved["seed"]  # A stream restarted earlier runs on with its folded seed.
        elif step > 0:
            seed = fold_seed(seed, step)
            why = (
                "This process's data position fits, but another process's is missing or does not fit"
                if fits_here
                else f"No data position fits this run (saved: {json.dumps(saved)}; this run: {json.dumps(fits)})"
            )
            logging.warning(
                "%s at step %d: every process goes on with a fresh stream of the records, shuffled with the seed "
                "folded with the step (%d).",
                why,
                step,
                seed,
            )
        self._fingerprint = {**fits, "seed": seed}
        self._iterator = train_dataset(records, seed=seed, **options).__iter__()
        if resume:
            self._iterator.set_state(state["grain"])

    def __iter__(self) -> "TrainStream":
        return self

    def __next__(self) -> Batch:
        return next(self._iterator)

    def get_state(self) -> dict:
        """The position after the last batch returned (JSON-serialisable), with what it is valid for."""
        return {"stream": self._fingerprint, "grain": self._iterator.get_state()}

    def close(self) -> None:
        """Stops the prefetch thread or worker processes (again: nothing)."""
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None  # Collected now, not at interpreter exit (where grain's cleanup fails).
