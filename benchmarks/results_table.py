r"""The README's results table and the page of every record, generated from the records under docs/results/.

  python -m benchmarks.results_table           # rewrites the table in README.md, and docs/records.md
  python -m benchmarks.results_table --check   # exits 1 where either differs from what the records make

Each row is one record (common/records.py): a measurement's figures, the machine it ran on and a
link to the record's page. The README shows one row per kind of result (a `Row` below) and
platform, CPU or GPU: the freshest record, by its date (of one date, the later commit). Every
record, older ones and those of other CPU kinds too, has its row on docs/records.md, so that none
is unlinked. That page lies in docs/ rather than in docs/results/, so that every page under
docs/results/ is a record's, written by its benchmark, and so that the docs' checks
(tests/test_records.py: links that exist, no commit or date in prose) read it as they read every
page of the guide.

A record whose measured code has changed since its commit says so (`MEASURED_PATHS`), and one
measured before a commit that replaced its code says which (`LANDMARKS`). The README's table lies
between its `results:begin` and `results:end` comments; nothing else in the README is touched.
"""

import dataclasses
import datetime
import fnmatch
import functools
import glob
import os
import shlex
import sys
from collections.abc import Callable

from absl import app, flags

from common import records

_CHECK = flags.DEFINE_bool("check", False, "Only compare: exit 1 where README.md's table is not the generated one.")

