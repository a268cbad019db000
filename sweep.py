r"""Runs a sweep (every variant of a sweep file x seeds, one train.py process each), then collects the results.

  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3
  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3 --only=base,heads_1 --seeds=1
  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3 --dry_run > jobs.txt  # one command a line
  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3 --collect
  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3 --ledger=ledgers/table3_cpu --budget_minutes=150
  python sweep.py --sweep=configs/sweeps/table3.py --root=/tmp/t3 --ledger=ledgers/table3_cpu --collect \
    --record=docs/results/table3_cpu

The dataset is prepared and the tokenizer trained once, under <root>/prepared; run (variant,
seed) trains in <root>/<variant>/seed_<seed> (log: train.log there), --jobs of them at once.
Finished runs are skipped and an interrupted one resumes from its checkpoint, so
the same command continues a sweep stopped at any point (Ctrl-C or SIGTERM: the runs
in progress save their step first). With --ledger, each finished run is also copied, small, into
the ledger folder (sweeps/ledger.py), which is kept in the repository: runs it holds are skipped
on any machine, and results are collected from it alone. Results: <root>/results.md, results.csv,
results_runs.csv, results_bleu.png, valid_curves.png; with --record, results.md's table
also as a record (common/records.py: command, machine, software, date, commit). Exit
status 1 if a run failed (each failure is named, with its log), 130/143 if stopped by a signal.
"""

import os
import sys

from absl import app, flags

from common import io_errors, records
from sweeps import plots, report, runner, train_processes
from sweeps.budget import Budget
from sweeps.ledger import Ledger, ledger_record_fields

records.define_software_note_flag()

