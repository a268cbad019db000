"""Tests for input_pipeline/: the local TFDS builder, named TFDS datasets, tokenizing and batching.

The named-dataset tests run under `tfds.testing.mock_data` with the network cut
off, so nothing is downloaded.
"""

import dataclasses
import errno
import gzip
import json
import os
import socket

import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import BUNDLED_CORPUS as CORPUS
from conftest import write_tfds_metadata

from common.errors import UserInputError
from common.special_ids import EOS_ID, PAD_ID
from configs import tiny
from input_pipeline import batching, datasets, parallel_text
from input_pipeline.batching import IteratorState, ParallelIds, RaggedIds, TrainBatches
from input_pipeline.text_lines import TextPairs
from input_pipeline.tokenizer import train_tokenizer

NUM_LINES = 200
SPLITS = ("train", "valid", "test")


def bundled_lines(split: str, lang: str, n: int = NUM_LINES) -> list[str]:
    """The first n lines of a split of the bundled corpus."""
    with gzip.open(os.path.join(CORPUS, f"{split}.{lang}.gz"), "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


def write_lines(folder, name: str, lines: list[str]) -> None:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    os.makedirs(folder, exist_ok=True)
    if name.endswith(".gz"):
        with gzip.open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    else:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)


def local_dataset(path, data_dir):
    """The `dataset` config of configs/tiny.py, pointed at `path`."""
    dataset = tiny.get_config().dataset
    dataset.path = str(path)
    dataset.data_dir = str(data_dir)
    return dataset


@pytest.fixture(scope="module")
def corpus_slice():
    """{(split, lang): the first NUM_LINES lines} of the bundled corpus."""
    lines = {(split, lang): bundled_lines(split, lang) for split in SPLITS for lang in ("en", "de")}
    # The slice must hold no blank or padded lines, or 'exactly these pairs' would not hold.
    assert all(line and line == line.strip() for side in lines.values() for line in side)
    return lines


# --- The local TFDS builder (parallel_text) ---------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_local_builder_returns_the_files_pairs_in_order(tmp_path, corpus_slice, suffix):
    folder = tmp_path / "corpus"
    for (split, lang), lines in corpus_slice.items():
        write_lines(folder, f"{split}.{lang}{suffix}", lines)
    dataset = local_dataset(folder, tmp_path / "tfds")
    workdir = tmp_path / "work"

    builder = datasets.make_builder(dataset, str(workdir), required_splits=SPLITS)

    assert isinstance(builder, parallel_text.ParallelText)
    assert builder.data_dir.startswith(str(tmp_path / "tfds"))
    assert not workdir.exists()  # An explicit data_dir keeps TFDS out of the workdir.
    for split in SPLITS:
        assert builder.info.splits[split].num_examples == NUM_LINES
        pairs = datasets.load_text_pairs(builder, split, "en", "de")
        assert pairs.sources == corpus_slice[split, "en"]
        assert pairs.targets == corpus_slice[split, "de"]


def test_local_builder_defaults_to_workdir_tfds(tmp_path, corpus_slice):
    folder = tmp_path / "corpus"
    write_lines(folder, "train.en", corpus_slice["train", "en"][:20])
    write_lines(folder, "train.de", corpus_slice["train", "de"][:20])
    dataset = local_dataset(folder, "")
    builder = datasets.make_builder(dataset, str(tmp_path / "work"), required_splits=("train",))
    assert builder.data_dir.startswith(str(tmp_path / "work" / "tfds"))
    assert os.listdir(tmp_path / "work" / "tfds")
    assert list(builder.info.splits) == ["train"]  # Absent optional splits are not invented.
    assert datasets.load_text_pairs(builder, "train", "en", "de").sources == corpus_slice["train", "en"][:20]


