"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Shapes: source ids [batch, src_len], target ids [batch, tgt_len], hidden states
[batch, length, d_model], logits [batch, tgt_len, vocab]. Padding (pad_id) only ever
trails the real tokens.

Packing: a training row may hold several pairs, described per side by 'segment_ids'
[batch, length] int32 (1, 2, ... per pair, 0 at padding; source segment k is the source
of target segment k) and 'positions' [batch, length] int32 (0, 1, ... restarting in each
segment). With them, every attention stays inside its pair, the decoder input restarts
with bos in each segment, and the positional encodings use the given positions, so each
pair's logits are those it would get in a row of its own. Without them a row is one pair.

Positions: 'sinusoidal' and 'learned' encodings are added to the embeddings (section
3.5); 'rotary' and 'relative' act inside every self-attention instead (models/positions.py),
on the queries' and keys' positions: the encoder's and the decoder's own. Cross-attention
sees no positions there: a target position and a source position are in different
sequences, whose distance (j - i) means nothing (Shaw et al. use relative positions in
self-attention only); the queries still carry their position through the decoder's
self-attention layers.

Precision: parameters, the residual stream, LayerNorm, softmax and logits are float32;
with dtype='bfloat16' the matmul operands are bfloat16 (accumulated in float32), and
the feed-forward biases are rounded to bfloat16 where flax's Dense adds them (so are
their gradients), as in the usual bfloat16 mixed precision.
"""

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from models.attention import MultiHeadAttention, causal_mask, padding_mask, segment_mask
from models.embeddings import PositionalEncoding, TokenEmbedding
from models.precision import float32_accumulating_dot_general

Array = jax.Array
# Per decoder layer: 'self_key' [batch, max_length, heads, d_k] (rotated, with rotary
# positions), 'self_value' [batch, max_length, heads, d_v] (filled up to the current
# position) and 'cross_key', 'cross_value' [batch, src_len, heads, d_k or d_v] (computed
# once from the encoder output).
LayerCache = dict[str, Array]
DecoderCache = dict[str, LayerCache]  # 'layers_{i}' -> LayerCache


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters; validated by the config layer, not here.

    The paper's base model: d_model=512, num_heads=8, d_ff=2048, 6 + 6 layers,
    dropout_rate=0.1, attention_dropout_rate=0, sinusoidal positions, post-LN, tied
    embeddings.
    """

    vocab_size: int
    d_model: int
    num_heads: int  # d_model must be divisible by num_heads.
    d_ff: int
    num_encoder_layers: int
    num_decoder_layers: int
    dropout_rate: float  # On the embedding sums and every sub-layer output.
    attention_dropout_rate: float  # On the attention weights.
    positional_encoding: str  # 'sinusoidal' | 'learned' (added to embeddings) | 'rotary' | 'relative' (in attention).
    max_len: int  # Size of the positions table: the longest source or target.
    norm_placement: str  # 'post' (paper): LN(x + sublayer(x)); 'pre': x + sublayer(LN(x)).
    tie_embeddings: bool  # One matrix for source and target embeddings and the output projection.
    dtype: str  # Matmul compute dtype, 'float32' | 'bfloat16'. Params are always float32.
    key_dim: int = 0  # d_k of each head's queries and keys; 0: d_model // num_heads, as d_v always is.
    relative_clip: int = 16  # 'relative': distances beyond this share one learned vector.
    relative_values: bool = False  # 'relative': relative terms in the values too, not only the keys.
    pad_id: int = 0
    bos_id: int = 2
    # models.attention.ATTENTION_IMPLEMENTATIONS: 'explicit', or jax.nn.dot_product_attention's
    # 'xla' / 'cudnn' where no attention weight is needed (see MultiHeadAttention).
    attention_implementation: str = 'explicit'

    @property
    def d_v(self) -> int:
        """Each head's value size: d_model / h."""
        return self.d_model // self.num_heads

    @property
    def d_k(self) -> int:
        """Each head's query and key size."""
        return self.key_dim or self.d_v

    @property
    def attention_positions(self) -> str | None:
        """What self-attention does with positions: 'rotary', 'relative', or None (added to the embeddings)."""
        return self.positional_encoding if self.positional_encoding in ('rotary', 'relative') else None


