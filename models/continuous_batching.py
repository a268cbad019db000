"""Continuous batching: many sentences decoded in one set of rows, each row refilled as its sentence ends.

A row holds a sentence (and its hypotheses) at a position and budget of its own. The host queues the
sentences, longest first, and calls one program, `advance`, again and again: it encodes a block of them
into the rows the last call left done, then runs the search until a block's worth of rows is done, and
reports the sentences that ended with their translations. The device picks the rows and keeps each row's
sentence, so the host reads a call's report after dispatching the next call: on an accelerator one
transfer a call, off the critical path. The arrays keep their shapes, so a split decodes in one program
whatever its lengths. Lest every step attend over the longest source's padding, sentences pass through a
few stages of falling source length (`stage_lengths`): once every sentence left fits the next stage, the
rows move on to its shorter arrays and more rows (`narrow`, the one other program). A split compiles at
most 2 * MAX_STAGES - 1 programs, of shapes set by the bucket boundaries, so the compilation cache serves
later runs. A sentence's translation is the one decoding it alone gives: each row is computed on its own,
and the padding a stage adds is masked.
"""

import dataclasses
import functools
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.beam_search import beam_rows, beams_done, run_beams
from models.decoding import cached_next_token_logits, decode_length, is_filler, source_context
from models.search import argmax_token, greedy_rows, run_greedy
from models.transformer import Transformer

Array = jax.Array
# Host arrays -> device arrays: the leading dimension of each (rows, or a block's sentences) split over
# the devices as the batch is, scalars replicated. Every process passes the same (global) arrays.
Place = Callable[[Any], Any]
# A device array -> the whole of it as numpy, on every process.
Fetch = Callable[[Array], np.ndarray]
# A row of `advance`'s report that ended no sentence.
NO_SENTENCE = -1

# A block of sentences is admitted once this share of the rows is done: fewer calls, against idle rows.
REFILL_SHARE = 1 / 8
# Stages of source length (each at most half the last): every stage adds one program and one narrowing.
MAX_STAGES = 3


class Block(NamedTuple):
    """Sentences to admit: inputs [n, src_len], budgets [n], sentences [n], the index of each (or NO_SENTENCE)."""

    inputs: np.ndarray
    budgets: np.ndarray
    sentences: np.ndarray


class Decoding(NamedTuple):
    """What `advance` carries: search, the `Search`'s rows; sentences [rows] int32, each one's (or NO_SENTENCE)."""

    search: Any
    sentences: Any


@dataclasses.dataclass(frozen=True)
class Search:
    """Greedy search or beam search as continuous batching drives it (models/search.py, models/beam_search.py).

    copies: hypotheses a sentence (1, or the beam size), the rows of the state (the self-attention cache);
        the context (the sources) has one a sentence.
    fresh(state, context, skip [n], budgets [n], max_length=) -> the search of n new sentences.
    run(next_token_logits, search, min_done=) -> the search run until at least min_done rows are done.
    done(search) -> [rows] bool; best(search) -> [rows, max_length] ids of each row's translation.
    free_field: the [rows] bool field that marks a row without a sentence.
    token_fields: the fields whose last axis is max_length + 1 tokens.
    """

    copies: int
    fresh: Callable
    run: Callable
    done: Callable
    best: Callable
    free_field: str
    token_fields: tuple[str, ...]


def greedy_search(*, bos_id: int, eos_id: int, pad_id: int) -> Search:
    """Greedy search: the most likely token at each step (`argmax_token` draws nothing from its key)."""
    special = dict(bos_id=bos_id, pad_id=pad_id)

    def run(next_token_logits, rows, *, min_done):  # The key made as the program is traced: no program of its own.
        key = jax.random.PRNGKey(0)
        return run_greedy(
            next_token_logits, rows, choose_token=argmax_token, rng=key, eos_id=eos_id, min_done=min_done, **special
        )

    fresh = functools.partial(greedy_rows, **special)
    return Search(1, fresh, run, lambda rows: rows.finished, lambda rows: rows.tokens[:, 1:], 'finished', ('tokens',))


def beam_search(*, beam_size: int, alpha: float, bos_id: int, eos_id: int, pad_id: int) -> Search:
    """Beam search with GNMT's length penalty, of which only each sentence's best hypothesis is read: a row is
    done once that one is settled."""
    special = dict(bos_id=bos_id, pad_id=pad_id)
    run = functools.partial(run_beams, alpha=alpha, eos_id=eos_id, settled=1, **special)
    fresh = functools.partial(beam_rows, beam_size=beam_size, **special)
    done, best = functools.partial(beams_done, alpha=alpha, settled=1), lambda beams: beams.finished_tokens[:, 0, 1:]
    return Search(beam_size, fresh, run, done, best, 'skip', ('live_tokens', 'finished_tokens'))


