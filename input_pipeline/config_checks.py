"""Checks of config.dataset and config.tokenizer before any data is read: each names the field that cannot work."""

import ml_collections

from common.config_fields import is_int, require_bool, require_choice, require_positive
from common.errors import UserInputError

TOKENIZER_MODEL_TYPES = ("unigram", "bpe")  # SentencePiece's.
# Datasets read from config.dataset.path, per config.task (datasets.LOCAL_DATASET, LOCAL_LABELLED_DATASET).
_LOCAL_DATASETS = {"translation": "parallel_text", "classification": "labelled_text"}


def check_data(config: ml_collections.ConfigDict) -> None:
    """Raises UserInputError naming the first field of config.dataset or config.tokenizer that cannot work.

    config.task (checked) says which datasets fit.
    """
    dataset, tokenizer = config.dataset, config.tokenizer
    require_positive("dataset.max_length", dataset.max_length)
    for name in ("vocab_size", "max_training_sentences"):
        require_positive(f"tokenizer.{name}", tokenizer[name])
    require_choice("tokenizer.model_type", tokenizer.model_type, TOKENIZER_MODEL_TYPES)
    _check_batching(dataset)
    _check_source(config.task, dataset)


def _check_batching(dataset: ml_collections.ConfigDict) -> None:
    """Packing, the workers that build batches, and the length buckets."""
    require_bool("dataset.packing", dataset.packing)
    lookahead = dataset.packing_lookahead
    if not is_int(lookahead) or lookahead < 0:
        raise UserInputError(
            f"config.dataset.packing_lookahead is {lookahead!r}; it must be 0 (first fit) or the pairs per row "
            "the packer picks from (e.g. 8)."
        )
    workers = dataset.num_workers
    if not is_int(workers) or workers < 0:
        raise UserInputError(
            f"config.dataset.num_workers is {workers!r}; it must be 0 (a background thread of the training process) "
            "or a number of worker processes."
        )
    boundaries = list(dataset.bucket_boundaries)
    if (
        not boundaries
        or boundaries != sorted(set(boundaries))
        or boundaries[0] < 2
        or boundaries[-1] != dataset.max_length
    ):
        raise UserInputError(
            f"config.dataset.bucket_boundaries {tuple(boundaries)} must be strictly "
            "increasing lengths >= 2 ending at config.dataset.max_length "
            f"({dataset.max_length})."
        )


def _check_source(task: str, dataset: ml_collections.ConfigDict) -> None:
    """The dataset is one of `task`'s, local files have a folder, and translation's languages differ."""
    local = _LOCAL_DATASETS[task]
    other_local = [name for t, name in _LOCAL_DATASETS.items() if t != task]
    if dataset.name in other_local:
        raise UserInputError(
            f"config.dataset.name is {dataset.name!r}, a dataset for another task than config.task "
            f"({task!r}); use {local!r} (files in config.dataset.path) or a TFDS dataset of the task."
        )
    if dataset.name == local and not dataset.path:
        raise UserInputError(
            f"config.dataset.name is {local!r} but config.dataset.path is "
            "empty; set --config.dataset.path to a folder of train/valid/test files."
        )
    if task == "translation" and dataset.source_lang == dataset.target_lang:
        raise UserInputError(
            f"config.dataset.source_lang and target_lang are both {dataset.source_lang!r}; they must differ."
        )
