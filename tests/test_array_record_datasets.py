"""Translation data prepared once in ArrayRecord files and read back by random access (input_pipeline.corpus).

A run prepares the dataset on its first start; later starts open the prepared
records and never read the text files again; the train split stays on disk
(`Corpus.train_records`), the evaluation splits are read and tokenized whole.
"""

import copy
import os
import random

import pytest
import tensorflow_datasets as tfds
from array_record.python.array_record_module import ArrayRecordWriter
from conftest import tiny_config, write_corpus_slice
from tensorflow_datasets.proto import tf_example_pb2

from common.errors import UserInputError
from common.workdir import Workdir
from input_pipeline import datasets
from input_pipeline.corpus import load_corpus
from input_pipeline.record_source import ArrayRecordSource, encode_text_example
from input_pipeline.text_lines import TextPairs, read_lines

SPLITS = ("train", "valid", "test")
LANGS = ("en", "de")


def file_pairs(folder, split: str) -> list[tuple[str, str]]:
    """The (source, target) lines of a split's files, stripped, as the builder keeps them."""
    pairs = zip(read_lines(os.path.join(folder, f"{split}.en")), read_lines(os.path.join(folder, f"{split}.de")))
    return [(s.strip(), t.strip()) for s, t in pairs]


def record_pairs(records) -> list[tuple[str, str]]:
    return [(records[i]["en"].decode("utf-8"), records[i]["de"].decode("utf-8")) for i in range(len(records))]


@pytest.fixture
def corpus_dir(tmp_path) -> str:
    """300 train pairs (three of them with an empty side), 30 valid and 30 test pairs of the bundled corpus."""
    folder = write_corpus_slice(str(tmp_path / "corpus"), {"train": 300, "valid": 30, "test": 30})
    for lang, blank_lines in (("en", (0, 41)), ("de", (41, 299))):
        path = os.path.join(folder, f"train.{lang}")
        lines = list(read_lines(path))
        for number in blank_lines:
            lines[number] = "  "
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
    return folder


def config_for(corpus_dir: str, tmp_path):
    return tiny_config(
        corpus_dir, **{"dataset.data_dir": str(tmp_path / "tfds"), "dataset.valid_split": "valid", "seed": 3}
    )


def test_preparing_writes_array_record_files_of_the_files_pairs_in_order(tmp_path, corpus_dir):
    config = config_for(corpus_dir, tmp_path)
    builder = datasets.make_builder(config.dataset, str(tmp_path / "work"), required_splits=SPLITS)

    assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
    files = os.listdir(builder.data_dir)
    for split in SPLITS:
        assert any(name.startswith(f"parallel_text-{split}.array_record-") for name in files), files
    assert not any("tfrecord" in name for name in files)
    for split in SPLITS:
        assert record_pairs(datasets.records(builder, split)) == file_pairs(corpus_dir, split)
    assert len(datasets.records(builder, "train")) == 300  # Lines 1, 42 and 300, with an empty side, too.


def test_the_record_source_reads_what_tfds_reads_across_shards(tmp_path, corpus_dir):
    """ArrayRecordSource (one-record range reads) gives TFDS's records, also split over shards and once copied."""
    config = config_for(corpus_dir, tmp_path)
    builder = datasets.make_builder(config.dataset, str(tmp_path / "work"), required_splits=SPLITS)
    source = datasets.records(builder, "train")
    assert isinstance(source, ArrayRecordSource)
    expected = builder.as_data_source("train")
    order = random.Random(0).sample(range(len(source)), len(source))
    assert [source[i] for i in order] == expected.__getitems__(order)
    # The same file as two "shards" of one record each end: indices map across shard boundaries.
    path = builder.info.splits["train"].filepaths[0]
    split = ArrayRecordSource([path, path], [len(source), len(source)], builder.info.features)
    assert len(split) == 2 * len(source)
    assert split[len(source) + 5] == source[5]
    # Copied through __getstate__, as grain hands the source to worker processes: open readers stay behind.
    assert copy.deepcopy(split)[len(source) - 1] == source[len(source) - 1]
    with pytest.raises(IndexError):
        source[len(source)]


