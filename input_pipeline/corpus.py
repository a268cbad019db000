"""Loads the splits a run needs and turns them into subword ids."""

import dataclasses
import os

import ml_collections
import sentencepiece as spm
from absl import logging

from input_pipeline import datasets
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.batching import ParallelIds
from training import distributed
from training.errors import UserInputError

TOKENIZER_FILE = "tokenizer.model"


@dataclasses.dataclass(frozen=True)
class Corpus:
    tokenizer: spm.SentencePieceProcessor
    text: dict[str, datasets.TextPairs]  # split -> sentence pairs
    ids: dict[str, ParallelIds]  # split -> subword ids (train: length-filtered)


def load_corpus(
    config: ml_collections.ConfigDict,
    workdir: str,
    splits: tuple[str, ...],
    *,
    allow_training_tokenizer: bool,
) -> Corpus:
    """Loads `splits` of config.dataset with the workdir's tokenizer.

    The tokenizer is trained on the train split on the first run and read from
    <workdir>/tokenizer.model afterwards, so a restarted or evaluated run uses
    the same subwords.

    Raises:
        UserInputError: bad dataset (see datasets.make_builder); no tokenizer
            in the workdir when one may not be trained; a damaged tokenizer file;
            or, when training, a workdir tokenizer other than config.tokenizer
            describes (vocab_size, model_type).
    """
    dataset = config.dataset
    tokenizer_path = os.path.join(workdir, TOKENIZER_FILE)
    tokenizer = None
    if os.path.exists(tokenizer_path):
        # Read and checked before the dataset is prepared: a restart that cannot work writes nothing.
        tokenizer = tokenizer_lib.load_tokenizer(tokenizer_path)
        if allow_training_tokenizer:
            tokenizer_lib.check_tokenizer_matches(
                tokenizer, tokenizer_path, vocab_size=config.tokenizer.vocab_size, kind=config.tokenizer.model_type
            )
    elif not allow_training_tokenizer:
        raise UserInputError(
            f"{tokenizer_path} does not exist: {workdir} holds no trained run. Train first with the same --workdir."
        )
    needed = splits if tokenizer is not None else tuple(dict.fromkeys((dataset.train_split, *splits)))
    # Process 0 prepares the dataset and trains the tokenizer; the others then read both.
    with distributed.main_process_first("prepare_dataset"):
        builder = datasets.make_builder(dataset, workdir, required_splits=needed)
    text = {
        split: datasets.load_text_pairs(builder, split, dataset.source_lang, dataset.target_lang) for split in needed
    }
    with distributed.main_process_first("train_tokenizer"):
        if os.path.exists(tokenizer_path):
            if tokenizer is None:  # Trained by process 0 meanwhile.
                tokenizer = tokenizer_lib.load_tokenizer(tokenizer_path)
        else:
            os.makedirs(workdir, exist_ok=True)  # Only now: bad data must leave no trace.
            train = text[dataset.train_split]
            tokenizer = tokenizer_lib.train_tokenizer(
                train.sources + train.targets,
                tokenizer_path,
                vocab_size=config.tokenizer.vocab_size,
                model_type=config.tokenizer.model_type,
                max_sentences=config.tokenizer.max_training_sentences,
                seed=config.seed,
            )
    ids = {}
    for split in splits:
        ids[split] = datasets.tokenize(text[split], tokenizer)
        if split == dataset.train_split:
            ids[split] = datasets.filter_by_length(ids[split], dataset.max_length)
        logging.info("%s: %d pairs, %d target subwords.", split, len(ids[split]), int(ids[split].targets.lengths.sum()))
    return Corpus(tokenizer, {s: text[s] for s in splits}, ids)
