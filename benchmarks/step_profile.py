r"""Where config R's train step spends its time on this CPU, by kind of operation.

  python -m benchmarks.step_profile [--dtype=bfloat16] [--steps=20]
  XLA_FLAGS=--xla_cpu_use_onednn=true python -m benchmarks.step_profile --output=...   # another XLA setting

The step is benchmarks/config_r.py's `ProjectStep` (config R: the train step exactly as
train.py builds it). After warm-up, `jax.profiler.trace` records `--steps` steps; every XLA
instruction's time is summed over all threads (CPU time, so the shares add up however the
cores split the work) and each instruction is put in one bucket by what it computes, read from
the compiled module by benchmarks/hlo_buckets.py. Writes a record (common/records.py) with
the buckets' milliseconds per step and shares, the largest instructions, and the step's wall
time outside the profiler; XLA_FLAGS is part of the record. The profile itself is
benchmarks/xla_profile.py's.
"""

import os
import statistics
import time

import jax
from absl import app, flags

from benchmarks import config_r, xla_profile
from common import records

records.define_software_note_flag()

_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype of the step.")
_STEPS = flags.DEFINE_integer("steps", 20, "Profiled steps (after warm-up).")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 5, "Steps before the profile (the first compiles).")
_TIMED_STEPS = flags.DEFINE_integer("timed_steps", 20, "Steps timed without the profiler, for the step's wall time.")
_OUTPUT = flags.DEFINE_string("output", "", "Record path without suffix (default: step_profile_<dtype>_<cpu kind>).")


def main(argv):
    del argv
    measured_source = records.source()
    config = config_r.config_r(_DTYPE.value)
    step = config_r.ProjectStep(config, config_r.random_batch(config))
    for _ in range(_WARMUP_STEPS.value):
        step().block_until_ready()
    seconds = []
    for _ in range(_TIMED_STEPS.value):
        start = time.perf_counter()
        step().block_until_ready()
        seconds.append(time.perf_counter() - start)
    profiled = xla_profile.profile(lambda: step().block_until_ready(), step.compiled_hlo(), calls=_STEPS.value)
    figures = {"step_wall_ms": statistics.median(seconds) * 1e3, **profiled}
    table = [
        f"Config R train step, {_DTYPE.value}: {figures['step_wall_ms']:.0f} ms wall a step (median of "
        f"{_TIMED_STEPS.value}, no profiler); {figures['profiled_cpu_ms_per_call']:.0f} ms of XLA instructions' "
        f"CPU time a step over all threads ({_STEPS.value} profiled steps). "
        f"XLA_FLAGS: `{os.environ.get('XLA_FLAGS', '')}`.",
        "",
        *xla_profile.bucket_table(figures),
    ]
    record = records.new(
        f"where config R's {_DTYPE.value} train step spends its time",
        figures=figures,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        jax_backend=jax.default_backend(),
        **measured_source,
    )
    path = _OUTPUT.value or os.path.join(
        records.RESULTS_DIR, f"step_profile_{_DTYPE.value}_{record['machine']['cpu_kind']}"
    )
    print("\n".join(table))
    print("wrote", records.write(record, path, table))


if __name__ == "__main__":
    app.run(main)
