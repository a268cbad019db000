"""An encoder-only Transformer classifier: the encoder stack, pooled into one vector, then a linear head.

Shapes: token ids [batch, length] (pad_id-padded, padding trailing the real tokens),
encodings [batch, length, d_model], logits [batch, num_classes] float32.

The encoder is `models.transformer.Encoder` (the same layers, embeddings and
positions as the translation model's). Pooling:
  'mean': the mean of the encodings of the real (non-padding) tokens, so padding
          never changes the result;
  'cls':  a [CLS] token (bos_id, its embedding learned) is put before every sequence; its
          encoding, which attends to the whole sentence, is the summary (BERT).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import TransformerConfig
from models.embeddings import TokenEmbedding
from models.precision import float32_accumulating_dot_general
from models.transformer import Encoder

Array = jax.Array
POOLINGS = ('mean', 'cls')


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
    """The encoder's hyperparameters (its decoder fields unused), the number of classes and the pooling."""

    encoder: TransformerConfig
    num_classes: int
    pooling: str = 'mean'  # One of POOLINGS.


def with_cls_token(inputs: Array, cls_id: int) -> Array:
    """[batch, length] ids -> [batch, 1 + length] ids starting with `cls_id`."""
    cls = jnp.full((inputs.shape[0], 1), cls_id, inputs.dtype)
    return jnp.concatenate([cls, inputs], axis=1)


def mean_over_real_tokens(encoded: Array, inputs: Array, pad_id: int) -> Array:
    """[batch, length, d_model] encodings averaged over each row's non-padding tokens -> [batch, d_model].

    A row of padding only (a filler row of a batch) gives zeros rather than 0/0.
    """
    real = (inputs != pad_id).astype(encoded.dtype)[..., None]  # [batch, length, 1]
    return jnp.sum(encoded * real, axis=1) / jnp.maximum(jnp.sum(real, axis=1), 1.0)


class Classifier(nn.Module):
    """Token ids -> class logits. Parameters: 'token_embedding', 'encoder/layers_{i}/...', 'head'.

    The head's kernel is named ('embed', 'classes') for sharding; `config.mesh.rules`
    maps 'classes' to None (replicated): a handful of classes is not worth splitting.
    """

    config: ClassifierConfig

    def setup(self):
        encoder = self.config.encoder
        dtype = jnp.dtype(encoder.dtype)
        self.token_embedding = TokenEmbedding(encoder.vocab_size, encoder.d_model, dtype)
        self.encoder = Encoder(encoder, self.token_embedding)
        self.dropout = nn.Dropout(encoder.dropout_rate)
        self.head = nn.Dense(
            self.config.num_classes,
            dtype=dtype,
            dot_general=float32_accumulating_dot_general,
            kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ('embed', 'classes')),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ('classes',)),
        )

    def encoder_inputs(self, inputs: Array) -> Array:
        """The ids the encoder reads: `inputs`, after a [CLS] (bos_id) token with 'cls' pooling."""
        if self.config.pooling == 'cls':
            return with_cls_token(inputs, self.config.encoder.bos_id)
        return inputs

    def pool(self, encoded: Array, encoder_inputs: Array) -> Array:
        """[batch, length, d_model] -> [batch, d_model] as config.pooling says."""
        if self.config.pooling == 'cls':
            return encoded[:, 0]
        return mean_over_real_tokens(encoded, encoder_inputs, self.config.encoder.pad_id)

    def __call__(self, inputs: Array, *, deterministic: bool) -> Array:
        """Logits [batch, num_classes] float32 of token ids [batch, length] (each ending with eos).

        Args:
            inputs: [batch, length] int32, pad_id-padded.
            deterministic: disables dropout; otherwise a 'dropout' rng is required.
        """
        encoder_inputs = self.encoder_inputs(inputs)
        encoded = self.encoder(encoder_inputs, deterministic=deterministic)
        pooled = self.dropout(self.pool(encoded, encoder_inputs), deterministic=deterministic)
        return self.head(pooled).astype(jnp.float32)
