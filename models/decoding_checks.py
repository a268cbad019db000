"""Checks of config.eval's decoding options, and of the memory that decoding a batch needs (models/decoding.py)."""

import ml_collections

from common.config_fields import require_positive
from common.errors import UserInputError
from models.decoding import decode_length, decoding_memory_bytes
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

    Every length bucket's batch carries about the same tokens, so shorter buckets decode more
    sentences at once; beam search decodes beam_size hypotheses of each.

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
