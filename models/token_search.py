"""Greedy search and sampling: one hypothesis a row, extended a token a step by a chooser (models/search.py's contract).

A row's step i draws from fold_in(its sentence's key, i), the sentence's key being fold_in(PRNGKey(seed),
its index in the job): a sampled translation depends on its sentence and the seed only, not on the rows
beside it or on when it was admitted.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from models import top_k as vocabulary_top_k
from models.search import (
    NEG_INF,
    Axis,
    NextTokenLogits,
    SpecialIds,
    first_tokens,
    forbid_special_tokens,
    row_field,
    run_until,
    search_rows,
)

Array = jax.Array
# (logits [rows, vocab] float32, keys [rows, 2] uint32 of this step) -> token ids [rows] int32.
ChooseToken = Callable[[Array, Array], Array]


def argmax_token(logits: Array, keys: Array) -> Array:
    """Greedy choice: the most likely token. [rows, vocab] -> [rows] int32."""
    del keys
    return vocabulary_top_k.argmax(logits)


def sampled_token(temperature: float, top_k: int = 0) -> ChooseToken:
    """Samples from softmax(logits / temperature), restricted to the top_k tokens if top_k > 0.

    A top_k of at least the vocabulary's size restricts nothing.
    """
    if temperature <= 0:
        raise ValueError(f'Sampling needs temperature > 0, got {temperature}; use greedy decoding for 0.')

    def choose(logits: Array, keys: Array) -> Array:
        logits = logits / temperature
        if 0 < top_k < logits.shape[-1]:
            kth_largest = vocabulary_top_k.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits >= kth_largest, logits, NEG_INF)
        return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)

    return choose


@search_rows
class Rows:
    """One hypothesis a row: tokens [rows, max_length + 1] int32, <bos> then the generated ones; positions [rows]
    int32 tokens generated (frozen once done); ended [rows] bool, by <eos>; budgets [rows] int32, the most tokens
    of each row; keys [rows, 2] uint32, each sentence's."""

    tokens: Array = row_field(Axis.ROWS, tokens=True)
    positions: Array = row_field(Axis.ROWS)
    ended: Array = row_field(Axis.ROWS)
    budgets: Array = row_field(Axis.ROWS)
    keys: Array = row_field(Axis.ROWS)


@dataclasses.dataclass(frozen=True)
class TokenSearch:
    """Greedy search (`argmax_token`) or sampling (`sampled_token`): a `Search` of one copy a sentence."""

    choose_token: ChooseToken
    special: SpecialIds
    seed: int = 0
    copies: int = 1

    def fresh(self, sentences: Array, budgets: Array, *, max_length: int) -> Rows:
        keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.PRNGKey(self.seed), sentences)
        return Rows(
            tokens=first_tokens((len(budgets), max_length + 1), self.special),
            positions=jnp.zeros(len(budgets), jnp.int32),
            ended=jnp.zeros(len(budgets), bool),
            budgets=jnp.asarray(budgets, jnp.int32),
            keys=keys,
        )

    def run(self, next_token_logits: NextTokenLogits, rows: Rows, cache, context, *, min_done=None):
        num_rows, length = rows.tokens.shape
        row_index, pad = jnp.arange(num_rows), self.special.pad

        def step(carry):
            rows, cache = carry
            logits, cache = next_token_logits(rows.positions, rows.tokens, cache, context)
            logits = forbid_special_tokens(logits.astype(jnp.float32), self.special)
            keys = jax.vmap(jax.random.fold_in)(rows.keys, rows.positions)
            done = self.done(rows)
            next_token = jnp.where(done, pad, self.choose_token(logits, keys))
            # A done row writes <pad> after its last token (within the array), where <pad> already is.
            at = jnp.minimum(rows.positions + 1, length - 1)
            tokens = rows.tokens.at[row_index, at].set(jnp.where(done, rows.tokens[row_index, at], next_token))
            ended = rows.ended | (next_token == self.special.eos)
            positions = jnp.where(done, rows.positions, rows.positions + 1)
            return dataclasses.replace(rows, tokens=tokens, positions=positions, ended=ended), cache

        return run_until(step, (rows, cache), lambda carry: self.done(carry[0]), min_done)

    def done(self, rows: Rows) -> Array:
        return rows.ended | (rows.positions >= rows.budgets)

    def best(self, rows: Rows) -> Array:
        return rows.tokens[:, 1:]
