"""Examples from TFDS, by name or from local files: sentence pairs (translation), labelled text (classification)."""

import os
import random
from collections.abc import Iterable, Iterator, Sequence

import ml_collections
import numpy as np
import sentencepiece as spm
import tensorflow_datasets as tfds
from absl import logging

from common import io_errors
from common.errors import UserInputError
from common.special_ids import EOS_ID
from common.workdir import Workdir
from input_pipeline.batching import LabelledIds, ParallelIds, RaggedIds
from input_pipeline.labelled_text import LABEL, LabelledText, LabelledTexts
from input_pipeline.labelled_text import TEXT as LABEL_TEXT
from input_pipeline.parallel_text import ParallelText
from input_pipeline.record_source import ArrayRecordSource
from input_pipeline.text_lines import TextPairs

LOCAL_DATASET = "parallel_text"
# Datasets are prepared in ArrayRecord files: random access, which training's global shuffle needs, without TensorFlow.
RECORDS_FORMAT = "array_record"
TENSORFLOW_EXTRA = 'pip install -e ".[tensorflow]"'  # pyproject.toml's extra.
_TOKENIZE_CHUNK = 100_000  # Sentences tokenized at a time.


def make_builder(
    dataset: ml_collections.ConfigDict, workdir: str, required_splits: tuple[str, ...]
) -> tfds.core.DatasetBuilder:
    """The TFDS builder named by `dataset`, prepared (once, in ArrayRecord files) and checked.

    Raises:
        UserInputError: unknown dataset, bad local files, missing languages or
            splits, a named dataset that is not prepared and cannot be fetched or
            needs TensorFlow to prepare, which is not installed, or one prepared in
            a format without random access (TFRecord).
    """
    if dataset.name == LOCAL_DATASET:
        builder = ParallelText(
            path=dataset.path,
            source_lang=dataset.source_lang,
            target_lang=dataset.target_lang,
            required_splits=required_splits,
            data_dir=dataset.data_dir or Workdir(workdir).tfds,
        )
    else:
        builder = _registered_builder(dataset, f"'wmt14_translate/de-en', or '{LOCAL_DATASET}'")
    _prepare(builder, dataset, local=dataset.name == LOCAL_DATASET)
    features = set(builder.info.features.keys())
    for lang in (dataset.source_lang, dataset.target_lang):
        if lang not in features:
            raise UserInputError(
                f"Dataset {dataset.name!r} has no language {lang!r}; it has "
                f"{sorted(features)} (set config.dataset.source_lang/target_lang)."
            )
    _check_splits(builder, dataset, required_splits)
    return builder


def _check_splits(
    builder: tfds.core.DatasetBuilder, dataset: ml_collections.ConfigDict, required: tuple[str, ...], hint: str = ""
) -> None:
    """Raises UserInputError for the first of the `required` splits that `builder` lacks; `hint`: what to set."""
    for split in required:
        if split not in builder.info.splits:
            raise UserInputError(
                f"Dataset {dataset.name!r} has no split {split!r}; it has {sorted(builder.info.splits)}{hint}."
            )


def _check_random_access(builder: tfds.core.DatasetBuilder, dataset: ml_collections.ConfigDict) -> None:
    """Raises UserInputError if `builder` was prepared (by the user, earlier) without ArrayRecord files."""
    if RECORDS_FORMAT not in {file_format.value for file_format in builder.info.available_file_formats()}:
        raise UserInputError(
            f"Dataset {dataset.name!r} in {builder.data_dir} is prepared as {builder.info.file_format.value}, "
            f"but training reads {RECORDS_FORMAT} files (random access): set --config.dataset.data_dir to a new "
            f"folder, where the run prepares it as {RECORDS_FORMAT}, or prepare it with `tfds build {dataset.name} "
            f"--file_format={RECORDS_FORMAT} --data_dir=DIR` and set --config.dataset.data_dir=DIR."
        )


def records(builder: tfds.core.DatasetBuilder, split: str) -> Sequence[dict[str, bytes]]:
    """`split` as a random-access source: len() and [i], record i a {feature: value} dict (text as UTF-8 bytes).

    Opens the split's ArrayRecord files; reads nothing until indexed. A prepared split reads
    through `ArrayRecordSource` (one record in microseconds, not TFDS's milliseconds a read call; a
    missing or damaged shard is an error naming it); what TFDS gives for a dataset without files
    (`tfds.testing.mock_data`) is used as it is.
    """
    shards = [path for info in builder.info.splits.values() for path in info.filepaths]
    if any(path.exists() for path in shards):  # Prepared here: the split's files, or an error naming one missing.
        return ArrayRecordSource.from_builder(builder, split)
    return builder.as_data_source(split)


def read_records(source: Sequence[dict], indices: Iterable[int]) -> Iterator[dict]:
    """The records `indices` of a data source, in that order."""
    return (source[index] for index in indices)


def all_records(builder: tfds.core.DatasetBuilder, split: str) -> Iterator[dict]:
    """Every record of `split`, in the dataset's order, read from its records (`records`)."""
    source = records(builder, split)
    return read_records(source, range(len(source)))


