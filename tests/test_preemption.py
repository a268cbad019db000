"""Stopping and resuming: SIGTERM and SIGINT save and exit; SIGKILL at any moment loses nothing saved.

A run stopped by a signal, killed at random moments (during saves too) and resumed
each time must end with the very parameters of a run that was never interrupted.
"""

import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import REPO_ROOT, entry_point_env, tiny_config
from test_multi_host import _read, _start_processes, _train_args, _train_args_shortest_evaluation, _wait_all
from test_train_loop import _best, _restore

from common.errors import TrainingStopped
from training import loop
from training.preemption import StopSignals, exit_status
from training.reporting import metric_log
from training.tasks.translation import TranslationTask

_STOPPED = re.compile(  # The one line a stopped run prints: (signal, step, checkpoint folder).
    r"^Stopped by (\S+|a stop signal to one of the processes) after step (\d+), saved in (\S+); "
    r"run the same command to resume\.$"
)


@pytest.mark.parametrize(("signal_number", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_becomes_a_stop_request_and_the_handlers_come_back(signal_number, status):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals(first_step=0) as stop:
        assert not stop.requested(1)
        signal.raise_signal(signal_number)  # Runs the Python handler before returning.
        assert stop.requested(2) and stop.received == signal_number
        signal.raise_signal(signal.SIGTERM)  # More SIGTERMs (a scheduler's, and sweep.py's copy) are the same request.
        assert stop.requested(3) and stop.received == signal_number
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # A second Ctrl-C would end the process at once.
        stopped = stop.stopped(2, "/runs/a/checkpoints")
    assert {s: signal.getsignal(s) for s in before} == before
    assert stopped.exit_status == exit_status(signal_number) == status
    match = _STOPPED.match(str(stopped))
    assert match and match.groups() == (signal.Signals(signal_number).name, "2", "/runs/a/checkpoints")


class _SignalAtStep:
    """Training batches that send this process SIGTERM as step `stop_at` takes its batch."""

    def __init__(self, batches, first_step: int, stop_at: int):
        self._batches, self._step, self._stop_at = batches, first_step, stop_at

    def __iter__(self):
        return self

    def __next__(self):
        self._step += 1
        if self._step == self._stop_at:
            signal.raise_signal(signal.SIGTERM)  # Runs the loop's handler before the step is dispatched.
        return next(self._batches)

    def get_state(self):
        return self._batches.get_state()

    def close(self):
        self._batches.close()


@pytest.mark.slow
def test_a_validation_step_saved_by_a_stop_is_validated_on_resuming(
    small_corpus, tmp_path, monkeypatch, compilation_cache
):
    # Steps 2 and 4 are due for validation; a signal stops the run during each, the second time on the last step.
    config = tiny_config(small_corpus, num_train_steps=4, eval_every_steps=2, checkpoint_every_steps=4)
    config.eval.num_bleu_sentences, config.eval.split = 4, "valid"
    workdir = str(tmp_path / "run")
    train_batches = TranslationTask.train_batches
    for stop_at in (2, 4, None):
        monkeypatch.setattr(
            TranslationTask,
            "train_batches",
            lambda self, config, data, mesh, position, step: _SignalAtStep(
                train_batches(self, config, data, mesh, position, step), step, stop_at
            ),
        )
        if stop_at is None:
            loop.train_and_evaluate(config, workdir)  # No step left: validates step 4, then evaluates.
        else:
            with pytest.raises(TrainingStopped, match=f"after step {stop_at}, saved"):
                loop.train_and_evaluate(config, workdir)
            assert stop_at not in metric_log.read(workdir, "valid")  # Saved, not validated.

    valid = metric_log.read(workdir, "valid")
    assert list(valid) == [2, 4] and all(valid[step]["loss"] is not None for step in valid)
    best_step = max(valid, key=lambda step: valid[step]["bleu"])  # The first of a tie, as the checkpointer keeps.
    assert _best(workdir).step == best_step
    train_steps = [step for step, metrics in metric_log.read(workdir, "train").items() if "num_params" in metrics]
    assert train_steps == [0]  # Written once, not again at each restart.


def _latest_step(workdir: str) -> int:
    """The newest complete checkpoint (Orbax writes <step>.orbax-checkpoint-tmp-* first, then renames it)."""
    folder = os.path.join(workdir, "checkpoints")
    steps = [int(name) for name in os.listdir(folder) if name.isdigit()] if os.path.isdir(folder) else []
    return max(steps, default=0)


def _save_in_flight(workdir: str) -> bool:
    folder = os.path.join(workdir, "checkpoints")
    return os.path.isdir(folder) and any(".orbax-checkpoint-tmp" in name for name in os.listdir(folder))


# Each of the 4 interrupted runs saves 2 to 8 steps (26 at most) and those it runs while its signal waits; the
# last one trains the rest.
_STEPS = 40
_TIMEOUT = 300  # Seconds for any one run; a hang fails the test.


def _args(corpus: str, workdir: str) -> list[str]:
    return [
        "train.py",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--config.dataset.path={corpus}",
        f"--config.num_train_steps={_STEPS}",
        "--config.checkpoint_every_steps=2",  # Saves are in flight most of the time.
        "--config.keep_checkpoints=2",
        "--config.eval_every_steps=100000",
        "--config.eval.split=valid",
        "--config.eval.num_bleu_sentences=0",
        "--config.dataset.bucket_boundaries=(32,)",  # One shape: one compilation.
    ]


def _start(corpus: str, workdir: str, log_path: str) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, *_args(corpus, workdir)],
            cwd=REPO_ROOT,
            env=entry_point_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _interrupt(process: subprocess.Popen, workdir: str, signal_number: int, steps: int, delay: float | None) -> None:
    """Sends the signal once the run has saved `steps` more steps, `delay` s later (None: when a save is in flight)."""
    deadline = time.monotonic() + _TIMEOUT
    target = _latest_step(workdir) + steps
    while _latest_step(workdir) < target:  # Counted in steps, not seconds: the same on any machine.
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
        time.sleep(0.005)
    if delay is None:
        while not _save_in_flight(workdir):
            assert process.poll() is None and time.monotonic() < deadline, "the run ended before a save was seen"
            time.sleep(0.002)
    else:
        time.sleep(delay)
    assert process.poll() is None, "the run ended before the signal"
    process.send_signal(signal_number)


@pytest.mark.slow
def test_runs_killed_at_random_moments_and_resumed_end_with_the_uninterrupted_parameters(small_corpus, tmp_path):
    started = time.monotonic()
    straight, interrupted = str(tmp_path / "straight"), str(tmp_path / "interrupted")
    reference = _start(small_corpus, straight, str(tmp_path / "straight.log"))  # Alongside the others.
    rng = np.random.default_rng(8)
    rounds = [  # (signal, steps saved first, then seconds to wait or None: the moment a save is in flight)
        (signal.SIGKILL, 2, None),
        (signal.SIGKILL, 2 * rng.integers(1, 5), rng.uniform(0.0, 0.05)),
        (signal.SIGTERM, 2 * rng.integers(1, 5), rng.uniform(0.0, 0.05)),
        (signal.SIGKILL, 2 * rng.integers(1, 5), rng.uniform(0.0, 0.05)),
    ]
    try:
        for i, (signal_number, steps, delay) in enumerate(rounds):
            log = str(tmp_path / f"round_{i}.log")
            process = _start(small_corpus, interrupted, log)
            try:
                _interrupt(process, interrupted, signal_number, steps, delay)
                returncode = process.wait(timeout=_TIMEOUT)
            finally:
                _wait_all([process], time.monotonic())
            print(
                f"round {i}: {signal.Signals(signal_number).name}, exit {returncode}, latest step "
                f"{_latest_step(interrupted)}"
            )
            if signal_number == signal.SIGKILL:
                assert returncode == -signal.SIGKILL
            else:
                last_line = _read(log).strip().splitlines()[-1]
                assert returncode == 143, _read(log)[-3000:]
                match = _STOPPED.match(last_line)
                assert match and match[1] == "SIGTERM", last_line
                assert _latest_step(interrupted) == int(match[2])
                assert "Traceback" not in _read(log)
        final = _start(small_corpus, interrupted, str(tmp_path / "final.log"))
        assert _wait_all([final], time.monotonic() + _TIMEOUT) == [0], _read(str(tmp_path / "final.log"))[-3000:]
    finally:
        reference_returncode = _wait_all([reference], time.monotonic() + _TIMEOUT)
    assert reference_returncode == [0], _read(str(tmp_path / "straight.log"))[-3000:]
    print(f"{len(rounds)} interruptions and the uninterrupted run: {time.monotonic() - started:.0f} s")

    config = tiny_config(small_corpus)
    state_a, data_a = _restore(config, straight, _STEPS)
    state_b, data_b = _restore(config, interrupted, _STEPS)
    assert data_a == data_b
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state_a), jax.device_get(state_b))


