"""Host memory that stays with the process: XLA:CPU steps without page faults.

XLA:CPU allocates each run's temporaries with malloc (about 600 MB for the train step of
benchmarks/peer_throughput.py's config R) and frees them when the run ends. glibc serves an
allocation that large with a fresh `mmap` and returns it with `munmap`, as it does every
allocation of a thread's own arena that outgrows its 64 MB heap, so every step faults all
those pages in anew: measured ~150,000 minor page faults and ~0.3 s of kernel time per config-R
step on a 2-core AMD EPYC, a third of the step's CPU time. With one arena, no `mmap` and no
trimming, the freed memory stays in the heap and the next step reuses it (~15,000 faults).
The cost is that the process keeps its peak heap until it exits, and one arena without
mmap fragments more: the quick-start's peak RSS rose from 2.2 to 5.2 GB with these
settings (config.keep_freed_host_memory turns them off for train.py).
"""

import ctypes
import ctypes.util
import sys

from absl import logging

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# mallopt takes an int: the largest trim threshold it accepts, 2 GiB of free heap top.
_NEVER_TRIM = 2**31 - 1


def keep_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for reuse: one arena, no mmap, no trimming.

    Call it first in an entry point's main, before JAX starts its backend: a thread that
    has already allocated keeps its own arena.

    Returns:
        Whether the settings were applied: False off Linux or without glibc (macOS,
        musl), where nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # Only glibc has it (and these mallopt parameters).
    except (OSError, AttributeError, TypeError):
        return False
    applied = all(
        libc.mallopt(parameter, value) == 1
        for parameter, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM))
    )
    if not applied:
        logging.warning("glibc refused a malloc setting: XLA's host buffers are mapped anew at every step.")
    return applied
