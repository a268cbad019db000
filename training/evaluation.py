"""Validation loss, greedy translation and sacreBLEU on a split."""

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
import sacrebleu
import sentencepiece as spm
from absl import logging
from jax.experimental import multihost_utils

from input_pipeline import batching
from input_pipeline.datasets import TextPairs
from training import distributed
from training.sharding import process_rows, shard_batch

EvalFn = Callable  # (params, batch) -> {'nll', 'correct', 'tokens'} sums
DecodeFn = Callable  # (params, inputs, max_length) -> [batch, max_length] ids


@dataclasses.dataclass(frozen=True)
class EvalSetup:
    """What evaluation needs besides the parameters."""

    eval_fn: EvalFn
    decode_fn: DecodeFn
    mesh: jax.sharding.Mesh
    tokenizer: spm.SentencePieceProcessor
    boundaries: Sequence[int]
    batch_sizes: dict[int, int]
    max_decode_length: int

    def batches(self, pairs: batching.ParallelIds):
        """`batching.eval_batches` of `pairs`, this process's rows of each."""
        rows = functools.partial(process_rows, mesh=self.mesh)
        return batching.eval_batches(pairs, self.boundaries, self.batch_sizes, rows)


def loss_metrics(setup: EvalSetup, params, pairs: batching.ParallelIds) -> dict[str, float]:
    """Per-token 'loss' (NLL), 'perplexity' and 'accuracy' over a whole split."""
    totals = None
    for batch, _ in setup.batches(pairs):
        sums = setup.eval_fn(params, shard_batch(batch, setup.mesh))
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    totals = jax.device_get(totals)
    tokens = max(float(totals["tokens"]), 1.0)
    loss = float(totals["nll"]) / tokens
    return {
        "loss": loss,
        "perplexity": float(np.exp(min(loss, 50.0))),
        "accuracy": float(totals["correct"]) / tokens,
    }


def decode_length(source_length: int, max_decode_length: int) -> int:
    """Output budget for sources padded to `source_length`: generous, bounded."""
    return min(max_decode_length, 2 * source_length + 8)


def translate(setup: EvalSetup, params, pairs: batching.ParallelIds) -> list[str]:
    """Greedy translations of every source in `pairs`, in their order, detokenized."""
    hypotheses = [""] * len(pairs)
    for batch, indices in setup.batches(pairs):
        inputs = shard_batch({"inputs": batch["inputs"]}, setup.mesh)["inputs"]
        max_length = decode_length(batch["inputs"].shape[1], setup.max_decode_length)
        # Every process gets every row: all compute the same hypotheses, process 0 writes them.
        outputs = setup.decode_fn(params, inputs, max_length=max_length)
        outputs = multihost_utils.process_allgather(outputs, tiled=True)  # [batch, max_length] on every process.
        for row, index in enumerate(indices):
            ids = outputs[row].tolist()
            if setup.tokenizer.eos_id() in ids:
                ids = ids[: ids.index(setup.tokenizer.eos_id())]
            hypotheses[index] = setup.tokenizer.decode(ids)
    return hypotheses


def bleu(hypotheses: list[str], references: list[str]) -> tuple[float, str]:
    """Detokenized corpus sacreBLEU and its signature."""
    metric = sacrebleu.metrics.BLEU()
    score = metric.corpus_score(hypotheses, [references])
    return score.score, str(metric.get_signature())


def evaluate_split(
    setup: EvalSetup, params, step: int, split: str, text: TextPairs, ids: batching.ParallelIds, out_dir: str
) -> dict:
    """Loss, perplexity and BLEU on a split; writes scores, hypotheses and references.

    Files in `out_dir`: scores.json, hypotheses.txt and references.txt (one line
    per pair, in the split's order).
    """
    truncated = int(np.sum(ids.sources.lengths > setup.boundaries[-1]))
    if truncated:
        logging.warning(
            "%s: %d source sentences are longer than %d subwords and were truncated.",
            split,
            truncated,
            setup.boundaries[-1],
        )
    scores = {"split": split, "step": step, "num_sentences": len(text), **loss_metrics(setup, params, ids)}
    hypotheses = translate(setup, params, ids)
    scores["bleu"], scores["signature"] = bleu(hypotheses, text.targets)
    scores["decoding"] = "greedy"
    if not distributed.is_main_process():
        return scores
    os.makedirs(out_dir, exist_ok=True)
    for name, lines in (("hypotheses.txt", hypotheses), ("references.txt", text.targets)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.writelines(line.replace("\n", " ") + "\n" for line in lines)
    with open(os.path.join(out_dir, "scores.json"), "w", encoding="utf-8") as f:
        json.dump(scores, f, indent=2)
    return scores
