"""Checks of config.eval's decoding options, and of the memory that decoding needs (models/continuous_batching.py)."""

import jax.numpy as jnp
import ml_collections

from common.config_fields import require_positive
from common.errors import UserInputError
from models.decoding import decode_length
from models.transformer import TransformerConfig


def check_decoding(eval_config: ml_collections.ConfigDict) -> None:
    """Raises UserInputError naming the first decoding option of config.eval that cannot work."""
    for name in ("max_decode_length", "beam_size"):
        require_positive(f"eval.{name}", eval_config[name])
    if eval_config.length_penalty < 0:
        raise UserInputError(
            f"config.eval.length_penalty is {eval_config.length_penalty}; it must be >= 0 (0 ranks by probability)."
        )
    if eval_config.temperature < 0 or eval_config.top_k < 0:
        raise UserInputError("config.eval.temperature and config.eval.top_k must be >= 0 (0 turns each off).")
    if eval_config.temperature > 0 and eval_config.beam_size > 1:
        raise UserInputError(
            f"config.eval.temperature is {eval_config.temperature} (sampling) but config.eval.beam_size is "
            f"{eval_config.beam_size}; sample with beam_size 1, or search with temperature 0."
        )
    if eval_config.top_k > 0 and eval_config.temperature == 0:
        raise UserInputError("config.eval.top_k applies to sampling only; set config.eval.temperature > 0 too.")


def check_decoding_memory(
    model_config: TransformerConfig,
    eval_config: ml_collections.ConfigDict,
    batch_sizes: dict[int, int],
    available: int,
    where: str,
) -> None:
    """Decoding the largest of evaluation's batches fits in one device's memory (a lower bound, before allocating).

    Every length bucket's batch carries about the same tokens, so shorter buckets (and the stages
    of continuous batching at their lengths) decode more sentences at once; beam search decodes
    beam_size hypotheses of each.

    Args:
        model_config: the Transformer that decodes.
        eval_config: config.eval (beam_size, temperature, max_decode_length).
        batch_sizes: bucket length -> sentences one device decodes at once.
        available: the bytes one device can hold; `where` describes them ("the memory of gpu:0").
    """
    beam_size = eval_config.beam_size if eval_config.temperature == 0 else 1
    needs = {
        length: decoding_memory_bytes(
            model_config,
            batch_size=batch_size,
            beam_size=beam_size,
            source_length=length,
            max_length=decode_length(length, eval_config.max_decode_length),
        )
        for length, batch_size in batch_sizes.items()
    }
    length = max(needs, key=needs.get)
    if needs[length] <= available:
        return
    sentences = batch_sizes[length]
    fit = int(available // (needs[length] / (sentences * beam_size)))
    fits = f"at most {fit:,} hypotheses of that length fit" if fit else "not even one hypothesis of that length fits"
    raise UserInputError(
        f"config.eval.beam_size={beam_size}: decoding a batch of {sentences} sentence{'s' * (sentences != 1)} of "
        f"{length} subwords needs at least {needs[length] / 1e9:,.1f} GB (keys and values of {beam_size} hypotheses "
        f"each, and their logits over {model_config.vocab_size} subwords) but {where} is {available / 1e9:,.1f} GB: "
        f"{fits}. Lower config.eval.per_device_batch_size (hypotheses a batch) or the beam size."
    )


def decoding_memory_bytes(
    config: TransformerConfig, *, batch_size: int, beam_size: int, source_length: int, max_length: int
) -> int:
    """A lower bound of the memory that decoding one batch holds at once, in bytes.

    Counts only arrays that the cached decoders keep alive together, for rows = batch_size *
    beam_size hypotheses:
      - the self-attention keys and values of every decoder layer,
        [rows, heads, max_length, d_k] and [rows, heads, max_length, d_v] in the
        compute dtype, twice: beam search's reordering by beam (`_gather_beams` in
        models/beam_search.py) writes a new copy while the old one is read, and rows moving
        on to a shorter stage (models/continuous_batching.py) get theirs beside the old;
      - the cross-attention keys and values, [batch_size, heads, source_length, d_k]
        and [batch_size, heads, source_length, d_v] per layer (once a sentence, whatever its beams);
      - the next-token logits, [rows, vocab_size] float32.
    Activations, parameters and XLA's temporaries come on top: decoding that
    needs more than this cannot run.
    """
    rows = batch_size * beam_size
    itemsize = jnp.dtype(config.dtype).itemsize
    per_layer = rows * (config.num_heads * config.d_k + config.d_model) * itemsize  # Keys and values.
    self_cache = per_layer * max_length * config.num_decoder_layers * 2
    cross_cache = per_layer // beam_size * source_length * config.num_decoder_layers
    logits = rows * config.vocab_size * 4
    return self_cache + cross_cache + logits
