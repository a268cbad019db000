"""Decoding: the cache equals the full decoder; greedy, sampling and beam search behave as specified."""

import dataclasses
import functools
import itertools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL
from decoding_programs import cached_step_logits_program, decoding_program, shared_sampled_token
from tolerances import FLOAT32_EPS, rounding_tolerance, transformer_operations

from models import Transformer
from models.beam_search import BeamSearch, length_penalty, top_extensions
from models.decoding import decode_length
from models.search import NEG_INF, SpecialIds
from models.token_search import TokenSearch, argmax_token, sampled_token

BOS, EOS, PAD = 2, 3, 0
SPECIAL = SpecialIds(bos=BOS, eos=EOS, pad=PAD)
GREEDY = TokenSearch(argmax_token, SPECIAL)


def _beams(beam_size, alpha, settled=None):
    """Beam search that settles every hypothesis (settled None: all beam_size), to read them all."""
    return BeamSearch(beam_size, alpha, SPECIAL, beam_size if settled is None else settled)


def _translated(search, model, params, inputs, max_length, use_cache=True):
    """[batch, max_length] outputs of `search` on `inputs`, by the shared jitted program (`decoding_program`)."""
    return search.best(decoding_program(search, model, max_length, use_cache)(params, inputs))


def _all_beams(search, model, params, inputs, max_length, use_cache=True):
    """Every settled hypothesis [batch, settled, max_length] of a beam search, best first, and its score."""
    beams = decoding_program(search, model, max_length, use_cache)(params, inputs)
    return beams.finished_tokens[:, : search.settled, 1:], beams.finished_scores[:, : search.settled]


@functools.cache
def _model(dtype="float32", norm_placement="pre", positional_encoding="sinusoidal", vocab_size=40, layers=2):
    """(model, params, inputs [3, 9] with padding in row 1), made once for every test that asks for the same: a
    test changes them only into new arrays (`.at[]`, `jax.tree.map`), never in place."""
    config = dataclasses.replace(
        TINY_MODEL,
        vocab_size=vocab_size,
        max_len=32,
        norm_placement=norm_placement,
        positional_encoding=positional_encoding,
        dtype=dtype,
        num_encoder_layers=layers,
        num_decoder_layers=layers,
    )
    model = Transformer(config)
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(4, vocab_size, (3, 9)), jnp.int32).at[1, 6:].set(PAD)
    params = nn.unbox(model.init(jax.random.PRNGKey(1), inputs, inputs, deterministic=True)["params"])
    return model, params, inputs


@pytest.mark.parametrize("norm_placement", ["pre", "post"])
@pytest.mark.parametrize("positional_encoding", ["sinusoidal", "learned"])
def test_cached_step_logits_equal_full_decoder(norm_placement, positional_encoding):
    model, params, inputs = _model(norm_placement=norm_placement, positional_encoding=positional_encoding)
    decoder_inputs = jnp.asarray(np.random.default_rng(2).integers(4, 40, (3, 7)), jnp.int32).at[:, 0].set(BOS)
    full, stepped = cached_step_logits_program(model, 7)(params, inputs, decoder_inputs)
    # The same logits in another order: within the rounding of the model's whole path. Hidden states are
    # layer-normalized to unit scale; the logits can be larger.
    operations = transformer_operations(model.config, inputs.shape[1], decoder_inputs.shape[1])
    atol = rounding_tolerance(operations, magnitude=max(1.0, float(np.abs(full).max())))
    for position in range(7):
        np.testing.assert_allclose(stepped[:, position], full[:, position], rtol=0, atol=atol, err_msg=f"{position=}")


def _shape(hlo_line: str) -> tuple[int, ...]:
    """An HLO instruction's result shape: (3, 4, 7, 8) of '%t = f32[3,4,7,8]{3,1,2,0} transpose(...'."""
    dims = re.search(r"= \w+\[([\d,]*)\]", hlo_line).group(1)
    return tuple(int(d) for d in dims.split(",") if d)


