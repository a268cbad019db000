"""Top-k and argmax over a vocabulary in two passes over blocks: lax.top_k's and jnp.argmax's results, cheaper on CPUs.

XLA:CPU runs `lax.top_k` and `jnp.argmax` over a whole vocabulary as scalar loops (a sort per
row, a reduction over (value, index) pairs), where a plain maximum is vectorized: on the
quick-start model they were a seventh of greedy decoding's time and most of beam search's
bookkeeping (docs/decoding.md, profile). Here the last axis is cut into blocks; the maximum of
each block is one vectorized pass, and the k best values (equal ones ranked by the lower index,
as lax.top_k and jnp.argmax rank them) lie in the k blocks ranked first by their maxima, so the
exact selection runs over k blocks instead of the whole axis. The chosen blocks are taken in
index order, which keeps that ranking of equal values: the values and indices are lax.top_k's
and jnp.argmax's (tests/test_top_k.py, random and tie-heavy inputs).
"""

import jax
import jax.numpy as jnp

Array = jax.Array


def block_size(n: int, k: int) -> int:
    """The divisor b of n that makes both selections smallest (n / b block maxima, then k * b values); 1: none helps."""
    divisors = [b for b in range(1, n + 1) if n % b == 0]
    best = min(divisors, key=lambda b: n // b + k * b)
    return best if n // best + k * best < n else 1


def top_k(x: Array, k: int) -> tuple[Array, Array]:
    """`lax.top_k(x, k)`: the last axis' k largest values, largest first, and their indices. [..., n] -> [..., k]."""
    n = x.shape[-1]
    size = block_size(n, k)
    if size == 1:
        return jax.lax.top_k(x, k)
    blocks = x.reshape(*x.shape[:-1], n // size, size)
    _, chosen = jax.lax.top_k(jnp.max(blocks, axis=-1), k)
    chosen = jnp.sort(chosen, axis=-1)  # Index order: equal values keep lax.top_k's order.
    values = jnp.take_along_axis(blocks, chosen[..., None], axis=-2)  # [..., k, size]
    values, flat = jax.lax.top_k(values.reshape(*x.shape[:-1], k * size), k)
    return values, jnp.take_along_axis(chosen, flat // size, axis=-1) * size + flat % size


def argmax(x: Array) -> Array:
    """`jnp.argmax(x, axis=-1)` as int32: the index of the largest value (the first of equals). [..., n] -> [...]."""
    return top_k(x, 1)[1][..., 0].astype(jnp.int32)
