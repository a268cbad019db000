r"""Runs a sweep (every variant of a sweep file x seeds, one train.py process each), then collects the results.

  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3
  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3 --only=base,heads_1 --seeds=1
  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3 --dry_run > jobs.txt  # one command a line
  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3 --collect
  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3 --record=docs/results/table3_cpu-avx512-bf16

Run (variant, seed) trains in <root>/<variant>/seed_<seed> (log: train.log there).
Finished runs are skipped and an interrupted one resumes from its checkpoint, so
the same command continues a sweep stopped at any point (Ctrl-C or SIGTERM: the run
in progress saves its step first). Results: <root>/results.md, results.csv,
results_runs.csv, results_bleu.png, valid_curves.png; with --record, results.md's table
also as a record (common/records.py: command, machine, software, date, commit). Exit
status 1 if a run failed (each failure is named, with its log), 130/143 if stopped by a signal.
"""

import os
import sys

from absl import app, flags

from common import io_errors, records
from sweeps import plots, report, runner, train_processes

records.define_software_note_flag()

_SWEEP = flags.DEFINE_string("sweep", None, "Sweep file (configs/sweeps/*.py): a base config and named variants.")
_ROOT = flags.DEFINE_string("root", None, "Folder of the sweep's runs (<root>/<variant>/seed_<k>) and results.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per variant: 0, 1, ..., N-1.", lower_bound=1)
_ONLY = flags.DEFINE_list("only", None, "Run only these variants (comma-separated names); collecting covers all.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the train.py command of each unfinished run; run nothing.")
_COLLECT = flags.DEFINE_bool("collect", False, "Only collect the results of the runs finished so far.")
_RECORD = flags.DEFINE_string(
    "record", None, "Also write the results as a record: this path (no suffix) .json and .md, e.g. docs/results/NAME."
)
flags.mark_flags_as_required(["sweep", "root"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if _DRY_RUN.value and _RECORD.value:
        raise app.UsageError("--dry_run runs and collects nothing: there is no result to --record.")
    try:
        _sweep()
    except train_processes.SweepStopped as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_status)
    except Exception as e:  # pylint: disable=broad-except
        # A bad sweep file, or storage failing under the root (a full disk): one line; a bug keeps its traceback.
        if (message := io_errors.user_error_message(e, _ROOT.value, elsewhere="choose another --root")) is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _sweep() -> None:
    loaded = runner.load_sweep(_SWEEP.value)
    selected = runner.select_variants(loaded, _ONLY.value)
    if _DRY_RUN.value:
        lines, left_out = runner.pending_commands(loaded, runner.plan_runs(_ROOT.value, selected, _SEEDS.value))
        print("\n".join(lines))
        for run, why in left_out:
            print(f"left out {run.label}: {why}", file=sys.stderr)
        return
    source = records.source() if _RECORD.value else None  # The commit as the sweep starts.
    failed, runs = [], {"trained": 0, "finished_before": None}  # --collect: none trained, the rest unknown.
    if not _COLLECT.value:
        outcome = train_processes.run_all(loaded, runner.plan_runs(_ROOT.value, selected, _SEEDS.value))
        failed = outcome.failed
        print(f"{len(outcome.finished)} runs trained, {len(outcome.skipped)} finished before, {len(failed)} failed.")
        runs = {"trained": len(outcome.finished), "finished_before": len(outcome.skipped)}
    # Every seed run so far, also beyond --seeds (a sweep run earlier with more).
    seeds = max(_SEEDS.value, runner.seeds_present(_ROOT.value, loaded.names()))
    collected = report.collect(loaded, _ROOT.value, runner.plan_runs(_ROOT.value, loaded.names(), seeds))
    plots.draw(_ROOT.value, collected.summaries)
    finished = sum(len(s.results) for s in collected.summaries)
    print(f"Results of {finished} runs ({len(collected.unfinished)} not finished) in {_ROOT.value}/results.md")
    if _RECORD.value:
        print(f"Record: {_write_record(_RECORD.value, loaded, collected, source, runs)}")
    if failed:
        for run, why in failed:
            print(f"FAILED {run.label}: {why}", file=sys.stderr)
        sys.exit(1)


def _write_record(path: str, sweep: runner.Sweep, collected: report.Collected, source: dict, runs: dict) -> str:
    """The results as a record at `path` (.json and .md), with `source`, the commit the sweep started from."""
    record = records.new(
        f"sweep {os.path.relpath(sweep.path, runner.REPOSITORY)}",
        figures=report.record_figures(collected.summaries),
        packages=(*records.DEFAULT_PACKAGES, "sacrebleu"),
        **source,
        runs={**runs, "unfinished": [run.label for run in collected.unfinished]},
    )
    return records.write(record, path, table=collected.page)


if __name__ == "__main__":
    app.run(main)
