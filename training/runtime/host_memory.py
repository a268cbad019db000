"""How glibc's malloc serves XLA:CPU's per-step buffers: freed buffers kept for reuse, set at start-up.

XLA:CPU mallocs each step's temporaries (hundreds of MB) and frees them after it; glibc's defaults
map and unmap every block above 32 MiB, so each step faults all its pages in again. Keeping freed
memory in the heap, set with `mallopt` in the running process, needs no restart nor anything set
before the process starts, and beats glibc's defaults and its huge-page tunable; tcmalloc through
LD_PRELOAD was faster still on a quiet machine (docs/results/host_allocators_fast_group.json,
benchmarks/host_allocators.py).
"""

import ctypes
import ctypes.util
import os
import sys

# mallopt's options (glibc's malloc.h) and their values: one arena, no mmap, never trim (-1).
_KEEP_FREED = {"M_ARENA_MAX": (-8, 1), "M_MMAP_MAX": (-4, 0), "M_TRIM_THRESHOLD": (-1, -1)}


def _glibc_version() -> tuple[int, ...] | None:
    """glibc's version, or None for another C library (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        return tuple(int(part) for part in libc.gnu_get_libc_version().decode().split(".")[:2])
    except (OSError, AttributeError, TypeError, ValueError):
        return None


def keep_freed_buffers() -> bool:
    """Sets glibc's malloc in this process to keep freed memory for reuse; returns whether mallopt took it.

    One arena, no `mmap` for large blocks, no trimming of the heap's free top: a buffer freed
    after a step serves the next step's without faulting its pages in again. Call it in an entry
    point before JAX starts (its threads then share the one arena). It changes nothing where the
    C library is not glibc, or where the user set glibc's malloc tunables (GLIBC_TUNABLES
    `glibc.malloc.*`): theirs stand. Under a preloaded allocator (LD_PRELOAD) it is harmless:
    tcmalloc's `mallopt` does nothing, and jemalloc leaves glibc's malloc unused.
    """
    if any(tunable.startswith("glibc.malloc.") for tunable in os.environ.get("GLIBC_TUNABLES", "").split(":")):
        return False
    if not sys.platform.startswith("linux") or _glibc_version() is None:
        return False
    libc = ctypes.CDLL(None)  # The process's own symbols: a preloaded allocator's mallopt where it has one.
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(libc.mallopt(option, value) == 1 for option, value in _KEEP_FREED.values())
