"""Scaled dot-product and multi-head attention (Vaswani et al., 2017, section 3.2).

Shape letters: b = batch, q = query length, k = key/value length, h = heads,
d = head_dim (d_v = d_model // num_heads; d_k the same unless key_dim says otherwise).

Self-attention may see positions itself (models/positions.py): rotary positions rotate
its queries and keys, relative positions add learned terms of the clipped distance to
its logits (and values).
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.positions import RelativePositions, RelativeTerms, relative_logits, relative_values, rotate
from models.precision import float32_accumulating_dot_general, float32_accumulating_einsum

Array = jax.Array
Dtype = Any

# Masked logits get the most negative finite float32 rather than -inf: exp() of it
# underflows to exactly 0, yet a row whose keys are all masked (a padded query)
# yields a uniform distribution instead of NaN.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


# --------------------------------------------------------------------------- #
# Masks: boolean, True = may attend, broadcastable to [batch, heads, q_len, kv_len].
# --------------------------------------------------------------------------- #


def padding_mask(query_tokens_valid: Array, key_tokens_valid: Array) -> Array:
    """Lets valid queries attend to valid keys.

    Args:
        query_tokens_valid: [batch, q_len] bool, False at padding.
        key_tokens_valid: [batch, kv_len] bool, False at padding.

    Returns:
        [batch, 1, q_len, kv_len] bool.
    """
    return query_tokens_valid[:, None, :, None] & key_tokens_valid[:, None, None, :]


def causal_mask(length: int) -> Array:
    """Lets position i attend to positions j <= i. Returns [1, 1, length, length] bool."""
    return jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))[None, None]


def segment_mask(query_segment_ids: Array, key_segment_ids: Array) -> Array:
    """Lets each query attend to the keys of its own segment, in rows that pack several sequences.

    Segments are numbered 1, 2, ... within a row and 0 marks padding, which no query
    may attend to: a padded query's row is all False (MASK_VALUE keeps it finite).
    Segment k of the query row meets segment k of the key row, so the same mask
    serves self-attention and cross-attention (target segment k to source segment k).

    Args:
        query_segment_ids: [batch, q_len] int.
        key_segment_ids: [batch, kv_len] int.

    Returns:
        [batch, 1, q_len, kv_len] bool.
    """
    same_segment = query_segment_ids[:, None, :, None] == key_segment_ids[:, None, None, :]
    return same_segment & (key_segment_ids != 0)[:, None, None, :]


# --------------------------------------------------------------------------- #
# Attention.
# --------------------------------------------------------------------------- #


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Array | None,
    *,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dtype: Dtype = jnp.float32,
    relative: RelativeTerms | None = None,
    heads_first: bool = False,
) -> tuple[Array, Array]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, independently per head.

    With `relative`, Shaw et al.'s: e_ij = q_i . (k_j + a^K_ij) / sqrt(d_k) and
    z_i = sum_j alpha_ij (v_j + a^V_ij).

    Args:
        query: [batch, q_len, heads, d_k].
        key: [batch, kv_len, heads, d_k], or [batch, heads, kv_len, d_k] with `heads_first`.
        value: [batch, kv_len, heads, d_v], or [batch, heads, kv_len, d_v] with `heads_first`.
        mask: bool, broadcastable to [batch, heads, q_len, kv_len]; True = attend.
            None attends everywhere.
        dropout_rng: PRNG key for dropout on the attention weights; needed only when
            `not deterministic and dropout_rate > 0`.
        dropout_rate: probability of dropping an attention weight.
        deterministic: disables dropout.
        dtype: matmul operand dtype; the logits, softmax and output are float32.
        relative: relative position tables and distances (models/positions.py), or None.
        heads_first: keys and values laid out as both products read them, batch and heads
            leading: a decoder's cache, which would otherwise be transposed whole at every step.

    Returns:
        output: [batch, q_len, heads, d_v] float32.
        weights: [batch, heads, q_len, kv_len] float32 attention probabilities
            (before dropout), each row summing to 1.
    """
    head_dim = query.shape[-1]
    # Scaling the queries is cheaper than scaling the [q_len, kv_len] logits.
    query = query / jnp.sqrt(jnp.float32(head_dim))
    kv = 'bhkd' if heads_first else 'bkhd'
    logits = float32_accumulating_einsum(f'bqhd,{kv}->bhqk', query, key, dtype=dtype)
    if relative is not None:
        logits = logits + relative_logits(query, relative.key_table, relative.distances, dtype=dtype)
    if mask is not None:
        logits = jnp.where(mask, logits, MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1)

    attended_weights = weights
    if not deterministic and dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        attended_weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)

    output = float32_accumulating_einsum(f'bhqk,{kv}->bqhd', attended_weights, value, dtype=dtype)
    if relative is not None and relative.value_table is not None:
        output = output + relative_values(attended_weights, relative.value_table, relative.distances, dtype=dtype)
    return output, weights


