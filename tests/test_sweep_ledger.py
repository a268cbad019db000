"""A sweep's ledger (sweeps/ledger.py): finished runs kept small in the repository, skipped on any machine,
refused when they differ from its pins, collected alone; the budget, the job slots, Holm's correction."""

import csv
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO_ROOT, entry_point_env
from test_sweep import _test_sentences, _write_finished_run, write_synthetic_sweep

from common.workdir import Workdir
from configs.sweeps import table3
from sweeps import budget, ledger, report, runner, significance, train_processes
from sweeps.ledger import Ledger, LedgerMismatch
from training.reporting import attempts, metric_log

_COMMIT = "a" * 40
_TOKENIZER = b"a SentencePiece model, as bytes"
_TABLE3 = os.path.join(REPO_ROOT, "configs", "sweeps", "table3.py")


def _attempt(**changes) -> dict:
    """An attempts.jsonl line as training/loop.py writes it, on a 2-core CPU in float32."""
    return {
        "commit": _COMMIT,
        "uncommitted_changes": False,
        "step": 600,
        "cpu_model": "Some CPU",
        "cpu_kind": "cpu-avx2",
        "cores": 2,
        "platform": "cpu",
        "device_kind": "cpu",
        "device_count": 1,
        "process_count": 1,
        "dtype": "float32",
        "software": {"python": "3.11.7", "jax": "0.10.2"},
        "wall_seconds": 600.0,
        "seconds": {"setup": 10.0, "compile": 20.0, "train": 500.0, "evaluation": 40.0},
        **changes,
    }


def _complete(run: runner.Run) -> None:
    """What else training leaves in a finished run's workdir (besides test_sweep's scores and translations):
    its config, tokenizer, metric logs and attempt."""
    workdir = Workdir(run.workdir)
    config = table3.get_config(run.variant)
    config.seed = run.seed
    with open(workdir.config, "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(sort_keys=True))
    with open(workdir.tokenizer, "wb") as f:
        f.write(_TOKENIZER)
    metric_log.append(run.workdir, "train", 0, {"num_params": 1_000_000})
    for step in (300, 600):
        metric_log.append(run.workdir, "train", step, {"seconds": 250.0, "model_flops_per_second": 1e11})
        metric_log.append(run.workdir, "valid", step, {"loss": 3.0, "perplexity": 20.0 - step / 100})
    attempts.append(workdir.attempts, _attempt())


@pytest.fixture
def sweep_runs(tmp_path):
    """test_sweep's synthetic sweep (two seeds of four Table 3 variants, finished), completed, and a ledger."""
    synthetic = write_synthetic_sweep(tmp_path)
    for run in synthetic["runs"]:
        _complete(run)
    return {**synthetic, "ledger": Ledger(str(tmp_path / "ledgers" / "table3_cpu"))}


def _sweep_cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "sweep.py", *flags],
        cwd=REPO_ROOT,
        env=entry_point_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_run_in_the_ledger_is_skipped_and_a_finished_run_folder_is_added(sweep_runs, monkeypatch):
    in_ledger, finished = sweep_runs["runs"][:2]
    the_ledger = sweep_runs["ledger"]
    the_ledger.add(in_ledger, "test")
    shutil.rmtree(in_ledger.workdir)  # Another machine: only the ledger holds it.

    def no_training(*args):
        raise AssertionError(f"train.py started for {args[1].label}")

    monkeypatch.setattr(train_processes, "_start", no_training)
    said = []
    outcome = train_processes.run_all(
        sweep_runs["sweep"], [in_ledger, finished], sweep_runs["root"], ledger=the_ledger, echo=said.append
    )
    assert outcome.skipped == [in_ledger, finished] and not outcome.failed
    assert said[0] == "[1/2] base/seed_0: in the ledger, skipped."
    assert said[1] == "[2/2] heads_1/seed_0: finished before, skipped; copied into the ledger."
    assert the_ledger.has(finished)


