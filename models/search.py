"""The search loops over a next-token function: one hypothesis a row with a token chooser, and beam search.

Both are `lax.while_loop`s over rows that each keep their own position, so that a row that is
done can be replaced by a new sentence between two runs of the loop (`insert_greedy_rows`,
`insert_beam_rows`; models/streaming.py drives that) while the others go on. They never emit
<pad> or <bos>. They take the model as a `NextTokenLogits` function (models/decoding.py binds
the Transformer to one), so that they can be tested on scripted logits. Tokens are [rows,
max_length] int32 ids, each row ending at its first <eos> (included) and padded after it; a row
that reaches its length budget without <eos> is returned as it is. Each row may have a budget of
its own (at most `max_length`, the arrays' static length), so that a sentence's output does not
depend on the batch it is in.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

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


def where_rows(take: Array, new: Any, old: Any) -> Any:
    """Leaves of `new` in the rows where take [rows] is True, of `old` elsewhere (same shapes)."""

    def pick(n, o):
        return jnp.where(take.reshape(-1, *([1] * (o.ndim - 1))), n, o)

    return jax.tree.map(pick, new, old)


def fields_of(record: NamedTuple, names) -> dict:
    """{name: record.name} for each of `names`."""
    return {name: getattr(record, name) for name in names}


def run_until(step: Callable, carry, done: Callable[[Any], Array], min_done: Array | int | None):
    """Steps `carry` until every row is done, or (min_done given) at least min_done rows are."""

    def go_on(carry):
        rows_done = done(carry)
        more = ~jnp.all(rows_done)
        return more if min_done is None else more & (jnp.sum(rows_done) < min_done)

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


class Rows(NamedTuple):
    """Greedy or sampled decoding of one hypothesis a row, each at its own position.

    step: [] int32 steps run (sampling's step i draws from fold_in(rng, i)).
    tokens: [rows, max_length + 1] int32, <bos> then the generated tokens.
    positions: [rows] int32 tokens generated (frozen once a row is finished).
    finished: [rows] bool, ended by <eos> or its budget (or no sentence: a free row).
    budgets: [rows] int32, the most tokens of each row.
    state, context: see `NextTokenLogits`.
    """

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


def insert_greedy_rows(rows: Rows, take: Array, new: Rows) -> Rows:
    """`rows` with those where take [rows] is True replaced by `new`'s (fresh rows from `greedy_rows`).

    The replaced rows' self-attention cache is kept: its slots past a row's position are masked
    out, so a new sentence never sees what the old one left there.
    """
    fields = ('tokens', 'positions', 'finished', 'budgets', 'context')
    return rows._replace(**where_rows(take, fields_of(new, fields), fields_of(rows, fields)))


def run_greedy(
    next_token_logits: NextTokenLogits,
    choose_token: ChooseToken,
    rows: Rows,
    rng: Array,
    *,
    eos_id: int,
    bos_id: int,
    pad_id: int,
    min_finished: Array | int | None = None,
) -> Rows:
    """Extends each unfinished row a token a step until every row has finished (or at least min_finished have).

    A row finishes at <eos> or at its budget, with or without <eos>.
    """
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

    return run_until(step, rows, lambda rows: rows.finished, min_finished)


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
    """Extends one hypothesis per row, a token a step, until every row has emitted <eos> or used its budget.

    Args:
        next_token_logits: the model's next-token logits given the tokens so far.
        choose_token: picks each row's next token from its logits (greedy or sampled).
        state, context: what next_token_logits carries (the cache and the source, or nothing).
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
    rows = greedy_rows(state, context, finished, budgets, max_length=max_length, bos_id=bos_id, pad_id=pad_id)
    rows = run_greedy(next_token_logits, choose_token, rows, rng, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id)
    return rows.tokens[:, 1:]


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


def top_extensions(logits: Array, live_log_probs: Array, n: int) -> tuple[Array, Array, Array]:
    """The n best extensions of each row's beams by log-probability, without a log-softmax of every logit.

    log_softmax(x) = x - max(x) - log(sum(exp(x - max(x)))) is monotonic in x within a beam: a
    beam's n best extensions are its n largest logits, and only those n are turned into
    log-probabilities (each as log_softmax would, with the same normaliser). The row's n best
    are then among its beams' n best each.

    Args:
        logits: [batch, beams, vocab] float32 next-token logits of each live beam.
        live_log_probs: [batch, beams] log P of each live beam.
        n: extensions to keep per row.

    Returns:
        log P of the extensions [batch, n] (best first), their beams [batch, n] and tokens [batch, n] int32.
    """
    batch, beams, vocab_size = logits.shape
    per_beam = min(n, vocab_size)
    top_logits, top_tokens = jax.lax.top_k(logits, per_beam)  # [batch, beams, per_beam]
    largest = jnp.max(logits, axis=-1, keepdims=True)
    normaliser = jnp.log(jnp.sum(jnp.exp(logits - largest), axis=-1, keepdims=True))
    candidates = live_log_probs[:, :, None] + ((top_logits - largest) - normaliser)
    top_log_probs, flat = jax.lax.top_k(candidates.reshape(batch, beams * per_beam), n)
    token = jnp.take_along_axis(top_tokens.reshape(batch, beams * per_beam), flat, axis=1)
    return top_log_probs, flat // per_beam, token.astype(jnp.int32)


class Beams(NamedTuple):
    """Beam search over `beam_size` hypotheses a sentence, each sentence (batch row) at its own position.

    step: [] int32 steps run.
    positions: [batch] int32 tokens generated by each row's live hypotheses (frozen once it is done).
    live_tokens, finished_tokens: [batch, beam_size, max_length + 1] int32.
    live_log_probs: [batch, beam_size] log P of the live hypotheses, best first.
    finished_scores: [batch, beam_size] log P / lp of the finished ones, best first (NEG_INF: none).
    budgets: [batch] int32.
    skip: [batch] bool, rows without a sentence (filler or free rows).
    state, context: see `NextTokenLogits`, over batch * beam_size hypotheses.
    """

    step: Array
    positions: Array
    live_tokens: Array
    live_log_probs: Array
    finished_tokens: Array
    finished_scores: Array
    budgets: Array
    skip: Array
    state: Any
    context: Any


def beam_rows(
    state, context, skip: Array, budgets: Array | None, *, beam_size: int, max_length: int, bos_id: int, pad_id: int
):
    """`Beams` before the first step. skip: [batch] bool, rows that need no decoding (filler rows)."""
    batch_size, k = skip.shape[0], beam_size
    empty = first_tokens((batch_size, k, max_length + 1), bos_id, pad_id)
    # All live beams start as the same <bos> hypothesis: only one may be extended at
    # first, or the row would fill with copies of the same hypotheses.
    return Beams(
        step=jnp.array(0, jnp.int32),
        positions=jnp.zeros(batch_size, jnp.int32),
        live_tokens=empty,
        live_log_probs=jnp.where(jnp.arange(k) == 0, 0.0, NEG_INF) * jnp.ones((batch_size, 1)),
        finished_tokens=empty,
        finished_scores=jnp.full((batch_size, k), NEG_INF),
        budgets=row_budgets(budgets, batch_size, max_length),
        skip=skip,
        state=state,
        context=context,
    )


def insert_beam_rows(beams: Beams, take: Array, new: Beams) -> Beams:
    """`beams` with the sentences where take [batch] is True replaced by `new`'s (fresh, from `beam_rows`).

    The replaced hypotheses' self-attention cache is kept (see `insert_greedy_rows`).
    """
    per_sentence = [f for f in Beams._fields if f not in ('step', 'state', 'context')]
    replaced = where_rows(take, fields_of(new, per_sentence), fields_of(beams, per_sentence))
    context = where_rows(jnp.repeat(take, beams.live_tokens.shape[1]), new.context, beams.context)
    return beams._replace(**replaced, context=context)


def beams_done(beams: Beams, alpha: float) -> Array:
    """[batch] bool: rows whose best finished hypotheses no live one can still beat, at their budget, or skipped.

    A live hypothesis' log-probability can only fall, and its penalty rise to at most lp(budget).
    """
    best_reachable = beams.live_log_probs[:, 0] / length_penalty(beams.budgets, alpha)  # Beams are sorted.
    return beams.skip | (beams.finished_scores[:, -1] >= best_reachable) | (beams.positions >= beams.budgets)


def run_beams(
    next_token_logits: NextTokenLogits,
    beams: Beams,
    *,
    alpha: float,
    eos_id: int,
    bos_id: int,
    pad_id: int,
    min_done: Array | int | None = None,
) -> Beams:
    """Runs beam search until every row is done (or at least min_done rows are); see `beam_search_loop`."""
    batch_size, k, length = beams.live_tokens.shape

    def step(beams: Beams) -> Beams:
        done = beams_done(beams, alpha)
        position = beams.positions
        logits, state = next_token_logits(
            jnp.repeat(position, k), beams.live_tokens.reshape(batch_size * k, -1), beams.state, beams.context
        )
        logits = forbid_special_tokens(logits.astype(jnp.float32), bos_id, pad_id)
        # The 2k best extensions: [batch, 2k] each (enough that k of them are not <eos>).
        top_log_probs, parent, token = top_extensions(logits.reshape(batch_size, k, -1), beams.live_log_probs, 2 * k)
        tokens = jnp.take_along_axis(beams.live_tokens, parent[:, :, None], axis=1)
        write_at = jnp.minimum(position + 1, length - 1)[:, None]
        tokens = tokens.at[jnp.arange(batch_size)[:, None], jnp.arange(2 * k)[None], write_at].set(token)
        ends = token == eos_id
        last_step = (position + 1 == beams.budgets)[:, None]
        # Extensions of the placeholder beams (first steps, tiny vocabularies) are not hypotheses,
        # nor are those of a row past its budget.
        real = (top_log_probs > NEG_INF / 2) & (position < beams.budgets)[:, None]

        # Finished: <eos> extensions, and every extension once the budget is reached.
        penalty = length_penalty(position + 1, alpha)[:, None]
        new_scores = jnp.where(real & (ends | last_step), top_log_probs / penalty, NEG_INF)
        finished_scores, finished_tokens = _top_k_of_rows(
            jnp.concatenate([beams.finished_scores, new_scores], axis=1),
            k,
            jnp.concatenate([beams.finished_tokens, tokens], axis=1),
        )
        # Live: the best k extensions that did not end.
        live_log_probs, live_tokens, parent = _top_k_of_rows(
            jnp.where(ends | ~real, NEG_INF, top_log_probs), k, tokens, parent
        )
        return beams._replace(
            step=beams.step + 1,
            positions=jnp.where(done, position, position + 1),
            live_tokens=live_tokens,
            live_log_probs=live_log_probs,
            finished_tokens=finished_tokens,
            finished_scores=finished_scores,
            state=_gather_beams(state, parent, batch_size),
        )

    return run_until(step, beams, lambda beams: beams_done(beams, alpha), min_done)


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
    context: Any = (),
) -> tuple[Array, Array]:
    """Beam search over `beam_size` hypotheses per row, keeping finished ones apart.

    At each step every live hypothesis is extended by every token; of the
    2 * beam_size best extensions by log-probability (enough that beam_size of
    them are not <eos>), those ending in <eos> join the row's finished
    hypotheses, scored log P / lp, and the best beam_size others stay live. A
    live hypothesis that reaches its row's budget is finished as it is. A row is
    done when it holds beam_size finished hypotheses and no live one can still
    beat the worst of them (its log-probability can only fall, its penalty rise
    to at most lp(budget)), or at its budget; its finished hypotheses no longer change.

    Args:
        next_token_logits: the model, over rows = batch * beam_size hypotheses
            (row-major: the beams of batch row b are rows b * beam_size + j).
            Every leaf of `state` has that leading dimension; beams are reordered
            with it (`context` is not).
        state: the per-hypothesis decoding state (the self-attention cache).
        skip: [batch] bool, rows that need no decoding (all-padding filler rows).
        beam_size: hypotheses kept per row (static).
        alpha: the length penalty exponent (static).
        max_length, bos_id, eos_id, pad_id, budgets, context: as in `search_loop`
            ([batch] budgets, one per row of hypotheses).

    Returns:
        tokens: [batch, beam_size, max_length] int32 finished hypotheses, best first.
        scores: [batch, beam_size] float32 their log P / lp.
    """
    beams = beam_rows(
        state, context, skip, budgets, beam_size=beam_size, max_length=max_length, bos_id=bos_id, pad_id=pad_id
    )
    beams = run_beams(next_token_logits, beams, alpha=alpha, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id)
    return beam_results(beams, pad_id)


def beam_results(beams: Beams, pad_id: int) -> tuple[Array, Array]:
    """(tokens [batch, beam_size, max_length], scores [batch, beam_size]) of the finished hypotheses, best first."""
    finished_tokens = jnp.where(beams.skip[:, None, None], pad_id, beams.finished_tokens)
    return finished_tokens[:, :, 1:], beams.finished_scores
