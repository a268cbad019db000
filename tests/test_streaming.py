"""The training stream (input_pipeline/streaming.py): shuffle, process shares, packing, restore, fallbacks."""

import collections
import json
import logging
import os
import random

import array_record.python.array_record_module as array_record
import grain
import numpy as np
import pytest

from common.errors import UserInputError
from common.special_ids import EOS_ID
from input_pipeline import streaming
from input_pipeline.tokenizer import train_tokenizer

MAX_LENGTH = 24
ROWS = 4
WORDS = "the a house garden red blue opens closes window menu file edit view insert format tools table help".split()


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 14)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(records, tokenizer path): 150 pairs {'en': bytes, 'de': bytes} of 1-14 words; some exceed MAX_LENGTH ids."""
    rng = random.Random(0)
    records = [{"en": _sentence(rng).encode(), "de": _sentence(rng).upper().encode()} for _ in range(150)]
    path = str(tmp_path_factory.mktemp("tokenizer") / "tokenizer.model")
    sentences = [r[k].decode() for r in records for k in ("en", "de")]
    train_tokenizer(sentences, path, vocab_size=60, model_type="bpe", max_sentences=1000)
    return records, path


def _stream(corpus, **options) -> streaming.TrainStream:
    records, path = corpus
    defaults = dict(seed=3, tokenizer_path=path, source_lang="en", target_lang="de", max_length=MAX_LENGTH, rows=ROWS)
    return streaming.TrainStream(records, **{**defaults, **options})


def _take(stream, n: int) -> list[dict]:
    return [next(stream) for _ in range(n)]


def _pairs(batches: list[dict]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (source ids, target ids) of every segment of packed batches, row by row."""
    pairs = []
    for batch in batches:
        for row in range(batch["inputs"].shape[0]):
            for segment in range(1, batch["inputs_segment_ids"][row].max() + 1):
                source = batch["inputs"][row][batch["inputs_segment_ids"][row] == segment]
                target = batch["targets"][row][batch["targets_segment_ids"][row] == segment]
                pairs.append((tuple(source.tolist()), tuple(target.tolist())))
    return pairs


