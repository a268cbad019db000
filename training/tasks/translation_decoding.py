"""Translation on a mesh: config.eval's search, decoded by continuous batching (translate.py, evaluation).

The path a translation takes at run time, kept apart from evaluation's scoring (sacrebleu) and train
steps (optax), which translate.py does not need.
"""

import dataclasses
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
import sentencepiece as spm
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from common.decoding_names import describe_decoding
from common.mesh_axes import LogicalRules
from common.special_ids import BOS_ID, EOS_ID, PAD_ID
from input_pipeline import batching
from models import Transformer, continuous_batching
from models.beam_search import BeamSearch
from models.decoding import sentences_per_batch
from models.search import Search, SpecialIds
from models.token_search import TokenSearch, argmax_token, sampled_token
from training.runtime.program_store import ProgramStore
from training.runtime.sharding import batch_sharding, decoding_cache_sharding, num_batch_shards, without_unit_axes
from training.tasks import base

SPECIAL_IDS = SpecialIds(bos=BOS_ID, eos=EOS_ID, pad=PAD_ID)


def search_of(eval_config: ml_collections.ConfigDict, seed: int = 0) -> Search:
    """config.eval's search: sampling (temperature > 0, keyed by `seed` and each sentence), beam search
    (beam_size > 1) or greedy search."""
    if eval_config.temperature > 0:
        return TokenSearch(sampled_token(eval_config.temperature, eval_config.top_k), SPECIAL_IDS, seed)
    if eval_config.beam_size > 1:
        return BeamSearch(eval_config.beam_size, eval_config.length_penalty, SPECIAL_IDS)
    return TokenSearch(argmax_token, SPECIAL_IDS)


@dataclasses.dataclass(frozen=True)
class Translator:
    """A row decoder of config.eval's search on a mesh, with what it takes to feed it."""

    decoder: continuous_batching.RowDecoder
    mesh: jax.sharding.Mesh
    rules: LogicalRules  # How rows are split over the mesh (config.mesh.rules).
    tokenizer: spm.SentencePieceProcessor
    boundaries: Sequence[int]
    rows: dict[int, int]  # The most sentences decoded at once at each bucket's length (and evaluation's batches).
    max_decode_length: int
    decoding: str  # As `describe_decoding` puts it.


def translator(
    config: ml_collections.ConfigDict, model: Transformer, tokenizer, mesh, store: ProgramStore | None = None
) -> Translator:
    """The `Translator` of config.eval for `model` on `mesh`; its programs kept in `store` (None: traced anew)."""
    eval_config = config.eval
    sentences = sentences_per_batch(eval_config.per_device_batch_size, eval_config.beam_size)
    decoder = continuous_batching.row_decoder(model, search_of(eval_config, config.seed))
    if store is not None:
        search = {name: eval_config[name] for name in ("beam_size", "length_penalty", "temperature", "top_k")}
        description = {"model": config.model.to_dict(), "search": search, "seed": config.seed}
        decoder = _stored(decoder, store, description)
    return Translator(
        decoder=decoder,
        mesh=mesh,
        rules=config.mesh.rules,
        tokenizer=tokenizer,
        boundaries=tuple(config.dataset.bucket_boundaries),
        rows=base.batch_sizes(config, sentences, mesh),
        max_decode_length=eval_config.max_decode_length,
        decoding=describe_decoding(eval_config),
    )


def _stored(decoder: continuous_batching.RowDecoder, store: ProgramStore, description: dict):
    """`decoder` whose compiled programs and shapes `store` keeps from one process to the next."""

    def advance(params, decoding, block, min_done, *, layout):
        args = (params, decoding, block, min_done)
        return store.compiled([description, "advance"], decoder.advance, *args, layout=layout)(*args)

    def narrow(decoding, *, stage, layout):
        return store.compiled([description, "narrow"], decoder.narrow, decoding, stage=stage, layout=layout)(decoding)

    def shapes(params, *sizes):
        return store.shapes([description, "decoding", *sizes], lambda: decoder.shapes(params, *sizes), params)

    return dataclasses.replace(decoder, advance=advance, narrow=narrow, shapes=shapes)


def translate_ids(translator: Translator, params, sources: batching.RaggedIds) -> list[list[int]]:
    """Output ids of every source, in their order, each cut before its first <eos> (or padding).

    Sources longer than the last bucket are cut to it, keeping their <eos> (callers warn). Each
    output has the budget of its own source (`decode_length`), whatever rows it is decoded beside,
    and sampling keys it on its index. An empty source (only <eos>) is not decoded: its output is
    empty. Every process gets every output.
    """
    layout = continuous_batching.Layout(
        rows=without_unit_axes(batch_sharding(translator.mesh, translator.rules)),
        heads=without_unit_axes(decoding_cache_sharding(translator.mesh, translator.rules)),
    )
    longest = translator.boundaries[-1]
    nonempty = {int(i): batching.cut_keeping_eos(sources[i], longest) for i in np.flatnonzero(sources.lengths > 1)}
    outputs = [[] for _ in range(len(sources))]
    decoded = continuous_batching.decode_sentences(
        translator.decoder,
        params,
        nonempty,
        rows=translator.rows,
        row_multiple=num_batch_shards(translator.mesh, translator.rules),
        max_decode_length=translator.max_decode_length,
        place=lambda tree, heads=False: place_rows(tree, layout.heads if heads else layout.rows),
        fetch=lambda array: np.asarray(multihost_utils.process_allgather(array, tiled=True)),
        layout=layout,
    )
    for index, ids in decoded:
        # Padding follows <eos>, or the last token of an output that its budget ended.
        ends = np.flatnonzero((ids == EOS_ID) | (ids == PAD_ID))
        outputs[index] = (ids[: ends[0]] if len(ends) else ids).tolist()
    return outputs


def translate(translator: Translator, params, sources: batching.RaggedIds) -> list[str]:
    """Detokenized translations of every source, in their order."""
    return [translator.tokenizer.decode(ids) for ids in translate_ids(translator, params, sources)]


def place_rows(tree, sharding: NamedSharding):
    """Device arrays of a pytree of host arrays that every process holds whole: leading dimensions split as
    `sharding` splits a batch, scalars replicated."""
    replicated = NamedSharding(sharding.mesh, PartitionSpec())

    def place(leaf):
        leaf = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, sharding if leaf.ndim else replicated, leaf.__getitem__)

    return jax.tree.map(place, tree)
