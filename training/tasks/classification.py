"""Classification with the encoder: its loss, predictions over a split, validation and evaluation (the Task).

Batches are {'inputs': [batch, length] int32 token ids, 'labels': [batch] int32 class ids}
(`input_pipeline.batching.LabelledIds`); filler rows are all padding and weigh nothing.
The train step's sums count examples where translation counts target tokens, so its
'loss' and 'accuracy' are per-example means.
"""

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from common import io_errors, processes
from common.mesh_axes import LogicalRules
from common.special_ids import PAD_ID
from common.workdir import Workdir
from input_pipeline import batching
from input_pipeline.corpus import LabelledCorpus, load_labelled_corpus
from input_pipeline.tokenizer import encode_sources
from models.build import make_model
from models.classifier import Classifier
from training.losses import weighted_metrics
from training.reporting import attention_maps
from training.reporting.attention_page import write_evaluation_page
from training.reporting.attention_weights import classifier_attention
from training.reporting.metrics_writer import MetricWriter
from training.reporting.scores import write_scores
from training.runtime.sharding import process_rows, shard_batch
from training.steps import LossFn
from training.tasks import base, classification_metrics

PREDICTIONS_FILE = "predictions.tsv"
CONFUSION_MATRIX_FILE = "confusion_matrix.png"


def real_rows(inputs: jax.Array) -> jax.Array:
    """[batch] 1.0 for examples, 0.0 for filler rows (all padding; a real row holds at least <eos>)."""
    return (inputs[:, 0] != PAD_ID).astype(jnp.float32)


