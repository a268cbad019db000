"""Translating a batch with the Transformer: one hypothesis a row (greedy or sampled) or beam search.

The encoder runs once per batch, cross-attention keys and values once per sentence, and each step runs the
decoder for one new position only (`Transformer.decode_step`). With `use_cache=False` the decoder reruns over
the whole prefix at every step: the reference the cached path is tested against. The loops are in
models/search.py and models/beam_search.py; decoding many batches, in models/continuous_batching.py. Outputs
are [batch, max_length] int32 ids, each row ending at its first <eos> (included) and padded after it, or cut
at its budget (`decode_length` of its own source, at most `max_length`) without one.
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


def source_context(model: Transformer, params: Any, inputs: Array) -> dict:
    """What the cached decoder reads of the sources [batch, src_len]: {'inputs': the ids, 'cross': the cross-attention
    keys and values, per layer [batch, heads, src_len, d]}, once a source whatever its hypotheses."""
    variables = {'params': params}
    encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)
    return {'inputs': inputs, 'cross': model.apply(variables, encoded, method=Transformer.cross_cache)}


def model_next_token_logits(
    model: Transformer, params: Any, inputs: Array, max_length: int, *, use_cache: bool, copies: int = 1
) -> tuple[NextTokenLogits, Any, Any]:
    """(next_token_logits, state, context): the model as a `NextTokenLogits` function over batch * copies rows (the
    copies of source b, e.g. its beams, being rows b * copies + j) that generate up to max_length tokens.

    use_cache: run the decoder for the new position only, on the self-attention cache (the state) and the
    sources' cross-attention keys and values (`source_context`); False reruns it on the whole prefix at every
    step, the sources and their encodings repeated for every copy.
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

    context: `source_context`'s, whose part of the cache no step changes (nor beam search reorders).
    """
    last = jnp.take_along_axis(tokens, positions[:, None], axis=1)  # [rows, 1]
    cache = {layer: {**self_cache[layer], **context['cross'][layer]} for layer in self_cache}
    logits, cache = model.apply(
        {'params': params}, context['inputs'], last, positions, cache, method=Transformer.decode_step
    )
    return logits, {layer: {name: cache[layer][name] for name in self_cache[layer]} for layer in self_cache}


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
    """[batch, max_length] int32 ids: a batch of sources [batch, src_len] translated a token a step, each picked by
    `choose_token` (`argmax_token`, or `sampled_token(temperature, top_k)` drawing step i from fold_in(rng, i):
    the same key, the same translations). budgets: [batch] int, the most tokens of each row, e.g.
    `decode_length` of each source's length (None: max_length, static, for every row)."""
    next_token_logits, state, context = model_next_token_logits(model, params, inputs, max_length, use_cache=use_cache)
    loop = dict(max_length=max_length, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, budgets=budgets, context=context)
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return search_loop(next_token_logits, choose_token, state, is_filler(inputs, pad_id), rng, **loop)


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
    """[batch, max_length] int32 ids of each source's best hypothesis by beam search with GNMT's length penalty
    (alpha: 0.6 in the paper; beam_size 1 with alpha 0 is greedy decoding); with return_all, every finished
    hypothesis [batch, beam_size, max_length] best first and their scores [batch, beam_size] instead. The other
    arguments are `generate`'s."""
    next_token_logits, state, context = model_next_token_logits(
        model, params, inputs, max_length, use_cache=use_cache, copies=beam_size
    )
    loop = dict(max_length=max_length, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, budgets=budgets, context=context)
    settled = beam_size if return_all else 1
    tokens, scores = beam_search_loop(
        next_token_logits, state, is_filler(inputs, pad_id), beam_size=beam_size, alpha=alpha, settled=settled, **loop
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
