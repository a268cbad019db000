"""Several processes as one run (jax.distributed on localhost, CPU devices), through train.py.

Two processes with 2 devices each, each reading its own share of the training
records, must resume exactly as they would have gone on (each process's data
position is in the checkpoint), evaluate as one process does, and write a
checkpoint whose state one process restores (without a data position of its own:
input_pipeline/streaming.py says what it does then). If one process dies, the other must stop
with an error instead of waiting for it forever. Processes that hold the same rows of a
batch (tensor parallelism across them) must read the same records. If one process's data
position is lost, every process starts afresh, so that the shares stay disjoint.
"""

import glob
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILE_XLA_FLAGS, REPO_ROOT, read_events, tiny_config
from test_train_loop import _restore

from input_pipeline import streaming

pytestmark = pytest.mark.slow

_TIMEOUT = 600  # Seconds for any one run (slow on a loaded 2-core machine): a hang fails the test.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], devices: int, log_path: str) -> subprocess.Popen:
    """train.py in a subprocess on `devices` CPU devices, stdout and stderr to `log_path`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2")
    env["XLA_FLAGS"] = FAST_COMPILE_XLA_FLAGS  # And no device count of its own: JAX_NUM_CPU_DEVICES sets it.
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
    for event in read_events(os.path.join(workdir, "tensorboard", "train")):
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


def _train_args_shortest_evaluation(corpus: str, workdir: str, steps: int) -> list[str]:
    """`_train_args` for tests whose point is the data or the processes: no BLEU, the split decoded 4 tokens long."""
    args = _train_args(corpus, workdir, steps)
    args.remove("--config.eval.num_bleu_sentences=8")
    return [*args, "--config.eval.num_bleu_sentences=0", "--config.eval.max_decode_length=4"]


def _train_in_two_processes(args: list[str], log_prefix: str, deadline: float) -> None:
    """Runs train.py with `args` as two processes of 2 devices each; both succeed, process 0 alone logs."""
    returncodes = _wait_all(_start_processes(args, 2, 2, log_prefix), deadline)
    logs = [_read(f"{log_prefix}.{i}.log") for i in range(2)]
    assert returncodes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    assert "] train: loss=" in logs[0] and "] train: loss=" not in logs[1]


@pytest.fixture(scope="module")
def saved_at_step_2(small_corpus, tmp_path_factory) -> str:
    """Two processes x 2 devices trained 2 steps and saved: the run the tests below resume, each in a copy
    (its data and tokenizer prepared once); the programs it compiled are in train.py's compilation cache."""
    folder = tmp_path_factory.mktemp("saved_at_step_2")
    workdir = str(folder / "run")
    _train_in_two_processes(_train_args(small_corpus, workdir, 2), str(folder / "two_2"), time.monotonic() + _TIMEOUT)
    return workdir


