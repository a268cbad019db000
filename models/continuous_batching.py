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

from models.decoding import cached_next_token_logits, decode_length, model_decoder, source_context
from models.search import Axis, Search, check_rows, fields
from models.transformer import Transformer

Array = jax.Array
# (host arrays, heads) -> device arrays: the leading dimension of each (rows, or a block's sentences) split
# over the devices as the batch is, scalars replicated; heads=True: attention caches [rows, heads, length, d],
# split over the heads too (`Layout.heads`). Every process passes the same (global) arrays.
Place = Callable[..., Any]
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
    """What `advance` carries: the search's rows; the model's cache [rows * copies, heads, max_length, d] and context
    (`source_context`, [rows, ...]); sentences [rows] int32, each row's (or NO_SENTENCE)."""

    rows: Any
    cache: Any
    context: Any
    sentences: Any


class Layout(NamedTuple):
    """How a `Decoding` is split over devices: rows, for [rows, ...] leaves; heads, for the caches' [rows, heads,
    length, d] leaves (over the tensor axis too, as the train step's attention is)."""

    rows: jax.sharding.Sharding
    heads: jax.sharding.Sharding


def _put(tree, new, at: Array):
    """`tree` with its leaves' entries `at` [n] replaced by `new`'s (past the last: dropped)."""
    return jax.tree.map(lambda old, value: old.at[at].set(value, mode='drop'), tree, new)


def _put_rows(search: Search, rows, fresh, slots: Array):
    """`rows` with rows `slots` [n] replaced by `fresh`'s, as each field's declared axis says."""
    at = {Axis.ROWS: slots, Axis.COPIES: (slots[:, None] * search.copies + jnp.arange(search.copies)).ravel()}
    news = {name: _put(getattr(rows, name), getattr(fresh, name), at[axis]) for name, axis, _ in fields(rows)}
    return dataclasses.replace(rows, **news)


