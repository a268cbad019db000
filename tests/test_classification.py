"""The encoder classifier: model and pooling, loss and metrics, labelled data, and the config checks."""

import dataclasses
import gzip
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import TINY_MODEL, write_tfds_metadata

from common.errors import UserInputError
from common.special_ids import BOS_ID, EOS_ID, PAD_ID
from configs import classify, classify_tiny
from input_pipeline import batching, datasets, labelled_text
from input_pipeline.batching import LabelledIds, RaggedIds, TrainBatches
from input_pipeline.labels import labels_from_training, load_labels, save_labels
from input_pipeline.record_source import ArrayRecordSource
from input_pipeline.tokenizer import train_tokenizer
from models.build import init_boxed_params, make_model
from models.classifier import Classifier, ClassifierConfig, mean_over_real_tokens
from training.config_checks import validate_config
from training.tasks import classification, classification_metrics

NUM_CLASSES = 5
ENCODER = dataclasses.replace(TINY_MODEL, num_decoder_layers=0)


def _classifier(pooling="mean", **overrides):
    return Classifier(ClassifierConfig(dataclasses.replace(ENCODER, **overrides), NUM_CLASSES, pooling))


def _ids(rows: list[list[int]], length: int) -> jnp.ndarray:
    """Rows of real ids (each ending with EOS) padded to `length`."""
    padded = np.full((len(rows), length), PAD_ID, np.int32)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    return jnp.asarray(padded)


ROWS = [[5, 6, 7, EOS_ID], [8, EOS_ID], [9, 10, 11, 12, 13, EOS_ID]]


# --- The model -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_logits_shape_and_parameters(pooling):
    model = _classifier(pooling)
    boxed = init_boxed_params(model, jax.random.PRNGKey(0))
    logits = model.apply({"params": nn.unbox(boxed)}, _ids(ROWS, 8), deterministic=True)
    assert logits.shape == (3, NUM_CLASSES) and logits.dtype == jnp.float32
    assert set(boxed) == {"token_embedding", "encoder", "head"}
    assert {f"layers_{i}" for i in range(ENCODER.num_encoder_layers)} <= set(boxed["encoder"])
    assert boxed["head"]["kernel"].names == ("embed", "classes")
    assert boxed["head"]["bias"].names == ("classes",)
    assert nn.unbox(boxed)["head"]["kernel"].shape == (ENCODER.d_model, NUM_CLASSES)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_padding_does_not_change_the_logits(pooling):
    model = _classifier(pooling, max_len=32)
    params = nn.unbox(init_boxed_params(model, jax.random.PRNGKey(1)))
    short = model.apply({"params": params}, _ids(ROWS, 6), deterministic=True)
    long = model.apply({"params": params}, _ids(ROWS, 24), deterministic=True)
    # Padded keys get weight exactly 0; only float32 summation order may differ (~1e-7 relative of O(1) logits).
    np.testing.assert_allclose(short, long, rtol=1e-5, atol=1e-5)