def test_local_builder_keeps_pairs_with_an_empty_side_in_file_order(tmp_path, corpus_slice):
    """Every line pair is a record, so that an evaluation's lines match the files (training leaves such pairs out)."""
    sources, targets = list(corpus_slice["train", "en"]), list(corpus_slice["train", "de"])
    sources[0] = ""  # Empty source, first line.
    targets[7] = "   "  # Blank target.
    sources[8] = targets[8] = ""  # Both empty.
    targets[-1] = "\t"  # Blank target, last line.
    folder = tmp_path / "corpus"
    write_lines(folder, "train.en", sources)
    write_lines(folder, "train.de", targets)

    builder = datasets.make_builder(
        local_dataset(folder, tmp_path / "tfds"), str(tmp_path / "work"), required_splits=("train",)
    )
    pairs = datasets.load_text_pairs(builder, "train", "en", "de")

    assert pairs.sources == [source.strip() for source in sources]
    assert pairs.targets == [target.strip() for target in targets]
    assert pairs.sources[0] == pairs.targets[7] == pairs.targets[-1] == ""


def test_local_builder_strips_whitespace_and_crlf(tmp_path):
    folder = tmp_path / "corpus"
    write_lines(folder, "train.en", ["  Hello world \r", "Second line\r"])
    write_lines(folder, "train.de", ["Hallo Welt", "\tZweite Zeile  "])
    builder = datasets.make_builder(
        local_dataset(folder, tmp_path / "tfds"), str(tmp_path / "work"), required_splits=("train",)
    )
    pairs = datasets.load_text_pairs(builder, "train", "en", "de")
    assert pairs.sources == ["Hello world", "Second line"]
    assert pairs.targets == ["Hallo Welt", "Zweite Zeile"]


@pytest.mark.parametrize("missing", ["valid", "test"])
def test_local_builder_refuses_a_missing_required_split(tmp_path, corpus_slice, missing):
    folder = tmp_path / "corpus"
    for split in SPLITS:
        if split != missing:
            for lang in ("en", "de"):
                write_lines(folder, f"{split}.{lang}", corpus_slice[split, lang][:10])
    dataset = local_dataset(folder, tmp_path / "tfds")
    with pytest.raises(UserInputError, match=rf"Missing {folder}/{missing}\.en \(or \.gz\)"):
        datasets.make_builder(dataset, str(tmp_path / "work"), required_splits=("train", missing))
    assert not (tmp_path / "tfds").exists() and not (tmp_path / "work").exists()
    # Not required: the same folder is fine.
    builder = datasets.make_builder(dataset, str(tmp_path / "work"), required_splits=("train",))
    assert missing not in builder.info.splits


# --- Named TFDS datasets, mocked ----------------------------------------------------------------------------


WMT_SPLITS = {"train": 100, "validation": 10, "test": 10}


@pytest.fixture(scope="module")
def wmt_metadata(tmp_path_factory):
    """A TFDS data_dir holding only the metadata of wmt14_translate/de-en in ArrayRecord format (no examples).

    `mock_data` reads split names from it (policy USE_FILES); without it the
    mocked builder has no splits at all.
    """
    return write_tfds_metadata(tmp_path_factory.mktemp("wmt_metadata"), "wmt14_translate/de-en", WMT_SPLITS)


