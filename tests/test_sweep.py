"""sweep.py: runs, resumes and skips, failures, --dry_run and --collect; the results table's arithmetic.

The end-to-end tests share one sweep of a tiny sweep file (two variants that train and one
that fails, two seeds) through the real train.py: its commands are printed by --dry_run and
one of them is run by hand, another run is stopped by a SIGTERM to the sweep, and the sweep
is run twice more.
"""

import csv
import gzip
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import BUNDLED_CORPUS, REPO_ROOT, entry_point_env
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from common.decoding_names import describe_decoding
from common.errors import UserInputError
from common.workdir import Workdir
from configs.sweeps import Paper, Variant, config_for, table3
from sweeps import plots, report, runner, significance, train_processes
from sweeps.significance import Translations
from training.config_checks import validate_config
from training.reporting import metric_log

_STEPS = 40

_SWEEP_FILE = '''
"""A tiny sweep for tests."""
from configs import tiny
from configs.sweeps import Paper, Variant, config_for


def base_config():
    config = tiny.get_config()
    config.dataset.path = {corpus!r}
    config.num_train_steps = {steps}
    config.log_every_steps = 10
    config.eval_every_steps = 20
    config.checkpoint_every_steps = 10
    config.eval.num_bleu_sentences = 0
    return config


VARIANTS = (
    Variant("base", "base", "tiny", {{}}, Paper("base row", 4.92, 25.8, 65)),
    Variant("heads_3", "(A) heads", "h=3: d_model 32 is not divisible", {{"model.num_heads": 3}}),
    Variant("wide", "(C) size", "d_ff 128", {{"model.d_ff": 128}}, Paper("(C) d_ff 4096", 4.75, 26.2, 90)),
)


def get_config(variant="base"):
    return config_for(base_config(), VARIANTS, variant)
'''


def _sweep_args(sweep_file: str, root: str, *flags: str) -> list[str]:
    return [sys.executable, "sweep.py", f"--sweep={sweep_file}", f"--root={root}", "--seeds=2", *flags]


def _run_sweep(sweep_file: str, root: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _sweep_args(sweep_file, root, *flags),
        cwd=REPO_ROOT,
        env=entry_point_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )


