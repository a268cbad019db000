"""Decoding many sentences in a fixed set of rows, each finished row refilled with the next sentence.

A batch decoded as a whole runs until its longest sentence ends, and every finished row keeps
its share of the work. Here the rows run in segments of the search loops (models/search.py,
models/beam_search.py), each until enough rows are done; between segments the finished
translations are read out and their rows take the next sentences, already encoded a batch
ahead. Every row keeps its own position, so the arrays keep one shape and each bucket of source
lengths compiles once.

Once a bucket has no sentence left to start, its last ones would run on in rows that the others
left: the rows are cut to a quarter (`SHRINK`) whenever at most that many still hold a sentence,
the live ones moved to the front, never below `MIN_ROWS` nor to a number the devices do not
divide (each size compiles once).

A sentence's translation is the one whole-batch decoding gives (`tests/test_refill.py`, and the
whole test split in float32): every step computes each row on its own, and the batches that are
encoded are those of the whole-batch decoding.
"""

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.beam_search import beam_rows, beams_done, insert_beam_rows, run_beams
from models.decoding import cached_next_token_logits, is_filler, model_next_token_logits
from models.search import argmax_token, greedy_rows, insert_greedy_rows, run_greedy
from models.transformer import Transformer

Array = jax.Array
# (inputs [rows, src_len] int32 this process's rows, budgets [rows] int32) -> global arrays.
Place = Callable[[np.ndarray, np.ndarray], tuple[Array, Array]]
# A global array -> the whole of it as numpy, on every process.
Fetch = Callable[[Array], np.ndarray]

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
    """

    start: Callable
    insert: Callable
    run: Callable
    take: Callable


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


def _row_decoder(start, insert, run, copies: int) -> RowDecoder:
    """The jitted `RowDecoder` of a search's functions (each search's `budgets` has one entry a row)."""

    def take(search, source):
        return _take_rows(search, search.budgets.shape[0], source, copies)

    return RowDecoder(jax.jit(start, static_argnames=('max_length',)), jax.jit(insert), jax.jit(run), jax.jit(take))


def greedy_decoder(model: Transformer, *, bos_id: int, eos_id: int, pad_id: int) -> RowDecoder:
    """Greedy search (`argmax_token`) as a `RowDecoder`."""
    special = dict(bos_id=bos_id, pad_id=pad_id)

    def start(params, inputs, budgets, *, max_length):
        _, state, context = model_next_token_logits(model, params, inputs, max_length, use_cache=True)
        return greedy_rows(state, context, is_filler(inputs, pad_id), budgets, max_length=max_length, **special)

    def insert(rows, fresh, take, source):
        return insert_greedy_rows(rows, take, _take_rows(fresh, source.shape[0], source, 1))

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

    return _row_decoder(start, insert, run, 1)


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
        return insert_beam_rows(beams, take, _take_rows(fresh, source.shape[0], source, beam_size))

    def run(params, beams, min_done):
        next_token_logits = functools.partial(cached_next_token_logits, model, params)
        beams = run_beams(next_token_logits, beams, alpha=alpha, eos_id=eos_id, min_done=min_done, **special)
        best = jnp.where(beams.skip[:, None], pad_id, beams.finished_tokens[:, 0, 1:])
        return beams, beams_done(beams, alpha), best

    return _row_decoder(start, insert, run, beam_size)


def decode_batches(
    decoder: RowDecoder,
    params: Any,
    batches: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]],
    *,
    max_length: int,
    place: Place,
    fetch: Fetch,
    row_multiple: int = 1,
) -> Iterator[tuple[int, np.ndarray]]:
    """Decodes batches of one shape in one set of rows, refilling each row once it is done.

    Args:
        decoder: greedy or beam search.
        params: the model parameters.
        batches: (inputs [rows, src_len] int32 this process's rows, budgets [rows] int32, ids
            [n] int: the sentence of each of the global batch's first n rows; the rest is filler).
        max_length: the arrays' output length (static): at least every budget.
        place, fetch: between this process's rows and global arrays.
        row_multiple: the rows are split over this many devices: fewer rows stay a multiple of it.

    Yields:
        (sentence id, its output ids [max_length]) as each is done, in no particular order.
    """
    batches = iter(batches)
    first = next(batches, None)
    if first is None:
        return
    search = decoder.start(params, *place(first[0], first[1]), max_length=max_length)
    rows = search.budgets.shape[0]
    slots = np.full(rows, -1)  # The sentence in each row; -1: none.
    slots[: len(first[2])] = first[2]
    pending = []  # (fresh search state of an encoded batch, [(its row, sentence id)] not yet placed).
    while True:
        waiting = bool(pending) or _encode_next(decoder, params, batches, pending, place, max_length)
        fewer = _fewer_rows(rows, row_multiple)
        min_done = max(1, int(rows * REFILL_SHARE)) if waiting else rows - fewer
        search, done, best = decoder.run(params, search, min_done)
        done, best = fetch(done), fetch(best)
        for slot in np.flatnonzero(done & (slots >= 0)):
            yield int(slots[slot]), best[slot]
            slots[slot] = -1
        search = _refill(decoder, params, search, slots, pending, batches, place, max_length)
        if np.all(slots < 0):
            return
        if not pending and np.count_nonzero(slots >= 0) <= fewer:  # No sentence left to start: fewer rows.
            source = np.argsort(slots < 0, kind='stable')[:fewer]  # The live rows, then done ones.
            search, slots, rows = decoder.take(search, source.astype(np.int32)), slots[source], fewer


def _fewer_rows(rows: int, row_multiple: int) -> int:
    """The rows a search of `rows` rows is cut to once no sentence is left to start; 0: it is not cut."""
    fewer = rows // SHRINK
    return fewer if fewer >= MIN_ROWS and fewer % row_multiple == 0 else 0


def compile_ahead(decoder: RowDecoder, params: Any, fillers, *, place: Place, row_multiple: int = 1, stop=None) -> None:
    """Compiles every program `decode_batches` runs on batches of the shapes of `fillers`, bucket by bucket.

    Runs each once on filler rows, where it has nothing to decode. Called in a thread of its own, it
    compiles the next buckets' programs while the current one decodes (the cores are not all busy).

    Args:
        decoder, params, place, row_multiple: as `decode_batches` gets them.
        fillers: (inputs [rows, src_len] int32 of filler rows, budgets [rows] int32, max_length) of
            each bucket, in the order they will be decoded.
        stop: a `threading.Event`; once set, nothing more is compiled.
    """
    for inputs, budgets, max_length in fillers:
        if stop is not None and stop.is_set():
            return
        # Each program gets what decode_batches gives it: a search that `run` or `insert` left.
        fresh = decoder.start(params, *place(inputs, budgets), max_length=max_length)
        rows = fresh.budgets.shape[0]
        search, _, _ = decoder.run(params, fresh, rows)  # Every row is filler, hence done: no step runs.
        search = decoder.insert(search, fresh, np.zeros(rows, bool), np.zeros(rows, np.int32))
        while rows := _fewer_rows(rows, row_multiple):
            if stop is not None and stop.is_set():
                return
            search, _, _ = decoder.run(params, decoder.take(search, np.zeros(rows, np.int32)), rows)


def _encode_next(decoder, params, batches, pending: list, place, max_length: int) -> bool:
    """Encodes the next batch into `pending`; False when there is none."""
    batch = next(batches, None)
    if batch is None:
        return False
    fresh = decoder.start(params, *place(batch[0], batch[1]), max_length=max_length)
    pending.append((fresh, list(enumerate(batch[2]))))
    return True


def _refill(decoder, params, search, slots: np.ndarray, pending: list, batches, place, max_length: int):
    """`search` with its free rows (slots -1) given the next sentences, batch by batch."""
    while True:
        free = np.flatnonzero(slots < 0)
        if not len(free) or (not pending and not _encode_next(decoder, params, batches, pending, place, max_length)):
            return search
        fresh, waiting = pending[0]
        placed, pending[0] = waiting[: len(free)], (fresh, waiting[len(free) :])
        take = np.zeros(len(slots), bool)
        source = np.zeros(len(slots), np.int32)
        for slot, (row, sentence) in zip(free, placed):
            take[slot], source[slot], slots[slot] = True, row, sentence
        search = decoder.insert(search, fresh, take, source)
        if not pending[0][1]:
            pending.pop(0)
