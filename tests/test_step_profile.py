"""benchmarks/step_profile.py at the tiny size on the CPU (the path benchmarks/gpu_step_check.sh runs on a GPU)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, entry_point_env

from benchmarks import step_variants
from training import step_options

GPU_STEP_CHECK = os.path.join(REPO_ROOT, "benchmarks", "gpu_step_check.sh")


@pytest.mark.slow  # A benchmark in a process of its own.
def test_the_tiny_step_is_profiled_through_its_own_dump_with_every_kernel_attributed(tmp_path):
    output = str(tmp_path / "profile")
    command = [sys.executable, "-m", "benchmarks.step_profile", "--model=tiny", "--steps=2", "--warmup_steps=1"]
    command += ["--timed_steps=2", f"--output={output}"]
    env = dict(entry_point_env(), XLA_FLAGS="--xla_cpu_enable_fast_math=false")  # The caller's, kept and recorded.
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(output + ".json") as f:
        record = json.load(f)
    figures = record["figures"]
    assert record["xla_flags"] == "--xla_cpu_enable_fast_math=false"
    assert figures["clock"] == "cpu" and figures["step_wall_ms"] > 0
    assert figures["unmatched_share"] < 0.05  # The dump holds the step's module: its kernels are named.
    ms = {label: row["cpu_ms_per_call"] for label, row in figures["buckets"].items()}
    assert (
        ms["matmuls: projections and feed-forward"] > 0
        and ms["layer norms"] > 0
        and ms["dropout (random bits, masks)"] > 0
    )
    assert math.fsum(ms.values()) == pytest.approx(figures["profiled_cpu_ms_per_call"])
    assert "Unattributed (no instruction matched)" in (tmp_path / "profile.md").read_text()


def test_the_gpu_scripts_variants_are_fields_of_transformer_base_that_its_step_accepts():
    with open(GPU_STEP_CHECK) as script:
        (variants,) = re.findall(r"--variants=(\S+)", script.read())
    for variant in variants.split(","):
        step_options.check_step_options(step_variants.with_variant(step_variants.transformer_base(), variant))
    assert "model.dropout_rate=0.0" in variants.split(",")
    assert step_variants.transformer_base().model.attention_dropout_rate == 0  # So dropout 0 is every rate at 0.
