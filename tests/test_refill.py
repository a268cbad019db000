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
from models.beam_search import beams_done
from models.decoding import beam_search, decode_length, generate
from models.search import argmax_token
from training.tasks import translation_eval

BOS, EOS, PAD = 2, 3, 0
_IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)
# Two buckets of source lengths (with <eos>): the second's batches have fewer rows, as batches of
# about the same number of tokens do, and longer outputs.
BUCKETS = ((8, 4, 5), (16, 2, 10))  # (source length, rows, shortest source) of each.
MAX_DECODE_LENGTH = 32


def _model_and_batches(sentences_per_bucket: int = 9) -> tuple[Transformer, dict, list[refill.SourceBatch]]:
    config = dataclasses.replace(TINY_MODEL, vocab_size=12, max_len=64, norm_placement="pre")
    model = Transformer(config)
    rng = np.random.default_rng(0)
    batches, sentence = [], 0
    for source_length, rows, shortest in BUCKETS:
        sources = np.zeros((sentences_per_bucket, source_length), np.int32)
        for source, length in zip(sources, rng.integers(shortest, source_length + 1, sentences_per_bucket)):
            source[: length - 1] = rng.integers(4, config.vocab_size, length - 1)
            source[length - 1] = EOS
        max_length = decode_length(source_length, MAX_DECODE_LENGTH)
        for start in range(0, sentences_per_bucket, rows):
            ids = np.arange(start, min(start + rows, sentences_per_bucket))
            inputs = np.zeros((rows, source_length), np.int32)  # The last batch has filler rows.
            inputs[: len(ids)] = sources[ids]
            budgets = decode_length(np.sum(inputs != PAD, axis=1), MAX_DECODE_LENGTH)
            batches.append(refill.SourceBatch(inputs, budgets, sentence + ids, max_length))
        sentence += sentences_per_bucket
    params = nn.unbox(model.init(jax.random.PRNGKey(1), sources[:2], sources[:2], deterministic=True)["params"])
    # Larger weights: outputs that depend on the source, and <eos> now early, now never (budgets matter).
    params = jax.tree.map(lambda x: 4.0 * x, params)
    return model, params, batches


def _whole_batches(model, params, batches, beam_size):
    if beam_size == 1:
        search = functools.partial(generate, model=model, choose_token=argmax_token, **_IDS)
    else:
        search = functools.partial(beam_search, model=model, beam_size=beam_size, alpha=0.6, **_IDS)
    decode = jax.jit(search, static_argnames=("max_length",))
    outputs = {}
    for inputs, budgets, ids, max_length in batches:
        decoded = np.asarray(decode(params, inputs, max_length=max_length, budgets=budgets))
        outputs.update(zip(ids.tolist(), decoded))
    return outputs


def _decoder(model, beam_size):
    if beam_size == 1:
        return refill.greedy_decoder(model, **_IDS)
    return refill.beam_decoder(model, beam_size=beam_size, alpha=0.6, **_IDS)


def _place(inputs, budgets):
    return jnp.asarray(inputs), jnp.asarray(budgets)


def _refilled(decoder, params, batches):
    return dict(refill.decode_batches(decoder, params, iter(batches), place=_place, fetch=np.asarray))


def _assert_same_outputs(found, expected):
    assert sorted(found) == sorted(expected)  # Every sentence once.
    for sentence, output in expected.items():
        # A sentence that started in a shorter bucket's rows has padding up to a later bucket's length.
        np.testing.assert_array_equal(found[sentence][: len(output)], output, err_msg=f"sentence {sentence}")
        assert np.all(found[sentence][len(output) :] == PAD)


BEAM_SIZES = (1, 3)


@pytest.fixture(scope="module")
def setting():
    """(model, params, batches, {beam size: whole-batch outputs}, {beam size: decoder}), shared by the tests.

    The refill constants the tests change act in Python, between the compiled programs.
    """
    model, params, batches = _model_and_batches()
    expected = {beam_size: _whole_batches(model, params, batches, beam_size) for beam_size in BEAM_SIZES}
    decoders = {beam_size: _decoder(model, beam_size) for beam_size in BEAM_SIZES}
    return model, params, batches, expected, decoders


