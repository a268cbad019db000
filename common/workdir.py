"""A run's workdir: the one place its layout is spelled out (`Workdir`), and one training run per workdir.

One training run per workdir: a kernel lock on <workdir>/train.lock, held while the run lives.

The lock is `fcntl.flock` on an open file, so the kernel releases it when the
holder exits in any way, SIGKILL and crashes included: a lock file left behind
never blocks the next run. The file also holds the holder's host, pid and start
time, for the message a second run prints. Only process 0 of a multi-process
run takes it (the other processes belong to the same run).

Network filesystems: flock works on local disks and on NFS (Linux emulates it
with POSIX locks); where the filesystem has no locks, training goes on with a
warning.
"""

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import os
import socket
from collections.abc import Iterator

from absl import logging

from common.errors import UserInputError

ATTENTION_PAGE_FILE = "attention.html"  # In each evaluation folder: the first sentence's attention, to explore.
SCORES_FILE = "scores.json"  # In each evaluation folder: what evaluating the split scored.


@dataclasses.dataclass(frozen=True)
class Workdir:
    """The paths of a run's files under its workdir `root`."""

    root: str

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def config(self) -> str:
        """The run's config as JSON, read by translate.py, classify.py and later evaluation."""
        return self._path("config.json")

    @property
    def tokenizer(self) -> str:
        """The SentencePiece model, trained on the first run."""
        return self._path("tokenizer.model")

    @property
    def labels(self) -> str:
        """A classifier's training labels, one 'label<TAB>count in train' line each, in class-id order."""
        return self._path("labels.tsv")

    @property
    def attempts(self) -> str:
        """One JSON line per training attempt (a resumed run adds one): its code, devices and seconds per phase."""
        return self._path("attempts.jsonl")

    @property
    def lock(self) -> str:
        """Held by the training run while it lives."""
        return self._path("train.lock")

    @property
    def tfds(self) -> str:
        """Where local corpora are prepared as ArrayRecord files, unless config.dataset.data_dir says otherwise."""
        return self._path("tfds")

    # Checkpoint folders are absolute: Orbax requires it.
    @property
    def checkpoints(self) -> str:
        """The rotation of full training states, one folder a step."""
        return os.path.join(os.path.abspath(self.root), "checkpoints")

    @property
    def best_checkpoint(self) -> str:
        """The parameters of the step with the best validation score."""
        return os.path.join(os.path.abspath(self.root), "best_checkpoint")

    @property
    def damaged_checkpoints(self) -> str:
        """Damaged steps moved out of the rotation, never deleted."""
        return os.path.join(os.path.abspath(self.root), "damaged_checkpoints")

    def averaged(self, steps: tuple[int, ...]) -> str:
        """Where the mean parameters of `steps` are saved: averaged/<N>_<last step>."""
        return os.path.join(os.path.abspath(self.root), "averaged", f"{len(steps)}_{steps[-1]}")

    def tensorboard(self, name: str) -> str:
        """TensorBoard events of `name`: 'train', 'valid', 'eval_<split>'."""
        return self._path("tensorboard", name)

    def metrics(self, name: str) -> str:
        """JSON lines of the scalars logged as `name` ('train', 'valid')."""
        return self._path("metrics", f"{name}.jsonl")

    @property
    def evaluations(self) -> str:
        """The folder of every evaluated split's folder."""
        return self._path("eval")

    def evaluation(self, split: str) -> str:
        """What evaluating `split` writes: its scores, outputs and figures."""
        return os.path.join(self.evaluations, split)

    def scores(self, split: str) -> str:
        """The scores of the latest evaluation of `split`."""
        return os.path.join(self.evaluation(split), SCORES_FILE)

    def attention_page(self, split: str) -> str:
        """The interactive attention page of the latest evaluation of `split` (its first sentence)."""
        return os.path.join(self.evaluation(split), ATTENTION_PAGE_FILE)


def _missing_folders(path: str) -> list[str]:
    """The folders `os.makedirs(path)` would create, outermost first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing[::-1]


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "a process that is starting"
    except OSError:
        return "another process"


def _lock_file(path: str) -> int:
    """An open descriptor of `path`, exclusively flock-ed.

    The holder unlinks the file on release; a run that opened the old file just
    before would lock a file no longer in the folder, so the lock is taken again
    until the locked file is the one at `path`.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserInputError(
                f"{os.path.dirname(path)} is in use by another training run ({_holder(path)}; lock {path}). "
                "Wait for it to finish or stop it, or train in another --workdir."
            ) from None
        except OSError:
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextlib.contextmanager
def training_lock(workdir: str) -> Iterator[None]:
    """Holds the workdir's training lock for the block, creating the workdir if needed.

    On leaving the block the lock file is removed, and so are the folders it
    created if they are still empty (a run stopped by bad data leaves no trace).

    Raises:
        UserInputError: another process holds the lock (the message names its
            host, pid and start time).
    """
    created = _missing_folders(workdir)
    os.makedirs(workdir, exist_ok=True)
    path = Workdir(workdir).lock
    fd = None
    try:
        try:
            fd = _lock_file(path)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            logging.warning("Cannot lock %s (%s): nothing stops a second run in this workdir.", path, e.strerror)
        if fd is not None:
            since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            os.ftruncate(fd, 0)
            os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {since}\n".encode())
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)  # Before the unlock: a waiting run then retries on a fresh file.
            os.close(fd)
        for folder in reversed(created):
            try:
                os.rmdir(folder)  # Only if empty.
            except OSError:
                break
