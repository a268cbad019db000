"""Loads the splits a run needs and turns them into subword ids (and, for classification, label ids)."""

import dataclasses
import os
from collections.abc import Callable, Sequence

import ml_collections
import sentencepiece as spm
from absl import logging

from common import processes
from common.errors import UserInputError
from common.workdir import Workdir
from input_pipeline import datasets
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.batching import LabelledIds, ParallelIds
from input_pipeline.labelled_text import LabelledTexts
from input_pipeline.labels import Labels, labels_from_training, load_labels, save_labels
from input_pipeline.text_lines import TextPairs


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A translation corpus: the training split as records to stream, the evaluation splits in memory."""

    tokenizer: spm.SentencePieceProcessor
    tokenizer_path: str  # <workdir>/tokenizer.model, for processes that load the tokenizer themselves.
    # The train split as a random-access source (len(), [i]): record i is {source_lang: bytes, target_lang:
    # bytes} (UTF-8), read from the prepared ArrayRecord files; None when the run needs no training split.
    train_records: Sequence[dict[str, bytes]] | None
    source_lang: str  # The records' keys.
    target_lang: str
    text: dict[str, TextPairs]  # Evaluation split -> sentence pairs.
    ids: dict[str, ParallelIds]  # Evaluation split -> subword ids, each sequence ending with <eos>.


def load_corpus(
    config: ml_collections.ConfigDict,
    workdir: str,
    splits: tuple[str, ...],
    *,
    allow_training_tokenizer: bool,
) -> Corpus:
    """Loads `splits` of config.dataset with the workdir's tokenizer.

    The dataset is prepared in ArrayRecord files on the first run (datasets.make_builder);
    later runs open them without reading the text again. The train split stays on disk as
    `train_records`; every other split of `splits` (and the train split too, if it is also
    config.dataset.valid_split or config.eval.split) is read and tokenized whole.

    The tokenizer is trained on the first run, on at most config.tokenizer.max_training_sentences
    sentences of both sides of the train split drawn with config.seed, and read from
    <workdir>/tokenizer.model afterwards, so a restarted or evaluated run uses the same subwords.

    Raises:
        UserInputError: bad dataset (see datasets.make_builder); no tokenizer
            in the workdir when one may not be trained; a damaged tokenizer file;
            or, when training, a workdir tokenizer other than config.tokenizer
            describes (vocab_size, model_type).
    """
    dataset = config.dataset
    langs = (dataset.source_lang, dataset.target_lang)
    tokenizer = _checked_workdir_tokenizer(config, workdir, allow_training_tokenizer=allow_training_tokenizer)
    needed = splits if tokenizer is not None else tuple(dict.fromkeys((dataset.train_split, *splits)))
    # Process 0 prepares the dataset and trains the tokenizer; the others then read both.
    with processes.main_process_first("prepare_dataset"):
        builder = datasets.make_builder(dataset, workdir, required_splits=needed)
    train_records = datasets.records(builder, dataset.train_split) if dataset.train_split in needed else None
    tokenizer = _workdir_tokenizer(
        config,
        workdir,
        tokenizer,
        lambda: datasets.sample_sentences(train_records, langs, config.tokenizer.max_training_sentences, config.seed),
    )
    evaluated = (dataset.valid_split, config.eval.split)
    text, ids = {}, {}
    for split in splits:
        if split == dataset.train_split and split not in evaluated:
            continue
        text[split] = datasets.load_text_pairs(builder, split, *langs)
        ids[split] = datasets.tokenize(text[split], tokenizer)
        logging.info("%s: %d pairs, %d target subwords.", split, len(ids[split]), int(ids[split].targets.lengths.sum()))
    return Corpus(
        tokenizer=tokenizer,
        tokenizer_path=Workdir(workdir).tokenizer,
        train_records=train_records if dataset.train_split in splits else None,
        source_lang=dataset.source_lang,
        target_lang=dataset.target_lang,
        text=text,
        ids=ids,
    )


def _checked_workdir_tokenizer(
    config: ml_collections.ConfigDict, workdir: str, *, allow_training_tokenizer: bool
) -> spm.SentencePieceProcessor | None:
    """<workdir>/tokenizer.model if the workdir has one (checked against config.tokenizer when training), else None.

    Read and checked before the dataset is prepared: a restart that cannot work writes nothing.

    Raises:
        UserInputError: a damaged tokenizer file; when training, a tokenizer other than
            config.tokenizer describes (vocab_size, model_type); no tokenizer when one may not be trained.
    """
    tokenizer_path = Workdir(workdir).tokenizer
    if os.path.exists(tokenizer_path):
        tokenizer = tokenizer_lib.load_tokenizer(tokenizer_path)
        if allow_training_tokenizer:
            tokenizer_lib.check_tokenizer_matches(
                tokenizer, tokenizer_path, vocab_size=config.tokenizer.vocab_size, kind=config.tokenizer.model_type
            )
        return tokenizer
    if not allow_training_tokenizer:
        raise UserInputError(
            f"{tokenizer_path} does not exist: {workdir} holds no trained run. Train first with the same --workdir."
        )
    return None


def _workdir_tokenizer(
    config: ml_collections.ConfigDict,
    workdir: str,
    tokenizer: spm.SentencePieceProcessor | None,
    training_sentences: Callable[[], list[str]],
) -> spm.SentencePieceProcessor:
    """`tokenizer` if the workdir had one; else <workdir>/tokenizer.model, trained by process 0 on the first run."""
    if tokenizer is not None:
        return tokenizer
    tokenizer_path = Workdir(workdir).tokenizer
    with processes.main_process_first("train_tokenizer"):
        if os.path.exists(tokenizer_path):  # Trained by process 0 meanwhile.
            return tokenizer_lib.load_tokenizer(tokenizer_path)
        os.makedirs(workdir, exist_ok=True)  # Only now: bad data must leave no trace.
        return tokenizer_lib.train_tokenizer(
            training_sentences(),
            tokenizer_path,
            vocab_size=config.tokenizer.vocab_size,
            model_type=config.tokenizer.model_type,
            max_sentences=config.tokenizer.max_training_sentences,
            seed=config.seed,
        )


# --------------------------------------------------------------------------- #
# Classification.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class LabelledCorpus:
    tokenizer: spm.SentencePieceProcessor
    labels: Labels
    text: dict[str, LabelledTexts]  # split -> sentences and label names
    ids: dict[str, LabelledIds]  # split -> subword ids (cut to dataset.max_length) and class ids


def load_labelled_corpus(
    config: ml_collections.ConfigDict,
    workdir: str,
    splits: tuple[str, ...],
    *,
    allow_training_tokenizer: bool,
) -> LabelledCorpus:
    """Loads `splits` of a labelled-text config.dataset with the workdir's tokenizer and classes.

    On the first run the tokenizer is trained on the train split's sentences and the classes
    are read off its labels (<workdir>/tokenizer.model, labels.tsv); later runs and evaluation
    read both back, so class ids never change.

    Raises:
        UserInputError: bad dataset (see datasets.make_labelled_builder), a label the training
            split lacks, or no tokenizer or classes in the workdir when they may not be made.
    """
    dataset = config.dataset
    tokenizer = _checked_workdir_tokenizer(config, workdir, allow_training_tokenizer=allow_training_tokenizer)
    have_vocabularies = tokenizer is not None and os.path.exists(Workdir(workdir).labels)
    if not have_vocabularies and not allow_training_tokenizer:
        raise UserInputError(
            f"{Workdir(workdir).labels} or {Workdir(workdir).tokenizer} does not exist: {workdir} holds no trained "
            "classifier. Train first with the same --workdir."
        )
    needed = splits if have_vocabularies else tuple(dict.fromkeys((dataset.train_split, *splits)))
    with processes.main_process_first("prepare_dataset"):
        builder = datasets.make_labelled_builder(dataset, workdir, required_splits=needed)
    text = {split: datasets.load_labelled_texts(builder, split) for split in needed}
    tokenizer = _workdir_tokenizer(config, workdir, tokenizer, lambda: text[dataset.train_split].texts)
    with processes.main_process_first("save_labels"):
        if os.path.exists(Workdir(workdir).labels):
            labels = load_labels(workdir)
        else:
            names = datasets.text_and_label_features(builder)[2]
            labels = labels_from_training(text[dataset.train_split].labels, names)
            save_labels(labels, workdir)
    ids = {}
    for split in splits:
        ids[split] = datasets.tokenize_labelled(text[split], tokenizer, labels.ids, dataset.max_length)
        logging.info("%s: %d examples, %d subwords.", split, len(ids[split]), int(ids[split].lengths.sum()))
    return LabelledCorpus(tokenizer, labels, {s: text[s] for s in splits}, ids)