@pytest.fixture
def offline(monkeypatch):
    """Cuts off the network and records any real attempt to prepare a dataset."""

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:]}")

    prepared = []

    def no_prepare(self, *args, **kwargs):
        prepared.append(self.name)
        raise AssertionError(f"download_and_prepare ran for real for {self.name}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    monkeypatch.setattr(tfds.core.GeneratorBasedBuilder, "_download_and_prepare", no_prepare)
    return prepared


@pytest.fixture
def mock_getitems(monkeypatch):
    """Mends tfds.testing.mock_data's batched reads: its data source's `__getitems__` is a partial of a
    method, set on an instance, so it lacks `self` and fails (tensorflow-datasets 4.9.10)."""
    monkeypatch.setattr(
        tfds.testing.mocking, "_getitems", lambda record_keys, generator: [generator[key] for key in record_keys]
    )


def wmt_dataset(tmp_path, source_lang="en", target_lang="de"):
    dataset = tiny.get_config().dataset
    dataset.name = "wmt14_translate/de-en"
    dataset.path = ""
    dataset.data_dir = str(tmp_path / "tfds")
    dataset.source_lang, dataset.target_lang = source_lang, target_lang
    return dataset


def test_named_dataset_under_mock_data(tmp_path, wmt_metadata, offline, mock_getitems, without_tensorflow):
    """A prepared named dataset (here mocked) is read through its data source, without TensorFlow."""
    dataset = wmt_dataset(tmp_path)
    with tfds.testing.mock_data(num_examples=7, policy=tfds.testing.MockPolicy.USE_FILES, data_dir=wmt_metadata):
        builder = datasets.make_builder(dataset, str(tmp_path / "work"), required_splits=("train", "validation"))
        pairs = datasets.load_text_pairs(builder, "validation", "en", "de")  # Read through the data source.
        records = datasets.records(builder, "train")
        sample = datasets.sample_sentences(records, ("en", "de"), 5, seed=0)
    assert builder.name == "wmt14_translate"
    assert len(pairs) == 7 and len(pairs.targets) == 7 and len(records) == 7
    assert all(isinstance(text, str) for text in pairs.sources + pairs.targets + sample)
    assert pairs.sources != pairs.targets  # The two languages are separate features.
    assert len(sample) == 5
    assert offline == []  # download_and_prepare never did real work.
    assert not (tmp_path / "tfds").exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    "failure, reported",
    [
        (ConnectionError("Failed to connect to statmt.org"), UserInputError),  # Offline: prepare it elsewhere.
        (OSError(errno.ENOSPC, "No space left on device", "/data/wmt14/x.array_record"), OSError),  # Kept as it is.
        (RuntimeError("write() failed: File too large; writing /data/wmt14/x.array_record; at byte 0"), RuntimeError),
    ],
)
def test_named_dataset_that_cannot_be_prepared(tmp_path, monkeypatch, failure, reported):
    """Offline, the error says where to prepare the dataset; a full disk reaches the entry point as itself."""

    def fail(self, *args, **kwargs):
        raise failure

    monkeypatch.setattr(tfds.core.GeneratorBasedBuilder, "_download_and_prepare", fail)
    tensorflow_imports = []  # TensorFlow as if installed (its import costs ~0.8 GB): the preparation fails after it.
    monkeypatch.setattr(datasets, "_import_tensorflow_off_accelerators", tensorflow_imports.append)
    with pytest.raises(reported) as error:
        datasets.make_builder(wmt_dataset(tmp_path), str(tmp_path / "work"), required_splits=("train",))
    if reported is UserInputError:
        assert str(error.value).startswith(f"Could not prepare dataset 'wmt14_translate/de-en' in {tmp_path}/tfds")
        assert "ConnectionError: Failed to connect to statmt.org. Prepare it where the internet is reachable" in (
            str(error.value)
        )
    else:
        assert error.value is failure
    assert [dataset.name for dataset in tensorflow_imports] == ["wmt14_translate/de-en"]


def test_preparing_a_named_dataset_without_tensorflow_says_how_to_install_it(tmp_path, offline, without_tensorflow):
    """TFDS's generators of named datasets need TensorFlow, an extra: one line naming the dataset and the extra."""
    with pytest.raises(UserInputError) as error:
        datasets.make_builder(wmt_dataset(tmp_path), str(tmp_path / "work"), required_splits=("train",))
    assert str(error.value) == (
        "preparing the TFDS dataset 'wmt14_translate/de-en' needs TensorFlow: pip install -e \".[tensorflow]\" "
        "(or prepare it where TensorFlow is installed: `tfds build wmt14_translate/de-en --file_format=array_record "
        "--data_dir=DIR`, and set --config.dataset.data_dir=DIR)."
    )
    assert offline == []  # Nothing was downloaded or generated.
    assert not (tmp_path / "tfds").exists() and not (tmp_path / "work").exists()


def test_named_dataset_prepared_as_tfrecord_says_how_to_prepare_it(tmp_path, offline):
    """A dataset the user prepared earlier without ArrayRecord files: one line saying how to prepare it again."""
    dataset = wmt_dataset(tmp_path)
    metadata = write_tfds_metadata(tmp_path / "tfrecord_metadata", "wmt14_translate/de-en", WMT_SPLITS, "tfrecord")
    with (
        tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_FILES, data_dir=metadata),
        pytest.raises(UserInputError) as error,
    ):
        datasets.make_builder(dataset, str(tmp_path / "work"), required_splits=("train",))
    message = str(error.value)
    assert "is prepared as tfrecord" in message and "\n" not in message
    assert "tfds build wmt14_translate/de-en --file_format=array_record --data_dir=DIR" in message
    assert offline == []


