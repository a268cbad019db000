r"""Where config R's train step spends its time on this CPU, by kind of operation.

  python -m benchmarks.step_profile [--dtype=bfloat16] [--steps=20]
  XLA_FLAGS=--xla_cpu_use_onednn=true python -m benchmarks.step_profile --output=...   # another XLA setting

The step is benchmarks/config_r.py's `ProjectStep` (config R: the train step exactly as
train.py builds it). After warm-up, `jax.profiler.trace` records `--steps` steps; every XLA
instruction's time is summed over all threads (CPU time, so the shares add up however the two
cores split the work) and each instruction is put in one bucket by what it computes, read from
the compiled module: its opcode and the JAX operation names (`metadata.op_name`) of every
instruction it fuses. A fusion goes to the first bucket of `BUCKETS` that any of its fused
operations belongs to, so a matmul with a fused cast counts as a matmul and a layer norm with
a fused cast as a layer norm; casts and transposes count alone only where nothing else is fused
with them. Writes a record (benchmarks/records.py) with the buckets' milliseconds per step and
shares, the largest instructions, and the step's wall time outside the profiler; XLA_FLAGS is
part of the record.
"""

import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import jax
from absl import app, flags

from benchmarks import config_r, records

_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype of the step.")
_STEPS = flags.DEFINE_integer("steps", 20, "Profiled steps (after warm-up).")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 5, "Steps before the profile (the first compiles).")
_TIMED_STEPS = flags.DEFINE_integer("timed_steps", 20, "Steps timed without the profiler, for the step's wall time.")
_OUTPUT = flags.DEFINE_string("output", "", "Record path without suffix (default: step_profile_<dtype>_<cpu kind>).")


def _is_matmul(opcode: str, op_name: str) -> bool:
    return opcode in ("dot", "convolution") or op_name.endswith("dot_general")


def _is_attention_product(opcode: str, op_name: str) -> bool:
    """QK^T and the weighted values: products of the attention's own `attend`, not of its projections."""
    return _is_matmul(opcode, op_name) and re.search(r"_attention\.attend/dot_general$", op_name) is not None


# (bucket, test on one operation: its opcode and JAX op_name). An instruction goes to the first
# bucket any of its operations (a fusion's: every fused one) passes.
BUCKETS = (
    ("matmuls: vocabulary projection", lambda opcode, op_name: _is_matmul(opcode, op_name) and "_logits" in op_name),
    ("matmuls: attention products", _is_attention_product),
    ("matmuls: projections and feed-forward", _is_matmul),
    ("loss (softmax cross-entropy, its gradient)", lambda _, op_name: "jvp()" in op_name or "_logits" in op_name),
    ("dropout (random bits, masks)", lambda _, op_name: "dropout" in op_name),
    ("layer norms", lambda _, op_name: "_norm/" in op_name or "LayerNorm" in op_name),
    ("attention softmax and masks", lambda _, op_name: "attention" in op_name),
    ("embeddings and positions", lambda _, op_name: "embed" in op_name),
    ("optimizer (Adam, gradient norm, finite checks)", lambda _, op_name: "Transformer" not in op_name),
    ("casts", lambda opcode, op_name: opcode == "convert" or op_name.endswith("convert_element_type")),
    ("transposes and copies", lambda opcode, op_name: opcode in ("transpose", "copy") or op_name.endswith("transpose")),
    ("other model work (residuals, activations)", lambda _, __: True),
)
# Operations that compute nothing themselves: left out of a fusion's tests.
_INERT = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_CONTAINERS = {"while", "call", "conditional", "async-start", "async-done"}  # Their inner instructions have events.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{$")


def _operations(hlo: str) -> tuple[dict, dict]:
    """(instruction -> (opcode, op_name, called computations), computation -> its instructions' names)."""
    instructions, computations, current = {}, collections.defaultdict(list), None
    for line in hlo.splitlines():
        if match := _COMPUTATION.match(line):
            current = match.group(1)
        elif match := _INSTRUCTION.match(line):
            name, opcode, rest = match.groups()
            op_name = re.search(r'op_name="([^"]*)"', rest)
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest)
            instructions[name] = (opcode, op_name.group(1) if op_name else "", calls)
            computations[current].append(name)
    return instructions, computations


def _fused_operations(name: str, instructions: dict, computations: dict) -> list[tuple[str, str]]:
    """(opcode, op_name) of an instruction and of everything its called computations hold."""
    opcode, op_name, calls = instructions[name]
    found = [(opcode, op_name)]
    for computation in calls:
        for inner in computations.get(computation, ()):
            found += _fused_operations(inner, instructions, computations)
    return found


def bucket(name: str, instructions: dict, computations: dict) -> str:
    """The first of BUCKETS that any operation of instruction `name` falls in."""
    operations = [
        (opcode, op_name)
        for opcode, op_name in _fused_operations(name, instructions, computations)
        if opcode not in _INERT and opcode != "fusion"
    ]
    return next(label for label, test in BUCKETS if any(test(opcode, op_name) for opcode, op_name in operations))


def _trace_events(trace_dir: str) -> list[dict]:
    (path,) = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(path) as trace:
        return [event for event in json.load(trace)["traceEvents"] if event.get("ph") == "X"]


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
    hlo = step.compiled_hlo()
    instructions, computations = _operations(hlo)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(_STEPS.value):
                loss = step()
            loss.block_until_ready()
        events = _trace_events(trace_dir)
    per_instruction = collections.Counter()
    for event in events:
        if event["name"] in instructions and instructions[event["name"]][0] not in _CONTAINERS:
            per_instruction[event["name"]] += event["dur"] / 1e3  # Microseconds to milliseconds.
    per_bucket = collections.Counter()
    for name, milliseconds in per_instruction.items():
        per_bucket[bucket(name, instructions, computations)] += milliseconds
    total = sum(per_bucket.values())
    steps = _STEPS.value
    figures = {
        "step_wall_ms": statistics.median(seconds) * 1e3,
        "profiled_cpu_ms_per_step": total / steps,
        "buckets": {
            label: {"cpu_ms_per_step": per_bucket[label] / steps, "share": per_bucket[label] / total}
            for label, _ in BUCKETS
        },
        "largest_instructions": [
            {
                "name": name,
                "bucket": bucket(name, instructions, computations),
                "op_name": instructions[name][1],
                "cpu_ms_per_step": milliseconds / steps,
            }
            for name, milliseconds in per_instruction.most_common(15)
        ],
    }
    table = [
        f"Config R train step, {_DTYPE.value}: {figures['step_wall_ms']:.0f} ms wall a step (median of "
        f"{_TIMED_STEPS.value}, no profiler); {figures['profiled_cpu_ms_per_step']:.0f} ms of XLA instructions' "
        f"CPU time a step over all threads ({steps} profiled steps). XLA_FLAGS: `{os.environ.get('XLA_FLAGS', '')}`.",
        "",
        "| operations | CPU ms a step | share |",
        "|---|---:|---:|",
        *(
            f"| {label} | {row['cpu_ms_per_step']:.1f} | {row['share']:.1%} |"
            for label, row in figures["buckets"].items()
        ),
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
