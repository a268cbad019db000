"""Positions inside attention: rotary (Su et al., 2021) and relative (Shaw, Uszkoreit and Vaswani, 2018).

Unlike Vaswani et al.'s positional encodings, which are added to the embeddings once
(models/embeddings.py), these act on each self-attention's queries and keys, and see
only the difference between a query's and a key's position: shifting every position
by the same offset leaves the attention unchanged.

Shape letters: b = batch, q = query length, k = key/value length, h = heads,
d = the per-head size of the vectors (d_k for queries and keys, d_v for values),
r = 2 * clip + 1 relative distances. Positions are [batch, length] int, each token's
position within its own sequence (0, 1, ... restarting in each segment of a packed row);
a batch dimension of 1 broadcasts.
"""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.precision import float32_accumulating_einsum

Array = jax.Array

ROTARY_BASE = 10_000.0


# --------------------------------------------------------------------------- #
# Rotary positions.
# --------------------------------------------------------------------------- #


def rotary_angles(positions: Array, dim: int) -> Array:
    """m * theta_i with theta_i = 10000^(-2i / dim), i = 0 .. dim / 2 - 1 (Su et al., 2021, eq. 15).

    Args:
        positions: [..., length] int.
        dim: the even size of the rotated vectors.

    Returns:
        [..., length, dim / 2] float32.
    """
    inverse_frequencies = np.power(ROTARY_BASE, -np.arange(0, dim, 2, dtype=np.float64) / dim).astype(np.float32)
    return positions[..., None].astype(jnp.float32) * inverse_frequencies


def rotate(x: Array, positions: Array) -> Array:
    """RoPE: rotates each pair (x_2i, x_2i+1) of every head's vector by the angle m * theta_i at position m.

    The pairs interleave, as in Su et al.'s block-diagonal rotation matrix R^d_{Theta,m}
    (eq. 15) and as models/embeddings.py interleaves sin and cos. (The half-split pairing
    (x_i, x_i+dim/2) of GPT-NeoX and LLaMA is the same up to a fixed permutation of the
    query and key projections' output units: no different model.) Then
    <rotate(q, m), rotate(k, n)> = q^T R^d_{Theta,n-m} k depends on the positions only
    through n - m.

    Args:
        x: [batch, length, heads, dim] queries or keys; dim even.
        positions: [batch, length] int.

    Returns:
        [batch, length, heads, dim] float32.
    """
    angles = rotary_angles(positions, x.shape[-1])[:, :, None, :]  # [b, length, 1, dim / 2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


# --------------------------------------------------------------------------- #
# Relative position representations.
# --------------------------------------------------------------------------- #


def relative_distances(query_positions: Array, key_positions: Array, clip: int) -> Array:
    """Each (query, key)'s index into the relative tables: clip(j - i, -clip, clip) + clip (Shaw et al., eq. 5).

    Args:
        query_positions: [batch, q_len] int, positions i of the queries.
        key_positions: [batch, kv_len] int, positions j of the keys.
        clip: k, the largest distance told apart.

    Returns:
        [batch, q_len, kv_len] int32 in [0, 2 * clip].
    """
    distance = key_positions[:, None, :] - query_positions[:, :, None]
    return (jnp.clip(distance, -clip, clip) + clip).astype(jnp.int32)


def gather_by_distance(per_distance: Array, distances: Array) -> Array:
    """Spreads one value per relative distance over the keys.

    out[b, h, i, j] = per_distance[b, h, i, distances[b, i, j]].

    Args:
        per_distance: [batch, heads, q_len, 2 * clip + 1].
        distances: [batch, q_len, kv_len] from `relative_distances`.

    Returns:
        [batch, heads, q_len, kv_len].
    """
    return jnp.take_along_axis(per_distance, distances[:, None], axis=-1)


