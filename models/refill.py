"""Decoding many sentences in a fixed set of rows, each finished row refilled with the next sentence.

A batch decoded as a whole runs until its longest sentence ends, and every finished row keeps
its share of the work. Here the rows run in segments of the search loops (models/search.py,
models/beam_search.py), each until enough rows are done; between segments the finished
translations are read out and their rows take the next sentences, already encoded a batch
ahead. Every row keeps its own position, so the arrays keep one shape and each bucket of source
lengths compiles once.

Batches come shortest sources first, a bucket of source lengths after another. When the next
bucket's sentences are due, the rows move on to its longer arrays (`RowDecoder.widen`) with the
sentences they hold, so that a bucket's last sentences run beside the next one's first instead of
in rows the others left. Once no sentence is left to start, the rows are cut to a quarter
(`SHRINK`) whenever at most that many still hold a sentence, the live ones moved to the front,
never below `MIN_ROWS` nor to a number the devices do not divide (each size compiles once).

A sentence's translation is the one whole-batch decoding gives (`tests/test_refill.py`, and the
whole test split in float32): every step computes each row on its own, the batches that are
encoded are those of the whole-batch decoding, and a row moved on to longer arrays only gains
positions that its masks hide.
"""

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.beam_search import beam_rows, beams_done, insert_beam_rows, run_beams
from models.decoding import cached_next_token_logits, is_filler, model_next_token_logits, widened_cached_decoding
from models.search import argmax_token, greedy_rows, grown, insert_greedy_rows, run_greedy
from models.transformer import Transformer

Array = jax.Array
# (inputs [rows, src_len] int32 this process's rows, budgets [rows] int32) -> global arrays.
Place = Callable[[np.ndarray, np.ndarray], tuple[Array, Array]]
# A global array -> the whole of it as numpy, on every process.
Fetch = Callable[[Array], np.ndarray]


class SourceBatch(NamedTuple):
    """A batch to decode: inputs [rows, src_len] int32 (this process's rows), budgets [rows] int32, ids [n] int
    (the sentence of each of the global batch's first n rows; the rest is filler) and max_length, the output
    length of its bucket (static; at least every budget)."""

    inputs: np.ndarray
    budgets: np.ndarray
    ids: np.ndarray
    max_length: int

    def filler(self, pad_id: int) -> 'SourceBatch':
        """A batch of this one's shapes with no sentence (`compile_ahead` runs programs on such)."""
        return self._replace(inputs=np.full_like(self.inputs, pad_id), ids=self.ids[:0])


# Rows are refilled once this share of them is done: fewer stops, against rows idle while they wait.
REFILL_SHARE = 1 / 8
# Without sentences to start, rows are cut to 1 / SHRINK of their number once at most that many are
# live: each cut is a compilation, each row left unused a share of every step.
SHRINK = 4
MIN_ROWS = 16


@dataclasses.dataclass(frozen=True)
class RowDecoder:
    """The jitted pieces of greedy search or beam search over rows refilled as they finish.

    start(params, inputs, budgets, max_length=) -> the search state of a batch's sentences
        (the encoder runs here), every non-filler row live.
    insert(search, fresh, take [rows] bool, source [rows] int32) -> `search` with the rows where
        take is True replaced by `fresh`'s rows source.
    run(params, search, min_done) -> (search, done [rows] bool, best [rows, max_length] ids): the
        search run until at least min_done rows are done (or all are).
    take(search, source [n] int32) -> the search of n rows, row i being `search`'s row source[i].
    widen(search, source_length=, max_length=) -> `search` in arrays for sources and outputs that
        long (static, at least its own), going on as it would have.
    """

    start: Callable
    insert: Callable
    run: Callable
    take: Callable
    widen: Callable


def _take_rows(tree: Any, rows: int, source: Array, copies: int) -> Any:
    """Rows `source` [n] of every leaf of `rows` rows; leaves with rows * copies rows move in blocks of `copies`."""

    def take(leaf):
        if leaf.ndim == 0:
            return leaf
        if leaf.shape[0] == rows:
            return leaf[source]
        by_row = leaf.reshape(rows, copies, *leaf.shape[1:])
        return by_row[source].reshape(-1, *leaf.shape[1:])

    return jax.tree.map(take, tree)


def _widened(search, *, token_fields: tuple[str, ...], source_length: int, max_length: int, pad_id: int):
    """`RowDecoder.widen` of a search whose `token_fields` end in [max_length + 1] tokens."""
    state, context = widened_cached_decoding(
        search.state, search.context, source_length=source_length, max_length=max_length, pad_id=pad_id
    )
    tokens = {name: grown(getattr(search, name), -1, max_length + 1, pad_id) for name in token_fields}
    return search._replace(**tokens, state=state, context=context)


