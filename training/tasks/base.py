"""The seam between the training loop and a task (translation, classification).

The loop (training/loop.py) trains and evaluates any task the same way: the same
state, optimizer, compiled train step, restorable training batches, checkpoints,
keep-best and metrics. What differs is asked of a `Task`: its data, its training
batches (translation streams packed rows from records, classification takes
length buckets of its in-memory examples), its model, its loss, and how its
parameters are validated and evaluated.
`training.tasks.translation.TranslationTask` and `training.tasks.classification.ClassificationTask`
implement it; `config.task` picks one (`training.loop.make_task`). What they share is here
too: the bucket batch sizes of a mesh, and length-bucketed training batches.
"""

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import jax
import ml_collections
import numpy as np
import sentencepiece as spm

from input_pipeline import batching
from input_pipeline.batching import Examples
from training.runtime import sharding

if TYPE_CHECKING:  # The steps import optax, which translating (translation_decoding's rows) does without.
    from training.steps import LossFn


class TrainBatchIterator(Protocol, Iterator[dict[str, np.ndarray]]):
    """Endless training batches (this process's rows of each global batch) with a position to checkpoint."""

    def get_state(self) -> dict:
        """The position after the last batch returned, JSON-serialisable."""

    def close(self) -> None:
        """Releases threads or processes."""


class Data(Protocol):
    """The splits a run needs, tokenized with the workdir's tokenizer."""

    tokenizer: spm.SentencePieceProcessor
    ids: dict[str, Examples]  # split -> examples the batching reads (lengths, padded batches)


class Evaluator(Protocol):
    """Validation during training and the final evaluation of a split, for one model and its data."""

    def validate(self, params: Any) -> dict[str, float]:
        """Scores on the validation split, with the task's `keep_best_metric` when it is computed."""

    def evaluate(self, params: Any, step: int, checkpoint: str, workdir: str) -> dict:
        """Evaluates config.eval.split: writes <workdir>/eval/<split>/ (scores.json, ...) and returns the scores."""


class Task(Protocol):
    """What the loop needs from a task."""

    # The validation score that picks best_checkpoint/ (higher is better), e.g. 'bleu' or 'accuracy'.
    keep_best_metric: str

    def load_data(
        self,
        config: ml_collections.ConfigDict,
        workdir: str,
        splits: tuple[str, ...],
        *,
        allow_training_tokenizer: bool,
    ) -> Data:
        """The splits, with the workdir's tokenizer (trained on the first run when allowed)."""

    def train_batches(
        self,
        config: ml_collections.ConfigDict,
        data: Data,
        mesh: jax.sharding.Mesh,
        position: dict | None,
        step: int,
    ) -> TrainBatchIterator:
        """The training batches from `position` (a checkpoint's, reached at `step`; None: none saved)."""

    def make_model(self, config: ml_collections.ConfigDict, data: Data) -> Any:
        """The flax module config.model describes, sized for `data` (vocabulary, classes)."""

    def loss_fn(self, config: ml_collections.ConfigDict, model: Any) -> "LossFn":
        """The train step's loss of (params, batch, rng)."""

    def evaluator(
        self,
        config: ml_collections.ConfigDict,
        model: Any,
        data: Data,
        mesh: jax.sharding.Mesh,
    ) -> Evaluator:
        """Validation and evaluation of `model` on `data` (config.eval's batches) on `mesh`."""


def batch_sizes(
    config: ml_collections.ConfigDict, per_device: int, mesh: jax.sharding.Mesh, micro_batches: int = 1
) -> dict[int, int]:
    """Bucket batch sizes carrying per_device * batch shards * micro_batches * max_length tokens each.

    A batch is split into `micro_batches` (gradient accumulation), each over the
    mesh's batch shards (data x fsdp; devices along 'tensor' share their batch).
    """
    shards = sharding.num_batch_shards(mesh, config.mesh.rules) * micro_batches
    tokens = per_device * shards * config.dataset.max_length
    return batching.bucket_batch_sizes(config.dataset.bucket_boundaries, tokens, shards)


def bucketed_train_batches(
    config: ml_collections.ConfigDict, examples: Examples, mesh: jax.sharding.Mesh, position: dict | None
) -> batching.TrainBatches:
    """Length-bucketed batches of in-memory `examples`, from `position` (None: the start)."""
    batches = batching.TrainBatches(
        examples,
        config.dataset.bucket_boundaries,
        batch_sizes(config, config.per_device_batch_size, mesh, config.grad_accumulation_steps),
        config.seed,
        rows=functools.partial(sharding.process_rows, mesh=mesh, rules=config.mesh.rules),
    )
    if position is not None:
        batches.set_state(position)
    return batches