def _grown(tree, rows: int, added: int):
    """Each leaf of `tree`, [rows, ...] or [rows * copies, ...], followed by zeros for `added` more rows."""
    return jax.tree.map(
        lambda leaf: jnp.pad(leaf, [(0, added * (len(leaf) // rows))] + [(0, 0)] * (leaf.ndim - 1)), tree
    )


def _laid_out(decoding: Decoding, layout: Layout | None) -> Decoding:
    """`decoding` split as `layout` says (None: XLA's choice): each call gets it as the last left it."""
    if layout is None:
        return decoding

    def split(tree, sharding):
        return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(leaf, sharding) if leaf.ndim else leaf, tree)

    rows, cache, context, sentences = decoding
    context = {'inputs': split(context['inputs'], layout.rows), 'cross': split(context['cross'], layout.heads)}
    return Decoding(split(rows, layout.rows), split(cache, layout.heads), context, split(sentences, layout.rows))


@dataclasses.dataclass(frozen=True)
class RowDecoder:
    """A `Search` over the Transformer in rows refilled as sentences end: the jitted programs and their shapes.

    advance(params, decoding, block, min_done, layout=) -> (decoding, report [rows, 1 + max_length]): `block`
        admitted into the rows done at the call's start, then the search run until at least min_done rows are
        done. A report's row: the sentence that ended there in this call (NO_SENTENCE: none), then its output
        ids. A row's sentence is reported once: the next call takes the row back.
    narrow(decoding, stage=, layout=) -> the `Decoding` in the `Stage`'s shorter arrays and more rows (static),
        the new ones free.
    """

    model: Transformer
    search: Search
    advance: Callable
    narrow: Callable
    shapes: Callable  # (params, rows, source_length, max_length) -> a `Decoding`'s rows, cache and context, abstract.

    def empty(self, params, rows: int, source_length: int, max_length: int, place: Place) -> Decoding:
        """The `Decoding` of `rows` free rows (zeros), made on the host: no program is compiled for it."""
        shapes = self.shapes(params, rows, source_length, max_length)
        free, cache, context = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), shapes)
        # Laid out as `advance` leaves them, or its second call would compile another program.
        context = {'inputs': place(context['inputs']), 'cross': place(context['cross'], heads=True)}
        return Decoding(place(free), place(cache, heads=True), context, place(np.full(rows, NO_SENTENCE, np.int32)))


def row_decoder(model: Transformer, search: Search) -> RowDecoder:
    """The `RowDecoder` of `search` over `model`."""

    def advance(params, decoding: Decoding, block: Block, min_done, *, layout):
        rows, cache, context, sentences = decoding
        num_rows = len(sentences)
        check_rows(rows, num_rows, search.copies)
        # The rows done at the start were reported by the last call: they take the block, or stay free.
        free = search.done(rows)
        slots = jnp.flatnonzero(free, size=len(block.sentences), fill_value=num_rows)  # Past the last: dropped.
        slots = jnp.where(block.sentences == NO_SENTENCE, num_rows, slots)
        sentences = jnp.where(free, NO_SENTENCE, sentences).at[slots].set(block.sentences, mode='drop')
        max_length = next(getattr(rows, name).shape[-1] - 1 for name, _, tokens in fields(rows) if tokens)
        fresh = search.fresh(block.sentences, block.budgets, max_length=max_length)
        rows = _put_rows(search, rows, fresh, slots)
        context = _put(context, source_context(model, params, block.inputs), slots)
        next_token_logits = functools.partial(cached_next_token_logits, model, params)
        rows, cache = search.run(next_token_logits, rows, cache, context, min_done=min_done)
        decoding = _laid_out(Decoding(rows, cache, context, sentences), layout)
        ended = jnp.where(search.done(rows), sentences, NO_SENTENCE)
        return decoding, jnp.concatenate([ended[:, None], search.best(rows)], axis=1)

    def narrow(decoding: Decoding, *, stage, layout):
        rows, cache, context, sentences = decoding
        check_rows(rows, len(sentences), search.copies)
        tokens = {name: getattr(rows, name)[..., : stage.max_length + 1] for name, _, tokens in fields(rows) if tokens}
        cut = lambda caches, length: jax.tree.map(lambda leaf: leaf[:, :, :length], caches)  # noqa: E731 [rows, heads, length, d]
        context = {
            'inputs': context['inputs'][:, : stage.source_length],
            'cross': cut(context['cross'], stage.source_length),
        }
        cut_down = Decoding(dataclasses.replace(rows, **tokens), cut(cache, stage.max_length), context, sentences)
        grown = _grown(cut_down, len(sentences), stage.rows - len(sentences))  # The new rows free: zeros.
        return _laid_out(grown._replace(sentences=grown.sentences.at[len(sentences) :].set(NO_SENTENCE)), layout)

    def shapes(params, rows: int, source_length: int, max_length: int):
        def made(params):
            inputs, nothing = jnp.zeros((rows, source_length), jnp.int32), jnp.zeros(rows, jnp.int32)
            decoder = model_decoder(model, params, inputs, max_length, copies=search.copies)
            return search.fresh(nothing, nothing, max_length=max_length), decoder.cache, decoder.context

        return jax.eval_shape(made, params)

    return RowDecoder(
        model,
        search,
        advance=jax.jit(advance, static_argnames=('layout',), donate_argnums=(1,)),
        narrow=jax.jit(narrow, static_argnames=('stage', 'layout')),
        shapes=shapes,
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


def stages_of(lengths: np.ndarray, rows: Mapping[int, int], row_multiple: int, max_decode_length: int) -> list[Stage]:
    """The `Stage`s of sources of `lengths` [n]: rows[length] at most at each stage's source length, and no more
    than its sentences need, rounded up to a power of two of row_multiple (so that other inputs of about as many
    sentences share its programs); never fewer than the stage before, whose live sentences keep their rows."""
    stages, most_rows = [], 0
    for length in stage_lengths(lengths, sorted(rows)):
        shares = -(-int(np.sum(lengths <= length)) // row_multiple)  # Rows each device needs for them.
        most_rows = max(most_rows, min(rows[length], row_multiple * 2 ** int(np.ceil(np.log2(shares)))))
        block_rows = -(-int(most_rows * REFILL_SHARE) // row_multiple) * row_multiple
        stages.append(Stage(length, decode_length(length, max_decode_length), most_rows, max(row_multiple, block_rows)))
    return stages


def decode_sentences(
    decoder: RowDecoder,
    params: Any,
    sources: Mapping[int, np.ndarray],
    *,
    rows: Mapping[int, int],
    row_multiple: int = 1,
    max_decode_length: int,
    place: Place,
    fetch: Fetch,
    layout: Layout | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yields (sentence, output ids [a stage's max_length]) of every source as each is done.

    sources: {sentence: [length] int32 ids ending with <eos>, at most max(rows) long}, the sentence a number (which
    sampling keys on). rows: the most sentences decoded at once at each source length a stage may take (the bucket
    boundaries, with about as many source ids each: shorter stages decode more rows). row_multiple: the devices
    the rows are split over, which divide every stage's rows and blocks. max_decode_length caps each sentence's
    budget (`decode_length` of its length). place, fetch: between host and device arrays; layout: how rows and
    caches are split (None: one device).
    """
    if not len(sources):
        return
    lengths = {sentence: len(ids) for sentence, ids in sources.items()}
    longest = max(lengths, key=lengths.get)
    if lengths[longest] > max(rows):
        raise ValueError(
            f'Sentence {longest} has {lengths[longest]} source ids, more than the longest stage takes ({max(rows)}): '
            'cut sources to it first (input_pipeline.batching.cut_keeping_eos).'
        )
    stages = stages_of(np.array(list(lengths.values())), rows, row_multiple, max_decode_length)
    queue = deque(sorted(lengths, key=lambda sentence: -lengths[sentence]))
    stage = stages.pop(0)
    decoding = decoder.empty(params, stage.rows, stage.source_length, stage.max_length, place)
    unread, report = set(), None  # Sentences admitted and not yet read; the last call's report.
    while queue:
        while stages and all(lengths[s] <= stages[0].source_length for s in [*unread, queue[0]]):
            stage = stages.pop(0)
            decoding = decoder.narrow(decoding, stage=stage, layout=layout)
        block = _next_block(sources, lengths, queue, stage, max_decode_length, decoder.search.special.pad)
        unread.update(block.sentences[block.sentences != NO_SENTENCE].tolist())
        # Done rows (free ones count) take the next block: a block's worth, or at the end every row.
        min_done = stage.block_rows if queue else stage.rows
        decoding, next_report = decoder.advance(params, decoding, place(block), min_done, layout=layout)
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
    """The next queued sentences, up to a block, as a `Block` of the stage's source length (the rest: budget 0)."""
    inputs = np.full((stage.block_rows, stage.source_length), pad_id, np.int32)
    budgets = np.zeros(stage.block_rows, np.int32)
    sentences = np.full(stage.block_rows, NO_SENTENCE, np.int32)
    for i in range(min(stage.block_rows, len(queue))):
        sentence = queue.popleft()
        inputs[i, : lengths[sentence]] = sources[sentence]
        budgets[i], sentences[i] = decode_length(lengths[sentence], max_decode_length), sentence
    return Block(inputs, budgets, sentences)