def test_an_entry_holds_the_run_small_and_its_wall_time_by_phase(sweep_runs):
    run = sweep_runs["runs"][0]
    summary = sweep_runs["ledger"].add(run, "test")
    entry = sweep_runs["ledger"].entry(run.variant, run.seed)
    files = sorted(os.path.relpath(os.path.join(d, f), entry) for d, _, names in os.walk(entry) for f in names)
    assert files == [
        "config.json",
        "eval/test/hypotheses.txt.gz",
        "eval/test/scores.json",
        "metrics/train.jsonl",
        "metrics/valid.jsonl",
        "run.json",
    ]
    assert sum(os.path.getsize(os.path.join(entry, f)) for f in files) < 50_000
    # The four phases add up to the wall time: start-up is what the others leave (imports, data, saves).
    assert summary["seconds"] == {"wall": 600.0, "start_up": 40.0, "compile": 20.0, "train": 500.0, "evaluation": 40.0}
    assert summary["model_flops"] == 2 * 250.0 * 1e11
    assert (summary["commit"], summary["dtype"], summary["device_count"]) == (_COMMIT, "float32", 1)
    with open(os.path.join(sweep_runs["ledger"].path, ledger.PINS_FILE), encoding="utf-8") as f:
        assert json.load(f)["commit"] == _COMMIT
    assert os.path.exists(sweep_runs["ledger"].references)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"commit": "b" * 40}, f"commit {'b' * 12} here, {'a' * 12} in the ledger"),
        ({"dtype": "bfloat16"}, "dtype bfloat16 here, float32 in the ledger"),
        ({"device_count": 8}, "device_count 8 here, 1 in the ledger"),
        ({"platform": "gpu"}, "platform gpu here, cpu in the ledger"),
    ],
)
def test_a_run_of_another_commit_dtype_device_count_or_platform_is_refused_with_one_line(sweep_runs, changes, named):
    first, other = sweep_runs["runs"][:2]
    sweep_runs["ledger"].add(first, "test")
    attempts.append(Workdir(other.workdir).attempts, _attempt(**changes))  # A resumed attempt on other terms.
    with pytest.raises(LedgerMismatch) as refused:
        sweep_runs["ledger"].add(other, "test")
    message = str(refused.value)
    assert "\n" not in message and named in message and "git worktree add" in message
    assert not sweep_runs["ledger"].has(other)


def test_runs_of_uncommitted_code_or_another_tokenizer_are_refused(sweep_runs):
    first, dirty, other_tokenizer = sweep_runs["runs"][:3]
    attempts.append(Workdir(dirty.workdir).attempts, _attempt(uncommitted_changes=True))
    with pytest.raises(LedgerMismatch, match="uncommitted code"):
        sweep_runs["ledger"].add(dirty, "test")  # Not even as the first run.
    sweep_runs["ledger"].add(first, "test")
    with open(Workdir(other_tokenizer.workdir).tokenizer, "wb") as f:
        f.write(b"another model")
    with pytest.raises(LedgerMismatch, match="tokenizer_sha256"):
        sweep_runs["ledger"].add(other_tokenizer, "test")


def test_collecting_from_the_ledger_alone_gives_the_table_of_the_run_folders(sweep_runs, tmp_path):
    sweep, runs = sweep_runs["sweep"], sweep_runs["runs"]
    every_run = runner.plan_runs(sweep_runs["root"], sweep.names(), 2)  # The unfinished ones are listed too.
    from_folders = report.collect(sweep, str(tmp_path / "from_folders"), every_run)
    for run in runs:
        sweep_runs["ledger"].add(run, "test")
    shutil.rmtree(sweep_runs["root"])
    from_ledger = report.collect(sweep, str(tmp_path / "from_ledger"), sweep_runs["ledger"].runs(sweep.names(), 2))
    assert from_ledger.page == from_folders.page
    assert from_ledger.summaries[1].significance.p_values  # Hypotheses read back from the gzipped entries.
    for name in ("results.md", "results.csv", "results_runs.csv"):
        with open(tmp_path / "from_folders" / name, encoding="utf-8") as a, open(tmp_path / "from_ledger" / name) as b:
            assert a.read() == b.read(), name


