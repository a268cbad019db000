"""Validation loss, translation (greedy, beam search or sampling), sacreBLEU and chrF on a split."""

import dataclasses
import functools
import os
from collections.abc import Callable

import jax
import numpy as np
import sacrebleu
from absl import logging

from common import io_errors, processes
from input_pipeline import batching
from input_pipeline.text_lines import TextPairs
from training.reporting.scores import nulls_for_nonfinite, write_scores
from training.runtime.sharding import process_rows, shard_batch
from training.steps import eval_step
from training.tasks import translation_decoding
from training.tasks.translation_decoding import Translator

EvalFn = Callable  # (params, batch) -> {'nll', 'correct', 'tokens'} sums


@dataclasses.dataclass(frozen=True)
class EvalSetup:
    """What evaluation needs besides the parameters: the loss step, and translation (batched as it is)."""

    eval_fn: EvalFn
    translator: Translator

    def batches(self, pairs: batching.ParallelIds):
        """`batching.eval_batches` of `pairs`, this process's rows of each."""
        translator = self.translator
        rows = functools.partial(process_rows, mesh=translator.mesh, rules=translator.rules)
        return batching.eval_batches(pairs, translator.boundaries, translator.rows, rows)


def eval_setup(config, model, tokenizer, mesh) -> EvalSetup:
    """The loss step and config.eval's translation of `model` on `mesh`."""
    return EvalSetup(
        eval_fn=jax.jit(functools.partial(eval_step, model=model)),
        translator=translation_decoding.translator(config, model, tokenizer, mesh),
    )


def loss_metrics(setup: EvalSetup, params, pairs: batching.ParallelIds) -> dict[str, float]:
    """Per-token 'loss' (NLL), 'perplexity' and 'accuracy' over a whole split."""
    totals = None
    for batch, _ in setup.batches(pairs):
        sums = setup.eval_fn(params, shard_batch(batch, setup.translator.mesh, setup.translator.rules))
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    totals = jax.device_get(totals)
    tokens = max(float(totals["tokens"]), 1.0)
    loss = float(totals["nll"]) / tokens
    return {
        "loss": loss,
        "perplexity": float(np.exp(min(loss, 50.0))),
        "accuracy": float(totals["correct"]) / tokens,
    }


def bleu(hypotheses: list[str], references: list[str]) -> tuple[float, str]:
    """Detokenized corpus sacreBLEU and its signature."""
    metric = sacrebleu.metrics.BLEU()
    score = metric.corpus_score(hypotheses, [references])
    return score.score, str(metric.get_signature())


def chrf(hypotheses: list[str], references: list[str]) -> tuple[float, str]:
    """Corpus chrF (character n-gram F-score, sacreBLEU's defaults) and its signature."""
    metric = sacrebleu.metrics.CHRF()
    score = metric.corpus_score(hypotheses, [references])
    return score.score, str(metric.get_signature())


def evaluate_split(
    setup: EvalSetup,
    params,
    step: int,
    split: str,
    text: TextPairs,
    ids: batching.ParallelIds,
    out_dir: str,
    checkpoint: str,
) -> tuple[dict, list[str]]:
    """Loss, perplexity, BLEU and chrF on a split; writes scores, hypotheses and references.

    Args:
        setup: decoding, batching and the tokenizer.
        params: the parameters to evaluate.
        step: the training step they stand for.
        split: the split's name, for the scores and logs.
        text, ids: the split as text (references) and as subword ids.
        out_dir: where to write scores.json, hypotheses.txt and references.txt (one
            line per pair, in the split's order).
        checkpoint: which parameters these are ('step 800', 'average of steps ...').

    Returns:
        The scores (as in scores.json) and the hypotheses.
    """
    limit = setup.translator.boundaries[-1]
    long_sources, long_targets = (int(np.sum(side.lengths > limit)) for side in (ids.sources, ids.targets))
    if long_sources or long_targets:
        logging.warning(
            "%s: %d source and %d target sentences are longer than %d subwords: translations are of the "
            "sources cut to that length (ending with <eos>), and the loss is over the cut pairs.",
            split,
            long_sources,
            long_targets,
            limit,
        )
    scores = {
        "split": split,
        "step": step,
        "checkpoint": checkpoint,
        "num_sentences": len(text),
        **loss_metrics(setup, params, ids),
    }
    hypotheses = translation_decoding.translate(setup.translator, params, ids.sources)
    scores["bleu"], scores["signature"] = bleu(hypotheses, text.targets)
    scores["chrf"], scores["chrf_signature"] = chrf(hypotheses, text.targets)
    scores["decoding"] = setup.translator.decoding
    scores["max_decode_length"] = setup.translator.max_decode_length
    scores = nulls_for_nonfinite(scores)
    if not processes.is_main_process():
        return scores, hypotheses
    os.makedirs(out_dir, exist_ok=True)
    for name, lines in (("hypotheses.txt", hypotheses), ("references.txt", text.targets)):
        path = os.path.join(out_dir, name)
        with io_errors.naming(path), open(path, "w", encoding="utf-8") as f:
            f.writelines(line.replace("\n", " ") + "\n" for line in lines)
    write_scores(scores, out_dir)
    return scores, hypotheses
