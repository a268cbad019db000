r"""Classifies sentences with a trained classifier: one line in, `label<TAB>probability` out.

  echo "Enter the formula in the cell and press Enter." | python classify.py --workdir=runs/classify
  python classify.py --workdir=runs/classify --checkpoint=best --input=sentences.txt --output=labels.tsv

  echo "Click Format - Cells." | python classify.py --workdir=runs/classify --attention_maps=maps/

Uses the config (config.json), tokenizer, classes (labels.tsv) and checkpoints of the
workdir of a run trained with config.task='classification' (e.g. configs/classify.py).
Each line gives the most probable label and its probability; empty lines stay empty;
sentences longer than config.dataset.max_length subwords are cut to it with a warning.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from common.errors import UserInputError
from training.reporting.logs import quiet_library_logs
from training.runtime import host_memory

_WORKDIR = flags.DEFINE_string("workdir", None, "The trained run's directory.")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "latest", "latest, best (highest validation accuracy), average:N (mean of the last N) or a step."
)
_INPUT = flags.DEFINE_string("input", None, "File of sentences, one per line (default: stdin).")
_OUTPUT = flags.DEFINE_string("output", None, "File for the labels (default: stdout).")
_ATTENTION_MAPS = flags.DEFINE_string(
    "attention_maps",
    None,
    "Also draw the encoder's attention maps of each line into DIR/line_<n>/ (PNG) and all lines on one "
    "interactive page, DIR/index.html.",
)
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file the run was trained with (default: <workdir>/config.json).", lock_config=True
)
flags.mark_flags_as_required(["workdir"])


def classify(workdir: str) -> None:
    from models.build import is_classification  # pylint: disable=g-import-not-at-top
    from training import inference, text_io  # pylint: disable=g-import-not-at-top
    from training.config_checks import validate_config  # pylint: disable=g-import-not-at-top  (JAX starts here)
    from training.tasks import base, classification  # pylint: disable=g-import-not-at-top

    config = _CONFIG.value if _CONFIG.value is not None else inference.load_config(workdir)
    if not is_classification(config):
        raise UserInputError(
            f"{workdir} holds a {config.task} run, not a classifier (config.task); "
            "use translate.py for it, or train with config.task='classification' (configs/classify.py)."
        )
    validate_config(config)
    lines = text_io.read_input_lines(_INPUT.value)
    trained = inference.load_trained_model(config, workdir, _CHECKPOINT.value)
    logging.info("Classifying %d lines: %s.", len(lines), trained.selection.description)
    sizes = base.batch_sizes(config, config.eval.per_device_batch_size, trained.mesh)
    setup = classification.predict_setup(config, trained.model, trained.mesh, sizes)
    results = classification.classify_lines(setup, trained.params, trained.tokenizer, lines, config.dataset.max_length)
    names = trained.labels.names
    outputs = ["" if result is None else f"{names[result[0]]}\t{result[1]:.4f}" for result in results]
    text_io.write_output_lines(outputs, _OUTPUT.value)  # First: drawing maps may still fail (a full disk).
    if _ATTENTION_MAPS.value:
        # pylint: disable-next=g-import-not-at-top  (matplotlib and the page only when asked for)
        from training.reporting import attention_maps, attention_page, attention_weights

        sentences = [
            attention_page.PageSentence(
                f"line {number}",
                line.strip(),
                "",
                "",
                attention_weights.classifier_attention(trained.model, trained.params, trained.tokenizer, line.strip()),
            )
            for number, line in enumerate(lines, start=1)
            if line.strip()
        ]
        if sentences:
            title = f"Attention of {workdir}, {trained.selection.description}"
            attention_maps.save_attention(sentences, _ATTENTION_MAPS.value, title)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from training import text_io  # pylint: disable=g-import-not-at-top

    quiet_library_logs()

    text_io.run_command(lambda: classify(_WORKDIR.value), _OUTPUT.value or _ATTENTION_MAPS.value)


if __name__ == "__main__":
    host_memory.set_up()  # Before JAX starts its threads.
    app.run(main)
