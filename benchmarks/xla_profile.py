"""Time of jitted computations' XLA instructions, from a `jax.profiler` trace, summed by bucket.

The trace's kernels are read from its `.xplane.pb` (benchmarks/xplane_kernels.py): on a GPU the
device's kernels, each naming the instruction that launched it (`hlo_op`), their times summed
(device time), with the gaps between them on the device's timeline as a bucket of their own; on
a CPU every instruction's run on each thread, summed over all threads (CPU time, so the shares
add up however the cores split the work). Each kernel is joined to its instruction in its
program's optimized module (an `--xla_dump_to` dump's, or a compiled module's text), and every
instruction is put in one bucket by what it computes (benchmarks/hlo_buckets.py). A kernel whose
instruction no module holds is put in a bucket by its name (`KERNEL_NAME_BUCKETS`) and counted in
'unmatched_share', the share of kernel time left unattributed.
"""

import collections
import re
import tempfile
from collections.abc import Callable

import jax

from benchmarks import hlo_buckets, xplane_kernels
from benchmarks.xplane_kernels import Kernel

# A kernel without a known instruction, by its name (lower case): the first pattern it contains.
KERNEL_NAME_BUCKETS = (
    (("fmha", "flash", "cudnn"), "fused attention (cuDNN)"),
    (("gemm", "cutlass", "cublas", "xmma", "wgmma"), "matmuls: projections and feed-forward"),
    (("memcpy", "memset", "copy", "transpose"), "transposes and copies"),
)
IDLE = "idle gaps between kernels"  # A device's bucket: its timeline with no kernel running.


def _kernel_name_bucket(name: str) -> str:
    lower = name.lower()
    return next(
        (label for patterns, label in KERNEL_NAME_BUCKETS if any(p in lower for p in patterns)),
        hlo_buckets.BUCKETS[-1][0],
    )


def _sanitized(name: str) -> str:
    """An instruction's name as XLA:GPU names the kernel it emits for it ('loop_fusion.2' -> 'loop_fusion_2')."""
    return re.sub(r"[^\w]", "_", name)


class _Module:
    """One optimized module's instructions, to join kernels to and bucket."""

    def __init__(self, hlo: str, buckets):
        self.instructions, self.computations = hlo_buckets.operations(hlo)
        self.by_kernel_name = {_sanitized(name): name for name in self.instructions}
        self.buckets, self._bucket_of = buckets, {}

    def instruction(self, kernel: Kernel, clock: str) -> str | None:
        """The instruction that ran `kernel`: its `hlo_op`, else (a GPU kernel) the one its name is made of."""
        if kernel.hlo_op in self.instructions:
            return kernel.hlo_op
        if clock == "cpu":
            return kernel.name if kernel.name in self.instructions else None
        return self.by_kernel_name.get(_sanitized(kernel.hlo_op)) or self.by_kernel_name.get(kernel.name)

    def bucket(self, name: str) -> str:
        if name not in self._bucket_of:
            self._bucket_of[name] = hlo_buckets.bucket(name, self.instructions, self.computations, self.buckets)
        return self._bucket_of[name]


