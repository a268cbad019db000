"""Which parameters a user's checkpoint choice stands for ('latest', 'best', 'average:N', a step), and averaging.

Pure functions over what a workdir holds (its steps, its best score); `Checkpointer` reads the arrays.
"""

import dataclasses
import re
from collections.abc import Iterable
from typing import Any, Literal

import jax
import numpy as np

from common.errors import UserInputError

CHECKPOINT_CHOICES = "'latest', 'best', 'average:N' (the mean of the last N checkpoints) or a step number"


@dataclasses.dataclass(frozen=True)
class BestScore:
    """The step whose parameters have the highest validation score so far."""

    step: int
    value: float
    metric: str = "bleu"  # The validation score's name ('bleu', 'accuracy').

    @property
    def description(self) -> str:
        """'valid BLEU 17.20', 'valid accuracy 0.8123'."""
        if self.metric == "bleu":
            return f"valid BLEU {self.value:.2f}"
        return f"valid {self.metric} {self.value:.4f}"


@dataclasses.dataclass(frozen=True)
class Selection:
    """The checkpoints a user's choice stands for (resolved from metadata; no array read yet)."""

    kind: Literal["latest", "step", "best", "average"]
    steps: tuple[int, ...]  # One step, or the steps to average (ascending).
    description: str  # 'step 800', 'best (step 400, valid BLEU 17.20)', 'average of steps 400, 800'.

    @property
    def step(self) -> int:
        """The step the parameters stand for (the last one of an average)."""
        return self.steps[-1]


def resolve_choice(
    choice: str, steps: list[int], best: BestScore | None, directory: str, best_directory: str
) -> Selection:
    """The checkpoints `choice` names among `steps` (ascending) of `directory` and the best one.

    'latest' resolves to the last step; restoring falls back to earlier ones if it is damaged.

    Raises:
        UserInputError: the choice is malformed, or names checkpoints the workdir does not hold.
    """
    text = choice.strip().lower()
    if text == "best":
        if best is None:
            raise UserInputError(
                f"No best checkpoint in {best_directory}: it is kept during training when "
                "the validation score is computed (for translation: config.eval.num_bleu_sentences > 0), "
                f"or choose {CHECKPOINT_CHOICES}."
            )
        return Selection("best", (best.step,), f"best (step {best.step}, {best.description})")
    if text == "latest" or re.fullmatch(r"[0-9]+", text):
        if not steps:
            raise UserInputError(f"No complete checkpoint in {directory}; train first.")
        if text == "latest":
            return Selection("latest", (steps[-1],), f"step {steps[-1]}")
        step = int(text)
        if step not in steps:
            raise UserInputError(
                f"No checkpoint for step {step} in {directory}; it has steps {', '.join(map(str, steps))}."
            )
        return Selection("step", (step,), f"step {step}")
    if match := re.fullmatch(r"average:(\d+)", text):
        num = int(match[1])
        if num < 1:
            raise UserInputError(f"Checkpoint {choice!r}: the number of checkpoints to average must be >= 1.")
        if len(steps) < num:
            raise UserInputError(
                f"Checkpoint {choice!r} averages the last {num} checkpoints, but {directory} holds "
                f"{len(steps)} (steps {', '.join(map(str, steps)) or 'none'}); choose a smaller N, or keep "
                "more checkpoints during training with config.keep_checkpoints."
            )
        chosen = tuple(steps[-num:])
        return Selection("average", chosen, f"average of steps {', '.join(map(str, chosen))}")
    raise UserInputError(f"Unknown checkpoint {choice!r}: choose {CHECKPOINT_CHOICES}.")


def mean_params(params_per_step: Iterable[Any], abstract_params: Any) -> Any:
    """The mean of parameter pytrees, leaf by leaf (fairseq's average_checkpoints).

    The trees are consumed one at a time into a float32 running sum on the host, so memory holds
    two copies of the parameters, not one per step. Each process sums only the distinct pieces its
    devices hold (the trees come restored with the shardings of `abstract_params`), so parameters
    split over several processes' devices average too. The sum and the division are numpy's: XLA
    turns division by a scalar into multiplication by its rounded reciprocal, an ulp off the mean.
    The mean has the dtypes and shardings of `abstract_params`.
    """
    likes, treedef = jax.tree.flatten(abstract_params)
    totals, count = None, 0
    for params in params_per_step:
        pieces = [_local_pieces(leaf) for leaf in treedef.flatten_up_to(params)]
        if totals is None:
            totals = pieces
        else:
            totals = [{key: total[key] + piece[key] for key in total} for total, piece in zip(totals, pieces)]
        count += 1
    means = []
    for like, total in zip(likes, totals):
        mean = {key: (piece / np.float32(count)).astype(like.dtype) for key, piece in total.items()}
        index_map = like.sharding.addressable_devices_indices_map(like.shape)
        arrays = [jax.device_put(mean[_piece_key(index, like.shape)], device) for device, index in index_map.items()]
        means.append(jax.make_array_from_single_device_arrays(like.shape, like.sharding, arrays))
    return jax.tree.unflatten(treedef, means)


def _local_pieces(leaf: jax.Array) -> dict[tuple, np.ndarray]:
    """The distinct pieces of `leaf` this process's devices hold, float32, by where they sit (replicas once)."""
    pieces = {}
    for shard in leaf.addressable_shards:
        key = _piece_key(shard.index, leaf.shape)
        if key not in pieces:
            pieces[key] = np.asarray(shard.data, np.float32)
    return pieces


def _piece_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    """A hashable form of a shard's index (slices are unhashable before Python 3.12)."""
    return tuple(part.indices(size) for part, size in zip(index, shape))
