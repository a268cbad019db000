"""Tests for training/runtime/host_memory.py: after start-up, a freed buffer stays in the process for the next one."""

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from training.runtime import host_memory

# Starts as an entry point does (or not, with 'none'; 'report with jax': JAX imported first, its
# jax_platforms set to argv[2], as train.py imports it before start-up), then allocates, touches
# and frees a buffer far above glibc's largest mmap threshold (32 MiB) from a new thread, as XLA's
# worker threads allocate a step's temporaries, twice; prints what start-up returned, the minor
# page faults of the second round and how far the resident set fell when the buffer was freed.
_PROBE = """
import ctypes, os, resource, sys, threading
from training.runtime import host_memory
if sys.argv[1] == "start-up":
    print("set", host_memory.keep_freed_buffers())
elif sys.argv[1] == "report":
    print("serving", host_memory.set_up())
elif sys.argv[1] == "report with jax":
    import jax
    from jax._src import xla_bridge
    jax.config.update("jax_platforms", sys.argv[2])
    print("serving", host_memory.set_up())
    print("backends_started", xla_bridge.backends_are_initialized())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 256 * 2**20
faults, released = [], []
statm = os.open("/proc/self/statm", os.O_RDONLY)

def resident_bytes():
    # Python's small-object allocator serves what this allocates: glibc's heap stays as it is.
    return int(os.pread(statm, 100, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")

def allocate_touch_free():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(size)
    ctypes.memset(buffer, 1, size)
    resident = resident_bytes()
    libc.free(buffer)
    released.append(resident - resident_bytes())
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

for _ in range(2):
    thread = threading.Thread(target=allocate_touch_free)
    thread.start()
    thread.join()
print("faults", faults[1])
print("released", released[1])
"""

SIZE = 256 * 2**20
SMALL_PAGES = SIZE // 4096  # 65,536

needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or host_memory._glibc_version() is None, reason="needs Linux with glibc"
)


def _run_probe(tmp_path, start: str, *args: str, **environment: str) -> dict[str, str]:
    """Runs _PROBE (`start`: 'start-up', 'report' as entry points start, or 'none'; then `args`) with
    `environment`, JAX on the CPU unless it says otherwise."""
    unset = ("GLIBC_TUNABLES", "LD_PRELOAD", "JAX_PLATFORMS")
    base = {key: value for key, value in os.environ.items() if key not in unset}
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    result = subprocess.run(
        [sys.executable, str(script), start, *args],
        cwd=REPO_ROOT,
        env={**base, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT), **environment},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


@needs_glibc
def test_after_start_up_a_freed_buffer_stays_and_the_next_reuses_it_without_faulting(tmp_path):
    probe = _run_probe(tmp_path, "start-up")
    assert probe["set"] == "True"
    assert int(probe["released"]) < SIZE // 100  # Still resident: not given back to the kernel.
    assert int(probe["faults"]) < SMALL_PAGES // 100  # Slack: the thread's stack, Python.


@needs_glibc
def test_glibc_defaults_unmap_a_large_buffer_and_fault_every_page_again(tmp_path):
    # What start-up fixes.
    probe = _run_probe(tmp_path, "none")
    assert int(probe["released"]) >= SIZE * 9 // 10
    assert int(probe["faults"]) >= SMALL_PAGES


@needs_glibc
def test_the_users_malloc_tunables_stand(tmp_path):
    # glibc.malloc.hugetlb=0 is glibc's default: a way to run with glibc's defaults.
    probe = _run_probe(tmp_path, "start-up", GLIBC_TUNABLES="glibc.rtld.optional_static_tls=512:glibc.malloc.hugetlb=0")
    assert probe["set"] == "False"
    assert int(probe["faults"]) >= SMALL_PAGES


@needs_glibc
def test_other_tunables_do_not_stop_start_up(tmp_path):
    probe = _run_probe(tmp_path, "start-up", GLIBC_TUNABLES="glibc.rtld.optional_static_tls=512")
    assert probe["set"] == "True"
    assert int(probe["faults"]) < SMALL_PAGES // 100


