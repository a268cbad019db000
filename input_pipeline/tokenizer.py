"""SentencePiece subwords shared by source and target, trained on the train split."""

import io
import os
import random
from collections.abc import Iterable, Sequence

import sentencepiece as spm
from absl import logging
from sentencepiece import sentencepiece_model_pb2

from common import io_errors
from common.errors import UserInputError
from common.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from input_pipeline.batching import RaggedIds


def train_tokenizer(
    sentences: Iterable[str],
    model_path: str,
    *,
    vocab_size: int,
    model_type: str = "unigram",
    max_sentences: int = 2_000_000,
    seed: int = 0,
) -> spm.SentencePieceProcessor:
    """Trains a SentencePiece model on `sentences` and writes it to `model_path`.

    At most `max_sentences` sentences, sampled uniformly, are used. The file is
    written atomically (a crash leaves no half-written model behind).
    """
    sentences = [s for s in sentences if s]
    if len(sentences) > max_sentences:
        sentences = random.Random(seed).sample(sentences, max_sentences)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:  # How SentencePiece reports settings that cannot work.
        raise UserInputError(
            f"Cannot train a {vocab_size}-piece tokenizer on {len(sentences)} sentences ({e}); "
            "adjust config.tokenizer.vocab_size."
        ) from None
    tmp_path = model_path + ".tmp"
    with io_errors.naming(model_path), open(tmp_path, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp_path, model_path)
    logging.info("Trained a %d-piece %s tokenizer on %d sentences.", vocab_size, model_type, len(sentences))
    return load_tokenizer(model_path)


def load_tokenizer(model_path: str) -> spm.SentencePieceProcessor:
    """The SentencePiece model in `model_path`.

    Raises:
        UserInputError: the file is missing, unreadable, empty or not a SentencePiece model.
    """
    try:
        return spm.SentencePieceProcessor(model_file=model_path)
    except (OSError, RuntimeError) as e:  # SentencePiece reports every failure as RuntimeError.
        size = os.path.getsize(model_path) if os.path.isfile(model_path) else None
        state = "is empty" if size == 0 else f"is not a SentencePiece model ({str(e).splitlines()[0]})"
        raise UserInputError(
            f"{model_path} {state}: the run's tokenizer is damaged. Restore it from a copy; the run's "
            "checkpoints only work with the tokenizer they were trained with."
        ) from None


def model_type(tokenizer: spm.SentencePieceProcessor) -> str:
    """The algorithm the tokenizer was trained with: 'unigram', 'bpe', 'word' or 'char'."""
    proto = sentencepiece_model_pb2.ModelProto.FromString(tokenizer.serialized_model_proto())
    return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()


def check_tokenizer_matches(
    tokenizer: spm.SentencePieceProcessor, model_path: str, *, vocab_size: int, kind: str
) -> None:
    """Checks that a workdir's trained tokenizer is the one config.tokenizer describes.

    Raises:
        UserInputError: naming the field, the tokenizer's value and the config's.
    """
    found = {"vocab_size": tokenizer.vocab_size(), "model_type": model_type(tokenizer)}
    for field, wanted in (("vocab_size", vocab_size), ("model_type", kind)):
        if found[field] != wanted:
            raise UserInputError(
                f"config.tokenizer.{field} is {wanted!r} but the workdir's tokenizer {model_path} was trained with "
                f"{found[field]!r}: the run's checkpoints depend on it. Resume with "
                f"--config.tokenizer.{field}={found[field]}, or train in a new --workdir."
            )


def encode_sources(
    tokenizer: spm.SentencePieceProcessor, lines: Sequence[str], max_length: int
) -> tuple[RaggedIds, list[int]]:
    """Subword ids of each line, ending with <eos>, cut to `max_length` ids.

    Returns:
        The ids, and the indices of the lines that were cut (for a warning).
    """
    ids = [tokenizer.encode(line) + [EOS_ID] for line in lines]
    cut = [i for i, line_ids in enumerate(ids) if len(line_ids) > max_length]
    for i in cut:
        ids[i] = ids[i][: max_length - 1] + [EOS_ID]
    return RaggedIds.from_lists(ids), cut
