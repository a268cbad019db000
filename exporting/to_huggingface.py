"""A trained model as a `transformers` folder: Marian (post-LN) or Blenderbot (pre-LN), safetensors weights.

`AutoModelForSeq2SeqLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load it
offline, and `model.generate(**tokenizer(lines, return_tensors="pt", padding=True, truncation=True))`
decodes as the run's config.eval says (generation_config.json), sources cut as `translate.py` cuts them.

How this project's Transformer maps onto them (models/transformer.py):
  - Both scale the tied token embedding by sqrt(d_model) (`scale_embedding`), add positions
    counted from 0, use ReLU and attention projections without biases (stored as zeros), and start the
    decoder from <bos> (`decoder_start_token_id`).
  - Marian computes the paper's sinusoids with sines in the first half of the units and
    cosines in the second, where this project interleaves them: the whole network is
    exported with its d_model units in that order (`network.reordered`), the same function.
  - Blenderbot reads its positions table from the weights, so it holds this project's table
    (sinusoidal or learned) as it is.
  - This project never generates <pad> or <bos> (models/search.py sets their logits to -1e9):
    the exported `final_logits_bias` is -1e9 there and 0 elsewhere, the same rule inside the
    network, for every decoding method.
  - `transformers` LayerNorms use epsilon 1e-5 where this project uses 1e-6, and have no
    setting for it. For pre-LN, every LayerNorm input is scaled by sqrt(10) (`_scaled_stream`),
    which makes epsilon 1e-5 act as 1e-6: exact. For post-LN the first sub-layer's input is
    the embedding plus Marian's own sinusoids, which cannot be scaled: the LayerNorms there
    differ from this project's by at most (1e-5 - 1e-6) / (2 var) relatively for inputs of
    variance var (tests/test_export_parity.py bounds the logits' difference by it).
"""

import dataclasses
import math

import numpy as np
import torch
from transformers import (
    BlenderbotConfig,
    BlenderbotForConditionalGeneration,
    GenerationConfig,
    MarianConfig,
    MarianMTModel,
    PreTrainedModel,
)

from common.special_ids import BOS_ID, EOS_ID, PAD_ID
from exporting import network as network_lib
from exporting.network import Attention, FeedForward, Layer, Network, Norm, Stack

TORCH_LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which both classes use.
PROJECT_LAYER_NORM_EPSILON = 1e-6  # models/layers.py `layer_norm`.
# Added to the logits of the ids this project never generates: as models/search.py's NEG_INF.
NEVER_GENERATED_BIAS = -1.0e9


# --------------------------------------------------------------------------- #
# Pre-LN: scaling the residual stream so that epsilon 1e-5 acts as 1e-6.
# --------------------------------------------------------------------------- #


def _scaled_stream(network: Network, factor: float) -> Network:
    """The same pre-LN function with its residual stream multiplied by `factor`.

    LN_eps(c x) = LN_{eps / c^2}(x): with the stream c times larger, every LayerNorm sees
    its epsilon c^2 times smaller. Inputs (embeddings, positions) and every sub-layer's output
    (the attention output and W_2, b_2) are scaled by c; the LayerNorms that feed the
    sub-layers are scale-free; the decoder's final LayerNorm output, which meets the
    (c times larger) tied embedding in the logits, is divided by c. The encoder's output
    (its final LayerNorm) is scale-free too, as cross-attention reads it.
    """

    def layer(old: Layer) -> Layer:
        def attention(a: Attention | None) -> Attention | None:
            return None if a is None else dataclasses.replace(a, output=a.output * factor)

        ff = old.feed_forward
        return dataclasses.replace(
            old,
            self_attention=attention(old.self_attention),
            cross_attention=attention(old.cross_attention),
            feed_forward=FeedForward(ff.hidden, ff.hidden_bias, ff.output * factor, ff.output_bias * factor),
        )

    def stack(s: Stack, final_scale: float) -> Stack:
        final = Norm(s.final_norm.scale * final_scale, s.final_norm.bias * final_scale)
        return Stack(s.embedding * factor, s.positions * factor, tuple(layer(x) for x in s.layers), final)

    assert network.pre_norm and network.config.tie_embeddings
    return dataclasses.replace(
        network,
        encoder=stack(network.encoder, 1.0),
        decoder=stack(network.decoder, 1.0 / factor),
        output_projection=network.output_projection * factor,
    )


# --------------------------------------------------------------------------- #
# The state dict.
# --------------------------------------------------------------------------- #


