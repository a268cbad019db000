"""SentencePiece subwords shared by source and target, trained on the train split."""

import io
import os
import random
from collections.abc import Iterable

import sentencepiece as spm
from absl import logging

from training.errors import UserInputError

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


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
    with open(tmp_path, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp_path, model_path)
    logging.info("Trained a %d-piece %s tokenizer on %d sentences.", vocab_size, model_type, len(sentences))
    return load_tokenizer(model_path)


def load_tokenizer(model_path: str) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=model_path)
