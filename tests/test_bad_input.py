"""Bad input stops a run with one clear `error:` line, a non-zero exit and an untouched workdir.

Each CLI case runs the real `train.py` in a subprocess (a few seconds each: it
imports JAX); fast function-level tests cover more variants.
"""

import gzip
import hashlib
import importlib
import os
import subprocess

import pytest
from conftest import BUNDLED_CORPUS as CORPUS
from conftest import WITHOUT_TENSORFLOW, run_entry_point, tiny_config

from common.errors import UserInputError
from configs import default, tiny
from input_pipeline.parallel_text import check_parallel_files
from training import loop
from training.config_checks import validate_config

NUM_LINES = 12
BAD_LINE = 5  # 1-based line number of the non-UTF-8 line.


def snapshot(path) -> dict | None:
    """{relative path: (size, sha256) or 'dir'} of everything under `path`; None if it does not exist."""
    if not os.path.exists(path):
        return None
    tree = {}
    for folder, dirs, files in os.walk(path):
        for name in dirs:
            tree[os.path.relpath(os.path.join(folder, name), path)] = "dir"
        for name in files:
            full = os.path.join(folder, name)
            with open(full, "rb") as f:
                tree[os.path.relpath(full, path)] = (
                    os.path.getsize(full),
                    hashlib.sha256(f.read()).hexdigest(),
                )
    return tree


def test_snapshot_sees_changes(tmp_path):
    assert snapshot(tmp_path / "nothing") is None
    assert snapshot(tmp_path) == {}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    before = snapshot(tmp_path)
    assert before == {"a": "dir", os.path.join("a", "f"): (1, hashlib.sha256(b"x").hexdigest())}
    (tmp_path / "a" / "f").write_text("y")
    assert snapshot(tmp_path) != before
    (tmp_path / "a" / "f").write_text("x")
    (tmp_path / "a" / "g").mkdir()
    assert snapshot(tmp_path) != before


def make_workdir(tmp_path, exists: bool) -> str:
    """A workdir path; if `exists`, a folder already holding an unrelated file and folder."""
    workdir = tmp_path / "workdir"
    if exists:
        (workdir / "notes").mkdir(parents=True)
        (workdir / "notes" / "README.txt").write_text("my earlier notes\n")
    return str(workdir)


# --- Bad data folders -------------------------------------------------------------------------------------


def bundled_lines(split: str, lang: str) -> list[bytes]:
    with gzip.open(os.path.join(CORPUS, f"{split}.{lang}.gz"), "rb") as f:
        return [next(f).rstrip(b"\n") for _ in range(NUM_LINES)]


def write(path: str, lines: list[bytes]) -> None:
    data = b"".join(line + b"\n" for line in lines)
    if path.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)


# kind -> (file changed, the message must name it with these words). {path} is the changed file.
BAD_DATA = {
    "missing_file": ("valid.de", ["Missing {path} (or .gz)", "split 'valid'"]),
    "empty_file": ("train.de", ["{path} is empty", "one sentence per line"]),
    "line_counts_differ": ("train.de", ["train.en", "has 12 lines but {path} has 11", "line i of one"]),
    "not_utf8": ("train.en", ["{path}, line 5:", "not UTF-8", "iconv"]),
}


def make_bad_folder(folder, kind: str, gz: bool = False) -> str:
    """Writes NUM_LINES pairs of every split of the bundled corpus, with one defect; returns the bad path."""
    os.makedirs(folder)
    suffix = ".gz" if gz else ""
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            write(os.path.join(folder, f"{split}.{lang}{suffix}"), bundled_lines(split, lang))
    name, _ = BAD_DATA[kind]
    path = os.path.join(folder, name + suffix)
    lines = bundled_lines(*name.split("."))
    if kind == "missing_file":
        os.remove(path)
        return os.path.join(folder, name)  # Named without .gz.
    if kind == "empty_file":
        lines = []
    elif kind == "line_counts_differ":
        lines = lines[:-1]
    elif kind == "not_utf8":
        lines[BAD_LINE - 1] += " caf\u00e9".encode("latin-1")
    write(path, lines)
    return path