def shift_right(targets: Array, bos_id: int) -> Array:
    """Teacher-forcing decoder inputs: [bos, y_0, ..., y_{n-2}] from targets [y_0, ..., y_{n-1}].

    Args:
        targets: [batch, tgt_len] int ids.
        bos_id: id placed at position 0.

    Returns:
        [batch, tgt_len] int ids, so that the prediction at position i sees targets[:, :i].
    """
    bos = jnp.full((targets.shape[0], 1), bos_id, dtype=targets.dtype)
    return jnp.concatenate([bos, targets[:, :-1]], axis=1)


def shift_right_per_segment(targets: Array, positions: Array, bos_id: int) -> Array:
    """`shift_right` within each sequence of packed rows: bos where a sequence starts, not the previous one's end.

    Args:
        targets: [batch, tgt_len] int ids of packed target sequences.
        positions: [batch, tgt_len] int, each token's position within its sequence (0 at its start).
        bos_id: id placed at each sequence's position 0.

    Returns:
        [batch, tgt_len] int ids.
    """
    return jnp.where(positions == 0, jnp.asarray(bos_id, targets.dtype), shift_right(targets, bos_id))


def _check_packing(**packing: Array | None) -> None:
    """Raises ValueError unless the packing arrays are all given (packed rows) or all None (one pair a row)."""
    given = [name for name, array in packing.items() if array is not None]
    if given and len(given) != len(packing):
        missing = [name for name in packing if name not in given]
        raise ValueError(f'Packed rows need {", ".join(packing)} together; missing {", ".join(missing)}.')


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


def _kernel_init(*logical_axes: str) -> nn.initializers.Initializer:
    """Glorot-uniform weights, their dimensions named for sharding (see training/runtime/sharding.py)."""
    return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), logical_axes)


def _bias_init(logical_axis: str) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), (logical_axis,))


class FeedForward(nn.Module):
    """Position-wise FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (section 3.3). [b, l, d_model] -> same."""

    d_ff: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d_model = x.shape[-1]
        dense = functools.partial(nn.Dense, dtype=self.dtype, dot_general=float32_accumulating_dot_general)
        hidden = dense(self.d_ff, kernel_init=_kernel_init('embed', 'mlp'), bias_init=_bias_init('mlp'), name='hidden')
        output = dense(d_model, kernel_init=_kernel_init('mlp', 'embed'), bias_init=_bias_init('embed'), name='output')
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


def _positions_or_range(positions: Array | None, length: int) -> Array:
    """`positions` [batch, length] of packed rows, or 0 .. length - 1 as [1, length] for one sequence a row."""
    return jnp.arange(length, dtype=jnp.int32)[None] if positions is None else positions


