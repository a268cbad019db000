"""A trained model as a CTranslate2 `TransformerSpec`, filled through CTranslate2's own spec API.

How this project's Transformer maps onto it (models/transformer.py):
  - Pre-LN (`pre_norm`, with a final LayerNorm after each stack) or the paper's post-LN;
    LayerNorm epsilon 1e-6 (`layer_norm_epsilon`); ReLU; no projection biases.
  - Token embeddings times sqrt(d_model) (`scale_embeddings`) plus the positions table,
    given explicitly (`position_encodings.encodings`): this project's interleaved sinusoids
    or its learned table, so no reordering is needed (CTranslate2's own sinusoids differ).
    Relative positions (Shaw et al.) are CTranslate2's `relative_position_keys` and `_values`
    of every self-attention: tables shared by the heads, clipped at (rows - 1) / 2, the values'
    table zero where this project adds relative terms to the keys only. Rotary positions are its
    `rotary_dim` 0 (every unit), interleaved pairs, base 10,000, in every self-attention.
  - The vocabulary is the SentencePiece pieces in id order. Sources get <eos> appended and
    no <bos> (`add_source_eos`), as `translate.py` encodes them; the decoder starts from
    <bos> (`decoder_start_token`).
  - This project never generates <pad> or <bos> (models/search.py sets their logits to
    -1e9): the output projection's bias is -1e9 there and 0 elsewhere, the same rule inside
    the network, for every decoding method CTranslate2 offers.
"""

from collections.abc import Sequence

import numpy as np
from ctranslate2.specs import common_spec, transformer_spec

from common.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from exporting.network import Attention, Layer, Network, Norm, Stack
from models.positions import ROTARY_BASE

PROJECT_LAYER_NORM_EPSILON = 1e-6  # models/layers.py `layer_norm`.
NEVER_GENERATED_BIAS = -1.0e9  # models/search.py NEG_INF, for <pad> and <bos>.


def _set_norm(spec: common_spec.LayerNormSpec, norm: Norm) -> None:
    spec.gamma = norm.scale
    spec.beta = norm.bias


def _set_linear(spec: common_spec.LinearSpec, *kernels: np.ndarray, bias: np.ndarray | None = None) -> None:
    """`spec` as y = x @ concat(kernels) (+ bias): CTranslate2 stores weights [outputs, inputs]."""
    spec.weight = np.concatenate([kernel.T for kernel in kernels], axis=0)
    if bias is not None:
        spec.bias = bias


def _set_attention(spec, attention: Attention, norm: Norm, *, self_attention: bool) -> None:
    """Self-attention fuses query, key and value into one product; cross-attention key and value."""
    _set_norm(spec.layer_norm, norm)
    if self_attention:
        _set_linear(spec.linear[0], attention.query, attention.key, attention.value)
    else:
        _set_linear(spec.linear[0], attention.query)
        _set_linear(spec.linear[1], attention.key, attention.value)
    _set_linear(spec.linear[-1], attention.output)
    if attention.relative_keys is not None:
        spec.relative_position_keys = attention.relative_keys
        spec.relative_position_values = attention.relative_values


def _set_layer(spec, layer: Layer) -> None:
    _set_attention(spec.self_attention, layer.self_attention, layer.self_attention_norm, self_attention=True)
    if layer.cross_attention is not None:
        _set_attention(spec.attention, layer.cross_attention, layer.cross_attention_norm, self_attention=False)
    ff = layer.feed_forward
    _set_norm(spec.ffn.layer_norm, layer.feed_forward_norm)
    _set_linear(spec.ffn.linear_0, ff.hidden, bias=ff.hidden_bias)
    _set_linear(spec.ffn.linear_1, ff.output, bias=ff.output_bias)


def _set_stack(spec, stack: Stack, embeddings: common_spec.EmbeddingsSpec, max_len: int) -> None:
    embeddings.weight = stack.embedding
    spec.scale_embeddings = True
    if stack.positions is not None:
        spec.position_encodings.encodings = stack.positions
    elif hasattr(spec, "position_encodings"):
        # Rotary positions: CTranslate2's encoder keeps a positions layer, which would add sinusoids of its
        # own; a table of zeros adds nothing.
        spec.position_encodings.encodings = np.zeros((max_len, stack.embedding.shape[1]), np.float32)
    for layer_spec, layer in zip(spec.layer, stack.layers, strict=True):
        _set_layer(layer_spec, layer)
    if stack.final_norm is not None:
        _set_norm(spec.layer_norm, stack.final_norm)


def _output_bias(vocab_size: int) -> np.ndarray:
    bias = np.zeros(vocab_size, np.float32)
    bias[[PAD_ID, BOS_ID]] = NEVER_GENERATED_BIAS
    return bias


def transformer_spec_of(network: Network, pieces: Sequence[str]) -> transformer_spec.TransformerSpec:
    """The validated CTranslate2 spec of `network`, its vocabulary `pieces` (the SentencePiece pieces in id order)."""
    config = network.config
    options = {
        "pre_norm": network.pre_norm,
        "activation": common_spec.Activation.RELU,
        "relative_position": config.positional_encoding == "relative",
        # Every unit of each head rotated in interleaved pairs, as models/positions.py `rotate`.
        "rotary_dim": 0 if config.positional_encoding == "rotary" else None,
        "rotary_interleave": True,
        "rotary_base": ROTARY_BASE,
    }
    spec = transformer_spec.TransformerSpec(
        transformer_spec.TransformerEncoderSpec(config.num_encoder_layers, config.num_heads, **options),
        transformer_spec.TransformerDecoderSpec(config.num_decoder_layers, config.num_heads, **options),
    )
    _set_stack(spec.encoder, network.encoder, spec.encoder.embeddings[0], config.max_len)
    _set_stack(spec.decoder, network.decoder, spec.decoder.embeddings, config.max_len)
    _set_linear(spec.decoder.projection, network.output_projection.T, bias=_output_bias(config.vocab_size))

    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.unk_token = pieces[UNK_ID]
    spec.config.bos_token = pieces[BOS_ID]
    spec.config.eos_token = pieces[EOS_ID]
    spec.config.decoder_start_token = pieces[BOS_ID]
    spec.config.add_source_bos = False
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = PROJECT_LAYER_NORM_EPSILON
    spec.validate()
    return spec


def save(spec: transformer_spec.TransformerSpec, directory: str, quantization: str | None = None) -> None:
    """Writes `spec` into the existing folder `directory` (model.bin, config.json, vocabularies), quantized if asked."""
    spec.optimize(quantization=quantization)
    spec.save(directory)