def _mtimes(root: str) -> dict[str, float]:
    """Modification times of every run's scores.json and train.log."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name in ("scores.json", train_processes.LOG_NAME):
                path = os.path.join(folder, name)
                found[os.path.relpath(path, root)] = os.path.getmtime(path)
    return found


@pytest.fixture(scope="module")
def swept(small_corpus, tmp_path_factory):
    """A tiny sweep run as a user would, step by step; what each step printed and left."""
    folder = tmp_path_factory.mktemp("sweep")
    sweep_file = str(folder / "tiny_sweep.py")
    with open(sweep_file, "w", encoding="utf-8") as f:
        f.write(_SWEEP_FILE.format(corpus=small_corpus, steps=_STEPS))
    root = str(folder / "runs")
    stages = {}

    # 1. --dry_run; one of its commands run as printed, from another folder.
    stages["dry_run"] = _run_sweep(sweep_file, root, "--dry_run")
    by_run = {line.rsplit("--workdir=", 1)[1]: line for line in stages["dry_run"].stdout.splitlines()}
    by_hand = os.path.join(root, "wide", "seed_1")
    stages["by_hand"] = subprocess.run(
        by_run[by_hand], shell=True, cwd=str(folder), env=entry_point_env(), capture_output=True, text=True
    )

    # 2. A sweep of base/seed_0 alone, stopped by SIGTERM once the run has saved a checkpoint.
    checkpoints = os.path.join(root, "base", "seed_0", "checkpoints")
    process = subprocess.Popen(
        _sweep_args(sweep_file, root, "--only=base", "--seeds=1"),
        cwd=REPO_ROOT,
        env=entry_point_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not (os.path.isdir(checkpoints) and os.listdir(checkpoints)) and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    stages["stopped"] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    stages["stopped_at"] = sorted(int(step) for step in os.listdir(checkpoints) if step.isdigit())

    # 3. The whole sweep: resumes base/seed_0, skips wide/seed_1, heads_3 fails; 4. again: all skipped.
    stages["full"] = _run_sweep(sweep_file, root)
    stages["mtimes_after_full"] = _mtimes(root)
    with open(os.path.join(root, "results.md"), encoding="utf-8") as f:
        stages["results_md_after_full"] = f.read()
    stages["again"] = _run_sweep(sweep_file, root)
    stages["mtimes_after_again"] = _mtimes(root)

    # 5. --collect alone, the results removed first.
    for name in ("results.md", "results.csv", "results_runs.csv", "results_bleu.png", "valid_curves.png"):
        os.remove(os.path.join(root, name))
    stages["collect"] = _run_sweep(sweep_file, root, "--collect")
    return {"sweep_file": sweep_file, "root": root, **stages}


def _read_log(root: str, run: str) -> str:
    with open(os.path.join(root, run, train_processes.LOG_NAME), encoding="utf-8", errors="replace") as f:
        return f.read()


def _scores(root: str, run: str) -> dict:
    with open(os.path.join(root, run, "eval", "test", "scores.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.slow
def test_dry_run_prints_one_self_contained_command_per_run(swept):
    lines = swept["dry_run"].stdout.splitlines()
    assert swept["dry_run"].returncode == 0, swept["dry_run"].stderr
    root = swept["root"]
    assert [shlex.split(line) for line in lines] == [
        [
            sys.executable,
            os.path.join(REPO_ROOT, "train.py"),
            f"--config={swept['sweep_file']}:{variant}",
            f"--config.seed={seed}",
            f"--config.dataset.data_dir={root}/prepared/tfds",  # Prepared once for the sweep.
            f"--workdir={root}/{variant}/seed_{seed}",
        ]
        for seed in (0, 1)
        for variant in ("base", "heads_3", "wide")
    ]
    # Run as printed from another folder, it trained and evaluated its run.
    assert swept["by_hand"].returncode == 0, swept["by_hand"].stderr[-3000:]
    assert _scores(swept["root"], "wide/seed_1")["step"] == _STEPS


@pytest.mark.slow
def test_a_stopped_run_resumes_from_its_checkpoint_and_finished_runs_are_skipped(swept):
    stopped = swept["stopped"]
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "Stopped by SIGTERM during base/seed_0" in stopped.stderr
    saved = swept["stopped_at"][-1]
    assert 0 < saved < _STEPS
    full = swept["full"]
    log = _read_log(swept["root"], "base/seed_0")
    assert log.count("# sweep.py") == 2  # Started twice: stopped, then resumed.
    assert f"Stopped by SIGTERM after step {saved}" in log
    assert f"Resumed from step {saved}" in log
    assert "wide/seed_1: finished before, skipped." in full.stdout
    # The third sweep trained nothing: every finished run's scores and log are as they were.
    again = swept["again"]
    assert again.stdout.count("finished before, skipped.") == 4, again.stdout
    after_full, after_again = swept["mtimes_after_full"], swept["mtimes_after_again"]
    unchanged = {path: t for path, t in after_full.items() if not path.startswith("heads_3")}
    assert sum(path.endswith("scores.json") for path in unchanged) == 4
    assert sum(path.endswith(train_processes.LOG_NAME) for path in unchanged) == 3  # wide/seed_1 was run by hand.
    assert {path: after_again[path] for path in unchanged} == unchanged


@pytest.mark.slow
def test_a_failing_run_is_named_with_its_log_and_the_others_still_run(swept):
    full = swept["full"]
    assert full.returncode == 1
    for seed in (0, 1):
        log = os.path.join(swept["root"], "heads_3", f"seed_{seed}", train_processes.LOG_NAME)
        failure = next(line for line in full.stderr.splitlines() if line.startswith(f"FAILED heads_3/seed_{seed}"))
        assert "exit status 2" in failure and "num_heads" in failure and f"log: {log}" in failure
    for run in ("base/seed_0", "base/seed_1", "wide/seed_0", "wide/seed_1"):  # wide/seed_* come after heads_3.
        assert _scores(swept["root"], run)["step"] == _STEPS
    assert "3 runs trained, 1 finished before, 2 failed." in full.stdout


@pytest.mark.slow
def test_results_are_the_mean_and_std_of_the_runs_scores(swept):
    root = swept["root"]
    assert swept["collect"].returncode == 0, swept["collect"].stderr[-3000:]
    with open(os.path.join(root, "results.csv"), encoding="utf-8") as f:
        rows = {row["variant"]: row for row in csv.DictReader(f)}
    for variant in ("base", "wide"):
        bleu = [_scores(root, f"{variant}/seed_{s}")["bleu"] for s in (0, 1)]
        chrf = [_scores(root, f"{variant}/seed_{s}")["chrf"] for s in (0, 1)]
        ppl = [metric_log.read(os.path.join(root, variant, f"seed_{s}"), "valid")[_STEPS]["perplexity"] for s in (0, 1)]
        row = rows[variant]
        assert row["runs_finished"] == "2" and row["steps"] == str(_STEPS)
        assert float(row["test_bleu_mean"]) == pytest.approx(np.mean(bleu), rel=1e-12)
        assert float(row["test_bleu_std"]) == pytest.approx(np.std(bleu, ddof=1), rel=1e-12, abs=1e-12)
        assert float(row["test_chrf_mean"]) == pytest.approx(np.mean(chrf), rel=1e-12)
        assert float(row["valid_perplexity_mean"]) == pytest.approx(np.mean(ppl), rel=1e-12)
        assert float(row["train_minutes_mean"]) > 0
    # The parameter count of d_ff 128 instead of 64: 2 layers (encoder, decoder) x (2 x 32 x 64 + 64) more.
    assert int(rows["wide"]["params"]) - int(rows["base"]["params"]) == 2 * (2 * 32 * 64 + 64)
    base_bleu = {s: _scores(root, f"base/seed_{s}")["bleu"] for s in (0, 1)}
    wide_bleu = {s: _scores(root, f"wide/seed_{s}")["bleu"] for s in (0, 1)}
    assert float(rows["wide"]["test_bleu_diff"]) == pytest.approx(
        np.mean([wide_bleu[s] - base_bleu[s] for s in (0, 1)]), abs=1e-9
    )
    assert rows["heads_3"]["runs_finished"] == "0" and rows["heads_3"]["test_bleu_mean"] == ""
    assert rows["wide"]["paper_bleu"] == "26.2"
    # --collect alone wrote the same table as the sweep did, and the pictures.
    with open(os.path.join(root, "results.md"), encoding="utf-8") as f:
        markdown = f.read()
    assert markdown == swept["results_md_after_full"]
    assert f"| wide | (C) size | d_ff 128 | 2/2 | {int(rows['wide']['params']) / 1e6:.2f}M | {_STEPS} |" in markdown
    bleu_cell = f"{np.mean(list(wide_bleu.values())):.2f} ± {np.std(list(wide_bleu.values()), ddof=1):.2f}"
    assert bleu_cell in markdown
    assert "- heads_3/seed_0\n" in markdown and "- heads_3/seed_1\n" in markdown
    for picture in ("results_bleu.png", "valid_curves.png"):
        with open(os.path.join(root, picture), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# Fast tests of the pieces.


def test_valid_curves_mark_evaluation_steps_on_the_x_axis():
    assert plots.evaluation_ticks([300, 600, 900]) == [300, 600, 900]
    many = list(range(250, 10_001, 250))  # 40 evaluations.
    ticks = plots.evaluation_ticks(many)
    assert len(ticks) <= 12 and set(ticks) <= set(many) and ticks[-1] == 10_000
    assert len(set(np.diff(ticks))) == 1  # Evenly spaced.


def test_estimate_is_the_mean_and_sample_std_of_the_values_present():
    value = report.estimate([20.0, None, 22.0, 21.0])
    assert (value.mean, value.std, value.n) == (21.0, 1.0, 3)
    single = report.estimate([20.5])
    assert (single.mean, single.std, single.n) == (20.5, None, 1)
    assert report.estimate([None]) is None


def test_format_estimate_says_n_when_fewer_seeds_finished_than_planned():
    fmt = report.format_estimate
    assert fmt(report.Estimate(20.186, 0.3149, 3), 2, 3) == "20.19 ± 0.31"
    assert fmt(report.Estimate(20.186, 0.3149, 2), 2, 3) == "20.19 ± 0.31 (n=2)"
    assert fmt(report.Estimate(20.186, None, 1), 2, 3) == "20.19 (n=1)"
    assert fmt(report.Estimate(0.52, 0.2, 3), 2, 3, signed=True) == "+0.52 ± 0.20"
    assert fmt(report.Estimate(-1.5, 0.25, 3), 1, 3, signed=True) == "-1.5 ± 0.2"
    assert fmt(None, 2, 3) == "–"


def test_the_difference_to_the_base_pairs_runs_of_the_same_seed():
    difference = report.paired_difference({0: 21.0, 1: 23.0, 2: 20.0}, {0: 20.0, 1: 21.0, 3: 30.0})
    assert (difference.mean, difference.n) == (1.5, 2)  # Seeds 0 and 1 only.
    assert difference.std == pytest.approx(math.sqrt(0.5))
    assert report.paired_difference({0: 21.0}, {1: 20.0}) is None


def _write_scores(workdir, config, step=None, **changes):
    """The test scores.json of a run of `config` evaluated after `step` (its last), as training writes it."""
    step = config.num_train_steps if step is None else step
    os.makedirs(os.path.join(workdir, "eval", "test"))
    scores = {
        "split": "test",
        "step": step,
        "checkpoint": f"step {step}",
        "num_sentences": 40,
        "loss": 2.5,
        "perplexity": 12.18,
        "accuracy": 0.5,
        "bleu": 20.0,
        "signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
        "chrf": 45.0,
        "chrf_signature": "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0",
        "decoding": describe_decoding(config.eval),
        "max_decode_length": config.eval.max_decode_length,
        **changes,
    }
    with open(os.path.join(workdir, "eval", "test", "scores.json"), "w", encoding="utf-8") as f:
        json.dump(scores, f)


def test_a_run_is_finished_when_its_final_scores_are_for_the_configs_last_step(tmp_path):
    config = table3.get_config("base")
    assert config.eval.beam_size == 1 and config.eval.temperature == 0  # Greedy.
    steps = config.num_train_steps
    assert not runner.is_finished(config, str(tmp_path / "empty"))
    _write_scores(str(tmp_path / "done"), config)
    assert runner.is_finished(config, str(tmp_path / "done"))
    _write_scores(str(tmp_path / "shorter"), config, steps // 2)  # The sweep file now asks for more.
    assert not runner.is_finished(config, str(tmp_path / "shorter"))
    # A later `train.py --mode=eval` wrote over the run's own evaluation: not the scores the table compares.
    _write_scores(str(tmp_path / "beam"), config, decoding="beam 4, alpha 0.6")
    assert not runner.is_finished(config, str(tmp_path / "beam"))
    _write_scores(str(tmp_path / "best"), config, checkpoint=f"best (step {steps // 2}, valid BLEU 9.00)")
    assert not runner.is_finished(config, str(tmp_path / "best"))
    _write_scores(str(tmp_path / "shorter_outputs"), config, max_decode_length=3)  # A later `--mode=eval`.
    assert not runner.is_finished(config, str(tmp_path / "shorter_outputs"))
    os.makedirs(tmp_path / "cut" / "eval" / "test")
    (tmp_path / "cut" / "eval" / "test" / "scores.json").write_text('{"step": 4', encoding="utf-8")
    assert not runner.is_finished(config, str(tmp_path / "cut"))


def test_a_full_disk_under_the_root_is_one_line(tmp_path):
    os.symlink("/dev/full", tmp_path / "results.md")  # Every write to it: ENOSPC.
    result = _run_sweep(os.path.join(REPO_ROOT, "configs", "sweeps", "table3.py"), str(tmp_path), "--collect")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: cannot write in {tmp_path}: No space left on device (errno 28); "
        "free space on that disk or choose another --root"
    )


def test_seeds_present_counts_every_seed_folder_of_the_variants(tmp_path):
    assert runner.seeds_present(str(tmp_path), ["base", "heads_1"]) == 0
    for folder in ("base/seed_0", "base/seed_4", "heads_1/seed_2", "heads_1/notes", "other/seed_9"):
        os.makedirs(tmp_path / folder)
    assert runner.seeds_present(str(tmp_path), ["base", "heads_1"]) == 5  # seed_0 ... seed_4; 'other' is not asked.


def test_a_failed_run_is_explained_by_its_last_attempt_only(tmp_path):
    log = tmp_path / train_processes.LOG_NAME
    log.write_text(
        "# sweep.py, 2026-11-22T10:00:00+00:00: train.py ...\nerror: No space left on device\n"
        "# sweep.py, 2026-11-23T10:00:00+00:00: train.py ...\nstep 3\nKilled\n",
        encoding="utf-8",
    )
    assert train_processes._last_error(str(log)) == "Killed"  # pylint: disable=protected-access


def test_metric_log_keeps_the_last_value_of_each_metric_per_step(tmp_path):
    workdir = str(tmp_path)
    metric_log.append(workdir, "train", 0, {"num_params": 1000})
    metric_log.append(workdir, "train", 10, {"loss": 5.0, "seconds": 2.0})
    metric_log.append(workdir, "train", 20, {"loss": 4.0, "seconds": 2.0})  # Lost in a kill after step 20...
    metric_log.append(workdir, "train", 10, {"num_params": 1000})  # ...resumed from step 10...
    metric_log.append(workdir, "train", 20, {"loss": 4.5, "seconds": 3.0})  # ...which repeats step 20.
    metric_log.append(workdir, "train", 30, {"loss": float("nan"), "seconds": 1.0})
    with open(Workdir(workdir).metrics("train"), "a", encoding="utf-8") as f:
        f.write('{"step": 40, "lo')  # Cut short.
    assert metric_log.read(workdir, "train") == {
        0: {"num_params": 1000},
        10: {"loss": 5.0, "seconds": 2.0, "num_params": 1000},
        20: {"loss": 4.5, "seconds": 3.0},
        30: {"loss": None, "seconds": 1.0},
    }
    assert metric_log.read(workdir, "valid") == {}


def test_runs_go_seed_by_seed_in_the_sweeps_order(tmp_path):
    runs = runner.plan_runs(str(tmp_path), ["base", "heads_1"], 2)
    assert [run.label for run in runs] == ["base/seed_0", "heads_1/seed_0", "base/seed_1", "heads_1/seed_1"]
    assert runs[3].workdir == str(tmp_path / "heads_1" / "seed_1")


def test_only_takes_variants_in_the_sweeps_order_and_names_a_missing_one():
    loaded = runner.load_sweep(os.path.join(REPO_ROOT, "configs", "sweeps", "table3.py"))
    assert runner.select_variants(loaded, ["post_ln", "base"]) == ["base", "post_ln"]
    with pytest.raises(UserInputError, match="No variant 'heads_99'.*its variants: base, heads_1"):
        runner.select_variants(loaded, ["heads_99"])


def test_a_variant_of_a_field_the_config_lacks_is_refused():
    variants = (Variant("base", "base", "b"), Variant("typo", "x", "y", {"model.num_haeds": 2}))
    base = table3.base_config()
    assert config_for(base, variants, "base").model.num_heads == base.model.num_heads
    with pytest.raises(UserInputError, match="'typo' sets model.num_haeds, a field this version's config does not"):
        config_for(base, variants, "typo")
    with pytest.raises(UserInputError, match="No variant 'other'"):
        config_for(base, variants, "other")
    wrong_type = (Variant("heads", "x", "y", {"model.num_heads": 4.0}),)
    with pytest.raises(UserInputError, match=r"'heads' sets model.num_heads=4.0, .*int"):
        config_for(base, wrong_type, "heads")


def test_table3_has_the_base_first_and_every_row_of_the_issue():
    loaded = runner.load_sweep(os.path.join(REPO_ROOT, "configs", "sweeps", "table3.py"))
    assert loaded.names()[0] == "base" and len(loaded.names()) >= 10
    groups = {variant.group[:3] for variant in loaded.variants}
    assert {"(A)", "(B)", "(C)", "(D)", "(E)", "(F)", "(G)", "(H)"} <= groups
    base = table3.get_config("base")
    assert (base.model.norm_placement, base.model.d_model, base.model.num_heads) == ("pre", 256, 4)
    for variant in loaded.variants:
        if variant.paper and variant.paper.bleu is not None:
            assert 20 < variant.paper.bleu < 30
        config = table3.get_config(variant.name)
        validate_config(config, num_devices=1)  # Every variant is a config train.py accepts.
        changed = {k for k, v in variant.overrides.items() if _get(config, k) != _get(base, k)}
        assert changed == set(variant.overrides) or variant.name == "base"
        # Heads at constant d_model: d_k = d_model / h stays whole.
        assert config.model.d_model % config.model.num_heads == 0


def _get(config, dotted):
    for part in dotted.split("."):
        config = config[part]
    return config


def test_a_file_without_variants_is_not_a_sweep(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text("def get_config():\n    return None\n", encoding="utf-8")
    with pytest.raises(UserInputError, match="is not a sweep file"):
        runner.load_sweep(str(path))
    with pytest.raises(UserInputError, match="No sweep file"):
        runner.load_sweep(str(tmp_path / "missing.py"))
    path.write_text(
        textwrap.dedent("""
        from configs.sweeps import Variant
        VARIANTS = (Variant("a:b", "x", "y"),)
        def get_config(v="a:b"):
            return None
        """),
        encoding="utf-8",
    )
    with pytest.raises(UserInputError, match="must be letters"):
        runner.load_sweep(str(path))
    path.write_text("VARIANTS = (('base', 'x', 'y'),)\ndef get_config(v='base'):\n    return None\n", encoding="utf-8")
    with pytest.raises(UserInputError, match="is not a sweep file"):  # Tuples, not Variants.
        runner.load_sweep(str(path))
    path.write_text(
        "from configs.sweeps import Variant\nVARIANTS = (Variant('base', 'x', 'y'),)\n"
        "def get_config():\n    return None\n",
        encoding="utf-8",
    )
    with pytest.raises(UserInputError, match="get_config must take the variant's name"):
        runner.load_sweep(str(path))
    folder = tmp_path / "sweeps:v2"  # ml_collections would read '--config=<path>' up to the ':' only.
    folder.mkdir()
    (folder / "table.py").write_text("", encoding="utf-8")
    with pytest.raises(UserInputError, match=r"holds a ':', which train.py cannot read; rename"):
        runner.load_sweep(str(folder / "table.py"))


def test_unused_paper_fields_default_to_none():
    assert Paper("not in Table 3").bleu is None


def test_the_dry_run_leaves_out_finished_runs_and_names_those_whose_config_cannot_be_built(tmp_path):
    path = tmp_path / "typo_sweep.py"
    path.write_text(
        textwrap.dedent("""
        from configs import tiny
        from configs.sweeps import Variant, config_for
        VARIANTS = (Variant("base", "base", "tiny"), Variant("typo", "x", "y", {"model.num_haeds": 2}))
        def get_config(variant="base"):
            return config_for(tiny.get_config(), VARIANTS, variant)
        """),
        encoding="utf-8",
    )
    loaded = runner.load_sweep(str(path))
    runs = runner.plan_runs(str(tmp_path / "runs"), loaded.names(), 2)
    lines, unbuildable = runner.pending_commands(loaded, runs, str(tmp_path / "runs"))
    assert [shlex.split(line)[2:4] for line in lines] == [
        [f"--config={path}:base", "--config.seed=0"],
        [f"--config={path}:base", "--config.seed=1"],
    ]
    assert [(run.label, "num_haeds" in why) for run, why in unbuildable] == [
        ("typo/seed_0", True),
        ("typo/seed_1", True),
    ]
    _write_scores(runs[0].workdir, loaded.get_config("base"))
    pending = runner.pending_commands(loaded, runs, str(tmp_path / "runs"))[0]
    assert [shlex.split(line)[3] for line in pending] == ["--config.seed=1"]
    # Collecting lists the runs that cannot have run as unfinished (base/seed_0 lacks its metric logs: no numbers).
    unfinished = report.collect(loaded, str(tmp_path / "runs"), runs).unfinished
    assert [run.label for run in unfinished] == ["typo/seed_0", "base/seed_1", "typo/seed_1"]
    assert "- typo/seed_1\n" in (tmp_path / "runs" / "results.md").read_text(encoding="utf-8")


def _write_sweep(path, dropout: float, log_every_steps: int = 100, beam_size: int = 1):
    """A two-variant sweep of the tiny config; the arguments are what an edit of the file changes."""
    path.write_text(
        textwrap.dedent(f"""
        from configs import tiny
        from configs.sweeps import Variant, config_for
        def base_config():
            config = tiny.get_config()
            config.log_every_steps = {log_every_steps}
            config.eval.beam_size = {beam_size}
            return config
        VARIANTS = (Variant("base", "base", "tiny"), Variant("drop", "x", "y", {{"model.dropout_rate": {dropout}}}))
        def get_config(variant="base"):
            return config_for(base_config(), VARIANTS, variant)
        """),
        encoding="utf-8",
    )
    return runner.load_sweep(str(path))


def test_a_run_trained_with_another_config_than_the_sweep_files_fails_and_is_not_counted(tmp_path):
    from training.inference import save_config  # pylint: disable=g-import-not-at-top  (JAX)

    path = tmp_path / "edited_sweep.py"
    loaded = _write_sweep(path, dropout=0.3)
    runs = runner.plan_runs(str(tmp_path / "runs"), loaded.names(), 2)  # base/0, drop/0, base/1, drop/1
    for run in runs[:3]:  # Trained and evaluated as the file was then: base/0, drop/0, base/1.
        trained = loaded.get_config(run.variant)
        trained.seed = run.seed  # As train.py's --config.seed sets it.
        os.makedirs(run.workdir)
        save_config(trained, run.workdir)
        _write_scores(run.workdir, loaded.run_config(run))
    assert [runner.config_changes(loaded.run_config(run), run.workdir) for run in runs] == [[], [], [], []]
    assert all(runner.is_finished(loaded.run_config(run), run.workdir) for run in runs[:3])

    # Edited: dropout 0.3 -> 0.5 in one variant; logging and decoding elsewhere, which change no training.
    edited = _write_sweep(path, dropout=0.5, log_every_steps=10, beam_size=4)
    base, drop = runs[:2]
    assert runner.config_changes(edited.run_config(base), base.workdir) == []
    assert runner.config_changes(edited.run_config(drop), drop.workdir) == ["model.dropout_rate: 0.3 → 0.5"]
    assert not runner.is_finished(edited.run_config(drop), drop.workdir)
    longer, shorter, resharded = (loaded.run_config(base) for _ in range(3))
    longer.num_train_steps += 1  # Resumes.
    shorter.num_train_steps -= 1  # Its last step is past.
    resharded.mesh.tensor = 2  # Fewer batch shards: another global batch.
    assert runner.config_changes(longer, base.workdir) == []
    steps = shorter.num_train_steps
    assert runner.config_changes(shorter, base.workdir) == [f"num_train_steps: {steps + 1} → {steps}"]
    assert runner.config_changes(resharded, base.workdir) == ["mesh.tensor: 1 → 2"]
    # The checkout moved: the same bundled file under another folder is no change; another corpus is.
    bundled = os.path.join(runner.REPOSITORY, "data", "libreoffice_help_en_de")
    for saved, now, changed in (
        ("/old/checkout/data/libreoffice_help_en_de", bundled, False),
        ("/old/checkout/data/other_corpus", bundled, True),
        ("/old/checkout/data/libreoffice_help_en_de", "/elsewhere/data/libreoffice_help_en_de", True),
    ):
        started, resumed = loaded.run_config(base), loaded.run_config(base)
        started.dataset.path, resumed.dataset.path = saved, now
        save_config(started, base.workdir)
        assert runner.config_changes(resumed, base.workdir) == (
            [f"dataset.path: {saved!r} → {now!r}"] if changed else []
        )
    save_config(loaded.run_config(base), base.workdir)

    lines, left_out = runner.pending_commands(edited, runs, str(tmp_path / "runs"))
    assert [shlex.split(line)[2:4] for line in lines] == [  # base/seed_0 is evaluated again: beam 4 now.
        [f"--config={path}:base", "--config.seed=0"],
        [f"--config={path}:base", "--config.seed=1"],
        [f"--config={path}:drop", "--config.seed=1"],
    ]
    assert left_out == [
        (
            drop,
            f"trained with another config than {path} gives now (model.dropout_rate: 0.3 → 0.5): "
            f"move {drop.workdir} away to train it again",
        )
    ]
    echoed = []
    outcome = train_processes.run_all(edited, [drop], str(tmp_path / "runs"), echo=echoed.append)  # Nothing trains.
    assert outcome.failed == left_out and not outcome.finished and not outcome.skipped
    assert echoed == [f"[1/1] drop/seed_0: FAILED ({left_out[0][1]})"]
    assert not os.path.exists(os.path.join(drop.workdir, train_processes.LOG_NAME))
    report.collect(edited, str(tmp_path / "runs"), runs)
    results_md = (tmp_path / "runs" / "results.md").read_text(encoding="utf-8")
    assert "- drop/seed_0 (trained with another config: model.dropout_rate: 0.3 → 0.5)" in results_md


def _result(variant, seed, bleu, perplexity, seconds=120.0):
    run = runner.Run(variant, seed, f"/runs/{variant}/seed_{seed}")
    curve = {100: 2 * perplexity, 200: perplexity}
    return report.RunResult(run, 200, 1000, seconds, perplexity, curve, bleu, 40.0, "signature", "greedy")


def test_summaries_estimate_each_variant_and_pair_its_seeds_with_the_base():
    variants = (Variant("base", "base", "b"), Variant("more", "x", "m"), Variant("none", "x", "n"))
    results = [
        _result("base", 0, 10.0, 50.0),
        _result("base", 1, 12.0, 40.0, seconds=180.0),
        _result("more", 1, 13.0, 38.0),  # Seed 0 did not finish.
    ]
    base, more, none = report.summarize(variants, results, {"base": 2, "more": 2, "none": 2})
    assert (base.estimates["test_bleu"].mean, base.estimates["test_bleu"].std) == (11.0, math.sqrt(2))
    assert base.estimates["train_minutes"].mean == pytest.approx(2.5)
    assert base.differences["test_bleu"] is None
    assert (more.estimates["test_bleu"].n, more.differences["test_bleu"].mean) == (1, 1.0)  # 13 - 12, seed 1.
    assert more.differences["valid_perplexity"].mean == -2.0
    assert none.estimates["test_bleu"] is None and none.differences["test_bleu"] is None and none.steps is None
    # Each seed's difference, over the seeds both finished: seed 1 only (seed 0 of "more" did not finish).
    assert (base.bleu_differences, more.bleu_differences, none.bleu_differences) == ({}, {1: 1.0}, {})
    figures = report.record_figures([base, more, none])["variants"]
    assert figures["more"]["test_bleu_by_seed"] == {"1": 13.0}
    assert figures["more"]["test_bleu_diff_by_seed"] == {"1": 1.0}
    assert figures["base"]["test_bleu_diff_by_seed"] == {} and figures["none"]["test_bleu_by_seed"] == {}


def _test_sentences(count: int) -> list[str]:
    with gzip.open(os.path.join(BUNDLED_CORPUS, "test.de.gz"), "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(count)]


def _write_finished_run(workdir: str, config, hypotheses: list[str], references: list[str]) -> None:
    """A run of `config` evaluated after its last step, its test translations written as evaluation writes them."""
    _write_scores(workdir, config)
    for name, lines in (("hypotheses.txt", hypotheses), ("references.txt", references)):
        with open(os.path.join(workdir, "eval", "test", name), "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)


def _sacrebleu_p_value(base: list[str], system: list[str], references: list[str]) -> float:
    """sacreBLEU's own paired bootstrap test (10,000 resamples, its default seed) of `system` against `base`."""
    named = [("base", base), ("system", system)]
    _, scores = PairedTest(named, {"BLEU": BLEU()}, [references], test_type="bs", n_samples=10_000)()
    return scores["BLEU"][1].p_value


