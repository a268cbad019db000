"""The train.py processes of a sweep: prepared data, N at a time, each one's output in its log, stop signals passed on.

`prepare` prepares the dataset and trains the tokenizer once for the whole sweep (train.py
--mode=prepare under <root>/prepared; a ledger's tokenizer where it has one). `run_all` then skips
the finished runs (sweeps/runner.py, or the ledger: sweeps/ledger.py), starts the others `jobs` at
a time in the sweep's order, each with its own CPU cores or GPUs (`slot_environment`) and the
tokenizer in its workdir, writes each one's output to <workdir>/train.log, copies each finished run
into the ledger, goes on past a run that fails, naming why from its log, and starts no run whose
predicted time exceeds what is left of the budget (sweeps/budget.py). A stop signal to the sweep is
passed to the runs in progress, which save a checkpoint and stop (training/preemption.py);
running the sweep again continues it.
"""

import ctypes
import dataclasses
import datetime
import functools
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from common.errors import UserInputError
from common.workdir import Workdir
from sweeps.ledger import Ledger, LedgerMismatch, Pins, file_sha256
from sweeps.runner import (
    Run,
    Sweep,
    changed_config,
    command,
    config_changes,
    is_finished,
    prepare_command,
    prepared_folder,
)
from training.reporting import attempts as attempts_log

if TYPE_CHECKING:  # The budget counts FLOPs with the model (JAX); the runner itself imports no JAX.
    from sweeps.budget import Budget

LOG_NAME = "train.log"
PREPARE_LOG_NAME = "prepare.log"  # In <root>/prepared.
_POLL_SECONDS = 0.5  # How often the sweep looks at its runs in progress.