def test_two_processes_resume_exactly_and_their_checkpoint_restores_in_one(
    small_corpus, saved_at_step_2, tmp_path, caplog
):
    """Two processes x 2 devices train 2 steps, save, then resume to step 4: as two processes straight to step 4."""
    straight, resumed = str(tmp_path / "straight"), str(shutil.copytree(saved_at_step_2, tmp_path / "resumed"))
    deadline = time.monotonic() + _TIMEOUT
    reference = _start_processes(_train_args(small_corpus, straight, 4), 2, 2, str(tmp_path / "straight"))
    try:  # Restores the checkpoint of step 2 in both processes.
        _train_in_two_processes(_train_args(small_corpus, resumed, 4), str(tmp_path / "two_4"), deadline)
    finally:
        returncodes = _wait_all(reference, deadline)
    assert returncodes == [0, 0], _read(str(tmp_path / "straight.0.log"))[-3000:]

    straight_losses, resumed_losses = _train_losses(straight), _train_losses(resumed)
    print("straight:", straight_losses, "\nresumed at step 2:", resumed_losses)
    assert sorted(straight_losses) == sorted(resumed_losses) == [1, 2, 3, 4]
    assert resumed_losses == straight_losses  # The same batches after the restart: the same arithmetic.
    # Each process kept its own position.
    data = os.path.join(resumed, "checkpoints", "4", "data")
    assert sorted(os.listdir(data)) == ["commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"]
    positions = [json.loads(_read(os.path.join(data, f"process_{i}-of-2.json"))) for i in range(2)]
    for index, position in enumerate(positions):  # Each its own share: the same count, seed and records.
        assert position["stream"] == {**positions[0]["stream"], "process_index": index, "share_index": index}
        assert position["stream"]["process_count"] == position["stream"]["share_count"] == 2
    # One summary file per run, from process 0 (process 1 writes none).
    assert len(glob.glob(os.path.join(resumed, "tensorboard", "train", "events.*"))) == 2
    # The final evaluation, with batches and translations split over the processes.
    scores = [json.loads(_read(os.path.join(w, "eval", "valid", "scores.json"))) for w in (straight, resumed)]
    assert scores[0]["loss"] == scores[1]["loss"]
    hypotheses = [_read(os.path.join(w, "eval", "valid", "hypotheses.txt")) for w in (straight, resumed)]
    assert hypotheses[0] == hypotheses[1] and len(hypotheses[0].splitlines()) == 40

    # The checkpoint the two processes wrote restores in this single process, with the first process's
    # position, which its stream does not take (tests/test_streaming.py).
    config = tiny_config(small_corpus)
    state_straight, _ = _restore(config, straight, 4)
    with caplog.at_level(logging.WARNING):
        state_resumed, position = _restore(config, resumed, 4)
    assert int(state_resumed.step) == 4 and position == positions[0]
    assert any("no data position for process 0 of 1" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(state_resumed.rng, state_straight.rng)
    jax.tree.map(np.testing.assert_array_equal, state_resumed.params, state_straight.params)


def test_tensor_parallel_across_processes_reads_one_share_and_averages_checkpoints(small_corpus, tmp_path):
    """Tensor parallelism across 2 processes (1 device each): the batch is replicated, so both read one share;
    the parameters are split over the processes, and --checkpoint=average:2 averages them. Its evaluations draw
    the attention maps, whose weights (heads split over the processes) every process must gather."""
    workdir = str(tmp_path / "run")
    args = [
        *_train_args_shortest_evaluation(small_corpus, workdir, 2),
        "--config.mesh.tensor=2",
        "--config.checkpoint_every_steps=1",  # Two steps to average.
        "--config.eval.attention_maps=True",
    ]
    deadline = time.monotonic() + _TIMEOUT
    returncodes = _wait_all(_start_processes(args, 2, 1, str(tmp_path / "tensor")), deadline)
    assert returncodes == [0, 0], _read(str(tmp_path / "tensor.0.log"))[-3000:]
    data = os.path.join(workdir, "checkpoints", "2", "data")
    positions = [json.loads(_read(os.path.join(data, f"process_{i}-of-2.json"))) for i in range(2)]
    # One share of the records (not each process its half) and the same place in it: the same batches.
    assert [p["stream"]["share_count"] for p in positions] == [1, 1] and positions[1]["stream"]["process_index"] == 1
    assert positions[0]["grain"] == positions[1]["grain"]
    assert {**positions[0]["stream"], "process_index": 1} == positions[1]["stream"]

    evaluate = [*args, "--mode=eval", "--checkpoint=average:2"]
    returncodes = _wait_all(_start_processes(evaluate, 2, 1, str(tmp_path / "average")), deadline)
    assert returncodes == [0, 0], _read(str(tmp_path / "average.0.log"))[-3000:]
    scores = json.loads(_read(os.path.join(workdir, "eval", "valid", "scores.json")))
    assert scores["checkpoint"] == "average of steps 1, 2"
    assert os.path.exists(os.path.join(workdir, "eval", "valid", "attention.html"))  # Written by process 0.


def test_a_data_position_lost_in_one_process_starts_every_process_afresh(small_corpus, saved_at_step_2, tmp_path):
    """Process 1's position file of step 2 is lost: process 1 alone starting afresh would read records of
    process 0's share; both must start afresh, with the same folded seed, each in its own share."""
    workdir = str(shutil.copytree(saved_at_step_2, tmp_path / "run"))
    os.remove(os.path.join(workdir, "checkpoints", "2", "data", "process_1-of-2.json"))

    args = _train_args_shortest_evaluation(small_corpus, workdir, 3)
    returncodes = _wait_all(_start_processes(args, 2, 2, str(tmp_path / "resumed")), time.monotonic() + _TIMEOUT)
    first_log = _read(str(tmp_path / "resumed.0.log"))
    assert returncodes == [0, 0], first_log[-3000:]
    assert "This process's data position fits, but another process's is missing or does not fit" in first_log
    data = os.path.join(workdir, "checkpoints", "3", "data")
    positions = [json.loads(_read(os.path.join(data, f"process_{i}-of-2.json")))["stream"] for i in range(2)]
    folded = streaming.fold_seed(tiny_config(small_corpus).seed, 2)
    assert [p["seed"] for p in positions] == [folded, folded]
    assert [p["share_index"] for p in positions] == [0, 1]


def test_when_one_process_is_killed_the_other_stops_with_an_error(small_corpus, saved_at_step_2, tmp_path):
    workdir = str(shutil.copytree(saved_at_step_2, tmp_path / "run"))  # Its programs are in train.py's cache.
    # Half the default heartbeat timeout: the bound below keeps a 4x margin on a loaded 2-core machine.
    args = [*_train_args(small_corpus, workdir, 100_000), "--heartbeat_timeout_seconds=15"]
    processes = _start_processes(args, 2, 2, str(tmp_path / "process"))
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
