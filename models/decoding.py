"""Translating a batch with the Transformer: one hypothesis a row (greedy or sampled) or beam search.

The encoder runs once per batch, cross-attention keys/values are computed once
per sentence, and each step runs the decoder for one new position only
(`Transformer.decode_step`). With `use_cache=False` the decoder reruns over the
whole prefix at every step: the reference the cached path is tested and
benchmarked against. The loops themselves are in models/search.py and
models/beam_search.py.

Outputs are [batch, max_length] int32 ids, each row ending at its first <eos>
(included) and padded after it; a row that reaches its budget (`decode_length` of its
own source, at most `max_length`) without <eos> is returned as it is.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.beam_search import beam_search_loop
from models.search import ChooseToken, NextTokenLogits, search_loop
from models.transformer import DecoderCache, Transformer

Array = jax.Array


def _split_cache(cache: DecoderCache) -> tuple[DecoderCache, DecoderCache]:
    """(self-attention part, cross-attention part) of a decoder cache.

    The cross-attention keys/values depend only on the source, which all beams of
    a row share: beam search reorders the self-attention part alone.
    """
    self_part = {layer: {n: v for n, v in c.items() if n.startswith('self_')} for layer, c in cache.items()}
    cross_part = {layer: {n: v for n, v in c.items() if not n.startswith('self_')} for layer, c in cache.items()}
    return self_part, cross_part


def _merge_cache(self_part: DecoderCache, cross_part: DecoderCache) -> DecoderCache:
    return {layer: {**self_part[layer], **cross_part[layer]} for layer in self_part}


def source_context(model: Transformer, params: Any, inputs: Array) -> dict:
    """What the cached decoder reads of the sources [batch, src_len]: {'inputs': the ids, 'cross': the cross-attention
    keys and values, per layer [batch, heads, src_len, d]}, once a source whatever its hypotheses."""
    variables = {'params': params}
    encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)
    return {'inputs': inputs, 'cross': model.apply(variables, encoded, method=Transformer.cross_cache)}


def model_next_token_logits(
    model: Transformer, params: Any, inputs: Array, max_length: int, *, use_cache: bool, copies: int = 1
) -> tuple[NextTokenLogits, Any, Any]:
    """The model as a `NextTokenLogits` function, with its initial state and context.

    Args:
        model: the Transformer.
        params: its parameters.
        inputs: [batch, src_len] source ids.
        max_length: the most tokens that will be generated.
        use_cache: run the decoder for the new position only, on cached keys and
            values; False reruns it on the whole prefix at every step.
        copies: hypotheses per source (the beam size): the function's rows are
            batch * copies, the copies of source b being rows b * copies + j.

    Returns:
        (next_token_logits, state: the self-attention cache of batch * copies rows, context:
        `source_context`'s, or without the cache the sources and their encodings repeated for every copy).
    """
    if not use_cache:
        variables = {'params': params}
        encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)
        encoded, inputs = (jnp.repeat(x, copies, axis=0) for x in (encoded, inputs))

        def uncached_logits(positions, tokens, state, context):
            logits = model.apply(
                variables,
                context['encoded'],
                context['inputs'],
                tokens[:, :-1],
                method=Transformer.decode,
                deterministic=True,
            )
            return jnp.take_along_axis(logits, positions[:, None, None], axis=1)[:, 0], state

        return uncached_logits, (), {'encoded': encoded, 'inputs': inputs}

    state = model.apply({'params': params}, inputs.shape[0] * copies, max_length, method=Transformer.self_cache)
    next_token_logits = functools.partial(cached_next_token_logits, model, params)
    return next_token_logits, state, source_context(model, params, inputs)


def cached_next_token_logits(
    model: Transformer, params: Any, positions: Array, tokens: Array, self_cache: DecoderCache, context: dict
) -> tuple[Array, DecoderCache]:
    """`NextTokenLogits` of the model with a key/value cache: one decoder step of each row at its position.

    context: `source_context`'s.
    """
    last = jnp.take_along_axis(tokens, positions[:, None], axis=1)  # [rows, 1]
    cache = _merge_cache(self_cache, context['cross'])
    logits, cache = model.apply(
        {'params': params}, context['inputs'], last, positions, cache, method=Transformer.decode_step
    )
    return logits, _split_cache(cache)[0]


def is_filler(inputs: Array, pad_id: int) -> Array:
    """[batch] True for all-padding rows (batches are padded to a fixed size with them)."""
    return jnp.all(inputs == pad_id, axis=1)


def generate(
    params: Any,
    inputs: Array,
    rng: Array | None = None,
    *,
    model: Transformer,
    choose_token: ChooseToken,
    max_length: int,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    use_cache: bool = True,
    budgets: Array | None = None,
) -> Array:
    """Translates a batch one token a step, each picked by `choose_token` from the model's logits.

    Args:
        params: the model parameters.
        inputs: [batch, src_len] int32 source ids, pad_id-padded.
        rng: PRNG key for a sampling `choose_token` (step i draws from fold_in(rng, i)):
            the same key gives the same translations. None where nothing is drawn.
        model: the Transformer.
        choose_token: `argmax_token` for greedy decoding, `sampled_token(temperature,
            top_k)` for sampling (models/search.py).
        max_length: the most tokens to generate (static).
        bos_id, eos_id, pad_id: special ids.
        use_cache: see `model_next_token_logits`.
        budgets: [batch] int, the most tokens of each row (at most max_length), e.g.
            `decode_length` of each source's length; None: max_length for every row.

    Returns:
        [batch, max_length] int32 output ids.
    """
    next_token_logits, state, context = model_next_token_logits(model, params, inputs, max_length, use_cache=use_cache)
    return search_loop(
        next_token_logits,
        choose_token,
        state,
        is_filler(inputs, pad_id),
        jax.random.PRNGKey(0) if rng is None else rng,
        max_length=max_length,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        budgets=budgets,
        context=context,
    )


def beam_search(
    params: Any,
    inputs: Array,
    *,
    model: Transformer,
    beam_size: int,
    alpha: float,
    max_length: int,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    use_cache: bool = True,
    return_all: bool = False,
    budgets: Array | None = None,
) -> Array | tuple[Array, Array]:
    """Translates a batch with beam search and the GNMT length penalty.

    Args:
        params, inputs, model, max_length, bos_id, eos_id, pad_id, use_cache, budgets:
            as in `generate`.
        beam_size: hypotheses kept per sentence (static); 1 equals greedy decoding
            when alpha is 0.
        alpha: length penalty exponent (static), see `length_penalty`; the paper uses 0.6.
        return_all: also return every finished hypothesis and its score.

    Returns:
        [batch, max_length] int32 ids of the best hypothesis per sentence; with
        return_all, ([batch, beam_size, max_length] hypotheses best first,
        [batch, beam_size] scores) instead.
    """
    next_token_logits, state, context = model_next_token_logits(
        model, params, inputs, max_length, use_cache=use_cache, copies=beam_size
    )
    tokens, scores = beam_search_loop(
        next_token_logits,
        state,
        is_filler(inputs, pad_id),
        beam_size=beam_size,
        alpha=alpha,
        max_length=max_length,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        budgets=budgets,
        context=context,
        settled=beam_size if return_all else 1,
    )
    return (tokens, scores) if return_all else tokens[:, 0]


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
