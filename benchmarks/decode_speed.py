r"""Decoding a whole test split: this project beside CTranslate2 (each in a process of its own), and as whole processes.

  python -m benchmarks.decode_speed --workdir=runs/quickstart    # needs the export extra
  python -m benchmarks.decode_speed --workdir=runs/quickstart --profile_calls=2

Decodes the test split as translate.py and evaluation do (`inference.translate_lines`: each
sentence with its own budget, the run's batches), greedy and with beam 4 at the run's alpha, in
this project's 'auto' and float32 dtypes, alternating in rounds in this process; then CTranslate2
float32 and int8 on the run exported with export.py's code, the same rounds in a process of their
own (benchmarks/ctranslate2_engine.py says why; --ct2_batch_size sentences a batch, on a GPU where
CTranslate2 finds one, else with the machine's cores as threads; greedy at the largest budget, cut
to each sentence's, beam search at each sentence's budget). It reports output subwords per second
(with `</s>`) and BLEU of each. Then it times whole processes on the same lines, start to end
(import, load, compile, decode, write): translate.py, first with an empty compilation cache and
again with the programs it wrote there, against ctranslate2_engine.py translating the file; and
each of them translating the split's first line alone, what starting up costs before decoding.
--noctranslate2 leaves CTranslate2 out (a machine without the export extra).

Each engine's first call in this process also counts the programs it compiles (or reads from a
compilation cache), the seconds XLA takes for them and those of tracing and lowering the jitted
functions: decoding's own, the model loaded before.

With --profile_calls, this project's float32 search is profiled too (benchmarks/xla_profile.py, by
decoding's buckets: the model's matmuls, the search's top-k and beam reordering, cache writes,
...): translating the whole split, its programs named by an `--xla_dump_to` dump of this process.
Writes a record (common/records.py).
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import sacrebleu
import sentencepiece
from absl import app, flags, logging

from benchmarks import accelerator_step, ctranslate2_engine, hlo_buckets, xla_profile
from common import records
from common.compile_events import BACKEND_COMPILE_EVENT, compile_events
from exporting import exporter
from input_pipeline.text_lines import read_lines
from models.decoding import decode_length
from training import inference, phases
from training.config_checks import validate_config
from training.reporting.logs import quiet_library_logs
from training.runtime import host_memory
from training.tasks import translation_decoding

records.define_software_note_flag()

_WORKDIR = flags.DEFINE_string("workdir", None, "The trained run to translate with.")
_SOURCES = flags.DEFINE_string("sources", "data/libreoffice_help_en_de/test.en.gz", "Source sentences.")
_REFERENCES = flags.DEFINE_string("references", "data/libreoffice_help_en_de/test.de.gz", "Their references.")
_BEAM_SIZES = flags.DEFINE_list("beam_sizes", ["1", "4"], "Beam sizes to time (1 is greedy).")
_DTYPES = flags.DEFINE_list("dtypes", ["auto", "float32"], "This project's compute dtypes (model.dtype values).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Timed rounds after a first that compiles; each translates every line.")
_CT2_BATCH_SIZE = flags.DEFINE_integer("ct2_batch_size", 32, "CTranslate2's sentences a batch.")
_CTRANSLATE2 = flags.DEFINE_bool("ctranslate2", True, "Time CTranslate2 too (needs the export extra).")
_WHOLE_PROCESSES = flags.DEFINE_bool("whole_processes", True, "Also time whole processes.")
_PROFILE_CALLS = flags.DEFINE_integer("profile_calls", 0, "Runs of the float32 search to profile (0: none).")
_OUTPUT = flags.DEFINE_string(
    "output", "", "Record path without suffix (default: decode_speed_<cpu kind>, or _<platform> on an accelerator)."
)
flags.mark_flags_as_required(["workdir"])


def _setup(workdir: str, dtype: str, beam_size: int, alpha: float):
    """(config, trained model, translator) of the run, decoding as asked."""
    config = inference.load_config(workdir).copy_and_resolve_references()
    config.model.dtype = dtype
    config.eval.beam_size, config.eval.length_penalty = beam_size, alpha
    validate_config(config)
    trained = inference.load_trained_model(config, workdir)
    return config, trained, translation_decoding.translator(config, trained.model, trained.tokenizer, trained.mesh)


def _ours(workdir: str, dtype: str, beam_size: int, alpha: float, lines: list[str]):
    """A call that translates `lines` as translate.py does, with the run's latest parameters."""
    config, trained, translator = _setup(workdir, dtype, beam_size, alpha)
    return lambda: inference.translate_lines(translator, trained.params, lines, config.dataset.max_length)