# How `MultiHeadAttention` computes softmax(Q K^T / sqrt(d_k)) V: 'explicit' is
# `dot_product_attention` above; 'xla' and 'cudnn' are `jax.nn.dot_product_attention`'s
# implementations (cuDNN's fused flash attention on NVIDIA GPUs); 'cudnn_where_safe' is
# 'cudnn' except at the key lengths of `cudnn_has_known_defect`, where it is 'explicit'
# (what config 'auto' resolves to on GPUs: models/build.py).
ATTENTION_IMPLEMENTATIONS = ('explicit', 'xla', 'cudnn', 'cudnn_where_safe')

# cuDNN's sm90 flash-attention backward, given a mask tensor (as this model always passes),
# scores the out-of-range half of the last 128-wide key tile 0 instead of -inf when the key
# length is 64 mod 128: a query row whose log-sum-exp is below -log(float32 max) then
# overflows and dQ turns NaN. Seen with cuDNN 9.19 and 9.20 on H100 and H200 (also reported
# against PyTorch's SDPA); no release is known to fix it, so the rule holds for every version.
_CUDNN_KEY_TILE = 128
_CUDNN_DEFECTIVE_KEY_REMAINDER = 64


def cudnn_has_known_defect(key_length: int) -> bool:
    """Whether cuDNN's fused attention is known to fail at this key length (see above)."""
    return key_length % _CUDNN_KEY_TILE == _CUDNN_DEFECTIVE_KEY_REMAINDER


