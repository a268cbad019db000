"""Continuous batching translates every sentence as decoding it alone does, in a few programs."""

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
from models.beam_search import BeamSearch
from models.decoding import decode_batch, decode_length
from models.search import SpecialIds
from models.token_search import TokenSearch, argmax_token, sampled_token

BOS, EOS, PAD = 2, 3, 0
SPECIAL = SpecialIds(bos=BOS, eos=EOS, pad=PAD)
BOUNDARIES = (8, 16, 24, 32)  # Stages of 32, 16 and 8 source ids.
MAX_DECODE_LENGTH = 40
ROWS = {8: 8, 16: 6, 24: 5, 32: 4}  # Shorter stages decode more rows.
BEAM_SIZES = (1, 3)
SEARCHES = {  # By name: greedy, beam search and sampling, each decoded alone and in refilled rows.
    "greedy": TokenSearch(argmax_token, SPECIAL),
    "beam 3": BeamSearch(3, 0.6, SPECIAL),
    "sampling": TokenSearch(sampled_token(1.0, top_k=5), SPECIAL, seed=7),
}


def _sources(count: int, rng: np.random.Generator, longest: int = 32) -> list[np.ndarray]:
    lengths = rng.integers(2, longest + 1, count)
    return [np.append(rng.integers(4, 12, length - 1), EOS).astype(np.int32) for length in lengths]


@pytest.fixture(scope="module")
def setting():
    """(model, params, sources, alone), shared by the tests: alone(search) is each source's output in one whole
    batch, decoded when a test first asks for that search (a program a search, not all three in the first test).

    In the whole batch each source is padded to the longest and has its own budget and key: what it decodes
    alone (tests/test_decoding.py), whatever its row and the batch's lengths.
    """
    model = Transformer(dataclasses.replace(TINY_MODEL, vocab_size=12, max_len=64, norm_placement="pre"))
    sources = _sources(30, np.random.default_rng(0))
    dummy = jnp.zeros((1, 8), jnp.int32)
    params = nn.unbox(model.init(jax.random.PRNGKey(1), dummy, dummy, deterministic=True)["params"])
    # Larger weights: outputs that depend on the source, and <eos> now early, now never (budgets matter).
    params = jax.tree.map(lambda x: 4.0 * x, params)
    inputs = np.zeros((len(sources), BOUNDARIES[-1]), np.int32)
    for row, source in zip(inputs, sources):
        row[: len(source)] = source
    budgets = decode_length(np.array([len(source) for source in sources]), MAX_DECODE_LENGTH)

    @functools.cache
    def alone(name: str) -> list[np.ndarray]:
        search = SEARCHES[name]
        decode = functools.partial(decode_batch, search, model, max_length=MAX_DECODE_LENGTH, budgets=budgets)
        decoded = search.best(jax.jit(decode)(params, inputs))
        return [output[:budget] for output, budget in zip(np.asarray(decoded), budgets)]

    return model, params, sources, alone


@pytest.fixture(scope="module")
def decoders(setting) -> dict:
    """A decoder per search, compiled once for the tests that do not count its programs."""
    return {name: batching.row_decoder(setting[0], search) for name, search in SEARCHES.items()}


def _decode(decoder, params, sources, refill_share, monkeypatch, rows=ROWS):
    monkeypatch.setattr(batching, "REFILL_SHARE", refill_share)  # Read between the compiled programs.
    place = on_one_device
    outputs = batching.decode_sentences(
        decoder, params, sources, rows=rows, max_decode_length=MAX_DECODE_LENGTH, place=place, fetch=np.asarray
    )
    return dict(outputs)


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("refill_share", [0.01, 1.0])
def test_refilled_rows_translate_each_sentence_as_decoding_it_alone(
    setting, decoders, search, refill_share, monkeypatch
):
    """Whatever the rows beside it, its stage, or when rows are refilled (a row at a time, or all at once); a
    sampled sentence draws from its own key, whatever its row."""
    _, params, sources, alone = setting
    found = _decode(decoders[search], params, dict(enumerate(sources)), refill_share, monkeypatch)
    assert sorted(found) == list(range(len(sources)))  # Every sentence once.
    for sentence, expected in enumerate(alone(search)):
        np.testing.assert_array_equal(found[sentence][: len(expected)], expected, err_msg=f"sentence {sentence}")
        assert np.all(found[sentence][len(expected) :] == PAD)
    lengths = [np.count_nonzero(output != PAD) for output in alone(search)]
    assert len(set(lengths)) > 3, lengths  # Sentences end at different steps: rows are refilled at different times.


