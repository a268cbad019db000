"""One export: a workdir's chosen checkpoint written as a folder another engine loads, with its model card."""

import os
import shutil

import jax
import ml_collections
from absl import logging

from common.errors import UserInputError
from common.workdir import Workdir
from exporting import folder, model_card, support
from exporting.network import Network, network_from_params
from training import inference


def _write_huggingface(network: Network, trained: inference.TrainedModel, config, staging: str) -> str:
    """Writes the `transformers` model, tokenizer and generation defaults; returns the model class's name."""
    from exporting import hf_tokenizer, to_huggingface  # pylint: disable=g-import-not-at-top  (torch starts here)

    model = to_huggingface.build_model(
        network,
        support.huggingface_architecture(config),
        dropout_rate=config.model.dropout_rate,
        attention_dropout_rate=config.model.attention_dropout_rate,
    )
    model.generation_config = to_huggingface.generation_config(config.eval, config.eval.max_decode_length)
    model.save_pretrained(staging)
    hf_tokenizer.huggingface_tokenizer(trained.tokenizer, config.dataset.max_length).save_pretrained(staging)
    return type(model).__name__


def _write_ctranslate2(
    network: Network, trained: inference.TrainedModel, workdir: str, staging: str, quantization: str | None
) -> str:
    """Writes the CTranslate2 model and the SentencePiece model beside it; returns the spec's name."""
    from exporting import to_ctranslate2  # pylint: disable=g-import-not-at-top

    tokenizer = trained.tokenizer
    spec = to_ctranslate2.transformer_spec_of(
        network, [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size())]
    )
    to_ctranslate2.save(spec, staging, quantization)
    shutil.copyfile(Workdir(workdir).tokenizer, os.path.join(staging, "sentencepiece.model"))
    return f"CTranslate2 {spec.name}" + (f" ({quantization})" if quantization else "")


def check_request(config: ml_collections.ConfigDict, export_format: str, quantization: str | None) -> None:
    """Checks the format can hold the run's model and the options fit the format, before anything is read.

    Raises:
        UserInputError: naming the config field or the option.
    """
    support.check_exportable(config, export_format)
    if quantization and export_format != "ctranslate2":
        raise UserInputError(f"--quantization applies to --format=ctranslate2, not {export_format}.")
    if quantization and quantization not in support.QUANTIZATIONS:
        choices = ", ".join(support.QUANTIZATIONS)
        raise UserInputError(f"Unknown --quantization={quantization}; choose one of {choices}.")


def export_run(
    workdir: str,
    export_format: str,
    output: str,
    *,
    checkpoint: str = "latest",
    quantization: str | None = None,
    overwrite: bool = False,
    command: str = "",
) -> None:
    """Exports a trained run's parameters to `output`, a folder written whole or not at all.

    Args:
        workdir: the run's workdir (config.json, tokenizer.model, checkpoints).
        export_format: 'ctranslate2' or 'huggingface'.
        output: the folder to write; an existing non-empty one only with `overwrite`.
        checkpoint: 'latest', 'best', 'average:N' or a step, as for translate.py.
        quantization: CTranslate2 weight type ('int8', ...); None keeps float32.
        overwrite: replace an existing non-empty `output`.
        command: the command line, for the model card.

    Raises:
        UserInputError: the run, the checkpoint or the options cannot be exported (one line naming why).
    """
    config = inference.load_config(workdir)
    check_request(config, export_format, quantization)
    folder.check_destination(output, overwrite=overwrite)  # Before the restore: fail fast.
    trained = inference.load_trained_model(config, workdir, checkpoint)
    network = network_from_params(trained.model.config, jax.device_get(trained.params))
    if config.model.dtype != "float32":  # The run's setting: 'auto' is bfloat16 wherever matmuls have it.
        logging.warning(
            "The run computes in %s; the export computes in float32 from the same (float32) parameters, so its "
            "translations may differ from translate.py's where two tokens' logits are within that rounding.",
            config.model.dtype,
        )
    with folder.written_whole(output, overwrite=overwrite) as staging:
        if export_format == "huggingface":
            architecture = _write_huggingface(network, trained, config, staging)
        else:
            architecture = _write_ctranslate2(network, trained, workdir, staging, quantization)
        card = model_card.model_card(
            config,
            export_format=export_format,
            architecture=architecture,
            workdir=workdir,
            checkpoint=trained.selection.description,
            command=command,
            output=output,
        )
        with open(os.path.join(staging, "README.md"), "w", encoding="utf-8") as f:
            f.write(card)
    logging.info("Exported %s of %s to %s as %s.", trained.selection.description, workdir, output, architecture)
