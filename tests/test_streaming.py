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

from common import processes
from common.errors import UserInputError
from common.special_ids import EOS_ID
from input_pipeline import streaming
from input_pipeline.tokenizer import load_tokenizer, train_tokenizer

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


def _ids(tokenizer, record: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A record's (source ids, target ids) as the stream trains on them: its SentencePiece ids, then <eos>."""
    return tuple(tokenizer.encode(record["en"].decode()) + [EOS_ID]), tuple(
        tokenizer.encode(record["de"].decode()) + [EOS_ID]
    )


def _expected_pairs(corpus, seed: int, share_index: int = 0, share_count: int = 1) -> list:
    """The tokenized, length-filtered pairs of a process's record stream, in order (first six epochs)."""
    records, path = corpus
    tokenizer = load_tokenizer(path)
    share = streaming.process_record_indices(len(records), seed, share_index, share_count)
    pairs = [_ids(tokenizer, records[share[i]]) for i in range(6 * (len(records) // share_count))]
    return [pair for pair in pairs if max(map(len, pair)) <= MAX_LENGTH]


def _placed_and_waiting(corpus, position: dict, seed: int = 3) -> tuple[collections.Counter, list]:
    """What a stream at `position` (one process, no workers) has placed and what waits: pairs as (source, target).

    Placed: every pair read before the next unread one that fits MAX_LENGTH, but those waiting.
    """
    records, path = corpus
    tokenizer = load_tokenizer(path)
    share = streaming.process_record_indices(len(records), seed, 0, 1)

    def pair(chunk: dict, offset: int) -> tuple:
        return _ids(tokenizer, records[share[chunk["next_index"] * streaming.CHUNK_RECORDS + offset]])

    grain_position = position["grain"]
    unread = grain_position["parent"]["next_index"] * streaming.CHUNK_RECORDS + grain_position["offset"]
    read = [pair({"next_index": 0}, i) for i in range(unread)]
    read = collections.Counter(p for p in read if len(p[0]) <= MAX_LENGTH and len(p[1]) <= MAX_LENGTH)
    waiting = [pair(group["chunk"], offset) for group in grain_position["waiting"] for offset, _ in group["pairs"]]
    assert not collections.Counter(waiting) - read  # Every waiting pair was read.
    return read - collections.Counter(waiting), waiting


def test_shuffle_covers_every_record_once_per_epoch_and_differs_per_epoch():
    stream = streaming.process_record_indices(50, seed=1, share_index=0, share_count=1)
    epochs = [[stream[e * 50 + i] for i in range(50)] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(50))
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(50))


# Each process's first 20 record indices of 51 records over 3 processes, seed 3, as streams read them
# since the seed was hashed (SHUFFLE_VERSION 2; recorded from the code that shuffled grain's source of
# the records): a position indexes this order, so a resumed run depends on it staying the same.
SHARES_OF_51_RECORDS = (
    [19, 35, 32, 23, 11, 44, 13, 29, 8, 46, 40, 24, 9, 34, 1, 38, 48, 5, 39, 48],
    [3, 41, 30, 43, 45, 16, 50, 26, 25, 22, 39, 4, 49, 7, 6, 0, 20, 44, 21, 0],
    [14, 5, 21, 42, 12, 28, 37, 15, 47, 36, 10, 17, 33, 31, 18, 2, 27, 10, 3, 30],
)


def test_the_record_order_is_the_one_saved_positions_index():
    for process, expected in enumerate(SHARES_OF_51_RECORDS):
        share = streaming.process_record_indices(51, seed=3, share_index=process, share_count=3)
        assert [share[i] for i in range(20)] == expected


@pytest.mark.parametrize("num_records, share_count", [(51, 3), (50, 3), (7, 7), (1000, 1)])
def test_the_record_order_is_grains_shuffle_of_the_records_in_shares(num_records, share_count):
    """Computed directly, as grain's chain would compute it (a position saved by either fits the other)."""
    for share_index in range(share_count):
        share = streaming.ShareOrder(num_records, 2**32 - 2, share_index, share_count)  # Epoch 2's seed wraps to 0.
        grains = grain.MapDataset.range(num_records).shuffle(seed=2**32 - 2)[share_index::share_count].repeat()
        span = range(3 * len(range(share_index, num_records, share_count)) + 5)  # Three epochs and a bit.
        assert [share[i] for i in span] == [grains[i] for i in span]


def test_processes_read_disjoint_records_whose_union_is_everything(corpus):
    first_epoch = [set(share[:17]) for share in SHARES_OF_51_RECORDS]  # 51 records: 17 a process.
    assert all(len(share) == 17 for share in first_epoch)
    assert set().union(*first_epoch) == set(range(51))
    records, path = corpus  # 150 records: 3 processes' shares of 50 each.
    shares = [streaming.process_record_indices(150, seed=3, share_index=p, share_count=3) for p in range(3)]
    first_epoch = [[share[i] for i in range(50)] for share in shares]
    assert all(len(set(share)) == 50 for share in first_epoch)
    union = set().union(*map(set, first_epoch))
    assert len(union) == 150 and union == set(range(150))

    read = []

    class Recording(list):
        def __getitem__(self, index):
            read.append(index)
            return super().__getitem__(index)

    # The stream first samples a few records to fingerprint the corpus (records_digest).
    streaming.records_digest(Recording(records))
    digest_reads = len(read)
    read.clear()

    # A process's stream reads its own records only, in its share's order (after the digest's samples).
    stream = streaming.TrainStream(
        Recording(records),
        seed=3,
        tokenizer_path=path,
        source_lang="en",
        target_lang="de",
        max_length=MAX_LENGTH,
        rows=ROWS,
        share_index=1,
        share_count=3,
    )
    _take(stream, 3)
    stream.close()
    streamed = read[digest_reads:]
    assert streamed and streamed == [shares[1][i] for i in range(len(streamed))]


@pytest.mark.parametrize("lookahead", [0, 2])
def test_packed_rows_hold_whole_pairs_with_segment_ids_and_positions(corpus, lookahead):
    stream = _stream(corpus, packing_lookahead=lookahead)
    batches = _take(stream, 12)
    position = stream.get_state()
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
    # Every pair of the record stream that fits comes once, whole, unless it still waits: none lost or cut.
    got = _pairs(batches)
    placed, waiting = _placed_and_waiting(corpus, position)
    assert collections.Counter(got) == placed
    assert len(waiting) <= max(1, lookahead * ROWS)
    assert len(got) > len(batches) * ROWS  # Packing puts several pairs in a row.


def _chunk_stream(num_pairs: int, max_side: int, seed: int = 0) -> grain.IterDataset:
    """Chunks of 16 pairs, each side 1 to max_side ids; the first id of each side numbers the pair (from 4)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for number, (n, m) in enumerate(rng.integers(1, max_side + 1, (num_pairs, 2)), start=4):
        pairs.append((np.r_[number, rng.integers(4, 50, n - 1)], np.r_[number, rng.integers(4, 50, m - 1)]))
    chunks = [pairs[i : i + 16] for i in range(0, num_pairs, 16)]
    return grain.MapDataset.source(chunks).to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


def _pair_numbers(batch: dict) -> list[int]:
    """The numbers of the pairs a packed batch holds (see `_chunk_stream`)."""
    starts = (batch["targets_positions"] == 0) & (batch["targets_segment_ids"] > 0)
    return batch["targets"][starts].tolist()


def test_best_fit_among_pairs_in_view_fills_rows_fuller_than_first_fit():
    from input_pipeline.row_packing import RowBatchIterDataset

    shares = {}
    for lookahead in (0, 1, 4):
        dataset = RowBatchIterDataset(_chunk_stream(2000, 12), max_length=16, rows=8, lookahead=lookahead)
        batches = list(dataset)[:-1]  # The last batch holds what was left.
        shares[lookahead] = np.mean([(b["targets"] != 0).mean() for b in batches])
        numbers = [n for b in batches for n in _pair_numbers(b)]
        assert len(numbers) == len(set(numbers))  # No pair twice.
    # Two independent sides of 1-12 ids in rows of 16 (NumPy's generator is the same everywhere):
    # first fit fills 0.73 of the target positions, best fit among 8 or 32 pairs in view 0.85 and 0.91.
    assert shares[0] + 0.1 < shares[1] < shares[4] - 0.05, shares


def _pairs_of_lengths(lengths: list[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pairs with sides of these lengths, each side 4, 5, 6, ..."""
    return [(np.arange(4, 4 + n, dtype=np.int32), np.arange(4, 4 + m, dtype=np.int32)) for n, m in lengths]


def test_best_fit_puts_a_pair_into_the_fullest_row_it_fits():
    from input_pipeline.row_packing import RowBatchIterDataset

    # Two pairs in view: (3, 3) and (3, 3) fill row 0 to 6, then (9, 9) fills row 1 to 9. (1, 1)
    # fits both rows: first fit takes row 0, best fit row 1, which it fills.
    chunks = grain.MapDataset.source([_pairs_of_lengths([(3, 3), (3, 3), (9, 9), (1, 1)])]).to_iter_dataset()
    rows_by_lookahead = {}
    for lookahead in (0, 1):
        (batch,) = list(RowBatchIterDataset(chunks, max_length=10, rows=2, lookahead=lookahead))
        rows_by_lookahead[lookahead] = batch["targets_segment_ids"].tolist()
    assert rows_by_lookahead[0] == [[1, 1, 1, 2, 2, 2, 3, 0, 0, 0], [1] * 9 + [0]]
    assert rows_by_lookahead[1] == [[1, 1, 1, 2, 2, 2, 0, 0, 0, 0], [1] * 9 + [2]]


def test_a_best_fit_stream_restored_after_any_batch_goes_on_exactly():
    from input_pipeline.row_packing import OVERDUE_AFTER, RowBatchIterDataset

    dataset = RowBatchIterDataset(_chunk_stream(800, 14, seed=2), max_length=16, rows=4, lookahead=8)
    reference = iter(dataset)
    expected, positions = [], []
    for _ in range(30):
        expected.append(next(reference))
        positions.append(json.loads(json.dumps(reference.get_state())))
    assert max(w for p in positions for g in p["waiting"] for _, w in g["pairs"]) >= OVERDUE_AFTER
    for after, position in enumerate(positions[:-1], start=1):
        restored = iter(dataset)
        restored.set_state(position)
        for want in expected[after : after + 2]:
            got = next(restored)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key}, restored after {after}")


@pytest.mark.parametrize("rows, lookahead, max_side, seed", [(8, 4, 12, 0), (4, 4, 14, 1), (4, 8, 14, 2)])
def test_overdue_pairs_go_first_so_none_waits_long(rows, lookahead, max_side, seed):
    from input_pipeline.row_packing import OVERDUE_AFTER, RowBatchIterDataset

    # Best fit by summed length passes over pairs whose one side is long while rows fill.
    dataset = RowBatchIterDataset(_chunk_stream(3000, max_side, seed), max_length=16, rows=rows, lookahead=lookahead)
    iterator = iter(dataset)
    most_waited = 0
    for _ in range(120):
        next(iterator)
        most_waited = max([most_waited] + [w for group in iterator.get_state()["waiting"] for _, w in group["pairs"]])
    # Measured: 4, 5 and 7 batches (18, 25 and 35 without the rule); beyond OVERDUE_AFTER only where
    # more pairs are overdue at once than the rows can take.
    assert OVERDUE_AFTER <= most_waited <= 2 * OVERDUE_AFTER


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


@pytest.mark.parametrize("lookahead", [0, 8])  # Without packing, the lookahead changes nothing.
def test_unpacked_rows_hold_one_padded_pair(corpus, lookahead):
    stream = _stream(corpus, packing=False, packing_lookahead=lookahead)
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


def test_pairs_with_an_empty_side_are_left_out(corpus):
    records, path = corpus
    empty = [{"en": b"", "de": b"THE HOUSE"}, {"en": b"the house", "de": b""}, {"en": b"", "de": b""}]
    tokenizer = load_tokenizer(path)
    fitting = {
        pair for pair in (_ids(tokenizer, record) for record in records[:20]) if max(map(len, pair)) <= MAX_LENGTH
    }
    stream = _stream((records[:20] + empty, path), rows=2)
    pairs = _pairs(_take(stream, 3 * len(fitting)))  # Over several epochs of the 23 records.
    stream.close()
    assert len(fitting) >= 2 and set(pairs) == fitting  # Only <eos> on a side: never placed.


def test_a_stream_where_every_pair_has_an_empty_side_is_one_error(corpus):
    """Such pairs never reach the packer (the chunks leave them out): it would wait for a pair forever."""
    records, path = corpus
    stream = _stream(([{"en": record["en"], "de": b""} for record in records], path))
    with pytest.raises(UserInputError, match=r"The last \d+ chunks of training records read held no pair with text"):
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
    with pytest.raises(UserInputError, match=r"holds 2 pairs, fewer than the 3 shares that the processes read"):
        _stream((corpus[0][:2], corpus[1]), share_index=2, share_count=3)


def test_neighbouring_seeds_shuffle_every_epoch_differently():
    streams = {seed: streaming.process_record_indices(200, seed, 0, 1) for seed in (0, 1)}
    orders = {tuple(streams[seed][epoch * 200 + i] for i in range(200)) for seed in (0, 1) for epoch in range(3)}
    assert len(orders) == 6  # Not seed 1's epoch e the same as seed 0's epoch e + 1 (grain's seed + epoch).


@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_restored_stream_yields_exactly_the_next_batches(corpus, lookahead):
    reference = _stream(corpus, packing_lookahead=lookahead)
    expected = _take(reference, 40)  # Past the end of the first epoch (150 records, ~4 pairs a row).
    reference.close()
    for interrupted_after in (1, 7, 23):
        interrupted = _stream(corpus, packing_lookahead=lookahead)
        _take(interrupted, interrupted_after)
        saved = json.loads(json.dumps(interrupted.get_state()))  # As the checkpoint keeps it.
        interrupted.close()
        restored = _stream(corpus, packing_lookahead=lookahead, state=saved, step=interrupted_after)
        for want, got in zip(expected[interrupted_after:], _take(restored, 40 - interrupted_after)):
            assert want.keys() == got.keys()
            for key in want:
                np.testing.assert_array_equal(want[key], got[key])
        restored.close()


def _resumed_afresh(
    corpus, caplog, state: dict | None, every_process_fits=processes.every_process_answer, **options
) -> streaming.TrainStream:
    """A stream resumed from `state` at step 5, checked to warn and start afresh with the seed folded with the step
    (`every_process_fits` stands for the other processes when it resumes)."""
    with caplog.at_level(logging.WARNING):
        resumed = _stream(corpus, state=state, step=5, every_process_fits=every_process_fits, **options)
    assert any("at step 5: every process goes on with a fresh stream" in r.getMessage() for r in caplog.records)
    caplog.clear()
    fresh = _stream(corpus, seed=streaming.fold_seed(3, 5), **options)
    assert _pairs(_take(resumed, 3)) == _pairs(_take(fresh, 3))
    fresh.close()
    return resumed


def test_without_its_position_a_stream_starts_afresh_with_the_seed_folded_with_the_step(corpus, caplog):
    saved_by_one_process = _stream(corpus)
    _take(saved_by_one_process, 5)
    saved = saved_by_one_process.get_state()
    saved_by_one_process.close()
    # Resumed by two processes: no position of its own (the checkpoint lacks its file) or a foreign one.
    second_of_two = dict(process_index=1, process_count=2, share_index=1, share_count=2)
    for position in (None, saved):
        resumed = _resumed_afresh(corpus, caplog, position, **second_of_two)
        # The new position carries the folded seed: resuming it later continues exactly.
        position = resumed.get_state()
        continued = _stream(corpus, state=position, step=8, **second_of_two)
        assert _pairs(_take(continued, 2)) == _pairs(_take(resumed, 2))
        for stream in (resumed, continued):
            stream.close()
    assert streaming.fold_seed(3, 5) not in (3, streaming.fold_seed(3, 6), streaming.fold_seed(4, 5))


def test_a_position_resumes_only_in_the_process_and_share_that_saved_it(corpus, caplog):
    """A checkpoint saved by another number of processes hands every process the first one's position. With the
    batch replicated over pairs of processes the number of shares can stay the same while processes change
    shares: resumed in another share, that position would skip and repeat records without a word."""
    first_of_two = dict(process_index=0, process_count=2, share_index=0, share_count=2)
    interrupted = _stream(corpus, **first_of_two)
    _take(interrupted, 5)
    saved = json.loads(json.dumps(interrupted.get_state()))
    expected = _pairs(_take(interrupted, 3))
    interrupted.close()
    with caplog.at_level(logging.WARNING):
        resumed = _stream(corpus, state=saved, step=5, **first_of_two)
    assert not caplog.records and _pairs(_take(resumed, 3)) == expected
    resumed.close()
    another_share = dict(process_index=1, process_count=2, share_index=1, share_count=2)
    four_processes = dict(process_index=2, process_count=4, share_index=0, share_count=2)  # Its share, others' run.
    for process in (another_share, four_processes):
        _resumed_afresh(corpus, caplog, saved, **process).close()


def test_a_position_that_fits_starts_afresh_where_another_process_has_none(corpus, caplog):
    """One process starting afresh while the others resume would read their shares' records (or, holding the
    same rows as another, other rows): where any process lacks a usable position, every process starts afresh."""
    first_of_two = dict(process_index=0, process_count=2, share_index=0, share_count=2)
    interrupted = _stream(corpus, **first_of_two)
    _take(interrupted, 5)
    saved = json.loads(json.dumps(interrupted.get_state()))
    interrupted.close()
    another_share = dict(first_of_two, process_index=1, share_index=1)
    # What each process tells the others (once, so that the collective matches): whether its own position fits.
    for options, fits_here in ((first_of_two, True), (another_share, False)):
        told = []

        def another_has_none(fits: bool) -> bool:
            told.append(fits)
            return False

        _resumed_afresh(corpus, caplog, saved, every_process_fits=another_has_none, **options).close()
        assert told == [fits_here]


def test_a_stream_at_step_0_asks_no_other_process(corpus):
    """Every process starts afresh at step 0: a collective there would only cost start-up time."""

    def asked(fits: bool) -> bool:
        raise AssertionError(f"asked the other processes at step 0 ({fits})")

    _stream(corpus, every_process_fits=asked).close()


def test_a_position_of_another_shuffle_starts_afresh(corpus, caplog):
    """Such a position indexes another order: resumed as it is, it would skip and repeat records."""
    interrupted = _stream(corpus)
    _take(interrupted, 5)
    saved = interrupted.get_state()
    interrupted.close()
    saved["stream"]["shuffle_version"] = streaming.SHUFFLE_VERSION + 1
    _resumed_afresh(corpus, caplog, saved).close()


def test_a_position_on_another_corpus_of_the_same_size_starts_afresh(corpus, caplog):
    """Positions index records by number: on other records they would name other pairs."""
    records, path = corpus
    interrupted = _stream(corpus)
    _take(interrupted, 5)
    saved = interrupted.get_state()
    interrupted.close()
    rng = random.Random(1)
    other = [{"en": _sentence(rng).encode(), "de": _sentence(rng).upper().encode()} for _ in records]
    _resumed_afresh((other, path), caplog, saved).close()


def test_waiting_pairs_longer_than_a_smaller_max_length_are_left_out():
    from input_pipeline.row_packing import RowBatchIterDataset

    chunks = _chunk_stream(64, 12)
    lengths = np.random.default_rng(0).integers(1, 13, (64, 2))  # `_chunk_stream`'s first draw.
    saved_under_16 = iter(RowBatchIterDataset(chunks, max_length=16, rows=4))
    next(saved_under_16)
    state = saved_under_16.get_state()  # First fit: the pair that fit no row waits.
    ((group,),) = [state["waiting"]]
    ((offset, _),) = group["pairs"]
    number = 4 + 16 * group["chunk"]["next_index"] + offset
    assert lengths[number - 4].max() > 8
    for max_length in (8, 16):
        resumed = iter(RowBatchIterDataset(chunks, max_length=max_length, rows=4))
        resumed.set_state(state)
        batch = next(resumed)
        assert (batch["targets_segment_ids"] > 0).any()  # Not stuck on a pair that fits no row.
        assert batch["targets"].shape == (4, max_length)
        assert (number in _pair_numbers(batch)) == (max_length == 16)


def test_records_digest_tells_contents_apart_and_ignores_the_reading(corpus):
    records, _ = corpus
    digest = streaming.records_digest(records)
    assert streaming.records_digest([dict(r) for r in records]) == digest
    assert streaming.records_digest([{k: v.decode() for k, v in r.items()} for r in records]) == digest
    changed = list(records)
    changed[-1] = {**records[-1], "de": b"ANDERS"}
    assert streaming.records_digest(changed) != digest
    assert streaming.records_digest(records[:-1]) != digest


@pytest.mark.parametrize("lookahead, resumed_lookahead", [(0, 0), (2, 2), (2, 0), (0, 2)])
def test_other_devices_or_lookahead_go_on_from_the_same_pairs(corpus, lookahead, resumed_lookahead):
    """Another batch size (devices) or packer with the saved position: no pair skipped or repeated."""
    first = _stream(corpus, rows=ROWS, packing_lookahead=lookahead)
    before = _take(first, 6)
    saved = first.get_state()
    first.close()
    resumed = _stream(corpus, rows=2 * ROWS, packing_lookahead=resumed_lookahead, state=saved, step=6)
    after = _take(resumed, 4)
    position = resumed.get_state()
    resumed.close()
    assert all(b["inputs"].shape == (2 * ROWS, MAX_LENGTH) for b in after)
    placed, _ = _placed_and_waiting(corpus, position)
    assert collections.Counter(_pairs(before) + _pairs(after)) == placed


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


@pytest.mark.slow  # grain's worker processes.
def test_workers_make_the_same_stream_on_every_run_and_restore(corpus):
    from absl import flags  # pylint: disable=g-import-not-at-top

    if not flags.FLAGS.is_parsed():  # train.py parses them; grain's workers read one.
        flags.FLAGS.mark_as_parsed()
    first = _stream(corpus, num_workers=2, packing_lookahead=2)
    batches = _take(first, 6)
    saved = first.get_state()
    more = _take(first, 3)
    first.close()
    second = _stream(corpus, num_workers=2, packing_lookahead=2)
    assert _pairs(_take(second, 6)) == _pairs(batches)
    second.close()
    restored = _stream(corpus, num_workers=2, packing_lookahead=2, state=saved, step=6)
    assert _pairs(_take(restored, 3)) == _pairs(more)
    restored.close()
    assert os.path.exists(corpus[1])


@pytest.mark.parametrize("lookahead", [0, 8])  # Without packing, no pair is read ahead.
def test_unpacked_row_batches_restore_where_a_batch_ends_a_chunk(lookahead):
    """A position saved where a batch used up its chunk names the next chunk, which a restore reads first."""
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
    dataset = RowBatchIterDataset(
        chunk_stream.to_iter_dataset(no_read_ahead), max_length=8, rows=4, packing=False, lookahead=lookahead
    )
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