def test_a_decode_step_transposes_no_cache():
    # The cache is kept in the layout both attention products read, so no step re-lays a whole cache out.
    model, params, inputs = _model()
    variables = {"params": params}
    encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)
    cache = model.apply(variables, encoded, 7, method=Transformer.init_cache)
    step = jax.jit(functools.partial(model.apply, variables, method=Transformer.decode_step))
    rows = inputs.shape[0]
    compiled = step.lower(inputs, jnp.full((rows, 1), BOS), jnp.zeros((rows,), jnp.int32), cache).compile()
    cache_shapes = {tuple(sorted(leaf.shape)) for leaf in jax.tree.leaves(cache)}
    transposed = [
        line
        for line in compiled.as_text().splitlines()
        if " transpose(" in line and tuple(sorted(_shape(line))) in cache_shapes
    ]
    assert not transposed, transposed[:2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_greedy_equals_uncached_greedy(dtype):
    model, params, inputs = _model(dtype=dtype)
    # Larger weights make an untrained model's choices depend on the source and the prefix.
    params = jax.tree.map(lambda x: 5.0 * x, params)
    cached = _translated(GREEDY, model, params, inputs, 10)
    uncached = _translated(GREEDY, model, params, inputs, 10, use_cache=False)
    assert cached.shape == (3, 10)
    assert len(np.unique(np.asarray(cached))) >= 5, cached  # Not one token repeated.
    np.testing.assert_array_equal(cached, uncached)


def test_all_padding_rows_stay_padding():
    model, params, inputs = _model()
    inputs = inputs.at[2].set(PAD)
    out = _translated(GREEDY, model, params, inputs, 10)  # The shapes of the tests above: their program.
    np.testing.assert_array_equal(out[2], np.zeros(10))


def _scripted_model(probabilities_by_step):
    """Next-token logits from a table: row t gives the distribution of the token at step t.

    probabilities_by_step: {step: {token: probability}}; other tokens get almost nothing.
    """
    table = np.full((max(probabilities_by_step) + 1, 20), -30.0, np.float32)
    for step, probabilities in probabilities_by_step.items():
        for token, p in probabilities.items():
            table[step, token] = np.log(p)
    table = jnp.asarray(table)

    def next_token_logits(positions, tokens, state, context):
        return table[jnp.minimum(positions, table.shape[0] - 1)], state

    return next_token_logits


def _run(search, next_token_logits, rows=2, max_length=6, budgets=None, context=()):
    """The rows of `rows` sentences that `search` decodes to the end with a scripted next_token_logits."""
    budgets = jnp.full(rows, max_length, jnp.int32) if budgets is None else jnp.asarray(budgets)
    fresh = search.fresh(jnp.arange(rows, dtype=jnp.int32), budgets, max_length=max_length)
    return search.run(next_token_logits, fresh, (), context)[0]


def _search(next_token_logits, choose=argmax_token, rows=2, max_length=6):
    search = TokenSearch(choose, SPECIAL)
    return search.best(jax.jit(lambda: _run(search, next_token_logits, rows, max_length))())


def test_search_loop_stops_at_eos_and_pads_after_it():
    # Row 0 says 5, 6, <eos>, then would go on with 7; row 1 never ends.
    script = jnp.array([[5, 6, EOS, 7, 7, 7], [8, 9, 10, 11, 12, 13]])

    def next_token_logits(positions, tokens, state, context):
        return jax.nn.one_hot(jnp.take_along_axis(script, positions[:, None], axis=1)[:, 0], 20) * 10.0, state

    np.testing.assert_array_equal(_search(next_token_logits), [[5, 6, EOS, PAD, PAD, PAD], [8, 9, 10, 11, 12, 13]])


def test_search_loop_exits_early_once_every_row_has_finished():
    steps_run = []

    def next_token_logits(positions, tokens, state, context):
        jax.debug.callback(lambda p: steps_run.append(int(p[0])), positions)
        return _scripted_model({0: {5: 0.9}, 1: {EOS: 0.9}})(positions, tokens, state, context)

    out = GREEDY.best(_run(GREEDY, next_token_logits, max_length=8))
    jax.effects_barrier()
    assert steps_run == [0, 1]  # Two steps of eight.
    np.testing.assert_array_equal(out[:, :3], [[5, EOS, PAD]] * 2)


def test_pad_and_bos_are_never_generated():
    # The script makes <pad> and <bos> the most likely tokens; decoding must skip them.
    out = _search(_scripted_model({0: {PAD: 0.5, BOS: 0.3, 7: 0.2}, 1: {PAD: 0.6, EOS: 0.4}}))
    np.testing.assert_array_equal(out[:, :3], [[7, EOS, PAD]] * 2)


# --------------------------------------------------------------------------- #
# Sampling.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "temperature, top_k, expected_share_of_5",
    [
        (1.0, 0, 0.7),
        (2.0, 0, 0.7**0.5 / (0.7**0.5 + 0.3**0.5)),  # p ** (1 / T), renormalised.
        (0.5, 0, 0.7**2 / (0.7**2 + 0.3**2)),
        (1.0, 1, 1.0),  # Only the most likely token is left.
        (1.0, 1000, 0.7),  # More than the vocabulary's 20 tokens: no restriction.
    ],
)
def test_sampling_follows_the_tempered_distribution(temperature, top_k, expected_share_of_5):
    rows = 4000
    out = _search(_scripted_model({0: {5: 0.7, 6: 0.3}, 1: {EOS: 1.0}}), sampled_token(temperature, top_k), rows=rows)
    share = float(np.mean(np.asarray(out[:, 0]) == 5))
    assert abs(share - expected_share_of_5) < 0.025, share
    assert set(np.unique(np.asarray(out[:, 0]))) <= {5, 6}
    np.testing.assert_array_equal(out[:, 1], EOS)


