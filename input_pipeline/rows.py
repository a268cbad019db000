"""Rows of a training batch written from their pairs: the arrays of the batch format (input_pipeline/row_packing.py).

Free of grain and TensorFlow, so that code without them (benchmarks/accelerator_check.py's
synthetic batches) writes rows exactly as the training stream does.
"""

from collections.abc import Sequence

import numpy as np

from common.special_ids import PAD_ID

# A pair: (source ids, target ids), each ending in <eos>.
Pair = tuple[Sequence[int], Sequence[int]]
SIDES = ("inputs", "targets")


def write_rows(row_pairs: list[list[Pair]], length: int, *, with_segments: bool) -> dict[str, np.ndarray]:
    """The batch arrays of each row's pairs, laid one after the other from the row's start.

    The ids are joined as Python lists, the segment ids and positions made from the sequences'
    lengths by NumPy: cheaper than writing each pair's slices.
    """
    rows = len(row_pairs)
    batch = {}
    for side_index, side in enumerate(SIDES):
        ids, runs, run_segments = [], [], []  # Runs: each sequence, then each row's padding (segment 0).
        for pairs in row_pairs:
            used = 0
            for segment, pair in enumerate(pairs, start=1):
                sequence = pair[side_index]
                ids.extend(sequence)
                runs.append(len(sequence))
                run_segments.append(segment)
                used += len(sequence)
            ids += [PAD_ID] * (length - used)
            runs.append(length - used)
            run_segments.append(0)
        batch[side] = np.array(ids, np.int32).reshape(rows, length)
        if with_segments:
            runs = np.array(runs)
            segment_ids = np.repeat(np.array(run_segments, np.int32), runs)
            run_starts = np.repeat((np.cumsum(runs) - runs).astype(np.int32), runs)
            positions = np.arange(rows * length, dtype=np.int32) - run_starts
            positions[segment_ids == 0] = 0
            batch[f"{side}_segment_ids"] = segment_ids.reshape(rows, length)
            batch[f"{side}_positions"] = positions.reshape(rows, length)
    return batch
