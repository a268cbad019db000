r"""The README's results table, generated from the records under docs/results/.

  python -m benchmarks.results_table           # rewrites the table in README.md
  python -m benchmarks.results_table --check   # exits 1 where README.md's table differs

Each row of the table is one record (benchmarks/records.py): a measurement's figures, the
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

from benchmarks import records

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


def _export_agreement(figures: dict) -> str:
    def greedy(engine: str) -> dict:
        return next(r for r in figures["rows"] if r["engine"] == engine and r["decoding"] == "greedy")

    engines = {"CTranslate2": greedy("CTranslate2, float32"), "Hugging Face": greedy("Hugging Face, float32")}
    own = ", ".join(f"{name} {row['identical_lines'] / row['lines']:.2%}" for name, row in engines.items())
    one = ", ".join(
        f"{name} {row['one_budget']['identical_lines'] / row['lines']:.2%}" for name, row in engines.items()
    )
    return (
        f"greedy float32 lines identical to `translate.py`'s, each sentence at its length budget: {own}; "
        f"at the engines' one budget: {one}"
    )


def _decode_speed(figures: dict) -> str:
    def speed(engine: str, beam_size: int) -> str:
        row = next(r for r in figures["rows"] if r["engine"] == engine and r["beam_size"] == beam_size)
        return f"{row['output_tokens_per_second']:,.0f}"

    ours = next(r["engine"] for r in figures["rows"] if r["engine"].endswith(", cached"))
    batch = f"{figures['batch']} test sentences, {figures['length']} tokens each"
    return f"output tokens/s, greedy / beam 4 ({batch}): " + "; ".join(
        f"{name} {speed(engine, 1)} / {speed(engine, 4)}"
        for name, engine in (
            (ours.removesuffix(", cached").replace("this project", "ours"), ours),
            ("CTranslate2 float32", "CTranslate2, float32"),
            ("int8", "CTranslate2, int8"),
        )
    )


@dataclasses.dataclass(frozen=True)
class Row:
    what: str
    records: str  # A glob of record names under docs/results/, one row per match.
    result: Callable[[dict], str]  # The figures' cell.


ROWS = (
    Row("quick-start: the main command, from an empty workdir", "quickstart_*", _quickstart),
    Row("quick-start's checkpoint, beam search", "quickstart_*", _beam),
    Row("train step against PyTorch 2.13 eager `nn.Transformer` (config R)", "peer_throughput_*", _peer),
    Row("classification of the bundled help topics (7 classes)", "classify_*", _classification),
    Row("quick-start model exported, translating the test set", "export_agreement_*", _export_agreement),
    Row("decoding speed beside CTranslate2, the same weights and sentences", "decode_speed_*", _decode_speed),
    Row("Transformer-base and -big train step, bf16, one device", "accelerator_check_base_big_*", _accelerator),
)
# Rows that link to a page instead of a record.
LINKS = (("the paper's Table 3 at the bundled corpus's scale", "[docs/ablations.md](docs/ablations.md#results)"),)


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
            lines.append(f"| {row.what} | {row.result(record['figures'])} | {_machine(record)} | [{name}]({page}) |")
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
