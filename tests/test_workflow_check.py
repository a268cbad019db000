"""benchmarks/workflow_check.py runs the README's workflow as a user would, records it, and fails where a step does.

The script is run in subprocesses only: its absl flags (--output, --config) would clash with other benchmarks' in the
test process.
"""

import json
import subprocess
import sys

import pytest
from conftest import FAST_COMPILE_XLA_FLAGS, REPO_ROOT, entry_point_env

PHASES = ["attention", "train", "beam", "translate", "export_huggingface", "export_ctranslate2"]
# A tiny budget: configs/tiny.py's model, two steps, a small validation.
TINY = ("--config.num_train_steps=2", "--config.eval_every_steps=2", "--config.checkpoint_every_steps=2")


def _workflow_check(corpus: str, output, *arguments: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "benchmarks.workflow_check",
        "--config=configs/tiny.py",
        "--attention_size=tiny",
        f"--output={output}",
        f"--config.dataset.path={corpus}",
        *TINY,
        "--config.eval.num_bleu_sentences=4",
        *arguments,
    ]
    environment = {**entry_point_env(), "XLA_FLAGS": FAST_COMPILE_XLA_FLAGS}
    return subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=900)


def test_a_failed_command_is_recorded_with_its_error_line(tmp_path):
    # As export.py fails where the export extra is not installed: one error: line, exit status 2.
    failing = "import sys; print('loading'); print('error: --format=x needs y, not installed'); sys.exit(2)"
    snippet = (
        "import json, sys\n"
        "from benchmarks import workflow_check\n"
        f"failed = workflow_check.run(['-c', {failing!r}], sys.argv[1])\n"
        "print(json.dumps([failed, workflow_check.summary(failed), workflow_check.run(['-c', 'pass'], sys.argv[1])]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", snippet, str(tmp_path / "log")], cwd=REPO_ROOT, capture_output=True, text=True
    )
    failed, summary, passed = json.loads(result.stdout)
    assert failed["exit_status"] == 2 and failed["wall_seconds"] >= 0
    assert failed["error"] == "exit status 2 (error: --format=x needs y, not installed)"
    assert failed["log_tail"] == ["loading", "error: --format=x needs y, not installed"]
    assert summary.startswith("FAILED: exit status 2 (error: --format=x")
    assert passed["exit_status"] == 0 and "error" not in passed


@pytest.mark.slow
def test_every_phase_runs_and_the_record_holds_its_time_and_scores(small_corpus, tmp_path):
    pytest.importorskip("ctranslate2")  # The export extra.
    pytest.importorskip("transformers")
    result = _workflow_check(small_corpus, tmp_path / "record")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((tmp_path / "record.json").read_text())
    assert (tmp_path / "record.md").exists()
    phases = record["figures"]["phases"]
    assert list(phases) == PHASES and record["figures"]["passed"]
    for name, figures in phases.items():
        assert figures["exit_status"] == 0 and "error" not in figures and figures["wall_seconds"] > 0, name
    assert record["figures"]["wall_seconds"] == pytest.approx(sum(f["wall_seconds"] for f in phases.values()))
    assert record["overrides"][-1] == "--config.eval.num_bleu_sentences=4"
    assert all(override in phases["train"]["command"] for override in TINY)
    assert phases["train"]["command"].endswith("--config.nonfinite=stop")

    assert phases["attention"]["compared"] == "explicit vs xla" and phases["attention"]["length"] == 64
    assert record["accelerator"]["platform"] == "cpu"
    train, beam = phases["train"], phases["beam"]
    assert train["valid"]["step"] == 2 and 0 <= train["valid"]["bleu"] <= 100
    assert train["test"]["decoding"] == "greedy" and train["test"]["num_sentences"] == 40
    assert beam["test"]["decoding"] == "beam 4, alpha 0.6" and beam["test"]["num_sentences"] == 40
    assert 0 <= train["test"]["bleu"] <= 100 and 0 <= beam["test"]["bleu"] <= 100
    translations = phases["translate"]["translations"]
    assert len(translations) == 3 and "Click the OK button to close the dialog." in translations


@pytest.mark.slow
def test_a_step_that_is_not_finite_fails_the_check(small_corpus, tmp_path):
    # The parameters overflow at the first update (tests/test_divergence.py).
    result = _workflow_check(
        small_corpus, tmp_path / "record", "--phases=train", "--config.optimizer.peak_learning_rate=1e38"
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == "workflow check FAILED: train"
    record = json.loads((tmp_path / "record.json").read_text())
    train = record["figures"]["phases"]["train"]
    assert train["exit_status"] == 3 and not record["figures"]["passed"]  # train.py's exit status for divergence.
    assert train["error"].startswith("exit status 3 (a non-finite step, error: the loss or gradients of step")
