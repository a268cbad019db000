r"""A run of a sweep's ledger trained again on another machine: how far float32 on another CPU kind moves it.

  python -m benchmarks.ledger_rerun --ledger=ledgers/table3_cpu --run=base/seed_2 \
    --workdir=/work/runs/xcheck/base_seed_2 --output=docs/results/ledger_rerun_cpu-avx512-bf16

`--workdir` holds the run trained again with the ledger's own command, from a worktree of the
ledger's commit (`sweep.py --dry_run` prints it; docs/ablations.md). The record gives each run's
machine, its test BLEU and chrF, its validation perplexity at the last step and how many of the test
translations are the same line for line. float32 rounds differently on each CPU kind, and a step's
rounding feeds the next: this says by how much a run's numbers move between machines, beside the
table's differences between variants and seeds.
"""

import json
import os
import sys

from absl import app, flags

from common import records
from common.errors import UserInputError
from common.workdir import Workdir
from sweeps import runner
from sweeps.ledger import Ledger, file_sha256, run_summary
from sweeps.report import read_run
from training.reporting import attempts, metric_log

records.define_software_note_flag()

_LEDGER = flags.DEFINE_string("ledger", "ledgers/table3_cpu", "The sweep's ledger.")
_SWEEP = flags.DEFINE_string("sweep", "configs/sweeps/table3.py", "The ledger's sweep file.")
_RUN = flags.DEFINE_string("run", "base/seed_2", "The ledger's run: <variant>/seed_<k>.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The same run trained again, on this machine.")
_OUTPUT = flags.DEFINE_string("output", None, "Record path without suffix, e.g. docs/results/ledger_rerun_cpu-amx.")
flags.mark_flags_as_required(["workdir", "output"])


def _figures(result, machine: str, commit: str) -> dict:
    return {
        "machine": machine,
        "commit": commit,
        "test_bleu": result.test_bleu,
        "test_chrf": result.test_chrf,
        "valid_perplexity": result.valid_perplexity,
        "steps": result.steps,
    }


def main(argv):
    del argv
    try:
        _compare()
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _compare() -> None:
    source = records.source()
    ledger, sweep = Ledger(_LEDGER.value), runner.load_sweep(_SWEEP.value)
    variant, _, seed = _RUN.value.partition("/seed_")
    if not seed.isdigit():
        raise UserInputError(f"--run={_RUN.value}: give it as <variant>/seed_<k>, e.g. base/seed_2.")
    kept = runner.Run(variant, int(seed), ledger.entry(variant, int(seed)), references=ledger.references)
    again = runner.Run(variant, int(seed), os.path.abspath(_WORKDIR.value))
    config = sweep.run_config(kept)
    kept_result, again_result = read_run(kept, config), read_run(again, config)
    if any(result is None or result.test_translations is None for result in (kept_result, again_result)):
        raise UserInputError(
            f"{_RUN.value} is not finished, with its test translations, in both {ledger.path} and {_WORKDIR.value}."
        )
    workdir = Workdir(again.workdir)
    trained = run_summary(
        again, attempts.read(workdir.attempts), file_sha256(workdir.tokenizer), metric_log.read(again.workdir, "train")
    )
    with open(os.path.join(kept.workdir, "run.json"), encoding="utf-8") as f:
        kept_summary = json.load(f)
    if any(
        trained[key] != kept_summary[key] for key in ("commit", "platform", "dtype", "tokenizer_sha256", "device_count")
    ):
        raise UserInputError(
            f"{_WORKDIR.value} was not trained as the ledger's run: train it with the ledger's command."
        )
    kept_lines, again_lines = kept_result.test_translations.hypotheses, again_result.test_translations.hypotheses
    figures = {
        "run": _RUN.value,
        "ledger": _figures(kept_result, "; ".join(kept_summary["machines"]), kept_summary["commit"]),
        "again": _figures(again_result, "; ".join(trained["machines"]), trained["commit"]),
        "sentences": len(kept_lines),
        "identical_translations": sum(a == b for a, b in zip(kept_lines, again_lines, strict=True)),
        "test_bleu_difference": again_result.test_bleu - kept_result.test_bleu,
    }
    record = records.new(f"{_RUN.value} of {ledger.path} trained again on another machine", figures=figures, **source)
    table = ["| run | machine | test BLEU | chrF | valid PPL |", "|---|---|---:|---:|---:|"]
    for name in ("ledger", "again"):
        run = figures[name]
        numbers = " | ".join(f"{run[key]:.2f}" for key in ("test_bleu", "test_chrf", "valid_perplexity"))
        table.append(f"| {name} | {run['machine']} | {numbers} |")
    table += [
        "",
        f"Test translations the same line for line: {figures['identical_translations']} of {figures['sentences']}; "
        f"test BLEU {figures['test_bleu_difference']:+.2f} trained again.",
    ]
    print(f"Record: {records.write(record, _OUTPUT.value, table=table)}")


if __name__ == "__main__":
    app.run(main)