@pytest.fixture
def synthetic_sweep(tmp_path):
    return write_synthetic_sweep(tmp_path)


def write_synthetic_sweep(tmp_path) -> dict:
    """Two seeds of four Table 3 variants, finished, with made-up translations of 60 test sentences.

    The base translates every sentence as the next one's reference (few n-grams right); heads_1
    gives the references themselves; key_16 gives the base's own translations; layers_1 the
    base's, but the first six sentences right.
    """
    references = _test_sentences(60)
    base = references[1:] + references[:1]
    translations = {"base": base, "heads_1": references, "key_16": base, "layers_1": references[:6] + base[6:]}
    root = str(tmp_path / "runs")
    runs = runner.plan_runs(root, list(translations), 2)
    for run in runs:
        _write_finished_run(run.workdir, table3.get_config(run.variant), translations[run.variant], references)
    loaded = runner.load_sweep(os.path.join(REPO_ROOT, "configs", "sweeps", "table3.py"))
    return {"root": root, "sweep": loaded, "runs": runs, "translations": translations, "references": references}


def test_bleu_significance_is_sacrebleus_paired_bootstrap_of_each_seed_against_the_base(synthetic_sweep):
    translations, references = synthetic_sweep["translations"], synthetic_sweep["references"]
    collected = report.collect(synthetic_sweep["sweep"], synthetic_sweep["root"], synthetic_sweep["runs"])
    rows = {s.variant.name: s for s in collected.summaries}
    base = translations["base"]
    assert rows["base"].significance is None
    # Far better than the base: every seed significant, with the p-value sacreBLEU's own test gives: its least,
    # 1/10,001, as no resample's difference exceeds the real one (~100 BLEU) by more than the resamples' mean.
    perfect = _sacrebleu_p_value(base, references, references)
    assert perfect == pytest.approx(1 / 10_001)
    assert rows["heads_1"].significance.p_values == {0: perfect, 1: perfect}
    assert rows["heads_1"].significance.significant == 2
    # The base's own translations: p = 1, no seed significant (sacreBLEU alone says 1/10,001: no resample exceeds 0).
    assert rows["key_16"].significance.p_values == {0: 1.0, 1: 1.0}
    assert rows["key_16"].significance.significant == 0
    assert _sacrebleu_p_value(base, list(base), references) == pytest.approx(1 / 10_001)
    # Six sentences of 60 right: sacreBLEU's p-value, whatever it is, on each seed.
    closer = _sacrebleu_p_value(base, translations["layers_1"], references)
    assert rows["layers_1"].significance.p_values == {0: closer, 1: closer}
    assert rows["smoothing_0"].significance is None  # No run.
    signature = rows["heads_1"].significance.signature
    assert "bs:10000" in signature and "seed:12345" in signature and "tok:13a" in signature
    # The table and the CSV show them.
    with open(os.path.join(synthetic_sweep["root"], "results.md"), encoding="utf-8") as f:
        markdown = f.read()
    assert f"| 2/2 ({perfect:.4f}, {perfect:.4f}) |" in markdown and "| 0/2 (1.0000, 1.0000) |" in markdown
    assert "| +0.00, +0.00 | 0/2 (1.0000, 1.0000) |" in markdown  # key_16: the base's own translations, each seed.
    assert signature in markdown
    with open(os.path.join(synthetic_sweep["root"], "results.csv"), encoding="utf-8") as f:
        csv_rows = {row["variant"]: row for row in csv.DictReader(f)}
    assert csv_rows["heads_1"]["test_bleu_p_values"] == f"0:{perfect!r} 1:{perfect!r}"
    assert csv_rows["heads_1"]["test_bleu_significant_seeds"] == "2"
    assert csv_rows["base"]["test_bleu_p_values"] == ""


