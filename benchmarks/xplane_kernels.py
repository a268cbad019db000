"""The XLA kernels of a `jax.profiler.trace`, read from its `.xplane.pb`, and the optimized modules they ran.

Each kernel event of the raw profile names the instruction that launched it in its `hlo_op` stat,
and its program in `hlo_module` and `program_id`. On a GPU they are the events of the device
plane's streams (`/device:GPU:0`, lines 'Stream #...'); the plane's other lines ('XLA Ops',
'XLA Modules', ...) are derived from them and would count each kernel again. On a CPU they are
the host plane's events that carry `hlo_op` (one per instruction run, on whichever thread ran it).
The trace viewer's JSON is not read: recent xprof versions drop `hlo_op` from it for GPU kernels.

Kernels are joined to instructions through an `--xla_dump_to` dump's optimized modules
(`module_<program id>.<name>.<platform>_after_optimizations.txt`), or a compiled module's text.
XLA:GPU launches kernels inside command buffers (CUDA graphs) by default, where they lose their
`hlo_op`: profile with `XLA_FLAGS=--xla_gpu_enable_command_buffer=` (empty).
"""

import dataclasses
import glob
import os
import re

from jax.profiler import ProfileData

_DEVICE_PLANE = re.compile(r"^/device:(GPU|TPU):\d+$")
# An optimized module of a dump: its program id and name (`module_0006.jit_step.cpu_after_optimizations.txt`).
_DUMPED_MODULE = re.compile(r"^module_(\d+)\.(.+?)\.[\w.\-]*after_optimizations\.txt$")
_MODULE_NAME = re.compile(r"^HloModule ([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel (GPU) or one instruction's run on a thread (CPU), on a timeline."""

    name: str  # The kernel's own (a fusion's, cuBLAS's), or on a CPU the instruction's.
    hlo_op: str  # The instruction that launched it; '' where the profiler names none.
    hlo_module: str  # Its program's name (`jit_train_step`); '' where none.
    program_id: int | None  # Its program's id, as the dump's file names give it.
    line: str  # The timeline it ran on: a GPU stream, a host thread.
    start_ns: float
    duration_ns: float


def _kernel(event, line: str) -> Kernel:
    stats = dict(event.stats)
    program_id = stats.get("program_id")
    return Kernel(
        name=event.name,
        hlo_op=str(stats.get("hlo_op", "")),
        hlo_module=str(stats.get("hlo_module", "")),
        program_id=int(program_id) if program_id is not None else None,
        line=line,
        start_ns=event.start_ns,
        duration_ns=event.duration_ns,
    )


def kernels(profile: ProfileData) -> tuple[list[Kernel], str]:
    """The profile's kernels and their clock: 'device' (the first accelerator's streams) or 'cpu' (the host's).

    On an accelerator every event of its stream lines counts, `hlo_op` or not (an unnamed kernel is
    time no instruction claims); on the host only events with an `hlo_op` are XLA's.
    """
    devices = sorted((plane for plane in profile.planes if _DEVICE_PLANE.match(plane.name)), key=lambda p: p.name)
    if devices:
        streams = [line for line in devices[0].lines if line.name.startswith("Stream")]
        return [_kernel(event, line.name) for line in streams for event in line.events], "device"
    host = profile.find_plane_with_name("/host:CPU")
    found = [_kernel(event, line.name) for line in (host.lines if host else ()) for event in line.events]
    return [kernel for kernel in found if kernel.hlo_op], "cpu"


def read_trace(trace_dir: str) -> tuple[list[Kernel], str]:
    """`kernels` of the one `.xplane.pb` that `jax.profiler.trace(trace_dir)` wrote."""
    (path,) = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.xplane.pb"))
    return kernels(ProfileData.from_file(path))


def dumped_modules(dump_dir: str) -> dict:
    """Every module an `--xla_dump_to=dump_dir` run compiled: program id -> its optimized text, and name -> the
    largest text of that name (for kernels whose program id the dump's file names do not give)."""
    modules, by_name = {}, {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "module_*after_optimizations.txt"))):
        if match := _DUMPED_MODULE.match(os.path.basename(path)):
            with open(path, encoding="utf-8") as module:
                modules[int(match.group(1))] = text = module.read()
            by_name[match.group(2)] = max(by_name.get(match.group(2), ""), text, key=len)
    return {**modules, **by_name}


def module_name(hlo: str) -> str:
    """The name a module's text gives it (`HloModule jit_train_step, ...` -> 'jit_train_step'); '' if none."""
    match = _MODULE_NAME.match(hlo.lstrip())
    return match.group(1) if match else ""


def idle_ns(timeline: list[Kernel]) -> float:
    """Time between the first kernel's start and the last one's end when no kernel runs, on any line."""
    idle, busy_until = 0.0, None
    for kernel in sorted(timeline, key=lambda k: k.start_ns):
        if busy_until is not None and kernel.start_ns > busy_until:
            idle += kernel.start_ns - busy_until
        end = kernel.start_ns + kernel.duration_ns
        busy_until = end if busy_until is None else max(busy_until, end)
    return idle
