"""One training run per workdir: a second one stops at once naming the first; a killed run blocks nothing."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO_ROOT, entry_point_env, run_entry_point
from test_bad_input import assert_clean_failure, snapshot

from common.errors import UserInputError
from common.workdir import Workdir, training_lock

# Holds the lock of sys.argv[1] until killed.
_HOLD_LOCK = """
import sys, time
from common.workdir import training_lock
with training_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def start_lock_holder(workdir: str) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, workdir], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "locked\n"
    return holder


def test_second_lock_names_the_holder(tmp_path):
    workdir = str(tmp_path / "run")
    with training_lock(workdir):
        with open(Workdir(workdir).lock) as f:
            assert f.read().startswith(f"host {socket.gethostname()}, pid {os.getpid()}, since ")
        # flock locks belong to open files: a second open in the same process conflicts too.
        with pytest.raises(UserInputError) as error:
            with training_lock(workdir):
                pass
    message = str(error.value)
    assert f"{workdir} is in use by another training run (host {socket.gethostname()}, pid {os.getpid()}" in message
    assert "\n" not in message
    with training_lock(workdir):  # Released on leaving the block.
        pass


def test_lock_of_a_killed_process_blocks_nothing(tmp_path):
    workdir = str(tmp_path / "run")
    holder = start_lock_holder(workdir)
    with pytest.raises(UserInputError, match=f"pid {holder.pid}, since"):
        with training_lock(workdir):
            pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock_path = Workdir(workdir).lock
    with open(lock_path) as f:
        assert f"pid {holder.pid}," in f.read()  # Left behind, still naming the dead holder...
    with training_lock(workdir):  # ...but the kernel released its lock.
        with open(lock_path) as f:
            assert f"pid {os.getpid()}," in f.read()
    assert not os.path.exists(lock_path)


def test_lock_leaves_no_trace(tmp_path):
    """A failed run removes its lock file and the folders it created, and nothing else."""
    new = tmp_path / "a" / "b" / "run"
    with pytest.raises(UserInputError):
        with training_lock(str(new)):
            raise UserInputError("bad data")
    assert not (tmp_path / "a").exists()

    existing = tmp_path / "existing"
    (existing / "notes").mkdir(parents=True)
    before = snapshot(existing)
    with training_lock(str(existing)):
        assert os.path.exists(Workdir(str(existing)).lock)
    assert snapshot(existing) == before

    kept = tmp_path / "kept" / "run"
    with training_lock(str(kept)):
        (kept / "tokenizer.model").write_text("x")  # A run that wrote something keeps its folder.
    assert os.listdir(kept) == ["tokenizer.model"]


@pytest.mark.slow
def test_second_trainer_stops_at_once_and_a_killed_one_blocks_nothing(tmp_path, small_corpus):
    """Two real train.py on one fresh workdir: the second stops before preparing data (which, racing
    the first's TFDS preparation, used to crash); after the first is SIGKILLed, the next run trains."""
    workdir = str(tmp_path / "run")
    common = ["--config=configs/tiny.py", f"--workdir={workdir}", f"--config.dataset.path={small_corpus}"]
    # Long enough to be still running; no checkpoint before it is killed.
    first = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            *common,
            "--config.num_train_steps=100000",
            "--config.checkpoint_every_steps=100000",
        ],
        cwd=REPO_ROOT,
        env=entry_point_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        lock_path = Workdir(workdir).lock
        deadline = time.monotonic() + 120
        while not (os.path.exists(lock_path) and open(lock_path).read()):
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not take the lock"
            time.sleep(0.2)
        second = run_entry_point("train.py", *common)
        assert_clean_failure(
            second,
            f"{workdir} is in use by another training run",
            f"host {socket.gethostname()}, pid {first.pid}, since",
        )
        assert first.poll() is None  # Undisturbed.
    finally:
        first.kill()
        first.wait()
    assert os.path.exists(lock_path)  # Left by the killed run.
    third = run_entry_point("train.py", *common, "--config.num_train_steps=2")
    assert third.returncode == 0, third.stderr[-3000:]
    assert not os.path.exists(lock_path)
