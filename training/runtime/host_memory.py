"""How glibc's malloc serves XLA:CPU's per-step buffers: chosen per run, set by a restart.

XLA:CPU allocates each run's temporaries with malloc (about 1 GB a step for the quick-start's
64 x 64 batch, 600 MB for benchmarks/peer_throughput.py's config R) and frees them when the run
ends. glibc serves every allocation above 32 MiB with a fresh `mmap` and returns it with
`munmap`, so with its defaults each step faults all those pages in anew, 4 KiB at a time: the
quick-start took ~280,000 minor page faults a step, a fifth of its CPU time in the kernel.
Three allocators (`config.host_allocator`):

- 'huge_pages' (the default): glibc's `glibc.malloc.hugetlb=1` tunable has malloc ask for
  transparent huge pages on its mappings, which then fault in 2 MiB at a time (512 times fewer
  faults); the kernel still zeroes every new page. Memory use stays glibc's.
- 'keep_freed': one arena, no `mmap`, no trimming: freed buffers stay in the heap and the next
  step reuses them without faulting or zeroing. Fastest, but the heap fragments and the process
  keeps its peak: the quick-start's peak RSS is 2-3x glibc's.
- 'glibc': glibc's defaults.

Measured on a 2-core AMD EPYC, quiet, in target tokens/s and peak RSS of one process
(2026-11-23): config R in bfloat16 (benchmarks/peer_throughput.py, medians of 5 rounds)
6,680 keep_freed, 6,192 huge_pages; the quick-start's packed step and stream
(benchmarks/train_throughput.py, two runs each) 6,157-6,579 and 3.9 GB keep_freed,
5,709-6,245 and 2.0 GB huge_pages, 4,738-5,142 and 2.0 GB glibc. The quick-start's whole
command with huge_pages: 1.3M minor faults, 2.2 GB peak RSS.

glibc reads its tunables only when a process starts, from GLIBC_TUNABLES, so an entry point
restarts itself (same PID and command line) with the allocator's tunables set.
"""

import ctypes
import ctypes.util
import os
import sys

from common.config_fields import require_choice

ALLOCATORS = ("huge_pages", "keep_freed", "glibc")
DEFAULT_ALLOCATOR = "huge_pages"  # config.host_allocator's default; translate.py and classify.py run with it.
_TUNABLES = {
    "huge_pages": "glibc.malloc.hugetlb=1",
    # A trim threshold of 2^62 bytes: never give the heap's free top back to the kernel.
    "keep_freed": "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4611686018427387904",
    "glibc": "",
}
_TUNABLES_VARIABLE = "GLIBC_TUNABLES"
# The allocator the process was restarted with, for its own later calls and its children.
_MARKER_VARIABLE = "AIAYN_HOST_ALLOCATOR"
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_FIRST_GLIBC_WITH_HUGETLB = (2, 35)


def _glibc_version() -> tuple[int, ...] | None:
    """glibc's version, or None for another C library (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        return tuple(int(part) for part in libc.gnu_get_libc_version().decode().split(".")[:2])
    except (OSError, AttributeError, TypeError, ValueError):
        return None


def _transparent_huge_pages_on_request() -> bool:
    """Whether the kernel gives transparent huge pages to mappings that ask (mode 'madvise').

    In mode 'always' every large mapping gets them without asking; in 'never' none does.
    """
    try:
        with open(_THP_MODE_FILE, encoding="ascii") as mode_file:
            return "[madvise]" in mode_file.read()
    except OSError:
        return False


def _effective(allocator: str) -> str:
    """The allocator that would change something here: 'glibc' where `allocator` would not."""
    version = _glibc_version() if sys.platform.startswith("linux") else None
    if version is None:
        return "glibc"
    if allocator == "huge_pages" and (version < _FIRST_GLIBC_WITH_HUGETLB or not _transparent_huge_pages_on_request()):
        return "glibc"
    return allocator


def check_allocator(allocator: str) -> None:
    """Raises UserInputError unless `allocator` (config.host_allocator) is one of ALLOCATORS."""
    require_choice("host_allocator", allocator, ALLOCATORS)


def allocator_environment(allocator: str, environ: dict[str, str]) -> dict[str, str] | None:
    """`environ` for a process that runs with `allocator`, or None if this one already does.

    The user's own GLIBC_TUNABLES stay, after the allocator's (glibc takes the last setting).
    """
    check_allocator(allocator)
    allocator = _effective(allocator)
    current = environ.get(_MARKER_VARIABLE, "glibc")
    if current == allocator:
        return None
    users = [tunable for tunable in environ.get(_TUNABLES_VARIABLE, "").split(":") if tunable]
    for tunable in _TUNABLES.get(current, "").split(":"):  # What an earlier restart added.
        if tunable in users:
            users.remove(tunable)
    tunables = ":".join(filter(None, [_TUNABLES[allocator], *users]))
    environment = {key: value for key, value in environ.items() if key not in (_TUNABLES_VARIABLE, _MARKER_VARIABLE)}
    if tunables:
        environment[_TUNABLES_VARIABLE] = tunables
    if allocator != "glibc":
        environment[_MARKER_VARIABLE] = allocator
    return environment


def restart_with_allocator(allocator: str) -> None:
    """Restarts this process (same PID, same command line) with `allocator`, unless it runs with it.

    Call it in an entry point before any work (JAX's backend included): the process starts
    over. Returns at once where it already runs with `allocator`, or where the allocator
    would change nothing (another C library; 'huge_pages' with glibc < 2.35 or the kernel's
    transparent huge pages in mode 'always' or 'never').

    Raises:
        UserInputError: `allocator` is not one of ALLOCATORS.
    """
    environment = allocator_environment(allocator, dict(os.environ))
    if environment is None or not sys.executable or not getattr(sys, "orig_argv", None):
        return  # Nothing to change, or no way to start this interpreter again (embedded Python).
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
