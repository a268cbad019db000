"""Validation loss, translation (greedy, beam search or sampling), sacreBLEU and chrF on a split."""

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence

import jax
import ml_collections
import numpy as np
import sacrebleu
import sentencepiece as spm
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from common import io_errors, processes
from common.decoding_names import describe_decoding
from common.mesh_axes import LogicalRules
from common.special_ids import BOS_ID, EOS_ID, PAD_ID
from input_pipeline import batching
from input_pipeline.text_lines import TextPairs
from models import Transformer, continuous_batching
from models.decoding import beam_search, decode_length, generate, sentences_per_batch
from models.search import argmax_token, sampled_token
from training.reporting.scores import nulls_for_nonfinite, write_scores
from training.runtime.sharding import batch_sharding, num_batch_shards, process_rows, shard_batch
from training.steps import eval_step
from training.tasks import base

EvalFn = Callable  # (params, batch) -> {'nll', 'correct', 'tokens'} sums
DecodeFn = Callable  # (params, inputs, budgets, rng, max_length=) -> [batch, max_length] ids


def make_row_decoder(
    model: Transformer, eval_config: ml_collections.ConfigDict
) -> continuous_batching.RowDecoder | None:
    """Greedy or beam search over rows refilled as sentences finish (models/continuous_batching.py); None for
    sampling, which draws step i of batch b from fold_in(fold_in(seed, b), i): it decodes batch by batch."""
    special = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
    if eval_config.temperature > 0:
        return None
    if eval_config.beam_size > 1:
        search = continuous_batching.beam_search(
            beam_size=eval_config.beam_size, alpha=eval_config.length_penalty, **special
        )
    else:
        search = continuous_batching.greedy_search(**special)
    return continuous_batching.row_decoder(model, search, pad_id=PAD_ID)


def make_decode_fn(model: Transformer, eval_config: ml_collections.ConfigDict) -> DecodeFn:
    """The jitted decoding config.eval asks for: greedy (beam_size 1), beam search, or sampling (temperature > 0)."""
    special = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
    if eval_config.temperature > 0:
        choose_token = sampled_token(eval_config.temperature, eval_config.top_k)
        sample = functools.partial(generate, model=model, choose_token=choose_token, **special)

        def decode(params, inputs, budgets, rng, *, max_length):
            return sample(params, inputs, rng, max_length=max_length, budgets=budgets)

    else:
        if eval_config.beam_size > 1:
            search = functools.partial(
                beam_search, model=model, beam_size=eval_config.beam_size, alpha=eval_config.length_penalty, **special
            )
        else:
            search = functools.partial(generate, model=model, choose_token=argmax_token, **special)

        def decode(params, inputs, budgets, rng, *, max_length):
            del rng  # Search is deterministic.
            return search(params, inputs, max_length=max_length, budgets=budgets)

    return jax.jit(decode, static_argnames=("max_length",))


@dataclasses.dataclass(frozen=True)
class EvalSetup:
    """What evaluation needs besides the parameters."""

    eval_fn: EvalFn
    decode_fn: DecodeFn
    mesh: jax.sharding.Mesh
    tokenizer: spm.SentencePieceProcessor
    boundaries: Sequence[int]
    batch_sizes: dict[int, int]  # Sentences of a batch of each bucket; the row decoder's rows at each length.
    rules: LogicalRules  # How batches are split over the mesh (config.mesh.rules), as `batch_sizes` were sized.
    max_decode_length: int
    decoding: str = "greedy"  # As `describe_decoding` puts it.
    # Greedy and beam search decode in rows refilled as sentences end; None (sampling): batch by batch.
    row_decoder: continuous_batching.RowDecoder | None = None
    seed: int = 0  # Sampling's randomness: batch i uses fold_in(PRNGKey(seed), i).

    def batches(self, pairs: batching.ParallelIds):
        """`batching.eval_batches` of `pairs`, this process's rows of each."""
        rows = functools.partial(process_rows, mesh=self.mesh, rules=self.rules)
        return batching.eval_batches(pairs, self.boundaries, self.batch_sizes, rows)


def eval_setup(config, model, tokenizer, mesh) -> EvalSetup:
    """Decoding, eval steps and batching of config.eval for `model` on `mesh` (shared with translate.py)."""
    return EvalSetup(
        eval_fn=jax.jit(functools.partial(eval_step, model=model)),
        decode_fn=make_decode_fn(model, config.eval),
        row_decoder=make_row_decoder(model, config.eval),
        mesh=mesh,
        tokenizer=tokenizer,
        boundaries=tuple(config.dataset.bucket_boundaries),
        batch_sizes=base.batch_sizes(
            config, sentences_per_batch(config.eval.per_device_batch_size, config.eval.beam_size), mesh
        ),
        max_decode_length=config.eval.max_decode_length,
        decoding=describe_decoding(config.eval),
        seed=config.seed,
        rules=config.mesh.rules,
    )


