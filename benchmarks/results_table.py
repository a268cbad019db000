r"""The README's results table, generated from the records under docs/results/.

  python -m benchmarks.results_table           # rewrites the table in README.md
  python -m benchmarks.results_table --check   # exits 1 where README.md's table differs

Each row of the table is one record (common/records.py): a measurement's figures, the
machine it ran on and a link to the record's page. A measurement run on several kinds of
machine gives a row per machine. The table lies between the README's `results:begin` and
`results:end` comments; nothing else in the README is touched.
"""

import dataclasses
import glob
import os
import sys
from collections.abc import Callable

from absl import app, flags

from common import records

_CHECK = flags.DEFINE_bool("check", False, "Only compare: exit 1 where README.md's table is not the generated one.")

README = os.path.join(records.REPO_ROOT, "README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _minutes(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _quickstart(figures: dict) -> str:
    run = figures["evaluations"]["train + evaluation"]
    return (
        f"{_minutes(run['wall_seconds'])}, {run['peak_rss_bytes'] / 1e9:.2f} GB peak RSS; "
        f"test BLEU {run['bleu']:.2f}, chrF {run['chrf']:.1f} ({run['decoding']}, {run['num_sentences']:,} pairs)"
    )


def _beam(figures: dict) -> str:
    beam = next(run for name, run in figures["evaluations"].items() if name.startswith("evaluation, beam"))
    return f"test BLEU {beam['bleu']:.2f}, chrF {beam['chrf']:.1f} ({beam['decoding']})"


def _peer(figures: dict) -> str:
    variants = figures["variants"]
    ratios = [(dtype, variants[dtype]["ratio"]) for dtype in ("bfloat16", "float32") if dtype in variants]
    cell = ", ".join(
        f"{ratio:.2f}× PyTorch's target tokens/s in {dtype}" if i == 0 else f"{ratio:.2f}× in {dtype}"
        for i, (dtype, ratio) in enumerate(ratios)
    )
    return cell + (f"; bfloat16 MFU {variants['bfloat16']['mfu']:.0%}" if "bfloat16" in variants else "")


def _peer_on_accelerator(figures: dict) -> str:
    ours, compiled = figures["contenders"]["default"], figures["contenders"]["torch_compile"]
    return (
        f"{ours['step_ms']:.1f} ms a step, {ours['vs_torch_compile']:.2f}× `torch.compile`'s target tokens/s "
        f"({compiled['step_ms']:.1f} ms), {ours['vs_torch']:.2f}× eager's; MFU {ours['mfu']:.0%}"
    )


def _workflow(figures: dict) -> str:
    phases = figures["phases"]
    scores = [
        f"test BLEU {phases[name]['test']['bleu']:.2f} {phases[name]['test']['decoding']}"
        for name in ("train", "beam")
        if "test" in phases.get(name, {})
    ]
    verdict = "every phase passed" if figures["passed"] else "FAILED"
    return f"{verdict} in {_minutes(figures['wall_seconds'])}; " + ", ".join(scores)


def _accelerator(figures: dict) -> str:
    def speed(step: dict) -> str:
        return f"{step['target_tokens_per_s']:,.0f} at {step['target_positions']:,} (MFU {step['mfu']:.0%})"

    cells = []
    for size in ("base", "big"):
        runs = [figures.get(size, {}).get(section, {}) for section in ("step", "max_batch")]
        if measured := [speed(run) for run in runs if "mfu" in run]:
            cells.append(f"{size}: " + ", ".join(measured))
    return "target tokens/s at target positions a batch: " + "; ".join(cells)


def _classification(figures: dict) -> str:
    run = figures["evaluations"]["train + evaluation"]
    return (
        f"{_minutes(run['wall_seconds'])}; test accuracy {run['accuracy']:.3f}, macro-F1 {run['macro_f1']:.3f} "
        f"(majority class {run['majority_accuracy']:.3f})"
    )


def _bf16_or_float32(record: dict) -> str:
    """What `model.dtype='auto'` computes in on the record's CPU: bf16 where it has bf16 matmul instructions."""
    return "bf16" if {"amx_bf16", "avx512_bf16"} & set(record["machine"].get("cpu_matmul_features", ())) else "float32"


def _export_agreement(record: dict) -> str:
    rows = record["figures"]["rows"]

    def greedy(engine: str) -> dict:
        return next(r for r in rows if r["engine"] == engine and r["decoding"] == "greedy")

    def share(identical: int, row: dict) -> str:
        return f"{identical / row['lines']:.2%}"

    engines = {"CTranslate2": greedy("CTranslate2, float32"), "Hugging Face": greedy("Hugging Face, float32")}
    own = ", ".join(f"{name} {share(row['identical_lines'], row)}" for name, row in engines.items())
    one = ", ".join(f"{name} {share(row['one_budget']['identical_lines'], row)}" for name, row in engines.items())
    auto = next(r for r in rows if "'auto'" in r["engine"] and r["decoding"] == "greedy")
    return (
        f"greedy lines identical to this project's greedy decoding forced to float32, each sentence at its length "
        f"budget: {own} (at the engines' one budget: {one}); `translate.py` in its default dtype ('auto': "
        f"{_bf16_or_float32(record)} on this CPU) gives those lines on {share(auto['identical_lines'], auto)}"
    )


def _decode_speed(figures: dict) -> str:
    """Whole processes' seconds and decoding's output subwords/s, by beam size, of the engines the record has."""
    beams = sorted({row["beam_size"] for row in figures["rows"]})

    def by_beam(entries: list[dict], name_field: str, name: str, value_field: str, form: str) -> str:
        values = {entry["beam_size"]: entry[value_field] for entry in entries if entry[name_field] == name}
        return " / ".join(f"{values[beam]:{form}}" if beam in values else "-" for beam in beams)

    def seconds(command: str) -> str:
        return by_beam(figures["whole_processes"], "command", command, "seconds", ".1f") + " s"

    commands = {process["command"] for process in figures["whole_processes"]}

    def processes_of(named: tuple[tuple[str, str], ...]) -> str:
        """'name seconds' of each (name, command) the record has; translate.py's with its cached run."""
        return "; ".join(
            f"{name} {seconds(command)}"
            + (f" (cached: {seconds(command + ', cached')})" if "translate" in command else "")
            for name, command in named
            if command in commands
        )

    processes = processes_of(
        (
            ("`translate.py` float32, compiling", "translate.py, float32"),
            ("`translate.py` 'auto', compiling", "translate.py, auto"),
            ("CTranslate2 float32", "CTranslate2, float32"),
            ("int8", "CTranslate2, int8"),
        )
    )
    engines = {row["engine"] for row in figures["rows"]}
    in_process = "; ".join(
        f"{name} {by_beam(figures['rows'], 'engine', engine, 'output_subwords_per_second', ',.0f')}"
        for name, engine in (
            ("ours float32", "this project, float32"),
            ("ours 'auto'", "this project, auto"),
            ("CTranslate2 float32", "CTranslate2, float32"),
            ("int8", "CTranslate2, int8"),
        )
        if engine in engines
    )
    start_up = processes_of(
        (
            ("`translate.py` float32", "translate.py, float32, one line"),
            ("CTranslate2 float32", "CTranslate2, float32, one line"),
        )
    )
    searches = " / ".join("greedy" if beam == 1 else f"beam {beam}" for beam in beams)
    apart = " (CTranslate2 in a process of its own)" if any(e.startswith("CTranslate2") for e in engines) else ""
    cell = f"the whole test split ({figures['lines']:,} lines), {searches}"
    if processes:
        cell += (
            ", as whole processes (start, load, compile, decode, write; cached: the programs read from the compilation "
            f"cache a first run wrote): {processes}"
        )
    if start_up:
        cell += f"; the first line alone (start-up): {start_up}"
    return cell + f". Decoding alone, output subwords/s, compiled{apart}: {in_process}"


def _figures(cell: Callable[[dict], str]) -> Callable[[dict], str]:
    """A cell made from the record's figures alone."""
    return lambda record: cell(record["figures"])


@dataclasses.dataclass(frozen=True)
class Row:
    what: str
    records: str  # A glob of record names under docs/results/, one row per match.
    result: Callable[[dict], str]  # The result's cell, from the record.


ROWS = (
    Row("quick-start: the main command, from an empty workdir", "quickstart_*", _figures(_quickstart)),
    Row("quick-start's checkpoint, beam search", "quickstart_*", _figures(_beam)),
    Row(
        "the README's workflow on a GPU: cuDNN attention at length 64, main command, beam 4, translate, export",
        "workflow_check_gpu",
        _figures(_workflow),
    ),
    Row("train step against PyTorch 2.13 eager `nn.Transformer` (config R)", "peer_throughput_cpu*", _figures(_peer)),
    Row(
        "Transformer-base train step (bf16, 96 × 256) against PyTorch eager and `torch.compile`",
        "peer_throughput_base_*",
        _figures(_peer_on_accelerator),
    ),
    Row("classification of the bundled help topics (7 classes)", "classify_*", _figures(_classification)),
    Row("quick-start model exported, translating the test set", "export_agreement_*", _export_agreement),
    Row(
        "decoding speed of the whole test split, beside CTranslate2 where it ran",
        "decode_speed_*",
        _figures(_decode_speed),
    ),
    Row(
        "Transformer-base and -big train step, bf16, one device",
        "accelerator_check_base_big_*",
        _figures(_accelerator),
    ),
)
# Rows without a record: what they are, in words.
LINKS = (
    (
        "the paper's Table 3 at the bundled corpus's scale",
        "not a record yet: [docs/ablations.md](docs/ablations.md#results) gives the sweep and its commands; its table "
        "came from older code and is to be generated again",
    ),
)


def _machine(record: dict) -> str:
    """The machine's kind; for a CPU, how busy it was where other work shared its cores."""
    machine = record["machine"]
    if machine.get("accelerator"):
        return machine["accelerator"]
    described = f"{machine['cores']}-core {machine['cpu_model']} (`{machine['cpu_kind']}`)"
    load = record.get("load_average")
    if load and load[0] > machine["cores"]:  # More runnable threads than cores when the run ended.
        described += f", shared: load {load[0]:.1f}"
    return described


def table(results_dir: str = records.RESULTS_DIR) -> list[str]:
    """The table's lines, from the records in `results_dir`."""
    lines = ["| what | result | machine | record |", "|---|---|---|---|"]
    for row in ROWS:
        for path in sorted(glob.glob(os.path.join(results_dir, row.records + ".json"))):
            name = os.path.basename(path).removesuffix(".json")
            record = records.read(name, results_dir)
            page = os.path.relpath(os.path.join(results_dir, name + ".md"), records.REPO_ROOT)
            lines.append(f"| {row.what} | {row.result(record)} | {_machine(record)} | [{name}]({page}) |")
    lines += [f"| {what} | {link} | | |" for what, link in LINKS]
    return lines


def with_table(readme: str, lines: list[str]) -> str:
    """`readme` with the lines between its BEGIN and END markers replaced by `lines`."""
    before, begin, rest = readme.partition(BEGIN)
    _, end, after = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block for the results table")
    return before + begin + "\n" + "\n".join(lines) + "\n" + end + after


def main(argv):
    del argv
    with open(README, encoding="utf-8") as readme:
        current = readme.read()
    lines = table()
    generated = with_table(current, lines)
    if _CHECK.value:
        if generated != current:
            print(
                "README.md's results table differs from the records: python -m benchmarks.results_table",
                file=sys.stderr,
            )
            sys.exit(1)
        return
    with open(README, "w", encoding="utf-8") as readme:
        readme.write(generated)
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