def test_sampling_is_reproducible_and_depends_on_the_seed():
    model, params, inputs = _model()
    params = jax.tree.map(lambda x: 3.0 * x, params)

    def sample(seed, temperature=1.0):
        return _translated(TokenSearch(shared_sampled_token(temperature), SPECIAL, seed), model, params, inputs, 10)

    np.testing.assert_array_equal(sample(7), sample(7))
    assert not np.array_equal(sample(7), sample(8))
    # A near-zero temperature is greedy.
    np.testing.assert_array_equal(sample(7, 1e-4), _translated(GREEDY, model, params, inputs, 10))


# --------------------------------------------------------------------------- #
# Beam search.
# --------------------------------------------------------------------------- #


def _beam(next_token_logits, *, beam_size, alpha, max_length=6):
    """Every hypothesis [1, beam_size, max_length] of one sentence's beam search, best first, and their scores."""
    beams = jax.jit(lambda: _run(_beams(beam_size, alpha), next_token_logits, 1, max_length))()
    return beams.finished_tokens[:, :, 1:], beams.finished_scores


def _score_tolerance(model, source_length: int, max_length: int, logits) -> float:
    """How far two computations of a beam score (a sum of up to max_length log-probabilities) can differ.

    Each log-probability is a logit minus a log-sum-exp over the vocabulary: the model's path, then
    vocab_size more terms; its magnitude is bounded by the largest logit. Dividing by the length penalty
    (>= 1) only shrinks the error.
    """
    per_token = 2 * (transformer_operations(model.config, source_length, max_length) + model.config.vocab_size)
    return rounding_tolerance(max_length * per_token, magnitude=max(1.0, float(np.abs(logits).max())))


def test_length_penalty_is_gnmt():
    # ((5 + 7) / 6) ** 0.6 in float32: a few roundings of an exact quotient.
    np.testing.assert_allclose(length_penalty(jnp.array([1, 7]), 0.6), [1.0, 2.0**0.6], rtol=4 * FLOAT32_EPS)
    np.testing.assert_allclose(length_penalty(jnp.array([1, 7]), 0.0), [1.0, 1.0])