README = os.path.join(records.REPO_ROOT, "README.md")
PAGE = os.path.join(records.REPO_ROOT, "docs", "records.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _minutes(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _quickstart(figures: dict) -> str:
    run = figures["evaluations"]["train + evaluation"]
    return (
        f"{_minutes(run['wall_seconds'])}, {run['peak_rss_bytes'] / 1e9:.2f} GB peak RSS; test BLEU {run['bleu']:.2f}"
    )


def _beam(figures: dict) -> str:
    beam = next(run for name, run in figures["evaluations"].items() if name.startswith("evaluation, beam"))
    return f"test BLEU {beam['bleu']:.2f} ({beam['decoding']})"


def _peer(figures: dict) -> str:
    variants = figures["variants"]
    ratios = [f"{variants[dtype]['ratio']:.2f}× in {dtype}" for dtype in ("bfloat16", "float32") if dtype in variants]
    return "PyTorch's target tokens/s " + ", ".join(ratios)


def _peer_on_accelerator(figures: dict) -> str:
    ours = figures["contenders"]["default"]
    return f"{ours['vs_torch_compile']:.2f}× `torch.compile`'s target tokens/s, {ours['vs_torch']:.2f}× eager's"


def _workflow(figures: dict) -> str:
    phases = figures["phases"]
    scores = [
        f"BLEU {phases[name]['test']['bleu']:.2f} {phases[name]['test']['decoding'].split(',')[0]}"
        for name in ("train", "beam")
        if "test" in phases.get(name, {})
    ]
    verdict = "every phase passed" if figures["passed"] else "ran"
    return f"{verdict} in {_minutes(figures['wall_seconds'])}; test " + ", ".join(scores)


def _accelerator(figures: dict) -> str:
    cells = [
        f"{size} {step['target_tokens_per_s']:,.0f} (MFU {step['mfu']:.0%})"
        for size in ("base", "big")
        if "mfu" in (step := figures.get(size, {}).get("max_batch") or figures.get(size, {}).get("step") or {})
    ]
    return "target tokens/s at the largest batch: " + ", ".join(cells)


def _classification(figures: dict) -> str:
    run = figures["evaluations"]["train + evaluation"]
    return f"test accuracy {run['accuracy']:.3f} (majority class {run['majority_accuracy']:.3f})"


def _export_agreement(figures: dict) -> str:
    def greedy(engine: str) -> str:
        row = next(r for r in figures["rows"] if r["engine"] == engine and r["decoding"] == "greedy")
        return f"{row['identical_lines'] / row['lines']:.2%}"

    return (
        f"greedy lines as ours in float32: CTranslate2 {greedy('CTranslate2, float32')}, "
        f"Hugging Face {greedy('Hugging Face, float32')}"
    )


def _decode_speed(figures: dict) -> str:
    """Decoding's output subwords/s by beam size, this project's and CTranslate2's in the same dtype (float32, or
    this project's 'auto' where CTranslate2 did not run); then, where they were timed, whole processes: the split
    cached over CTranslate2's, and one line less the bare imports."""
    beams = sorted({row["beam_size"] for row in figures["rows"]})
    present = {row["engine"] for row in figures["rows"]}
    matching = "CTranslate2, float32" in present and "this project, float32" in present
    ours = ("ours float32", "this project, float32")
    ours = ours if matching or "this project, auto" not in present else ("ours 'auto'", "this project, auto")
    engines = (ours, ("CTranslate2 float32", "CTranslate2, float32"))

    def by_beam(engine: str) -> str:
        speeds = {r["beam_size"]: r["output_subwords_per_second"] for r in figures["rows"] if r["engine"] == engine}
        return " / ".join(f"{speeds[beam]:,.0f}" if beam in speeds else "-" for beam in beams)

    searches = " / ".join("greedy" if beam == 1 else f"beam {beam}" for beam in beams)
    cell = f"output subwords/s, {searches}: " + "; ".join(
        f"{name} {by_beam(engine)}" for name, engine in engines if engine in present
    )
    startup = figures.get("startup", {})
    dtype = ours[0].split()[-1].strip("'")
    split = [startup.get(f"{dtype}: whole split cached, beam {beam}, over CTranslate2 float32's") for beam in beams]
    if all(ratio is not None for ratio in split):
        cell += f"; whole processes, cached, {searches}: {' / '.join(f'{r:.2f}' for r in split)}× CTranslate2's time"
    one_line = startup.get(f"{dtype}: one line, cached, less the bare imports (s)")
    if one_line is not None:
        cell += f"; one line {one_line:.1f} s over the bare imports"
    return cell


def _table3(figures: dict) -> str:
    """How many of the planned runs the record holds, the base's test BLEU, and the differences that survive Holm:
    those that do in every seed compared and one direction (with the count where seeds are missing), then the
    others (surviving seeds / seeds compared, and whether the surviving seeds' signs disagree).
    """
    variants = figures["variants"]
    finished = sum(v["runs_finished"] for v in variants.values())
    planned = sum(v["runs_planned"] for v in variants.values())
    base = variants["base"]["test_bleu"]
    every, some = [], []
    for name, v in variants.items():
        if not (holm := v.get("test_bleu_significant_seeds_after_holm")):
            continue
        compared = len(v["test_bleu_holm_p_values"])
        signs = {
            diff > 0
            for seed, diff in v.get("test_bleu_diff_by_seed", {}).items()
            if v["test_bleu_holm_p_values"].get(seed, 1.0) < figures["significance_level"]
        }
        described = f"{name} {v['test_bleu_diff']['mean']:+.2f}"
        if holm == compared and len(signs) <= 1:
            every.append(described + (f" ({holm}/{compared})" if compared < v["runs_planned"] else ""))
        else:
            some.append(f"{described} ({holm}/{compared}{', of opposite signs' if len(signs) > 1 else ''})")
    base_bleu = "–" if base is None else f"{base['mean']:.2f}"
    if base is not None and base["std"] is not None:
        base_bleu += f" ± {base['std']:.2f}"
    return (
        f"{finished} of {planned} runs{' (partial)' if finished < planned else ''}; base test BLEU {base_bleu}; "
        "Δ BLEU to the base surviving Holm's correction in every seed compared: "
        + (", ".join(every) or "none")
        + "; in some seeds or opposite ways (seeds where it does / seeds compared): "
        + (", ".join(some) or "none")
    )


def _test_tiers(figures: dict) -> str:
    fast, whole = figures["fast tier"], figures["whole suite"]
    over = len(fast["over_limit"])
    warm = figures.get("fast tier, warm")  # Records before the tests kept compiled programs have none.
    return (
        f"fast tier (`-m \"not slow\"`) {_minutes(fast['wall_seconds'])} for {fast['tests']} tests"
        + (f" ({_minutes(warm['wall_seconds'])} run again)" if warm else "")
        + f", {over or 'none'} over 10 s; whole suite {_minutes(whole['wall_seconds'])} for {whole['tests']} tests"
    )


@dataclasses.dataclass(frozen=True)
class Row:
    what: str
    records: str  # A glob of record names under docs/results/, one row per match.
    result: Callable[[dict], str]  # The result's cell, from the record's figures.


ROWS = (
    Row("quick-start: the main command, from an empty workdir", "quickstart_*", _quickstart),
    Row("quick-start's checkpoint, beam search", "quickstart_*", _beam),
    Row(
        "the README's workflow on a GPU: main command (its rows of 64 run the explicit attention formula), beam 4, "
        "translate, export; a separate check of cuDNN against XLA attention at length 64",
        "workflow_check_gpu",
        _workflow,
    ),
    Row("train step against PyTorch 2.13 eager `nn.Transformer` (config R)", "peer_throughput_cpu*", _peer),
    Row(
        "Transformer-base train step (bf16, 96 × 256) against PyTorch eager and `torch.compile`",
        "peer_throughput_base_*",
        _peer_on_accelerator,
    ),
    Row("classification of the bundled help topics (7 classes)", "classify_*", _classification),
    Row("quick-start model exported, translating the test set", "export_agreement_*", _export_agreement),
    Row(
        "decoding the whole test split, beside CTranslate2 where it ran",
        "decode_speed_*",
        _decode_speed,
    ),
    Row(
        "Transformer-base and -big train step, bf16, one device",
        "accelerator_check_base_big_*",
        _accelerator,
    ),
    Row(
        "the test suite, each tier run alone and cold with 2 workers (`pytest -n 2 --dist loadfile`), then again",
        "test_tiers_*",
        _test_tiers,
    ),
    Row("the paper's Table 3 at the bundled corpus's scale (23 variants × 3 seeds)", "table3_*", _table3),
)
# Rows without a record: what they are, in words.
LINKS: tuple[tuple[str, str], ...] = ()


_NOT_RECORDS = ":(exclude)common/records.py"  # A git pathspec.
# The code each program's figures depend on, by the program that writes the records (as `python -m` names it): a
# later commit that changes any of it marks the program's records as measured on older code. Writing a record is not
# what a record measures: common/records.py is left out.
_TRAINING = ("train.py", "configs/", "models/", "input_pipeline/", "training/", "common/", "data/", _NOT_RECORDS)
_TRAIN_STEP = (
    "models/",
    "training/steps.py",
    "training/state.py",
    "training/losses.py",
    "training/optimizer.py",
    "training/step_options.py",
    "training/flops.py",
    "training/runtime/",
    "configs/default.py",
    "benchmarks/config_r.py",
)
# Decoding as `inference.translate_lines` runs it: the restore, the runtime, the search, reading text, the config's
# checks (tests/test_records.py checks that these hold every module it loads).
_DECODING = (
    "models/",
    "common/",
    _NOT_RECORDS,
    "input_pipeline/batching.py",
    "input_pipeline/config_checks.py",
    "input_pipeline/labels.py",
    "input_pipeline/text_lines.py",
    "input_pipeline/tokenizer.py",
    "training/checkpoints/",
    "training/runtime/",
    "training/inference.py",
    "training/tasks/base.py",
    "training/tasks/translation_decoding.py",
    "training/config_checks.py",
    "training/divergence.py",
    "training/optimizer.py",
    "training/state.py",
    "training/steps.py",
    "training/losses.py",
    "training/step_options.py",
    "training/reporting/logs.py",
    "training/reporting/scores.py",
)
# The command, reading and writing lines, and timing its phases too.
_TRANSLATE_PY = (*_DECODING, "translate.py", "training/text_io.py", "training/phases.py")
MEASURED_PATHS = {
    "benchmarks.training_run": (*_TRAINING, "benchmarks/training_run.py"),
    "benchmarks.workflow_check": (
        *_TRAINING,
        "translate.py",
        "export.py",
        "exporting/",
        "benchmarks/workflow_check.py",
    ),
    "benchmarks.peer_throughput": (*_TRAIN_STEP, "benchmarks/peer_throughput.py", "benchmarks/step_variants.py"),
    "benchmarks.step_profile": (*_TRAIN_STEP, "benchmarks/step_profile.py", "benchmarks/xla_profile.py"),
    "benchmarks.accelerator_check": (
        *_TRAIN_STEP,
        "configs/tiny.py",
        "input_pipeline/synthetic.py",
        "benchmarks/accelerator_check.py",
        "benchmarks/accelerator_step.py",
    ),
    "benchmarks.decode_speed": (
        *_TRANSLATE_PY,
        "exporting/",
        "benchmarks/decode_speed.py",
        "benchmarks/ctranslate2_engine.py",
    ),
    "benchmarks.export_agreement": (
        *_DECODING,
        "exporting/",
        "benchmarks/export_agreement.py",
        "benchmarks/ctranslate2_engine.py",
    ),
    "benchmarks.attention_page": (  # translate.py's pages: their pieces and weights are its translation's.
        *_TRANSLATE_PY,
        "training/reporting/",
        "benchmarks/attention_page.py",
        "benchmarks/page_browser.py",
    ),
    "benchmarks.test_tiers": ("tests/", ".ci/", "pyproject.toml", "benchmarks/test_tiers.py"),
    "sweep": (*_TRAINING, "sweep.py", "sweeps/"),
    "benchmarks.sweep_jobs": (*_TRAINING, "sweep.py", "sweeps/", "benchmarks/sweep_jobs.py"),
    # The runs trained at the ledger's commit; this reads them.
    "benchmarks.ledger_rerun": ("sweeps/report.py", "sweeps/ledger.py", "benchmarks/ledger_rerun.py"),
    "benchmarks.sweep_run_cost": (  # It runs train.py as the sweep does, and collects nothing.
        *_TRAINING,
        "sweeps/__init__.py",
        "sweeps/runner.py",
        "sweeps/train_processes.py",
        "sweeps/ledger.py",
        "benchmarks/sweep_run_cost.py",
    ),
}


@dataclasses.dataclass(frozen=True)
class Landmark:
    """A commit that replaced code some records measured: a record of a commit before it measured code now gone."""

    commit: str
    before: str  # What such a record says: 'before continuous batching'.
    records: tuple[str, ...]  # Globs of the names of the records whose figures came from the code it replaced.


LANDMARKS = (
    Landmark(
        "cc4f5182793954fe78f2149876ad3ba24546e141",  # The commit that added models/continuous_batching.py.
        "before continuous batching",
        # The records whose figures decoding makes: its speed, the export's agreement, evaluation's BLEU and time.
        ("decode_speed_*", "export_agreement_*", "quickstart_*", "workflow_check_*"),
    ),
)


def _machine(record: dict) -> str:
    """The machine's kind; for a CPU, how busy it was where other work shared its cores."""
    machine = record["machine"]
    if machine.get("accelerator"):
        return machine["accelerator"]
    cores = machine["cores"]  # A list where the runs of a ledger had several (sweeps/ledger.py).
    described = f"{'/'.join(map(str, cores)) if isinstance(cores, list) else cores}-core {machine['cpu_model']}"
    described += f" (`{machine['cpu_kind']}`)"
    load = record.get("load_average")
    if load and isinstance(cores, int) and load[0] > cores:  # More runnable threads than cores when the run ended.
        described += f", shared: load {load[0]:.1f}"
    return described


def _program(command: str) -> str:
    """The program a record's command ran, as a module name: 'benchmarks.decode_speed', 'sweep'."""
    arguments = shlex.split(command)[1:]
    program = arguments[1] if arguments[0] == "-m" else arguments[0].removesuffix(".py").replace("/", ".")
    return program


def _failed_checks(figures, where: tuple[str, ...] = ()) -> list[str]:
    """Where `figures` hold `passed: false`, as the keys leading there ('base copy'); '' for the figures' own."""
    if isinstance(figures, list):
        return [found for item in figures for found in _failed_checks(item, where)]
    if not isinstance(figures, dict):
        return []
    found = [" ".join(where)] if figures.get("passed") is False else []
    return found + [f for key, value in figures.items() for f in _failed_checks(value, (*where, str(key)))]


def _verdict(figures: dict) -> str:
    """'FAILED (where): ' where `figures` hold a failed check; else ''."""
    failed = _failed_checks(figures)
    return "FAILED" + (f" ({', '.join(failed)})" if any(failed) else "") + ": " if failed else ""


def _result(row: Row, figures: dict) -> str:
    return _verdict(figures) + row.result(figures)


def _staleness(name: str, record: dict) -> str:
    """'' where the code record `name` measured is unchanged since its commit; else which landmarks it predates
    (`LANDMARKS`) and how much has changed."""
    changed = records.commits_since(record["commit"], MEASURED_PATHS[_program(record["command"])])
    if changed is None:
        return "; its commit is not in this clone's history, so whether its code changed since is unknown"
    predates = [
        f"; measured {landmark.before}"
        for landmark in LANDMARKS
        if any(fnmatch.fnmatch(name, pattern) for pattern in landmark.records)
        and records.is_ancestor(landmark.commit, record["commit"]) is False  # None: a clone without the landmark.
    ]
    older = (
        f"; measured on older code: {changed} later commit{'s' if changed > 1 else ''} changed it" if changed else ""
    )
    return "".join(predates) + older


def _platform(record: dict) -> str:
    """'cpu', whatever its kind, or the accelerator's platform: 'gpu' (records.add_accelerator names it last)."""
    accelerator = record["machine"].get("accelerator")  # 'NVIDIA H200 (gpu)'
    return accelerator.rpartition("(")[2].removesuffix(")") if accelerator else "cpu"


def _date(record: dict) -> datetime.datetime:
    return datetime.datetime.fromisoformat(record["date"])


def _fresher(first: tuple[str, dict], second: tuple[str, dict]) -> int:
    """A comparison of two (name, record): 1 where `first` is the fresher, by date, then by commit (the descendant),
    then by name (a total order, so that sorting does not depend on the records' order); -1 the other way."""
    (name, one), (other_name, other) = first, second
    if _date(one) != _date(other):
        return 1 if _date(one) > _date(other) else -1
    if one["commit"] != other["commit"] and records.is_ancestor(other["commit"], one["commit"]):
        return 1
    if one["commit"] != other["commit"] and records.is_ancestor(one["commit"], other["commit"]):
        return -1
    return (name > other_name) - (name < other_name)


@dataclasses.dataclass
class _Records:
    """The records of a results folder: those that pass the records check by `Row` and platform, the rest, and those
    failing it."""

    by_row: dict[Row, dict[str, list[tuple[str, dict]]]]  # Row: platform: (name, record), the freshest first.
    others: list[tuple[str, dict]]  # Records no row shows.
    left_out: dict[str, str]  # Name: why, the problems' first words.


def _read(results_dir: str, problems: Callable[[dict], list[str]]) -> _Records:
    found = _Records({row: {} for row in ROWS}, [], {})
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        name = os.path.basename(path).removesuffix(".json")
        record = records.read(name, results_dir)
        if failed := problems(record):
            found.left_out[name] = "; ".join(problem.split(":")[0] for problem in failed)
            continue
        rows = [row for row in ROWS if fnmatch.fnmatch(name, row.records)]
        for row in rows:
            found.by_row[row].setdefault(_platform(record), []).append((name, record))
        if not rows:
            found.others.append((name, record))
    for platforms in found.by_row.values():
        for platform in sorted(platforms):  # 'cpu' before 'gpu', in the tables too.
            platforms[platform] = sorted(platforms.pop(platform), key=functools.cmp_to_key(_fresher), reverse=True)
    return found


def _link(name: str, results_dir: str, page_dir: str) -> str:
    """A link to record `name`'s page, from a page in `page_dir`."""
    return f"[{name}]({os.path.relpath(os.path.join(results_dir, name + '.md'), page_dir)})"


def _line(what: str, result: str, name: str, record: dict, results_dir: str, page_dir: str) -> str:
    link = _link(name, results_dir, page_dir) + _staleness(name, record)
    return f"| {what} | {result} | {_machine(record)} | {link} |"


def _left_out(found: _Records, results_dir: str, page_dir: str) -> list[str]:
    if not found.left_out:
        return []
    named = ", ".join(f"{_link(name, results_dir, page_dir)} ({why})" for name, why in found.left_out.items())
    return ["", f"Left out, as their records fail the records check (`common/records.py`): {named}."]


_HEADER = ["| what | result | machine | record |", "|---|---|---|---|"]


def table(
    results_dir: str = records.RESULTS_DIR, problems: Callable[[dict], list[str]] = records.problems
) -> list[str]:
    """The README's table: each row's freshest record of each platform, from the records in `results_dir` that pass
    `problems`; then a line linking the page of every record, and one naming those left out."""
    found = _read(results_dir, problems)
    lines = list(_HEADER)
    for row, platforms in found.by_row.items():
        freshest = [named[0] for named in platforms.values()]
        lines += [
            _line(row.what, _result(row, r["figures"]), n, r, results_dir, records.REPO_ROOT) for n, r in freshest
        ]
    lines += [f"| {what} | {link} | | |" for what, link in LINKS]
    page = os.path.relpath(PAGE, records.REPO_ROOT)
    lines += ["", f"Every record, older ones and those of other CPU kinds too: [{page}]({page})."]
    return lines + _left_out(found, results_dir, records.REPO_ROOT)


def page(results_dir: str = records.RESULTS_DIR, problems: Callable[[dict], list[str]] = records.problems) -> list[str]:
    """docs/records.md's lines: every record in `results_dir` with its row, each platform's freshest first."""
    found = _read(results_dir, problems)
    here = os.path.dirname(PAGE)
    lines = [
        "# Records",
        "",
        "Every record under `docs/results/` (what ran, where, at which commit), made by",
        "`python -m benchmarks.results_table`. Of each kind of result, the first row on a CPU and the first on a",
        "GPU are the freshest, which the [README's results table](../README.md#results) shows; the rows after them",
        "are older, or of another kind of CPU. The records no kind of result shows come last. A record whose",
        "measured code has changed since says so.",
        "",
        *_HEADER,
    ]
    for row, platforms in found.by_row.items():
        every = [item for named in platforms.values() for item in named]
        lines += [_line(row.what, _result(row, r["figures"]), n, r, results_dir, here) for n, r in every]
    for name, record in found.others:
        lines.append(
            _line(record["measurement"], _verdict(record["figures"]) + "on its page", name, record, results_dir, here)
        )
    return lines + _left_out(found, results_dir, here)


def with_table(readme: str, lines: list[str]) -> str:
    """`readme` with the lines between its BEGIN and END markers replaced by `lines`."""
    before, begin, rest = readme.partition(BEGIN)
    _, end, after = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block for the results table")
    return before + begin + "\n" + "\n".join(lines) + "\n" + end + after


def generated() -> dict[str, str]:
    """README.md and docs/records.md as the records make them, by path."""
    with open(README, encoding="utf-8") as readme:
        current = readme.read()
    return {README: with_table(current, table()), PAGE: "\n".join(page()) + "\n"}


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except FileNotFoundError:
        return None


def main(argv):
    del argv
    files = generated()
    differing = [path for path, text in files.items() if _read_text(path) != text]
    if _CHECK.value:
        if differing:
            names = " and ".join(os.path.relpath(path, records.REPO_ROOT) for path in differing)
            print(f"{names}: not what the records make: python -m benchmarks.results_table", file=sys.stderr)
            sys.exit(1)
        return
    for path in differing:
        with open(path, "w", encoding="utf-8") as out:
            out.write(files[path])
    print(files[README].partition(BEGIN)[2].partition(END)[0].strip())


if __name__ == "__main__":
    app.run(main)
