"""How the host's allocator serves XLA:CPU's per-step buffers: tcmalloc where preloaded, else glibc's malloc tuned.

XLA:CPU mallocs each step's temporaries (hundreds of MB) and frees them after it; glibc's defaults
map and unmap every block above 32 MiB, so each step faults all its pages in again. tcmalloc
(`LD_PRELOAD`, Debian's `libtcmalloc-minimal4`) keeps freed blocks in its caches. A preloaded
allocator must be in place before the process starts, so it is the user's choice (the README's
main command, docs/speed.md); without one, `set_up` tunes glibc's malloc in the running process: no restart, nothing
set before start-up. It does so only where JAX computes on the CPU, where it was measured: on an
accelerator the step's buffers live in device memory, and the host's malloc serves other work.
"""

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import pkgutil
import re
import sys

# mallopt's options (glibc's malloc.h) and their values: one arena, no mmap, never trim (-1).
_KEEP_FREED = {"M_ARENA_MAX": (-8, 1), "M_MMAP_MAX": (-4, 0), "M_TRIM_THRESHOLD": (-1, -1)}


# Allocators that replace malloc when preloaded, by the file name of their library.
_PRELOADED = re.compile(r"/lib(tcmalloc|jemalloc)[\w.-]*\.so")


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
    after a step serves the next step's without faulting its pages in again. Called before JAX
    starts (its threads then share the one arena). It changes nothing where the
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


def preloaded_allocator(maps_path: str = "/proc/self/maps") -> str | None:
    """'tcmalloc' or 'jemalloc' where its library is mapped into this process (LD_PRELOAD), else None."""
    try:
        with open(maps_path) as maps:
            found = _PRELOADED.search(maps.read())
    except OSError:  # No /proc (macOS): nothing to find.
        return None
    return found.group(1) if found else None


def installed_accelerators() -> list[str]:
    """JAX's accelerator backends installed here, found as JAX finds them but without importing them.

    JAX loads the modules of the `jax_plugins` namespace package and of the `jax_plugins` entry-point
    group (the CUDA and ROCm plugins), and libtpu for TPUs (jax/_src/xla_bridge.py).
    """
    found = {entry_point.value for entry_point in importlib.metadata.entry_points(group="jax_plugins")}
    plugins = importlib.util.find_spec("jax_plugins")
    if plugins is not None and plugins.submodule_search_locations:
        found.update(
            f"jax_plugins.{module.name}" for module in pkgutil.iter_modules(plugins.submodule_search_locations)
        )
    if importlib.util.find_spec("libtpu") is not None:
        found.add("libtpu")
    return sorted(found)


def accelerator_backend() -> str | None:
    """What JAX will compute on in this process, where it may not be the CPU; None for the CPU. Starts no backend.

    JAX_PLATFORMS (or jax.config's jax_platforms, where JAX is imported) lists the platforms by
    preference: the first is JAX's default. Without it, JAX prefers an installed accelerator backend
    that starts (`installed_accelerators`); one installed on a machine without its device still
    counts here, as it cannot be told apart without starting it: set JAX_PLATFORMS=cpu there.
    """
    jax = sys.modules.get("jax")
    platforms = (jax.config.jax_platforms if jax is not None else os.environ.get("JAX_PLATFORMS")) or ""
    if platforms:
        first = platforms.split(",")[0].strip()
        return None if first == "cpu" else f"{first} (JAX_PLATFORMS)"
    accelerators = installed_accelerators()
    return f"an installed backend: {', '.join(accelerators)}" if accelerators else None


def set_up() -> str:
    """Sets up host memory for XLA:CPU's step buffers; returns what serves them, for the log.

    Call it in an entry point before JAX starts its threads. A preloaded tcmalloc or jemalloc is
    left as it is; otherwise, where JAX computes on the CPU (`accelerator_backend` is None),
    glibc's malloc keeps freed buffers (`keep_freed_buffers`).
    """
    allocator = preloaded_allocator()
    if allocator:
        return f"{allocator} (preloaded)"
    if accelerator := accelerator_backend():
        return f"the C library's malloc as configured (JAX may compute on {accelerator})"
    if keep_freed_buffers():
        return "glibc malloc, keeping freed buffers (faster: LD_PRELOAD=libtcmalloc_minimal.so.4)"
    return "the C library's malloc as configured"
