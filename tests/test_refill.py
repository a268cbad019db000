"""Rows refilled as sentences finish translate every sentence as whole-batch decoding does."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL

from models import Transformer, refill
from models.decoding import beam_search, decode_length, generate
from models.search import argmax_token
from training.tasks import translation_eval

BOS, EOS, PAD = 2, 3, 0
_IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)
ROWS, SOURCE_LENGTH = 4, 6


def _model_and_batches(num_sentences: int = 10):
    config = dataclasses.replace(TINY_MODEL, vocab_size=12, max_len=32, norm_placement="pre")
    model = Transformer(config)
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, SOURCE_LENGTH + 1, num_sentences)  # With <eos>.
    sources = np.zeros((num_sentences, SOURCE_LENGTH), np.int32)
    for i, length in enumerate(lengths):
        sources[i, : length - 1] = rng.integers(4, config.vocab_size, length - 1)
        sources[i, length - 1] = EOS
    params = nn.unbox(model.init(jax.random.PRNGKey(1), sources[:2], sources[:2], deterministic=True)["params"])
    # Larger weights: outputs that depend on the source, and <eos> now early, now never (budgets matter).
    params = jax.tree.map(lambda x: 4.0 * x, params)
    batches = []
    for start in range(0, num_sentences, ROWS):
        ids = np.arange(start, min(start + ROWS, num_sentences))
        inputs = np.zeros((ROWS, SOURCE_LENGTH), np.int32)  # The last batch has filler rows.
        inputs[: len(ids)] = sources[ids]
        batches.append((inputs, decode_length(np.sum(inputs != PAD, axis=1), 20), ids))
    return model, params, batches


def _whole_batches(model, params, batches, max_length, beam_size):
    if beam_size == 1:
        search = functools.partial(generate, model=model, choose_token=argmax_token, **_IDS)
    else:
        search = functools.partial(beam_search, model=model, beam_size=beam_size, alpha=0.6, **_IDS)
    decode = jax.jit(search, static_argnames=("max_length",))
    outputs = {}
    for inputs, budgets, ids in batches:
        decoded = np.asarray(decode(params, inputs, max_length=max_length, budgets=budgets))
        outputs.update(zip(ids.tolist(), decoded))
    return outputs


def _decoder(model, beam_size):
    if beam_size == 1:
        return refill.greedy_decoder(model, **_IDS)
    return refill.beam_decoder(model, beam_size=beam_size, alpha=0.6, **_IDS)


def _place(inputs, budgets):
    return jnp.asarray(inputs), jnp.asarray(budgets)


def _refilled(decoder, params, batches, max_length):
    return dict(
        refill.decode_batches(decoder, params, iter(batches), max_length=max_length, place=_place, fetch=np.asarray)
    )


def _assert_same_outputs(found, expected):
    assert sorted(found) == sorted(expected)  # Every sentence once.
    for sentence, output in expected.items():
        np.testing.assert_array_equal(found[sentence], output, err_msg=f"sentence {sentence}")


@pytest.mark.parametrize("beam_size", [1, 3])
@pytest.mark.parametrize("refill_share", [0.01, 0.5, 1.0])
def test_refilled_rows_translate_as_whole_batches(beam_size, refill_share, monkeypatch):
    """At any refill point (a row at a time, half the rows, only when all are done), the same outputs."""
    monkeypatch.setattr(refill, "REFILL_SHARE", refill_share)
    model, params, batches = _model_and_batches()
    max_length = decode_length(SOURCE_LENGTH, 20)
    expected = _whole_batches(model, params, batches, max_length, beam_size)
    _assert_same_outputs(_refilled(_decoder(model, beam_size), params, batches, max_length), expected)
    lengths = [np.count_nonzero(output != PAD) for output in expected.values()]
    assert len(set(lengths)) > 2, lengths  # Sentences end at different steps: rows are refilled at different times.


@pytest.fixture(params=[1, 3], ids=["greedy", "beam3"])
def shrinking(request, monkeypatch):
    """(beam size, model, params, batches, max_length, decoder), rows halved down to one once no sentence waits."""
    monkeypatch.setattr(refill, "SHRINK", 2)
    monkeypatch.setattr(refill, "MIN_ROWS", 1)
    model, params, batches = _model_and_batches()
    return request.param, model, params, batches, decode_length(SOURCE_LENGTH, 20), _decoder(model, request.param)


def test_the_last_sentences_move_to_fewer_rows_and_translate_as_whole_batches(shrinking):
    """Without sentences left to start, the live rows move to a half, then a quarter of the rows: the same outputs."""
    beam_size, model, params, batches, max_length, decoder = shrinking
    expected = _whole_batches(model, params, batches, max_length, beam_size)
    row_counts = []

    def take(search, source):
        row_counts.append(len(source))
        return decoder.take(search, source)

    found = _refilled(dataclasses.replace(decoder, take=take), params, batches, max_length)
    _assert_same_outputs(found, expected)
    assert row_counts == [ROWS // 2, ROWS // 4], row_counts


def test_compiling_ahead_compiles_every_program_decoding_then_runs(shrinking):
    """After `compile_ahead` on filler rows of the batches' shape, decoding them (rows shrinking) compiles nothing."""
    _, _, params, batches, max_length, decoder = shrinking
    inputs, budgets, _ = batches[0]
    refill.compile_ahead(decoder, params, [(np.full_like(inputs, PAD), budgets, max_length)], place=_place)
    programs = ("start", "insert", "run", "take")
    compiled = {name: getattr(decoder, name)._cache_size() for name in programs}
    assert all(compiled.values()), compiled
    _refilled(decoder, params, batches, max_length)
    assert {name: getattr(decoder, name)._cache_size() for name in programs} == compiled


def test_decoding_compiles_ahead_in_a_thread_in_one_process_on_cpus_only():
    """A GPU's first run of a loop records a CUDA graph, which a second thread's runs broke on an H100."""
    assert translation_eval.compiles_ahead_in_a_thread("cpu", process_count=1)
    for platform, process_count in (("gpu", 1), ("tpu", 1), ("cpu", 2)):
        assert not translation_eval.compiles_ahead_in_a_thread(platform, process_count)