def _profile(translate, calls: int, dump_dir: str) -> dict:
    """`xla_profile.profile` of `translate` (warmed up), its programs' modules read from `dump_dir`."""
    return xla_profile.profile(translate, calls=calls, dump_dir=dump_dir, buckets=hlo_buckets.DECODE_BUCKETS)


def _counting_programs(call):
    """(call(), {'programs': the programs it compiled or read from a compilation cache, 'compiling_seconds': the
    seconds XLA took for them, 'tracing_seconds': those of tracing and lowering its jitted functions})."""
    with compile_events() as events:
        result = call()
    compiles = [seconds for event, seconds, _ in events if event == BACKEND_COMPILE_EVENT]
    tracing = sum(seconds for event, seconds, _ in events if event != BACKEND_COMPILE_EVENT)
    return result, {"programs": len(compiles), "compiling_seconds": sum(compiles), "tracing_seconds": tracing}


def _whole_process(command: list[str]) -> dict:
    """{'seconds': how long `command` ran, from the repository's root, 'phases': the seconds of each phase that
    translate.py logs (imports, restore, tracing, compiling, decoding; {} for another command)}; a failure ends
    the benchmark with the command's errors."""
    start = time.perf_counter()
    env = {**os.environ, "XLA_FLAGS": _CALLERS_XLA_FLAGS}  # Without this process's dump.
    finished = subprocess.run(command, capture_output=True, text=True, cwd=records.REPO_ROOT, env=env)
    seconds = time.perf_counter() - start
    if finished.returncode:
        sys.exit(f"error: {' '.join(command)} exited with {finished.returncode}:\n{finished.stderr[-3000:]}")
    logged = [line for line in finished.stderr.splitlines() if "Start-up and translation:" in line]
    return {"seconds": seconds, "phases": phases.parse(logged[-1]) if logged else {}}


# What any JAX program that restores a checkpoint and reads a SentencePiece model imports: the floor under
# translate.py's start-up on this machine.
BARE_IMPORTS = "import jax, flax, orbax.checkpoint, sentencepiece; jax.numpy.zeros(1)"


def _row(
    engine: str, beam_size: int, seconds: list[float], translations: list[str], references: list[str], sp, compiles=None
) -> dict:
    """A table row from an engine's seconds (the first round compiling, the others timed) and translations, and
    what its first call compiled (`_counting_programs`; None: not counted, another engine)."""
    first, *timed = seconds
    subwords = sum(len(sp.encode(line)) + 1 for line in translations)  # With </s>.
    median = statistics.median(timed)
    bleu = sacrebleu.BLEU().corpus_score(translations, [references]).score
    logging.info("%s, beam %d: %.1f s, BLEU %.2f", engine, beam_size, median, bleu)
    return {
        "engine": engine,
        "beam_size": beam_size,
        "first_call_seconds": first,
        "seconds": median,
        "seconds_all": timed,
        "output_subwords": subwords,
        "output_subwords_per_second": subwords / median,
        "bleu": bleu,
        "programs_compiled": compiles and compiles["programs"],
        "compiling_seconds": compiles and compiles["compiling_seconds"],
        "tracing_seconds": compiles and compiles["tracing_seconds"],
    }


_CALLERS_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")


