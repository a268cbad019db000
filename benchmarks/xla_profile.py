"""Time of a jitted computation's XLA instructions, from a `jax.profiler` trace, summed by bucket.

On a CPU the trace holds one event per instruction run on each thread; their times are summed
over all threads (CPU time, so the shares add up however the cores split the work). On a GPU the
device's streams hold one event per kernel, named by the kernel (an XLA fusion's name, a cuBLAS
or cuDNN kernel's own) and carrying the instruction that launched it in its `hlo_op` argument;
their times are summed (device time). Either way every instruction is put in one bucket by what it
computes (benchmarks/hlo_buckets.py), read from the compiled module the calls run. A kernel no
instruction of the module claims is put in a bucket by its name (`KERNEL_NAME_BUCKETS`) and
counted in 'unmatched_share'.
"""

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable

import jax

from benchmarks import hlo_buckets

# A kernel without a known instruction, by its name (lower case): the first pattern it contains.
KERNEL_NAME_BUCKETS = (
    (("fmha", "flash", "cudnn"), "fused attention (cuDNN)"),
    (("gemm", "cutlass", "cublas", "xmma", "wgmma"), "matmuls: projections and feed-forward"),
    (("memcpy", "memset", "copy", "transpose"), "transposes and copies"),
)
# Lines of a device's trace that XLA's profiler derives from its kernels (each kernel again).
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Framework", "Steps", "Source code", "Launch Stats")


def _trace_events(trace_dir: str) -> list[dict]:
    (path,) = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(path) as trace:
        return json.load(trace)["traceEvents"]


def _names(events: list[dict], kind: str) -> dict:
    """Names of processes (`kind` 'process_name', by pid) or threads ('thread_name', by (pid, tid))."""
    return {
        (event["pid"] if kind == "process_name" else (event["pid"], event.get("tid"))): event["args"]["name"]
        for event in events
        if event.get("ph") == "M" and event.get("name") == kind
    }


def timed_events(events: list[dict]) -> tuple[list[dict], str]:
    """The events that time instructions, and their clock: 'device' (an accelerator's kernels) or 'cpu'.

    An accelerator's events are those of its streams ('Stream #...' lines), where it has any, else
    of its lines but the ones the profiler derives from them; without an accelerator, every event
    of the host (the caller keeps those that name an instruction).
    """
    processes, threads = _names(events, "process_name"), _names(events, "thread_name")
    devices = {pid for pid, name in processes.items() if name.startswith("/device:") and "CPU" not in name}
    complete = [event for event in events if event.get("ph") == "X"]
    on_device = [event for event in complete if event["pid"] in devices]
    if not on_device:
        return complete, "cpu"

    def line(event):
        return threads.get((event["pid"], event.get("tid")), "")

    streams = [event for event in on_device if line(event).startswith("Stream")]
    return streams or [event for event in on_device if not line(event).startswith(_DERIVED_LINES)], "device"


def _kernel_name_bucket(name: str) -> str:
    lower = name.lower()
    return next(
        (label for patterns, label in KERNEL_NAME_BUCKETS if any(p in lower for p in patterns)),
        hlo_buckets.BUCKETS[-1][0],
    )


def _sanitized(name: str) -> str:
    """An instruction's name as XLA:GPU names the kernel it emits for it ('loop_fusion.2' -> 'loop_fusion_2')."""
    return re.sub(r"[^\w]", "_", name)


def sum_by_bucket(events: list[dict], hlo: str, *, calls: int, buckets=hlo_buckets.BUCKETS) -> dict:
    """Sums the trace events' instruction times by bucket; the figures of `profile`, from a trace's events."""
    instructions, computations = hlo_buckets.operations(hlo)
    by_kernel_name = {_sanitized(name): name for name in instructions}
    timed, clock = timed_events(events)
    per_instruction, unmatched = collections.Counter(), collections.Counter()
    for event in timed:
        # A host event is named by its instruction; a kernel names it in `hlo_op`, or by its own name.
        candidates = ((event.get("args") or {}).get("hlo_op"), event["name"]) if clock == "device" else (event["name"],)
        name = next((c for c in candidates if c in instructions), None)
        if name is None and clock == "device":
            name = next((by_kernel_name[c] for c in candidates if c in by_kernel_name), None)
        if name is not None and instructions[name][0] not in hlo_buckets.CONTAINERS:
            per_instruction[name] += event["dur"] / 1e3  # Microseconds to milliseconds.
        elif name is None and clock == "device":  # A kernel of no instruction here (a library's helper).
            unmatched[event["name"]] += event["dur"] / 1e3
    bucket_of = {name: hlo_buckets.bucket(name, instructions, computations, buckets) for name in per_instruction}
    per_bucket = collections.Counter()
    for name, milliseconds in per_instruction.items():
        per_bucket[bucket_of[name]] += milliseconds
    for name, milliseconds in unmatched.items():
        per_bucket[_kernel_name_bucket(name)] += milliseconds
    total = sum(per_bucket.values()) or float("nan")
    key = f"{clock}_ms_per_call"
    return {
        "clock": clock,
        f"profiled_{key}": total / calls,
        "unmatched_share": sum(unmatched.values()) / total,
        "buckets": {
            label: {key: per_bucket[label] / calls, "share": per_bucket[label] / total} for label, _ in buckets
        },
        "largest_instructions": [
            {"name": name, "bucket": bucket_of[name], "op_name": instructions[name][1], key: milliseconds / calls}
            for name, milliseconds in per_instruction.most_common(15)
        ],
        "largest_unmatched_kernels": [
            {"name": name, key: milliseconds / calls} for name, milliseconds in unmatched.most_common(5)
        ],
    }


def profile(run: Callable[[], object], hlo: str, *, calls: int, buckets=hlo_buckets.BUCKETS) -> dict:
    """Traces `calls` calls of `run` (each blocking until done) and sums its instructions' times.

    Args:
        run: one call of the compiled computation, already warmed up.
        hlo: the compiled module's text (`compiled.as_text()`), whose instructions the trace names.
        calls: how many calls to trace; figures are per call.
        buckets: the classification (hlo_buckets.BUCKETS for a train step, DECODE_BUCKETS for decoding).

    Returns:
        'clock' ('cpu': summed over the host's threads; 'device': an accelerator's kernels),
        'profiled_<clock>_ms_per_call', 'buckets' ({label: {'<clock>_ms_per_call', 'share'}}),
        'unmatched_share' (of kernels no instruction claims), the 15 'largest_instructions' (name,
        bucket, JAX op_name, time) and the 5 'largest_unmatched_kernels'.
    """
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                run()
        events = _trace_events(trace_dir)
    return sum_by_bucket(events, hlo, calls=calls, buckets=buckets)


def bucket_table(figures: dict) -> list[str]:
    """`profile`'s buckets as a Markdown table: milliseconds a call on its clock, and shares."""
    clock = figures["clock"]
    lines = [f"| operations | {clock.upper() if clock == 'cpu' else clock} ms a step | share |", "|---|---:|---:|"]
    for label, row in figures["buckets"].items():
        lines.append(f"| {label} | {row[f'{clock}_ms_per_call']:.1f} | {row['share']:.1%} |")
    return lines