@pytest.mark.parametrize("alpha, winner", [(0.0, "short"), (1.0, "long")])
def test_length_penalty_changes_the_choice_as_the_formula_says(alpha, winner):
    # short = [<eos>]: log 0.5. long = [5, <eos>]: log 0.5 + log 0.95, lower by 0.05,
    # but its length penalty (7/6)^alpha divides it by more: with alpha = 1 it wins.
    tokens, scores = _beam(_scripted_model({0: {EOS: 0.5, 5: 0.5}, 1: {EOS: 0.95, 6: 0.05}}), beam_size=2, alpha=alpha)
    short, long = np.log(0.5), np.log(0.5) + np.log(0.95)
    expected = {"short": ([EOS, PAD, PAD], short), "long": ([5, EOS, PAD], long / (7 / 6) ** alpha)}
    best_tokens, best_score = expected[winner]
    np.testing.assert_array_equal(tokens[0, 0, :3], best_tokens)
    np.testing.assert_allclose(scores[0, 0], best_score, rtol=1e-4)
    assert scores[0, 0] >= scores[0, 1]


def test_beam_search_exits_early_and_pads_after_eos():
    steps_run = []
    scripted = _scripted_model({0: {5: 0.6, 6: 0.4}, 1: {EOS: 0.9, 7: 0.1}})

    def next_token_logits(positions, tokens, state, context):
        jax.debug.callback(lambda p: steps_run.append(int(p[0])), positions)
        return scripted(positions, tokens, state, context)

    beams = _run(_beams(2, 0.6), next_token_logits, rows=1, max_length=12)
    jax.effects_barrier()
    np.testing.assert_array_equal(beams.finished_tokens[0, :, 1:5], [[5, EOS, PAD, PAD], [6, EOS, PAD, PAD]])
    assert len(steps_run) < 12, steps_run  # No live hypothesis can beat the two finished ones.


def test_beam_search_finds_the_exhaustive_best():
    """With a beam wider than the search space, beam search ranks every hypothesis as enumeration does.

    One layer a side: the search is under test, not the model (cached decoding has its tests above)."""
    model, params, inputs = _model(vocab_size=6, layers=1)
    params = jax.tree.map(lambda x: 4.0 * x, params)  # Peaked, source-dependent distributions.
    inputs = inputs[:2]
    max_length, alpha = 3, 0.6
    tokens, scores = _all_beams(_beams(64, alpha), model, params, inputs, max_length)

    # Every output the model can produce: up to max_length tokens of {1, 3, 4, 5}
    # (never <pad> or <bos>), ending at the first <eos> or at max_length.
    hypotheses = [list(h) for n in range(1, max_length + 1) for h in itertools.product((1, EOS, 4, 5), repeat=n)]
    hypotheses = [h for h in hypotheses if EOS not in h[:-1] and (h[-1] == EOS or len(h) == max_length)]
    # Score them all with the full decoder, in one batch per source.
    decoder_inputs = jnp.array([[BOS, *h[:-1]] + [PAD] * (max_length - len(h)) for h in hypotheses], jnp.int32)

    @jax.jit
    def full_decoder_logits(params, inputs, decoder_inputs):  # One program for both sources.
        variables = {"params": params}
        encoded = model.apply(variables, inputs, method=Transformer.encode, deterministic=True)
        return model.apply(variables, encoded, inputs, decoder_inputs, method=Transformer.decode, deterministic=True)

    for row in range(2):
        logits = full_decoder_logits(params, jnp.repeat(inputs[row : row + 1], len(hypotheses), axis=0), decoder_inputs)
        log_probs = np.asarray(jax.nn.log_softmax(logits.at[:, :, jnp.array([BOS, PAD])].set(NEG_INF)))
        expected = [
            (sum(log_probs[i, t, token] for t, token in enumerate(h)) / float(length_penalty(len(h), alpha)), h)
            for i, h in enumerate(hypotheses)
        ]
        expected.sort(reverse=True)
        found = [
            (float(s), [t for t in np.asarray(tokens[row, j]).tolist() if t != PAD]) for j, s in enumerate(scores[row])
        ]
        assert found[0][1] == expected[0][1]
        atol = _score_tolerance(model, inputs.shape[1], max_length, logits)
        np.testing.assert_allclose([s for s, _ in found[: len(expected)]], [s for s, _ in expected], rtol=0, atol=atol)
        assert [h for _, h in found[: len(expected)]] == [h for _, h in expected]
        assert all(s <= NEG_INF / 2 for s, _ in found[len(expected) :])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_beam_size_one_equals_greedy(dtype):
    model, params, inputs = _model(dtype=dtype)
    params = jax.tree.map(lambda x: 5.0 * x, params)
    beam = _translated(BeamSearch(1, 0.0, SPECIAL), model, params, inputs, 10)
    np.testing.assert_array_equal(beam, _translated(GREEDY, model, params, inputs, 10))