def _put_rows(search, fresh, slots: Array):
    """`search` with rows `slots` [n] replaced by `fresh`'s (past the last row: dropped); the state's are masked."""

    def put(old, new):
        return old.at[slots].set(new, mode='drop')

    names = [name for name in search._fields if name not in ('step', 'state')]
    return search._replace(**{name: jax.tree.map(put, getattr(search, name), getattr(fresh, name)) for name in names})


def _added_free_rows(search, added: int, free_field: str):
    """`search` with `added` free rows after its own (zeros, marked free in `free_field`)."""
    rows = search.budgets.shape[0]

    def grow(leaf):  # A leaf of rows * copies rows grows by added * copies.
        return jnp.pad(leaf, [(0, added * (leaf.shape[0] // rows))] + [(0, 0)] * (leaf.ndim - 1))

    names = [name for name in search._fields if name != 'step']
    grown = search._replace(**{name: jax.tree.map(grow, getattr(search, name)) for name in names})
    return grown._replace(**{free_field: getattr(grown, free_field).at[rows:].set(True)})


def _constrained(search, row_sharding):
    """`search` split by rows as `row_sharding` says (None: XLA's choice): each call gets it as the last left it."""
    if row_sharding is None:
        return search
    return jax.tree.map(
        lambda leaf: jax.lax.with_sharding_constraint(leaf, row_sharding) if leaf.ndim else leaf, search
    )


@dataclasses.dataclass(frozen=True)
class RowDecoder:
    """A `Search` over the Transformer in rows refilled as sentences end: the jitted programs and their shapes.

    advance(params, decoding, block, min_done, row_sharding=) -> (decoding, report [rows, 1 + max_length]):
        `block` admitted into the rows done at the call's start, then the search run until at least min_done
        rows are done. A report's row: the sentence that ended there in this call (NO_SENTENCE: none), then
        its output ids. A row's sentence is reported once: the next call takes the row back.
    narrow(decoding, stage=, row_sharding=) -> the `Decoding` in the `Stage`'s shorter arrays and more rows
        (static), the new ones free.
    """

    model: Transformer
    search: Search
    pad_id: int
    advance: Callable
    narrow: Callable

    def empty(self, params, rows: int, source_length: int, max_length: int, place: Place) -> Decoding:
        """The `Decoding` of `rows` free rows, made on the host: no program is compiled for it."""

        def fresh(params):
            inputs, copies = jnp.zeros((rows, source_length), jnp.int32), self.search.copies
            state = self.model.apply({'params': params}, rows * copies, max_length, method=Transformer.self_cache)
            context = source_context(self.model, params, inputs)
            skip, budgets = jnp.ones(rows, bool), jnp.zeros(rows, jnp.int32)
            return self.search.fresh(state, context, skip, budgets, max_length=max_length)

        empty = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), jax.eval_shape(fresh, params))
        empty = empty._replace(**{self.search.free_field: np.ones(rows, bool)})
        return place(Decoding(empty, np.full(rows, NO_SENTENCE, np.int32)))


def row_decoder(model: Transformer, search: Search, *, pad_id: int) -> RowDecoder:
    """The `RowDecoder` of `search` over `model`."""

    def advance(params, decoding: Decoding, block: Block, min_done, *, row_sharding):
        rows, sentences = decoding
        # The rows done at the start were reported by the last call: they take the block, or stay free.
        free = search.done(rows)
        slots = jnp.flatnonzero(free, size=len(block.sentences), fill_value=len(free))  # Past the last: dropped.
        slots = jnp.where(block.sentences == NO_SENTENCE, len(free), slots)
        sentences = jnp.where(free, NO_SENTENCE, sentences).at[slots].set(block.sentences, mode='drop')
        context = source_context(model, params, block.inputs)
        max_length = getattr(rows, search.token_fields[0]).shape[-1] - 1
        fresh = search.fresh((), context, is_filler(block.inputs, pad_id), block.budgets, max_length=max_length)
        rows = _put_rows(rows, fresh, slots)
        rows = search.run(functools.partial(cached_next_token_logits, model, params), rows, min_done=min_done)
        rows, sentences = _constrained((rows, sentences), row_sharding)
        ended = jnp.where(search.done(rows), sentences, NO_SENTENCE)
        return Decoding(rows, sentences), jnp.concatenate([ended[:, None], search.best(rows)], axis=1)

    def narrow(decoding: Decoding, *, stage, row_sharding):
        rows, sentences = decoding
        source_length, max_length = stage.source_length, stage.max_length

        def cut(caches, length):  # Leaves [rows, heads, length, d].
            return jax.tree.map(lambda leaf: leaf[:, :, :length], caches)

        inputs, cross = rows.context['inputs'][:, :source_length], cut(rows.context['cross'], source_length)
        tokens = {name: getattr(rows, name)[..., : max_length + 1] for name in search.token_fields}
        rows = rows._replace(**tokens, state=cut(rows.state, max_length), context={'inputs': inputs, 'cross': cross})
        added = stage.rows - len(sentences)
        sentences = jnp.pad(sentences, (0, added), constant_values=NO_SENTENCE)
        return _constrained(Decoding(_added_free_rows(rows, added, search.free_field), sentences), row_sharding)

    return RowDecoder(
        model,
        search,
        pad_id,
        advance=jax.jit(advance, static_argnames=('row_sharding',), donate_argnums=(1,)),
        narrow=jax.jit(narrow, static_argnames=('stage', 'row_sharding')),
    )


def stage_lengths(source_lengths: np.ndarray, boundaries: Sequence[int]) -> list[int]:
    """The source lengths of the stages, longest first: the bucket boundary that holds the longest source, then
    up to MAX_STAGES - 1 more, each the longest boundary at most half the last that some source fits."""
    longest = int(np.max(source_lengths))
    stages = [next((b for b in boundaries if b >= longest), boundaries[-1])]
    while len(stages) < MAX_STAGES:
        shorter = [b for b in boundaries if b <= stages[-1] // 2 and np.any(source_lengths <= b)]
        if not shorter:
            break
        stages.append(max(shorter))
    return stages


class Stage(NamedTuple):
    """`rows` sentences of up to source_length ids and max_length output tokens, block_rows admitted a call."""

    source_length: int
    max_length: int
    rows: int
    block_rows: int


def decode_sentences(
    decoder: RowDecoder,
    params: Any,
    sources: Sequence[np.ndarray],
    *,
    rows: Mapping[int, int],
    row_multiple: int = 1,
    max_decode_length: int,
    place: Place,
    fetch: Fetch,
    row_sharding=None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yields (sentence index, output ids [a stage's max_length]) of every source as each is done.

    sources: [length] int32 ids of each sentence, ending with <eos>, at most max(rows) long. rows: the sentences
    decoded at once at each source length a stage may take (the bucket boundaries, with about as many source ids
    each: shorter stages decode more rows). row_multiple: the devices the rows are split over, which divide every
    stage's rows and blocks. max_decode_length caps each sentence's budget (`decode_length` of its length).
    place, fetch: between host and device arrays; row_sharding: how rows are split (None: one device).
    """
    if not len(sources):
        return
    lengths = np.array([len(source) for source in sources])
    stages, most_rows = [], 0
    for length in stage_lengths(lengths, sorted(rows)):
        most_rows = max(most_rows, rows[length])  # Rows never fall: live sentences keep theirs.
        block_rows = -(-int(most_rows * REFILL_SHARE) // row_multiple) * row_multiple
        stages.append(Stage(length, decode_length(length, max_decode_length), most_rows, max(row_multiple, block_rows)))
    queue = deque(np.argsort(-lengths, kind='stable').tolist())
    stage = stages.pop(0)
    decoding = decoder.empty(params, stage.rows, stage.source_length, stage.max_length, place)
    unread, report = set(), None  # Sentences admitted and not yet read; the last call's report.
    while queue:
        fits_next = lambda length: bool(stages) and length <= stages[0].source_length  # noqa: E731
        while stages and all(fits_next(lengths[s]) for s in unread) and fits_next(lengths[queue[0]]):
            stage = stages.pop(0)
            decoding = decoder.narrow(decoding, stage=stage, row_sharding=row_sharding)
        block = _next_block(sources, lengths, queue, stage, max_decode_length, decoder.pad_id)
        unread.update(block.sentences[block.sentences != NO_SENTENCE].tolist())
        # Done rows (free ones count) take the next block: a block's worth, or at the end every row.
        min_done = stage.block_rows if queue else stage.rows
        decoding, next_report = decoder.advance(params, decoding, place(block), min_done, row_sharding=row_sharding)
        if report is not None:  # Read while the call just dispatched runs.
            yield from _read(fetch(report), unread)
        report = next_report
    yield from _read(fetch(report), unread)
    if unread:
        raise RuntimeError(f'Continuous batching lost sentences {sorted(unread)[:10]}: a block found too few rows.')


def _read(report: np.ndarray, unread: set) -> Iterator[tuple[int, np.ndarray]]:
    """(sentence, output ids) of each row of an `advance` report that ended a sentence, taken out of `unread`."""
    for row in np.flatnonzero(report[:, 0] != NO_SENTENCE):
        sentence = int(report[row, 0])
        unread.remove(sentence)
        yield sentence, report[row, 1:]


def _next_block(sources, lengths, queue: deque, stage: Stage, max_decode_length: int, pad_id: int) -> Block:
    """The next queued sentences, up to a block, as a `Block` of the stage's source length."""
    inputs = np.full((stage.block_rows, stage.source_length), pad_id, np.int32)
    budgets = np.zeros(stage.block_rows, np.int32)
    sentences = np.full(stage.block_rows, NO_SENTENCE, np.int32)
    for i in range(min(stage.block_rows, len(queue))):
        sentence = queue.popleft()
        inputs[i, : lengths[sentence]] = sources[sentence]
        budgets[i], sentences[i] = decode_length(lengths[sentence], max_decode_length), sentence
    return Block(inputs, budgets, sentences)
