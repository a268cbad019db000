"""Token and positional embeddings (Vaswani et al., 2017, sections 3.4 and 3.5)."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.precision import float32_accumulating_einsum

Array = jax.Array
Dtype = Any


def sinusoidal_positions(length: int, d_model: int) -> np.ndarray:
    """The fixed positional encodings of section 3.5, interleaved as in the paper.

    PE[pos, 2i] = sin(pos / 10000^(2i / d_model))
    PE[pos, 2i + 1] = cos(pos / 10000^(2i / d_model))

    Returns:
        [length, d_model] float32.
    """
    positions = np.arange(length, dtype=np.float64)[:, None]  # [length, 1]
    even_dims = np.arange(0, d_model, 2, dtype=np.float64)  # 2i
    angles = positions / np.power(10000.0, even_dims / d_model)  # [length, ceil(d_model / 2)]
    encoding = np.zeros((length, d_model), dtype=np.float64)
    encoding[:, 0::2] = np.sin(angles)
    encoding[:, 1::2] = np.cos(angles[:, : d_model // 2])  # An odd d_model has one fewer cos.
    return encoding.astype(np.float32)


class TokenEmbedding(nn.Module):
    """Token embedding scaled by sqrt(d_model); `attend` is the tied pre-softmax projection.

    Initialised N(0, 1/d_model) so that the scaled embeddings have unit variance and,
    when tied, the output logits start O(1).

    Attributes:
        vocab_size: number of token ids.
        d_model: embedding width.
        dtype: matmul operand dtype of `attend` (its logits are float32).
    """

    vocab_size: int
    d_model: int
    dtype: Dtype = jnp.float32

    def setup(self):
        self.embedding = self.param(
            'embedding',
            nn.with_logical_partitioning(nn.initializers.normal(stddev=self.d_model**-0.5), ('vocab', 'embed')),
            (self.vocab_size, self.d_model),
            jnp.float32,
        )

    def __call__(self, token_ids: Array) -> Array:
        """Maps [batch, length] int ids to [batch, length, d_model] float32 vectors."""
        return jnp.take(self.embedding, token_ids, axis=0) * jnp.sqrt(jnp.float32(self.d_model))

    def attend(self, hidden: Array) -> Array:
        """Maps [batch, length, d_model] hidden states to [batch, length, vocab] float32 logits."""
        return float32_accumulating_einsum('bld,vd->blv', hidden, self.embedding, dtype=self.dtype)


class PositionalEncoding(nn.Module):
    """Adds positional information to [batch, length, d_model] embeddings.

    Attributes:
        kind: 'sinusoidal' (fixed, section 3.5) or 'learned' (a trained table, which the
            paper reports to perform nearly identically).
        max_len: number of positions in the table; inputs may be at most this long.
    """

    kind: str
    max_len: int

    @nn.compact
    def __call__(self, embeddings: Array, *, offset: Array | int = 0, positions: Array | None = None) -> Array:
        """Adds the encodings of positions offset .. offset + length - 1, or of `positions`, to the embeddings.

        Args:
            embeddings: [batch, length, d_model].
            offset: the position of the first column (incremental decoding).
            positions: [batch, length] int, each token's position within its own
                sequence (0, 1, ... restarting at every sequence of a packed row);
                replaces `offset`. Each must be below max_len.

        Returns:
            [batch, length, d_model] float32.
        """
        length, d_model = embeddings.shape[-2:]
        if positions is None and (
            length > self.max_len or (isinstance(offset, int) and offset + length > self.max_len)
        ):
            raise ValueError(f'Positions up to {offset + length} exceed max_len={self.max_len}.')
        if self.kind == 'sinusoidal':
            table = jnp.asarray(sinusoidal_positions(self.max_len, d_model))
        elif self.kind == 'learned':
            table = self.param(
                'embedding',
                nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), (None, 'embed')),
                (self.max_len, d_model),
                jnp.float32,
            )
        else:
            raise ValueError(f"Unknown positional encoding {self.kind!r}; expected 'sinusoidal' or 'learned'.")
        if positions is not None:
            # Traced positions cannot be checked here; one beyond the table reads NaN
            # (which the train step refuses) rather than a silently clipped row.
            return embeddings + jnp.take(table, positions, axis=0, mode='fill')
        return embeddings + jax.lax.dynamic_slice_in_dim(table, offset, length)[None]