def test_cached_beam_search_equals_uncached():
    model, params, inputs = _model()
    params = jax.tree.map(lambda x: 5.0 * x, params)
    max_length = 10
    cached_tokens, cached_scores = _all_beams(_beams(4, 0.6), model, params, inputs, max_length)
    uncached_tokens, uncached_scores = _all_beams(_beams(4, 0.6), model, params, inputs, max_length, use_cache=False)
    assert len(np.unique(np.asarray(cached_tokens))) >= 5
    np.testing.assert_array_equal(cached_tokens, uncached_tokens)
    # Scores of magnitude ~8 differed by ~1e-5 relative between two x86-64 CPUs: bound them by the arithmetic.
    teacher_forced_logits = jax.jit(functools.partial(model.apply, deterministic=True))
    logits = teacher_forced_logits({"params": params}, inputs, cached_tokens[:, 0])
    atol = _score_tolerance(model, inputs.shape[1], max_length, logits)
    np.testing.assert_allclose(cached_scores, uncached_scores, rtol=0, atol=atol)


def test_beam_search_leaves_padding_rows_as_padding():
    model, params, inputs = _model()
    inputs = inputs.at[2].set(PAD)
    out = _translated(_beams(4, 0.6), model, params, inputs, 10)  # The search and shapes above: their program.
    np.testing.assert_array_equal(out[2], np.zeros(10))
    assert np.all(np.asarray(out[:2, 0]) != PAD)


# --------------------------------------------------------------------------- #
# Budgets: each row's own length limit, whatever the batch's.
# --------------------------------------------------------------------------- #


def test_decode_length_is_each_sources_own():
    assert decode_length(5, 100) == 18 and decode_length(60, 100) == 100
    np.testing.assert_array_equal(decode_length(np.array([0, 5, 60]), 100), [8, 18, 100])


