r"""Where a train step spends its time, by kind of kernel: config R on a CPU, Transformer-base on a GPU.

  python -m benchmarks.step_profile [--dtype=bfloat16] [--steps=20]          # config R on this CPU
  python -m benchmarks.step_profile --model=base --steps=10                  # Transformer-base on one GPU
  python -m benchmarks.step_profile --model=base --variant=model.dropout_rate=0.0 --output=/tmp/dropout0
  XLA_FLAGS=--xla_cpu_use_onednn=true python -m benchmarks.step_profile --output=...   # another XLA setting

The step is benchmarks/config_r.py's `ProjectStep` (the train step exactly as train.py builds it):
config R (`--model=config_r`, `--dtype`), or benchmarks/step_variants.py's Transformer-base
(`base`: bf16, 96 x 256) or its tiny stand-in (`tiny`: the same path on a CPU in seconds), with
`--variant`'s config fields. The process adds `--xla_dump_to` (a scratch folder) and
`--xla_gpu_enable_command_buffer=` to XLA_FLAGS before JAX starts its backend: kernels launched
inside command buffers (CUDA graphs, on by default) carry no instruction. After warm-up,
`jax.profiler.trace` records `--steps` steps dispatched back to back; benchmarks/xla_profile.py
reads their kernels from the trace's `.xplane.pb`, joins each to its instruction in the dump,
and sums their time by what the instruction computes (on a GPU: device time, and the device's
idle gaps between kernels; on a CPU: every thread's time). Writes a record (common/records.py)
with the buckets' milliseconds per step and shares, the unattributed share, the largest
instructions, and the step's wall time outside the profiler; the caller's XLA_FLAGS is part of
the record.
"""

import os
import tempfile
import time

import jax
from absl import app, flags

from benchmarks import config_r, step_variants, xla_profile
from common import records

records.define_software_note_flag()

MODELS = ("config_r", *step_variants.MODELS)
_MODEL = flags.DEFINE_enum(
    "model", "config_r", MODELS, "config_r (CPU), base (Transformer-base, GPU), tiny (base's path)."
)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "config_r: compute dtype of the step.")
_VARIANT = flags.DEFINE_string(
    "variant", step_variants.DEFAULT_VARIANT, "base, tiny: config fields field=value joined by '+' (step_variants)."
)
_STEPS = flags.DEFINE_integer("steps", 20, "Profiled steps (after warm-up).", lower_bound=1)
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 5, "Steps before the profile (the first compiles).", lower_bound=1)
_TIMED_STEPS = flags.DEFINE_integer(
    "timed_steps", 20, "Steps timed without the profiler, for the step's wall time.", lower_bound=1
)
_OUTPUT = flags.DEFINE_string(
    "output",
    "",
    "Record path without suffix (default: step_profile_<dtype>_<cpu kind>, step_profile_<model>_<backend>).",
)
# Kernels in command buffers lose their instruction (an empty value turns them all off).
PROFILE_XLA_FLAGS = "--xla_gpu_enable_command_buffer="


def _config():
    if _MODEL.value == "config_r":
        return config_r.config_r(_DTYPE.value)
    return step_variants.with_variant(step_variants.MODELS[_MODEL.value](), _VARIANT.value)


def _wall_ms(step: config_r.ProjectStep, steps: int) -> float:
    """Milliseconds a step, dispatched back to back as training runs them, waiting once at the end."""
    start = time.perf_counter()
    jax.block_until_ready([step() for _ in range(steps)])
    return (time.perf_counter() - start) / steps * 1e3


def _profile(dump_dir: str, callers_xla_flags: str) -> tuple[dict, str]:
    """The step's figures and the title of its table."""
    config = _config()
    step = config_r.ProjectStep(config, config_r.random_batch(config))
    jax.block_until_ready([step() for _ in range(_WARMUP_STEPS.value)])
    figures = {"step_wall_ms": _wall_ms(step, _TIMED_STEPS.value)}
    figures.update(xla_profile.profile(step, calls=_STEPS.value, dump_dir=dump_dir))
    clock = figures["clock"]
    name = f"config R ({_DTYPE.value})" if _MODEL.value == "config_r" else f"{_MODEL.value} ({_VARIANT.value})"
    title = (
        f"{name} train step, {config.per_device_batch_size} x {config.dataset.max_length}, on "
        f"{jax.devices()[0].device_kind}: {figures['step_wall_ms']:.1f} ms wall a step (mean of {_TIMED_STEPS.value}, "
        f"no profiler); {figures[f'profiled_{clock}_ms_per_call']:.1f} ms of {clock} time a step "
        f"({_STEPS.value} profiled steps). XLA_FLAGS: `{callers_xla_flags}`, and `{PROFILE_XLA_FLAGS}` to profile."
    )
    return figures, title


def _largest_table(figures: dict) -> list[str]:
    key = f"{figures['clock']}_ms_per_call"
    lines = ["| largest instructions | bucket | ms a step | JAX op |", "|---|---|---:|---|"]
    lines += [
        f"| {row['name']} | {row['bucket']} | {row[key]:.2f} | `{row['op_name'][-80:]}` |"
        for row in figures["largest_instructions"][:10]
    ]
    lines += [
        f"| {row['hlo_op']} ({row['name'][:60]}) | unattributed | {row[key]:.2f} | |"
        for row in figures["largest_unmatched_kernels"]
    ]
    return lines


def main(argv):
    del argv
    callers_xla_flags = os.environ.get("XLA_FLAGS", "")
    measured_source = records.source()
    with tempfile.TemporaryDirectory() as dump_dir:
        # Read once, when JAX starts its backend: nothing before this line may use a device.
        os.environ["XLA_FLAGS"] = f"{callers_xla_flags} {PROFILE_XLA_FLAGS} --xla_dump_to={dump_dir}".strip()
        figures, title = _profile(dump_dir, callers_xla_flags)
    os.environ["XLA_FLAGS"] = callers_xla_flags
    table = [title, "", *xla_profile.bucket_table(figures), "", *_largest_table(figures)]
    device = jax.devices()[0]
    record = records.new(
        f"where the {_MODEL.value} train step spends its time, by kind of kernel",
        figures=figures,
        xla_flags=callers_xla_flags,
        profile_xla_flags=PROFILE_XLA_FLAGS,
        variant=_VARIANT.value,
        jax_backend=jax.default_backend(),
        machine={**records.machine(), "accelerator": f"{device.device_kind} ({jax.default_backend()})"},
        **measured_source,
    )
    default_name = (
        f"step_profile_{_DTYPE.value}_{record['machine']['cpu_kind']}"
        if _MODEL.value == "config_r"
        else f"step_profile_{_MODEL.value}_{jax.default_backend()}"
    )
    print("\n".join(table))
    print("wrote", records.write(record, _OUTPUT.value or os.path.join(records.RESULTS_DIR, default_name), table))


if __name__ == "__main__":
    app.run(main)
