"""The search loops over a next-token function: one hypothesis a row with a token chooser, and beam search.

Both are `lax.while_loop`s that exit as soon as every row of the batch is done, and
never emit <pad> or <bos>. They take the model as a `NextTokenLogits` function
(models/decoding.py binds the Transformer to one), so that they can be tested on
scripted logits. Tokens are [rows, max_length] int32 ids, each row ending at its first
<eos> (included) and padded after it; a row that reaches its length budget without <eos>
is returned as it is. Each row may have a budget of its own (at most `max_length`, the
arrays' static length), so that a sentence's output does not depend on the batch it is in.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
# (position [], tokens [rows, max_length + 1], state) -> (logits [rows, vocab] of the
# token after `position`, state); tokens[:, 0] is <bos>, tokens[:, i + 1] the token
# generated at step i.
NextTokenLogits = Callable[[Array, Array, Any], tuple[Array, Any]]
# (logits [rows, vocab] float32, rng of this step) -> token ids [rows] int32.
ChooseToken = Callable[[Array, Array], Array]

# Log-probability of impossible hypotheses: finite, so that sums and comparisons
# stay NaN-free, and far below any real score.
NEG_INF = -1.0e9


def _forbid_special_tokens(logits: Array, bos_id: int, pad_id: int) -> Array:
    """Sets the logits of <bos> and <pad>, which are never generated, to NEG_INF. [rows, vocab]."""
    return logits.at[:, jnp.array([bos_id, pad_id])].set(NEG_INF)


def _row_budgets(budgets: Array | None, rows: int, max_length: int) -> Array:
    """[rows] int32 output budgets: the given ones, or max_length for every row."""
    return jnp.full((rows,), max_length, jnp.int32) if budgets is None else jnp.asarray(budgets, jnp.int32)


# --------------------------------------------------------------------------- #
# Greedy and sampling: one hypothesis per row.
# --------------------------------------------------------------------------- #


def argmax_token(logits: Array, rng: Array) -> Array:
    """Greedy choice: the most likely token. [rows, vocab] -> [rows] int32."""
    del rng
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sampled_token(temperature: float, top_k: int = 0) -> ChooseToken:
    """Samples from softmax(logits / temperature), restricted to the top_k tokens if top_k > 0.

    A top_k of at least the vocabulary's size restricts nothing.
    """
    if temperature <= 0:
        raise ValueError(f"Sampling needs temperature > 0, got {temperature}; use greedy decoding for 0.")

    def choose(logits: Array, rng: Array) -> Array:
        logits = logits / temperature
        if 0 < top_k < logits.shape[-1]:
            kth_largest = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits >= kth_largest, logits, NEG_INF)
        return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)

    return choose


def search_loop(
    next_token_logits: NextTokenLogits,
    choose_token: ChooseToken,
    state: Any,
    finished: Array,
    rng: Array,
    *,
    max_length: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    budgets: Array | None = None,
) -> Array:
    """Extends one hypothesis per row, a token a step, until every row has emitted <eos> or used its budget.

    Args:
        next_token_logits: the model's next-token logits given the tokens so far.
        choose_token: picks each row's next token from its logits (greedy or sampled).
        state: whatever next_token_logits carries (the cache, or nothing).
        finished: [rows] bool, rows that need no decoding (all-padding filler rows):
            they stay padding and do not hold up the early exit.
        rng: PRNG key; step i uses fold_in(rng, i).
        max_length: the most tokens to generate (static).
        bos_id, eos_id, pad_id: special ids.
        budgets: [rows] int, the most tokens of each row (at most max_length; None:
            max_length for every row). A row stops there, with or without <eos>.

    Returns:
        [rows, max_length] int32 ids.
    """
    rows = finished.shape[0]
    tokens = jnp.full((rows, max_length + 1), pad_id, jnp.int32).at[:, 0].set(bos_id)
    budgets = _row_budgets(budgets, rows, max_length)

    def not_done(carry):
        position, _, finished, _ = carry
        return (position < max_length) & ~jnp.all(finished)

    def step(carry):
        position, tokens, finished, state = carry
        logits, state = next_token_logits(position, tokens, state)
        logits = _forbid_special_tokens(logits.astype(jnp.float32), bos_id, pad_id)
        next_token = choose_token(logits, jax.random.fold_in(rng, position))
        next_token = jnp.where(finished, pad_id, next_token)
        tokens = tokens.at[:, position + 1].set(next_token)
        finished = finished | (next_token == eos_id) | (position + 1 >= budgets)
        return position + 1, tokens, finished, state

    carry = (jnp.array(0, jnp.int32), tokens, finished, state)
    _, tokens, _, _ = jax.lax.while_loop(not_done, step, carry)
    return tokens[:, 1:]


# --------------------------------------------------------------------------- #
# Beam search.
# --------------------------------------------------------------------------- #


def length_penalty(length: Array, alpha: float) -> Array:
    """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al., 2016); |Y| counts <eos>.

    A hypothesis scores log P(Y) / lp(Y): alpha = 0 ranks by log-probability alone,
    larger alpha favours longer outputs.
    """
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _gather_beams(tree: Any, beam_indices: Array, batch_size: int) -> Any:
    """Selects beams of every leaf: [batch * beams_in, ...] -> [batch * beams_out, ...].

    beam_indices: [batch, beams_out] int, indices into each row's beams_in beams.
    """

    def gather(leaf):
        by_row = leaf.reshape(batch_size, -1, *leaf.shape[1:])
        index = beam_indices.reshape(*beam_indices.shape, *([1] * (by_row.ndim - 2)))
        return jnp.take_along_axis(by_row, index, axis=1).reshape(-1, *leaf.shape[1:])

    return jax.tree.map(gather, tree)


def _top_k_of_rows(scores: Array, k: int, *arrays: Array) -> tuple[Array, ...]:
    """The k best of each row: scores [batch, n] and arrays [batch, n, ...] -> [batch, k, ...]."""
    top_scores, indices = jax.lax.top_k(scores, k)
    return (
        top_scores,
        *(jnp.take_along_axis(a, indices.reshape(*indices.shape, *([1] * (a.ndim - 2))), 1) for a in arrays),
    )


def beam_search_loop(
    next_token_logits: NextTokenLogits,
    state: Any,
    skip: Array,
    *,
    beam_size: int,
    alpha: float,
    max_length: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    budgets: Array | None = None,
) -> tuple[Array, Array]:
    """Beam search over `beam_size` hypotheses per row, keeping finished ones apart.

    At each step every live hypothesis is extended by every token; of the
    2 * beam_size best extensions by log-probability (enough that beam_size of
    them are not <eos>), those ending in <eos> join the row's finished
    hypotheses, scored log P / lp, and the best beam_size others stay live. A
    live hypothesis that reaches its row's budget is finished as it is. A row is
    done when it holds beam_size finished hypotheses and no live one can still
    beat the worst of them (its log-probability can only fall, its penalty rise
    to at most lp(budget)), or at its budget.

    Args:
        next_token_logits: the model, over rows = batch * beam_size hypotheses
            (row-major: the beams of batch row b are rows b * beam_size + j).
            Every leaf of `state` has that leading dimension; beams are reordered
            with it.
        state: the per-hypothesis decoding state (the self-attention cache).
        skip: [batch] bool, rows that need no decoding (all-padding filler rows).
        beam_size: hypotheses kept per row (static).
        alpha: the length penalty exponent (static).
        max_length, bos_id, eos_id, pad_id, budgets: as in `search_loop` ([batch]
            budgets, one per row of hypotheses).

    Returns:
        tokens: [batch, beam_size, max_length] int32 finished hypotheses, best first.
        scores: [batch, beam_size] float32 their log P / lp.
    """
    batch_size, k = skip.shape[0], beam_size
    empty = jnp.full((batch_size, k, max_length + 1), pad_id, jnp.int32).at[:, :, 0].set(bos_id)
    # All live beams start as the same <bos> hypothesis: only one may be extended at
    # first, or the row would fill with copies of the same hypotheses.
    live_log_probs = jnp.where(jnp.arange(k) == 0, 0.0, NEG_INF) * jnp.ones((batch_size, 1))
    finished_scores = jnp.full((batch_size, k), NEG_INF)
    budgets = _row_budgets(budgets, batch_size, max_length)
    max_penalty = length_penalty(budgets, alpha)

    def row_done(position, live_log_probs, finished_scores):
        best_reachable = live_log_probs[:, 0] / max_penalty  # Beams are kept sorted: 0 is best.
        return skip | (finished_scores[:, -1] >= best_reachable) | (position >= budgets)

    def not_done(carry):
        position, _, live_log_probs, _, finished_scores, _ = carry
        return ~jnp.all(row_done(position, live_log_probs, finished_scores))

    def step(carry):
        position, live_tokens, live_log_probs, finished_tokens, finished_scores, state = carry
        logits, state = next_token_logits(position, live_tokens.reshape(batch_size * k, -1), state)
        logits = _forbid_special_tokens(logits.astype(jnp.float32), bos_id, pad_id)
        vocab_size = logits.shape[-1]
        log_probs = jax.nn.log_softmax(logits).reshape(batch_size, k, vocab_size)
        candidate_log_probs = (live_log_probs[:, :, None] + log_probs).reshape(batch_size, k * vocab_size)

        # The 2k best extensions: [batch, 2k] each.
        top_log_probs, flat_indices = jax.lax.top_k(candidate_log_probs, 2 * k)
        parent, token = flat_indices // vocab_size, (flat_indices % vocab_size).astype(jnp.int32)
        tokens = jnp.take_along_axis(live_tokens, parent[:, :, None], axis=1)
        tokens = tokens.at[:, :, position + 1].set(token)
        ends = token == eos_id
        last_step = (position + 1 == budgets)[:, None]
        # Extensions of the placeholder beams (first steps, tiny vocabularies) are not hypotheses,
        # nor are those of a row past its budget (it waits for the batch's others).
        real = (top_log_probs > NEG_INF / 2) & (position < budgets)[:, None]

        # Finished: <eos> extensions, and every extension once the budget is reached.
        new_scores = jnp.where(real & (ends | last_step), top_log_probs / length_penalty(position + 1, alpha), NEG_INF)
        finished_scores, finished_tokens = _top_k_of_rows(
            jnp.concatenate([finished_scores, new_scores], axis=1),
            k,
            jnp.concatenate([finished_tokens, tokens], axis=1),
        )
        # Live: the best k extensions that did not end.
        live_log_probs, live_tokens, parent = _top_k_of_rows(
            jnp.where(ends | ~real, NEG_INF, top_log_probs), k, tokens, parent
        )
        state = _gather_beams(state, parent, batch_size)
        return position + 1, live_tokens, live_log_probs, finished_tokens, finished_scores, state

    carry = (jnp.array(0, jnp.int32), empty, live_log_probs, empty, finished_scores, state)
    _, _, _, finished_tokens, finished_scores, _ = jax.lax.while_loop(not_done, step, carry)
    finished_tokens = jnp.where(skip[:, None, None], pad_id, finished_tokens)
    return finished_tokens[:, :, 1:], finished_scores