def _markov_model(vocab_size=12, seed=0):
    """Next-token logits that depend on the hypothesis' last token (a random Markov chain over the
    vocabulary, <eos> rare): hypotheses diverge, and most run on without ending."""
    table = np.random.default_rng(seed).normal(size=(vocab_size, vocab_size)).astype(np.float32) * 2.0
    table[:, EOS] -= 3.0
    table = jnp.asarray(table)

    def next_token_logits(positions, tokens, state, context):
        return table[jnp.take_along_axis(tokens, positions[:, None], axis=1)[:, 0]], state

    return next_token_logits


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_a_rows_output_depends_on_its_budget_not_on_the_batchs_length(search):
    """Decoded with budgets [3, 7, 10] in arrays of 10, each row is what it is decoded alone at its budget."""
    next_token_logits = _markov_model()

    searcher = GREEDY if search == "greedy" else BeamSearch(3, 0.6, SPECIAL)

    def decode(rows: int, max_length: int, budgets=None):
        return searcher.best(_run(searcher, next_token_logits, rows, max_length, budgets))

    budgets = np.array([3, 7, 10], np.int32)
    together = np.asarray(decode(3, 10, budgets))
    alone = {int(budget): np.asarray(decode(1, int(budget)))[0] for budget in budgets}
    for row, budget in enumerate(budgets):
        np.testing.assert_array_equal(together[row], np.pad(alone[budget], (0, 10 - budget), constant_values=PAD))
    assert [np.count_nonzero(row != PAD) for row in together] == budgets.tolist()  # Each used its whole budget.
    unlimited = np.asarray(decode(1, 10))[0]
    assert EOS not in unlimited[:3] and unlimited[3] != PAD  # The budget cut row 0, or the test shows nothing.


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
def test_a_row_done_once_its_best_is_settled_keeps_the_best_of_a_search_run_to_every_budget(alpha):
    """settled=1 (a caller that reads the best only) stops a row once no live hypothesis can beat its best
    finished one; running every row to its budget (settled=0, no bound) finds the same best, later."""
    rows, beam_size, max_length, vocab_size = 64, 3, 12, 12
    rng = np.random.default_rng(1)
    budgets = jnp.asarray(rng.integers(4, max_length + 1, rows), jnp.int32)
    # A Markov chain of each row's own (the context holds each hypothesis' row), <eos> as likely as any token.
    # Sharp, so that some continuations cost little: at alpha 1.5 a live hypothesis can still overtake a
    # finished one, and a bound at the row's position instead of its budget fails here.
    table = jnp.asarray(rng.normal(size=(rows, vocab_size, vocab_size)) * 4.0, jnp.float32)

    def next_token_logits(positions, tokens, state, row):
        return table[row, jnp.take_along_axis(tokens, positions[:, None], axis=1)[:, 0]], state

    context = jnp.repeat(jnp.arange(rows), beam_size)
    runs = {
        settled: _run(_beams(beam_size, alpha, settled), next_token_logits, rows, max_length, budgets, context)
        for settled in (1, 0)
    }
    np.testing.assert_array_equal(runs[1].finished_tokens[:, 0], runs[0].finished_tokens[:, 0])
    np.testing.assert_array_equal(runs[1].finished_scores[:, 0], runs[0].finished_scores[:, 0])
    # A done row's position stops: rows stop sooner (or the rule shows nothing), some before their budget.
    sooner, later = np.asarray(runs[1].positions), np.asarray(runs[0].positions)
    np.testing.assert_array_equal(later, budgets)
    assert np.all(sooner <= later) and np.any(sooner < later), (sooner, later)


def test_top_extensions_compile_to_topk_routines_not_sorts_on_the_cpu():
    """XLA:CPU runs a lax.top_k whose result is sliced again as a sort of all its candidates (a fifth of
    beam search's time, once): in a loop as decoding runs it, every selection stays a TopK routine."""
    logits, live = jnp.zeros((16, 4, 8000)), jnp.zeros((16, 4))

    def steps(logits, live):
        return jax.lax.fori_loop(
            0, 2, lambda i, total: total + top_extensions(logits + i, live, 8)[0], jnp.zeros((16, 8))
        )

    hlo = jax.jit(steps).lower(logits, live).compile().as_text()
    sorted_widths = [int(width) for width in re.findall(r"(\d+)\]\{[\d,]*\}\)? sort\(", hlo)]
    assert hlo.count('custom_call_target="TopK"') >= 2
    assert all(width <= 8 for width in sorted_widths), sorted_widths  # Only the chosen blocks' indices are sorted.


def test_top_extensions_equal_the_top_k_of_every_log_probability():
    """The n best of live log P + log_softmax over all beams and tokens, ties (repeated logits) included."""
    rng = np.random.default_rng(0)
    batch, beams, vocab_size, n = 3, 4, 50, 8
    logits = jnp.asarray(rng.integers(-20, 20, (batch, beams, vocab_size)) / 4.0, jnp.float32)  # Many ties.
    live = jnp.asarray([[0.0, -1.5, NEG_INF, NEG_INF], [0.0, -0.25, -0.25, -3.0], [-2.0, -2.0, -2.0, -2.0]])
    candidates = (live[:, :, None] + jax.nn.log_softmax(logits)).reshape(batch, beams * vocab_size)
    expected_log_probs, flat = jax.lax.top_k(candidates, n)
    log_probs, parent, token = jax.jit(top_extensions, static_argnums=2)(logits, live, n)
    np.testing.assert_array_equal(log_probs, expected_log_probs)
    np.testing.assert_array_equal(parent, flat // vocab_size)
    np.testing.assert_array_equal(token, flat % vocab_size)