def test_a_partial_ledger_gives_a_partial_record_naming_its_missing_runs(sweep_runs, tmp_path):
    for run in sweep_runs["runs"][:3]:  # base, heads_1, key_16 of seed 0.
        sweep_runs["ledger"].add(run, "test")
    path = str(tmp_path / "record" / "table3_cpu")
    result = _sweep_cli(
        f"--sweep={_TABLE3}",
        f"--root={tmp_path / 'collected'}",
        f"--ledger={sweep_runs['ledger'].path}",
        "--seeds=1",
        "--collect",
        f"--record={path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(path + ".json", encoding="utf-8") as f:
        record = json.load(f)
    missing = sorted(f"{v.name}/seed_0" for v in table3.VARIANTS if v.name not in ("base", "heads_1", "key_16"))
    assert record["runs"]["in_ledger"] == 3 and record["runs"]["planned"] == len(table3.VARIANTS)
    assert sorted(record["runs"]["unfinished"]) == missing
    assert record["commit"] == _COMMIT and record["uncommitted_changes"] is False  # The ledger's, not HEAD.
    assert record["machine"]["cpu_kind"] == "cpu-avx2" and record["machine"]["runs_by_machine"]
    with open(path + ".md", encoding="utf-8") as f:
        page = f.read()
    assert f"3 of {len(table3.VARIANTS)} runs finished" in page
    assert all(f"- {label}" in page for label in missing)
    for picture in ("table3_cpu_bleu.png", "table3_cpu_valid_curves.png"):  # Beside the record, shown on its page.
        assert f"]({picture})" in page
        assert (tmp_path / "record" / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_KILLED_WHILE_COPYING = """
import os, signal, sys
from sweeps import ledger, runner
copied = []
def copy_then_die(source, target):
    copied.append(target)
    if len(copied) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    original(source, target)
original, ledger._copy = ledger._copy, copy_then_die
ledger.Ledger(sys.argv[1]).add(runner.Run(sys.argv[2], 0, sys.argv[3]), "test")
"""


def test_a_sweep_killed_while_copying_leaves_the_ledger_readable(sweep_runs, tmp_path):
    first, killed = sweep_runs["runs"][:2]
    the_ledger = sweep_runs["ledger"]
    the_ledger.add(first, "test")
    process = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_COPYING, the_ledger.path, killed.variant, killed.workdir],
        cwd=REPO_ROOT,
        env=entry_point_env(),
        capture_output=True,
        timeout=120,
    )
    assert process.returncode == -9, process.stderr[-2000:]
    assert not the_ledger.has(killed) and not os.path.exists(the_ledger.entry(killed.variant, killed.seed))
    collected = report.collect(sweep_runs["sweep"], str(tmp_path / "out"), the_ledger.runs(["base", "heads_1"], 1))
    assert [len(s.results) for s in collected.summaries[:2]] == [1, 0]
    # The same run added again: whole, and what the killed copy left is gone.
    the_ledger.add(killed, "test")
    assert the_ledger.has(killed)
    assert os.listdir(os.path.dirname(the_ledger.entry(killed.variant, 0))) == ["seed_0"]


def test_a_run_trained_again_is_set_beside_the_ledgers_and_one_trained_otherwise_is_refused(sweep_runs, tmp_path):
    base = next(run for run in sweep_runs["runs"] if (run.variant, run.seed) == ("base", 0))
    sweep_runs["ledger"].add(base, "test")
    again = Workdir(shutil.copytree(base.workdir, tmp_path / "again"))
    references = sweep_runs["references"]  # The base translated each sentence as the next one's reference.
    translations = references[:20] + sweep_runs["translations"]["base"][20:]  # The first 20 differ.
    with open(os.path.join(again.evaluation("test"), "hypotheses.txt"), "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in translations)
    output = tmp_path / "record"

    def compare() -> subprocess.CompletedProcess:
        flags = [f"--ledger={sweep_runs['ledger'].path}", "--run=base/seed_0", f"--workdir={again.root}"]
        return subprocess.run(
            [sys.executable, "-m", "benchmarks.ledger_rerun", *flags, f"--output={output}"],
            cwd=REPO_ROOT,
            env=entry_point_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )

    compared = compare()
    assert compared.returncode == 0, compared.stderr[-2000:]
    with open(f"{output}.json", encoding="utf-8") as f:
        figures = json.load(f)["figures"]
    assert (figures["identical_translations"], figures["sentences"]) == (len(references) - 20, len(references))
    assert figures["ledger"]["commit"] == figures["again"]["commit"] == _COMMIT
    assert figures["again"]["machine"] == "Some CPU (cpu-avx2), 2 cores"
    # Its test translations gone: one line says so, and nothing is compared.
    os.rename(os.path.join(again.evaluation("test"), "hypotheses.txt"), tmp_path / "hypotheses.txt")
    missing = compare()
    assert missing.returncode == 2 and "with its test translations" in missing.stderr.strip().splitlines()[-1]
    os.rename(tmp_path / "hypotheses.txt", os.path.join(again.evaluation("test"), "hypotheses.txt"))
    # Trained at another commit: not the ledger's run, one line says so.
    os.remove(again.attempts)
    attempts.append(again.attempts, _attempt(commit="b" * 40))
    refused = compare()
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: {again.root} was not trained as the ledger's run: train it with the ledger's command."
    )


