r"""Translates sentences with a trained model: one line in, one line out.

  echo "Click the OK button." | python translate.py --workdir=runs/quickstart
  python translate.py --workdir=runs/quickstart --beam_size=4 --checkpoint=best \
      --input=sentences.en --output=sentences.de

  printf 'Click OK.\tKlicken Sie auf OK.\n' | python translate.py --workdir=runs/quickstart \
      --attention_maps=maps/

Uses the config (config.json), tokenizer and checkpoints of the workdir. Empty
lines stay empty; sentences longer than config.dataset.max_length subwords are
cut to it with a warning. Decoding is greedy unless --beam_size or --temperature
say otherwise.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from common.decoding_names import describe_decoding
from common.errors import UserInputError
from training.reporting.logs import quiet_library_logs
from training.runtime import host_memory

_WORKDIR = flags.DEFINE_string("workdir", None, "The trained run's directory.")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "latest", "latest, best (highest validation BLEU), average:N (mean of the last N) or a step."
)
_INPUT = flags.DEFINE_string("input", None, "File of source sentences, one per line (default: stdin).")
_OUTPUT = flags.DEFINE_string("output", None, "File for the translations (default: stdout).")
_BEAM_SIZE = flags.DEFINE_integer("beam_size", None, "Beam size; 1 is greedy (default: the run's config.eval).")
_LENGTH_PENALTY = flags.DEFINE_float("length_penalty", None, "GNMT length penalty alpha for beam search.")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "> 0 samples each token at this temperature.")
_TOP_K = flags.DEFINE_integer("top_k", None, "With --temperature: sample among the k most likely tokens.")
_DTYPE = flags.DEFINE_enum(
    "dtype", None, ["auto", "float32", "bfloat16"], "Matmul dtype to decode with (default: the run's model.dtype)."
)
_ATTENTION_MAPS = flags.DEFINE_string(
    "attention_maps",
    None,
    "Also draw attention maps of each line into DIR/line_<n>/ (PNG, every layer and head) and all lines on "
    "one interactive page, DIR/index.html. A line "
    "'source<TAB>target' draws them for that target (and translates the source); otherwise for the "
    "translation. Without this flag a tab is part of the sentence.",
)
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir",
    None,
    "Where compiled decoding programs are kept ('': nowhere; default: the user's cache folder, configs/default.py). "
    "Never the run's config.compilation_cache_dir: the programs are code, and a run may come from elsewhere.",
)
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file the run was trained with (default: <workdir>/config.json).", lock_config=True
)
flags.mark_flags_as_required(["workdir"])


def _decoding_config(config):
    """The config with the decoding flags given applied (to config.eval; --dtype to model.dtype), validated."""
    from training.config_checks import validate_config  # pylint: disable=g-import-not-at-top

    overrides = {
        "beam_size": _BEAM_SIZE.value,
        "length_penalty": _LENGTH_PENALTY.value,
        "temperature": _TEMPERATURE.value,
        "top_k": _TOP_K.value,
    }
    config = config.copy_and_resolve_references()
    for name, value in overrides.items():
        if value is not None:
            config.eval[name] = value
    if _DTYPE.value is not None:
        config.model.dtype = _DTYPE.value
    validate_config(config)
    return config


def _draw_attention_maps(trained, lines: list[str], translations: list[str], out_dir: str, title: str) -> None:
    # pylint: disable-next=g-import-not-at-top  (matplotlib and the page only when asked for)
    from training.reporting import attention_maps, attention_page, attention_weights

    sentences = []
    for number, (line, translation) in enumerate(zip(lines, translations), start=1):
        source, _, given = (side.strip() for side in line.partition("\t"))
        if not source:
            continue
        target = given or translation
        attention = attention_weights.sentence_attention(
            trained.model, trained.params, trained.tokenizer, source, target
        )
        origin = "given" if given else "translation"
        sentences.append(attention_page.PageSentence(f"line {number}", source, target, origin, attention))
    if sentences:
        attention_maps.save_attention(sentences, out_dir, title)


def translate(workdir: str) -> None:
    import common  # pylint: disable=g-import-not-at-top  (with models, what the stored programs run)
    import models  # pylint: disable=g-import-not-at-top
    from common.compile_events import TRACING_EVENTS, compile_events  # pylint: disable=g-import-not-at-top
    from training import inference, phases, text_io  # pylint: disable=g-import-not-at-top  (JAX starts here)
    from training.runtime import compilation_cache  # pylint: disable=g-import-not-at-top
    from training.runtime.program_store import program_store  # pylint: disable=g-import-not-at-top
    from training.tasks import translation_decoding  # pylint: disable=g-import-not-at-top

    config = _CONFIG.value if _CONFIG.value is not None else inference.load_config(workdir)
    if config.task != "translation":
        raise UserInputError(f"{workdir} holds a {config.task} run, not a translation model; use classify.py for it.")
    config = _decoding_config(config)
    # A later translation with the same config and shapes reads its compiled decoding back: from the program
    # store (no tracing), or with several processes from JAX's cache.
    code = (models, common, translation_decoding)  # What the stored programs run: the model, searches, their ids.
    cache_dir = compilation_cache.DEFAULT_DIR if _COMPILATION_CACHE_DIR.value is None else _COMPILATION_CACHE_DIR.value
    store = program_store(compilation_cache.cache_folder(cache_dir), code)
    if store is None:
        compilation_cache.enable(cache_dir)
    lines = text_io.read_input_lines(_INPUT.value)
    # 'source<TAB>target' lines are for attention maps; otherwise a tab is part of the sentence.
    sources = [line.partition("\t")[0] for line in lines] if _ATTENTION_MAPS.value else lines
    imported = phases.process_age_seconds()  # The interpreter, the imports, the config: before any phase.
    clock = phases.PhaseClock()
    with compile_events() as events, clock.counting_compiles():
        with clock.phase("restore"):
            trained = inference.load_trained_model(config, workdir, _CHECKPOINT.value, store)
        decoding = describe_decoding(config.eval)
        logging.info("Translating %d lines: %s, %s.", len(lines), trained.selection.description, decoding)
        with clock.phase("decoding"):
            translator = translation_decoding.translator(config, trained.model, trained.tokenizer, trained.mesh, store)
            translations = inference.translate_lines(translator, trained.params, sources, config.dataset.max_length)
    text_io.write_output_lines(translations, _OUTPUT.value)  # First: drawing maps may still fail (a full disk).
    tracing = sum(seconds for event, seconds, _ in events if event in TRACING_EVENTS)
    seconds = {"imports": imported or 0.0, "restore": clock.seconds["restore"], "tracing": tracing}
    seconds.update(compiling=clock.seconds[phases.COMPILE] - tracing, decoding=clock.seconds["decoding"])
    logging.info("Start-up and translation: %s.", phases.describe(seconds))
    if _ATTENTION_MAPS.value:
        title = f"Attention of {workdir}, {trained.selection.description}"
        _draw_attention_maps(trained, lines, translations, _ATTENTION_MAPS.value, title)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from training import text_io  # pylint: disable=g-import-not-at-top

    quiet_library_logs()

    text_io.run_command(lambda: translate(_WORKDIR.value), _OUTPUT.value or _ATTENTION_MAPS.value)


if __name__ == "__main__":
    host_memory.set_up()  # Before JAX starts its threads.
    app.run(main)
