"""Data, FSDP and tensor parallelism and pmap on 8 simulated CPU devices equal one device.

The tests read what tests/multi_device_check.py printed running every check in one
subprocess: the device count must be set before JAX starts. The script asserts; its
printed table of losses is kept in the test output (pytest -s to see it).
"""

import os
import subprocess
import sys

import pytest
from conftest import FAST_COMPILE_XLA_FLAGS, REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def output(compilation_cache_folder, tmp_path_factory) -> str:
    """What tests/multi_device_check.py printed running every check in one process (JAX starts once, and a
    program one check compiled, such as the 8-way data-parallel step that `checkpoint` trains after `layouts`
    did, is read from the persistent compilation cache instead of compiled again)."""
    # PYTHONPATH: the checkout under test, not whatever an editable install points to.
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {FAST_COMPILE_XLA_FLAGS}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO_ROOT,
        JAX_COMPILATION_CACHE_DIR=compilation_cache_folder,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    checks = ["layouts", "classifier", "positions", "decoding_cache", "checkpoint"]
    checks.append(f"--directory={tmp_path_factory.mktemp('run')}")
    result = subprocess.run(
        [sys.executable, os.path.join("tests", "multi_device_check.py"), *checks],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(result.stdout)
    return result.stdout + result.stderr


def _check(output: str, name: str) -> str:
    """The lines `name` printed, asserting that it passed (with the output, its error included, if not)."""
    assert f"\n{name}: ok\n" in f"\n{output}", output[-6000:]
    return output


def test_every_layout_trains_like_one_device(output):
    """5 steps: pmap, jit data / FSDP / tensor / accumulation agree in loss (within float32 rounding) and parameters."""
    output = _check(output, "layouts")
    assert "jit 2 data x 4 tensor" in output and "pmap 8" in output


def test_the_classifier_trains_in_each_kind_of_layout_like_one_device(output):
    """The encoder classifier: pmap, jit tensor and jit FSDP with accumulation agree in loss and predictions."""
    output = _check(output, "classifier")
    assert "classifier, jit 2 data x 4 tensor" in output


def test_checkpoint_restores_onto_another_mesh(output):
    """Saved under 8-way data parallelism; restored onto 4 data x 2 FSDP and 2 data x 4 tensor, bit for bit."""
    output = _check(output, "checkpoint")
    # The [d_model, d_ff] kernel: d_model split over fsdp, d_ff over tensor.
    assert "data=4 fsdp=2 tensor=1: feed-forward kernel (32, 64), shards (16, 64)" in output
    assert "data=2 fsdp=1 tensor=4: feed-forward kernel (32, 64), shards (32, 16)" in output


def test_relative_and_rotary_positions_train_sharded_as_on_one_device(output):
    """Relative and rotary positions train on 2 data x 2 FSDP x 2 tensor as on one device."""
    output = _check(output, "positions")
    assert "relative, jit 2 data x 2 fsdp x 2 tensor" in output and "rotary, jit 2 data" in output


def test_decoding_splits_its_caches_over_the_heads_on_a_tensor_axis(output):
    """4 data x 2 tensor: a device holds an eighth of the caches (a quarter if they followed the rows alone)."""
    output = _check(output, "decoding_cache")
    assert "a device holds 14336 of 114688 cache bytes with the heads split, 28672 with the rows split only" in output