def load_text_pairs(builder: tfds.core.DatasetBuilder, split: str, source_lang: str, target_lang: str) -> TextPairs:
    """All pairs of `split`, in the dataset's order, as Python strings (for the small evaluation splits)."""
    sources, targets = [], []
    for record in all_records(builder, split):
        sources.append(_text(record[source_lang]))
        targets.append(_text(record[target_lang]))
    logging.info("Loaded %d %s pairs from %s.", len(sources), split, builder.name)
    return TextPairs(sources, targets)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value  # tfds.testing.mock_data gives str.


def sample_sentences(source: Sequence[dict], keys: tuple[str, ...], max_sentences: int, seed: int) -> list[str]:
    """At most `max_sentences` sentences of `source`'s records, drawn at random from every record's `keys`.

    The draw depends only on len(source), `max_sentences` and `seed`: the sentences are those
    `random.Random(seed).sample` picks from the list of all sentences of keys[0], then of keys[1], ...
    (all of them, in that order, if there are no more than `max_sentences`). Only the records
    holding a picked sentence are read, in file order, by random access.
    """
    n = len(source)
    total = n * len(keys)
    picks = random.Random(seed).sample(range(total), max_sentences) if total > max_sentences else range(total)
    picked = np.zeros(total, bool)  # Sentence keys[k] of record i is number k * n + i.
    picked[list(picks)] = True
    wanted = np.flatnonzero(picked.reshape(len(keys), n).any(axis=0)).tolist()
    texts = {}
    for index, record in zip(wanted, read_records(source, wanted), strict=True):
        for side, key in enumerate(keys):
            if picked[side * n + index]:
                texts[side * n + index] = _text(record[key])
    return [texts[pick] for pick in picks]


def tokenize(
    pairs: TextPairs, tokenizer: spm.SentencePieceProcessor, sides: tuple[str, ...] = ("sources", "targets")
) -> ParallelIds:
    """Subword ids of both sides (or only of `sides`; the others stay empty), each sequence ending with <eos>."""

    def encode(texts: list[str]) -> RaggedIds:
        # In chunks, so that only one chunk at a time is held as Python lists.
        chunks = []
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            ids = tokenizer.encode(texts[start : start + _TOKENIZE_CHUNK], num_threads=os.cpu_count() or 1)
            chunks.append(RaggedIds.from_lists([seq + [EOS_ID] for seq in ids]))
        return RaggedIds.concatenate(chunks) if chunks else RaggedIds.from_lists([])

    return ParallelIds(*(encode(getattr(pairs, side) if side in sides else []) for side in ("sources", "targets")))


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


# --------------------------------------------------------------------------- #
# Labelled text (classification).
# --------------------------------------------------------------------------- #

LOCAL_LABELLED_DATASET = "labelled_text"


def make_labelled_builder(
    dataset: ml_collections.ConfigDict, workdir: str, required_splits: tuple[str, ...]
) -> tfds.core.DatasetBuilder:
    """The TFDS builder of labelled text named by `dataset`, prepared and checked.

    `labelled_text` reads `{split}.tsv[.gz]` files from dataset.path; any other name is a
    registered TFDS dataset with one text feature and one `ClassLabel` (`imdb_reviews`,
    `glue/sst2`, `ag_news_subset`, ...). Either is prepared in ArrayRecord files, as
    translation's datasets are (`make_builder`).

    Raises:
        UserInputError: unknown dataset, bad local files, a dataset without one text and one
            label feature, missing splits, a named dataset that is not prepared and cannot be
            fetched or needs TensorFlow to prepare, which is not installed, or one prepared in
            a format without random access (TFRecord).
    """
    if dataset.name == LOCAL_LABELLED_DATASET:
        builder = LabelledText(
            path=dataset.path,
            required_splits=required_splits,
            data_dir=dataset.data_dir or Workdir(workdir).tfds,
        )
    else:
        builder = _registered_builder(dataset, f"'imdb_reviews' or 'glue/sst2', or '{LOCAL_LABELLED_DATASET}'")
    _prepare(builder, dataset, local=dataset.name == LOCAL_LABELLED_DATASET)
    text_and_label_features(builder)  # Fails early on a dataset that is not text classification.
    _check_splits(
        builder, dataset, required_splits, hint=" (set config.dataset.train_split/valid_split and config.eval.split)"
    )
    return builder


def _import_tensorflow_off_accelerators(dataset: ml_collections.ConfigDict) -> None:
    """Imports TensorFlow for TFDS's generators of named datasets, and hides GPUs from it.

    TensorFlow would otherwise take the GPUs' memory from JAX on its first op. Only preparing a
    named dataset needs it (an optional dependency, the `tensorflow` extra); the project's own
    builders prepare, and every dataset reads, its ArrayRecord files without it.

    Raises:
        UserInputError: TensorFlow is not installed.
    """
    try:
        import tensorflow as tf  # pylint: disable=g-import-not-at-top  (optional, ~0.8 GB: only where needed)
    except ImportError:
        raise UserInputError(
            f"preparing the TFDS dataset {dataset.name!r} needs TensorFlow: {TENSORFLOW_EXTRA} (or prepare it "
            f"where TensorFlow is installed: `tfds build {dataset.name} --file_format={RECORDS_FORMAT} "
            "--data_dir=DIR`, and set --config.dataset.data_dir=DIR)."
        ) from None
    tf.config.set_visible_devices([], "GPU")


