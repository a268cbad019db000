"""One hypothesis a row: the greedy and sampling search loop over a next-token function, and what beam search shares.

The loops (this one with a token chooser, beam search's in models/beam_search.py) are `lax.while_loop`s over
rows that each keep their own position and budget, so that a row can take a new sentence between two runs
while the others go on (models/continuous_batching.py), and an output does not depend on its neighbours.
They never emit <pad> or <bos>, and take the model as a `NextTokenLogits` function (models/decoding.py), so
that they can be tested on scripted logits. Tokens are [rows, max_length] int32 ids, each row ending at its
first <eos> (included), padded after it, or cut at its budget (at most `max_length`, static) without one.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from models import top_k as vocabulary_top_k

Array = jax.Array
# (positions [rows] int32, tokens [rows, max_length + 1], state, context) -> (logits [rows, vocab]
# of the token after each row's position, state). tokens[:, 0] is <bos>, tokens[:, i + 1] the token
# generated at a row's step i. `state` (the self-attention cache) follows the hypotheses (beam search
# reorders it); `context` (the source and its cross-attention keys and values) stays with its row.
NextTokenLogits = Callable[[Array, Array, Any, Any], tuple[Array, Any]]
# (logits [rows, vocab] float32, rng of this step) -> token ids [rows] int32.
ChooseToken = Callable[[Array, Array], Array]

# Log-probability of impossible hypotheses: finite, so that sums and comparisons
# stay NaN-free, and far below any real score.
NEG_INF = -1.0e9


def forbid_special_tokens(logits: Array, bos_id: int, pad_id: int) -> Array:
    """Sets the logits of <bos> and <pad>, which are never generated, to NEG_INF. [rows, vocab]."""
    return logits.at[:, jnp.array([bos_id, pad_id])].set(NEG_INF)


def row_budgets(budgets: Array | None, rows: int, max_length: int) -> Array:
    """[rows] int32 output budgets: the given ones, or max_length for every row."""
    return jnp.full((rows,), max_length, jnp.int32) if budgets is None else jnp.asarray(budgets, jnp.int32)


def run_until(step: Callable, carry, done: Callable[[Any], Array], min_done: Array | int | None):
    """Steps `carry` until every row is done, or (min_done given) at least min_done rows are."""

    def go_on(carry):
        rows_done = done(carry)
        target = len(rows_done) if min_done is None else jnp.minimum(min_done, len(rows_done))
        return jnp.sum(rows_done) < target

    return jax.lax.while_loop(go_on, step, carry)


def first_tokens(shape: tuple[int, ...], bos_id: int, pad_id: int) -> Array:
    """Tokens of hypotheses that have generated nothing: <bos>, then padding. [*shape] int32."""
    return jnp.full(shape, pad_id, jnp.int32).at[..., 0].set(bos_id)


# --------------------------------------------------------------------------- #
# Greedy and sampling: one hypothesis per row.
# --------------------------------------------------------------------------- #


def argmax_token(logits: Array, rng: Array) -> Array:
    """Greedy choice: the most likely token. [rows, vocab] -> [rows] int32."""
    del rng
    return vocabulary_top_k.argmax(logits)


def sampled_token(temperature: float, top_k: int = 0) -> ChooseToken:
    """Samples from softmax(logits / temperature), restricted to the top_k tokens if top_k > 0.

    A top_k of at least the vocabulary's size restricts nothing.
    """
    if temperature <= 0:
        raise ValueError(f"Sampling needs temperature > 0, got {temperature}; use greedy decoding for 0.")

    def choose(logits: Array, rng: Array) -> Array:
        logits = logits / temperature
        if 0 < top_k < logits.shape[-1]:
            kth_largest = vocabulary_top_k.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits >= kth_largest, logits, NEG_INF)
        return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)

    return choose


class Rows(NamedTuple):
    """Greedy or sampled decoding, one hypothesis a row: step [] int32 steps run (step i of sampling draws from
    fold_in(rng, i)); tokens [rows, max_length + 1] int32, <bos> then the generated tokens; positions [rows]
    int32 tokens generated (frozen once finished); finished [rows] bool, ended by <eos> or the budget, or
    without a sentence; budgets [rows] int32, the most tokens of each row; state, context: `NextTokenLogits`'."""

    step: Array
    tokens: Array
    positions: Array
    finished: Array
    budgets: Array
    state: Any
    context: Any


def greedy_rows(state, context, finished: Array, budgets: Array | None, *, max_length: int, bos_id: int, pad_id: int):
    """`Rows` before the first step. finished: [rows] bool, rows that need no decoding (filler rows)."""
    rows = finished.shape[0]
    return Rows(
        step=jnp.array(0, jnp.int32),
        tokens=first_tokens((rows, max_length + 1), bos_id, pad_id),
        positions=jnp.zeros(rows, jnp.int32),
        finished=finished,
        budgets=row_budgets(budgets, rows, max_length),
        state=state,
        context=context,
    )


def run_greedy(
    next_token_logits: NextTokenLogits,
    rows: Rows,
    *,
    choose_token: ChooseToken,
    rng: Array,
    eos_id: int,
    bos_id: int,
    pad_id: int,
    min_done: Array | int | None = None,
) -> Rows:
    """Extends each unfinished row a token a step (`choose_token`'s, step i drawing from fold_in(rng, i)) until
    every row has finished, at <eos> or at its budget (or until at least min_done rows have)."""
    num_rows, length = rows.tokens.shape
    row_index = jnp.arange(num_rows)

    def step(rows: Rows) -> Rows:
        logits, state = next_token_logits(rows.positions, rows.tokens, rows.state, rows.context)
        logits = forbid_special_tokens(logits.astype(jnp.float32), bos_id, pad_id)
        next_token = choose_token(logits, jax.random.fold_in(rng, rows.step))
        next_token = jnp.where(rows.finished, pad_id, next_token)
        # A finished row writes <pad> after its last token (within the array), where <pad> already is.
        tokens = rows.tokens.at[row_index, jnp.minimum(rows.positions + 1, length - 1)].set(
            jnp.where(rows.finished, rows.tokens[row_index, jnp.minimum(rows.positions + 1, length - 1)], next_token)
        )
        finished = rows.finished | (next_token == eos_id) | (rows.positions + 1 >= rows.budgets)
        positions = jnp.where(rows.finished, rows.positions, rows.positions + 1)
        return rows._replace(step=rows.step + 1, tokens=tokens, positions=positions, finished=finished, state=state)

    return run_until(step, rows, lambda rows: rows.finished, min_done)


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
    context: Any = (),
) -> Array:
    """[rows, max_length] int32 ids: one hypothesis a row, a token a step, until every row has ended (`run_greedy`).

    state, context: what next_token_logits carries (the cache and the sources, or nothing). finished: [rows] bool,
    rows that need no decoding (all-padding filler rows): they stay padding and do not hold up the early exit.
    budgets: [rows] int, the most tokens of each row (None: max_length, the arrays' static length, for every row).
    """
    rows = greedy_rows(state, context, finished, budgets, max_length=max_length, bos_id=bos_id, pad_id=pad_id)
    special = dict(eos_id=eos_id, bos_id=bos_id, pad_id=pad_id)
    return run_greedy(next_token_logits, rows, choose_token=choose_token, rng=rng, **special).tokens[:, 1:]