@pytest.mark.parametrize(
    "features, examples, parsed_by_protobuf",
    [
        (
            {"en": tfds.features.Text(), "de": tfds.features.Text()},
            [{"en": "Öffnen", "de": ""}, {"en": "a b", "de": "ß"}],
            True,
        ),
        (tfds.features.Translation(languages=["de", "en"]), [{"en": "Open", "de": "Öffnen"}], True),
        (  # Not all text, or text that may be missing: decoded by the features.
            {"text": tfds.features.Text(), "label": tfds.features.ClassLabel(names=["no", "yes"])},
            [{"text": "x", "label": 1}, {"text": "", "label": 0}],
            False,
        ),
        (
            {"text": tfds.features.Text(), "note": tfds.features.Text(optional=True)},
            [{"text": "x", "note": None}, {"text": "y", "note": "z"}],
            False,
        ),
    ],
)
def test_the_record_source_decodes_as_the_features_do(tmp_path, monkeypatch, features, examples, parsed_by_protobuf):
    if isinstance(features, dict):
        features = tfds.features.FeaturesDict(features)
    path = str(tmp_path / "records.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for example in examples:
        writer.write(features.serialize_example(example))
    writer.close()
    expected = [features.deserialize_example_np(features.serialize_example(example)) for example in examples]
    if parsed_by_protobuf:  # The features' own decoding (~10x slower) is not called.
        monkeypatch.setattr(type(features), "deserialize_example_np", lambda *_: pytest.fail("decoded by the features"))
    source = ArrayRecordSource([path], [len(examples)], features)
    for index, example in enumerate(expected):
        decoded = source[index]
        assert decoded.keys() == example.keys()
        for key in example:
            assert type(decoded[key]) is type(example[key]) and decoded[key] == example[key], (key, decoded)


def test_text_records_are_written_as_the_features_write_them():
    """The builder's own encoder: the same tf.train.Example as TFDS's serializer, decoded by the features alike."""
    features = tfds.features.FeaturesDict({"en": tfds.features.Text(), "de": tfds.features.Text()})
    for example in ({"en": "Open the file.", "de": "Öffnen Sie die Datei."}, {"en": "ß – 日本 \t", "de": "x"}):
        written = encode_text_example(example)
        parsed = tf_example_pb2.Example.FromString(written)
        assert parsed == tf_example_pb2.Example.FromString(features.serialize_example(example))
        assert features.deserialize_example_np(written) == {key: text.encode() for key, text in example.items()}


def test_a_text_record_without_a_feature_is_an_error_naming_it(tmp_path):
    written = tfds.features.FeaturesDict({"en": tfds.features.Text()})
    path = str(tmp_path / "records.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    writer.write(written.serialize_example({"en": "Open"}))
    writer.close()
    read_as = tfds.features.FeaturesDict({"en": tfds.features.Text(), "de": tfds.features.Text()})
    with pytest.raises(ValueError, match=r"Record 0 holds 0 values of its text feature 'de'"):
        ArrayRecordSource([path], [1], read_as)[0]


def _write_records(path: str, count: int) -> None:
    writer = ArrayRecordWriter(path, "group_size:1,uncompressed")  # Records findable in the bytes.
    for index in range(count):
        writer.write(encode_text_example({"en": f"Open file {index}.", "de": f"Datei {index} öffnen."}))
    writer.close()


@pytest.mark.parametrize("damage", ["missing", "truncated", "overwritten"])
def test_a_damaged_prepared_shard_is_one_error_naming_it_and_the_fix(tmp_path, damage):
    """Not an IndexError from an empty reader (ArrayRecord opens a truncated or missing file as one), nor Riegeli's
    hash mismatch without a path: the shard, what is wrong, and which folder to delete to prepare it again."""
    features = tfds.features.FeaturesDict({"en": tfds.features.Text(), "de": tfds.features.Text()})
    intact, path = str(tmp_path / "intact.array_record"), str(tmp_path / "split" / "damaged.array_record")
    _write_records(intact, 200)
    os.makedirs(os.path.dirname(path))
    with open(intact, "rb") as f:
        data = f.read()
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "overwritten":  # One record's bytes: the file opens, that record does not read.
        data = data.replace(b"Open file 100.", b"Open file 1OO.")
    if damage != "missing":
        with open(path, "wb") as f:
            f.write(data)
    source = ArrayRecordSource([intact, path], [200, 200], features)
    assert source[199]["en"] == b"Open file 199."  # The intact shard reads on.
    with pytest.raises(UserInputError) as raised:
        for index in range(200, 400):
            source[index]
    message = str(raised.value)
    expected = {"missing": "(missing)", "truncated": "(unreadable, where", "overwritten": "(record 100: Corrupted"}
    assert message.startswith(f"The prepared records {path} are damaged {expected[damage]}")
    assert f"delete {os.path.dirname(path)} and run again" in message and "\n" not in message


def test_a_prepared_split_with_a_shard_missing_is_read_from_its_files_and_fails_naming_it(tmp_path, corpus_dir):
    """Not through TFDS's reader (~55 ms a read), which would fail later with its own error."""
    config = config_for(corpus_dir, tmp_path)
    builder = datasets.make_builder(config.dataset, str(tmp_path / "work"), required_splits=SPLITS)
    path = builder.info.splits["train"].filepaths[0]
    os.remove(path)
    source = datasets.records(builder, "train")
    assert isinstance(source, ArrayRecordSource)
    with pytest.raises(UserInputError, match=r"are damaged \(missing\)"):
        source[0]


def test_a_second_start_does_not_read_the_text_files(tmp_path, corpus_dir):
    config = config_for(corpus_dir, tmp_path)
    workdir = str(tmp_path / "work")
    first = load_corpus(config, workdir, SPLITS, allow_training_tokenizer=True)
    prepared = sorted(os.listdir(tmp_path / "tfds" / "parallel_text"))

    # Every file becomes bytes that are not UTF-8, with its size and times kept: reading any line of it
    # fails (checking, preparing), yet the fingerprint of names, sizes and times is unchanged.
    times = {}
    for name in os.listdir(corpus_dir):
        path = os.path.join(corpus_dir, name)
        stat = os.stat(path)
        times[path] = (stat.st_atime_ns, stat.st_mtime_ns)
        with open(path, "wb") as f:
            f.write(b"\xff" * stat.st_size)
        os.utime(path, ns=times[path])

    second = load_corpus(config, workdir, SPLITS, allow_training_tokenizer=True)
    assert record_pairs(second.train_records) == record_pairs(first.train_records)
    for split in ("valid", "test"):
        assert second.text[split] == first.text[split]
    assert sorted(os.listdir(tmp_path / "tfds" / "parallel_text")) == prepared

    # The control: files that changed (a new time) are checked again, and these fail.
    path = os.path.join(corpus_dir, "train.en")
    os.utime(path, ns=(times[path][0], times[path][1] + 1_000_000_000))
    with pytest.raises(UserInputError, match=rf"{path}, line 1: bytes that are not UTF-8"):
        load_corpus(config, workdir, SPLITS, allow_training_tokenizer=True)


def test_corpus_keeps_train_on_disk_and_tokenizes_the_evaluation_splits(tmp_path, corpus_dir):
    config = config_for(corpus_dir, tmp_path)
    workdir = str(tmp_path / "work")
    corpus = load_corpus(config, workdir, SPLITS, allow_training_tokenizer=True)

    assert corpus.tokenizer_path == Workdir(workdir).tokenizer and os.path.isfile(corpus.tokenizer_path)
    assert (corpus.source_lang, corpus.target_lang) == LANGS
    assert record_pairs(corpus.train_records) == file_pairs(corpus_dir, "train")
    assert sorted(corpus.text) == sorted(corpus.ids) == ["test", "valid"]  # No train text or ids.
    for split in ("valid", "test"):
        pairs = file_pairs(corpus_dir, split)
        expected_text = TextPairs([s for s, _ in pairs], [t for _, t in pairs])
        assert corpus.text[split] == expected_text
        expected = datasets.tokenize(expected_text, corpus.tokenizer)
        for side in ("sources", "targets"):
            assert [list(x) for x in getattr(corpus.ids[split], side)] == [list(x) for x in getattr(expected, side)]

    # Evaluating a trained workdir: no training split.
    evaluated = load_corpus(config, workdir, ("test",), allow_training_tokenizer=False)
    assert evaluated.train_records is None and sorted(evaluated.ids) == ["test"]


class CountingSource:
    """A data source that counts the records read from it (and refuses to be iterated whole)."""

    def __init__(self, source):
        self.source, self.records_read = source, 0

    def __len__(self):
        return len(self.source)

    def __getitem__(self, index):
        self.records_read += 1
        return self.source[index]

    def __getitems__(self, indices):
        self.records_read += len(indices)
        return self.source.__getitems__(indices)

    def __iter__(self):
        raise AssertionError("the whole split was iterated")


@pytest.fixture
def train_records(tmp_path, corpus_dir):
    builder = datasets.make_builder(config_for(corpus_dir, tmp_path).dataset, str(tmp_path / "w"), ("train",))
    return datasets.records(builder, "train")


def test_tokenizer_sample_is_seeded_bounded_and_read_by_random_access(train_records):
    sources, targets = (list(side) for side in zip(*record_pairs(train_records)))
    counting = CountingSource(train_records)
    sample = datasets.sample_sentences(counting, LANGS, 100, seed=3)

    # The sentences today's in-memory draw picks from the list of all sentences, in its order.
    assert sample == random.Random(3).sample(sources + targets, 100)
    assert 0 < counting.records_read <= 100  # Only records holding a picked sentence.
    assert datasets.sample_sentences(train_records, LANGS, 100, seed=3) == sample
    assert datasets.sample_sentences(train_records, LANGS, 100, seed=4) != sample
    # No more sentences than there are: all of them, sources then targets.
    assert datasets.sample_sentences(train_records, LANGS, 10_000, seed=3) == sources + targets


def test_a_split_without_a_whole_pair_is_a_user_error(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.en").write_text("one\n\nthree\n\n", encoding="utf-8")
    (folder / "train.de").write_text("\nzwei\n\nvier\n", encoding="utf-8")  # Each file has text; no pair has both.
    config = config_for(str(folder), tmp_path)
    with pytest.raises(UserInputError, match=r"train\.en and .*train\.de hold no pair with text on both sides"):
        datasets.make_builder(config.dataset, str(tmp_path / "work"), required_splits=("train",))
