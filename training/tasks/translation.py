"""Translation as a task of the training loop: sentence pairs, the encoder-decoder, BLEU (see training.tasks).

Validation during training is the loss on the whole validation split and BLEU on its
first config.eval.num_bleu_sentences pairs (the keep-best metric); the final
evaluation of a split writes <workdir>/eval/<split>/ (training/tasks/translation_eval.py) and
puts the attention maps of its first sentence and translation into TensorBoard.
"""

import dataclasses
import functools

import jax
import ml_collections
import numpy as np
from absl import logging

from common import processes
from common.workdir import Workdir
from input_pipeline import batching, streaming
from input_pipeline.corpus import Corpus, load_corpus
from input_pipeline.text_lines import TextPairs
from models.build import make_model
from training import step_options
from training.reporting.attention_maps import write_attention_summary
from training.reporting.attention_page import write_evaluation_page
from training.reporting.attention_weights import sentence_attention
from training.reporting.metrics_writer import MetricWriter
from training.runtime import sharding
from training.steps import LossFn, translation_loss
from training.tasks import translation_eval
from training.tasks.translation_decoding import translate


def _head(text: TextPairs, ids: batching.ParallelIds, n: int) -> tuple[TextPairs, batching.ParallelIds]:
    """The first n pairs of a split (the BLEU check during training)."""
    keep = np.arange(min(n, len(text)))
    return (
        TextPairs(text.sources[:n], text.targets[:n]),
        batching.ParallelIds(ids.sources.select(keep), ids.targets.select(keep)),
    )


class TranslationTask:
    """Translation: the encoder-decoder on sentence pairs, kept best by validation BLEU (see training.tasks)."""

    keep_best_metric = "bleu"

    def load_data(self, config, workdir: str, splits: tuple[str, ...], *, allow_training_tokenizer: bool) -> Corpus:
        return load_corpus(config, workdir, splits, allow_training_tokenizer=allow_training_tokenizer)

    def train_batches(self, config, data: Corpus, mesh, position: dict | None, step: int) -> streaming.TrainStream:
        """The stream of packed (or padded) rows from data.train_records: this process's rows of each batch.

        Processes that hold the same rows (the batch replicated over a mesh axis across processes)
        read the same share of the records, so that their copies of those rows agree.
        """
        dataset = config.dataset
        global_rows = (
            config.per_device_batch_size
            * sharding.num_batch_shards(mesh, config.mesh.rules)
            * config.grad_accumulation_steps
        )
        rows = sharding.process_rows(global_rows, mesh, config.mesh.rules)
        share_index, share_count = sharding.data_share(rows, global_rows)
        return streaming.TrainStream(
            data.train_records,
            seed=config.seed,
            state=position,
            step=step,
            tokenizer_path=data.tokenizer_path,
            source_lang=dataset.source_lang,
            target_lang=dataset.target_lang,
            max_length=dataset.max_length,
            rows=rows.stop - rows.start,
            packing=dataset.packing,
            packing_lookahead=dataset.packing_lookahead,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            share_index=share_index,
            share_count=share_count,
            num_workers=dataset.num_workers,
        )

    def make_model(self, config, data: Corpus):
        return make_model(config, data.tokenizer.vocab_size())

    def loss_fn(self, config, model) -> LossFn:
        return functools.partial(
            translation_loss,
            model=model,
            label_smoothing=config.optimizer.label_smoothing,
            loss_chunks=step_options.option(config, "loss_chunks"),
        )

    def evaluator(self, config, model, data: Corpus, mesh) -> "TranslationEvaluator":
        return TranslationEvaluator(
            config, model, data, translation_eval.eval_setup(config, model, data.tokenizer, mesh)
        )


@dataclasses.dataclass(frozen=True)
class TranslationEvaluator:
    """Validation loss and BLEU on the first config.eval.num_bleu_sentences pairs; the full evaluation of a split."""

    config: ml_collections.ConfigDict
    model: object
    corpus: Corpus
    setup: translation_eval.EvalSetup

    def validate(self, params) -> dict[str, float]:
        split = self.config.dataset.valid_split
        valid = translation_eval.loss_metrics(self.setup, params, self.corpus.ids[split])
        if self.config.eval.num_bleu_sentences:
            text, ids = _head(self.corpus.text[split], self.corpus.ids[split], self.config.eval.num_bleu_sentences)
            valid["bleu"], _ = translation_eval.bleu(
                translate(self.setup.translator, params, ids.sources), text.targets
            )
        return valid

    def evaluate(self, params, step: int, checkpoint: str, workdir: str) -> dict:
        return evaluate_split(self.config, self.setup, self.model, params, step, checkpoint, self.corpus, workdir)


def evaluate_split(config, setup, model, params, step: int, description: str, corpus: Corpus, workdir: str) -> dict:
    """Evaluates config.eval.split into <workdir>/eval/<split>/; the attention of its first sentence and
    translation (config.eval.attention_maps) goes to TensorBoard and to <workdir>/eval/<split>/attention.html."""
    split = config.eval.split
    scores, hypotheses = translation_eval.evaluate_split(
        setup,
        params,
        step,
        split,
        corpus.text[split],
        corpus.ids[split],
        Workdir(workdir).evaluation(split),
        checkpoint=description,
    )
    _log_scores(scores)
    if config.eval.attention_maps and len(corpus.text[split]):  # The split's first sentence and its translation.
        source = corpus.text[split].sources[0]
        attention = sentence_attention(
            model, params, setup.translator.tokenizer, source, hypotheses[0]
        )  # On every process.
        writer = MetricWriter(workdir, f"eval_{split}")
        write_attention_summary(writer, step, attention)
        writer.close()
        if processes.is_main_process():
            write_evaluation_page(workdir, split, description, source, hypotheses[0], attention)
    return scores


def _log_scores(scores: dict) -> None:
    def number(name: str, digits: int) -> str:
        return "null" if scores[name] is None else f"{scores[name]:.{digits}f}"  # Null: not finite.

    logging.info(
        "%s, %s: BLEU %.2f, loss %s, perplexity %s (%s)",
        scores["split"],
        scores["checkpoint"],
        scores["bleu"],
        number("loss", 4),
        number("perplexity", 2),
        scores["signature"],
    )
