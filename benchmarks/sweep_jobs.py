r"""Sweep throughput by --jobs: N runs at once, each on its share of the cores, against one run at a time on all.

  python -m benchmarks.sweep_jobs --output=docs/results/sweep_jobs_cpu-amx

Runs two short Table 3 runs (base and heads_1, seed 0, --steps each) through sweep.py twice, in
fresh roots with empty compilation caches: once with --jobs=1 (one run after the other, each on
every core), once with --jobs=2 (both at once, one core each on a 2-core machine). The record gives
each sweep's wall time for the two runs (the data prepared before, by a dry run; the sweep only
checks it, a few seconds), runs per hour, and each run's seconds by phase
(its attempts.jsonl): how the cores' sharing changes start-up, compiling, training and evaluation.
A full run of 600 steps spends a larger share training than these short ones; the record also
extrapolates each setting to full runs from its per-step training time and its fixed phases.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from common import records
from common.workdir import Workdir
from training.reporting import attempts

records.define_software_note_flag()

_OUTPUT = flags.DEFINE_string("output", None, "Record path without suffix, e.g. docs/results/sweep_jobs_cpu-amx.")
_STEPS = flags.DEFINE_integer("steps", 100, "Training steps of each short run.", lower_bound=1)
_JOBS = flags.DEFINE_list("jobs", ["1", "2"], "The --jobs settings compared.")
flags.mark_flags_as_required(["output"])

_VARIANTS = ("base", "heads_1")
_FULL_STEPS = 600  # configs/sweeps/table3.py's runs.
_SWEEP_FILE = """
from configs.sweeps import config_for
from configs.sweeps import table3

VARIANTS = table3.VARIANTS


def get_config(variant="base"):
    config = config_for(table3.base_config(), VARIANTS, variant)
    config.num_train_steps = config.checkpoint_every_steps = {steps}
    config.compilation_cache_dir = {cache!r}  # Each setting compiles afresh, as a new machine's sweep does.
    return config
"""


def _sweep(sweep_file: str, root: str, jobs: int) -> float:
    """Runs the two variants' seed 0 with `jobs` at once; returns the wall seconds of the training part."""
    args = [sys.executable, "sweep.py", f"--sweep={sweep_file}", f"--root={root}", "--seeds=1"]
    args.append(f"--only={','.join(_VARIANTS)}")
    # The data and tokenizer first, alone (a --dry_run prepares them): the timed sweep only trains.
    subprocess.run([*args, "--dry_run"], cwd=records.REPO_ROOT, check=True, capture_output=True)
    started = time.monotonic()
    subprocess.run([*args, f"--jobs={jobs}"], cwd=records.REPO_ROOT, check=True, capture_output=True)
    return time.monotonic() - started


def _phases(root: str, variant: str) -> dict:
    (attempt,) = attempts.read(Workdir(os.path.join(root, variant, "seed_0")).attempts)
    seconds = {name: round(value, 1) for name, value in attempt["seconds"].items()}
    return {"wall_seconds": round(attempt["wall_seconds"], 1), **seconds}


def _full_run_seconds(phases: dict, steps: int) -> float:
    """A 600-step run's wall predicted from a short run's: its training scaled by the steps, the rest as measured."""
    return phases["wall_seconds"] + phases["train"] * (_FULL_STEPS / steps - 1)


def main(argv):
    del argv
    source = records.source()
    figures = {"steps": _STEPS.value, "variants": list(_VARIANTS), "settings": {}}
    with tempfile.TemporaryDirectory() as folder:
        for jobs in map(int, _JOBS.value):
            root = os.path.join(folder, f"jobs_{jobs}")
            sweep_file = os.path.join(folder, f"short_table3_{jobs}.py")
            with open(sweep_file, "w", encoding="utf-8") as f:
                f.write(_SWEEP_FILE.format(steps=_STEPS.value, cache=os.path.join(root, "compilation_cache")))
            wall = _sweep(sweep_file, root, jobs)
            runs = {variant: _phases(root, variant) for variant in _VARIANTS}
            # Full runs `jobs` at a time: the groups run one after the other, each as long as its slowest run.
            full = [_full_run_seconds(phases, _STEPS.value) for phases in runs.values()]
            groups = [full[start : start + jobs] for start in range(0, len(full), jobs)]
            full_runs_per_hour = 3600 * len(full) / sum(max(group) for group in groups)
            figures["settings"][str(jobs)] = {
                "wall_seconds": round(wall, 1),
                "runs_per_hour": round(3600 * len(_VARIANTS) / wall, 2),
                "full_runs_per_hour": round(full_runs_per_hour, 2),
                "runs": runs,
            }
            print(f"--jobs={jobs}: {wall:.0f} s for {len(_VARIANTS)} runs of {_STEPS.value} steps", flush=True)
    settings = figures["settings"]
    figures["faster"] = max(settings, key=lambda jobs: settings[jobs]["full_runs_per_hour"])
    record = records.new("sweep throughput by --jobs", figures=figures, **source)
    table = [
        "| --jobs | wall, 2 short runs | runs/hour | predicted 600-step runs/hour | "
        "per run: start-up, compile, train, evaluation (s) |",
        "|---|---:|---:|---:|---|",
    ]
    for jobs, setting in settings.items():
        per_run = "; ".join(
            f"{variant} {p['wall_seconds'] - p['compile'] - p['train'] - p['evaluation']:.0f}, {p['compile']:.0f}, "
            f"{p['train']:.0f}, {p['evaluation']:.0f}"
            for variant, p in setting["runs"].items()
        )
        table.append(
            f"| {jobs} | {setting['wall_seconds']:.0f} s | {setting['runs_per_hour']:.2f} | "
            f"{setting['full_runs_per_hour']:.2f} | {per_run} |"
        )
    print(json.dumps(figures["settings"], indent=1))
    print(f"Record: {records.write(record, _OUTPUT.value, table=table)}")


if __name__ == "__main__":
    app.run(main)
