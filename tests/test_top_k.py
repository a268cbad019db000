"""models/top_k.py gives lax.top_k's and jnp.argmax's exact results, ties included, selecting over blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import top_k


@pytest.mark.parametrize("shape", [(5, 8000), (3, 4, 8000), (6, 360), (2, 7919)])
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_and_argmax_equal_lax_and_numpy(shape, ties):
    """The same values and indices, where values repeat (ties broken by the lower index) or not; a prime width too."""
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    if ties:
        x = np.round(x * 2) / 2  # A few distinct values: every row's largest repeat, within and across blocks.
    for k in (1, 2, 8, 40):
        values, indices = jax.jit(top_k.top_k, static_argnums=1)(x, k)
        expected_values, expected_indices = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(values, expected_values)
        np.testing.assert_array_equal(indices, expected_indices)
    np.testing.assert_array_equal(jax.jit(top_k.argmax)(x), np.argmax(x, axis=-1))


def test_top_k_selects_over_blocks_not_the_whole_row():
    """At a vocabulary's width no selection (lax.top_k) sees the whole row: the point of the module."""
    jaxpr = jax.make_jaxpr(lambda x: top_k.top_k(x, 8))(jnp.zeros((4, 8000)))
    widths = [eqn.invars[0].aval.shape[-1] for eqn in jaxpr.eqns if eqn.primitive is jax.lax.top_k_p]
    assert widths and max(widths) <= 2 * int(np.sqrt(8 * 8000)), widths


def test_block_size_divides_and_falls_back():
    assert top_k.block_size(8000, 8) == 32  # 250 block maxima, then 8 x 32 values.
    assert 8000 % top_k.block_size(8000, 1) == 0
    assert top_k.block_size(7919, 8) == 1  # A prime width has no blocks: lax.top_k itself.