def test_mean_pooling_averages_the_real_tokens_only():
    encoded = jax.random.normal(jax.random.PRNGKey(2), (3, 7, 4))
    inputs = _ids(ROWS[:2] + [[]], 7)  # The last row is all padding (a filler row).
    pooled = np.asarray(mean_over_real_tokens(encoded, inputs, PAD_ID))
    np.testing.assert_allclose(pooled[0], np.asarray(encoded)[0, :4].mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(pooled[1], np.asarray(encoded)[1, :2].mean(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(pooled[2], np.zeros(4))


def test_cls_pooling_reads_the_encoding_of_a_token_put_first():
    model = _classifier("cls")
    params = nn.unbox(init_boxed_params(model, jax.random.PRNGKey(3)))
    inputs = _ids(ROWS, 8)
    assert model.apply({"params": params}, inputs, method=Classifier.encoder_inputs)[:, 0].tolist() == [BOS_ID] * 3

    def logits_from_first_position(module, inputs):
        encoded = module.encoder(module.encoder_inputs(inputs), deterministic=True)
        return module.head(encoded[:, 0])

    expected = model.apply({"params": params}, inputs, method=logits_from_first_position)
    np.testing.assert_allclose(model.apply({"params": params}, inputs, deterministic=True), expected, rtol=1e-6)
    mean = _classifier("mean")  # Same parameters, other pooling: other logits.
    assert not np.allclose(mean.apply({"params": params}, inputs, deterministic=True), expected, atol=1e-3)


def test_make_model_builds_the_classifier_of_the_config():
    config = classify_tiny.get_config()
    model = make_model(config, vocab_size=40, num_classes=7)
    assert isinstance(model, Classifier)
    assert model.config.num_classes == 7 and model.config.pooling == "mean"
    assert model.config.encoder.num_encoder_layers == config.model.num_layers
    assert model.config.encoder.num_decoder_layers == 0


# --- Loss and metrics ------------------------------------------------------------------------------------


def test_classification_loss_sums_over_real_examples():
    model = _classifier(dropout_rate=0.0, attention_dropout_rate=0.0)
    params = nn.unbox(init_boxed_params(model, jax.random.PRNGKey(4)))
    inputs = _ids([*ROWS, []], 8)  # A filler row at the end.
    labels = jnp.array([0, 3, 4, 2], jnp.int32)
    batch = {"inputs": inputs, "labels": labels}
    loss, sums = classification.classification_loss(
        params, batch, jax.random.PRNGKey(0), model=model, label_smoothing=0.0
    )
    logits = np.asarray(model.apply({"params": params}, inputs, deterministic=True), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    nll = -log_probs[np.arange(4), np.asarray(labels)][:3]
    assert float(sums["tokens"]) == 3.0  # Examples, not tokens; the filler row weighs nothing.
    np.testing.assert_allclose(float(loss), nll.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(sums["nll"]), nll.sum(), rtol=1e-5)
    assert float(sums["correct"]) == float(np.sum(logits[:3].argmax(axis=1) == np.asarray(labels)[:3]))


def _numpy_macro_f1(labels, predictions):
    """Macro-F1 the textbook way: per class precision and recall, F1 = 2PR / (P + R), over classes that occur."""
    f1s = []
    for c in sorted(set(labels) | set(predictions)):
        tp = sum(1 for y, p in zip(labels, predictions) if y == c and p == c)
        predicted = sum(1 for p in predictions if p == c)
        actual = sum(1 for y in labels if y == c)
        precision = tp / predicted if predicted else 0.0
        recall = tp / actual if actual else 0.0
        f1s.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    return sum(f1s) / len(f1s)


def test_scores_against_a_numpy_transcription():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 300)
    predictions = np.where(rng.random(300) < 0.6, labels, rng.integers(0, 5, 300))  # Class 4 is never true.
    confusion = classification_metrics.confusion_matrix(labels, predictions, 6)  # Class 5: never seen.
    assert confusion.sum() == 300 and confusion[2, 3] == np.sum((labels == 2) & (predictions == 3))
    scores = classification_metrics.scores(confusion)
    assert scores["accuracy"] == pytest.approx(np.mean(labels == predictions), abs=1e-12)
    assert scores["macro_f1"] == pytest.approx(_numpy_macro_f1(labels.tolist(), predictions.tolist()), abs=1e-12)


def test_split_scores_include_the_majority_class():
    probabilities = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4], [0.6, 0.3, 0.1]], np.float32)
    labels = np.array([0, 1, 1, 2])
    scores = classification.split_scores(probabilities, labels, majority=1)
    assert scores["accuracy"] == 0.5 and scores["majority_accuracy"] == 0.5
    assert scores["loss"] == pytest.approx(-np.mean(np.log([0.7, 0.8, 0.3, 0.1])), rel=1e-6)