def main(argv) -> None:
    del argv
    with tempfile.TemporaryDirectory() as dump_dir:
        if _PROFILE_CALLS.value:  # Read once, when JAX starts its backend: no device is used before this line.
            os.environ["XLA_FLAGS"] = f"{_CALLERS_XLA_FLAGS} --xla_dump_to={dump_dir}".strip()
        _measure(dump_dir)


def _measure(dump_dir: str) -> None:
    # The translate.py processes timed beside this one take an accelerator's memory as a user's would.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    host_memory.set_up()  # As translate.py runs.
    quiet_library_logs()
    workdir, dtypes, rounds, ct2_batch_size = _WORKDIR.value, _DTYPES.value, _ROUNDS.value, _CT2_BATCH_SIZE.value
    measured_source = records.source()
    lines, reference_lines = list(read_lines(_SOURCES.value)), list(read_lines(_REFERENCES.value))
    config = inference.load_config(workdir)
    alpha, max_source = config.eval.length_penalty, config.dataset.max_length
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(workdir, "tokenizer.model"))
    lengths = [min(len(sp.encode(line.strip())) + 1, max_source) for line in lines]  # As translate.py cuts them.
    budgets = decode_length(np.array(lengths), config.eval.max_decode_length).tolist()
    rows, processes, profiles, ct2_devices = [], [], {}, set()
    with tempfile.TemporaryDirectory() as scratch:
        folders = {}
        for weights, quantization in (("float32", None), ("int8", "int8")) if _CTRANSLATE2.value else ():
            folders[weights] = os.path.join(scratch, weights)
            exporter.export_run(workdir, "ctranslate2", folders[weights], quantization=quantization)
        for beam_size in [int(b) for b in _BEAM_SIZES.value]:
            engines = {f"this project, {dtype}": _ours(workdir, dtype, beam_size, alpha, lines) for dtype in dtypes}
            seconds = {engine: [] for engine in engines}
            translations, compiles = {}, {}
            for round_ in range(1 + rounds):  # The first round compiles this project's programs.
                for engine, translate in engines.items():
                    start = time.perf_counter()
                    translations[engine], counts = _counting_programs(translate)
                    seconds[engine].append(time.perf_counter() - start)
                    compiles.setdefault(engine, counts)
            rows += [_row(e, beam_size, seconds[e], translations[e], reference_lines, sp, compiles[e]) for e in engines]
            for weights, folder in folders.items():
                # Greedy at the largest budget, cut to each line's (a greedy output's first n subwords do not
                # depend on how many follow); beam search at each line's.
                theirs = ctranslate2_engine.translate(
                    folder,
                    lines,
                    [max(budgets)] * len(lines) if beam_size == 1 else budgets,
                    beam_size=beam_size,
                    length_penalty=alpha,
                    max_source_length=max_source,
                    batch_size=ct2_batch_size,
                    rounds=1 + rounds,
                )
                ct2_devices.add(theirs.device)
                texts = [sp.decode_pieces(h[:budget]) for h, budget in zip(theirs.hypotheses, budgets)]
                rows.append(_row(f"CTranslate2, {weights}", beam_size, theirs.seconds, texts, reference_lines, sp))
            if _WHOLE_PROCESSES.value:
                processes += _time_processes(
                    workdir, folders, lines, beam_size, alpha, config, scratch, ct2_batch_size, dtypes
                )
            if _PROFILE_CALLS.value:
                float32 = _ours(workdir, "float32", beam_size, alpha, lines)
                float32()  # Compiles.
                profiles[f"beam {beam_size}"] = _profile(float32, _PROFILE_CALLS.value, dump_dir)
    _write(rows, processes, profiles, lines, rounds, ct2_batch_size, sorted(ct2_devices), measured_source, workdir)