def expected_words(kind: str, path: str) -> list[str]:
    return [words.format(path=path) for words in BAD_DATA[kind][1]]


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("kind", sorted(BAD_DATA))
def test_check_parallel_files_names_the_file(tmp_path, kind, gz):
    folder = str(tmp_path / "data")
    path = make_bad_folder(folder, kind, gz)
    with pytest.raises(UserInputError) as error:
        check_parallel_files(folder, "en", "de", required_splits=("train", "valid"))
    message = str(error.value)
    for words in expected_words(kind, path):
        assert words in message
    assert "\n" not in message


def test_check_parallel_files_accepts_good_files(tmp_path):
    folder = str(tmp_path / "data")
    make_bad_folder(folder, "empty_file")
    write(os.path.join(folder, "train.de"), bundled_lines("train", "de"))  # Repaired.
    files = check_parallel_files(folder, "en", "de", required_splits=("train", "valid"))
    assert sorted(files) == ["test", "train", "valid"]
    assert all(f.num_lines == NUM_LINES for f in files.values())


def test_check_parallel_files_blank_lines_only_is_empty(tmp_path):
    folder = str(tmp_path / "data")
    make_bad_folder(folder, "empty_file")
    write(os.path.join(folder, "train.de"), [b""] * NUM_LINES)
    with pytest.raises(UserInputError, match=r"train\.de is empty"):
        check_parallel_files(folder, "en", "de", required_splits=("train",))


def test_missing_dataset_folder(tmp_path):
    with pytest.raises(UserInputError, match=rf"Dataset folder {tmp_path}/nowhere does not exist"):
        check_parallel_files(str(tmp_path / "nowhere"), "en", "de", required_splits=("train",))


# --- Bad configs, function level --------------------------------------------------------------------------


def _fields(tree: dict, prefix: str = "") -> set[str]:
    """The dotted names of the leaves of a config's `to_dict()`."""
    names = set()
    for name, value in tree.items():
        names |= _fields(value, f"{prefix}{name}.") if isinstance(value, dict) else {prefix + name}
    return names


@pytest.mark.parametrize("name", ["quickstart", "tiny", "classify", "classify_tiny"])
def test_every_config_has_the_fields_of_the_default(name):
    """The config checks read every field: each config is the default's, with values changed, none added."""
    config = importlib.import_module(f"configs.{name}").get_config()
    assert _fields(config.to_dict()) == _fields(default.get_config().to_dict())


