"""Tests for training/host_memory.py: freed host memory is reused without page faults."""

import subprocess
import sys

import pytest
from conftest import REPO_ROOT

# Allocates, touches and frees a buffer far above glibc's largest mmap threshold (32 MiB)
# from a new thread, as XLA's worker threads allocate a step's temporaries, then does it
# again and prints the minor page faults of the second round.
_PROBE = """
import ctypes, resource, sys, threading
from training import host_memory
applied = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else False
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
print(applied, faults[1])
"""

PAGES = 256 * 2**20 // 4096


def _second_round_faults(mode: str) -> tuple[bool, int]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    applied, faults = result.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_a_freed_buffer_is_reused_without_faulting_its_pages_again():
    applied, faults = _second_round_faults("keep")
    assert applied
    # Reused memory faults no page; a little slack for the thread's own stack and Python's objects.
    assert faults < PAGES // 100


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_without_the_settings_every_round_faults_its_pages():
    # What the settings fix: glibc maps a buffer this large anew for each allocation.
    applied, faults = _second_round_faults("default")
    assert not applied
    assert faults >= PAGES
