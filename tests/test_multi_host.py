"""Several processes as one run (jax.distributed on localhost, CPU devices), through train.py.

Two processes with 2 devices each must train exactly as one process with 4
devices: the same global batches, so the same losses and parameters, and a
checkpoint that one process restores. If one process dies, the other must stop
with an error instead of waiting for it forever.
"""

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO_ROOT, tiny_config
from test_train_loop import _restore
from tolerances import loss_rtol

from models.build import make_model

pytestmark = pytest.mark.slow

_TIMEOUT = 600  # Seconds for any one run (slow on a loaded 2-core machine): a hang fails the test.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], devices: int, log_path: str) -> subprocess.Popen:
    """train.py in a subprocess on `devices` CPU devices, stdout and stderr to `log_path`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("XLA_FLAGS", None)
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "train.py", *args], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def _start_processes(args: list[str], num_processes: int, devices: int, log_prefix: str) -> list[subprocess.Popen]:
    coordinator = f"--coordinator_address=127.0.0.1:{_free_port()}"
    return [
        _start(
            [*args, coordinator, f"--num_processes={num_processes}", f"--process_id={i}"],
            devices,
            f"{log_prefix}.{i}.log",
        )
        for i in range(num_processes)
    ]


def _wait_all(processes: list[subprocess.Popen], deadline: float) -> list[int]:
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _train_losses(workdir: str) -> dict[int, float]:
    """{step: loss} from the run's TensorBoard event files."""
    losses = {}
    for path in glob.glob(os.path.join(workdir, "tensorboard", "train", "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == "loss":
                    losses[event.step] = value.simple_value
    return losses


def _train_args(corpus: str, workdir: str, steps: int) -> list[str]:
    return [
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--config.dataset.path={corpus}",
        f"--config.num_train_steps={steps}",
        "--config.dataset.bucket_boundaries=(32,)",  # One shape: one compilation of each step.
        "--config.log_every_steps=1",
        "--config.eval_every_steps=1000",
        "--config.checkpoint_every_steps=1000",
        "--config.eval.split=valid",
        "--config.eval.num_bleu_sentences=8",
    ]


def test_two_processes_train_and_resume_like_one_with_as_many_devices(small_corpus, tmp_path):
    """Two processes x 2 devices train 2 steps, save, then resume to step 4: as one process x 4 devices."""
    one, two = str(tmp_path / "one_process"), str(tmp_path / "two_processes")
    deadline = time.monotonic() + _TIMEOUT
    reference = _start(_train_args(small_corpus, one, 4), 4, str(tmp_path / "one.log"))
    try:
        for steps in (2, 4):  # The second run restores the checkpoint of the first in both processes.
            processes = _start_processes(_train_args(small_corpus, two, steps), 2, 2, str(tmp_path / f"two_{steps}"))
            returncodes = _wait_all(processes, deadline)
            logs = [_read(str(tmp_path / f"two_{steps}.{i}.log")) for i in range(2)]
            assert returncodes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
            assert "] train: loss=" in logs[0] and "] train: loss=" not in logs[1]  # Process 0 logs.
    finally:
        returncode = _wait_all([reference], deadline)
    assert returncode == [0], _read(str(tmp_path / "one.log"))[-3000:]

    one_losses, two_losses = _train_losses(one), _train_losses(two)
    print("one process, 4 devices:", one_losses, "\ntwo processes, 2 devices each:", two_losses)
    assert sorted(one_losses) == sorted(two_losses) == [1, 2, 3, 4]
    # The same sums over other devices, in another order: within the rounding of 4 steps (tests/tolerances.py).
    config = tiny_config(small_corpus)
    rtol = loss_rtol(
        make_model(config, config.tokenizer.vocab_size).config,
        length=config.dataset.max_length,
        tokens=config.per_device_batch_size * 4 * config.dataset.max_length,
        steps=4,
    )
    np.testing.assert_allclose([two_losses[s] for s in range(1, 5)], [one_losses[s] for s in range(1, 5)], rtol=rtol)
    # One summary file per run, from process 0 (process 1 writes none).
    assert len(glob.glob(os.path.join(two, "tensorboard", "train", "events.*"))) == 2
    # The final evaluation, with batches and translations split over the processes.
    one_scores, two_scores = (json.loads(_read(os.path.join(w, "eval", "valid", "scores.json"))) for w in (one, two))
    assert two_scores["loss"] == pytest.approx(one_scores["loss"], rel=rtol)
    one_hypotheses, two_hypotheses = (_read(os.path.join(w, "eval", "valid", "hypotheses.txt")) for w in (one, two))
    assert two_hypotheses == one_hypotheses and len(two_hypotheses.splitlines()) == 40

    # The checkpoint the two processes wrote restores in this single process.
    state_one, data_one = _restore(config, one, 4)
    state_two, data_two = _restore(config, two, 4)
    assert int(state_two.step) == 4 and data_two == data_one
    np.testing.assert_array_equal(state_two.rng, state_one.rng)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state_two.params, state_one.params
    )


def test_when_one_process_is_killed_the_other_stops_with_an_error(small_corpus, tmp_path):
    workdir = str(tmp_path / "run")
    processes = _start_processes(_train_args(small_corpus, workdir, 100_000), 2, 1, str(tmp_path / "process"))
    first_log = str(tmp_path / "process.0.log")
    try:
        deadline = time.monotonic() + _TIMEOUT
        while "] train: loss=" not in _read(first_log):  # Both are training.
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), _read(first_log)[-3000:]
            time.sleep(0.5)
        processes[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        returncode = processes[0].wait(timeout=90)
        seconds = time.monotonic() - killed_at
    finally:
        _wait_all(processes, time.monotonic())
    print(f"process 0 exited {seconds:.1f} s after process 1 was killed, status {returncode}")
    assert returncode != 0
    assert seconds < 60
    assert "another task died" in _read(first_log)