def test_confusion_matrix_figure_names_every_class():
    confusion = np.array([[5, 1, 0], [2, 7, 1], [0, 0, 3]])
    figure = classification_metrics.confusion_matrix_figure(confusion, ["calc", "writer", "math"], "test")
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["calc", "writer", "math"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["calc (6)", "writer (10)", "math (3)"]
    assert sorted(t.get_text() for t in ax.texts) == sorted(str(n) for n in confusion.ravel())


# --- Labelled examples and batches ----------------------------------------------------------------------


def test_labelled_batches_pad_inputs_and_carry_labels():
    examples = LabelledIds(RaggedIds.from_lists(ROWS), np.array([2, 0, 1], np.int32))
    batch = examples.padded(np.array([2, 0]), length=8, batch_size=4)
    assert batch["inputs"].shape == (4, 8) and batch["labels"].tolist() == [1, 2, 0, 0]
    assert batch["inputs"][0, :6].tolist() == ROWS[2] and batch["inputs"][1, :4].tolist() == ROWS[0]
    assert not batch["inputs"][2:].any()  # Filler rows: padding only.
    stream = TrainBatches(examples, (4, 8), {4: 2, 8: 1}, seed=0)
    seen = [next(stream) for _ in range(4)]
    assert all(set(b) == {"inputs", "labels"} for b in seen)
    assert {tuple(b["inputs"][0][b["inputs"][0] != PAD_ID]) for b in seen} <= {tuple(r) for r in ROWS}


def _write_tsv(folder, name, lines, compress=False):
    path = os.path.join(folder, name + (".gz" if compress else ""))
    opener = gzip.open if compress else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    return path


def test_labelled_text_builder_reads_any_folder(tmp_path, monkeypatch, without_tensorflow):
    """Prepared in ArrayRecord files and read back by random access, as translation's records are: no TensorFlow."""
    folder = str(tmp_path / "data")
    os.makedirs(folder)
    _write_tsv(folder, "train.tsv", ["pos\tGood film.", "neg\tBad film.", "", "pos\t   ", "neg\tDull."], compress=True)
    _write_tsv(folder, "test.tsv", ["neg\tAwful.", "pos\tGreat."])
    monkeypatch.setattr(tfds.core.DatasetBuilder, "as_dataset", lambda *_, **__: pytest.fail("read with tf.data"))
    dataset = classify_tiny.get_config().dataset
    dataset.path, dataset.data_dir = folder, str(tmp_path / "tfds")
    builder = datasets.make_labelled_builder(dataset, str(tmp_path / "work"), required_splits=("train",))
    assert isinstance(builder, labelled_text.LabelledText)
    assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
    assert sorted(os.listdir(builder.data_dir)) == [
        "dataset_info.json",
        "features.json",
        "labelled_text-test.array_record-00000-of-00001",
        "labelled_text-train.array_record-00000-of-00001",
    ]
    assert isinstance(datasets.records(builder, "train"), ArrayRecordSource)
    train = datasets.load_labelled_texts(builder, "train")
    assert train.texts == ["Good film.", "Bad film.", "Dull."] and train.labels == ["pos", "neg", "neg"]
    assert datasets.load_labelled_texts(builder, "test").labels == ["neg", "pos"]
    assert sorted(builder.info.splits) == ["test", "train"]


@pytest.mark.parametrize(
    "files, message",
    [
        ({"train.tsv": ["pos\tGood.", "no tab here"]}, r"train\.tsv, line 2: expected 'label<TAB>text'"),
        ({"train.tsv": ["pos\tGood.", "\tNo label."]}, r"train\.tsv, line 2: expected 'label<TAB>text'"),
        ({"train.tsv": ["pos\tGood."], "test.tsv": ["pos\tOk.", "meh\tSo so."]}, r"test\.tsv, line 2: label 'meh'"),
        ({"train.tsv": ["", "  "]}, r"train\.tsv holds no example"),
        ({"valid.tsv": ["pos\tGood."]}, r"Missing .*train\.tsv \(or \.gz\)"),
    ],
)
def test_labelled_text_errors_name_the_file_and_line(tmp_path, files, message):
    for name, lines in files.items():
        _write_tsv(str(tmp_path), name, lines)
    with pytest.raises(UserInputError, match=message):
        labelled_text.check_labelled_files(str(tmp_path), required_splits=("train",))


def test_labelled_text_rejects_bytes_that_are_not_utf8(tmp_path):
    (tmp_path / "train.tsv").write_bytes(b"pos\tGood.\nneg\tBad \xff.\n")
    with pytest.raises(UserInputError, match=r"train\.tsv, line 2: bytes that are not UTF-8"):
        labelled_text.check_labelled_files(str(tmp_path), required_splits=("train",))


def test_tokenize_labelled_cuts_long_sentences_and_keeps_eos(tmp_path):
    texts = labelled_text.LabelledTexts(["Select the cells. " * 20, "Click OK."], ["calc", "writer"])
    tokenizer = train_tokenizer(texts.texts * 20 + ["Insert a chart."] * 20, str(tmp_path / "t.model"), vocab_size=24)
    ids = datasets.tokenize_labelled(texts, tokenizer, {"calc": 0, "writer": 1}, max_length=12)
    assert ids.lengths.tolist()[0] == 12 and ids.sources[0][-1] == EOS_ID
    assert ids.sources[1].tolist() == tokenizer.encode("Click OK.") + [EOS_ID]
    assert ids.labels.tolist() == [0, 1]
    with pytest.raises(UserInputError, match=r"Labels \['math'\] do not occur in the training split"):
        datasets.tokenize_labelled(dataclasses.replace(texts, labels=["math", "calc"]), tokenizer, {"calc": 0}, 12)


def test_labels_survive_the_workdir_and_name_the_majority(tmp_path):
    labels = labels_from_training(["b", "a", "b", "c", "b", "a"], None)
    assert labels.names == ("a", "b", "c") and labels.train_counts == (2, 3, 1) and labels.majority == 1
    save_labels(labels, str(tmp_path))
    assert load_labels(str(tmp_path)) == labels
    declared = labels_from_training(["pos"], ["neg", "pos"])  # A TFDS ClassLabel's order is kept.
    assert declared.names == ("neg", "pos") and declared.train_counts == (0, 1)
    with pytest.raises(UserInputError, match=r"labels\.tsv .*holds no trained classifier"):
        load_labels(str(tmp_path / "elsewhere"))


# --- Named TFDS datasets (offline, mock_data) --------------------------------------------------------------


class FakeReviews(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A named dataset as imdb_reviews is (one Text, one ClassLabel), prepared here by TFDS's own writer."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        features = {"text": tfds.features.Text(), "label": tfds.features.ClassLabel(names=["neg", "pos"])}
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict(features), disable_shuffling=True
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        return {
            "train": self._generate_examples([("Good film.", 1), ("Bad film.", 0), ("Dull.", 0)]),
            "test": self._generate_examples([("Not labelled.", -1)]),  # As GLUE's test splits.
        }

    def _generate_examples(self, rows):
        for key, (text, label) in enumerate(rows):
            yield key, {"text": text, "label": label}


def test_a_named_dataset_prepared_as_array_record_is_read_by_random_access(tmp_path, monkeypatch, without_tensorflow):
    """Read from its files (the builder's code not needed), record by record, as translation reads: no TensorFlow."""
    data_dir = str(tmp_path / "tfds")
    FakeReviews(data_dir=data_dir).download_and_prepare(file_format="array_record")
    monkeypatch.setattr(tfds.core.DatasetBuilder, "as_dataset", lambda *_, **__: pytest.fail("read with tf.data"))
    dataset = classify_tiny.get_config().dataset
    dataset.name, dataset.path, dataset.data_dir = "fake_reviews", "", data_dir

    builder = datasets.make_labelled_builder(dataset, str(tmp_path / "work"), required_splits=("train",))

    assert isinstance(datasets.records(builder, "train"), ArrayRecordSource)
    assert datasets.text_and_label_features(builder) == ("text", "label", ["neg", "pos"])
    train = datasets.load_labelled_texts(builder, "train")
    assert train.texts == ["Good film.", "Bad film.", "Dull."] and train.labels == ["pos", "neg", "neg"]
    with pytest.raises(UserInputError, match=r"Split 'test' of 'fake_reviews' has unlabelled examples \(label -1\)"):
        datasets.load_labelled_texts(builder, "test")


@pytest.mark.parametrize(
    "name, splits, names",
    [
        ("imdb_reviews", {"train": 20, "test": 10}, ["neg", "pos"]),
        ("glue/sst2", {"train": 20, "validation": 10, "test": 10}, ["negative", "positive"]),
    ],
)
def test_named_text_classification_datasets_under_mock_data(tmp_path, name, splits, names, without_tensorflow):
    metadata = write_tfds_metadata(tmp_path / "metadata", name, splits)
    dataset = classify_tiny.get_config().dataset
    dataset.name, dataset.path, dataset.data_dir = name, "", str(tmp_path / "tfds")
    with tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_FILES, data_dir=metadata):
        builder = datasets.make_labelled_builder(dataset, str(tmp_path / "work"), required_splits=tuple(splits))
        texts = datasets.load_labelled_texts(builder, "train")
        with pytest.raises(UserInputError, match=r"has no split 'valid'"):
            datasets.make_labelled_builder(dataset, str(tmp_path / "work"), required_splits=("train", "valid"))
    assert datasets.text_and_label_features(builder)[2] == names
    assert len(texts) == 6 and all(isinstance(t, str) for t in texts.texts)
    assert set(texts.labels) <= set(names)


def test_preparing_a_named_classification_dataset_without_tensorflow_says_how_to_install_it(
    tmp_path, monkeypatch, without_tensorflow
):
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", lambda *_, **__: pytest.fail("prepared"))
    dataset = classify_tiny.get_config().dataset
    dataset.name, dataset.path, dataset.data_dir = "imdb_reviews", "", str(tmp_path / "tfds")
    with pytest.raises(UserInputError) as error:
        datasets.make_labelled_builder(dataset, str(tmp_path / "work"), required_splits=("train",))
    assert str(error.value).startswith(
        "preparing the TFDS dataset 'imdb_reviews' needs TensorFlow: pip install -e \".[tensorflow]\" (or prepare it"
    )


def test_a_translation_dataset_is_not_text_classification(tmp_path):
    metadata = write_tfds_metadata(tmp_path / "metadata", "wmt14_translate/de-en", {"train": 10})
    dataset = classify_tiny.get_config().dataset
    dataset.name, dataset.path, dataset.data_dir = "wmt14_translate/de-en", "", str(tmp_path / "tfds")
    with (
        tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_FILES, data_dir=metadata),
        pytest.raises(
            UserInputError,
            match=r"not single-text classification: it has text features \['de', 'en'\] and label features \[\]",
        ),
    ):
        datasets.make_labelled_builder(dataset, str(tmp_path / "work"), required_splits=("train",))