def test_each_seed_is_compared_with_the_base_run_of_the_same_seed_on_the_same_references():
    references = tuple(_test_sentences(30))
    wrong = tuple(references[1:] + references[:1])
    translations = {
        "base": {0: Translations(wrong, references), 1: Translations(references, references)},
        # Seed 0 gives the base's seed-1 translations: compared with seed 0's, it differs; seed 1 is the base's own.
        "same": {0: Translations(references, references), 1: Translations(references, references)},
        "other_test_set": {0: Translations(wrong, wrong)},  # Other references: no paired test.
        "no_base_seed": {2: Translations(references, references)},
    }
    found = significance.against_base(translations, "base")
    assert set(found) == {"same"}
    assert found["same"].p_values == {0: _sacrebleu_p_value(list(wrong), list(references), list(references)), 1: 1.0}
    assert found["same"].describe() == f"1/2 ({found['same'].p_values[0]:.4f}, 1.0000)"


def test_test_translations_are_read_line_by_line_and_refused_when_cut(tmp_path):
    (tmp_path / "hypotheses.txt").write_text("ein Satz\r mit CR\n\nzwei\n", encoding="utf-8")
    (tmp_path / "references.txt").write_text("a\nb\nc\n", encoding="utf-8")
    assert significance.read_translations(str(tmp_path)) == Translations(
        ("ein Satz\r mit CR", "", "zwei"), ("a", "b", "c")
    )
    (tmp_path / "references.txt").write_text("a\nb\n", encoding="utf-8")  # A line short.
    assert significance.read_translations(str(tmp_path)) is None
    assert significance.read_translations(str(tmp_path / "missing")) is None