_SWEEP = flags.DEFINE_string("sweep", None, "Sweep file (configs/sweeps/*.py): a base config and named variants.")
_ROOT = flags.DEFINE_string("root", None, "Folder of the sweep's runs (<root>/<variant>/seed_<k>) and results.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per variant: 0, 1, ..., N-1.", lower_bound=1)
_ONLY = flags.DEFINE_list("only", None, "Run only these variants (comma-separated names); collecting covers all.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Prepare the data and tokenizer the runs share, then print the train.py command of each unfinished run.",
)
_COLLECT = flags.DEFINE_bool("collect", False, "Only collect the results of the runs finished so far.")
_RECORD = flags.DEFINE_string(
    "record", None, "Also write the results as a record: this path (no suffix) .json and .md, e.g. docs/results/NAME."
)
_LEDGER = flags.DEFINE_string(
    "ledger",
    None,
    "A ledger folder kept in the repository (ledgers/<name>): finished runs are copied into it and skipped on any "
    "machine; the results come from it alone. It pins the code commit, platform, devices, dtype and tokenizer.",
)
_JOBS = flags.DEFINE_integer(
    "jobs",
    None,
    "Runs trained at once, each on its own GPUs or CPU cores where there are enough. Default: 2 on a CPU of 2 or "
    "more cores (docs/results/sweep_jobs_cpu-amx: more runs an hour than one run on both cores), else 1.",
    lower_bound=1,
)
_BUDGET_MINUTES = flags.DEFINE_float(
    "budget_minutes",
    None,
    "Start a run only if its predicted time (seconds per FLOP measured so far x its FLOPs) fits in what is left.",
    lower_bound=0,
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
    ledger = Ledger(_LEDGER.value) if _LEDGER.value else None
    if not _COLLECT.value:
        train_processes.prepare(loaded, _ROOT.value, ledger)
    planned = runner.plan_runs(_ROOT.value, selected, _SEEDS.value)
    if ledger is not None:
        in_ledger = [run for run in planned if ledger.has(run)]
        planned = [run for run in planned if run not in in_ledger]
        print(
            f"{len(in_ledger)} of the runs asked for are in the ledger {ledger.path}, {len(planned)} not.",
            file=sys.stderr,
        )
    if _DRY_RUN.value:
        lines, left_out = runner.pending_commands(loaded, planned, _ROOT.value)
        left_out_runs = {run for run, _ in left_out}
        for run in planned:  # Each printed command trains with the sweep's one tokenizer.
            if run not in left_out_runs:
                train_processes.provide_tokenizer(run, _ROOT.value)
        print("\n".join(lines))
        for run, why in left_out:
            print(f"left out {run.label}: {why}", file=sys.stderr)
        return
    source = records.source() if _RECORD.value else None  # The commit as the sweep starts.
    failed, runs = [], {"trained": 0, "finished_before": None}  # --collect: none trained, the rest unknown.
    if not _COLLECT.value:
        budget = _budget(ledger)
        outcome = train_processes.run_all(loaded, planned, _ROOT.value, ledger=ledger, jobs=_jobs(), budget=budget)
        failed = outcome.failed
        print(f"{len(outcome.finished)} runs trained, {len(outcome.skipped)} finished before, {len(failed)} failed.")
        if outcome.deferred:
            print(f"{len(outcome.deferred)} runs left for later (over the budget): " + _labels(outcome.deferred))
        runs = {"trained": len(outcome.finished), "finished_before": len(outcome.skipped)}
    collected = _collect(loaded, ledger)
    plots.draw(_ROOT.value, collected.summaries)
    finished = sum(len(s.results) for s in collected.summaries)
    print(f"Results of {finished} runs ({len(collected.unfinished)} not finished) in {_ROOT.value}/results.md")
    if _RECORD.value:
        print(f"Record: {_write_record(_RECORD.value, loaded, collected, source, runs, ledger)}")
    if failed:
        for run, why in failed:
            print(f"FAILED {run.label}: {why}", file=sys.stderr)
        sys.exit(1)


def _labels(runs_and_predictions) -> str:
    return ", ".join(f"{run.label} (~{seconds / 60:.0f} min)" for run, seconds in runs_and_predictions)


def _jobs() -> int:
    """--jobs, or its default: 2 on a CPU of 2 or more cores, else 1 (a machine with GPUs: one run on all of them)."""
    if _JOBS.value is not None:
        return _JOBS.value
    return 2 if not train_processes.visible_gpus() and len(os.sched_getaffinity(0)) >= 2 else 1


def _budget(ledger: Ledger | None) -> Budget | None:
    """--budget_minutes, predicted from the ledger's runs on this CPU kind until this sweep has its own."""
    if _BUDGET_MINUTES.value is None:
        return None
    rates = ledger.wall_seconds_per_flop(records.machine()["cpu_kind"]) if ledger is not None else ()
    return Budget(_BUDGET_MINUTES.value * 60, rates)


def _collect(sweep: runner.Sweep, ledger: Ledger | None) -> report.Collected:
    """Every seed run so far, also beyond --seeds (a sweep run earlier with more), from the ledger or the root."""
    if ledger is not None:
        seeds = max(_SEEDS.value, ledger.seeds_present(sweep.names()))
        return report.collect(sweep, _ROOT.value, ledger.runs(sweep.names(), seeds))
    seeds = max(_SEEDS.value, runner.seeds_present(_ROOT.value, sweep.names()))
    return report.collect(sweep, _ROOT.value, runner.plan_runs(_ROOT.value, sweep.names(), seeds))


def _write_record(
    path: str, sweep: runner.Sweep, collected: report.Collected, source: dict, runs: dict, ledger: Ledger | None
) -> str:
    """The results as a record at `path` (.json and .md), with `source`, the commit the sweep started from, or
    with a ledger, the commit and the machines and software of the ledger's runs."""
    unfinished = [run.label for run in collected.unfinished]
    fields = {**source, "runs": {**runs, "unfinished": unfinished}}
    if ledger is not None:
        fields = ledger_record_fields(ledger, collected, collected_by=source)
    record = records.new(
        f"sweep {os.path.relpath(sweep.path, runner.REPOSITORY)}",
        figures=report.record_figures(collected.summaries),
        packages=(*records.DEFAULT_PACKAGES, "sacrebleu"),
        **fields,
    )
    path = path.removesuffix(".json")
    written = records.write(
        record, path, table=[*collected.page, "", *plots.record_pictures(path, collected.summaries)]
    )
    plots.draw_beside_record(path, collected.summaries)  # Only once the record is taken.
    return written


if __name__ == "__main__":
    app.run(main)
