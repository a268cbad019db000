"""Start-up of several processes: when to connect, and flags that cannot work."""

import os
import socket
import subprocess
import sys

import jax
import pytest
from conftest import REPO_ROOT

from common.errors import UserInputError
from input_pipeline.batching import ParallelIds, RaggedIds, TrainBatches, eval_batches
from training.runtime import distributed

_SLURM_TWO_TASKS = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


@pytest.mark.parametrize(
    "environ, launcher",
    [
        ({}, None),
        (_SLURM_TWO_TASKS, "slurm"),
        ({**_SLURM_TWO_TASKS, "SLURM_NTASKS": "1"}, None),  # One task: nothing to join.
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}, None),  # `salloc` shell, not an `srun` step.
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:3", "OMPI_COMM_WORLD_SIZE": "4"}, "open_mpi"),
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:3", "OMPI_COMM_WORLD_SIZE": "1"}, None),
    ],
)
def test_detect_launcher(environ, launcher):
    assert distributed.detect_launcher(environ) == launcher


def test_a_single_process_does_not_connect():
    # Neither would touch JAX's distributed runtime: this process's backend already runs.
    assert not distributed.initialize(environ={})
    assert not distributed.initialize(mode="off", environ=_SLURM_TWO_TASKS)
    with pytest.raises(UserInputError, match="--distributed='sometimes'"):
        distributed.initialize(mode="sometimes", environ={})


def _pairs(lengths):
    ids = [[5] * (n - 1) + [3] for n in lengths]
    return ParallelIds(RaggedIds.from_lists(ids), RaggedIds.from_lists(ids))


def test_process_rows_of_batches_put_together_are_the_whole_batches():
    """What two processes pad, each its half, is what one process pads."""
    pairs = _pairs([3, 5, 7, 2, 8, 4, 6, 3, 5, 7, 1, 8] * 3)
    boundaries, sizes = (4, 8), {4: 4, 8: 4}
    halves = [lambda n, p=p: slice(p * n // 2, (p + 1) * n // 2) for p in range(2)]

    whole = TrainBatches(pairs, boundaries, sizes, seed=1)
    parts = [TrainBatches(pairs, boundaries, sizes, seed=1, rows=rows) for rows in halves]
    for _ in range(12):  # Past the end of the first epoch.
        batch = next(whole)
        first, second = (next(part) for part in parts)
        for key in batch:
            assert first[key].shape[0] == second[key].shape[0] == batch[key].shape[0] // 2
            assert (batch[key] == [*first[key], *second[key]]).all()

    evaluated = list(eval_batches(pairs, boundaries, sizes))
    evaluated_in_parts = [list(eval_batches(pairs, boundaries, sizes, rows)) for rows in halves]
    for (batch, indices), (first, first_indices), (second, second_indices) in zip(evaluated, *evaluated_in_parts):
        assert (indices == first_indices).all() and (indices == second_indices).all()
        assert (batch["inputs"] == [*first["inputs"], *second["inputs"]]).all()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num_processes=2", "--process_id=2", "--coordinator_address=127.0.0.1:1"], "process_id < num_processes"),
        (["--num_processes=2", "--process_id=0"], "coordinator_address should be defined"),
        # JAX itself would wait out its initialization timeout (5 minutes) on these.
        (["--num_processes=2", "--process_id=1", "--coordinator_address=head.invalid:1234"], "'head.invalid' does not"),
        (["--num_processes=2", "--process_id=1", "--coordinator_address=head"], "is not HOST:PORT"),
    ],
)
def test_flags_that_cannot_describe_processes_are_one_error_line(tmp_path, flags, message):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for name in list(env):
        if name.startswith(("SLURM_", "OMPI_")):
            del env[name]
    result = subprocess.run(
        [sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", *flags],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: Cannot start several processes with ")
    assert message in last_line and "Traceback" not in result.stderr
    assert not os.path.exists(tmp_path / "run")


def test_a_port_in_use_on_process_0_is_one_error_line(monkeypatch):
    """JAX's coordination service would crash on it (a segmentation fault, no message)."""
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: pytest.fail("JAX was asked to connect"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserInputError) as error:
            distributed.initialize(f"localhost:{port}", 2, 0, environ={})
        assert str(error.value) == (
            f"Cannot start several processes with --coordinator_address=localhost:{port} --num_processes=2 "
            f"--process_id=0: process 0 cannot serve the coordination on port {port}: Address already in use; "
            "choose another port."
        )
        assert distributed.coordinator_problem(f"localhost:{port}", 1) is None  # Others connect to it.
    assert distributed.coordinator_problem(f"localhost:{port}", 0) is None  # Free again.


_JOIN_AND_REPORT = """
from training.runtime import distributed
import jax
assert distributed.initialize()
print("process", jax.process_index(), "of", jax.process_count(), "devices", jax.device_count())
"""


def test_processes_started_by_slurm_join_without_flags(tmp_path):
    """Two `srun` tasks on this host, as SLURM describes them in the environment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = []
    for task in range(2):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            JAX_NUM_CPU_DEVICES="2",
            JAX_COORDINATOR_PORT=str(port),  # SLURM gives no port; JAX's default derives one from the job id.
            SLURM_JOB_ID="4242",
            SLURM_STEP_NODELIST="127.0.0.1",
            SLURM_NTASKS="2",
            SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task),
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", _JOIN_AND_REPORT],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=120) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for task, (process, (stdout, stderr)) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, stderr[-3000:]
        assert f"process {task} of 2 devices 4" in stdout