def test_the_sweep_writes_its_table_as_a_record(synthetic_sweep, tmp_path):
    root, path = synthetic_sweep["root"], str(tmp_path / "records" / "table3_test")
    table3_file = os.path.join(REPO_ROOT, "configs", "sweeps", "table3.py")
    result = _run_sweep(table3_file, root, "--collect", f"--record={path}")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(path + ".json", encoding="utf-8") as f:
        record = json.load(f)
    assert record["command"] == shlex.join(
        ["python", "sweep.py", *_sweep_args(table3_file, root)[2:], "--collect", f"--record={path}"]
    )
    assert record["measurement"] == "sweep configs/sweeps/table3.py"
    assert record["commit"] and record["machine"]["cores"] and record["software"]["sacrebleu"]
    unfinished = [f"{v.name}/seed_{k}" for k in (0, 1) for v in table3.VARIANTS if v.name not in ("base", "heads_1")]
    finished_too = ("key_16/seed_0", "key_16/seed_1", "layers_1/seed_0", "layers_1/seed_1")
    assert record["runs"]["trained"] == 0 and record["runs"]["finished_before"] is None  # --collect alone.
    assert sorted(record["runs"]["unfinished"]) == sorted(set(unfinished) - set(finished_too))
    heads_1 = record["figures"]["variants"]["heads_1"]
    references = synthetic_sweep["references"]
    p_value = _sacrebleu_p_value(synthetic_sweep["translations"]["base"], references, references)
    assert heads_1["test_bleu_p_values"] == {"0": p_value, "1": p_value} and heads_1["test_bleu_significant_seeds"] == 2
    assert heads_1["runs_finished"] == 2 and heads_1["test_bleu"] == {"mean": 20.0, "std": 0.0, "n": 2}
    # The page is results.md's, under the record's header.
    with open(path + ".md", encoding="utf-8") as f:
        page = f.read()
    with open(os.path.join(root, "results.md"), encoding="utf-8") as f:
        results_md = f.read()
    assert results_md.split("\n", 2)[2] in page and "- command: `python sweep.py " in page


