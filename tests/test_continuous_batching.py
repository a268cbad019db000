"""Continuous batching translates every sentence as decoding it alone does, in a few programs."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL

from models import Transformer
from models import continuous_batching as batching
from models.decoding import beam_search, decode_length, generate
from models.search import argmax_token

BOS, EOS, PAD = 2, 3, 0
_IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)
BOUNDARIES = (8, 16, 24, 32)  # Stages of 32, 16 and 8 source ids.
MAX_DECODE_LENGTH = 40
ROWS = {8: 8, 16: 6, 24: 5, 32: 4}  # Shorter stages decode more rows.
BEAM_SIZES = (1, 3)


def _sources(count: int, rng: np.random.Generator, longest: int = 32) -> list[np.ndarray]:
    lengths = rng.integers(2, longest + 1, count)
    return [np.append(rng.integers(4, 12, length - 1), EOS).astype(np.int32) for length in lengths]


@pytest.fixture(scope="module")
def setting():
    """(model, params, sources, {beam size: each source's output in one whole batch}), shared by the tests.

    In the whole batch each source is padded to the longest and has its own budget: what it decodes alone
    (tests/test_decoding.py), whatever its row and the batch's lengths.
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
    alone = {}
    for beam_size in BEAM_SIZES:
        if beam_size == 1:
            search = functools.partial(generate, model=model, choose_token=argmax_token, **_IDS)
        else:
            search = functools.partial(beam_search, model=model, beam_size=beam_size, alpha=0.6, **_IDS)
        decoded = search(params, inputs, max_length=MAX_DECODE_LENGTH, budgets=budgets)
        alone[beam_size] = [output[:budget] for output, budget in zip(np.asarray(decoded), budgets)]
    return model, params, sources, alone


def _decoder(model, beam_size):
    if beam_size == 1:
        return batching.row_decoder(model, batching.greedy_search(**_IDS), pad_id=PAD)
    return batching.row_decoder(model, batching.beam_search(beam_size=beam_size, alpha=0.6, **_IDS), pad_id=PAD)


@pytest.fixture(scope="module")
def decoders(setting) -> dict:
    """A decoder per beam size, compiled once for the tests that do not count its programs."""
    model = setting[0]
    return {beam_size: _decoder(model, beam_size) for beam_size in BEAM_SIZES}


def _decode(decoder, params, sources, refill_share, monkeypatch):
    monkeypatch.setattr(batching, "REFILL_SHARE", refill_share)  # Read between the compiled programs.
    place = functools.partial(jax.tree.map, jnp.asarray)
    outputs = batching.decode_sentences(
        decoder, params, sources, rows=ROWS, max_decode_length=MAX_DECODE_LENGTH, place=place, fetch=np.asarray
    )
    return dict(outputs)


@pytest.mark.parametrize("beam_size", BEAM_SIZES)
@pytest.mark.parametrize("refill_share", [0.01, 1.0])
def test_refilled_rows_translate_each_sentence_as_decoding_it_alone(
    setting, decoders, beam_size, refill_share, monkeypatch
):
    """Whatever the rows beside it, its stage, or when rows are refilled (a row at a time, or all at once)."""
    _, params, sources, alone = setting
    found = _decode(decoders[beam_size], params, sources, refill_share, monkeypatch)
    assert sorted(found) == list(range(len(sources)))  # Every sentence once.
    for sentence, expected in enumerate(alone[beam_size]):
        np.testing.assert_array_equal(found[sentence][: len(expected)], expected, err_msg=f"sentence {sentence}")
        assert np.all(found[sentence][len(expected) :] == PAD)
    lengths = [np.count_nonzero(output != PAD) for output in alone[beam_size]]
    assert len(set(lengths)) > 3, lengths  # Sentences end at different steps: rows are refilled at different times.


def test_the_host_reads_each_call_once_while_the_next_one_runs(setting, decoders, monkeypatch):
    """On an accelerator a fetch waits for the device: the report of call i is fetched after call i + 1 is
    dispatched, in one transfer (the device picks the rows, so the next block needs nothing of it)."""
    _, params, sources, _ = setting
    events = []
    decoder = decoders[1]

    def advance(*args, **kwargs):
        events.append("advance")
        return decoder.advance(*args, **kwargs)

    def fetch(array):
        events.append("fetch")
        return np.asarray(array)

    monkeypatch.setattr(batching, "REFILL_SHARE", 0.25)
    place = functools.partial(jax.tree.map, jnp.asarray)
    found = dict(
        batching.decode_sentences(
            dataclasses.replace(decoder, advance=advance),
            params,
            sources,
            rows=ROWS,
            max_decode_length=MAX_DECODE_LENGTH,
            place=place,
            fetch=fetch,
        )
    )
    assert sorted(found) == list(range(len(sources)))
    calls = events.count("advance")
    assert calls > 5 and events == ["advance"] + ["advance", "fetch"] * (calls - 1) + ["fetch"], events


@pytest.mark.parametrize("beam_size", BEAM_SIZES)
def test_sentences_of_every_length_compile_one_program_a_stage_and_one_a_narrowing(setting, beam_size, monkeypatch):
    model, params, sources, _ = setting
    decoder = _decoder(model, beam_size)  # Its own: the test counts its compiled programs.
    assert batching.stage_lengths(np.array([len(source) for source in sources]), BOUNDARIES) == [32, 16, 8]
    for subset in (sources, sources[::2], sources[::-1]):  # Other sentences, other refill points.
        _decode(decoder, params, subset, 0.25, monkeypatch)
        # A stage is entered once every sentence left fits it: the last may never be, its tail run in the one before.
        programs = (decoder.advance._cache_size(), decoder.narrow._cache_size())
        assert programs in ((2, 1), (3, 2)), programs


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
    assert _decode(decoders[1], params, [], 0.25, monkeypatch) == {}
