"""CPU time of a jitted computation's XLA instructions, from a `jax.profiler` trace, summed by bucket.

Every instruction's time is summed over all threads (CPU time, so the shares add up however the
cores split the work) and put in one bucket by what it computes (benchmarks/hlo_buckets.py), read
from the compiled module the calls run.
"""

import collections
import glob
import gzip
import json
import os
import tempfile
from collections.abc import Callable

import jax

from benchmarks import hlo_buckets


def _trace_events(trace_dir: str) -> list[dict]:
    (path,) = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(path) as trace:
        return [event for event in json.load(trace)["traceEvents"] if event.get("ph") == "X"]


def profile(run: Callable[[], object], hlo: str, *, calls: int, buckets=hlo_buckets.BUCKETS) -> dict:
    """Traces `calls` calls of `run` (each blocking until done) and sums its instructions' CPU time.

    Args:
        run: one call of the compiled computation, already warmed up.
        hlo: the compiled module's text (`compiled.as_text()`), whose instructions the trace names.
        calls: how many calls to trace; figures are per call.
        buckets: the classification (hlo_buckets.BUCKETS for a train step, DECODE_BUCKETS for decoding).

    Returns:
        'profiled_cpu_ms_per_call', 'buckets' ({label: {'cpu_ms_per_call', 'share'}}) and the 15
        'largest_instructions' (name, bucket, JAX op_name, cpu_ms_per_call).
    """
    instructions, computations = hlo_buckets.operations(hlo)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                run()
        events = _trace_events(trace_dir)
    per_instruction = collections.Counter()
    for event in events:
        if event["name"] in instructions and instructions[event["name"]][0] not in hlo_buckets.CONTAINERS:
            per_instruction[event["name"]] += event["dur"] / 1e3  # Microseconds to milliseconds.
    bucket_of = {name: hlo_buckets.bucket(name, instructions, computations, buckets) for name in per_instruction}
    per_bucket = collections.Counter()
    for name, milliseconds in per_instruction.items():
        per_bucket[bucket_of[name]] += milliseconds
    total = sum(per_bucket.values())
    return {
        "profiled_cpu_ms_per_call": total / calls,
        "buckets": {
            label: {"cpu_ms_per_call": per_bucket[label] / calls, "share": per_bucket[label] / total}
            for label, _ in buckets
        },
        "largest_instructions": [
            {
                "name": name,
                "bucket": bucket_of[name],
                "op_name": instructions[name][1],
                "cpu_ms_per_call": milliseconds / calls,
            }
            for name, milliseconds in per_instruction.most_common(15)
        ],
    }
