"""Tests for common/host_memory.py: the restart with an allocator, and what each does to a large buffer."""

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, run_entry_point

from common import host_memory
from common.errors import UserInputError

# Restarts as an entry point does, then allocates, touches and frees a buffer far above glibc's
# largest mmap threshold (32 MiB) from a new thread, as XLA's worker threads allocate a step's
# temporaries, twice, and prints its PID before and after the restart, its arguments and the
# minor page faults of the second round.
_PROBE = """
import ctypes, os, resource, sys, threading
print("pid", os.getpid(), flush=True)
from common import host_memory
host_memory.restart_with_allocator(sys.argv[1])
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 256 * 2**20
faults = []

def allocate_touch_free():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(size)
    ctypes.memset(buffer, 1, size)
    libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

for _ in range(2):
    thread = threading.Thread(target=allocate_touch_free)
    thread.start()
    thread.join()
print("pid", os.getpid())
print("args", *sys.argv[2:])
print("tunables", os.environ.get("GLIBC_TUNABLES", ""))
print("faults", faults[1])
"""

SIZE = 256 * 2**20
SMALL_PAGES = SIZE // 4096  # 65,536
# On huge pages: one fault per 2 MiB page, plus 4 KiB pages at each unaligned end of the mapping.
HUGE_PAGE_FAULTS_AT_MOST = SIZE // 2**21 + 1 + 2 * 511

needs_glibc = pytest.mark.skipif(
    host_memory.allocator_environment("keep_freed", {}) is None, reason="needs Linux with glibc"
)
needs_huge_pages_on_request = pytest.mark.skipif(
    host_memory.allocator_environment("huge_pages", {}) is None,
    reason="needs Linux, glibc >= 2.35 and transparent huge pages in mode 'madvise'",
)


def _run_probe(tmp_path, allocator: str, environment: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Runs _PROBE with `allocator`, in the environment of this process without glibc's tunables."""
    if environment is None:
        environment = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    result = subprocess.run(
        [sys.executable, str(script), allocator, "--flag=1", "two words"],
        cwd=REPO_ROOT,
        env={**environment, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    lines = {}
    for line in result.stdout.splitlines():
        key, *values = line.split(" ", 1)
        lines.setdefault(key, []).append(values[0] if values else "")
    return lines


def _restarted_once_as_the_same_process(probe: dict[str, list[str]]) -> bool:
    # One PID line before the restart, two after; the restart replaces the program, not the process.
    return len(probe["pid"]) == 3 and len(set(probe["pid"])) == 1 and probe["args"] == ["--flag=1 two words"]


@needs_huge_pages_on_request
def test_huge_pages_fault_a_large_buffer_in_2_mib_at_a_time(tmp_path):
    probe = _run_probe(tmp_path, "huge_pages")
    assert _restarted_once_as_the_same_process(probe)
    assert probe["tunables"] == ["glibc.malloc.hugetlb=1"]
    assert int(probe["faults"][0]) <= HUGE_PAGE_FAULTS_AT_MOST + 100  # Slack: the thread's stack, Python.


@needs_glibc
def test_keep_freed_reuses_a_freed_buffer_without_faulting_its_pages_again(tmp_path):
    probe = _run_probe(tmp_path, "keep_freed")
    assert _restarted_once_as_the_same_process(probe)
    assert "glibc.malloc.mmap_max=0" in probe["tunables"][0]
    assert int(probe["faults"][0]) < SMALL_PAGES // 100  # Slack: the thread's stack, Python.


@needs_glibc
def test_mallopt_reuses_a_freed_buffer_without_faulting_its_pages_again_and_without_a_restart(tmp_path):
    probe = _run_probe(tmp_path, "mallopt")
    assert len(probe["pid"]) == 2  # Set in the running process.
    assert probe["tunables"] == [""]
    assert int(probe["faults"][0]) < SMALL_PAGES // 100  # Slack: the thread's stack, Python.


@needs_glibc
def test_glibc_maps_a_large_buffer_anew_and_faults_every_page_each_time(tmp_path):
    # What the other two fix.
    probe = _run_probe(tmp_path, "glibc")
    assert len(probe["pid"]) == 2  # Nothing to change: no restart.
    assert int(probe["faults"][0]) >= SMALL_PAGES


@needs_glibc
def test_the_users_tunables_come_last_so_that_they_win(tmp_path):
    environment = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_max=7"}
    probe = _run_probe(tmp_path, "keep_freed", environment)
    assert _restarted_once_as_the_same_process(probe)
    assert probe["tunables"][0].endswith(":glibc.malloc.mmap_max=7")
    assert int(probe["faults"][0]) >= SMALL_PAGES  # mmap is back: the user's setting took effect.


def test_switching_allocators_drops_what_the_earlier_restart_added(monkeypatch):
    monkeypatch.setattr(host_memory, "_transparent_huge_pages_on_request", lambda: True)
    monkeypatch.setattr(host_memory, "_glibc_version", lambda: (2, 36))
    monkeypatch.setattr(sys, "platform", "linux")
    started = host_memory.allocator_environment("keep_freed", {"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "HOME": "/h"})
    assert host_memory.allocator_environment("keep_freed", started) is None  # Runs with it already.
    assert host_memory.allocator_environment("huge_pages", started) == {
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.pthread.rseq=0",
        "AIAYN_HOST_ALLOCATOR": "huge_pages",
        "HOME": "/h",
    }
    assert host_memory.allocator_environment("glibc", started) == {
        "GLIBC_TUNABLES": "glibc.pthread.rseq=0",
        "HOME": "/h",
    }


@pytest.mark.parametrize(
    "thp_on_request, glibc, platform",
    [(False, (2, 36), "linux"), (True, (2, 34), "linux"), (True, None, "linux"), (True, (2, 36), "darwin")],
)
def test_no_restart_for_huge_pages_where_they_would_change_nothing(monkeypatch, thp_on_request, glibc, platform):
    monkeypatch.setattr(host_memory, "_transparent_huge_pages_on_request", lambda: thp_on_request)
    monkeypatch.setattr(host_memory, "_glibc_version", lambda: glibc)
    monkeypatch.setattr(sys, "platform", platform)
    assert host_memory.allocator_environment("huge_pages", {"HOME": "/h"}) is None


def test_an_unknown_allocator_names_the_config_field():
    with pytest.raises(UserInputError, match=r"config.host_allocator is 'tcmalloc'; choose one of"):
        host_memory.allocator_environment("tcmalloc", {})


def test_train_py_names_an_unknown_allocator_in_one_line(tmp_path):
    result = run_entry_point(
        "train.py", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", "--config.host_allocator=tcmalloc"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: config.host_allocator is 'tcmalloc'; choose one of ('huge_pages', 'keep_freed', 'mallopt', 'glibc')."
    ]
    assert not (tmp_path / "run").exists()
