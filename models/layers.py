"""The encoder and decoder layers: attention and feed-forward sub-layers wrapped by residual connections.

Shapes: hidden states [batch, length, d_model]; attention keys and values [batch, length,
heads, d_k or d_v]. Self-attention sees positions itself with 'rotary' and 'relative'
encodings (on the queries' and keys' positions); cross-attention never does, as a target
and a source position belong to different sequences.
"""

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.attention import MultiHeadAttention
from models.config import TransformerConfig
from models.precision import float32_accumulating_dot_general

Array = jax.Array
# Per decoder layer: 'self_key' [batch, max_length, heads, d_k] (rotated, with rotary
# positions), 'self_value' [batch, max_length, heads, d_v] (filled up to the current
# position) and 'cross_key', 'cross_value' [batch, src_len, heads, d_k or d_v] (computed
# once from the encoder output).
LayerCache = dict[str, Array]


def add_residual(
    x: Array,
    sublayer: Callable[[Array], Array],
    norm: nn.LayerNorm,
    dropout: nn.Dropout,
    *,
    norm_placement: str,
    deterministic: bool,
) -> Array:
    """Wraps a sub-layer with dropout, a residual connection and LayerNorm.

    post (paper, section 5.4): LN(x + Dropout(sublayer(x)))
    pre: x + Dropout(sublayer(LN(x))); the stack then needs a final LayerNorm.
    """
    if norm_placement == 'pre':
        return x + dropout(sublayer(norm(x)), deterministic=deterministic)
    return norm(x + dropout(sublayer(x), deterministic=deterministic))


def glorot_uniform_init(*logical_axes: str) -> nn.initializers.Initializer:
    """Glorot-uniform weights, their dimensions named for sharding (see training/runtime/sharding.py)."""
    return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), logical_axes)


def _bias_init(logical_axis: str) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), (logical_axis,))


class FeedForward(nn.Module):
    """Position-wise FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (section 3.3). [batch, length, d_model] -> same."""

    d_ff: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d_model = x.shape[-1]
        dense = functools.partial(nn.Dense, dtype=self.dtype, dot_general=float32_accumulating_dot_general)
        hidden = dense(
            self.d_ff, kernel_init=glorot_uniform_init('embed', 'mlp'), bias_init=_bias_init('mlp'), name='hidden'
        )
        output = dense(
            d_model, kernel_init=glorot_uniform_init('mlp', 'embed'), bias_init=_bias_init('embed'), name='output'
        )
        return output(nn.relu(hidden(x)))


def _multi_head_attention(config: TransformerConfig, *, self_attention: bool) -> MultiHeadAttention:
    return MultiHeadAttention(
        config.num_heads,
        config.d_model,
        config.attention_dropout_rate,
        jnp.dtype(config.dtype),
        implementation=config.attention_implementation,
        key_dim=config.d_k,
        positions=config.attention_positions if self_attention else None,
        relative_clip=config.relative_clip,
        relative_values=config.relative_values,
    )


