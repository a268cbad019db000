r"""Exports a trained translation model for Hugging Face `transformers` or CTranslate2.

  python export.py --workdir=runs/quickstart --format=huggingface --output=exported/hf
  python export.py --workdir=runs/quickstart --format=ctranslate2 --output=exported/ct2 \
      --checkpoint=average:2 --quantization=int8

Reads the workdir as translate.py does (config.json, tokenizer.model, checkpoints) and writes
DIR whole or not at all, with a model card (README.md). Needs the `export` extra:
pip install -e ".[export]".
"""

import shlex
import sys

from absl import app, flags

from exporting import dependencies
from exporting.support import FORMATS, QUANTIZATIONS
from training.reporting.logs import quiet_library_logs

_WORKDIR = flags.DEFINE_string("workdir", None, "The trained run's directory.")
_FORMAT = flags.DEFINE_enum("format", None, FORMATS, "The engine to export for.")
_OUTPUT = flags.DEFINE_string("output", None, "The folder to write (created; see --overwrite).")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "latest", "latest, best (highest validation BLEU), average:N (mean of the last N) or a step."
)
_QUANTIZATION = flags.DEFINE_enum(
    "quantization", None, QUANTIZATIONS, "CTranslate2 only: the weight type (default: float32)."
)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace --output if it exists and is not empty.")
flags.mark_flags_as_required(["workdir", "format", "output"])


def export() -> None:
    dependencies.check_installed(_FORMAT.value)
    from exporting import exporter  # pylint: disable=g-import-not-at-top  (JAX starts here)

    exporter.export_run(
        _WORKDIR.value,
        _FORMAT.value,
        _OUTPUT.value,
        checkpoint=_CHECKPOINT.value,
        quantization=_QUANTIZATION.value,
        overwrite=_OVERWRITE.value,
        command=shlex.join(["python", "export.py", *sys.argv[1:]]),
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from training import text_io  # pylint: disable=g-import-not-at-top

    quiet_library_logs()
    text_io.run_command(export, _OUTPUT.value)


if __name__ == "__main__":
    app.run(main)
