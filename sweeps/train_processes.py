"""The train.py processes of a sweep: one at a time, each one's output in its log, stop signals passed on.

`run_all` skips the finished runs (sweeps/runner.py says which), starts the others one at a
time, writes each one's output to <workdir>/train.log, and goes on past a run that fails,
naming why from its log. A stop signal to the sweep is passed to the run in progress, which
saves a checkpoint and stops (training/preemption.py); running the sweep again continues it.
"""

import ctypes
import dataclasses
import datetime
import functools
import os
import shlex
import signal
import subprocess
from collections.abc import Callable, Sequence

from common.errors import UserInputError
from sweeps.runner import Run, Sweep, changed_config, command, config_changes, is_finished

LOG_NAME = "train.log"


class SweepStopped(Exception):
    """A stop signal came; the run in progress saved its step (train.py) and the sweep stops."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


@dataclasses.dataclass
class Outcome:
    """What `run_all` did: runs trained to the end, skipped as finished, and failed (with why)."""

    finished: list[Run] = dataclasses.field(default_factory=list)
    skipped: list[Run] = dataclasses.field(default_factory=list)
    failed: list[tuple[Run, str]] = dataclasses.field(default_factory=list)


def run_all(sweep: Sweep, runs: Sequence[Run], *, echo: Callable[[str], None] = print) -> Outcome:
    """Trains every unfinished run, one train.py process at a time; see the module docstring.

    Raises:
        SweepStopped: SIGINT or SIGTERM came; it was passed on to the run in progress, which saved its step.
    """
    outcome = Outcome()
    with _ForwardedSignals() as signals:
        for index, run in enumerate(runs, 1):
            if signals.received is not None:  # Between two runs.
                raise signals.stopped(f"before {run.label}")
            try:
                config = sweep.run_config(run)
            except UserInputError as e:
                outcome.failed.append((run, f"its config cannot be built: {e}"))
                echo(f"[{index}/{len(runs)}] {run.label}: FAILED, its config cannot be built: {e}")
                continue
            if changes := config_changes(config, run.workdir):
                outcome.failed.append((run, changed_config(sweep, run, changes)))
                echo(f"[{index}/{len(runs)}] {run.label}: FAILED, {outcome.failed[-1][1]}")
                continue
            if is_finished(config, run.workdir):
                outcome.skipped.append(run)
                echo(f"[{index}/{len(runs)}] {run.label}: finished before, skipped.")
                continue
            echo(f"[{index}/{len(runs)}] {run.label}: training in {run.workdir} (log: {_log_path(run)})")
            status = _train(sweep, run, signals)
            if signals.received is not None:
                raise signals.stopped(f"during {run.label} (train.py: {_describe(status)}; log: {_log_path(run)})")
            if status == 0 and is_finished(config, run.workdir):
                outcome.finished.append(run)
                echo(f"[{index}/{len(runs)}] {run.label}: finished.")
                continue
            why = _describe(status) if status else "exit status 0 but no final scores"
            outcome.failed.append((run, f"{why}: {_last_error(_log_path(run))}; log: {_log_path(run)}"))
            echo(f"[{index}/{len(runs)}] {run.label}: FAILED ({outcome.failed[-1][1]})")
    return outcome


_LOG_HEADER = "# sweep.py, "  # Opens each attempt's part of a run's log.
_PR_SET_PDEATHSIG = 1  # prctl(2)


def _log_path(run: Run) -> str:
    return os.path.join(run.workdir, LOG_NAME)


def _train(sweep: Sweep, run: Run, signals: "_ForwardedSignals") -> int:
    """Runs train.py for `run`, its output appended to its log; returns its exit status."""
    os.makedirs(run.workdir, exist_ok=True)
    args = command(sweep, run)
    with open(_log_path(run), "a", encoding="utf-8") as log:
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        log.write(f"{_LOG_HEADER}{started}: {shlex.join(args)}\n")
        log.flush()
        # Its own session: a Ctrl-C in the terminal reaches the sweep only, which passes it on
        # once (a second Ctrl-C would end train.py at once, without saving). Progress bars
        # every 30 s: the log is a file.
        child = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_stop_when_parent_dies, os.getpid()),
            env={**os.environ, "TQDM_MININTERVAL": "30"},
        )
        signals.child = child
        if signals.received is not None and not signals.forwarded:  # It came while train.py was starting.
            child.send_signal(signals.received)
            signals.forwarded = True
        try:
            return child.wait()
        finally:
            signals.child = None


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
    """A context in which SIGINT and SIGTERM are passed on to the train.py process in progress.

    train.py saves its step and stops on the first signal and ends at once on a second one,
    so each signal the sweep gets is passed on once. The previous handlers come back on leaving.
    """

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.received: int | None = None
        self.forwarded = False  # Whether the train.py in progress has been sent the signal.
        self._previous = {}

    def __enter__(self) -> "_ForwardedSignals":
        for signal_number in (signal.SIGINT, signal.SIGTERM):
            self._previous[signal_number] = signal.signal(signal_number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signal_number, handler in self._previous.items():
            signal.signal(signal_number, handler)

    def stopped(self, where: str) -> SweepStopped:
        """The exception that stops the sweep after the signal received; `where`: 'during heads_1/seed_0 (...)'."""
        name = signal.Signals(self.received).name
        return SweepStopped(f"Stopped by {name} {where}; run the same command to continue.", 128 + self.received)

    def _handle(self, signal_number: int, frame) -> None:
        del frame
        self.received = self.received or signal_number
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signal_number)
            self.forwarded = True