def test_the_host_reads_each_call_once_while_the_next_one_runs(setting, decoders, monkeypatch):
    """On an accelerator a fetch waits for the device: the report of call i is fetched after call i + 1 is
    dispatched, in one transfer (the device picks the rows, so the next block needs nothing of it)."""
    _, params, sources, _ = setting
    events = []
    decoder = decoders["greedy"]

    def advance(*args, **kwargs):
        events.append("advance")
        return decoder.advance(*args, **kwargs)

    def fetch(array):
        events.append("fetch")
        return np.asarray(array)

    monkeypatch.setattr(batching, "REFILL_SHARE", 0.25)
    place = on_one_device
    found = dict(
        batching.decode_sentences(
            dataclasses.replace(decoder, advance=advance),
            params,
            dict(enumerate(sources)),
            rows=ROWS,
            max_decode_length=MAX_DECODE_LENGTH,
            place=place,
            fetch=fetch,
        )
    )
    assert sorted(found) == list(range(len(sources)))
    calls = events.count("advance")
    assert calls > 5 and events == ["advance"] + ["advance", "fetch"] * (calls - 1) + ["fetch"], events


@pytest.mark.parametrize("search", ["greedy", "beam 3"])
def test_sentences_of_every_length_compile_one_program_a_stage_and_one_a_narrowing(setting, search, monkeypatch):
    model, params, sources, _ = setting
    decoder = batching.row_decoder(model, SEARCHES[search])  # Its own: the test counts its compiled programs.
    assert batching.stage_lengths(np.array([len(source) for source in sources]), BOUNDARIES) == [32, 16, 8]
    entered, narrowings = set(), set()  # Stages decoded in; (from, to) stages narrowed between.

    def narrow(decoding, *, stage, layout):
        narrowings.add((decoding.sentences.shape[0], decoding.context["inputs"].shape[1], stage))
        entered.add(stage)
        return decoder.narrow(decoding, stage=stage, layout=layout)

    recording = dataclasses.replace(decoder, narrow=narrow)
    for subset in (sources, sources[::2], sources[::-1]):  # Other sentences, other refill points.
        found = _decode(recording, params, dict(enumerate(subset)), 0.25, monkeypatch)
        assert len(found) == len(subset)
        lengths = np.array([len(source) for source in subset])
        entered.add(batching.stages_of(lengths, ROWS, 1, MAX_DECODE_LENGTH)[0])
        # A stage is entered once every sentence left fits it: the last may never be, its tail run in the one before.
        assert (decoder.advance._cache_size(), decoder.narrow._cache_size()) == (len(entered), len(narrowings))
    assert len(entered) >= 2 and narrowings  # The test saw narrowing.


def test_a_stage_has_no_more_rows_than_its_sentences_need():
    """Rows are capped by the sentences a stage can hold, rounded up to a power of two of the row multiple."""
    lengths = np.array([30, 12, 12, 5, 4, 3])
    stages = batching.stages_of(lengths, {8: 64, 16: 32, 32: 16}, row_multiple=2, max_decode_length=40)
    assert [(stage.source_length, stage.rows) for stage in stages] == [(32, 8), (16, 8), (8, 8)]
    one = batching.stages_of(np.array([7]), {8: 512, 16: 256}, row_multiple=1, max_decode_length=40)
    assert [(stage.rows, stage.block_rows) for stage in one] == [(1, 1)]
    many = batching.stages_of(np.full(1000, 7), {8: 512, 16: 256}, row_multiple=1, max_decode_length=40)
    assert [stage.rows for stage in many] == [512]


def test_a_source_longer_than_the_longest_stage_is_refused_by_name(setting, decoders, monkeypatch):
    _, params, sources, _ = setting
    too_long = {0: sources[0], 5: np.append(np.full(40, 4, np.int32), EOS)}
    with pytest.raises(ValueError, match=r"^Sentence 5 has 41 source ids, more than the longest stage takes \(32\)"):
        _decode(decoders["greedy"], params, too_long, 0.25, monkeypatch)


def test_stages_halve_the_source_length_from_the_longest_sources_bucket():
    lengths = np.array([3, 5, 9, 30])
    assert batching.stage_lengths(lengths, (8, 16, 24, 32, 48, 64)) == [32, 16, 8]
    assert batching.stage_lengths(lengths, (8, 64)) == [64, 8]  # Boundaries at most half the last.
    assert batching.stage_lengths(np.array([20, 30]), (8, 16, 24, 32)) == [32]  # No source fits 16.
    assert batching.stage_lengths(np.array([4, 5]), (8, 16, 24, 32)) == [8]
    many = np.arange(1, 257)
    assert len(batching.stage_lengths(many, (2, 4, 8, 16, 32, 64, 128, 256))) == batching.MAX_STAGES


def test_no_sentence_decodes_nothing(setting, decoders, monkeypatch):
    _, params, _, _ = setting
    assert _decode(decoders["greedy"], params, {}, 0.25, monkeypatch) == {}