def _linear(prefix: str, kernel: np.ndarray, bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """torch.nn.Linear's weight [out, in] and bias of `y = x @ kernel + bias`; a zero bias where there is none."""
    if bias is None:
        bias = np.zeros(kernel.shape[1], np.float32)
    return {f"{prefix}.weight": kernel.T, f"{prefix}.bias": bias}


def _norm(prefix: str, norm: Norm) -> dict[str, np.ndarray]:
    return {f"{prefix}.weight": norm.scale, f"{prefix}.bias": norm.bias}


def _attention(prefix: str, a: Attention) -> dict[str, np.ndarray]:
    return {
        **_linear(f"{prefix}.q_proj", a.query),
        **_linear(f"{prefix}.k_proj", a.key),
        **_linear(f"{prefix}.v_proj", a.value),
        **_linear(f"{prefix}.out_proj", a.output),
    }


def _layer(prefix: str, layer: Layer) -> dict[str, np.ndarray]:
    ff = layer.feed_forward
    weights = {
        **_attention(f"{prefix}.self_attn", layer.self_attention),
        **_norm(f"{prefix}.self_attn_layer_norm", layer.self_attention_norm),
        **_linear(f"{prefix}.fc1", ff.hidden, ff.hidden_bias),
        **_linear(f"{prefix}.fc2", ff.output, ff.output_bias),
        **_norm(f"{prefix}.final_layer_norm", layer.feed_forward_norm),
    }
    if layer.cross_attention is not None:
        weights |= _attention(f"{prefix}.encoder_attn", layer.cross_attention)
        weights |= _norm(f"{prefix}.encoder_attn_layer_norm", layer.cross_attention_norm)
    return weights


def _stack(prefix: str, stack: Stack, *, with_positions: bool) -> dict[str, np.ndarray]:
    weights = {f"{prefix}.embed_tokens.weight": stack.embedding}
    for i, layer in enumerate(stack.layers):
        weights |= _layer(f"{prefix}.layers.{i}", layer)
    if with_positions:
        weights[f"{prefix}.embed_positions.weight"] = stack.positions
    if stack.final_norm is not None:
        weights |= _norm(f"{prefix}.layer_norm", stack.final_norm)
    return weights


def _final_logits_bias(vocab_size: int) -> np.ndarray:
    bias = np.zeros((1, vocab_size), np.float32)
    bias[0, [PAD_ID, BOS_ID]] = NEVER_GENERATED_BIAS
    return bias


def state_dict(network: Network, architecture: str) -> dict[str, np.ndarray]:
    """The `transformers` weights of `network` for `architecture` ('marian' or 'blenderbot'), as float32 arrays."""
    if architecture == "marian":
        network = network_lib.reordered(network, network_lib.sin_then_cos_order(network.config.d_model))
    else:
        network = _scaled_stream(network, math.sqrt(TORCH_LAYER_NORM_EPSILON / PROJECT_LAYER_NORM_EPSILON))
    with_positions = architecture == "blenderbot"  # Marian computes its sinusoids itself.
    weights = {
        "model.shared.weight": network.encoder.embedding,
        "lm_head.weight": network.output_projection,
        "final_logits_bias": _final_logits_bias(network.config.vocab_size),
        **_stack("model.encoder", network.encoder, with_positions=with_positions),
        **_stack("model.decoder", network.decoder, with_positions=with_positions),
    }
    return {name: np.array(array, dtype=np.float32, order="C") for name, array in weights.items()}


# --------------------------------------------------------------------------- #
# The model and its generation defaults.
# --------------------------------------------------------------------------- #


def model_config(network: Network, architecture: str, *, dropout_rate: float, attention_dropout_rate: float):
    """The `transformers` config of `network` (dropout rates for whoever fine-tunes it)."""
    c = network.config
    common = dict(
        vocab_size=c.vocab_size,
        d_model=c.d_model,
        encoder_layers=c.num_encoder_layers,
        decoder_layers=c.num_decoder_layers,
        encoder_attention_heads=c.num_heads,
        decoder_attention_heads=c.num_heads,
        encoder_ffn_dim=c.d_ff,
        decoder_ffn_dim=c.d_ff,
        activation_function="relu",
        max_position_embeddings=c.max_len,
        scale_embedding=True,
        dropout=dropout_rate,
        attention_dropout=attention_dropout_rate,
        activation_dropout=0.0,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
        tie_word_embeddings=True,
    )
    if architecture == "marian":
        return MarianConfig(decoder_vocab_size=c.vocab_size, share_encoder_decoder_embeddings=True, **common)
    return BlenderbotConfig(**common)


def generation_config(eval_config, max_decode_length: int) -> GenerationConfig:
    """config.eval's decoding as `generate`'s defaults.

    `length_penalty` is config.eval.length_penalty, but `transformers` divides a hypothesis'
    log-probability by length ** alpha where this project uses GNMT's ((5 + length) / 6) **
    alpha: beam search ranks hypotheses alike only for alpha 0 (the model card says so).
    """
    sampling = eval_config.temperature > 0
    beams = 1 if sampling else eval_config.beam_size
    # transformers refuses options of the modes not chosen (a length penalty without beams, ...).
    optional = {"length_penalty": eval_config.length_penalty} if beams > 1 else {}
    if sampling:
        optional |= {"temperature": eval_config.temperature, "top_k": eval_config.top_k or None}
    return GenerationConfig(
        decoder_start_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        max_new_tokens=max_decode_length,
        num_beams=beams,
        do_sample=sampling,
        forced_eos_token_id=None,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        **optional,
    )


def build_model(
    network: Network, architecture: str, *, dropout_rate: float = 0.0, attention_dropout_rate: float = 0.0
) -> PreTrainedModel:
    """The `transformers` model of `network`: MarianMTModel or BlenderbotForConditionalGeneration, in eval mode."""
    config = model_config(
        network, architecture, dropout_rate=dropout_rate, attention_dropout_rate=attention_dropout_rate
    )
    model_class = MarianMTModel if architecture == "marian" else BlenderbotForConditionalGeneration
    model = model_class(config)
    weights = {name: torch.from_numpy(array) for name, array in state_dict(network, architecture).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Marian's sinusoids are computed, not loaded; everything else must come from the network.
    missing = [name for name in missing if not name.endswith("embed_positions.weight") or architecture != "marian"]
    if missing or unexpected:
        raise ValueError(f"The {architecture} weights do not fit: missing {missing}, unexpected {unexpected}.")
    return model.eval()