@pytest.mark.parametrize("langs", [("fr", "de"), ("en", "fr")])
def test_named_dataset_without_the_language(tmp_path, wmt_metadata, offline, langs):
    dataset = wmt_dataset(tmp_path, *langs)
    with (
        tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_FILES, data_dir=wmt_metadata),
        pytest.raises(UserInputError, match=r"has no language 'fr'; it has \['de', 'en'\]"),
    ):
        datasets.make_builder(dataset, str(tmp_path / "work"), required_splits=("train",))
    assert offline == []


def test_named_dataset_without_the_split(tmp_path, wmt_metadata, offline):
    dataset = wmt_dataset(tmp_path)
    with (
        tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_FILES, data_dir=wmt_metadata),
        pytest.raises(UserInputError, match=r"has no split 'valid'; it has \['test', 'train', 'validation'\]"),
    ):
        datasets.make_builder(dataset, str(tmp_path / "work"), required_splits=("train", "valid"))


def test_unknown_dataset_name(tmp_path, offline):
    dataset = wmt_dataset(tmp_path)
    dataset.name = "no_such_dataset_xyz"
    with pytest.raises(UserInputError, match=r"Unknown dataset 'no_such_dataset_xyz'"):
        datasets.make_builder(dataset, str(tmp_path / "work"), required_splits=("train",))
    assert not (tmp_path / "tfds").exists() and not (tmp_path / "work").exists()


# --- Tokenizing and length filtering --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, corpus_slice):
    sentences = corpus_slice["train", "en"] + corpus_slice["train", "de"]
    path = str(tmp_path_factory.mktemp("tokenizer") / "tokenizer.model")
    return train_tokenizer(sentences, path, vocab_size=200)


def test_tokenize_appends_eos_to_both_sides(tokenizer, corpus_slice):
    pairs = TextPairs(corpus_slice["valid", "en"][:50], corpus_slice["valid", "de"][:50])
    ids = datasets.tokenize(pairs, tokenizer)
    assert len(ids) == 50
    for side, texts in ((ids.sources, pairs.sources), (ids.targets, pairs.targets)):
        assert side.values.dtype == np.int32
        for i, text in enumerate(texts):
            assert side[i][-1] == EOS_ID
            assert EOS_ID not in side[i][:-1] and PAD_ID not in side[i]
            assert side[i][:-1].tolist() == tokenizer.encode(text)
    assert ids.lengths.tolist() == [
        max(len(tokenizer.encode(s)), len(tokenizer.encode(t))) + 1 for s, t in zip(pairs.sources, pairs.targets)
    ]


def test_filter_by_length_drops_exactly_the_long_pairs():
    source_lengths = [3, 9, 5, 10, 2, 11, 7]
    target_lengths = [4, 2, 10, 10, 12, 1, 7]
    pairs = ParallelIds(
        RaggedIds.from_lists([[100 + i] * n for i, n in enumerate(source_lengths)]),
        RaggedIds.from_lists([[200 + i] * n for i, n in enumerate(target_lengths)]),
    )
    kept = datasets.filter_by_length(pairs, max_length=10)
    keep = [0, 1, 2, 3, 6]  # 4 (target 12) and 5 (source 11) are too long; 10 itself fits.
    assert len(kept) == len(keep)
    for row, index in enumerate(keep):
        np.testing.assert_array_equal(kept.sources[row], pairs.sources[index])
        np.testing.assert_array_equal(kept.targets[row], pairs.targets[index])
    assert len(datasets.filter_by_length(pairs, max_length=12)) == 7
    with pytest.raises(UserInputError, match=r"config.dataset.max_length=1"):
        datasets.filter_by_length(pairs, max_length=1)


# --- Batching ---------------------------------------------------------------------------------------------

BOUNDARIES = (8, 16, 32)
TOKENS_PER_BATCH = 128
SHARDS = 2


