"""benchmarks/peer_throughput.py's accelerator mode, run on the CPU at its tiny size: every contender, the profiles."""

import math
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from conftest import REPO_ROOT, entry_point_env  # noqa: E402

from benchmarks import step_variants  # noqa: E402

_TINY = ["--model=tiny", "--rounds=1", "--steps=2", "--warmup_steps=1"]


def _run(*arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.peer_throughput", *arguments]
    return subprocess.run(command, cwd=REPO_ROOT, env=entry_point_env(), capture_output=True, text=True, check=False)


@pytest.mark.slow  # A benchmark in a process of its own.
def test_tiny_run_times_each_variant_against_torch_and_profiles_it(tmp_path, monkeypatch):
    variant = "loss_chunks=2+prng_impl=unsafe_rbg"
    arguments = [
        *_TINY,
        f"--variants=default,{variant}",
        "--profile_steps=1",
        "--torch_compile_backend=eager",  # The torch.compile path without minutes of compiling on a CPU.
    ]
    # As step_variants runs each XLA flag set (here none): in a process of its own, its record read back; on the
    # CPU, as the other tests' processes (`entry_point_env`), whatever accelerator the machine has.
    for name in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(name, entry_point_env()[name])
    record = step_variants.run_with_xla_flags("", arguments, str(tmp_path / "peer"))
    assert "error" not in record, record["error"]
    figures = record["figures"]
    contenders = figures["contenders"]
    assert list(contenders) == ["default", variant, "torch", "torch_compile"]
    for row in contenders.values():
        assert row["tokens_per_second"] > 0 and 0 < row["mfu"] < 1
        assert math.isclose(row["vs_torch"], row["tokens_per_second"] / contenders["torch"]["tokens_per_second"])
    assert set(figures["profiles"]) == {"default", variant}
    for profile in figures["profiles"].values():
        assert profile["clock"] == "cpu"
        assert math.isclose(math.fsum(row["share"] for row in profile["buckets"].values()), 1.0)


@pytest.mark.slow  # A benchmark in a process of its own.
def test_an_xla_flag_set_reaches_the_process_it_runs_in(tmp_path):
    """A flag XLA does not know stops the process at start-up: its error comes back, naming the flag (a flag
    set that runs is the test above's)."""
    arguments = [*_TINY, "--variants=default", "--frameworks=jax"]
    failed = step_variants.run_with_xla_flags("--xla_no_such_flag=true", arguments, str(tmp_path / "bad"))
    assert "xla_no_such_flag" in failed["error"]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--variants=loss_chunks=3"], "error: --variants: config.loss_chunks is 3; it must divide"),
        (["--variants=model.no_such_field=1"], "error: --variants: the config has no field 'model.no_such_field'"),
        (["--variants=prng_impl"], "error: --variants: 'prng_impl' is not field=value"),
        (["--xla_flag_sets=jax_guide"], "error: --xla_flag_sets: XLA's GPU flags apply on a GPU; this backend is cpu"),
    ],
)
def test_variants_and_flag_sets_that_cannot_run_stop_with_one_error_line(arguments, message):
    done = _run(*_TINY, "--frameworks=jax", *arguments)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(message)


def test_a_variant_sets_nested_and_top_level_fields_on_a_copy():
    base = step_variants.tiny_model()
    config = step_variants.with_variant(base, "model.attention_implementation=xla+loss_chunks=4+optimizer.eps=1e-8")
    assert config.model.attention_implementation == "xla"
    assert config.loss_chunks == 4 and config.optimizer.eps == 1e-8
    # The base config is left as it was.
    assert base.model.attention_implementation != "xla" and base.loss_chunks != 4 and base.optimizer.eps != 1e-8