def sum_by_bucket(kernels: list[Kernel], clock: str, modules: dict, *, calls: int, buckets=hlo_buckets.BUCKETS) -> dict:
    """Sums the kernels' times by bucket; the figures of `profile`.

    Args:
        kernels: a trace's kernels (xplane_kernels.kernels), over `calls` calls.
        clock: 'device' (an accelerator's kernels: their idle gaps become a bucket) or 'cpu'.
        modules: optimized modules' text by program id (int, a dump's) or by module name (str); a kernel is
            joined to its program's, by id where the dump has it, else by name.
        calls: how many calls the kernels ran; figures are per call.
        buckets: the classification (hlo_buckets.BUCKETS for a train step, DECODE_BUCKETS for decoding).
    """
    parsed = {key: _Module(hlo, buckets) for key, hlo in modules.items()}
    per_instruction, unmatched = collections.Counter(), collections.Counter()
    for kernel in kernels:
        module = parsed.get(kernel.program_id) or parsed.get(kernel.hlo_module)
        name = module.instruction(kernel, clock) if module else None
        milliseconds = kernel.duration_ns / 1e6
        if name is None:  # A kernel no module here holds (a library's helper, a program not dumped).
            unmatched[kernel.hlo_op or kernel.name, kernel.name] += milliseconds
        elif module.instructions[name][0] not in hlo_buckets.CONTAINERS:  # Their inner instructions are timed.
            per_instruction[module, name] += milliseconds
    per_bucket = collections.Counter()
    for (module, name), milliseconds in per_instruction.items():
        per_bucket[module.bucket(name)] += milliseconds
    for (_, kernel_name), milliseconds in unmatched.items():
        per_bucket[_kernel_name_bucket(kernel_name)] += milliseconds
    kernel_total = sum(per_bucket.values()) or float("nan")
    labels = [label for label, _ in buckets]
    if clock == "device":
        per_bucket[IDLE] = xplane_kernels.idle_ns(kernels) / 1e6
        labels.append(IDLE)
    total = sum(per_bucket.values()) or float("nan")
    key = f"{clock}_ms_per_call"
    return {
        "clock": clock,
        f"profiled_{key}": total / calls,
        "unmatched_share": sum(unmatched.values()) / kernel_total,
        "buckets": {label: {key: per_bucket[label] / calls, "share": per_bucket[label] / total} for label in labels},
        "largest_instructions": [
            {
                "name": name,
                "bucket": module.bucket(name),
                "op_name": module.instructions[name][1],
                key: milliseconds / calls,
            }
            for (module, name), milliseconds in per_instruction.most_common(15)
        ],
        "largest_unmatched_kernels": [
            {"hlo_op": hlo_op, "name": name, key: milliseconds / calls}
            for (hlo_op, name), milliseconds in unmatched.most_common(5)
        ],
    }


def profile(
    run: Callable[[], object], hlo: str = "", *, calls: int, dump_dir: str = "", buckets=hlo_buckets.BUCKETS
) -> dict:
    """Traces `calls` calls of `run` and sums its instructions' times, waiting for the last call's result.

    Args:
        run: one call of the compiled computation, already warmed up; calls that do not wait for their
            result keep the device busy, so that the idle gaps are the step's own.
        hlo: the compiled module's text (`compiled.as_text()`), whose instructions the trace names.
        calls: how many calls to trace; figures are per call.
        dump_dir: instead of or beside `hlo`, the process's `--xla_dump_to` folder: every program's module.
        buckets: the classification (hlo_buckets.BUCKETS for a train step, DECODE_BUCKETS for decoding).

    Returns:
        'clock' ('cpu': summed over the host's threads; 'device': an accelerator's kernels),
        'profiled_<clock>_ms_per_call' (on a device, idle gaps included), 'buckets' ({label:
        {'<clock>_ms_per_call', 'share'}}), 'unmatched_share' (of kernel time no instruction
        claims), the 15 'largest_instructions' (name, bucket, JAX op_name, time) and the 5
        'largest_unmatched_kernels'.
    """
    modules = xplane_kernels.dumped_modules(dump_dir) if dump_dir else {}
    if hlo:
        modules[xplane_kernels.module_name(hlo)] = hlo
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            result = None
            for _ in range(calls):
                result = run()
            jax.block_until_ready(result)
        kernels, clock = xplane_kernels.read_trace(trace_dir)
    return sum_by_bucket(kernels, clock, modules, calls=calls, buckets=buckets)


def bucket_table(figures: dict) -> list[str]:
    """`profile`'s buckets as a Markdown table (ms a call on its clock, shares), then the unattributed share."""
    clock = figures["clock"]
    lines = [f"| operations | {clock.upper() if clock == 'cpu' else clock} ms a step | share |", "|---|---:|---:|"]
    for label, row in figures["buckets"].items():
        lines.append(f"| {label} | {row[f'{clock}_ms_per_call']:.1f} | {row['share']:.1%} |")
    return [*lines, "", f"Unattributed (no instruction matched): {figures['unmatched_share']:.1%} of kernel time."]
