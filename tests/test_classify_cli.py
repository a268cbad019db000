"""Classification end to end through the command line: train.py trains and evaluates, classify.py classifies."""

import collections
import gzip
import json
import os

import pytest
from conftest import REPO_ROOT, WITHOUT_TENSORFLOW, run_entry_point
from test_bad_input import assert_clean_failure, snapshot

from training.reporting import attention_page

pytestmark = pytest.mark.slow

TOPICS = os.path.join(REPO_ROOT, "data", "libreoffice_help_topics")


def _bundled_rows(split: str, every: int) -> list[str]:
    with gzip.open(os.path.join(TOPICS, f"{split}.tsv.gz"), "rt", encoding="utf-8") as f:
        return f.read().splitlines()[::every]


@pytest.fixture(scope="module")
def topics_slice(tmp_path_factory) -> str:
    """Every 20th example of each bundled split (~1,400 train, ~75 valid and test, all 7 labels)."""
    folder = tmp_path_factory.mktemp("topics_slice")
    for split in ("train", "valid", "test"):
        (folder / f"{split}.tsv").write_text("\n".join(_bundled_rows(split, 20)) + "\n", encoding="utf-8")
    return str(folder)


@pytest.fixture(scope="module")
def trained_workdir(topics_slice, tmp_path_factory) -> str:
    """Trained and evaluated where TensorFlow is not installed (the base install)."""
    workdir = str(tmp_path_factory.mktemp("classify") / "run")
    trained = run_entry_point(
        WITHOUT_TENSORFLOW,
        "train.py",
        "--config=configs/classify_tiny.py",
        f"--workdir={workdir}",
        f"--config.dataset.path={topics_slice}",
        "--config.num_train_steps=4",
        "--config.eval_every_steps=2",
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    return workdir


def test_training_evaluates_the_test_split(trained_workdir, topics_slice):
    out = os.path.join(trained_workdir, "eval", "test")
    with open(os.path.join(out, "scores.json"), encoding="utf-8") as f:
        scores = json.load(f)
    test_rows = [line.split("\t") for line in open(os.path.join(topics_slice, "test.tsv"), encoding="utf-8")]
    train_labels = [line.split("\t")[0] for line in open(os.path.join(topics_slice, "train.tsv"), encoding="utf-8")]
    majority = collections.Counter(train_labels).most_common(1)[0][0]
    assert scores["step"] == 4 and scores["checkpoint"] == "step 4"
    assert scores["num_examples"] == len(test_rows)
    assert scores["majority_label"] == majority
    assert scores["majority_accuracy"] == pytest.approx(sum(row[0] == majority for row in test_rows) / len(test_rows))
    assert 0 <= scores["macro_f1"] <= 1 and 0 <= scores["accuracy"] <= 1
    with open(os.path.join(out, "predictions.tsv"), encoding="utf-8") as f:
        predictions = [line.rstrip("\n").split("\t") for line in f]
    assert predictions[0] == ["label", "prediction", "probability", "text"]
    assert [row[0] for row in predictions[1:]] == [row[0] for row in test_rows]  # The split's order.
    assert [row[3] for row in predictions[1:]] == [row[1].strip() for row in test_rows]
    accuracy = sum(row[0] == row[1] for row in predictions[1:]) / len(test_rows)
    assert accuracy == pytest.approx(scores["accuracy"])
    with open(os.path.join(out, "confusion_matrix.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.isdir(os.path.join(trained_workdir, "best_checkpoint"))
    assert os.listdir(os.path.join(trained_workdir, "tensorboard", "eval_test"))  # The attention maps.
    (page,) = attention_page.read_attention_page(os.path.join(out, "attention.html"))  # The first sentence's.
    assert page["source"] == test_rows[0][1].strip() and page["pieces"]["source"][-1] == "</s>"


def test_evaluating_the_best_checkpoint_on_valid(trained_workdir, topics_slice):
    result = run_entry_point(
        "train.py",
        "--config=configs/classify_tiny.py",
        f"--workdir={trained_workdir}",
        f"--config.dataset.path={topics_slice}",
        "--mode=eval",
        "--checkpoint=best",
        "--config.eval.split=valid",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(trained_workdir, "eval", "valid", "scores.json"), encoding="utf-8") as f:
        scores = json.load(f)
    assert scores["checkpoint"].startswith(f"best (step {scores['step']}, valid accuracy ")
    assert f"{scores['accuracy']:.4f}" in scores["checkpoint"]  # The best step's validation accuracy.


def test_classify_keeps_one_line_per_input_line(trained_workdir, tmp_path):
    lines = ["Select the cells you want to merge.", "", "Insert a chart into the slide.", "   ", "x " * 200]
    result = run_entry_point(
        "classify.py",
        f"--workdir={trained_workdir}",
        f"--attention_maps={tmp_path / 'maps'}",
        stdin="\n".join(lines) + "\n",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = result.stdout.split("\n")
    assert outputs[-1] == "" and len(outputs) == len(lines) + 1
    assert outputs[1] == "" and outputs[3] == ""
    with open(os.path.join(trained_workdir, "labels.tsv"), encoding="utf-8") as f:
        names = {line.split("\t")[0] for line in f}
    for output in (outputs[0], outputs[2], outputs[4]):
        label, probability = output.split("\t")
        assert label in names and 1 / len(names) <= float(probability) <= 1
    assert "Line 5 is longer than 32 subwords" in result.stderr
    assert sorted(os.listdir(tmp_path / "maps")) == ["index.html", "line_1", "line_3", "line_5"]
    assert os.listdir(tmp_path / "maps" / "line_1") == ["encoder_layer0_self_attention.png"]
    page = attention_page.read_attention_page(str(tmp_path / "maps" / "index.html"))
    assert [(s["name"], s["source"]) for s in page] == [(f"line {n}", lines[n - 1].strip()) for n in (1, 3, 5)]
    assert [list(s["weights"]) for s in page] == [["encoder/layer_0/self_attention"]] * 3
    assert "target" not in page[0]["pieces"]  # The classifier has no decoder.

    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.tsv"
    from_file = run_entry_point("classify.py", f"--workdir={trained_workdir}", f"--input={source}", f"--output={out}")
    assert from_file.returncode == 0, from_file.stderr[-3000:]
    assert out.read_text(encoding="utf-8") == result.stdout


def test_classify_reports_bad_requests_in_one_line(trained_workdir, tmp_path):
    translation = tmp_path / "translation_run"
    translation.mkdir()
    (translation / "config.json").write_text(json.dumps({"task": "translation"}), encoding="utf-8")
    cases = [
        ([f"--workdir={trained_workdir}", f"--output={tmp_path / 'no' / 'out.tsv'}"], "Cannot write --output="),
        ([f"--workdir={translation}"], "holds a translation run, not a classifier"),
        ([f"--workdir={tmp_path / 'nothing'}"], "config.json does not exist"),
    ]
    for flags, message in cases:
        assert_clean_failure(run_entry_point("classify.py", *flags, stdin="Click OK.\n"), message)
    translate = run_entry_point("translate.py", f"--workdir={trained_workdir}", stdin="Click OK.\n")
    assert_clean_failure(translate, "holds a classification run, not a translation model; use classify.py")


def test_bad_labelled_data_stops_training_before_anything_is_written(tmp_path, topics_slice):
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "valid", "test"):
        text = open(os.path.join(topics_slice, f"{split}.tsv"), encoding="utf-8").read()
        if split == "valid":
            text = text.replace("\n", "\nno tab on this line\n", 1)
        (folder / f"{split}.tsv").write_text(text, encoding="utf-8")
    workdir = tmp_path / "workdir"
    result = run_entry_point(
        "train.py", "--config=configs/classify_tiny.py", f"--workdir={workdir}", f"--config.dataset.path={folder}"
    )
    assert_clean_failure(result, f"{folder / 'valid.tsv'}, line 2: expected 'label<TAB>text'")
    assert snapshot(str(workdir)) is None