def random_pairs(n: int, max_length: int, seed: int = 0) -> ParallelIds:
    """n pairs of random ids in [4, 100), each side 1..max_length long and ending with EOS."""
    rng = np.random.default_rng(seed)

    def side():
        lengths = rng.integers(1, max_length + 1, n)
        return RaggedIds.from_lists([list(rng.integers(4, 100, k - 1)) + [EOS_ID] for k in lengths])

    return ParallelIds(side(), side())


@pytest.fixture(scope="module")
def pairs():
    return random_pairs(300, BOUNDARIES[-1])


@pytest.fixture(scope="module")
def batch_sizes():
    return batching.bucket_batch_sizes(BOUNDARIES, TOKENS_PER_BATCH, SHARDS)


def test_bucket_batch_sizes():
    assert batching.bucket_batch_sizes((8, 16, 32, 64), 1024, 4) == {8: 128, 16: 64, 32: 32, 64: 16}
    assert batching.bucket_batch_sizes((8, 16, 48), 1000, 3) == {8: 123, 16: 60, 48: 18}
    # Never below one sequence per shard, even if that exceeds the token budget.
    assert batching.bucket_batch_sizes((64,), 100, 4) == {64: 4}
    for tokens, shards in ((4096, 1), (4096, 8), (5000, 3), (777, 2)):
        for length, size in batching.bucket_batch_sizes((8, 16, 24, 40, 64), tokens, shards).items():
            assert size % shards == 0 and size >= shards
            assert size * length <= tokens or size == shards
            assert (size + shards) * length > tokens  # The largest such multiple.


def test_epoch_batches_cover_each_example_at_most_once(pairs, batch_sizes):
    lengths = pairs.lengths
    buckets = batching.bucket_of(lengths, BOUNDARIES)
    for seed, epoch in ((0, 0), (0, 1), (3, 5)):
        batches = batching.epoch_batches(lengths, BOUNDARIES, batch_sizes, seed, epoch)
        covered = np.concatenate(batches)
        assert len(covered) == len(set(covered.tolist()))
        for indices in batches:
            bucket = buckets[indices[0]]
            assert np.all(buckets[indices] == bucket)
            assert len(indices) == batch_sizes[BOUNDARIES[bucket]]
        for bucket, length in enumerate(BOUNDARIES):
            members = np.flatnonzero(buckets == bucket)
            in_batches = np.isin(members, covered).sum()
            # Every full batch's worth of a bucket is used; only a remainder waits.
            assert in_batches == len(members) // batch_sizes[length] * batch_sizes[length]


def test_epoch_batches_depend_only_on_seed_and_epoch(pairs, batch_sizes):
    def order(seed, epoch):
        batches = batching.epoch_batches(pairs.lengths, BOUNDARIES, batch_sizes, seed, epoch)
        return [indices.tolist() for indices in batches]

    assert order(0, 0) == order(0, 0)
    assert order(0, 1) == order(0, 1)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)


def test_train_batches_are_padded_to_their_bucket(pairs, batch_sizes):
    lengths = pairs.lengths
    batches = TrainBatches(pairs, BOUNDARIES, batch_sizes, seed=0)
    epoch0 = batching.epoch_batches(lengths, BOUNDARIES, batch_sizes, 0, 0)
    epoch1 = batching.epoch_batches(lengths, BOUNDARIES, batch_sizes, 0, 1)
    for expected in epoch0 + epoch1:  # Two epochs: the stream goes on past the first.
        batch = next(batches)
        length = BOUNDARIES[batching.bucket_of(lengths[expected[:1]], BOUNDARIES)[0]]
        for key, side in (("inputs", pairs.sources), ("targets", pairs.targets)):
            assert batch[key].shape == (batch_sizes[length], length) and batch[key].dtype == np.int32
            for row, index in zip(batch[key], expected):
                ids = side[index]
                assert len(ids) <= length  # The row fits: nothing is cut off.
                np.testing.assert_array_equal(row[: len(ids)], ids)
                assert np.all(row[len(ids) :] == PAD_ID)
        # The smallest bucket that holds the batch's longest pair.
        assert lengths[expected].max() > ([0] + list(BOUNDARIES))[BOUNDARIES.index(length)]
    assert (batches.state.epoch, batches.state.batch) == (1, len(epoch1))