def _row_decoder(start, insert, run, widen, copies: int) -> RowDecoder:
    """The jitted `RowDecoder` of a search's functions (each search's `budgets` has one entry a row)."""

    def take(search, source):
        return _take_rows(search, search.budgets.shape[0], source, copies)

    return RowDecoder(
        start=jax.jit(start, static_argnames=('max_length',)),
        insert=jax.jit(insert),
        run=jax.jit(run),
        take=jax.jit(take),
        widen=jax.jit(widen, static_argnames=('source_length', 'max_length')),
    )


def greedy_decoder(model: Transformer, *, bos_id: int, eos_id: int, pad_id: int) -> RowDecoder:
    """Greedy search (`argmax_token`) as a `RowDecoder`."""
    special = dict(bos_id=bos_id, pad_id=pad_id)

    def start(params, inputs, budgets, *, max_length):
        _, state, context = model_next_token_logits(model, params, inputs, max_length, use_cache=True)
        return greedy_rows(state, context, is_filler(inputs, pad_id), budgets, max_length=max_length, **special)

    def insert(rows, fresh, take, source):
        return insert_greedy_rows(rows, take, _take_rows(fresh, fresh.budgets.shape[0], source, 1))

    def run(params, rows, min_done):
        next_token_logits = functools.partial(cached_next_token_logits, model, params)
        rows = run_greedy(
            next_token_logits,
            argmax_token,
            rows,
            jax.random.PRNGKey(0),
            eos_id=eos_id,
            min_finished=min_done,
            **special,
        )
        return rows, rows.finished, rows.tokens[:, 1:]

    widen = functools.partial(_widened, token_fields=('tokens',), pad_id=pad_id)
    return _row_decoder(start, insert, run, widen, 1)


def beam_decoder(
    model: Transformer, *, beam_size: int, alpha: float, bos_id: int, eos_id: int, pad_id: int
) -> RowDecoder:
    """Beam search as a `RowDecoder`: a row is a sentence and its beam_size hypotheses."""
    special = dict(bos_id=bos_id, pad_id=pad_id)

    def start(params, inputs, budgets, *, max_length):
        _, state, context = model_next_token_logits(model, params, inputs, max_length, use_cache=True, copies=beam_size)
        return beam_rows(
            state, context, is_filler(inputs, pad_id), budgets, beam_size=beam_size, max_length=max_length, **special
        )

    def insert(beams, fresh, take, source):
        return insert_beam_rows(beams, take, _take_rows(fresh, fresh.budgets.shape[0], source, beam_size))

    def run(params, beams, min_done):
        next_token_logits = functools.partial(cached_next_token_logits, model, params)
        # Only the best hypothesis is read: a sentence is done once it is settled.
        beams = run_beams(next_token_logits, beams, alpha=alpha, eos_id=eos_id, settled=1, min_done=min_done, **special)
        best = jnp.where(beams.skip[:, None], pad_id, beams.finished_tokens[:, 0, 1:])
        return beams, beams_done(beams, alpha, settled=1), best

    widen = functools.partial(_widened, token_fields=('live_tokens', 'finished_tokens'), pad_id=pad_id)
    return _row_decoder(start, insert, run, widen, beam_size)


@dataclasses.dataclass
class _Encoded:
    """An encoded batch whose sentences wait for rows: its fresh search state and (its row, sentence id) pairs."""

    search: Any
    waiting: list[tuple[int, int]]
    shape: tuple[int, int]  # (source length, max_length) of its bucket.
    rows: int  # Of the global batch.


def decode_batches(
    decoder: RowDecoder,
    params: Any,
    batches: Iterable[SourceBatch],
    *,
    place: Place,
    fetch: Fetch,
    row_multiple: int = 1,
) -> Iterator[tuple[int, np.ndarray]]:
    """Decodes batches in one set of rows, refilling each row once it is done.

    The rows start as the first batch's. When the next bucket's sentences are due, the rows run
    until at most as many as its batches have are live, then move on to its shapes, cut to that
    number (they never grow): each bucket decodes in at most as many rows as its batches have, the
    batch sizes' trade of rows against their lengths.

    Args:
        decoder: greedy or beam search.
        params: the model parameters.
        batches: `SourceBatch`es, shortest sources first (source lengths and max_lengths never fall).
        place, fetch: between this process's rows and global arrays.
        row_multiple: the rows are split over this many devices: fewer rows stay a multiple of it.

    Yields:
        (sentence id, its output ids [max_length of its bucket or a later one's]) as each is done, in
        no particular order.
    """
    pending: list[_Encoded] = []
    encode_next = functools.partial(_encode_next, decoder, params, iter(batches), pending, place)
    if not encode_next():
        return
    first = pending.pop(0)
    search, shape, rows = first.search, first.shape, first.rows
    slots = np.full(rows, -1)  # The sentence in each row; -1: none.
    for row, sentence in first.waiting:
        slots[row] = sentence
    while True:
        waiting = bool(pending) or encode_next()
        if waiting and pending[0].shape != shape:  # The next bucket's sentences are due.
            next_rows = min(rows, pending[0].rows)
            if np.count_nonzero(slots >= 0) <= next_rows:
                search, slots, rows = _cut_rows(decoder, search, slots, next_rows)
                shape = pending[0].shape
                search = decoder.widen(search, source_length=shape[0], max_length=shape[1])
                search = _refill(decoder, search, shape, slots, pending, encode_next)
                continue
            min_done = rows - next_rows
        elif waiting:
            min_done = max(1, int(rows * REFILL_SHARE))
        else:  # No sentence left to start: the rows are cut as they finish.
            min_done = rows - _fewer_rows(rows, row_multiple)
        search, done, best = decoder.run(params, search, min_done)
        done, best = fetch(done), fetch(best)
        for slot in np.flatnonzero(done & (slots >= 0)):
            yield int(slots[slot]), best[slot]
            slots[slot] = -1
        search = _refill(decoder, search, shape, slots, pending, encode_next)
        if not pending and np.all(slots < 0):
            return
        fewer = _fewer_rows(rows, row_multiple)
        if not pending and np.count_nonzero(slots >= 0) <= fewer:
            search, slots, rows = _cut_rows(decoder, search, slots, fewer)