def _registered_builder(dataset: ml_collections.ConfigDict, examples: str) -> tfds.core.DatasetBuilder:
    """The registered TFDS dataset config.dataset names; `examples`: names to suggest, then the local dataset."""
    try:
        return tfds.builder(dataset.name, data_dir=dataset.data_dir or None)
    except tfds.core.registered.DatasetNotFoundError:
        raise UserInputError(
            f"Unknown dataset {dataset.name!r}: use a TFDS name such as {examples} with --config.dataset.path=FOLDER."
        ) from None


def _prepare(builder: tfds.core.DatasetBuilder, dataset: ml_collections.ConfigDict, *, local: bool) -> None:
    """Prepares `builder` in ArrayRecord files unless it is prepared; then checks that it was in ArrayRecord files.

    Raises:
        UserInputError: see `make_builder`.
    """
    if not local and not builder.is_prepared():  # TFDS's generators for named datasets run TensorFlow ops.
        _import_tensorflow_off_accelerators(dataset)
    try:
        builder.download_and_prepare(file_format=RECORDS_FORMAT)
    except Exception as e:  # pylint: disable=broad-except
        if local or io_errors.storage_errno(e) is not None:
            raise  # The local files were checked, and a full disk is not for `tfds build` elsewhere to fix.
        raise UserInputError(
            f"Could not prepare dataset {dataset.name!r} in {builder.data_dir}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            "Prepare it where the internet is reachable (`tfds build`) and set "
            "--config.dataset.data_dir."
        ) from None
    _check_random_access(builder, dataset)


def text_and_label_features(builder: tfds.core.DatasetBuilder) -> tuple[str, str, list[str] | None]:
    """(text feature, label feature, label names or None for string labels) of a classification dataset.

    Raises:
        UserInputError: the dataset has not exactly one text feature and one label feature.
    """
    features = builder.info.features
    if builder.name == LabelledText.name:
        return LABEL_TEXT, LABEL, None
    texts = [name for name, feature in features.items() if isinstance(feature, tfds.features.Text)]
    labels = [name for name, feature in features.items() if isinstance(feature, tfds.features.ClassLabel)]
    if len(texts) != 1 or len(labels) != 1:
        raise UserInputError(
            f"Dataset {builder.name!r} is not single-text classification: it has text features {texts} and "
            f"label features {labels}; exactly one of each is needed."
        )
    return texts[0], labels[0], list(features[labels[0]].names)


def load_labelled_texts(builder: tfds.core.DatasetBuilder, split: str) -> LabelledTexts:
    """All examples of `split`, in the dataset's order, with label names.

    Raises:
        UserInputError: the split holds unlabelled examples (label -1, e.g. GLUE's test splits).
    """
    text_feature, label_feature, names = text_and_label_features(builder)
    texts, labels = [], []
    for record in all_records(builder, split):
        label = record[label_feature]
        if names is None:
            labels.append(_text(label))
        elif 0 <= label < len(names):
            labels.append(names[label])
        else:
            raise UserInputError(
                f"Split {split!r} of {builder.name!r} has unlabelled examples (label {label}); evaluate a "
                "labelled split (e.g. --config.eval.split=validation)."
            )
        texts.append(_text(record[text_feature]))
    logging.info("Loaded %d %s examples from %s.", len(texts), split, builder.name)
    return LabelledTexts(texts, labels)


def tokenize_labelled(
    texts: LabelledTexts, tokenizer: spm.SentencePieceProcessor, label_ids: dict[str, int], max_length: int
) -> LabelledIds:
    """Subword ids of each sentence, ending with <eos> and cut to `max_length` ids, and the label ids.

    Raises:
        UserInputError: a label that is not in `label_ids` (the training labels).
    """
    unknown = sorted(set(texts.labels) - label_ids.keys())
    if unknown:
        raise UserInputError(
            f"Labels {unknown[:5]} do not occur in the training split (labels {sorted(label_ids)}); "
            "a classifier can only predict the labels it was trained on."
        )
    ids = tokenize(TextPairs(texts.texts, []), tokenizer, sides=("sources",)).sources
    lengths = ids.lengths
    if np.any(lengths > max_length):  # Keep the beginning and <eos>: no example is lost.
        sequences = [
            ids[i] if lengths[i] <= max_length else np.append(ids[i][: max_length - 1], EOS_ID) for i in range(len(ids))
        ]
        ids = RaggedIds.from_lists(sequences)
    labels = np.array([label_ids[label] for label in texts.labels], np.int32)
    return LabelledIds(ids, labels)
