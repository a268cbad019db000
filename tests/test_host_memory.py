"""Tests for training/host_memory.py: large buffers fault in as huge pages after the restart."""

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from training import host_memory

# Restarts as an entry point does, then allocates, touches and frees a buffer far above glibc's
# largest mmap threshold (32 MiB) from a new thread, as XLA's worker threads allocate a step's
# temporaries, twice, and prints its PID before and after the restart, its arguments and the
# minor page faults of the second round.
_PROBE = """
import ctypes, os, resource, sys, threading
print("pid", os.getpid(), flush=True)
from training import host_memory
host_memory.restart_with_huge_pages()
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
print("args", *sys.argv[1:])
print("tunables", os.environ.get("GLIBC_TUNABLES", ""))
print("faults", faults[1])
"""

SIZE = 256 * 2**20
SMALL_PAGES = SIZE // 4096  # 65,536
# On huge pages: one fault per 2 MiB page, plus 4 KiB pages at each unaligned end of the mapping.
HUGE_PAGE_FAULTS_AT_MOST = SIZE // 2**21 + 1 + 2 * 511

needs_huge_pages_on_request = pytest.mark.skipif(
    host_memory.huge_page_environment({}) is None,
    reason="needs Linux, glibc >= 2.35 and transparent huge pages in mode 'madvise'",
)


def _run_probe(tmp_path, environment: dict[str, str]) -> dict[str, list[str]]:
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    result = subprocess.run(
        [sys.executable, str(script), "--flag=1", "two words"],
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


@needs_huge_pages_on_request
def test_the_restarted_process_faults_a_large_buffer_in_as_huge_pages(tmp_path):
    environment = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    probe = _run_probe(tmp_path, environment)
    assert probe["tunables"] == ["glibc.malloc.hugetlb=1"]
    # The same process (the restart replaces its program, not it), with the same arguments.
    assert len(probe["pid"]) == 3 and len(set(probe["pid"])) == 1
    assert probe["args"] == ["--flag=1 two words"]
    assert int(probe["faults"][0]) <= HUGE_PAGE_FAULTS_AT_MOST + 100  # Slack: the thread's stack, Python.


@needs_huge_pages_on_request
def test_the_users_own_setting_is_kept_and_without_huge_pages_every_small_page_faults(tmp_path):
    probe = _run_probe(tmp_path, {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert probe["tunables"] == ["glibc.malloc.hugetlb=0"]
    assert len(probe["pid"]) == 2  # No restart.
    # What the tunable fixes: glibc maps a buffer this large anew for each allocation.
    assert int(probe["faults"][0]) >= SMALL_PAGES


def test_the_tunable_joins_the_users_other_tunables(monkeypatch):
    monkeypatch.setattr(host_memory, "_transparent_huge_pages_on_request", lambda: True)
    monkeypatch.setattr(host_memory, "_glibc_version", lambda: (2, 36))
    monkeypatch.setattr(sys, "platform", "linux")
    environment = host_memory.huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"})
    assert environment == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "HOME": "/h"}
    assert host_memory.huge_page_environment({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


@pytest.mark.parametrize(
    "thp_on_request, glibc, platform",
    [(False, (2, 36), "linux"), (True, (2, 34), "linux"), (True, None, "linux"), (True, (2, 36), "darwin")],
)
def test_no_restart_where_the_tunable_would_change_nothing(monkeypatch, thp_on_request, glibc, platform):
    monkeypatch.setattr(host_memory, "_transparent_huge_pages_on_request", lambda: thp_on_request)
    monkeypatch.setattr(host_memory, "_glibc_version", lambda: glibc)
    monkeypatch.setattr(sys, "platform", platform)
    assert host_memory.huge_page_environment({"HOME": "/h"}) is None