@pytest.mark.slow
def test_two_processes_stop_at_the_same_step_when_one_gets_sigterm(small_corpus, tmp_path):
    workdir = str(tmp_path / "run")
    deadline = time.monotonic() + 600
    # 2 devices a process: tests/test_multi_host.py's programs, shared through train.py's compilation cache.
    processes = _start_processes(_train_args(small_corpus, workdir, 100_000), 2, 2, str(tmp_path / "stop"))
    logs = [str(tmp_path / f"stop.{i}.log") for i in range(2)]
    try:
        while "] train: loss=" not in _read(logs[0]):  # Both are training.
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), _read(logs[0])[-3000:]
            time.sleep(0.2)
        processes[1].send_signal(signal.SIGTERM)
        returncodes = _wait_all(processes, deadline)
    finally:
        _wait_all(processes, time.monotonic())
    last_lines = [_read(log).strip().splitlines()[-1] for log in logs]
    assert returncodes == [143, 143], "\n\n".join(_read(log)[-3000:] for log in logs)
    matches = [_STOPPED.match(line) for line in last_lines]
    assert all(matches), last_lines
    step = int(matches[0][2])
    assert int(matches[1][2]) == step and step % 1000  # Not a regular checkpoint step.
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [str(step)]

    # The run resumes from that step in both processes (told to stop two steps later, its evaluation cut short).
    resume = _train_args_shortest_evaluation(small_corpus, workdir, step + 2)
    processes = _start_processes(resume, 2, 2, str(tmp_path / "resume"))
    assert _wait_all(processes, deadline) == [0, 0], _read(str(tmp_path / "resume.0.log"))[-3000:]
    assert f"Resumed from step {step} " in _read(str(tmp_path / "resume.0.log"))
    state, _ = _restore(tiny_config(small_corpus), workdir, step + 2)
    assert int(state.step) == step + 2