def _time_processes(workdir, folders, lines, beam_size, alpha, config, scratch, ct2_batch_size, dtypes) -> list[dict]:
    """Seconds of whole processes translating `lines`, then their first line alone, into a file: translate.py
    in each of `dtypes`, first with an empty compilation cache, then again with the programs the first wrote
    there; benchmarks/ctranslate2_engine.py with each export in `folders`."""
    max_source = config.dataset.max_length
    target = os.path.join(scratch, "target.txt")
    processes = []
    for part, name, inputs in (("all", "", lines), ("first", ", one line", lines[:1])):
        source = os.path.join(scratch, f"source_{part}.txt")
        with open(source, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in inputs)
        translate_py = [sys.executable, os.path.join(records.REPO_ROOT, "translate.py"), f"--workdir={workdir}"]
        translate_py += [f"--beam_size={beam_size}", f"--length_penalty={alpha}", f"--input={source}"]
        translate_py += [f"--output={target}"]
        commands = {}
        for dtype in dtypes:
            cache = os.path.join(scratch, f"compilation_cache_beam{beam_size}_{dtype}_{part}")  # Empty at first.
            command = [*translate_py, f"--dtype={dtype}", f"--compilation_cache_dir={cache}"]
            commands[f"translate.py, {dtype}{name}"] = command  # Compiles, and writes the cache.
            commands[f"translate.py, {dtype}{name}, cached"] = command  # Reads it.
        for weights, folder in folders.items():
            commands[f"CTranslate2, {weights}{name}"] = [
                *(sys.executable, "-m", "benchmarks.ctranslate2_engine", folder, source, target),
                *(f"--beam_size={beam_size}", f"--length_penalty={alpha}", f"--batch_size={ct2_batch_size}"),
                *(f"--max_decoding_length={config.eval.max_decode_length}", f"--max_source_length={max_source}"),
            ]
        if beam_size == 1 and part == "first":
            commands["python: the bare imports"] = [sys.executable, "-c", BARE_IMPORTS]
        processes += [
            {"command": command, "beam_size": beam_size, "lines": len(inputs), **_whole_process(c)}
            for command, c in commands.items()
        ]
    return processes


def _startup_ratios(processes: list[dict]) -> dict:
    """For each dtype translate.py ran in: its one line, cached, less the bare imports (seconds); the whole split,
    cached and cold, over CTranslate2 float32's whole process (a ratio), at each beam size."""
    seconds = {(p["command"], p["beam_size"]): p["seconds"] for p in processes}
    bare = seconds.get(("python: the bare imports", 1))
    dtypes = sorted({p["command"].split(", ")[1] for p in processes if p["command"].startswith("translate.py")})
    figures = {}
    for dtype in dtypes:
        one_line = seconds.get((f"translate.py, {dtype}, one line, cached", 1))
        if bare is not None and one_line is not None:
            figures[f"{dtype}: one line, cached, less the bare imports (s)"] = one_line - bare
        for beam in sorted({p["beam_size"] for p in processes}):
            for name, command in (("cached", f"translate.py, {dtype}, cached"), ("cold", f"translate.py, {dtype}")):
                theirs, ours = seconds.get(("CTranslate2, float32", beam)), seconds.get((command, beam))
                if theirs and ours:
                    figures[f"{dtype}: whole split {name}, beam {beam}, over CTranslate2 float32's"] = ours / theirs
    return figures


def _phase(process: dict, name: str) -> str:
    """A process's seconds in phase `name` as a table cell (blank: not translate.py)."""
    value = process.get("phases", {}).get(name)
    return "" if value is None else f"{value:.2f}"


def _compiles(row: dict) -> str:
    """A row's programs, their compiling and tracing seconds, as table cells (blank for another engine)."""
    if row.get("compiling_seconds") is None:  # Another engine, or a record from before these were counted.
        return f"{'' if row['programs_compiled'] is None else row['programs_compiled']} |  | "
    return f"{row['programs_compiled']} | {row['compiling_seconds']:.1f} | {row['tracing_seconds']:.1f}"