def loss_metrics(setup: EvalSetup, params, pairs: batching.ParallelIds) -> dict[str, float]:
    """Per-token 'loss' (NLL), 'perplexity' and 'accuracy' over a whole split."""
    totals = None
    for batch, _ in setup.batches(pairs):
        sums = setup.eval_fn(params, shard_batch(batch, setup.mesh, setup.rules))
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    totals = jax.device_get(totals)
    tokens = max(float(totals["tokens"]), 1.0)
    loss = float(totals["nll"]) / tokens
    return {
        "loss": loss,
        "perplexity": float(np.exp(min(loss, 50.0))),
        "accuracy": float(totals["correct"]) / tokens,
    }


def translate_ids(setup: EvalSetup, params, sources: batching.RaggedIds) -> list[list[int]]:
    """Output ids of every source, in their order, each cut before its first <eos> (or padding).

    Sources longer than the last bucket are cut to it, keeping their <eos> (callers warn). Each
    output has the budget of its own source (`decode_length`), whatever rows it is decoded beside.
    An empty source (only <eos>) is not decoded: its output is empty. Every process gets every output.
    """
    outputs = [[] for _ in range(len(sources))]
    nonempty = np.flatnonzero(sources.lengths > 1)
    for index, ids in _decoded(setup, params, sources.select(nonempty)):
        # Padding follows <eos>, or the last token of an output that its budget ended.
        ends = np.flatnonzero((ids == EOS_ID) | (ids == PAD_ID))
        outputs[nonempty[index]] = (ids[: ends[0]] if len(ends) else ids).tolist()
    return outputs


def _decoded(setup: EvalSetup, params, sources: batching.RaggedIds) -> Iterator[tuple[int, np.ndarray]]:
    """(source index, output ids) of every source, in no particular order."""

    def fetch(array):
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    if setup.row_decoder is not None:
        rows_sharding = batch_sharding(setup.mesh, setup.rules)
        yield from continuous_batching.decode_sentences(
            setup.row_decoder,
            params,
            [batching.cut_keeping_eos(sources[i], setup.boundaries[-1]) for i in range(len(sources))],
            rows=setup.batch_sizes,
            row_multiple=num_batch_shards(setup.mesh, setup.rules),
            max_decode_length=setup.max_decode_length,
            place=functools.partial(_place_rows, sharding=rows_sharding),
            fetch=fetch,
            row_sharding=rows_sharding,
        )
        return
    rows = functools.partial(process_rows, mesh=setup.mesh, rules=setup.rules)
    base_rng = jax.random.PRNGKey(setup.seed)
    for batch_index, (inputs, indices) in enumerate(
        batching.source_batches(sources, setup.boundaries, setup.batch_sizes, rows)
    ):
        rng = jax.random.fold_in(base_rng, batch_index)
        max_length = decode_length(inputs.shape[1], setup.max_decode_length)
        budgets = decode_length(np.sum(inputs != PAD_ID, axis=1), setup.max_decode_length)
        placed = shard_batch({"inputs": inputs, "budgets": budgets}, setup.mesh, setup.rules)
        decoded = fetch(setup.decode_fn(params, placed["inputs"], placed["budgets"], rng, max_length=max_length))
        yield from zip(indices, decoded[: len(indices)])


def _place_rows(tree, sharding: NamedSharding):
    """Device arrays of a pytree of host arrays that every process holds whole: leading dimensions split as
    `sharding` splits a batch, scalars replicated."""
    replicated = NamedSharding(sharding.mesh, PartitionSpec())

    def place(leaf):
        leaf = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, sharding if leaf.ndim else replicated, leaf.__getitem__)

    return jax.tree.map(place, tree)


def translate(setup: EvalSetup, params, pairs: batching.ParallelIds) -> list[str]:
    """Detokenized translations of every source in `pairs`, in their order."""
    return [setup.tokenizer.decode(ids) for ids in translate_ids(setup, params, pairs.sources)]


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
    limit = setup.boundaries[-1]
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
    hypotheses = translate(setup, params, ids)
    scores["bleu"], scores["signature"] = bleu(hypotheses, text.targets)
    scores["chrf"], scores["chrf_signature"] = chrf(hypotheses, text.targets)
    scores["decoding"] = setup.decoding
    scores["max_decode_length"] = setup.max_decode_length
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