def sum_by_distance(per_key: Array, distances: Array, num_distances: int) -> Array:
    """Sums the values of the keys at each relative distance.

    out[b, h, i, r] = sum over j with distances[b, i, j] = r of per_key[b, h, i, j].

    The transpose (adjoint) of `gather_by_distance`, computed as such: XLA emits the same
    batched scatter-add that the gather's gradient uses, several times faster on CPU than a
    one-hot matmul or an indexed `.at[].add`.

    Args:
        per_key: [batch, heads, q_len, kv_len].
        distances: [batch, q_len, kv_len] from `relative_distances`.
        num_distances: 2 * clip + 1.

    Returns:
        [batch, heads, q_len, num_distances].
    """
    per_distance = jax.ShapeDtypeStruct((*per_key.shape[:-1], num_distances), per_key.dtype)
    (sums,) = jax.linear_transpose(functools.partial(gather_by_distance, distances=distances), per_distance)(per_key)
    return sums


def relative_logits(query: Array, key_table: Array, distances: Array, *, dtype) -> Array:
    """The relative terms q_i . a^K_ij of the attention logits (Shaw et al., eq. 4), for every query and key.

    Computed as q_i . a^K_r for the 2 * clip + 1 distances r, then gathered by distance,
    rather than by materialising a [q_len, kv_len, d_k] table of a^K_ij.

    Args:
        query: [batch, q_len, heads, d_k] (already scaled by 1 / sqrt(d_k) where wanted).
        key_table: [2 * clip + 1, d_k], a^K of each clipped distance, shared by the heads.
        distances: [batch, q_len, kv_len] from `relative_distances`.
        dtype: matmul operand dtype.

    Returns:
        [batch, heads, q_len, kv_len] float32.
    """
    per_distance = float32_accumulating_einsum('bqhd,rd->bhqr', query, key_table, dtype=dtype)
    return gather_by_distance(per_distance, distances)


def relative_values(weights: Array, value_table: Array, distances: Array, *, dtype) -> Array:
    """The relative terms sum_j alpha_ij a^V_ij of the attention outputs (Shaw et al., eq. 3).

    The weights are first summed into the 2 * clip + 1 distance buckets, then one small
    matmul with the table, rather than materialising a [q_len, kv_len, d_v] table of a^V_ij.

    Args:
        weights: [batch, heads, q_len, kv_len] attention weights alpha.
        value_table: [2 * clip + 1, d_v], a^V of each clipped distance, shared by the heads.
        distances: [batch, q_len, kv_len] from `relative_distances`.
        dtype: matmul operand dtype.

    Returns:
        [batch, q_len, heads, d_v] float32.
    """
    per_distance = sum_by_distance(weights, distances, value_table.shape[0])
    return float32_accumulating_einsum('bhqr,rd->bqhd', per_distance, value_table, dtype=dtype)


class RelativeTerms(NamedTuple):
    """What `dot_product_attention` needs to add Shaw et al.'s relative terms to one attention."""

    distances: Array  # [batch, q_len, kv_len] int32 from `relative_distances`.
    key_table: Array  # a^K [2 * clip + 1, d_k].
    value_table: Array | None  # a^V [2 * clip + 1, d_v], or None for keys only.


class RelativePositions(nn.Module):
    """The learned tables a^K [2 * clip + 1, d_k] and (optionally) a^V [2 * clip + 1, d_v] of one attention.

    As in Shaw et al., the tables are shared by the heads of the attention (one pair per
    layer and attention), and distances beyond `clip` share the tables' first or last row.

    Attributes:
        clip: k, the largest distance told apart.
        key_dim: d_k.
        value_dim: d_v; 0 for keys only.
    """

    clip: int
    key_dim: int
    value_dim: int = 0

    @nn.compact
    def __call__(self, query_positions: Array, key_positions: Array) -> RelativeTerms:
        """The tables, and the distances of queries at `query_positions` [batch, q_len] int to keys at
        `key_positions` [batch, kv_len] int."""
        # Glorot-uniform as in the projections (tensor2tensor's tables use a unit-scaling uniform of
        # the same order); the distance axis is replicated, the vector axis named like head_dim.
        init = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), (None, 'kv'))
        num_distances = 2 * self.clip + 1
        key_table = self.param('key', init, (num_distances, self.key_dim), jnp.float32)
        value_table = (
            self.param('value', init, (num_distances, self.value_dim), jnp.float32) if self.value_dim else None
        )
        return RelativeTerms(relative_distances(query_positions, key_positions, self.clip), key_table, value_table)