def test_tiny_config_is_valid():
    validate_config(tiny.get_config())  # The baseline of the cases below passes.


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"model.num_heads": 3},
            r"config\.model\.d_model \(32\) is not divisible by config\.model\.num_heads \(3\)",
        ),
        ({"model.d_model": 30, "model.num_heads": 4}, r"config\.model\.d_model \(30\) is not divisible"),
        ({"model.num_layers": 0}, r"config\.model\.num_layers is 0; it must be positive"),
        ({"per_device_batch_size": -1}, r"config\.per_device_batch_size is -1; it must be positive"),
        ({"eval.per_device_batch_size": 0}, r"config\.eval\.per_device_batch_size is 0"),
        ({"tokenizer.vocab_size": -5}, r"config\.tokenizer\.vocab_size is -5"),
        ({"model.num_heads": 0}, r"config\.model\.num_heads is 0"),
        ({"model.num_encoder_layers": 0}, r"config\.model\.num_encoder_layers is 0"),
        ({"model.dropout_rate": 1.0}, r"config\.model\.dropout_rate must be in \[0, 1\)"),
        ({"model.dtype": "float16"}, r"config\.model\.dtype is 'float16'; choose one of"),
        ({"dataset.bucket_boundaries": (16, 24)}, r"config\.dataset\.bucket_boundaries \(16, 24\)"),
        ({"dataset.bucket_boundaries": (32, 16, 32)}, r"config\.dataset\.bucket_boundaries"),
        ({"dataset.path": ""}, r"config\.dataset\.path is\s+empty"),
        ({"dataset.target_lang": "en"}, r"source_lang and target_lang are both 'en'"),
        ({"eval.max_decode_length": 129}, r"config\.eval\.max_decode_length \(129\) exceeds config\.model\.max_len"),
        ({"eval.num_bleu_sentences": -1}, r"config\.eval\.num_bleu_sentences must be >= 0"),
        ({"seed": -1}, r"config\.seed is -1; it must be an integer in \[0, 2\*\*63\)"),
        ({"dataset.packing_lookahead": -1}, r"config\.dataset\.packing_lookahead is -1; it must be 0 \(first fit\)"),
        ({"optimizer.schedule": "noam"}, r"config\.optimizer\.schedule is 'noam'; choose one of \('paper', 'rsqrt'\)"),
        ({"optimizer.peak_learning_rate": 0.0}, r"peak_learning_rate is 0\.0; schedule 'rsqrt' needs a positive peak"),
        ({"optimizer.learning_rate_scale": 2.0}, r"learning_rate_scale is 2\.0 but applies to schedule 'paper' only"),
        (
            {"optimizer.schedule": "paper"},  # The tiny config's peak would be ignored.
            r"peak_learning_rate is 0\.001 but schedule 'paper' takes its peak from config\.model\.d_model",
        ),
        (
            {"optimizer.schedule": "paper", "optimizer.peak_learning_rate": None, "optimizer.learning_rate_scale": 0.0},
            r"config\.optimizer\.learning_rate_scale is 0\.0; it must be positive",
        ),
    ],
)
def test_validate_config_names_the_field(overrides, message):
    with pytest.raises(UserInputError, match=message):
        validate_config(tiny_config(**overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mesh.data": 3}, r"config\.mesh \(data=3, fsdp=1, tensor=1\) does not fit the 8 devices"),
        ({"mesh.fsdp": 3}, r"config\.mesh \(data=-1, fsdp=3, tensor=1\) does not fit the 8 devices"),
        ({"mesh.fsdp": -1}, r"at most one of them -1"),
        (
            {"mesh.tensor": 4},
            r"config\.model\.num_heads \(2\) is not divisible by 4, the size of mesh axes \('tensor',\)",
        ),
        (
            {"mesh.tensor": 2, "tokenizer.vocab_size": 301},
            r"config\.tokenizer\.vocab_size \(301\) is not divisible by 2",
        ),
        ({"mesh.rules": (("batch", "data"), ("embed", "model"))}, r"maps 'embed' to \['model'\]"),
        ({"step_compilation": "pmap", "mesh.fsdp": 2}, r"step_compilation='pmap' is data parallel only"),
        ({"step_compilation": "pjit"}, r"config\.step_compilation is 'pjit'; choose one of"),
        ({"grad_accumulation_steps": 0}, r"config\.grad_accumulation_steps is 0; it must be positive"),
    ],
)
def test_validate_config_names_the_mesh_problem(overrides, message):
    validate_config(tiny_config(), num_devices=8)  # The baseline fits 8 devices.
    with pytest.raises(UserInputError, match=message):
        validate_config(tiny_config(**overrides), num_devices=8)


def test_pmap_with_several_processes_names_jit(monkeypatch):
    validate_config(tiny_config(step_compilation="pmap"), num_devices=8)  # One process: fine.
    monkeypatch.setattr("jax.process_count", lambda: 2)
    with pytest.raises(UserInputError, match=r"'pmap' runs in one process.*2 processes: use step_compilation='jit'"):
        validate_config(tiny_config(step_compilation="pmap"), num_devices=8)


# --- Evaluating a workdir without checkpoints, function level ---------------------------------------------


@pytest.mark.parametrize("exists", [True, False], ids=["empty_workdir", "no_workdir"])
def test_evaluate_checkpoint_needs_a_checkpoint(tmp_path, exists):
    workdir = tmp_path / "workdir"
    if exists:
        workdir.mkdir()
    with pytest.raises(UserInputError, match=rf"No checkpoints in {workdir}/checkpoints: train first"):
        loop.evaluate_checkpoint(tiny.get_config(), str(workdir))
    assert snapshot(workdir) == ({} if exists else None)


# --- The command line -------------------------------------------------------------------------------------


def run_train(workdir: str, *args: str) -> subprocess.CompletedProcess:
    return run_entry_point("train.py", "--config=configs/tiny.py", f"--workdir={workdir}", *args)


