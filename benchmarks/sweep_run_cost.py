r"""A Table 3 base run's wall time by phase, with the sweep's cuts and without them.

  python -m benchmarks.sweep_run_cost --output=docs/results/sweep_run_cost_cpu-avx512-bf16

Trains configs/sweeps/table3.py's base (seed 0, all its steps) twice, one run after the other, each
with an empty compilation cache, as a new machine's sweep does:

- before: as the sweep ran it before the cuts, the same code with the settings restored: the run
  prepares its dataset and trains its tokenizer in its own workdir, measures the CPU's matmul peak
  for an MFU, checkpoints every 250 steps and draws the test's attention maps.
- after: as the sweep runs it now: the dataset and tokenizer prepared once for the sweep
  (`train.py --mode=prepare`, timed apart: a sweep of 69 runs pays it once), one checkpoint at the
  end, no attention maps, no MFU.

Both validate every 100 steps (at 200 the curves would have three points) and train in float32
(the sweep's first runs were bfloat16; float32 is its dtype on every CPU for its numbers, not a cut).
The seconds by phase come from each run's attempts.jsonl (training/phases.py): setup (data,
tokenizer, model, the matmul peak), compile, train (checkpoints included), evaluation (validation,
test, attention maps); start-up is the rest of the process' wall time (imports, JAX's start). Run it on a machine doing
nothing else: a sweep beside it would share the cores.
"""

import json
import os
import subprocess
import tempfile
import time

from absl import app, flags

from common import records
from common.workdir import Workdir
from sweeps import runner, train_processes
from training.reporting import attempts

records.define_software_note_flag()

_OUTPUT = flags.DEFINE_string("output", None, "Record path without suffix, e.g. docs/results/sweep_run_cost_cpu-amx.")
_STEPS = flags.DEFINE_integer("steps", 0, "Training steps of each run; 0: the sweep's.", lower_bound=0)
_SEEDS = 3  # sweep.py's default: 69 runs of Table 3 share one preparation.
flags.mark_flags_as_required(["output"])

_SWEEP_FILE = """
from configs.sweeps import config_for
from configs.sweeps import table3

VARIANTS = table3.VARIANTS


def get_config(variant="base"):
    config = config_for(table3.base_config(), VARIANTS, variant)
    config.compilation_cache_dir = {cache!r}  # Empty: compiled afresh, as on a new machine.
{settings}
    return config
"""
_PHASES = ("start_up", "setup", "compile", "train", "evaluation")


def _before_settings(workdir: str) -> dict:
    """The base config's settings before the cuts (configs/sweeps/table3.py as the sweep's first runs had it)."""
    return {
        "dataset.data_dir": Workdir(workdir).tfds,  # Prepared by the run itself, its tokenizer too.
        "checkpoint_every_steps": 250,
        "eval.attention_maps": True,
        "peak_flops_per_device": 0.0,  # Measured at start-up.
    }


def _write_sweep(path: str, cache: str, settings: dict) -> runner.Sweep:
    """A sweep file of Table 3 whose configs compile into `cache` and take `settings` (config field -> value)."""
    if _STEPS.value:
        settings = {"num_train_steps": _STEPS.value, "checkpoint_every_steps": _STEPS.value} | settings
    lines = "\n".join(f"    config.{field} = {value!r}" for field, value in settings.items())
    with open(path, "w", encoding="utf-8") as f:
        f.write(_SWEEP_FILE.format(cache=cache, settings=lines))
    return runner.load_sweep(path)


def _train(sweep: runner.Sweep, root: str) -> dict:
    """Trains the base's seed 0 under `root`; its seconds by phase, start-up the process' wall outside them."""
    (run,) = runner.plan_runs(root, ["base"], 1)
    train_processes.provide_tokenizer(run, root)
    os.makedirs(run.workdir, exist_ok=True)
    with open(os.path.join(run.workdir, "train.log"), "w", encoding="utf-8") as log:
        subprocess.run(runner.command(sweep, run, root), check=True, stdout=log, stderr=subprocess.STDOUT)
    (attempt,) = attempts.read(Workdir(run.workdir).attempts)
    seconds = {name: attempt["seconds"].get(name, 0.0) for name in _PHASES[1:]}
    phases = {"start_up": attempt["wall_seconds"] - sum(seconds.values()), **seconds}
    rounded = {name: round(value, 1) for name, value in phases.items()}
    return {"steps": attempt["step"], "wall_seconds": round(attempt["wall_seconds"], 1), **rounded}


def main(argv):
    del argv
    source = records.source()
    figures = {"variant": "base", "seed": 0}
    with tempfile.TemporaryDirectory() as folder:
        before_root, after_root = os.path.join(folder, "before"), os.path.join(folder, "after")
        (before_run,) = runner.plan_runs(before_root, ["base"], 1)
        before = _write_sweep(
            os.path.join(folder, "before_table3.py"),
            os.path.join(folder, "cache_before"),
            _before_settings(before_run.workdir),
        )
        figures["before_settings"] = _before_settings("<workdir>")
        figures["before"] = _train(before, before_root)
        print("before:", json.dumps(figures["before"]), flush=True)

        after = _write_sweep(os.path.join(folder, "after_table3.py"), os.path.join(folder, "cache_after"), {})
        figures["sweep_runs"] = len(after.variants) * _SEEDS
        started = time.monotonic()
        subprocess.run(runner.prepare_command(after, after_root), check=True, capture_output=True)
        figures["prepare_once_seconds"] = round(time.monotonic() - started, 1)
        figures["after"] = _train(after, after_root)
        print("after:", json.dumps(figures["after"]), f"prepared once in {figures['prepare_once_seconds']} s")
    before, after = figures["before"], figures["after"]
    per_run = after["wall_seconds"] + figures["prepare_once_seconds"] / figures["sweep_runs"]
    figures["after_with_preparation_shared_seconds"] = round(per_run, 1)
    figures["saved_fraction"] = round(1 - per_run / before["wall_seconds"], 3)
    record = records.new(
        "a Table 3 base run's wall by phase, before and after the sweep's cuts", figures=figures, **source
    )
    table = [
        "| run | steps | wall (s) | start-up | setup | compile | train | evaluation |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {name} | {run['steps']} | {run['wall_seconds']:.0f} | "
            + " | ".join(f"{run[phase]:.0f}" for phase in _PHASES)
            + " |"
            for name, run in (("before the cuts", before), ("after the cuts", after))
        ),
        "",
        f"After the cuts the dataset and tokenizer are prepared once a sweep, in "
        f"{figures['prepare_once_seconds']:.0f} s: {per_run:.0f} s a run with it shared over "
        f"{figures['sweep_runs']} runs, {100 * figures['saved_fraction']:.0f}% less than before.",
    ]
    print(f"Record: {records.write(record, _OUTPUT.value, table=table)}")


if __name__ == "__main__":
    app.run(main)
