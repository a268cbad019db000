"""Every attention head's weights for one sentence (pair), collected from what `MultiHeadAttention` sows.

`attention_weights` runs the model once and returns the weights by name; `sentence_attention` does so for
a text pair and keeps the subword pieces that label each map's queries and keys. The PNG figures
(attention_maps.py) and the interactive page (attention_page.py) both draw a `SentenceAttention`.
"""

import dataclasses
import functools

import jax
import numpy as np
import sentencepiece as spm
from jax.experimental import multihost_utils

from common.errors import UserInputError
from input_pipeline.tokenizer import encode_sources
from models import Transformer
from models.classifier import Classifier

# SentencePiece's piece for bos_id: the first decoder input, and the classifier's [CLS] token.
BOS_PIECE = "<s>"


@functools.partial(jax.jit, static_argnums=0)
def _sown_attention_weights(model: Transformer | Classifier, params, *ids: jax.Array):
    """The 'intermediates' collection of a deterministic pass on [1, len] ids (source, and target if any)."""
    # Linen modules hash and compare by their config, so equal models share one compiled pass.
    _, state = model.apply({"params": params}, *ids, deterministic=True, mutable=["intermediates"])
    return state["intermediates"]


def _real_tokens(ids, pad_id: int, side: str, max_len: int) -> np.ndarray:
    """`ids` [length] without its trailing padding; padding only ever trails the real tokens."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"{side} ids must be 1-D (one sentence), got shape {ids.shape}.")
    ids = ids[: np.max(np.flatnonzero(ids != pad_id), initial=-1) + 1].astype(np.int32)
    if not 0 < len(ids) <= max_len:
        raise UserInputError(
            f"The {side} sentence has {len(ids)} subword tokens; attention maps need 1 to {max_len} "
            f"(the model's max_len). Use a shorter sentence."
        )
    return ids


def attention_weights(model: Transformer | Classifier, params, source_ids, target_ids=None) -> dict[str, np.ndarray]:
    """Every attention head's weights for one sentence pair under teacher forcing, or one classified sentence.

    Args:
        model: the Transformer (its config gives the layer counts and pad/bos ids), or the
            encoder Classifier (then without `target_ids`; with 'cls' pooling the encoder
            reads a [CLS] token first, and the maps have one more row and column, first).
        params: its 'params' collection (arrays on any device, or numpy arrays).
        source_ids: [src_len] int ids ending with eos; trailing padding is dropped.
        target_ids: [tgt_len] int ids ending with eos; trailing padding is dropped. The
            decoder reads bos followed by target_ids[:-1] (`shift_right`), so query i of the
            decoder is the position that predicts target_ids[i]. None for the Classifier.

    Returns:
        Float32 attention probabilities of the real tokens, each row summing to 1, keyed
        'encoder/layer_{i}/self_attention' [heads, src_len, src_len],
        'decoder/layer_{i}/self_attention' [heads, tgt_len, tgt_len] (lower triangular) and
        'decoder/layer_{i}/cross_attention' [heads, tgt_len, src_len], encoder layers first,
        then decoder layers, each in layer order.
    """
    if isinstance(model, Classifier):
        config = model.config.encoder
        cls_token = int(model.config.pooling == "cls")
        source_ids = _real_tokens(source_ids, config.pad_id, "source", config.max_len - cls_token)
        sown = _sown_attention_weights(model, params, source_ids[None])
    else:
        config = model.config
        source_ids = _real_tokens(source_ids, config.pad_id, "source", config.max_len)
        target_ids = _real_tokens(target_ids, config.pad_id, "target", config.max_len)
        sown = _sown_attention_weights(model, params, source_ids[None], target_ids[None])
    # Numpy copies of the whole arrays, also where heads are split over other processes' devices
    # (tensor parallelism across hosts): a collective then, which every process of a run reaches.
    sown = multihost_utils.process_allgather(sown, tiled=True)

    def weights_of(stack: str, layer: int, kind: str) -> np.ndarray:
        # `sow` appends to a tuple; one pass sows once per attention module.
        (batch_weights,) = sown[stack][f"layers_{layer}"][kind]["attention_weights"]
        return np.asarray(batch_weights[0], np.float32)  # Drops the batch of one.

    weights = {}
    for i in range(config.num_encoder_layers):
        weights[f"encoder/layer_{i}/self_attention"] = weights_of("encoder", i, "self_attention")
    for i in range(config.num_decoder_layers):
        for kind in ("self_attention", "cross_attention"):
            weights[f"decoder/layer_{i}/{kind}"] = weights_of("decoder", i, kind)
    return weights


def token_pieces(tokenizer: spm.SentencePieceProcessor, ids) -> list[str]:
    """The subword pieces of `ids` [length] without padding, e.g. ['▁Click', 'ing', '</s>']."""
    return [tokenizer.id_to_piece(int(i)) for i in np.asarray(ids) if int(i) != tokenizer.pad_id()]


def map_axes(name: str) -> tuple[str, str]:
    """The sequences ('source', 'target' or 'decoder_input') that label the rows and columns of the map `name`.

    Decoder rows are the positions predicting each target token, so they carry the target pieces,
    not the pieces they read: a cross-attention map then reads as an alignment ("to produce 'Haus'
    the decoder looked at '▁house'"). Decoder self-attention keys are the decoder inputs, bos then
    the targets but the last, so its diagonal pairs each prediction with the token before it.
    """
    stack, _, kind = name.split("/")
    if stack == "encoder":
        return "source", "source"
    return "target", "decoder_input" if kind == "self_attention" else "source"


@dataclasses.dataclass(frozen=True)
class SentenceAttention:
    """One sentence (pair)'s attention weights and the subword pieces labelling them.

    Attributes:
        weights: name -> [heads, q_len, kv_len] float32, as `attention_weights` returns them.
        source_pieces: [src_len] pieces of the source, ending with '</s>' (with the classifier's
            'cls' pooling, '<s>' first: its [CLS] token).
        target_pieces: [tgt_len] pieces of the target, ending with '</s>'; empty for the classifier.
    """

    weights: dict[str, np.ndarray]
    source_pieces: list[str]
    target_pieces: list[str]

    def pieces(self, sequence: str) -> list[str]:
        """The pieces of 'source', 'target' or 'decoder_input' (bos, then the target pieces but the last)."""
        if sequence == "decoder_input":
            return [BOS_PIECE, *self.target_pieces[:-1]]
        return {"source": self.source_pieces, "target": self.target_pieces}[sequence]

    def axis_pieces(self, name: str) -> tuple[list[str], list[str]]:
        """(query pieces, key pieces): the labels of the rows and columns of the map `name`."""
        queries, keys = map_axes(name)
        return self.pieces(queries), self.pieces(keys)


def sentence_attention(
    model: Transformer, params, tokenizer: spm.SentencePieceProcessor, source: str, target: str
) -> SentenceAttention:
    """Every layer's and head's attention for the text pair (source, target), teacher-forced.

    Both sides are cut to the model's max_len subwords (with <eos>).
    """
    source_ids, target_ids = (
        encode_sources(tokenizer, [text], model.config.max_len)[0][0] for text in (source, target)
    )
    weights = attention_weights(model, params, source_ids, target_ids)
    return SentenceAttention(weights, token_pieces(tokenizer, source_ids), token_pieces(tokenizer, target_ids))


def classifier_attention(
    model: Classifier, params, tokenizer: spm.SentencePieceProcessor, text: str
) -> SentenceAttention:
    """Every layer's and head's attention of the encoder Classifier for one text.

    The text is cut to the subwords the model can encode (with <eos>); with 'cls' pooling the
    first row and column are the [CLS] token (labelled '<s>').
    """
    cls_token = model.config.pooling == "cls"
    ids = encode_sources(tokenizer, [text], model.config.encoder.max_len - int(cls_token))[0][0]
    weights = attention_weights(model, params, ids)
    return SentenceAttention(weights, [BOS_PIECE] * cls_token + token_pieces(tokenizer, ids), [])
