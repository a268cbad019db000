"""`TransformerConfig`: the hyperparameters that every module of the model reads."""

import dataclasses


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
    # 'xla' / 'cudnn' ('cudnn_where_safe': not at shapes of known cuDNN defects) where no
    # attention weight is needed (see MultiHeadAttention).
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
