"""The run's SentencePiece model as a `transformers` fast tokenizer that gives this project's ids.

Built from the model's own pieces, scores and normalisation rules with the `tokenizers`
library's primitives, so that `AutoTokenizer.from_pretrained(DIR)(line)` is
`sp.encode(line) + [EOS_ID]`: the source ids `translate.py` feeds its encoder
(input_pipeline/tokenizer.py `encode_sources`), special ids included.
"""

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from common.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID

# SentencePiece's word-boundary mark, which the pieces carry in front of each word.
WORD_BOUNDARY = "\u2581"
# Leading spaces the decoder drops, at most: more than any output has (Strip needs a bound).
_MAX_LEADING_SPACES = 1 << 16


def _decoder(strip_leading_spaces: bool) -> decoders.Decoder:
    """Pieces to text as SentencePiece joins them: each word boundary a space, and with a dummy
    prefix, every leading space dropped (not only the first piece's: an output may start with bare
    boundary pieces, which SentencePiece also drops)."""
    steps = [decoders.Replace(WORD_BOUNDARY, " "), decoders.Fuse()]
    if strip_leading_spaces:
        steps.append(decoders.Strip(content=" ", left=_MAX_LEADING_SPACES, right=0))
    return decoders.Sequence(steps)


def _tokenizer(proto: sentencepiece_model_pb2.ModelProto) -> Tokenizer:
    """The unigram model `proto` describes, with SentencePiece's normalisation and word splitting."""
    vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    tokenizer = Tokenizer(models.Unigram(vocab, proto.trainer_spec.unk_id, proto.trainer_spec.byte_fallback))
    rules = [normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap)]
    if proto.normalizer_spec.remove_extra_whitespaces:
        rules += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    tokenizer.normalizer = normalizers.Sequence(rules)
    prepend = "always" if proto.normalizer_spec.add_dummy_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=WORD_BOUNDARY, prepend_scheme=prepend, split=proto.trainer_spec.split_by_whitespace
    )
    tokenizer.decoder = _decoder(strip_leading_spaces=proto.normalizer_spec.add_dummy_prefix)
    eos = proto.pieces[EOS_ID].piece
    # The encoder's input is the sentence then <eos>, with no <bos> (the decoder starts from <bos>).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A $B {eos}", special_tokens=[(eos, EOS_ID)]
    )
    return tokenizer


def huggingface_tokenizer(sentencepiece: spm.SentencePieceProcessor, max_length: int) -> PreTrainedTokenizerFast:
    """A fast tokenizer equal to `sentencepiece` (a unigram model) with the project's special ids.

    Args:
        sentencepiece: the run's tokenizer.
        max_length: the longest source `translate.py` feeds the model (config.dataset.max_length), in ids with
            <eos>: the tokenizer's `model_max_length`, so that `truncation=True` cuts a longer source as
            `translate.py` does, to its first max_length - 1 ids and <eos>.
    """
    proto = sentencepiece_model_pb2.ModelProto.FromString(sentencepiece.serialized_model_proto())
    special = {
        name: proto.pieces[i].piece for name, i in (("pad", PAD_ID), ("unk", UNK_ID), ("bos", BOS_ID), ("eos", EOS_ID))
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(proto),
        pad_token=special["pad"],
        unk_token=special["unk"],
        bos_token=special["bos"],
        eos_token=special["eos"],
        model_max_length=max_length,
        padding_side="right",
    )