def _fewer_rows(rows: int, row_multiple: int) -> int:
    """The rows a search of `rows` rows is cut to once no sentence is left to start; 0: it is not cut."""
    fewer = rows // SHRINK
    return fewer if fewer >= MIN_ROWS and fewer % row_multiple == 0 else 0


def _cut_rows(decoder: RowDecoder, search, slots: np.ndarray, rows: int):
    """(search, slots, rows) cut to `rows` rows, at least the live ones (slots >= 0), which move to the front."""
    if rows == len(slots):
        return search, slots, rows
    source = np.argsort(slots < 0, kind='stable')[:rows]  # The live rows, then free ones.
    return decoder.take(search, source.astype(np.int32)), slots[source], rows


def _encode_next(decoder: RowDecoder, params, batches: Iterator[SourceBatch], pending: list, place: Place) -> bool:
    """Encodes the next batch into `pending`; False when there is none."""
    batch = next(batches, None)
    if batch is None:
        return False
    fresh = decoder.start(params, *place(batch.inputs, batch.budgets), max_length=batch.max_length)
    shape = (batch.inputs.shape[1], batch.max_length)
    pending.append(_Encoded(fresh, list(enumerate(batch.ids)), shape, fresh.budgets.shape[0]))
    return True


def _refill(decoder: RowDecoder, search, shape: tuple[int, int], slots: np.ndarray, pending: list, encode_next):
    """`search` with its free rows (slots -1) given the next sentences of its shape's bucket, batch by batch."""
    while True:
        free = np.flatnonzero(slots < 0)
        if not len(free) or (not pending and not encode_next()) or pending[0].shape != shape:
            return search
        encoded = pending[0]
        placed, encoded.waiting = encoded.waiting[: len(free)], encoded.waiting[len(free) :]
        take = np.zeros(len(slots), bool)
        source = np.zeros(len(slots), np.int32)
        for slot, (row, sentence) in zip(free, placed):
            take[slot], source[slot], slots[slot] = True, row, sentence
        search = decoder.insert(search, encoded.search, take, source)
        if not encoded.waiting:
            pending.pop(0)


def compile_ahead(decoder: RowDecoder, params: Any, fillers, *, place: Place, row_multiple: int = 1, stop=None) -> None:
    """Compiles the programs `decode_batches` runs after its first bucket's, on batches of the shapes of `fillers`.

    Runs each once on filler rows, where it has nothing to decode. Called in a thread of its own, it
    compiles the next buckets' programs while the first one decodes (the cores are not all busy).

    Args:
        decoder, params, place, row_multiple: as `decode_batches` gets them.
        fillers: `SourceBatch`es of filler rows, one of each bucket's shapes, the first bucket's first.
        stop: a `threading.Event`; once set, nothing more is compiled.
    """

    def start(batch: SourceBatch):
        return decoder.start(params, *place(batch.inputs, batch.budgets), max_length=batch.max_length)

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    first, *later = fillers
    search = None
    for batch in later:
        if stopped():
            return
        fresh = start(batch)
        # The first bucket's rows, made after a program that decoding does not compile itself: by
        # then it most likely has compiled their `start` (it begins there).
        search = start(first) if search is None else search
        rows, next_rows = search.budgets.shape[0], fresh.budgets.shape[0]
        if next_rows < rows:
            search, rows = decoder.take(search, np.zeros(next_rows, np.int32)), next_rows
        search = decoder.widen(search, source_length=batch.inputs.shape[1], max_length=batch.max_length)
        search = decoder.insert(search, fresh, np.zeros(rows, bool), np.zeros(rows, np.int32))
        search, _, _ = decoder.run(params, search, rows)  # Every row is filler, hence done: no step runs.
    search = start(first) if search is None else search
    rows = search.budgets.shape[0]
    while rows := _fewer_rows(rows, row_multiple):  # The last bucket's rows, cut once no sentence is left.
        if stopped():
            return
        search, _, _ = decoder.run(params, decoder.take(search, np.zeros(rows, np.int32)), rows)
