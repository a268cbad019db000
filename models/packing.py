"""`Packing`: where the sentence pairs sit in rows that pack several of them.

A training row may hold several pairs, described per side by 'segment_ids'
[batch, length] int32 (1, 2, ... per pair, 0 at padding; source segment k is the source
of target segment k) and 'positions' [batch, length] int32 (0, 1, ... restarting in each
segment). With them, every attention stays inside its pair, the decoder input restarts
with bos in each segment, and the positional encodings use the given positions, so each
pair's logits are those it would get in a row of its own. Without them (`packing=None`)
a row is one pair.

A batch dict carries them under BATCH_KEYS; `Packing.from_batch` gathers and checks them
once, and the model takes the result as one argument.
"""

from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import numpy as np

Array = jax.Array
# The batch keys of packed rows: segment ids and positions of the source ('inputs') and target ('targets').
BATCH_KEYS = ('inputs_segment_ids', 'inputs_positions', 'targets_segment_ids', 'targets_positions')


@flax.struct.dataclass
class Segments:
    """One side of packed rows: the segment of every token and its position within it."""

    segment_ids: Array  # [batch, length] int32: 1, 2, ... per pair, 0 at padding.
    positions: Array  # [batch, length] int32: 0, 1, ... restarting in each segment.


@flax.struct.dataclass
class Packing:
    """Packed rows, both sides: a pytree, so it passes through `jit`, `grad` and `Module.apply`."""

    source: Segments  # [batch, src_len] each.
    target: Segments  # [batch, tgt_len] each.

    @classmethod
    def from_batch(cls, batch: Mapping[str, Any]) -> 'Packing | None':
        """The packing of a batch dict with BATCH_KEYS, or None for one pair a row (none of them).

        Raises:
            ValueError: some of BATCH_KEYS but not all, or one whose shape differs from
                its side's ids ('inputs' [batch, src_len] or 'targets' [batch, tgt_len]).
        """
        given = [key for key in BATCH_KEYS if key in batch]
        if not given:
            return None
        if len(given) != len(BATCH_KEYS):
            missing = [key for key in BATCH_KEYS if key not in given]
            raise ValueError(f'Packed rows need {", ".join(BATCH_KEYS)} together; missing {", ".join(missing)}.')
        for side in ('inputs', 'targets'):
            ids_shape = np.shape(batch[side])
            for key in (f'{side}_segment_ids', f'{side}_positions'):
                if np.shape(batch[key]) != ids_shape:
                    raise ValueError(
                        f"Packed rows: '{key}' has shape {np.shape(batch[key])}, '{side}' {ids_shape}; "
                        'each token needs its segment id and position.'
                    )
        return cls(
            source=Segments(batch['inputs_segment_ids'], batch['inputs_positions']),
            target=Segments(batch['targets_segment_ids'], batch['targets_positions']),
        )