class SweepStopped(Exception):
    """A stop signal came; the runs in progress saved their step (train.py) and the sweep stops."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


@dataclasses.dataclass
class Outcome:
    """What `run_all` did: runs trained to the end, skipped as finished, failed (with why), and left for
    later as over the budget (with their predicted seconds)."""

    finished: list[Run] = dataclasses.field(default_factory=list)
    skipped: list[Run] = dataclasses.field(default_factory=list)
    failed: list[tuple[Run, str]] = dataclasses.field(default_factory=list)
    deferred: list[tuple[Run, float | None]] = dataclasses.field(default_factory=list)


def prepare(sweep: Sweep, root: str, ledger: Ledger | None) -> None:
    """Prepares the sweep's dataset and tokenizer once under <root>/prepared, with the ledger's tokenizer if any.

    Raises:
        UserInputError: the preparation failed (its `error:` line and log), or the machine, the code or the
            tokenizer differ from what the ledger pins (LedgerMismatch), before any run has trained.
    """
    prepared = Workdir(prepared_folder(root))
    os.makedirs(prepared.root, exist_ok=True)
    if ledger is not None and os.path.exists(ledger.tokenizer) and not os.path.exists(prepared.tokenizer):
        shutil.copyfile(ledger.tokenizer, prepared.tokenizer)
    log_path = os.path.join(prepared.root, PREPARE_LOG_NAME)
    with open(log_path, "a", encoding="utf-8") as log:
        args = prepare_command(sweep, root)
        log.write(f"{_LOG_HEADER}{_now()}: {shlex.join(args)}\n")
        log.flush()
        status = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if status:
        raise UserInputError(f"Preparing the sweep's data failed ({_describe(status)}): {_last_error(log_path)}")
    if ledger is not None:
        environment = attempts_log.read(prepared.attempts)[-1]
        ledger.check(Pins.of_attempt(environment, file_sha256(prepared.tokenizer)), "This machine")
        ledger.store_tokenizer(prepared.tokenizer)


def slot_environment(slot: int, jobs: int, cores: Sequence[int], gpus: Sequence[str]) -> tuple[dict, list[int]]:
    """The environment variables and CPU cores of the run in `slot` (0 .. jobs - 1) of `jobs` at once.

    With a GPU for each job, each gets its own share (CUDA_VISIBLE_DEVICES); with fewer, they share them, each
    allocating as it needs instead of JAX's default 75% of the memory. Without GPUs, each gets its own cores
    (XLA's CPU thread pool takes the cores it may run on). One job keeps everything.
    """
    if jobs == 1:
        return {}, list(cores)
    if len(gpus) >= jobs:
        share = len(gpus) // jobs
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[slot * share : (slot + 1) * share])}, list(cores)
    if gpus:
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, list(cores)
    share = max(1, len(cores) // jobs)
    return {}, list(cores[(slot * share) % len(cores) :][:share])


def visible_gpus() -> list[str]:
    """The NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi's list); [] without."""
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [gpu for gpu in visible.split(",") if gpu.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]


@dataclasses.dataclass
class _Running:
    """A run whose train.py is in progress, in slot `slot`."""

    index: int
    run: Run
    config: object
    child: subprocess.Popen
    slot: int
    started: float
    fresh: bool  # Started from step 0, not resumed: its wall time is a whole run's (the budget's measure).


def run_all(
    sweep: Sweep,
    runs: Sequence[Run],
    root: str,
    *,
    ledger: Ledger | None = None,
    jobs: int = 1,
    budget: "Budget | None" = None,
    echo: Callable[[str], None] = print,
) -> Outcome:
    """Trains every unfinished run, `jobs` train.py processes at a time; see the module docstring.

    Raises:
        SweepStopped: SIGINT or SIGTERM came; it was passed on to the runs in progress, which saved their step.
    """
    with _ForwardedSignals() as signals:
        return _Scheduler(sweep, runs, root, ledger, jobs, budget, echo, signals).run()


@dataclasses.dataclass
class _Scheduler:
    """`run_all`'s state: the runs not looked at yet, those in progress by slot, and the outcome so far."""

    sweep: Sweep
    runs: Sequence[Run]
    root: str
    ledger: Ledger | None
    jobs: int
    budget: "Budget | None"
    echo: Callable[[str], None]
    signals: "_ForwardedSignals"
    outcome: Outcome = dataclasses.field(default_factory=Outcome)
    running: dict[int, _Running] = dataclasses.field(default_factory=dict)
    interrupted: list[str] = dataclasses.field(default_factory=list)  # The runs a stop signal ended.

    def run(self) -> Outcome:
        pending = list(enumerate(self.runs, 1))
        while pending or self.running:
            while pending and len(self.running) < self.jobs and self.signals.received is None:
                self._admit(*pending.pop(0))
            self._reap()
            if self.signals.received is not None and not self.running:
                if self.interrupted:
                    raise self.signals.stopped(f"during {', '.join(self.interrupted)}")
                raise self.signals.stopped(f"before {pending[0][1].label}" if pending else "after the last run")
            if self.running:
                time.sleep(_POLL_SECONDS)
        return self.outcome

    def _say(self, index: int, run: Run, what: str) -> None:
        self.echo(f"[{index}/{len(self.runs)}] {run.label}: {what}")

    def _fail(self, index: int, run: Run, why: str) -> None:
        self.outcome.failed.append((run, why))
        self._say(index, run, f"FAILED ({why})")

    def _admit(self, index: int, run: Run) -> None:
        """Skips, fails, defers or starts `run`."""
        try:
            config = self.sweep.run_config(run)
        except UserInputError as e:
            self._fail(index, run, f"its config cannot be built: {e}")
            return
        if self.ledger is not None and self.ledger.has(run):
            self.outcome.skipped.append(run)
            self._say(index, run, "in the ledger, skipped.")
        elif changes := config_changes(config, run.workdir):
            self._fail(index, run, changed_config(self.sweep, run, changes))
        elif is_finished(config, run.workdir):
            self._keep(index, run, self.outcome.skipped, "finished before, skipped")
        elif self.budget is not None and not (fits := self.budget.allows(config))[0]:
            self.outcome.deferred.append((run, fits[1]))
            left = self.budget.left() / 60
            self._say(index, run, f"left for later: ~{fits[1] / 60:.0f} min predicted, {left:.0f} left.")
        else:
            slot = min(set(range(self.jobs)) - set(self.running))
            self._say(index, run, f"training in {run.workdir} (log: {_log_path(run)})")
            cores, gpus = sorted(os.sched_getaffinity(0)), visible_gpus()
            fresh = not _has_checkpoint(run)
            child = _start(self.sweep, run, self.root, *slot_environment(slot, self.jobs, cores, gpus))
            self.running[slot] = _Running(index, run, config, child, slot, time.monotonic(), fresh)
            self.signals.children.add(child)
            if self.signals.received is not None:  # It came while train.py was starting.
                self.signals.forward(child)

    def _reap(self) -> None:
        """Takes in the runs whose train.py has ended."""
        for slot, job in list(self.running.items()):
            if (status := job.child.poll()) is None:
                continue
            del self.running[slot]
            self.signals.children.discard(job.child)
            if self.signals.received is not None:
                self.interrupted.append(f"{job.run.label} (train.py: {_describe(status)}; log: {_log_path(job.run)})")
            elif status == 0 and is_finished(job.config, job.run.workdir):
                if self.budget is not None and job.fresh:
                    self.budget.observe(job.config, time.monotonic() - job.started)
                self._keep(job.index, job.run, self.outcome.finished, "finished")
            else:
                why = _describe(status) if status else "exit status 0 but no final scores"
                self._fail(job.index, job.run, f"{why}: {_last_error(_log_path(job.run))}; log: {_log_path(job.run)}")

    def _keep(self, index: int, run: Run, done: list[Run], what: str) -> None:
        """A finished run: copied into the ledger (if any), then counted in `done`."""
        if self.ledger is not None:
            try:
                self.ledger.add(run, self.sweep.run_config(run).eval.split)
            except LedgerMismatch as e:
                self._fail(index, run, str(e))
                return
            what += "; copied into the ledger"
        done.append(run)
        self._say(index, run, what + ".")


_LOG_HEADER = "# sweep.py, "  # Opens each attempt's part of a run's log.
_PR_SET_PDEATHSIG = 1  # prctl(2)


def _has_checkpoint(run: Run) -> bool:
    checkpoints = Workdir(run.workdir).checkpoints
    return os.path.isdir(checkpoints) and any(name.isdigit() for name in os.listdir(checkpoints))


def _log_path(run: Run) -> str:
    return os.path.join(run.workdir, LOG_NAME)


def provide_tokenizer(run: Run, root: str) -> None:
    """Puts the sweep's tokenizer (`prepare`) in the run's workdir, where train.py reads it, if it has none."""
    workdir, shared = Workdir(run.workdir), Workdir(prepared_folder(root)).tokenizer
    os.makedirs(workdir.root, exist_ok=True)
    if not os.path.exists(workdir.tokenizer) and os.path.exists(shared):
        shutil.copyfile(shared, workdir.tokenizer)


def _start(sweep: Sweep, run: Run, root: str, environment: dict, cores: list[int]) -> subprocess.Popen:
    """Starts train.py for `run` on `cores` with `environment` added, its output appended to its log."""
    provide_tokenizer(run, root)
    args = command(sweep, run, root)
    with open(_log_path(run), "a", encoding="utf-8") as log:
        log.write(f"{_LOG_HEADER}{_now()}: {shlex.join(args)}\n")
        log.flush()
        # Its own session: a Ctrl-C in the terminal reaches the sweep only, which passes it on
        # once (a second Ctrl-C would end train.py at once, without saving). Progress bars
        # every 30 s: the log is a file.
        return subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_set_up_child, os.getpid(), cores),
            env={**os.environ, "TQDM_MININTERVAL": "30", **environment},
        )


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _set_up_child(parent: int, cores: list[int]) -> None:
    """In train.py's process before it starts: its CPU cores, and SIGTERM when the sweep dies."""
    os.sched_setaffinity(0, cores)
    _stop_when_parent_dies(parent)