# --- Config checks ---------------------------------------------------------------------------------------


def test_the_classification_configs_are_valid():
    validate_config(classify.get_config(), num_devices=1)
    validate_config(classify_tiny.get_config(), num_devices=1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"task": "tagging"}, r"config\.task is 'tagging'; choose one of \('translation', 'classification'\)"),
        ({"model.pooling": "max"}, r"config\.model\.pooling is 'max'"),
        ({"dataset.path": ""}, r"'labelled_text' but config\.dataset\.path is empty"),
        ({"dataset.name": "parallel_text"}, r"'parallel_text', a dataset for another task"),
        (
            {"model.pooling": "cls", "model.max_len": 64, "eval.max_decode_length": 64},
            r"config\.model\.max_len \(64\) must be at least 65",
        ),
    ],
)
def test_bad_classification_configs_name_the_field(overrides, message):
    config = classify.get_config()
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    with pytest.raises(UserInputError, match=message):
        validate_config(config, num_devices=1)


def test_batching_of_labelled_examples_in_eval_order():
    examples = LabelledIds(RaggedIds.from_lists(ROWS), np.array([2, 0, 1], np.int32))
    batches = list(batching.eval_batches(examples, (4, 8), {4: 2, 8: 2}))
    assert [indices.tolist() for _, indices in batches] == [[1, 0], [2]]
    assert batches[1][0]["labels"].tolist() == [1, 0]