def fused_dot_product_attention(
    query: Array, key: Array, value: Array, mask: Array | None, *, implementation: str, dtype: Dtype
) -> Array:
    """`dot_product_attention`'s output through `jax.nn.dot_product_attention`, without weights or dropout.

    No query row without a key reaches the kernel. Padding leaves such rows in every batch
    (a padded query may attend to nothing), and a fused kernel turns the boolean mask into a
    large negative bias, so such a row's log-sum-exp is about -2^41: cuDNN's backward then
    overflows on some shapes. Those rows are handed every key instead, and their output is
    replaced by what the explicit formula gives them, the mean of the values (a uniform
    softmax over equal logits). Rows with a key see exactly the mask they were given.

    Args:
        query: [batch, q_len, heads, head_dim].
        key, value: [batch, kv_len, heads, head_dim].
        mask: bool, broadcastable to [batch, heads, q_len, kv_len]; True = attend.
        implementation: 'xla' or 'cudnn'.
        dtype: the operand dtype (cuDNN needs bfloat16 or float16).

    Returns:
        [batch, q_len, heads, head_dim] float32.
    """
    query, key, value = query.astype(dtype), key.astype(dtype), value.astype(dtype)
    has_key = None
    if mask is not None:
        mask = jnp.broadcast_to(mask, (query.shape[0], mask.shape[1], query.shape[1], key.shape[1]))
        has_key = jnp.any(mask, axis=-1, keepdims=True)  # [batch, heads or 1, q_len, 1]
        mask = mask | ~has_key
    output = jax.nn.dot_product_attention(query, key, value, mask=mask, implementation=implementation)
    output = output.astype(jnp.float32)
    if has_key is None:
        return output
    mean_value = jnp.mean(value.astype(jnp.float32), axis=1, keepdims=True)  # [batch, 1, heads, head_dim]
    return jnp.where(jnp.swapaxes(has_key, 1, 2), output, mean_value)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The per-head projections W_i^{Q,K} [d_model, d_k] and W_i^V [d_model, d_v] are stored
    stacked as one [d_model, heads, d_k or d_v] kernel each; the concatenation followed by
    W^O is a single contraction over (heads, d_v). As in the paper, projections have no bias.

    `__call__` is `project_key_value` followed by `attend`; incremental decoding calls
    the two separately so that keys and values are computed once and cached.

    The attention weights are sown into the 'intermediates' collection as
    'attention_weights' [batch, heads, q_len, kv_len]; retrieve them with
    `model.apply(..., mutable=['intermediates'])`.

    With `positions` 'rotary' or 'relative', the methods take the positions of the
    queries and keys ([batch, length] int, each token's position within its own
    sequence): keys are rotated as they are projected (so a cache holds rotated keys),
    queries as they attend.

    Attributes:
        num_heads: h; d_model must be divisible by it.
        d_model: width of the inputs and the output.
        dropout_rate: dropout on the attention weights.
        dtype: matmul operand dtype (outputs are float32).
        implementation: one of ATTENTION_IMPLEMENTATIONS. The fused ones apply where
            no attention weight is needed and d_k = d_v without relative positions: the
            explicit formula still runs for attention dropout, relative positions, a
            smaller key size, and when the weights are collected (attention maps).
        key_dim: d_k of each head's queries and keys; 0: d_v = d_model // num_heads.
        positions: None (the attention sees no positions), 'rotary' or 'relative'.
        relative_clip: the largest relative distance told apart ('relative').
        relative_values: also add relative terms to the values ('relative').
    """

    num_heads: int
    d_model: int
    dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32
    implementation: str = 'explicit'
    key_dim: int = 0
    positions: str | None = None
    relative_clip: int = 16
    relative_values: bool = False

    def setup(self):
        value_dim = self.d_model // self.num_heads
        key_dim = self.key_dim or value_dim
        project_to_heads = functools.partial(
            nn.DenseGeneral,
            use_bias=False,
            dtype=self.dtype,
            dot_general=float32_accumulating_dot_general,
            kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ('embed', 'heads', 'kv')),
        )
        self.query = project_to_heads((self.num_heads, key_dim))
        self.key = project_to_heads((self.num_heads, key_dim))
        self.value = project_to_heads((self.num_heads, value_dim))
        if self.positions == 'relative':
            self.relative_positions = RelativePositions(
                self.relative_clip, key_dim, value_dim if self.relative_values else 0
            )
        self.output = nn.DenseGeneral(
            features=self.d_model,
            axis=(-2, -1),
            use_bias=False,
            dtype=self.dtype,
            dot_general=float32_accumulating_dot_general,
            kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ('heads', 'kv', 'embed')),
        )

    def project_key_value(self, inputs_kv: Array, key_positions: Array | None = None) -> tuple[Array, Array]:
        """Per-head keys [batch, kv_len, heads, d_k] and values [batch, kv_len, heads, d_v] of [batch, kv_len, d_model].

        `key_positions` [batch, kv_len] int: needed with rotary positions, which rotate the keys.
        """
        key = self.key(inputs_kv)
        if self.positions == 'rotary':
            key = rotate(key, key_positions)
        return key, self.value(inputs_kv)

    def attend(
        self,
        inputs_q: Array,
        key: Array,
        value: Array,
        mask: Array | None,
        *,
        deterministic: bool,
        query_positions: Array | None = None,
        key_positions: Array | None = None,
        implementation: str | None = None,
        heads_first: bool = False,
    ) -> Array:
        """Attends from `inputs_q` [batch, q_len, d_model] to projected keys and values.

        Args:
            inputs_q: [batch, q_len, d_model].
            key: [batch, kv_len, heads, d_k] and value: [batch, kv_len, heads, d_v] from `project_key_value`,
                or [batch, heads, kv_len, d_k or d_v] with `heads_first` (a decoder's cache).
            mask: bool, broadcastable to [batch, heads, q_len, kv_len]; True = attend.
            deterministic: disables attention dropout.
            query_positions: [batch, q_len] int; needed with rotary and relative positions.
            key_positions: [batch, kv_len] int; needed with relative positions.
            implementation: overrides `self.implementation` for this call.
            heads_first: the layout of `key` and `value`; the explicit formula reads it directly.

        Returns:
            [batch, q_len, d_model] float32.
        """
        query = self.query(inputs_q)
        if self.positions == 'rotary':
            query = rotate(query, query_positions)
        implementation = implementation or self.implementation
        if implementation == 'cudnn_where_safe':
            implementation = 'explicit' if cudnn_has_known_defect(key.shape[1]) else 'cudnn'
        dropout = not deterministic and self.dropout_rate > 0.0
        fused = (
            implementation != 'explicit'
            and not heads_first
            and not dropout
            and self.positions != 'relative'
            and query.shape[-1] == value.shape[-1]
            and not self.is_mutable_collection('intermediates')
        )
        if fused:
            heads = fused_dot_product_attention(
                query, key, value, mask, implementation=implementation, dtype=self.dtype
            )
            return self.output(heads)
        relative = None
        if self.positions == 'relative':
            relative = self.relative_positions(query_positions, key_positions)
        heads, weights = dot_product_attention(
            query,
            key,
            value,
            mask,
            dropout_rng=self.make_rng('dropout') if dropout else None,
            dropout_rate=self.dropout_rate,
            deterministic=deterministic,
            dtype=self.dtype,
            relative=relative,
            heads_first=heads_first,
        )
        self.sow('intermediates', 'attention_weights', weights)
        return self.output(heads)

    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array,
        mask: Array | None,
        *,
        deterministic: bool,
        query_positions: Array | None = None,
        key_positions: Array | None = None,
    ) -> Array:
        """Attends from `inputs_q` [batch, q_len, d_model] to `inputs_kv` [batch, kv_len, d_model].

        `query_positions` [batch, q_len] and `key_positions` [batch, kv_len] int: needed with positions.
        Returns [batch, q_len, d_model] float32.
        """
        key, value = self.project_key_value(inputs_kv, key_positions)
        return self.attend(
            inputs_q,
            key,
            value,
            mask,
            deterministic=deterministic,
            query_positions=query_positions,
            key_positions=key_positions,
        )