@pytest.mark.parametrize("beam_size", BEAM_SIZES)
@pytest.mark.parametrize("refill_share", [0.01, 0.5, 1.0])
def test_refilled_rows_translate_as_whole_batches(setting, beam_size, refill_share, monkeypatch):
    """At any refill point (a row at a time, half the rows, only when all are done), the same outputs."""
    monkeypatch.setattr(refill, "REFILL_SHARE", refill_share)
    _, params, batches, expected, decoders = setting
    _assert_same_outputs(_refilled(decoders[beam_size], params, batches), expected[beam_size])
    lengths = [np.count_nonzero(output != PAD) for output in expected[beam_size].values()]
    assert len(set(lengths)) > 2, lengths  # Sentences end at different steps: rows are refilled at different times.


@pytest.mark.parametrize("beam_size", BEAM_SIZES)
def test_a_buckets_last_sentences_move_on_to_the_next_buckets_rows_and_translate_as_whole_batches(setting, beam_size):
    """The rows move on to the second bucket's shapes and fewer rows once as many are live, sentences and all."""
    _, params, batches, expected, decoders = setting
    decoder = decoders[beam_size]
    moved = []  # (rows, source length, max_length, live rows) at each move.

    def widen(search, *, source_length, max_length):
        live = ~(search.finished if beam_size == 1 else beams_done(search, 0.6, settled=1))
        moved.append((search.budgets.shape[0], source_length, max_length, int(np.sum(live))))
        return decoder.widen(search, source_length=source_length, max_length=max_length)

    found = _refilled(dataclasses.replace(decoder, widen=widen), params, batches)
    _assert_same_outputs(found, expected[beam_size])
    (second_bucket_length, second_bucket_rows, _) = BUCKETS[1]
    assert len(moved) == 1, moved
    rows, source_length, max_length, live = moved[0]
    assert (rows, source_length, max_length) == (
        second_bucket_rows,
        second_bucket_length,
        decode_length(second_bucket_length, MAX_DECODE_LENGTH),
    )
    assert live >= 1  # A first bucket's sentence goes on in the second bucket's rows.


@pytest.mark.parametrize("beam_size", BEAM_SIZES)
def test_the_last_sentences_move_to_fewer_rows_and_translate_as_whole_batches(setting, beam_size, monkeypatch):
    """Rows cut to the second bucket's, then, without sentences left to start, to a half: the same outputs."""
    monkeypatch.setattr(refill, "SHRINK", 2)
    monkeypatch.setattr(refill, "MIN_ROWS", 1)
    _, params, batches, expected, decoders = setting
    row_counts = []

    def take(search, source):
        row_counts.append(len(source))
        return decoders[beam_size].take(search, source)

    found = _refilled(dataclasses.replace(decoders[beam_size], take=take), params, batches)
    _assert_same_outputs(found, expected[beam_size])
    second_rows = BUCKETS[1][1]
    assert row_counts == [second_rows, second_rows // 2], row_counts


@pytest.mark.parametrize("beam_size", BEAM_SIZES)
def test_compiling_ahead_compiles_every_program_decoding_then_runs(setting, beam_size, monkeypatch):
    """With the first bucket's programs compiled, and `compile_ahead` on fillers of both, decoding compiles nothing."""
    monkeypatch.setattr(refill, "SHRINK", 2)
    monkeypatch.setattr(refill, "MIN_ROWS", 1)
    model, params, batches, _, _ = setting
    decoder = _decoder(model, beam_size)  # Its own: the test counts its compiled programs.
    first_bucket = [batch for batch in batches if batch.inputs.shape[1] == BUCKETS[0][0]]
    _refilled(decoder, params, first_bucket)  # Compiles the first bucket's programs, as decoding begins.
    fillers = [first_bucket[0].filler(PAD), batches[len(first_bucket)].filler(PAD)]
    refill.compile_ahead(decoder, params, fillers, place=_place)
    programs = ("start", "insert", "run", "take", "widen")
    compiled = {name: getattr(decoder, name)._cache_size() for name in programs}
    assert compiled["widen"] == 1, compiled
    _refilled(decoder, params, batches)
    assert {name: getattr(decoder, name)._cache_size() for name in programs} == compiled


def test_decoding_compiles_ahead_in_a_thread_in_one_process_on_cpus_only():
    """A GPU's first run of a loop records a CUDA graph, which a second thread's runs broke on an H100."""
    assert translation_eval.compiles_ahead_in_a_thread("cpu", process_count=1)
    for platform, process_count in (("gpu", 1), ("tpu", 1), ("cpu", 2)):
        assert not translation_eval.compiles_ahead_in_a_thread(platform, process_count)