def _stop_when_parent_dies(parent: int) -> None:
    """In train.py's process before it starts: SIGTERM it (a clean stop) if the sweep dies.

    Else a sweep killed outright (SIGKILL, the out-of-memory killer) would leave train.py
    training, its workdir locked against the same sweep command run again. Linux only.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # Not Linux.
        return
    if os.getppid() != parent:  # The sweep died before prctl: no signal will come.
        os.kill(os.getpid(), signal.SIGTERM)


def _describe(status: int) -> str:
    """'exit status 2', or 'killed by SIGKILL' (Popen's negative status)."""
    return f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"


def _last_error(log_path: str) -> str:
    """The log's last `error:` line, or else its last line: why a run failed, in a line."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    except OSError:
        return "no log"
    # The log holds every attempt of the run, each after its '# sweep.py' header: only the last one's lines count.
    lines = lines[max((i for i, line in enumerate(lines) if line.startswith(_LOG_HEADER)), default=0) :]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["empty log"])[-1]


class _ForwardedSignals:
    """A context in which SIGINT and SIGTERM are passed on to the train.py processes in progress.

    train.py saves its step and stops on the first signal and ends at once on a second one,
    so each signal the sweep gets is passed on once to each. The previous handlers come back on leaving.
    """

    def __init__(self):
        self.children: set[subprocess.Popen] = set()
        self.received: int | None = None
        self._forwarded: set[subprocess.Popen] = set()  # The train.py processes sent the signal.
        self._previous = {}

    def __enter__(self) -> "_ForwardedSignals":
        for signal_number in (signal.SIGINT, signal.SIGTERM):
            self._previous[signal_number] = signal.signal(signal_number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signal_number, handler in self._previous.items():
            signal.signal(signal_number, handler)

    def forward(self, child: subprocess.Popen) -> None:
        """Passes the signal received on to `child`, once."""
        if child not in self._forwarded and child.poll() is None:
            child.send_signal(self.received)
            self._forwarded.add(child)

    def stopped(self, where: str) -> SweepStopped:
        """The exception that stops the sweep after the signal received; `where`: 'during heads_1/seed_0 (...)'."""
        name = signal.Signals(self.received).name
        return SweepStopped(f"Stopped by {name} {where}; run the same command to continue.", 128 + self.received)

    def _handle(self, signal_number: int, frame) -> None:
        del frame
        self.received = self.received or signal_number
        for child in list(self.children):
            self.forward(child)