def _write(rows, processes, profiles, lines, rounds, ct2_batch_size, ct2_devices, measured_source, workdir) -> None:
    references = [
        engine for engine in ("CTranslate2, float32", "CTranslate2, int8") if any(r["engine"] == engine for r in rows)
    ]

    def ratios(row: dict) -> str:
        """The reference engines' seconds over this row's, at its beam size."""
        seconds = {r["engine"]: r["seconds"] for r in rows if r["beam_size"] == row["beam_size"]}
        return "".join(f" {seconds[engine] / row['seconds']:.2f}x |" for engine in references)

    ct2 = ""
    if references:
        threads = f"{os.cpu_count()} threads" if ct2_devices == ["cpu"] else "/".join(ct2_devices)
        ct2 = (
            f"; CTranslate2 in a process of its own ({threads}, {ct2_batch_size} sentences a batch). "
            "Speed ratios: the other engine's seconds over this row's"
        )
    table = [
        f"The whole test split ({len(lines):,} lines), each sentence with its own budget, median of {rounds} "
        f"rounds after a first that compiles{ct2}.",
        "",
        "| engine | beam | first call s | programs compiled | their compiling s | tracing s | s | output subwords/s |"
        + "".join(f" vs {e} |" for e in references)
        + " BLEU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(references) + "---:|",
        *(
            f"| {row['engine']} | {row['beam_size']} | {row['first_call_seconds']:.1f} | {_compiles(row)} "
            f"| {row['seconds']:.1f} | {row['output_subwords_per_second']:,.0f} |{ratios(row)} {row['bleu']:.2f} |"
            for row in rows
        ),
    ]
    if processes:
        table += [
            "",
            "Whole processes translating the lines into a file (import, load, compile, decode, write), and the"
            " first line alone (start-up):",
            "",
            "| command | beam | seconds | imports | restore | tracing | compiling | decoding |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {p['command']} | {p['beam_size']} | {p['seconds']:.1f} | "
                + " | ".join(_phase(p, name) for name in ("imports", "restore", "tracing", "compiling", "decoding"))
                + " |"
                for p in processes
            ),
            "",
            "Start-up against the bare imports and CTranslate2's whole process:",
            "",
            *(f"- {name}: {value:.2f}" for name, value in _startup_ratios(processes).items()),
        ]
    if profiles:
        table += [
            "",
            f"Where this project's float32 search spends its time: CPU ms of XLA instructions over all threads, "
            f"translating the whole split ({_PROFILE_CALLS.value} profiled runs).",
            "",
            "| operations | " + " | ".join(profiles) + " |",
            "|---|" + "---:|" * len(profiles),
            *(
                f"| {label} | "
                + " | ".join(
                    f"{p['buckets'][label]['cpu_ms_per_call']:.0f} ({p['buckets'][label]['share']:.0%})"
                    for p in profiles.values()
                )
                + " |"
                for label, _ in hlo_buckets.DECODE_BUCKETS
            ),
            "| all instructions | "
            + " | ".join(f"{p['profiled_cpu_ms_per_call']:.0f}" for p in profiles.values())
            + " |",
        ]
    accelerator = {} if jax.default_backend() == "cpu" else {"accelerator": accelerator_step.accelerator()}
    record = records.new(
        "decoding a whole test split: this project and CTranslate2",
        figures={
            "rows": rows,
            "whole_processes": processes,
            "startup": _startup_ratios(processes),
            "profiles": profiles,
            "lines": len(lines),
        },
        packages=(*records.DEFAULT_PACKAGES, "ctranslate2", "sacrebleu"),
        workdir=workdir,
        ctranslate2_devices=ct2_devices,
        **accelerator,
        **measured_source,
    )
    machine = accelerator["accelerator"]["platform"] if accelerator else record["machine"]["cpu_kind"]
    path = _OUTPUT.value or os.path.join(records.RESULTS_DIR, f"decode_speed_{machine}")
    print("\n".join(table))
    print("wrote", records.write(record, path, table))


if __name__ == "__main__":
    app.run(main)
