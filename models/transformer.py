"""The encoder and decoder stacks and the encoder-decoder `Transformer` of "Attention Is All You Need".

Shapes: source ids [batch, src_len], target ids [batch, tgt_len], hidden states
[batch, length, d_model], logits [batch, tgt_len, vocab]. Padding (pad_id) only ever
trails the real tokens. Rows that pack several pairs are described by one `Packing`
(models/packing.py); without it a row is one pair.

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

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.attention import causal_mask, padding_mask, segment_mask
from models.config import TransformerConfig
from models.embeddings import PositionalEncoding, TokenEmbedding
from models.layers import DecoderLayer, EncoderLayer, LayerCache, glorot_uniform_init, layer_norm
from models.packing import Packing
from models.precision import float32_accumulating_dot_general

Array = jax.Array
DecoderCache = dict[str, LayerCache]  # 'layers_{i}' -> LayerCache


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


def _positions_or_range(positions: Array | None, length: int) -> Array:
    """`positions` [batch, length] of packed rows, or 0 .. length - 1 as [1, length] for one sequence a row."""
    return jnp.arange(length, dtype=jnp.int32)[None] if positions is None else positions


class Encoder(nn.Module):
    """Embeds source ids and runs the encoder stack.

    Attributes:
        config: model hyperparameters.
        token_embedding: shared with the decoder when embeddings are tied.
    """

    config: TransformerConfig
    token_embedding: TokenEmbedding

    def setup(self):
        config = self.config
        if config.attention_positions is None:
            self.position_embedding = PositionalEncoding(config.positional_encoding, config.max_len)
        # The name seeds the dropout masks: 'Dropout_0' keeps those of trained runs reproducible.
        self.dropout = nn.Dropout(config.dropout_rate, name='Dropout_0')
        self.layers = [EncoderLayer(config) for _ in range(config.num_encoder_layers)]
        if config.norm_placement == 'pre':
            self.final_norm = layer_norm()

    def __call__(self, inputs: Array, *, packing: Packing | None = None, deterministic: bool) -> Array:
        """Maps source ids [batch, src_len] to encodings [batch, src_len, d_model] float32.

        Args:
            inputs: [batch, src_len] int ids, pad_id-padded.
            packing: for rows that pack several sources (its `source` side is read);
                None for one source a row.
            deterministic: disables dropout.
        """
        config = self.config
        segments = None if packing is None else packing.source
        positions = None if segments is None else segments.positions
        x = self.token_embedding(inputs)
        if config.attention_positions is None:
            x = self.position_embedding(x, positions=positions)
        x = self.dropout(x, deterministic=deterministic)

        if segments is None:
            source_valid = inputs != config.pad_id
            mask = padding_mask(source_valid, source_valid)
        else:
            mask = segment_mask(segments.segment_ids, segments.segment_ids)
        positions = _positions_or_range(positions, inputs.shape[1])
        for layer in self.layers:
            x = layer(x, mask, positions, deterministic=deterministic)
        if config.norm_placement == 'pre':
            x = self.final_norm(x)
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
            self.final_norm = layer_norm()

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
        packing: Packing | None = None,
        deterministic: bool,
    ) -> Array:
        """Computes decoder hidden states.

        Args:
            encoded: [batch, src_len, d_model] encoder output.
            inputs: [batch, src_len] source ids, for the source padding mask (packed rows use
                the source segment ids instead).
            decoder_inputs: [batch, tgt_len] ids starting with bos (in packed rows, each
                sequence starting with bos: `shift_right_per_segment`).
            packing: for rows that pack several pairs; None for one pair a row.
            deterministic: disables dropout.

        Returns:
            [batch, tgt_len, d_model] float32.
        """
        length = decoder_inputs.shape[1]
        positions = None if packing is None else packing.target.positions
        x = self._embed(decoder_inputs, positions=positions, deterministic=deterministic)
        if packing is None:
            # Causal masking alone suffices: padding only trails the real tokens, so real
            # positions never see it, and position 0 (bos) keeps every row non-empty.
            self_attention_mask = causal_mask(length)
            cross_attention_mask = self._cross_attention_mask(inputs, length)
        else:
            target_segment_ids = packing.target.segment_ids
            self_attention_mask = causal_mask(length) & segment_mask(target_segment_ids, target_segment_ids)
            cross_attention_mask = segment_mask(target_segment_ids, packing.source.segment_ids)
        positions = _positions_or_range(positions, length)
        for layer in self.layers:
            x = layer(x, encoded, self_attention_mask, cross_attention_mask, positions, deterministic=deterministic)
        return self._final(x)

    def init_cache(self, encoded: Array, max_length: int) -> DecoderCache:
        """The cache for generating up to `max_length` positions from `encoded` [batch, src_len, d_model]."""
        return {f'layers_{i}': layer.init_cache(encoded, max_length) for i, layer in enumerate(self.layers)}

    def self_cache(self, batch: int, max_length: int) -> DecoderCache:
        """The self-attention part of `init_cache`: every layer's empty slots."""
        return {f'layers_{i}': layer.self_cache(batch, max_length) for i, layer in enumerate(self.layers)}

    def cross_cache(self, encoded: Array) -> DecoderCache:
        """The cross-attention part of `init_cache`: every layer's keys and values of `encoded`."""
        return {f'layers_{i}': layer.cross_cache(encoded) for i, layer in enumerate(self.layers)}

    def decode_step(
        self, inputs: Array, decoder_input: Array, position: Array, cache: DecoderCache
    ) -> tuple[Array, DecoderCache]:
        """Hidden state [batch, 1, d_model] of one new position of each row, and the extended cache.

        Args:
            inputs: [batch, src_len] source ids, for the source padding mask; or [batch / copies, src_len]
                where `copies` consecutive rows share a source, and the cache's cross-attention part too.
            decoder_input: [batch, 1] the id at each row's position (bos at position 0).
            position: [] or [batch] int32, the position of every row or of each.
            cache: from `init_cache` or the previous step.
        """
        positions = jnp.broadcast_to(jnp.asarray(position, jnp.int32), (decoder_input.shape[0],))
        x = self._embed(decoder_input, positions=positions[:, None], deterministic=True)
        cross_attention_mask = self._cross_attention_mask(inputs, 1)
        new_cache = {}
        for i, layer in enumerate(self.layers):
            name = f'layers_{i}'
            x, new_cache[name] = layer.decode_step(x, cache[name], positions, cross_attention_mask)
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
                kernel_init=glorot_uniform_init('embed', 'vocab'),
            )
            source_embedding, target_embedding = self.source_embedding, self.target_embedding
        self.encoder = Encoder(config, source_embedding)
        self.decoder = Decoder(config, target_embedding)

    def encode(
        self,
        inputs: Array,
        *,
        packing: Packing | None = None,
        deterministic: bool,
    ) -> Array:
        """Source ids [batch, src_len] (pad_id-padded) -> encoded [batch, src_len, d_model].

        `packing` describes rows that pack several pairs (its source side is read here).
        """
        return self.encoder(inputs, packing=packing, deterministic=deterministic)

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
        packing: Packing | None = None,
        deterministic: bool,
    ) -> Array:
        """Next-token logits [batch, tgt_len, vocab] float32 for each decoder input position.

        Args:
            encoded: [batch, src_len, d_model] from `encode`.
            inputs: [batch, src_len] source ids, for the source padding mask (packed rows use
                the source segment ids instead).
            decoder_inputs: [batch, tgt_len] ids, already starting with bos_id (in each
                sequence, for packed rows).
            packing: for rows that pack several pairs; None for one pair a row.
            deterministic: disables dropout.
        """
        hidden = self.decoder(encoded, inputs, decoder_inputs, packing=packing, deterministic=deterministic)
        return self._logits(hidden)

    def init_cache(self, encoded: Array, max_length: int) -> DecoderCache:
        """Key/value cache for generating up to `max_length` tokens from `encoded` [batch, src_len, d_model]."""
        return self.decoder.init_cache(encoded, max_length)

    def self_cache(self, batch: int, max_length: int) -> DecoderCache:
        """The self-attention part of `init_cache`: per layer 'self_key', 'self_value' [batch, heads, max_length, d]."""
        return self.decoder.self_cache(batch, max_length)

    def cross_cache(self, encoded: Array) -> DecoderCache:
        """The cross-attention part of `init_cache`: per layer 'cross_key', 'cross_value' [batch, heads, src_len, d]."""
        return self.decoder.cross_cache(encoded)

    def decode_step(
        self, inputs: Array, decoder_input: Array, position: Array, cache: DecoderCache
    ) -> tuple[Array, DecoderCache]:
        """Logits [batch, vocab] for the token after `decoder_input`, and the extended cache.

        Equal to `decode(...)[:, position]` on the whole prefix, at the cost of one position.

        Args:
            inputs: [batch, src_len] source ids, for the source padding mask; or [batch / copies, src_len],
                `copies` consecutive rows sharing a source and its cross-attention keys and values
                (beam search's hypotheses: `Decoder.decode_step`).
            decoder_input: [batch, 1] the id at each row's position (bos_id at position 0).
            position: [] or [batch] int32: rows may be at different positions.
            cache: from `init_cache` or the previous step.
        """
        hidden, cache = self.decoder.decode_step(inputs, decoder_input, position, cache)
        return self._logits(hidden)[:, 0], cache

    def __call__(
        self,
        inputs: Array,
        targets: Array,
        *,
        packing: Packing | None = None,
        deterministic: bool,
    ) -> Array:
        """Teacher-forced logits [batch, tgt_len, vocab]; logits[:, i] predicts targets[:, i].

        Args:
            inputs: [batch, src_len] int32 source ids (pad_id-padded, each sequence ending with eos).
            targets: [batch, tgt_len] int32 target ids (pad_id-padded, each sequence ending with eos).
            packing: for rows that pack several pairs (`Packing.from_batch`); None for one
                pair a row.
            deterministic: disables dropout; otherwise a 'dropout' rng is required.
        """
        encoded = self.encode(inputs, packing=packing, deterministic=deterministic)
        decoder_inputs = _teacher_forced_inputs(targets, packing, self.config.bos_id)
        return self.decode(encoded, inputs, decoder_inputs, packing=packing, deterministic=deterministic)

    def output_states(
        self,
        inputs: Array,
        targets: Array,
        *,
        packing: Packing | None = None,
        deterministic: bool,
    ) -> tuple[Array, Array]:
        """`__call__` short of the output projection, for a loss that computes the logits itself.

        The logits `__call__` returns are `states @ matrix^T` with both operands in config.dtype,
        accumulated in float32 (`TokenEmbedding.attend`); dropout draws the same bits as there.

        Returns:
            states: [batch, tgt_len, d_model] float32, the decoder's final states.
            matrix: [vocab, d_model] float32, the output projection (the shared embedding when tied).
        """
        encoded = self.encode(inputs, packing=packing, deterministic=deterministic)
        decoder_inputs = _teacher_forced_inputs(targets, packing, self.config.bos_id)
        states = self.decoder(encoded, inputs, decoder_inputs, packing=packing, deterministic=deterministic)
        if self.config.tie_embeddings:
            return states, self.shared_embedding.embedding
        return states, self.output_projection.variables['params']['kernel'].T


def _teacher_forced_inputs(targets: Array, packing: Packing | None, bos_id: int) -> Array:
    """The decoder's inputs [batch, tgt_len] for `targets`: shifted right, each sequence starting with bos."""
    if packing is None:
        return shift_right(targets, bos_id)
    return shift_right_per_segment(targets, packing.target.positions, bos_id)