def layer_norm(name: str | None = None) -> nn.LayerNorm:
    """LayerNorm over the last dimension, in float32, its scale and bias named for sharding."""
    # Always float32: normalisation statistics are precision sensitive.
    return nn.LayerNorm(
        epsilon=1e-6,
        dtype=jnp.float32,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ('norm',)),
        bias_init=_bias_init('norm'),
        name=name,
    )


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped by `add_residual`. [batch, src_len, d_model] -> same."""

    config: TransformerConfig

    def setup(self):
        config = self.config
        dtype = jnp.dtype(config.dtype)
        self.self_attention = _multi_head_attention(config, self_attention=True)
        self.self_attention_norm = layer_norm('self_attention_norm')
        self.feed_forward = FeedForward(config.d_ff, dtype)
        self.feed_forward_norm = layer_norm('feed_forward_norm')
        self.dropout = nn.Dropout(config.dropout_rate)

    def __call__(self, x: Array, mask: Array, positions: Array, *, deterministic: bool) -> Array:
        """Runs one encoder layer over whole source sequences.

        Args:
            x: [batch, src_len, d_model] encoder stream.
            mask: broadcastable to [batch, 1, src_len, src_len], the source padding mask (in
                packed rows, the segment mask).
            positions: [batch or 1, src_len] int, for rotary and relative positions.
            deterministic: disables dropout.
        """
        residual = functools.partial(
            add_residual,
            dropout=self.dropout,
            norm_placement=self.config.norm_placement,
            deterministic=deterministic,
        )
        x = residual(
            x,
            lambda h: self.self_attention(
                h, h, mask, deterministic=deterministic, query_positions=positions, key_positions=positions
            ),
            self.self_attention_norm,
        )
        return residual(x, self.feed_forward, self.feed_forward_norm)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder, feed-forward. [batch, tgt_len, d_model] -> same."""

    config: TransformerConfig

    def setup(self):
        config = self.config
        dtype = jnp.dtype(config.dtype)
        self.self_attention = _multi_head_attention(config, self_attention=True)
        self.self_attention_norm = layer_norm('self_attention_norm')
        self.cross_attention = _multi_head_attention(config, self_attention=False)
        self.cross_attention_norm = layer_norm('cross_attention_norm')
        self.feed_forward = FeedForward(config.d_ff, dtype)
        self.feed_forward_norm = layer_norm('feed_forward_norm')
        self.dropout = nn.Dropout(config.dropout_rate)

    def _sublayers(
        self,
        x: Array,
        self_attend: Callable[[Array], Array],
        cross_attend: Callable[[Array], Array],
        *,
        deterministic: bool,
    ) -> Array:
        """The three wrapped sub-layers; `*_attend` map a (normalised) stream to attention outputs."""
        residual = functools.partial(
            add_residual,
            dropout=self.dropout,
            norm_placement=self.config.norm_placement,
            deterministic=deterministic,
        )
        x = residual(x, self_attend, self.self_attention_norm)
        x = residual(x, cross_attend, self.cross_attention_norm)
        return residual(x, self.feed_forward, self.feed_forward_norm)

    def __call__(
        self,
        x: Array,
        encoded: Array,
        self_attention_mask: Array,
        cross_attention_mask: Array,
        positions: Array,
        *,
        deterministic: bool,
    ) -> Array:
        """Runs one decoder layer over a whole target sequence.

        Args:
            x: [batch, tgt_len, d_model] decoder stream.
            encoded: [batch, src_len, d_model] encoder output (keys and values of the
                cross-attention).
            self_attention_mask: broadcastable to [batch, 1, tgt_len, tgt_len].
            cross_attention_mask: broadcastable to [batch, 1, tgt_len, src_len].
            positions: [batch or 1, tgt_len] int, for rotary and relative positions.
            deterministic: disables dropout.
        """
        return self._sublayers(
            x,
            lambda h: self.self_attention(
                h,
                h,
                self_attention_mask,
                deterministic=deterministic,
                query_positions=positions,
                key_positions=positions,
            ),
            lambda h: self.cross_attention(h, encoded, cross_attention_mask, deterministic=deterministic),
            deterministic=deterministic,
        )

    def init_cache(self, encoded: Array, max_length: int) -> LayerCache:
        """The cache before the first step: empty self-attention slots and the cross-attention keys/values of `encoded`.

        Every entry is [batch, heads, length, d_k or d_v] (length: `max_length` slots, or the source's),
        the layout attention's two products read, in the compute dtype they cast to: no step
        transposes or converts a whole cache.
        """
        return {**self.self_cache(encoded.shape[0], max_length), **self.cross_cache(encoded)}

    def self_cache(self, batch: int, max_length: int) -> LayerCache:
        """Empty self-attention slots: 'self_key' and 'self_value', [batch, heads, max_length, d_k or d_v] zeros."""
        config = self.config
        dtype = jnp.dtype(config.dtype)
        return {
            'self_key': jnp.zeros((batch, config.num_heads, max_length, config.d_k), dtype),
            'self_value': jnp.zeros((batch, config.num_heads, max_length, config.d_v), dtype),
        }

    def cross_cache(self, encoded: Array) -> LayerCache:
        """'cross_key' and 'cross_value' [batch, heads, src_len, d_k or d_v] of `encoded` [batch, src_len, d_model]."""
        cross_key, cross_value = self.cross_attention.project_key_value(encoded)
        dtype = jnp.dtype(self.config.dtype)
        return {
            'cross_key': jnp.swapaxes(cross_key, 1, 2).astype(dtype),
            'cross_value': jnp.swapaxes(cross_value, 1, 2).astype(dtype),
        }

    def decode_step(
        self, x: Array, cache: LayerCache, positions: Array, cross_attention_mask: Array
    ) -> tuple[Array, LayerCache]:
        """Runs the layer for one new target position of each row, reading and extending `cache`.

        Args:
            x: [batch, 1, d_model] decoder stream at each row's position.
            cache: from `init_cache` or the previous step. Its cross-attention part may hold a source's
                keys and values once for `copies` consecutive rows (beam search's hypotheses of one
                sentence): [batch / copies, heads, src_len, d].
            positions: [batch] int32, the index of each row's new position (earlier ones are cached).
            cross_attention_mask: broadcastable to [batch / copies, 1, 1, src_len].

        Returns:
            The layer output [batch, 1, d_model] and the cache with each row's new
            self-attention key and value written at its position.
        """
        new_cache = dict(cache)
        # Each row's query and new key sit at its position; the cache's slots hold 0 .. max_length - 1.
        query_positions = positions[:, None]
        slots = jnp.arange(cache['self_key'].shape[2], dtype=jnp.int32)
        rows = jnp.arange(x.shape[0])

        def self_attend(h: Array) -> Array:
            key, value = self.self_attention.project_key_value(h, query_positions)  # [batch, 1, heads, d_k or d_v]
            for name, new in (('self_key', key), ('self_value', value)):
                new_cache[name] = cache[name].at[rows, :, positions].set(new[:, 0].astype(cache[name].dtype))
            # Slots after a row's position are empty (or left by an earlier sentence): the causal mask hides them.
            visible = slots[None, :] <= query_positions  # [batch, max_length]
            # One query a step: the explicit formula (fused kernels gain nothing at q_len 1).
            return self.self_attention.attend(
                h,
                new_cache['self_key'],
                new_cache['self_value'],
                visible[:, None, None, :],
                deterministic=True,
                query_positions=query_positions,
                key_positions=slots[None],
                implementation='explicit',
                heads_first=True,
            )

        def cross_attend(h: Array) -> Array:
            # A source's rows attend to its keys as queries of one row: its keys and values are read once.
            sources = cache['cross_key'].shape[0]
            attended = self.cross_attention.attend(
                h.reshape(sources, -1, h.shape[-1]),
                cache['cross_key'],
                cache['cross_value'],
                cross_attention_mask,
                deterministic=True,
                implementation='explicit',
                heads_first=True,
            )
            return attended.reshape(h.shape)

        return self._sublayers(x, self_attend, cross_attend, deterministic=True), new_cache