def _layer_norm(name: str | None = None) -> nn.LayerNorm:
    # Always float32: normalisation statistics are precision sensitive.
    return nn.LayerNorm(
        epsilon=1e-6,
        dtype=jnp.float32,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ('norm',)),
        bias_init=_bias_init('norm'),
        name=name,
    )


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped by `add_residual`. [b, src, d_model] -> same."""

    config: TransformerConfig

    def setup(self):
        config = self.config
        dtype = jnp.dtype(config.dtype)
        self.self_attention = _multi_head_attention(config, self_attention=True)
        self.self_attention_norm = _layer_norm('self_attention_norm')
        self.feed_forward = FeedForward(config.d_ff, dtype)
        self.feed_forward_norm = _layer_norm('feed_forward_norm')
        self.dropout = nn.Dropout(config.dropout_rate)

    def __call__(self, x: Array, mask: Array, positions: Array, *, deterministic: bool) -> Array:
        """x: [batch, src_len, d_model]; mask: [batch, 1, src_len, src_len], the source padding mask (in
        packed rows, the segment mask); positions: [batch or 1, src_len] int, for rotary and relative positions."""
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
    """Causal self-attention, cross-attention to the encoder, feed-forward. [b, tgt, d_model] -> same."""

    config: TransformerConfig

    def setup(self):
        config = self.config
        dtype = jnp.dtype(config.dtype)
        self.self_attention = _multi_head_attention(config, self_attention=True)
        self.self_attention_norm = _layer_norm('self_attention_norm')
        self.cross_attention = _multi_head_attention(config, self_attention=False)
        self.cross_attention_norm = _layer_norm('cross_attention_norm')
        self.feed_forward = FeedForward(config.d_ff, dtype)
        self.feed_forward_norm = _layer_norm('feed_forward_norm')
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
        """The cache before the first step: cross-attention keys/values of `encoded`, empty self-attention slots."""
        config = self.config
        # Stored in the compute dtype: attention casts keys and values to it anyway.
        dtype = jnp.dtype(config.dtype)
        cross_key, cross_value = self.cross_attention.project_key_value(encoded)
        return {
            'self_key': jnp.zeros((encoded.shape[0], max_length, config.num_heads, config.d_k), dtype),
            'self_value': jnp.zeros((encoded.shape[0], max_length, config.num_heads, config.d_v), dtype),
            'cross_key': cross_key.astype(dtype),
            'cross_value': cross_value.astype(dtype),
        }

    def decode_step(
        self, x: Array, cache: LayerCache, position: Array, cross_attention_mask: Array
    ) -> tuple[Array, LayerCache]:
        """Runs the layer for one new target position, reading and extending `cache`.

        Args:
            x: [batch, 1, d_model] decoder stream at `position`.
            cache: from `init_cache` or the previous step.
            position: [] int32, the index of this position (earlier ones are cached).
            cross_attention_mask: broadcastable to [batch, 1, 1, src_len].

        Returns:
            The layer output [batch, 1, d_model] and the cache with this position's
            self-attention key and value written in.
        """
        new_cache = dict(cache)
        # This step's query and its new key sit at `position`; the cache's slots hold 0 .. max_length - 1.
        query_positions = jnp.full((1, 1), position, jnp.int32)
        key_positions = jnp.arange(cache['self_key'].shape[1], dtype=jnp.int32)[None]

        def self_attend(h: Array) -> Array:
            key, value = self.self_attention.project_key_value(h, query_positions)  # [batch, 1, heads, d_k or d_v]
            for name, new in (('self_key', key), ('self_value', value)):
                new_cache[name] = lax.dynamic_update_slice_in_dim(
                    cache[name], new.astype(cache[name].dtype), position, axis=1
                )
            # Slots after `position` are still empty; the causal mask hides them.
            visible = jnp.arange(cache['self_key'].shape[1]) <= position
            # One query a step: the explicit formula (fused kernels gain nothing at q_len 1).
            return self.self_attention.attend(
                h,
                new_cache['self_key'],
                new_cache['self_value'],
                visible[None, None, None, :],
                deterministic=True,
                query_positions=query_positions,
                key_positions=key_positions,
                implementation='explicit',
            )

        def cross_attend(h: Array) -> Array:
            return self.cross_attention.attend(
                h,
                cache['cross_key'],
                cache['cross_value'],
                cross_attention_mask,
                deterministic=True,
                implementation='explicit',
            )

        return self._sublayers(x, self_attend, cross_attend, deterministic=True), new_cache


class Encoder(nn.Module):
    """Embeds source ids and runs the encoder stack.

    Attributes:
        config: model hyperparameters.
        token_embedding: shared with the decoder when embeddings are tied.
    """

    config: TransformerConfig
    token_embedding: TokenEmbedding

    @nn.compact
    def __call__(
        self,
        inputs: Array,
        *,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        deterministic: bool,
    ) -> Array:
        """Maps source ids [batch, src_len] to encodings [batch, src_len, d_model] float32.

        Args:
            inputs: [batch, src_len] int ids, pad_id-padded.
            segment_ids, positions: [batch, src_len] int, for rows that pack several
                sources (see the module docstring); None for one source a row.
            deterministic: disables dropout.
        """
        config = self.config
        _check_packing(segment_ids=segment_ids, positions=positions)
        x = self.token_embedding(inputs)
        if config.attention_positions is None:
            x = PositionalEncoding(config.positional_encoding, config.max_len, name='position_embedding')(
                x, positions=positions
            )
        x = nn.Dropout(config.dropout_rate)(x, deterministic=deterministic)

        if segment_ids is None:
            source_valid = inputs != config.pad_id
            mask = padding_mask(source_valid, source_valid)
        else:
            mask = segment_mask(segment_ids, segment_ids)
        positions = _positions_or_range(positions, inputs.shape[1])
        for i in range(config.num_encoder_layers):
            x = EncoderLayer(config, name=f'layers_{i}')(x, mask, positions, deterministic=deterministic)
        if config.norm_placement == 'pre':
            x = _layer_norm('final_norm')(x)
        return x


class Decoder(nn.Module):
    """Embeds decoder input ids and runs the decoder stack (without the output projection).

    `__call__` processes whole sequences (training, scoring); `init_cache` and
    `decode_step` generate one position at a time with cached keys and values.

    Attributes:
        config: model hyperparameters.
        token_embedding: shared with the encoder when embeddings are tied.
    """

    config: TransformerConfig
    token_embedding: TokenEmbedding

    def setup(self):
        config = self.config
        if config.attention_positions is None:
            self.position_embedding = PositionalEncoding(config.positional_encoding, config.max_len)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.layers = [DecoderLayer(config) for _ in range(config.num_decoder_layers)]
        if config.norm_placement == 'pre':
            self.final_norm = _layer_norm()

    def _embed(
        self, ids: Array, *, offset: Array | int = 0, positions: Array | None = None, deterministic: bool
    ) -> Array:
        x = self.token_embedding(ids)
        if self.config.attention_positions is None:
            x = self.position_embedding(x, offset=offset, positions=positions)
        return self.dropout(x, deterministic=deterministic)

    def _final(self, x: Array) -> Array:
        return self.final_norm(x) if self.config.norm_placement == 'pre' else x

    def _cross_attention_mask(self, inputs: Array, query_length: int) -> Array:
        # Every decoder position may query the real source tokens; masking padded
        # target queries too would only make their (ignored) logits depend on the
        # source's padding length.
        return padding_mask(jnp.ones((inputs.shape[0], query_length), bool), inputs != self.config.pad_id)

    def __call__(
        self,
        encoded: Array,
        inputs: Array,
        decoder_inputs: Array,
        *,
        inputs_segment_ids: Array | None = None,
        targets_segment_ids: Array | None = None,
        targets_positions: Array | None = None,
        deterministic: bool,
    ) -> Array:
        """Computes decoder hidden states.

        Args:
            encoded: [batch, src_len, d_model] encoder output.
            inputs: [batch, src_len] source ids, for the source padding mask (packed rows use
                inputs_segment_ids instead).
            decoder_inputs: [batch, tgt_len] ids starting with bos (in packed rows, each
                sequence starting with bos: `shift_right_per_segment`).
            inputs_segment_ids: [batch, src_len] int, for packed rows; None for one pair a row.
            targets_segment_ids, targets_positions: [batch, tgt_len] int, for packed rows.
            deterministic: disables dropout.

        Returns:
            [batch, tgt_len, d_model] float32.
        """
        _check_packing(
            inputs_segment_ids=inputs_segment_ids,
            targets_segment_ids=targets_segment_ids,
            targets_positions=targets_positions,
        )
        length = decoder_inputs.shape[1]
        x = self._embed(decoder_inputs, positions=targets_positions, deterministic=deterministic)
        if targets_segment_ids is None:
            # Causal masking alone suffices: padding only trails the real tokens, so real
            # positions never see it, and position 0 (bos) keeps every row non-empty.
            self_attention_mask = causal_mask(length)
            cross_attention_mask = self._cross_attention_mask(inputs, length)
        else:
            self_attention_mask = causal_mask(length) & segment_mask(targets_segment_ids, targets_segment_ids)
            cross_attention_mask = segment_mask(targets_segment_ids, inputs_segment_ids)
        positions = _positions_or_range(targets_positions, length)
        for layer in self.layers:
            x = layer(x, encoded, self_attention_mask, cross_attention_mask, positions, deterministic=deterministic)
        return self._final(x)

    def init_cache(self, encoded: Array, max_length: int) -> DecoderCache:
        """The cache for generating up to `max_length` positions from `encoded` [batch, src_len, d_model]."""
        return {f'layers_{i}': layer.init_cache(encoded, max_length) for i, layer in enumerate(self.layers)}

    def decode_step(
        self, inputs: Array, decoder_input: Array, position: Array, cache: DecoderCache
    ) -> tuple[Array, DecoderCache]:
        """Hidden state [batch, 1, d_model] of one new position, and the extended cache.

        Args:
            inputs: [batch, src_len] source ids, for the source padding mask.
            decoder_input: [batch, 1] the id at `position` (bos at position 0).
            position: [] int32.
            cache: from `init_cache` or the previous step.
        """
        x = self._embed(decoder_input, offset=position, deterministic=True)
        cross_attention_mask = self._cross_attention_mask(inputs, 1)
        new_cache = {}
        for i, layer in enumerate(self.layers):
            name = f'layers_{i}'
            x, new_cache[name] = layer.decode_step(x, cache[name], position, cross_attention_mask)
        return self._final(x), new_cache


class Transformer(nn.Module):
    """Encoder-decoder Transformer returning float32 next-token logits.

    Parameters live under 'shared_embedding' (tied) or 'source_embedding',
    'target_embedding' and 'output_projection' (untied), then 'encoder/layers_{i}/...'
    and 'decoder/layers_{i}/...'.
    """

    config: TransformerConfig

    def setup(self):
        config = self.config
        dtype = jnp.dtype(config.dtype)
        if config.tie_embeddings:
            self.shared_embedding = TokenEmbedding(config.vocab_size, config.d_model, dtype)
            source_embedding = target_embedding = self.shared_embedding
        else:
            self.source_embedding = TokenEmbedding(config.vocab_size, config.d_model, dtype)
            self.target_embedding = TokenEmbedding(config.vocab_size, config.d_model, dtype)
            self.output_projection = nn.Dense(
                config.vocab_size,
                use_bias=False,
                dtype=dtype,
                dot_general=float32_accumulating_dot_general,
                kernel_init=_kernel_init('embed', 'vocab'),
            )
            source_embedding, target_embedding = self.source_embedding, self.target_embedding
        self.encoder = Encoder(config, source_embedding)
        self.decoder = Decoder(config, target_embedding)

    def encode(
        self,
        inputs: Array,
        *,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        deterministic: bool,
    ) -> Array:
        """Source ids [batch, src_len] (pad_id-padded) -> encoded [batch, src_len, d_model].

        `segment_ids` and `positions` [batch, src_len] describe packed rows (module docstring).
        """
        return self.encoder(inputs, segment_ids=segment_ids, positions=positions, deterministic=deterministic)

    def _logits(self, hidden: Array) -> Array:
        if self.config.tie_embeddings:
            logits = self.shared_embedding.attend(hidden)
        else:
            logits = self.output_projection(hidden)
        return logits.astype(jnp.float32)

    def decode(
        self,
        encoded: Array,
        inputs: Array,
        decoder_inputs: Array,
        *,
        inputs_segment_ids: Array | None = None,
        targets_segment_ids: Array | None = None,
        targets_positions: Array | None = None,
        deterministic: bool,
    ) -> Array:
        """Next-token logits [batch, tgt_len, vocab] float32 for each decoder input position.

        Args:
            encoded: [batch, src_len, d_model] from `encode`.
            inputs: [batch, src_len] source ids, for the source padding mask (packed rows use
                inputs_segment_ids instead).
            decoder_inputs: [batch, tgt_len] ids, already starting with bos_id (in each
                sequence, for packed rows).
            inputs_segment_ids: [batch, src_len], targets_segment_ids and targets_positions
                [batch, tgt_len]: for packed rows (module docstring); None for one pair a row.
            deterministic: disables dropout.
        """
        hidden = self.decoder(
            encoded,
            inputs,
            decoder_inputs,
            inputs_segment_ids=inputs_segment_ids,
            targets_segment_ids=targets_segment_ids,
            targets_positions=targets_positions,
            deterministic=deterministic,
        )
        return self._logits(hidden)

    def init_cache(self, encoded: Array, max_length: int) -> DecoderCache:
        """Key/value cache for generating up to `max_length` tokens from `encoded` [batch, src_len, d_model]."""
        return self.decoder.init_cache(encoded, max_length)

    def decode_step(
        self, inputs: Array, decoder_input: Array, position: Array, cache: DecoderCache
    ) -> tuple[Array, DecoderCache]:
        """Logits [batch, vocab] for the token after `decoder_input`, and the extended cache.

        Equal to `decode(...)[:, position]` on the whole prefix, at the cost of one position.

        Args:
            inputs: [batch, src_len] source ids, for the source padding mask.
            decoder_input: [batch, 1] the id at `position` (bos_id at position 0).
            position: [] int32.
            cache: from `init_cache` or the previous step.
        """
        hidden, cache = self.decoder.decode_step(inputs, decoder_input, position, cache)
        return self._logits(hidden)[:, 0], cache

    def __call__(
        self,
        inputs: Array,
        targets: Array,
        *,
        inputs_segment_ids: Array | None = None,
        inputs_positions: Array | None = None,
        targets_segment_ids: Array | None = None,
        targets_positions: Array | None = None,
        deterministic: bool,
    ) -> Array:
        """Teacher-forced logits [batch, tgt_len, vocab]; logits[:, i] predicts targets[:, i].

        Args:
            inputs: [batch, src_len] int32 source ids (pad_id-padded, each sequence ending with eos).
            targets: [batch, tgt_len] int32 target ids (pad_id-padded, each sequence ending with eos).
            inputs_segment_ids, inputs_positions: [batch, src_len] int32;
            targets_segment_ids, targets_positions: [batch, tgt_len] int32: all four for
                rows that pack several pairs (module docstring), or none for one pair a row.
            deterministic: disables dropout; otherwise a 'dropout' rng is required.
        """
        _check_packing(
            inputs_segment_ids=inputs_segment_ids,
            inputs_positions=inputs_positions,
            targets_segment_ids=targets_segment_ids,
            targets_positions=targets_positions,
        )
        encoded = self.encode(
            inputs, segment_ids=inputs_segment_ids, positions=inputs_positions, deterministic=deterministic
        )
        if targets_positions is None:
            decoder_inputs = shift_right(targets, self.config.bos_id)
        else:
            decoder_inputs = shift_right_per_segment(targets, targets_positions, self.config.bos_id)
        return self.decode(
            encoded,
            inputs,
            decoder_inputs,
            inputs_segment_ids=inputs_segment_ids,
            targets_segment_ids=targets_segment_ids,
            targets_positions=targets_positions,
            deterministic=deterministic,
        )