def classification_loss(
    params: Any, batch: dict[str, jax.Array], rng: jax.Array, *, model: Classifier, label_smoothing: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The `LossFn` of classification: label-smoothed cross-entropy summed over the batch's examples.

    Returns:
        The summed loss, and sums of 'loss', 'nll', 'correct' and 'tokens' (here: examples).
    """
    logits = model.apply({"params": params}, batch["inputs"], deterministic=False, rngs={"dropout": rng})
    sums = weighted_metrics(logits, batch["labels"], real_rows(batch["inputs"]), label_smoothing)
    return sums["loss"], sums


def make_predict_fn(model: Classifier):
    """Jitted (params, inputs [batch, length]) -> class probabilities [batch, num_classes] float32."""

    def predict(params, inputs):
        return jax.nn.softmax(model.apply({"params": params}, inputs, deterministic=True), axis=-1)

    return jax.jit(predict)


@dataclasses.dataclass(frozen=True)
class PredictSetup:
    """What predicting needs besides the parameters."""

    predict_fn: Any  # From `make_predict_fn`.
    mesh: jax.sharding.Mesh
    boundaries: tuple[int, ...]
    batch_sizes: dict[int, int]
    rules: LogicalRules  # How batches are split over the mesh (config.mesh.rules), as `batch_sizes` were sized.


def predict_setup(config: ml_collections.ConfigDict, model: Classifier, mesh, batch_sizes) -> PredictSetup:
    return PredictSetup(
        make_predict_fn(model), mesh, tuple(config.dataset.bucket_boundaries), batch_sizes, config.mesh.rules
    )


def predict_probabilities(setup: PredictSetup, params, sources: batching.RaggedIds) -> np.ndarray:
    """[num_sentences, num_classes] class probabilities of every sentence, in their order, on every process.

    Sentences are batched by length; longer ones than the last bucket are cut to it.
    """
    rows = functools.partial(process_rows, mesh=setup.mesh, rules=setup.rules)
    outputs = None
    for inputs, indices in batching.source_batches(sources, setup.boundaries, setup.batch_sizes, rows):
        sharded = shard_batch({"inputs": inputs}, setup.mesh, setup.rules)["inputs"]
        probabilities = multihost_utils.process_allgather(setup.predict_fn(params, sharded), tiled=True)
        if outputs is None:
            outputs = np.zeros((len(sources), probabilities.shape[-1]), np.float32)
        outputs[indices] = probabilities[: len(indices)]
    return outputs if outputs is not None else np.zeros((0, 0), np.float32)


def split_scores(probabilities: np.ndarray, labels: np.ndarray, majority: int) -> dict[str, float]:
    """'loss' (mean NLL), 'accuracy', 'macro_f1' and 'majority_accuracy' (always predicting `majority`)."""
    num_classes = probabilities.shape[1]
    confusion = classification_metrics.confusion_matrix(labels, probabilities.argmax(axis=1), num_classes)
    nll = -np.log(np.maximum(probabilities[np.arange(len(labels)), labels], np.finfo(np.float32).tiny))
    return {
        "loss": float(nll.mean()) if len(labels) else 0.0,
        **classification_metrics.scores(confusion),
        "majority_accuracy": float(np.mean(labels == majority)) if len(labels) else 0.0,
    }


@dataclasses.dataclass(frozen=True)
class ClassificationEvaluator:
    """Validation scores during training, and the evaluation of config.eval.split into files."""

    config: ml_collections.ConfigDict
    model: Classifier
    corpus: LabelledCorpus
    setup: PredictSetup

    def validate(self, params) -> dict[str, float]:
        """'loss', 'accuracy', 'macro_f1' and 'majority_accuracy' on the validation split."""
        ids = self.corpus.ids[self.config.dataset.valid_split]
        probabilities = predict_probabilities(self.setup, params, ids.sources)
        return split_scores(probabilities, ids.labels, self.corpus.labels.majority)

    def evaluate(self, params, step: int, checkpoint: str, workdir: str) -> dict:
        """Scores, per-example predictions and the confusion matrix of config.eval.split.

        Writes <workdir>/eval/<split>/scores.json, predictions.tsv ('label<TAB>prediction<TAB>
        probability<TAB>text' per example, in the split's order, after a header line) and
        confusion_matrix.png; the attention maps of the split's first sentence go to TensorBoard
        (<workdir>/tensorboard/eval_<split>/).
        """
        split = self.config.eval.split
        ids, text, labels = self.corpus.ids[split], self.corpus.text[split], self.corpus.labels
        probabilities = predict_probabilities(self.setup, params, ids.sources)
        predictions = probabilities.argmax(axis=1) if len(ids) else np.zeros(0, np.int64)
        confusion = classification_metrics.confusion_matrix(ids.labels, predictions, len(labels.names))
        f1 = classification_metrics.per_class_f1(confusion)
        scores = {
            "split": split,
            "step": step,
            "checkpoint": checkpoint,
            "num_examples": len(ids),
            **split_scores(probabilities, ids.labels, labels.majority),
            "majority_label": labels.names[labels.majority],
            "per_class_f1": {name: float(f1[i]) for i, name in enumerate(labels.names)},
        }
        logging.info(
            "%s, %s: accuracy %.4f, macro-F1 %.4f (majority class %.4f), loss %.4f",
            split,
            checkpoint,
            scores["accuracy"],
            scores["macro_f1"],
            scores["majority_accuracy"],
            scores["loss"],
        )
        # The encoder's attention maps of the split's first sentence, as for translation: every process
        # runs the model on the global parameters, process 0 writes.
        attention = (
            classifier_attention(self.model, params, self.corpus.tokenizer, text.texts[0])
            if self.config.eval.attention_maps and len(text)
            else None
        )
        if not processes.is_main_process():
            return scores
        out_dir = Workdir(workdir).evaluation(split)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, PREDICTIONS_FILE)
        with io_errors.naming(path), open(path, "w", encoding="utf-8") as f:
            f.write("label\tprediction\tprobability\ttext\n")
            for i, sentence in enumerate(text.texts):
                predicted = int(predictions[i])
                f.write(f"{text.labels[i]}\t{labels.names[predicted]}\t{probabilities[i, predicted]:.4f}\t")
                f.write(" ".join(sentence.split()) + "\n")
        title = f"{split}, {checkpoint}: accuracy {scores['accuracy']:.3f}, macro-F1 {scores['macro_f1']:.3f}"
        figure = classification_metrics.confusion_matrix_figure(confusion, list(labels.names), title)
        figure.savefig(os.path.join(out_dir, CONFUSION_MATRIX_FILE))
        write_scores(scores, out_dir)
        if attention is not None:
            writer = MetricWriter(workdir, f"eval_{split}")
            attention_maps.write_attention_summary(writer, step, attention)
            writer.close()
            write_evaluation_page(workdir, split, checkpoint, text.texts[0], "", attention)
        return scores


class ClassificationTask:
    """Classification: the encoder Classifier on labelled sentences, kept best by validation accuracy."""

    keep_best_metric = "accuracy"

    def load_data(self, config, workdir: str, splits: tuple[str, ...], *, allow_training_tokenizer: bool):
        return load_labelled_corpus(config, workdir, splits, allow_training_tokenizer=allow_training_tokenizer)

    def train_batches(self, config, data: LabelledCorpus, mesh, position: dict | None, step: int):
        del step  # A position saved by other processes is never missing: every process computes all batches.
        return base.bucketed_train_batches(config, data.ids[config.dataset.train_split], mesh, position)

    def make_model(self, config, data: LabelledCorpus) -> Classifier:
        return make_model(config, data.tokenizer.vocab_size(), num_classes=len(data.labels.names))

    def loss_fn(self, config, model: Classifier) -> LossFn:
        return functools.partial(classification_loss, model=model, label_smoothing=config.optimizer.label_smoothing)

    def evaluator(self, config, model: Classifier, data: LabelledCorpus, mesh) -> ClassificationEvaluator:
        sizes = base.batch_sizes(config, config.eval.per_device_batch_size, mesh)
        return ClassificationEvaluator(config, model, data, predict_setup(config, model, mesh, sizes))


def classify_lines(
    setup: PredictSetup, params, tokenizer, lines: list[str], max_length: int
) -> list[tuple[int, float] | None]:
    """(class id, its probability) of each raw sentence, in order; None for an empty line.

    Sentences longer than `max_length` subwords (with <eos>) are cut to it, with a warning naming the line.
    """
    lines = [line.strip() for line in lines]
    nonempty = [i for i, line in enumerate(lines) if line]
    sources, cut = encode_sources(tokenizer, [lines[i] for i in nonempty], max_length)
    for i in cut:
        logging.warning(
            "Line %d is longer than %d subwords; only its beginning is classified.", nonempty[i] + 1, max_length
        )
    results: list[tuple[int, float] | None] = [None] * len(lines)
    if nonempty:
        probabilities = predict_probabilities(setup, params, sources)
        for row, i in enumerate(nonempty):
            best = int(probabilities[row].argmax())
            results[i] = (best, float(probabilities[row, best]))
    return results