def test_a_dry_run_has_nothing_to_record(tmp_path):
    result = _run_sweep(
        os.path.join(REPO_ROOT, "configs", "sweeps", "table3.py"), str(tmp_path), "--dry_run", "--record=x"
    )
    assert result.returncode == 1 and "--dry_run runs and collects nothing" in result.stderr


def test_the_run_in_progress_is_stopped_when_the_sweep_is_killed(tmp_path):
    """A sweep killed outright (SIGKILL) must not leave its train.py training, its workdir locked."""
    stopped = tmp_path / "stopped"
    train = (  # Stands in for train.py: on SIGTERM it stops, as train.py saves and stops.
        "import signal, sys, time; "
        f"signal.signal(signal.SIGTERM, lambda *_: (open({str(stopped)!r}, 'w').close(), sys.exit(143))); "
        "print('started', flush=True); time.sleep(120)"
    )
    sweep_process = (  # Starts it as the sweep starts train.py, then waits.
        "import functools, os, subprocess, sys, time; from sweeps import train_processes; "
        f"subprocess.Popen([sys.executable, '-c', {train!r}], start_new_session=True, "
        "preexec_fn=functools.partial(train_processes._stop_when_parent_dies, os.getpid())); time.sleep(120)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", sweep_process], cwd=REPO_ROOT, env=entry_point_env(), stdout=subprocess.PIPE
    )
    assert process.stdout.readline() == b"started\n"  # The child's line, on the pipe it inherited.
    process.kill()
    process.wait(timeout=60)
    deadline = time.monotonic() + 60
    while not stopped.exists():
        assert time.monotonic() < deadline, "the child went on after its sweep was killed"
        time.sleep(0.05)