def test_train_batches_needs_one_full_batch():
    twenty = {length: 20 for length in BOUNDARIES}
    with pytest.raises(UserInputError, match=r"lower config.per_device_batch_size"):
        TrainBatches(random_pairs(19, 32), BOUNDARIES, twenty, seed=0)
    assert next(TrainBatches(random_pairs(20, 8), BOUNDARIES, twenty, seed=0))["inputs"].shape == (20, 8)


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_restored_train_batches_continue_exactly(pairs, batch_sizes):
    epoch_length = len(batching.epoch_batches(pairs.lengths, BOUNDARIES, batch_sizes, 7, 0))
    total = 2 * epoch_length + 3
    reference = take(TrainBatches(pairs, BOUNDARIES, batch_sizes, seed=7), total)
    for k in (0, 1, 5, epoch_length - 1, epoch_length, epoch_length + 1, 2 * epoch_length):
        interrupted = TrainBatches(pairs, BOUNDARIES, batch_sizes, seed=7)
        take(interrupted, k)
        # Saved as JSON with the checkpoint, as training/checkpoints/checkpointer.py does.
        saved = json.loads(json.dumps(dataclasses.asdict(interrupted.state)))
        restored = TrainBatches(pairs, BOUNDARIES, batch_sizes, seed=7, state=IteratorState(**saved))
        for expected, actual in zip(reference[k:], take(restored, total - k), strict=True):
            for key in ("inputs", "targets"):
                np.testing.assert_array_equal(actual[key], expected[key], err_msg=f"restored after {k}")
    # The epoch boundary: after a whole epoch the state still points into epoch 0.
    interrupted = TrainBatches(pairs, BOUNDARIES, batch_sizes, seed=7)
    take(interrupted, epoch_length)
    assert (interrupted.state.epoch, interrupted.state.batch) == (0, epoch_length)
    next(interrupted)
    assert (interrupted.state.epoch, interrupted.state.batch) == (1, 1)


def test_eval_batches_yield_every_pair_once(batch_sizes):
    pairs = random_pairs(101, 40, seed=1)  # Some pairs are longer than the last bucket (32).
    seen = []
    for batch, indices in batching.eval_batches(pairs, BOUNDARIES, batch_sizes):
        length = batch["inputs"].shape[1]
        assert length in BOUNDARIES
        assert batch["inputs"].shape == batch["targets"].shape == (batch_sizes[length], length)
        assert 0 < len(indices) <= batch_sizes[length]
        for key, side in (("inputs", pairs.sources), ("targets", pairs.targets)):
            for row, index in zip(batch[key], indices):
                ids = side[index]
                if len(ids) > length:
                    # A long source is cut keeping its <eos> (its last id); a long target is cut to a prefix.
                    ids = np.concatenate([ids[: length - 1], ids[-1:]]) if key == "inputs" else ids[:length]
                np.testing.assert_array_equal(row[: len(ids)], ids)
                assert np.all(row[len(ids) :] == PAD_ID)
            assert np.all(batch[key][len(indices) :] == PAD_ID)  # Filler rows: all padding.
        seen.extend(indices.tolist())
    assert sorted(seen) == list(range(len(pairs)))
    assert len(seen) == len(pairs)


def test_sources_to_translate_are_cut_to_the_last_bucket_keeping_their_eos():
    sources = RaggedIds.from_lists([[5, 6, EOS_ID], [7, 8, 9, 10, 11, 12, EOS_ID]])
    batches = list(batching.source_batches(sources, (2, 4), {2: 2, 4: 2}))
    ((inputs, indices),) = [(inputs, indices) for inputs, indices in batches if 1 in indices]
    row = inputs[list(indices).index(1)]
    assert row.tolist() == [7, 8, 9, EOS_ID]  # Not [7, 8, 9, 10]: the model has only seen sources end with <eos>.


def test_tokenizer_too_large_for_its_corpus_is_a_user_error(tmp_path):
    sentences = ["a small corpus", "with few distinct pieces"] * 10
    with pytest.raises(UserInputError, match=r"config\.tokenizer\.vocab_size"):
        train_tokenizer(sentences, str(tmp_path / "tokenizer.model"), vocab_size=5000)
    assert not os.listdir(tmp_path)  # Nothing half-written.
