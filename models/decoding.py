"""The Transformer as a search's next-token function, and one batch decoded by any search (models/search.py).

The encoder runs once a sentence, cross-attention keys and values once a sentence whatever its
hypotheses, and each step runs the decoder for one new position only (`Transformer.decode_step`).
With `use_cache=False` the decoder reruns over the whole prefix at every step: the reference the
cached path is tested against. Many sentences are decoded by models/continuous_batching.py, with the
same functions.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.search import NextTokenLogits, Search
from models.transformer import DecoderCache, Transformer

Array = jax.Array


def source_context(model: Transformer, params: Any, inputs: Array) -> dict:
    """What the cached decoder reads of the sources [batch, src_len]: {'inputs': the ids, 'cross': the cross-attention
    keys and values, per layer [batch, heads, src_len, d]}, once a source whatever its hypotheses."""
    variables = {'params': params}
    encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)
    return {'inputs': inputs, 'cross': model.apply(variables, encoded, method=Transformer.cross_cache)}


def cached_next_token_logits(
    model: Transformer, params: Any, positions: Array, tokens: Array, self_cache: DecoderCache, context: dict
) -> tuple[Array, DecoderCache]:
    """`NextTokenLogits` of the model with a key/value cache: one decoder step of each hypothesis at its position.

    self_cache: per layer 'self_key', 'self_value' [rows * copies, heads, max_length, d]; context: `source_context`'s,
    [rows, ...], whose part of the cache no step changes (nor beam search reorders).
    """
    last = jnp.take_along_axis(tokens, positions[:, None], axis=1)  # [rows * copies, 1]
    cache = {layer: {**self_cache[layer], **context['cross'][layer]} for layer in self_cache}
    logits, cache = model.apply(
        {'params': params}, context['inputs'], last, positions, cache, method=Transformer.decode_step
    )
    return logits, {layer: {name: cache[layer][name] for name in self_cache[layer]} for layer in self_cache}


class Decoder(NamedTuple):
    """The model as a search decodes with it: next_token_logits, with its cache [rows * copies, ...] and context."""

    next_token_logits: NextTokenLogits
    cache: Any
    context: Any


def model_decoder(
    model: Transformer, params: Any, inputs: Array, max_length: int, *, copies: int, use_cache: bool = True
) -> Decoder:
    """The `Decoder` of sources [rows, src_len] whose `copies` hypotheses each generate up to max_length tokens.

    use_cache: run the decoder for the new position only, on the self-attention cache and the sources'
    cross-attention keys and values (`source_context`); False reruns it on the whole prefix at every step,
    the sources and their encodings repeated for every copy.
    """
    if use_cache:
        cache = model.apply({'params': params}, inputs.shape[0] * copies, max_length, method=Transformer.self_cache)
        next_token_logits = functools.partial(cached_next_token_logits, model, params)
        return Decoder(next_token_logits, cache, source_context(model, params, inputs))
    variables = {'params': params}
    encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)

    def uncached_logits(positions, tokens, cache, context):  # Logits [rows * copies, max_length, vocab], then one.
        logits = model.apply(variables, *context, tokens[:, :-1], method=Transformer.decode, deterministic=True)
        return jnp.take_along_axis(logits, positions[:, None, None], axis=1)[:, 0], cache

    return Decoder(uncached_logits, (), tuple(jnp.repeat(x, copies, axis=0) for x in (encoded, inputs)))


def decode_batch(
    search: Search,
    model: Transformer,
    params: Any,
    inputs: Array,
    *,
    max_length: int,
    budgets: Array | None = None,
    sentences: Array | None = None,
    use_cache: bool = True,
):
    """A batch of sources [batch, src_len] decoded by `search` to the end: its rows, `search.best` the outputs.

    budgets: [batch] int, the most tokens of each sentence (`decode_length` of its source's; None: max_length,
    static, for each). sentences: [batch] int32 each one's index, which sampling keys on (None: its row).
    All-padding rows are no sentence: they decode nothing.
    """
    batch = inputs.shape[0]
    budgets = jnp.full(batch, max_length, jnp.int32) if budgets is None else budgets
    budgets = jnp.where(jnp.all(inputs == search.special.pad, axis=1), 0, budgets)  # Filler rows: no sentence.
    sentences = jnp.arange(batch, dtype=jnp.int32) if sentences is None else sentences
    decoder = model_decoder(model, params, inputs, max_length, copies=search.copies, use_cache=use_cache)
    rows = search.fresh(sentences, budgets, max_length=max_length)
    rows, _ = search.run(decoder.next_token_logits, rows, decoder.cache, decoder.context)
    return rows


def sentences_per_batch(hypotheses: int, beam_size: int) -> int:
    """Sentences of a decoding batch of `hypotheses` rows: beam search decodes beam_size hypotheses a sentence.

    Decoding batches are sized in hypotheses, not sentences: a step's work, and the self-attention
    cache it reads and beam search reorders, grow with them, so that beam search's batches weigh
    what greedy decoding's do.
    """
    return max(1, hypotheses // beam_size)


def decode_length(source_length, max_decode_length: int):
    """The most subwords a translation of a source of `source_length` ids (<eos> included) may have.

    Generous (twice the source and a margin: translations run longer than their sources
    in some languages), and capped by `max_decode_length`. An int for an int, or
    elementwise for an array of lengths ([batch] -> [batch] int32): each sentence's own
    budget, so that its translation does not depend on the batch it is decoded in.
    """
    budget = np.minimum(max_decode_length, 2 * np.asarray(source_length) + 8)
    return int(budget) if budget.ndim == 0 else budget.astype(np.int32)
