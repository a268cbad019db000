"""The contract between a search (greedy, sampling, beam search) and the scheduler that runs it over rows.

A search decodes sentences in rows, one sentence a row, `copies` hypotheses a sentence (1, or the beam
size). Its rows are a pytree dataclass whose every field declares its leading axis with `row_field`:
`ROWS` ([rows, ...]: a sentence's) or `COPIES` ([rows * copies, ...]: a hypothesis', those of row r
being r * copies + j); at least one holds tokens (its last axis max_length + 1). The scheduler
(models/continuous_batching.py) moves rows by these declarations alone: it writes a new sentence's
`fresh` rows into a free slot, widens the rows with free ones (zeros), cuts the `tokens=True` fields'
last axis, and splits them over devices; `check_rows` rejects a leaf that does not fit its field's
declaration, by name.

The model is not the search's: `run` gets it as a `NextTokenLogits` function with its `cache` (the
self-attention keys and values, a leaf a hypothesis, which the search reorders with them) and the
`context` (the sources, a leaf a sentence), both the scheduler's. The rules a search keeps:
- a row of zeros (a budget of 0) is done: the scheduler's free rows are zeros, and a sentence's rows are
  the search's `fresh` ones;
- `done(rows)` never turns from True to False, across `run` as in between (the scheduler reports and
  frees a row once it is done);
- `best(rows)` of a done row no longer changes, and neither is changed by widening or cutting the rows;
- a row's outputs depend on its own sentence, budget and key only, never on the rows beside it.
tests/test_search_contract.py holds them for every search; docs/decoding.md shows how to add one.
"""

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

Array = jax.Array
# (positions [rows * copies] int32, tokens [rows * copies, max_length + 1], cache, context) -> (logits
# [rows * copies, vocab] of the token after each hypothesis' position, cache). tokens[:, 0] is <bos>,
# tokens[:, i + 1] the token generated at step i.
NextTokenLogits = Callable[[Array, Array, Any, Any], tuple[Array, Any]]

# Log-probability of impossible hypotheses: finite, so that sums and comparisons stay NaN-free, and far
# below any real score.
NEG_INF = -1.0e9


class SpecialIds(NamedTuple):
    """The ids a search treats apart: it starts with <bos>, ends at <eos>, pads with <pad>, and never emits <bos>
    or <pad>."""

    bos: int
    eos: int
    pad: int


class Axis(enum.Enum):
    """A search field's leading axis."""

    ROWS = 'rows'
    COPIES = 'rows x copies'


def row_field(axis: Axis, *, tokens: bool = False):
    """A search field over `axis`; tokens: its last axis is max_length + 1 token positions (<bos> first)."""
    return dataclasses.field(metadata={'axis': axis, 'tokens': tokens})


def search_rows(cls):
    """Makes `cls`, a frozen dataclass of `row_field`s, a search's rows: a pytree of them."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


def fields(rows) -> list[tuple[str, Axis, bool]]:
    """(name, axis, tokens) of each field of a search's rows."""
    return [(f.name, f.metadata['axis'], f.metadata['tokens']) for f in dataclasses.fields(rows)]


def check_rows(rows, num_rows: int, copies: int) -> None:
    """Raises ValueError naming the field whose leaf does not have the leading axis it declares, or the rows'
    class if no field holds tokens."""
    sizes = {Axis.ROWS: num_rows, Axis.COPIES: num_rows * copies}
    for name, axis, _ in fields(rows):
        for leaf in jax.tree.leaves(getattr(rows, name)):
            if jnp.shape(leaf)[:1] != (sizes[axis],):
                raise ValueError(
                    f"Search field '{name}' declares {axis.value} ({sizes[axis]},) for {num_rows} rows of {copies} "
                    f'copies, but holds a leaf of shape {jnp.shape(leaf)}.'
                )
    if not any(tokens for _, _, tokens in fields(rows)):
        raise ValueError(f'{type(rows).__name__} has no field of tokens (row_field(..., tokens=True)).')


class Search(Protocol):
    """What the scheduler asks of a search. copies: hypotheses a sentence (rows of the cache a row).

    fresh(sentences [n] int32, budgets [n] int32, *, max_length) -> the rows of n new sentences (their index in
        the job, which a search may key on), each to generate at most its budget of tokens (<= max_length,
        static; 0: no sentence, done at once).
    run(next_token_logits, rows, cache, context, *, min_done) -> (rows, cache): steps until at least min_done
        rows are done (all of them: min_done None).
    done(rows) -> [rows] bool; best(rows) -> [rows, max_length] int32, each row's output: ids up to its first
        <eos> (included), <pad> after it, or cut at its budget without one.
    """

    copies: int
    special: SpecialIds

    def fresh(self, sentences: Array, budgets: Array, *, max_length: int) -> Any: ...

    def run(
        self, next_token_logits: NextTokenLogits, rows: Any, cache: Any, context: Any, *, min_done: Any = None
    ) -> tuple[Any, Any]: ...

    def done(self, rows: Any) -> Array: ...

    def best(self, rows: Any) -> Array: ...


def forbid_special_tokens(logits: Array, special: SpecialIds) -> Array:
    """Sets the logits of <bos> and <pad>, which are never generated, to NEG_INF. [rows, vocab]."""
    return logits.at[:, jnp.array([special.bos, special.pad])].set(NEG_INF)


def run_until(step: Callable, carry, done: Callable[[Any], Array], min_done: Array | int | None):
    """Steps `carry` until every row is done, or (min_done given) at least min_done rows are."""

    def go_on(carry):
        rows_done = done(carry)
        target = len(rows_done) if min_done is None else jnp.minimum(min_done, len(rows_done))
        return jnp.sum(rows_done) < target

    return jax.lax.while_loop(go_on, step, carry)


def first_tokens(shape: tuple[int, ...], special: SpecialIds) -> Array:
    """Tokens of hypotheses that have generated nothing: <bos>, then padding. [*shape] int32."""
    return jnp.full(shape, special.pad, jnp.int32).at[..., 0].set(special.bos)
