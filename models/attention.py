"""Scaled dot-product and multi-head attention (Vaswani et al., 2017, section 3.2).

Shape letters: b = batch, q = query length, k = key/value length, h = heads,
d = head_dim (d_k = d_v = d_model // num_heads).
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

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
) -> tuple[Array, Array]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, independently per head.

    Args:
        query: [batch, q_len, heads, head_dim].
        key: [batch, kv_len, heads, head_dim].
        value: [batch, kv_len, heads, head_dim].
        mask: bool, broadcastable to [batch, heads, q_len, kv_len]; True = attend.
            None attends everywhere.
        dropout_rng: PRNG key for dropout on the attention weights; needed only when
            `not deterministic and dropout_rate > 0`.
        dropout_rate: probability of dropping an attention weight.
        deterministic: disables dropout.
        dtype: matmul operand dtype; the logits, softmax and output are float32.

    Returns:
        output: [batch, q_len, heads, head_dim] float32.
        weights: [batch, heads, q_len, kv_len] float32 attention probabilities
            (before dropout), each row summing to 1.
    """
    head_dim = query.shape[-1]
    # Scaling the queries is cheaper than scaling the [q_len, kv_len] logits.
    query = query / jnp.sqrt(jnp.float32(head_dim))
    logits = float32_accumulating_einsum('bqhd,bkhd->bhqk', query, key, dtype=dtype)
    if mask is not None:
        logits = jnp.where(mask, logits, MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1)

    attended_weights = weights
    if not deterministic and dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        attended_weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)

    output = float32_accumulating_einsum('bhqk,bkhd->bqhd', attended_weights, value, dtype=dtype)
    return output, weights


# How `MultiHeadAttention` computes softmax(Q K^T / sqrt(d_k)) V: 'explicit' is
# `dot_product_attention` above; 'xla' and 'cudnn' are `jax.nn.dot_product_attention`'s
# implementations (cuDNN's fused flash attention on NVIDIA GPUs).
ATTENTION_IMPLEMENTATIONS = ('explicit', 'xla', 'cudnn')


def fused_dot_product_attention(
    query: Array, key: Array, value: Array, mask: Array | None, *, implementation: str, dtype: Dtype
) -> Array:
    """`dot_product_attention`'s output through `jax.nn.dot_product_attention`, without weights or dropout.

    Args:
        query: [batch, q_len, heads, head_dim].
        key, value: [batch, kv_len, heads, head_dim].
        mask: bool, broadcastable to [batch, heads, q_len, kv_len]; True = attend.
        implementation: 'xla' or 'cudnn'.
        dtype: the operand dtype (cuDNN needs bfloat16 or float16).

    Returns:
        [batch, q_len, heads, head_dim] float32.
    """
    if mask is not None:
        mask = jnp.broadcast_to(mask, (query.shape[0], mask.shape[1], query.shape[1], key.shape[1]))
    output = jax.nn.dot_product_attention(
        query.astype(dtype), key.astype(dtype), value.astype(dtype), mask=mask, implementation=implementation
    )
    return output.astype(jnp.float32)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The per-head projections W_i^{Q,K,V} [d_model, head_dim] are stored stacked as one
    [d_model, heads, head_dim] kernel each; the concatenation followed by W^O is a
    single contraction over (heads, head_dim). As in the paper, projections have no bias.

    `__call__` is `project_key_value` followed by `attend`; incremental decoding calls
    the two separately so that keys and values are computed once and cached.

    The attention weights are sown into the 'intermediates' collection as
    'attention_weights' [batch, heads, q_len, kv_len]; retrieve them with
    `model.apply(..., mutable=['intermediates'])`.

    Attributes:
        num_heads: h; d_model must be divisible by it.
        d_model: width of the inputs and the output.
        dropout_rate: dropout on the attention weights.
        dtype: matmul operand dtype (outputs are float32).
        implementation: one of ATTENTION_IMPLEMENTATIONS. 'xla' and 'cudnn' apply where
            no attention weight is needed: the explicit formula still runs for attention
            dropout and when the weights are collected (attention maps).
    """

    num_heads: int
    d_model: int
    dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32
    implementation: str = 'explicit'

    def setup(self):
        project_to_heads = functools.partial(
            nn.DenseGeneral,
            features=(self.num_heads, self.d_model // self.num_heads),
            use_bias=False,
            dtype=self.dtype,
            dot_general=float32_accumulating_dot_general,
            kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ('embed', 'heads', 'kv')),
        )
        self.query = project_to_heads()
        self.key = project_to_heads()
        self.value = project_to_heads()
        self.output = nn.DenseGeneral(
            features=self.d_model,
            axis=(-2, -1),
            use_bias=False,
            dtype=self.dtype,
            dot_general=float32_accumulating_dot_general,
            kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ('heads', 'kv', 'embed')),
        )

    def project_key_value(self, inputs_kv: Array) -> tuple[Array, Array]:
        """Per-head keys and values, each [batch, kv_len, heads, head_dim], of [batch, kv_len, d_model]."""
        return self.key(inputs_kv), self.value(inputs_kv)

    def attend(
        self,
        inputs_q: Array,
        key: Array,
        value: Array,
        mask: Array | None,
        *,
        deterministic: bool,
        implementation: str | None = None,
    ) -> Array:
        """Attends from `inputs_q` [batch, q_len, d_model] to projected keys and values.

        Args:
            inputs_q: [batch, q_len, d_model].
            key, value: [batch, kv_len, heads, head_dim] from `project_key_value`.
            mask: bool, broadcastable to [batch, heads, q_len, kv_len]; True = attend.
            deterministic: disables attention dropout.
            implementation: overrides `self.implementation` for this call.

        Returns:
            [batch, q_len, d_model] float32.
        """
        implementation = implementation or self.implementation
        dropout = not deterministic and self.dropout_rate > 0.0
        if implementation != 'explicit' and not dropout and not self.is_mutable_collection('intermediates'):
            heads = fused_dot_product_attention(
                self.query(inputs_q), key, value, mask, implementation=implementation, dtype=self.dtype
            )
            return self.output(heads)
        heads, weights = dot_product_attention(
            self.query(inputs_q),
            key,
            value,
            mask,
            dropout_rng=self.make_rng('dropout') if dropout else None,
            dropout_rate=self.dropout_rate,
            deterministic=deterministic,
            dtype=self.dtype,
        )
        self.sow('intermediates', 'attention_weights', weights)
        return self.output(heads)

    def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Array | None, *, deterministic: bool) -> Array:
        """Attends from `inputs_q` [batch, q_len, d_model] to `inputs_kv` [batch, kv_len, d_model].

        Returns [batch, q_len, d_model] float32.
        """
        key, value = self.project_key_value(inputs_kv)
        return self.attend(inputs_q, key, value, mask, deterministic=deterministic)