@pytest.mark.parametrize("glibc, platform", [(None, "linux"), ((2, 36), "darwin")])
def test_nothing_is_set_without_glibc(monkeypatch, glibc, platform):
    monkeypatch.setattr(host_memory, "_glibc_version", lambda: glibc)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert host_memory.keep_freed_buffers() is False


@pytest.mark.parametrize(
    "mapped, allocator",
    [
        ("7f00-7f10 r-xp 0 08:01 12 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10", "tcmalloc"),
        ("7f00-7f10 r-xp 0 08:01 12 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc"),
        ("7f00-7f10 r-xp 0 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6", None),
    ],
)
def test_a_preloaded_allocator_is_found_by_its_mapped_library(tmp_path, mapped, allocator):
    maps = tmp_path / "maps"
    maps.write_text(f"5600-5601 r--p 0 08:01 7 /usr/bin/python3.11\n{mapped}\n")
    assert host_memory.preloaded_allocator(str(maps)) == allocator


_TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@needs_glibc
@pytest.mark.skipif(not os.path.exists(_TCMALLOC), reason="needs Debian's libtcmalloc-minimal4")
def test_a_preloaded_tcmalloc_is_left_in_place(tmp_path):
    probe = _run_probe(tmp_path, "report", LD_PRELOAD=_TCMALLOC)
    assert probe["serving"] == "tcmalloc (preloaded)"


@needs_glibc
def test_without_a_preloaded_allocator_start_up_reports_glibc_keeping_freed_buffers(tmp_path):
    probe = _run_probe(tmp_path, "report")
    assert probe["serving"].startswith("glibc malloc, keeping freed buffers")
    assert int(probe["faults"]) < SMALL_PAGES // 100


@needs_glibc
@pytest.mark.parametrize("platforms", ["cuda", "tpu,cpu"])
def test_where_jax_computes_on_an_accelerator_malloc_is_left_as_configured(tmp_path, platforms):
    # Measured only on CPUs: on an accelerator the step's buffers are the device's.
    probe = _run_probe(tmp_path, "report", JAX_PLATFORMS=platforms)
    first = platforms.split(",")[0]
    assert probe["serving"] == f"the C library's malloc as configured (JAX may compute on {first} (JAX_PLATFORMS))"
    assert int(probe["faults"]) >= SMALL_PAGES  # glibc's defaults.


@needs_glibc
def test_the_cpu_first_in_jax_platforms_gets_the_cpu_setting(tmp_path):
    probe = _run_probe(tmp_path, "report", JAX_PLATFORMS="cpu,cuda")
    assert probe["serving"].startswith("glibc malloc, keeping freed buffers")
    assert int(probe["faults"]) < SMALL_PAGES // 100


@needs_glibc
def test_an_installed_accelerator_plugin_leaves_malloc_as_configured(tmp_path):
    # JAX prefers a plugin's accelerator where JAX_PLATFORMS is unset; a module of the jax_plugins
    # namespace package is a plugin, as the CUDA plugin's jax_plugins.xla_cuda12 is.
    plugin = tmp_path / "site" / "jax_plugins" / "xla_stand_in"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text("raise ImportError('start-up must not import a plugin')\n")
    paths = os.pathsep.join((str(REPO_ROOT), str(tmp_path / "site")))
    probe = _run_probe(tmp_path, "report", JAX_PLATFORMS="", PYTHONPATH=paths)
    assert probe["serving"].startswith("the C library's malloc as configured (JAX may compute on an installed backend:")
    assert "jax_plugins.xla_stand_in" in probe["serving"]
    assert int(probe["faults"]) >= SMALL_PAGES


@needs_glibc
def test_start_up_reads_jax_config_and_starts_no_backend(tmp_path):
    # JAX_PLATFORMS=cpu in the environment, jax_platforms='cuda' in JAX's config: JAX would start CUDA.
    probe = _run_probe(tmp_path, "report with jax", "cuda")
    assert probe["serving"] == "the C library's malloc as configured (JAX may compute on cuda (JAX_PLATFORMS))"
    assert probe["backends_started"] == "False"