def test_holm_adjusts_each_p_value_by_its_rank_and_keeps_them_ordered():
    p_values = {"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005}
    # Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> 0.06 (never below the one before).
    assert significance.holm(p_values) == pytest.approx({"d": 0.02, "a": 0.03, "c": 0.06, "b": 0.06})
    assert significance.holm({"x": 0.4, "y": 0.5}) == {"x": 0.8, "y": 0.8}
    assert significance.holm({"x": 0.9}) == {"x": 0.9} and significance.holm({}) == {}


def test_the_bootstrap_resolves_p_values_small_enough_to_survive_holm_over_all_of_table_3():
    # Every variant but the base against the base, on each of three seeds: 66 tests.
    tests = (len(table3.VARIANTS) - 1) * 3
    # A bootstrap's least p-value is 1/(resamples + 1); with sacreBLEU's default 1,000, Holm rejects nothing past 50.
    least = 1 / (significance.RESAMPLES + 1)
    adjusted = significance.holm({test: least for test in range(tests)})
    # Adjusted, it rejects with room to spare: a p-value a few times the least survives too.
    assert max(adjusted.values()) == pytest.approx(tests * least) and tests * least < significance.LEVEL / 5


def test_the_tables_significance_is_holm_corrected_over_every_variant_and_seed(sweep_runs, tmp_path):
    collected = report.collect(sweep_runs["sweep"], str(tmp_path / "out"), sweep_runs["runs"])
    tested = {s.variant.name: s.significance for s in collected.summaries if s.significance}
    raw = {(name, seed): p for name, s in tested.items() for seed, p in s.p_values.items()}
    assert len(raw) == 6  # Three variants, two seeds each, in one family.
    expected = significance.holm(raw)
    for name, s in tested.items():
        assert s.holm_p_values == {seed: expected[name, seed] for seed in s.p_values}
    with open(tmp_path / "out" / "results.csv", encoding="utf-8") as f:
        rows = {row["variant"]: row for row in csv.DictReader(f)}
    assert rows["heads_1"]["test_bleu_significant_seeds_after_holm"] == str(tested["heads_1"].significant_after_holm)
    assert "Holm" in "\n".join(collected.page)


def test_a_run_is_predicted_to_take_the_measured_time_times_its_flops_ratio():
    base, wide = table3.get_config("base"), table3.get_config("d_model_512")
    assert budget.run_flops(wide) / budget.run_flops(base) == pytest.approx(2.6, abs=0.1)  # The arithmetic.
    now = [0.0]
    measured = 600.0 / budget.run_flops(base)  # A base run took 10 minutes here.
    plan = budget.Budget(30 * 60, ledger_rates=[measured], clock=lambda: now[0])
    assert plan.predicted_seconds(base) == pytest.approx(600.0)
    assert plan.allows(wide) == (True, pytest.approx(600.0 * budget.run_flops(wide) / budget.run_flops(base)))
    now[0] = 20 * 60.0  # 10 minutes left: a base run fits, d_model 512 (~26 min) does not.
    assert plan.allows(base)[0] and not plan.allows(wide)[0]
    plan.observe(base, 300.0)  # This sweep's own runs replace the ledger's rate.
    assert plan.predicted_seconds(base) == pytest.approx(300.0)


class _FinishedAtOnce:
    """Stands in for train.py's process: the run it was started for is finished when it is polled."""

    def __init__(self, run: runner.Run, references: list[str]):
        self.run, self.references = run, references

    def poll(self) -> int:
        if not os.path.exists(Workdir(self.run.workdir).scores("test")):
            _write_finished_run(self.run.workdir, table3.get_config(self.run.variant), self.references, self.references)
        return 0


def test_only_runs_trained_from_their_first_step_measure_the_budget(tmp_path, monkeypatch):
    """A resumed run's wall time is a part of a run's: taken as a whole one, it would predict runs too short."""
    references = _test_sentences(10)
    fresh, resumed = runner.plan_runs(str(tmp_path / "runs"), ["base", "heads_1"], 1)
    os.makedirs(os.path.join(Workdir(resumed.workdir).checkpoints, "347"))
    monkeypatch.setattr(train_processes, "_start", lambda sweep, run, *_: _FinishedAtOnce(run, references))
    observed = []

    class Recording(budget.Budget):
        def observe(self, config, wall_seconds):
            observed.append(config.model.num_heads)

    sweep = runner.load_sweep(_TABLE3)
    outcome = train_processes.run_all(sweep, [fresh, resumed], str(tmp_path / "runs"), budget=Recording(None))
    assert outcome.finished == [fresh, resumed] and observed == [4]  # base's 4 heads; heads_1 was resumed.


def test_counting_a_runs_flops_starts_no_jax_backend():
    """The sweep process must not take a GPU (JAX's 75% of its memory) that its runs need: JAX_PLATFORMS names a
    platform this machine lacks, so that starting any backend would fail."""
    code = "from configs.sweeps import table3; from sweeps import budget; print(budget.run_flops(table3.get_config()))"
    env = {**entry_point_env(), "JAX_PLATFORMS": "tpu"}
    counted = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert counted.returncode == 0, counted.stderr[-2000:]
    assert int(counted.stdout) == budget.run_flops(table3.get_config()) > 0


def test_each_job_gets_its_own_cores_or_gpus():
    cores = [0, 1]
    assert train_processes.slot_environment(0, 1, cores, []) == ({}, [0, 1])
    assert [train_processes.slot_environment(slot, 2, cores, [])[1] for slot in (0, 1)] == [[0], [1]]
    gpus = ["0", "1", "2", "3"]
    assert [train_processes.slot_environment(s, 2, cores, gpus)[0] for s in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    shared, shared_cores = train_processes.slot_environment(1, 4, cores, ["0"])  # Four runs on one GPU.
    assert shared == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"} and shared_cores == cores
    assert train_processes.slot_environment(2, 3, cores, [])[1] == [0]  # More jobs than cores: they share.


_TINY_SWEEP = '''
from configs import tiny
from configs.sweeps import Variant, config_for


def base_config():
    config = tiny.get_config()
    config.dataset.path = {corpus!r}
    return config


VARIANTS = (Variant("base", "base", "tiny"),)


def get_config(variant="base"):
    return config_for(base_config(), VARIANTS, variant)
'''


def test_a_machine_at_another_commit_is_refused_before_any_run_trains(small_corpus, tmp_path):
    sweep_file = tmp_path / "tiny_sweep.py"
    sweep_file.write_text(textwrap.dedent(_TINY_SWEEP.format(corpus=small_corpus)), encoding="utf-8")
    ledger_folder = tmp_path / "ledger"
    ledger_folder.mkdir()
    pins = {"commit": "b" * 40, "platform": "cpu", "device_count": 1, "dtype": "float32", "tokenizer_sha256": "c"}
    (ledger_folder / ledger.PINS_FILE).write_text(json.dumps(pins), encoding="utf-8")
    root = tmp_path / "runs"
    result = _sweep_cli(f"--sweep={sweep_file}", f"--root={root}", f"--ledger={ledger_folder}")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: This machine differs from the ledger") and f"{'b' * 12} in the ledger" in line
    assert not os.path.exists(root / "base")  # Nothing trained.
    # The preparation ran once: the data and the tokenizer every run would share, and what it ran on.
    prepared = Workdir(runner.prepared_folder(str(root)))
    assert os.path.exists(prepared.tokenizer) and os.path.isdir(prepared.tfds)
    (environment,) = attempts.read(prepared.attempts)
    assert environment["platform"] == "cpu" and environment["dtype"] == "float32" and environment["step"] == 0
