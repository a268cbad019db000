"""The contract between a search and the scheduler (models/search.py), held for greedy search, beam search and sampling.

A new search is added to SEARCHES and must pass these tests as they stand (docs/decoding.md#adding-a-search).
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL, on_one_device

from models import Transformer
from models import continuous_batching as batching
from models.beam_search import Beams, BeamSearch
from models.decoding import decode_length
from models.search import Axis, SpecialIds, row_field, search_rows
from models.token_search import TokenSearch, argmax_token, sampled_token

BOS, EOS, PAD = 2, 3, 0
SPECIAL = SpecialIds(bos=BOS, eos=EOS, pad=PAD)
SEARCHES = {
    "greedy": TokenSearch(argmax_token, SPECIAL),
    "beam 3": BeamSearch(3, 0.6, SPECIAL),
    "sampling": TokenSearch(sampled_token(1.0), SPECIAL, seed=3),
}
VOCAB, MAX_DECODE_LENGTH = 12, 48  # Stages of 16 and 8 source ids: 40 and 24 output tokens.


def _markov_logits(seed=0):
    """Next-token logits of each row's own Markov chain over the vocabulary (the context holds each hypothesis'
    row), <eos> rarer than the rest: rows end at many different steps, some only at their budget."""
    table = np.random.default_rng(seed).normal(size=(64, VOCAB, VOCAB)).astype(np.float32) * 3.0
    table[:, :, EOS] -= 2.0
    table = jnp.asarray(table)

    def next_token_logits(positions, tokens, cache, row):
        return table[row, jnp.take_along_axis(tokens, positions[:, None], axis=1)[:, 0]], cache

    return next_token_logits


@pytest.mark.parametrize("name", SEARCHES)
def test_zero_rows_are_done_and_done_never_turns_false_nor_best_changes_once_done(name):
    search, rows, max_length = SEARCHES[name], 48, 16
    budgets = np.random.default_rng(1).integers(0, max_length + 1, rows).astype(np.int32)  # Some 0: no sentence.
    state = search.fresh(jnp.arange(rows, dtype=jnp.int32), jnp.asarray(budgets), max_length=max_length)
    assert np.all(search.done(jax.tree.map(jnp.zeros_like, state)))  # The scheduler's free rows.
    run = jax.jit(functools.partial(search.run, _markov_logits()))
    context = jnp.repeat(jnp.arange(rows), search.copies)
    done, best = np.asarray(search.done(state)), np.asarray(search.best(state))
    np.testing.assert_array_equal(done, budgets == 0)
    for min_done in [*range(1, rows, 5), rows]:  # Each run stops as soon as min_done rows are done.
        state, _ = run(state, (), context, min_done=min_done)
        now, best_now = np.asarray(search.done(state)), np.asarray(search.best(state))
        assert np.all(now[done]), f"done turned false in rows {np.flatnonzero(done & ~now)}"
        np.testing.assert_array_equal(best_now[done], best[done])
        assert np.sum(now) >= min_done
        done, best = now, best_now
    assert np.all(done) and len({int(np.count_nonzero(b != PAD)) for b in best}) > 4  # Rows ended apart.


@pytest.fixture(scope="module")
def model_and_params():
    """Two layers a side: narrowing cuts every layer's cache, and the narrowing test is the one that sees a layer's
    cut wrong (test_continuous_batching passes with it)."""
    model = Transformer(dataclasses.replace(TINY_MODEL, vocab_size=VOCAB, max_len=64, norm_placement="pre"))
    dummy = jnp.zeros((1, 8), jnp.int32)
    params = nn.unbox(model.init(jax.random.PRNGKey(1), dummy, dummy, deterministic=True)["params"])
    return model, jax.tree.map(lambda x: 4.0 * x, params)  # Outputs that depend on the source.


@pytest.fixture(scope="module")
def decoders(model_and_params) -> dict:
    """A decoder per search, shared: the narrowing test runs the programs of the stages AMONG_OTHERS decodes in."""
    return {name: batching.row_decoder(model_and_params[0], search) for name, search in SEARCHES.items()}


def _sources(count, seed=0, longest=16):
    rng = np.random.default_rng(seed)
    return {i: np.append(rng.integers(4, VOCAB, rng.integers(1, longest)), EOS).astype(np.int32) for i in range(count)}


ROWS = {8: 6, 16: 4}
AMONG_OTHERS = _sources(20, seed=2)  # Decoded in a stage of 4 rows of 16 ids, narrowed to 6 rows of 8.


def _decode(decoder, params, sources, rows=ROWS):
    found = batching.decode_sentences(
        decoder, params, sources, rows=rows, max_decode_length=MAX_DECODE_LENGTH, place=on_one_device, fetch=np.asarray
    )
    return dict(found)


def _block(sources: dict, rows: int, source_length: int, max_length: int) -> batching.Block:
    """`sources` in the first of `rows` rows of `source_length` ids (the rest no sentence), budgets capped at
    max_length."""
    inputs = np.zeros((rows, source_length), np.int32)
    budgets = np.zeros(rows, np.int32)
    sentences = np.full(rows, batching.NO_SENTENCE, np.int32)
    for row, (sentence, ids) in enumerate(sources.items()):
        inputs[row, : len(ids)], budgets[row], sentences[row] = ids, decode_length(len(ids), max_length), sentence
    return batching.Block(inputs, budgets, sentences)


@pytest.mark.parametrize("name", SEARCHES)
def test_narrowing_keeps_every_rows_done_and_best_and_adds_free_rows(name, model_and_params, decoders):
    search, decoder, (_, params) = SEARCHES[name], decoders[name], model_and_params
    wide, narrow = batching.stages_of(np.array([len(ids) for ids in AMONG_OTHERS.values()]), ROWS, 1, MAX_DECODE_LENGTH)
    assert (wide.rows, narrow.rows) == (4, 6)  # AMONG_OTHERS's stages: the four sentences below fill the wide one.
    sentences = list(_sources(4, longest=8).items())  # Each fits the narrow stage, and its budget its outputs.
    place = on_one_device
    decoding = decoder.empty(params, wide.rows, wide.source_length, wide.max_length, place)
    # Admitted a block at a time: free rows are done, so no step runs until all four rows are live.
    for first in range(0, len(sentences), wide.block_rows):
        admitted = dict(sentences[first : first + wide.block_rows])
        block = _block(admitted, wide.block_rows, wide.source_length, narrow.max_length)
        decoding, _ = decoder.advance(params, decoding, place(block), 1, layout=None)
    done, best = np.asarray(search.done(decoding.rows)), np.asarray(search.best(decoding.rows))
    assert 0 < np.sum(done[:4]) < 4  # Some rows done, some live: both kinds are narrowed.
    narrowed = decoder.narrow(decoding, stage=narrow, layout=None)
    added = narrow.rows - wide.rows
    np.testing.assert_array_equal(np.asarray(search.done(narrowed.rows)), np.append(done, [True] * added))
    np.testing.assert_array_equal(np.asarray(search.best(narrowed.rows))[: wide.rows], best[:, : narrow.max_length])
    assert np.all(best[:, narrow.max_length :] == PAD)
    np.testing.assert_array_equal(narrowed.sentences, [0, 1, 2, 3] + [batching.NO_SENTENCE] * added)
    # Decoded on to the end, narrowed or not: the same outputs.
    outputs = []
    for stage, state in ((narrow, narrowed), (wide, decoding)):
        nothing = _block({}, stage.block_rows, stage.source_length, 0)
        state, _ = decoder.advance(params, state, place(nothing), stage.rows, layout=None)
        outputs.append(np.asarray(search.best(state.rows))[:4, : narrow.max_length])
    np.testing.assert_array_equal(*outputs)
    assert len({int(np.count_nonzero(row != PAD)) for row in outputs[0]}) > 1


@pytest.mark.parametrize("name", SEARCHES)
def test_a_sentence_translates_alone_as_among_others(name, model_and_params, decoders):
    """Its own budget, and for sampling its own key (its number): not its neighbours, row or time of admission."""
    (_, params), sources, decoder = model_and_params, AMONG_OTHERS, decoders[name]
    among_others = _decode(decoder, params, sources)
    for sentence in (0, 7, 19):
        alone = _decode(decoder, params, {sentence: sources[sentence]})
        np.testing.assert_array_equal(alone[sentence], among_others[sentence][: len(alone[sentence])])
    if name == "sampling":  # Another sentence number draws another sample.
        renumbered = _decode(decoder, params, {i + 100: ids for i, ids in sources.items()})
        assert any(not np.array_equal(renumbered[i + 100], among_others[i]) for i in sources)


@search_rows
class _MisfitBeams(Beams):
    """Beams with a field a hypothesis, [rows * copies], declared as a sentence's."""

    per_hypothesis: jax.Array = row_field(Axis.ROWS)


@dataclasses.dataclass(frozen=True)
class _MisfitBeamSearch(BeamSearch):
    def fresh(self, sentences, budgets, *, max_length):
        beams = super().fresh(sentences, budgets, max_length=max_length)
        fields = {field.name: getattr(beams, field.name) for field in dataclasses.fields(beams)}
        return _MisfitBeams(**fields, per_hypothesis=jnp.zeros(len(budgets) * self.copies))


def test_a_field_that_does_not_have_its_declared_row_axis_is_refused_by_name(model_and_params):
    model, params = model_and_params
    expected = (
        r"^Search field 'per_hypothesis' declares rows \(4,\) for 4 rows of 3 copies, but holds a leaf of shape \(12,\)"
    )
    with pytest.raises(ValueError, match=expected):
        _decode(batching.row_decoder(model, _MisfitBeamSearch(3, 0.6, SPECIAL)), params, _sources(3), rows={16: 4})