def _expected_pairs(corpus, seed: int, process_index: int = 0, process_count: int = 1) -> list:
    """The tokenized, length-filtered pairs of a process's record stream, in order (first six epochs)."""
    records, path = corpus
    tokenize = streaming.TokenizePair(path, "en", "de")
    share = streaming.process_records(records, seed, process_index, process_count)
    pairs = [tokenize.map(share[i]) for i in range(6 * (len(records) // process_count))]
    return [
        (tuple(p["inputs"].tolist()), tuple(p["targets"].tolist()))
        for p in pairs
        if len(p["inputs"]) <= MAX_LENGTH and len(p["targets"]) <= MAX_LENGTH
    ]


def test_shuffle_covers_every_record_once_per_epoch_and_differs_per_epoch():
    records = list(range(50))
    stream = streaming.process_records(records, seed=1, process_index=0, process_count=1)
    epochs = [[stream[e * 50 + i] for i in range(50)] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == records
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != records


def test_processes_read_disjoint_records_whose_union_is_everything():
    records = list(range(51))  # Not a multiple of the process count: the last record waits for another epoch.
    read = []

    class Recording(list):
        def __getitem__(self, index):
            read.append(index)
            return super().__getitem__(index)

    shares = []
    for process in range(3):
        read.clear()
        share = streaming.process_records(Recording(records), seed=1, process_index=process, process_count=3)
        shares.append([share[i] for i in range(17)])
        assert sorted(read) == sorted(shares[-1])  # It reads its own records only.
    assert all(len(set(share)) == 17 for share in shares)
    union = set().union(*map(set, shares))
    assert len(union) == 51 and union == set(records)


def test_packed_rows_hold_whole_pairs_with_segment_ids_and_positions(corpus):
    stream = _stream(corpus)
    batches = _take(stream, 12)
    stream.close()
    for batch in batches:
        assert set(batch) == {
            "inputs",
            "targets",
            "inputs_segment_ids",
            "targets_segment_ids",
            "inputs_positions",
            "targets_positions",
        }
        for key, value in batch.items():
            assert value.shape == (ROWS, MAX_LENGTH) and value.dtype == np.int32, key
        for side in ("inputs", "targets"):
            ids, segments, positions = (batch[side + suffix] for suffix in ("", "_segment_ids", "_positions"))
            assert (segments.max(axis=1) >= 1).all()  # At least one pair a row.
            for row in range(ROWS):
                real = segments[row] > 0
                assert (ids[row][~real] == 0).all() and (ids[row][real] != 0).all() and not real[real.sum() :].any()
                for segment in range(1, segments[row].max() + 1):
                    where = np.flatnonzero(segments[row] == segment)
                    assert (np.diff(where) == 1).all()  # Contiguous, numbered in order.
                    np.testing.assert_array_equal(positions[row][where], np.arange(len(where)))
                    assert ids[row][where[-1]] == EOS_ID  # Ends with <eos>: nothing cut.
        assert (batch["inputs_segment_ids"].max(axis=1) == batch["targets_segment_ids"].max(axis=1)).all()
    # Every pair of the record stream that fits comes once, whole, in order of rounds: none lost or cut.
    got = _pairs(batches)
    expected = _expected_pairs(corpus, seed=3)
    assert collections.Counter(got) == collections.Counter(expected[: len(got)])
    assert len(expected) > len(got) > len(batches) * ROWS  # Packing puts several pairs in a row.


def test_rows_are_packed_as_grains_first_fit_packs_them(corpus):
    """The stream's packer (input_pipeline/row_packing.py) writes grain's first-fit batches, array for array."""
    stream = _stream(corpus)
    batches = _take(stream, 20)  # Past chunk boundaries (256 records) and epochs (150 records).
    stream.close()
    pairs = [{"inputs": np.array(s, np.int32), "targets": np.array(t, np.int32)} for s, t in _expected_pairs(corpus, 3)]
    grain_batches = grain.experimental.FirstFitPackIterDataset(
        grain.MapDataset.source(pairs).to_iter_dataset(),
        length_struct={"inputs": MAX_LENGTH, "targets": MAX_LENGTH},
        num_packing_bins=ROWS,
        shuffle_bins=False,
    ).batch(ROWS, drop_remainder=True)
    grain_batches = [batch for batch, _ in zip(grain_batches, range(len(batches)))]
    assert len(grain_batches) == len(batches)
    for ours, grains in zip(batches, grain_batches):
        assert ours.keys() == grains.keys()
        for key in ours:
            np.testing.assert_array_equal(ours[key], grains[key], err_msg=key)


def test_unpacked_rows_hold_one_padded_pair(corpus):
    stream = _stream(corpus, packing=False)
    batches = _take(stream, 5)
    stream.close()
    assert all(set(b) == {"inputs", "targets"} and b["inputs"].shape == (ROWS, MAX_LENGTH) for b in batches)
    got = [
        (tuple(i[i != 0].tolist()), tuple(t[t != 0].tolist()))
        for b in batches
        for i, t in zip(b["inputs"], b["targets"])
    ]
    assert got == _expected_pairs(corpus, seed=3)[: len(got)]


def test_a_position_after_the_last_chunk_of_a_finite_stream_restores_used_up():
    from input_pipeline.row_packing import RowBatchIterDataset

    pairs = [(np.array([5, 1], np.int32), np.array([6, 1], np.int32))] * 8
    chunks = grain.MapDataset.source([pairs[:4], pairs[4:]]).to_iter_dataset()
    dataset = RowBatchIterDataset(chunks, max_length=4, rows=4, packing=False)
    read = iter(dataset)
    assert len(_take(read, 2)) == 2
    with pytest.raises(StopIteration):
        next(read)
    restored = iter(dataset)
    restored.set_state(json.loads(json.dumps(read.get_state())))
    with pytest.raises(StopIteration):
        next(restored)


def test_a_stream_where_no_pair_fits_is_one_error(corpus):
    stream = _stream(corpus, max_length=1)  # Every side has at least one subword and <eos>.
    message = r"The last \d+ training pairs read were all longer than config.dataset.max_length=1"
    with pytest.raises(UserInputError, match=message):
        next(stream)
    stream.close()


def test_a_stream_where_one_pair_in_an_epoch_fits_goes_on(corpus):
    """The misfits between two reads of the one pair that fits may span most of two epochs."""
    records = [{"en": " ".join(["garden"] * 30).encode(), "de": " ".join(["GARDEN"] * 30).encode()}] * 149
    records.append({"en": b"the house", "de": b"THE HOUSE"})
    for seed in range(10):
        stream = _stream((records, corpus[1]), seed=seed, rows=1, packing=False)
        batches = _take(stream, 5)  # Each holds the one pair; one epoch apart from the next.
        stream.close()
        assert all(np.array_equal(b["inputs"], batches[0]["inputs"]) for b in batches)


def test_fewer_records_than_processes_is_one_error(corpus):
    with pytest.raises(UserInputError, match=r"holds 2 pairs, fewer than the 3 processes"):
        _stream((corpus[0][:2], corpus[1]), process_index=2, process_count=3)


def test_neighbouring_seeds_shuffle_every_epoch_differently():
    records = list(range(200))
    streams = {seed: streaming.process_records(records, seed, 0, 1) for seed in (0, 1)}
    orders = {tuple(streams[seed][epoch * 200 + i] for i in range(200)) for seed in (0, 1) for epoch in range(3)}
    assert len(orders) == 6  # Not seed 1's epoch e the same as seed 0's epoch e + 1 (grain's seed + epoch).


def test_a_restored_stream_yields_exactly_the_next_batches(corpus):
    reference = _stream(corpus)
    expected = _take(reference, 40)  # Past the end of the first epoch (150 records, ~4 pairs a row).
    reference.close()
    for interrupted_after in (1, 7, 23):
        interrupted = _stream(corpus)
        _take(interrupted, interrupted_after)
        saved = json.loads(json.dumps(interrupted.get_state()))  # As the checkpoint keeps it.
        interrupted.close()
        restored = _stream(corpus, state=saved, step=interrupted_after)
        for want, got in zip(expected[interrupted_after:], _take(restored, 40 - interrupted_after)):
            assert want.keys() == got.keys()
            for key in want:
                np.testing.assert_array_equal(want[key], got[key])
        restored.close()


def test_without_its_position_a_stream_starts_afresh_with_the_seed_folded_with_the_step(corpus, caplog):
    saved_by_one_process = _stream(corpus)
    _take(saved_by_one_process, 5)
    saved = saved_by_one_process.get_state()
    saved_by_one_process.close()
    # Resumed by two processes: no position of its own (the checkpoint lacks its file) or a foreign one.
    for position in (None, saved):
        with caplog.at_level(logging.WARNING):
            resumed = _stream(corpus, state=position, step=5, process_index=1, process_count=2)
        assert any("No data position fits this run at step 5" in r.getMessage() for r in caplog.records)
        caplog.clear()
        fresh = _stream(corpus, seed=streaming.fold_seed(3, 5), process_index=1, process_count=2)
        assert _pairs(_take(resumed, 3)) == _pairs(_take(fresh, 3))
        # The new position carries the folded seed: resuming it later continues exactly.
        position = resumed.get_state()
        continued = _stream(corpus, state=position, step=8, process_index=1, process_count=2)
        assert _pairs(_take(continued, 2)) == _pairs(_take(resumed, 2))
        for stream in (resumed, fresh, continued):
            stream.close()
    assert streaming.fold_seed(3, 5) not in (3, streaming.fold_seed(3, 6), streaming.fold_seed(4, 5))


def test_a_position_saved_before_the_shuffle_seed_was_hashed_starts_afresh(corpus, caplog):
    """Such a position indexes another order: resumed as it is, it would skip and repeat records."""
    interrupted = _stream(corpus)
    _take(interrupted, 5)
    saved = interrupted.get_state()
    interrupted.close()
    del saved["stream"]["shuffle_version"]  # As positions saved before it had it.
    with caplog.at_level(logging.WARNING):
        resumed = _stream(corpus, state=saved, step=5)
    assert any("No data position fits this run at step 5" in r.getMessage() for r in caplog.records)
    fresh = _stream(corpus, seed=streaming.fold_seed(3, 5))
    assert _pairs(_take(resumed, 3)) == _pairs(_take(fresh, 3))
    resumed.close()
    fresh.close()


def test_a_position_on_another_corpus_of_the_same_size_starts_afresh(corpus, caplog):
    """Positions index records by number: on other records they would name other pairs."""
    records, path = corpus
    interrupted = _stream(corpus)
    _take(interrupted, 5)
    saved = interrupted.get_state()
    interrupted.close()
    rng = random.Random(1)
    other = [{"en": _sentence(rng).encode(), "de": _sentence(rng).upper().encode()} for _ in records]
    with caplog.at_level(logging.WARNING):
        resumed = _stream((other, path), state=saved, step=5)
    assert any("No data position fits this run at step 5" in r.getMessage() for r in caplog.records)
    fresh = _stream((other, path), seed=streaming.fold_seed(3, 5))
    assert _pairs(_take(resumed, 3)) == _pairs(_take(fresh, 3))
    resumed.close()
    fresh.close()


def test_a_position_saved_before_the_records_digest_resumes_exactly(corpus, caplog):
    """Such positions fit on the record count alone, as they did when they were saved."""
    interrupted = _stream(corpus)
    _take(interrupted, 5)
    saved = interrupted.get_state()
    expected = _take(interrupted, 3)
    interrupted.close()
    del saved["stream"]["records_digest"]
    with caplog.at_level(logging.WARNING):
        resumed = _stream(corpus, state=saved, step=5)
    assert not any("No data position fits" in r.getMessage() for r in caplog.records)
    assert _pairs(_take(resumed, 3)) == _pairs(expected)
    resumed.close()


def test_records_digest_tells_contents_apart_and_ignores_the_reading(corpus):
    records, _ = corpus
    digest = streaming.records_digest(records)
    assert streaming.records_digest([dict(r) for r in records]) == digest
    assert streaming.records_digest([{k: v.decode() for k, v in r.items()} for r in records]) == digest
    changed = list(records)
    changed[-1] = {**records[-1], "de": b"ANDERS"}
    assert streaming.records_digest(changed) != digest
    assert streaming.records_digest(records[:-1]) != digest


def test_other_devices_same_processes_go_on_from_the_same_record(corpus):
    """Another batch size (devices) with the saved position: no pair skipped or repeated, rows of the new size."""
    first = _stream(corpus, rows=ROWS)
    before = _take(first, 6)
    saved = first.get_state()
    first.close()
    resumed = _stream(corpus, rows=2 * ROWS, state=saved, step=6)
    after = _take(resumed, 4)
    resumed.close()
    assert all(b["inputs"].shape == (2 * ROWS, MAX_LENGTH) for b in after)
    got = _pairs(before) + _pairs(after)
    expected = _expected_pairs(corpus, seed=3)[: len(got)]
    assert collections.Counter(got) == collections.Counter(expected)


def test_stream_reads_array_record_files(corpus, tmp_path):
    """The source the records helper provides: ArrayRecord files read with random access."""
    records, _ = corpus
    path = str(tmp_path / "train.array_record")
    writer = array_record.ArrayRecordWriter(path, "group_size:1")
    for record in records:
        writer.write(json.dumps({k: v.decode() for k, v in record.items()}).encode())
    writer.close()

    class JsonRecords(grain.sources.ArrayRecordDataSource):
        def __getitem__(self, index):
            return {k: v.encode() for k, v in json.loads(super().__getitem__(index)).items()}

    from_files = _stream((JsonRecords([path]), corpus[1]))
    from_list = _stream(corpus)
    assert _pairs(_take(from_files, 4)) == _pairs(_take(from_list, 4))
    from_files.close()
    from_list.close()


def test_workers_make_the_same_stream_on_every_run_and_restore(corpus):
    from absl import flags  # pylint: disable=g-import-not-at-top

    if not flags.FLAGS.is_parsed():  # train.py parses them; grain's workers read one.
        flags.FLAGS.mark_as_parsed()
    first = _stream(corpus, num_workers=2)
    batches = _take(first, 6)
    saved = first.get_state()
    more = _take(first, 3)
    first.close()
    second = _stream(corpus, num_workers=2)
    assert _pairs(_take(second, 6)) == _pairs(batches)
    second.close()
    restored = _stream(corpus, num_workers=2, state=saved, step=6)
    assert _pairs(_take(restored, 3)) == _pairs(more)
    restored.close()
    assert os.path.exists(corpus[1])


def test_unpacked_row_batches_restore_where_a_batch_ends_a_chunk():
    """A position saved where a batch used up its chunk names the next chunk, which a restore reads first.

    Only unpacked batches end there: a packed batch ends at a pair that did not fit, read already.
    """
    from input_pipeline.row_packing import RowBatchIterDataset

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, (48, 2))
    pairs = [(rng.integers(4, 50, n).astype(np.int32), rng.integers(4, 50, m).astype(np.int32)) for n, m in lengths]
    chunks = [pairs[i : i + 4] for i in range(0, len(pairs), 4)]  # A batch of 4 rows takes one chunk.
    chunks_read = []  # Indices of the chunks the batches were made from, in the order read.

    def read_chunk(index: int) -> list:
        chunks_read.append(index)
        return chunks[index]

    chunk_stream = grain.MapDataset.source(range(len(chunks))).repeat().map(read_chunk)
    no_read_ahead = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    dataset = RowBatchIterDataset(chunk_stream.to_iter_dataset(no_read_ahead), max_length=8, rows=4, packing=False)
    reference = iter(dataset)
    expected = [next(reference) for _ in range(8)]
    for saved_after in (1, 3):
        interrupted = iter(dataset)
        for _ in range(saved_after):
            next(interrupted)
        state = json.loads(json.dumps(interrupted.get_state()))
        assert state["offset"] == 0  # The chunk is used up: the position is the next one's start.
        restored = iter(dataset)
        chunks_read.clear()
        restored.set_state(state)
        assert chunks_read == [saved_after]  # The next chunk, not the used-up one again.
        for want in expected[saved_after:]:
            got = next(restored)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=key)
