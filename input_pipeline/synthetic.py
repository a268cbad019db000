"""Synthetic training batches: packed rows of a copy task (target = source), from NumPy alone.

For measuring a train step where no corpus, tokenizer, grain or TensorFlow is at hand
(benchmarks/accelerator_check.py): the rows are packed and written as the training stream
writes them (`rows.write_rows`), with segment ids and positions, so the step compiled for
them is the one training runs. The task is learnable: each target copies its source, so a
model that reads the source drives the loss towards 0, while one that does not can do no
better than log(num_symbols) nats per symbol (`blind_nll`).
"""

import math

import numpy as np

from common.special_ids import EOS_ID
from input_pipeline.rows import Pair, write_rows

# The first id of the copied symbols: after the ids SentencePiece reserves (common/special_ids.py).
FIRST_SYMBOL = EOS_ID + 1


def copy_pairs(
    rng: np.random.Generator, count: int, *, num_symbols: int, min_length: int, max_length: int
) -> list[Pair]:
    """`count` pairs (ids, ids): uniformly random symbols then <eos>, `min_length`..`max_length` ids long in all."""
    if not 2 <= min_length <= max_length:
        raise ValueError(f"Copy pairs need 2 <= min_length <= max_length; got {min_length} and {max_length}.")
    lengths = rng.integers(min_length, max_length + 1, count)
    pairs = []
    for length in lengths:
        ids = np.append(rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + num_symbols, length - 1), EOS_ID).tolist()
        pairs.append((ids, ids))
    return pairs


def packed_copy_batch(
    rng: np.random.Generator,
    rows: int,
    length: int,
    *,
    num_symbols: int,
    min_length: int = 8,
    max_length: int = 64,
) -> dict[str, np.ndarray]:
    """A batch of `rows` packed rows of copy pairs: each row filled with pairs until the next one does not fit.

    Args:
        rng: the source of the symbols and lengths.
        rows, length: the batch's shape.
        num_symbols: symbols ids are drawn from, FIRST_SYMBOL .. FIRST_SYMBOL + num_symbols - 1 (the
            model's vocabulary must hold them).
        min_length, max_length: a pair's length range, <eos> included (at most `length`).

    Returns:
        'inputs', 'targets' and models.packing.BATCH_KEYS, [rows, length] int32 each ('targets' equal
        to 'inputs'; 0 at padding).
    """
    if max_length > length:
        raise ValueError(f"Copy pairs of up to {max_length} ids do not fit rows of {length}.")
    # Enough pairs for every row: each row holds at most length // min_length of them, and one is read ahead.
    pairs = iter(
        copy_pairs(
            rng,
            rows * (length // min_length + 1),
            num_symbols=num_symbols,
            min_length=min_length,
            max_length=max_length,
        )
    )
    row_pairs: list[list[Pair]] = []
    pair = next(pairs)
    for _ in range(rows):
        row, used = [], 0
        while used + len(pair[0]) <= length:
            row.append(pair)
            used += len(pair[0])
            pair = next(pairs)
        row_pairs.append(row)
    return write_rows(row_pairs, length, with_segments=True)


def blind_nll(num_symbols: int) -> float:
    """Nats per symbol of the best model that ignores the source: the symbols are uniform, so log(num_symbols)."""
    return math.log(num_symbols)
