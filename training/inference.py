"""A trained model loaded from its workdir, and translation of raw text with it.

Shared by `translate.py` and checkpoint evaluation: the workdir holds the run's
config (config.json), tokenizer and checkpoints.
"""

import dataclasses
import json
import os
from collections.abc import Sequence

import flax.linen as nn
import jax
import ml_collections
import sentencepiece as spm
from absl import logging

from common import io_errors
from common.errors import UserInputError
from common.workdir import Workdir
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.labels import Labels, load_labels
from models import Transformer
from models.build import init_boxed_params, is_classification, make_model
from training.checkpoints.checkpointer import Checkpointer, Selection
from training.runtime import sharding
from training.runtime.program_store import ProgramStore
from training.tasks import translation_decoding


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Writes the run's config to <workdir>/config.json, for translate.py and later evaluation."""
    path = Workdir(workdir).config
    with io_errors.naming(path), open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    os.replace(path + ".tmp", path)


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a workdir's run was trained with.

    Raises:
        UserInputError: the workdir has no readable config.json (pass the config file instead).
    """
    path = Workdir(workdir).config
    if not os.path.exists(path):
        raise UserInputError(
            f"{path} does not exist: {workdir} holds no run trained with this version of the code; "
            "pass the config it was trained with, e.g. --config=configs/quickstart.py."
        )
    try:
        with open(path, encoding="utf-8") as f:
            return ml_collections.ConfigDict(json.load(f))
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8.
        raise UserInputError(
            f"{path} is unreadable ({e}); pass the config the run was trained with, e.g. "
            "--config=configs/quickstart.py (training writes the file again)."
        ) from None


@dataclasses.dataclass(frozen=True)
class TrainedModel:
    """Parameters restored from a workdir, with what it takes to use them."""

    model: Transformer
    params: object  # The parameter pytree, laid out on `mesh` by config.mesh.rules.
    tokenizer: spm.SentencePieceProcessor
    mesh: jax.sharding.Mesh
    selection: Selection  # Which checkpoint(s) the parameters come from.
    labels: Labels | None = None  # A classifier's classes; None for translation.


def load_trained_model(
    config: ml_collections.ConfigDict, workdir: str, checkpoint: str = "latest", store: ProgramStore | None = None
) -> TrainedModel:
    """Restores a workdir's parameters and tokenizer for the model config describes.

    Args:
        config: the run's config (its model and vocabulary must fit the checkpoint).
        workdir: the run's workdir.
        checkpoint: 'latest', 'best', 'average:N' or a step (see `Checkpointer.select`). 'latest' is
            the newest intact step: a damaged later one is skipped with one warning (and left in place).
        store: where the parameters' shapes are kept from one process to the next (None: traced from the model).

    Raises:
        UserInputError: no checkpoint or tokenizer in the workdir, a bad checkpoint
            choice, or a checkpoint that does not fit the model.
        DamagedCheckpointError: the chosen checkpoint is damaged, or with 'latest' every one is.
    """
    directory = Workdir(workdir).checkpoints
    if not os.path.isdir(directory) or not os.listdir(directory):
        raise UserInputError(
            f"No checkpoints in {directory}: train first, e.g. `python train.py --config=... --workdir={workdir}`."
        )
    tokenizer_path = Workdir(workdir).tokenizer
    if not os.path.exists(tokenizer_path):
        raise UserInputError(f"{tokenizer_path} does not exist: {workdir} holds no trained run.")
    tokenizer = tokenizer_lib.load_tokenizer(tokenizer_path)
    labels = load_labels(workdir) if is_classification(config) else None
    mesh = sharding.make_mesh(config.mesh)
    model = make_model(config, tokenizer.vocab_size(), num_classes=len(labels.names) if labels else 0)

    # Parameters are restored straight onto their shards, as config.mesh.rules lay them out.
    def boxed_shapes():
        return jax.eval_shape(lambda: init_boxed_params(model, jax.random.PRNGKey(0)))

    boxed = boxed_shapes() if store is None else store.shapes(["parameters", repr(model)], boxed_shapes)
    abstract_params = sharding.with_shardings(
        nn.unbox(boxed), sharding.shardings_from_boxes(boxed, mesh, config.mesh.rules)
    )
    checkpointer = Checkpointer(workdir, read_only=True)
    try:
        params, selection = checkpointer.load_params(checkpoint, abstract_params)
    finally:
        checkpointer.close()
    return TrainedModel(model, params, tokenizer, mesh, selection, labels)


def translate_lines(
    translator: translation_decoding.Translator, params, lines: Sequence[str], max_source_length: int
) -> list[str]:
    """Translations of raw sentences, one per line, in order; an empty line gives an empty line.

    Args:
        translator: config.eval's decoding, its rows and the tokenizer.
        params: the model parameters.
        lines: source sentences.
        max_source_length: longer sources (in subwords, with <eos>) are cut to it, with a warning.
    """
    sources, cut = tokenizer_lib.encode_sources(
        translator.tokenizer, [line.strip() for line in lines], max_source_length
    )
    for i in cut:
        logging.warning(
            "Line %d is longer than %d subwords; only its beginning is translated.", i + 1, max_source_length
        )
    return translation_decoding.translate(translator, params, sources)
