"""Sentence pairs from TFDS: registered datasets by name, or local parallel text."""

import dataclasses
import os

import ml_collections
import numpy as np
import sentencepiece as spm
import tensorflow_datasets as tfds
from absl import logging

from input_pipeline.batching import ParallelIds, RaggedIds
from input_pipeline.parallel_text import ParallelText
from input_pipeline.tokenizer import EOS_ID
from training.errors import UserInputError

LOCAL_DATASET = "parallel_text"
_TOKENIZE_CHUNK = 100_000  # Sentences tokenized at a time.


@dataclasses.dataclass(frozen=True)
class TextPairs:
    sources: list[str]
    targets: list[str]

    def __len__(self) -> int:
        return len(self.sources)


def make_builder(
    dataset: ml_collections.ConfigDict, workdir: str, required_splits: tuple[str, ...]
) -> tfds.core.DatasetBuilder:
    """The TFDS builder named by `dataset`, prepared and checked.

    Raises:
        UserInputError: unknown dataset, bad local files, missing languages or
            splits, or a named dataset that is not prepared and cannot be fetched.
    """
    if dataset.name == LOCAL_DATASET:
        builder = ParallelText(
            path=dataset.path,
            source_lang=dataset.source_lang,
            target_lang=dataset.target_lang,
            required_splits=required_splits,
            data_dir=dataset.data_dir or os.path.join(workdir, "tfds"),
        )
    else:
        try:
            builder = tfds.builder(dataset.name, data_dir=dataset.data_dir or None)
        except tfds.core.registered.DatasetNotFoundError:
            raise UserInputError(
                f"Unknown dataset {dataset.name!r}: use a TFDS name such as "
                "'wmt14_translate/de-en', or 'parallel_text' with "
                "--config.dataset.path=FOLDER."
            ) from None
    try:
        builder.download_and_prepare()
    except Exception as e:  # pylint: disable=broad-except
        if dataset.name == LOCAL_DATASET:
            raise  # The files were checked: this is not the user's to fix.
        raise UserInputError(
            f"Could not prepare dataset {dataset.name!r} in {builder.data_dir}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            "Prepare it where the internet is reachable (`tfds build`) and set "
            "--config.dataset.data_dir."
        ) from None
    features = set(builder.info.features.keys())
    for lang in (dataset.source_lang, dataset.target_lang):
        if lang not in features:
            raise UserInputError(
                f"Dataset {dataset.name!r} has no language {lang!r}; it has "
                f"{sorted(features)} (set config.dataset.source_lang/target_lang)."
            )
    for split in required_splits:
        if split not in builder.info.splits:
            raise UserInputError(
                f"Dataset {dataset.name!r} has no split {split!r}; it has {sorted(builder.info.splits)}."
            )
    return builder


def load_text_pairs(builder: tfds.core.DatasetBuilder, split: str, source_lang: str, target_lang: str) -> TextPairs:
    """All pairs of `split`, in the dataset's order, as Python strings."""
    sources, targets = [], []
    for example in tfds.as_numpy(builder.as_dataset(split=split)):
        sources.append(example[source_lang].decode("utf-8"))
        targets.append(example[target_lang].decode("utf-8"))
    logging.info("Loaded %d %s pairs from %s.", len(sources), split, builder.name)
    return TextPairs(sources, targets)


def tokenize(pairs: TextPairs, tokenizer: spm.SentencePieceProcessor) -> ParallelIds:
    """Subword ids of both sides, each sequence ending with <eos>."""

    def encode(texts: list[str]) -> RaggedIds:
        # In chunks, so that only one chunk at a time is held as Python lists.
        chunks = []
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            ids = tokenizer.encode(texts[start : start + _TOKENIZE_CHUNK], num_threads=os.cpu_count() or 1)
            chunks.append(RaggedIds.from_lists([seq + [EOS_ID] for seq in ids]))
        return RaggedIds.concatenate(chunks) if chunks else RaggedIds.from_lists([])

    return ParallelIds(encode(pairs.sources), encode(pairs.targets))


def filter_by_length(pairs: ParallelIds, max_length: int) -> ParallelIds:
    """Drops pairs with a side longer than `max_length` ids (logged)."""
    keep = np.flatnonzero(pairs.lengths <= max_length)
    if len(keep) < len(pairs):
        logging.info(
            "Left out %d of %d training pairs longer than %d subwords.",
            len(pairs) - len(keep),
            len(pairs),
            max_length,
        )
    if not len(keep):
        raise UserInputError(f"No training pair fits config.dataset.max_length={max_length}.")
    return ParallelIds(pairs.sources.select(keep), pairs.targets.select(keep))