def assert_clean_failure(result: subprocess.CompletedProcess, *names: str) -> None:
    """Non-zero exit, no traceback, and one `error:` line (the last) naming `names`."""
    stderr = result.stderr
    assert result.returncode != 0, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), stderr
    assert sum(line.startswith("error:") for line in lines) == 1, stderr
    for name in names:
        assert name in lines[-1], f"{name!r} not in {lines[-1]!r}"


@pytest.mark.parametrize(
    "args, names, workdir_exists",
    [
        (
            ["--config.model.num_heads=3"],
            ["config.model.d_model", "config.model.num_heads", "divides"],
            False,
        ),
        (["--config.model.num_layers=0"], ["config.model.num_layers is 0", "must be positive"], True),
        (["--config.per_device_batch_size=-1"], ["config.per_device_batch_size is -1", "positive"], False),
        (["--config.dataset.name=no_such_dataset"], ["'no_such_dataset'", "wmt14_translate/de-en"], True),
        (
            ["--config.model.no_such_field=1"],
            ["--config.model.no_such_field", "no field 'no_such_field'", "the config file"],
            True,
        ),
        (["--config.model.num_layer=2"], ["--config.model.num_layer:", 'Did you mean "num_layers"'], False),
    ],
    ids=["heads_divide_d_model", "zero_layers", "negative_batch", "unknown_dataset", "unknown_field", "typo"],
)
def test_cli_bad_config(tmp_path, args, names, workdir_exists):
    workdir = make_workdir(tmp_path, workdir_exists)
    before = snapshot(workdir)
    result = run_train(workdir, *args)
    assert_clean_failure(result, *names)
    assert snapshot(workdir) == before


def test_cli_bad_flag_value_is_one_line(tmp_path):
    """absl's own flag errors are one line naming the flag (and exit non-zero, untouched workdir)."""
    workdir = make_workdir(tmp_path, False)
    result = run_train(workdir, "--config.model.num_layers=abc")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "--config.model.num_layers=abc" in line]
    assert len(error_lines) == 1 and "Flags parsing error" in error_lines[0], result.stderr
    assert snapshot(workdir) is None


@pytest.mark.parametrize(
    "kind, workdir_exists",
    [("missing_file", True), ("empty_file", False), ("line_counts_differ", False), ("not_utf8", True)],
)
def test_cli_bad_data(tmp_path, kind, workdir_exists):
    folder = str(tmp_path / "data")
    path = make_bad_folder(folder, kind)
    workdir = make_workdir(tmp_path, workdir_exists)
    before = snapshot(workdir)
    result = run_train(workdir, "--config.dataset.name=parallel_text", f"--config.dataset.path={folder}")
    assert_clean_failure(result, *expected_words(kind, path))
    assert snapshot(workdir) == before


@pytest.mark.parametrize(
    "config, dataset, extra_args",
    [
        ("tiny", "wmt14_translate/de-en", []),
        ("classify_tiny", "glue/sst2", ["--config.dataset.valid_split=validation", "--config.eval.split=validation"]),
    ],
)
def test_cli_named_dataset_to_prepare_without_tensorflow(tmp_path, config, dataset, extra_args):
    """TensorFlow is an extra: preparing a named TFDS dataset without it is one line naming the dataset and extra."""
    workdir, data_dir = tmp_path / "workdir", tmp_path / "tfds"
    result = run_entry_point(
        WITHOUT_TENSORFLOW,
        "train.py",
        f"--config=configs/{config}.py",
        f"--workdir={workdir}",
        f"--config.dataset.name={dataset}",
        "--config.dataset.path=",
        f"--config.dataset.data_dir={data_dir}",
        *extra_args,
    )
    assert_clean_failure(
        result, f"error: preparing the TFDS dataset '{dataset}' needs TensorFlow: pip install -e \".[tensorflow]\""
    )
    assert snapshot(workdir) is None and snapshot(data_dir) is None


@pytest.mark.parametrize("workdir_exists", [True, False], ids=["empty_workdir", "no_workdir"])
def test_cli_eval_without_checkpoints(tmp_path, workdir_exists):
    workdir = tmp_path / "workdir"
    if workdir_exists:
        workdir.mkdir()
    before = snapshot(workdir)
    result = run_train(str(workdir), "--mode=eval")
    assert_clean_failure(result, f"No checkpoints in {workdir}/checkpoints", "train first", str(workdir))
    assert snapshot(workdir) == before
