"""Which trained models each export format can hold: the config is checked before any weight is read.

Pure functions of the run's config (no JAX, no engine imported), so that every config can be
checked in a test without training it.
"""

import ml_collections

from common.errors import UserInputError

FORMATS = ("ctranslate2", "huggingface")
# CTranslate2 weight types (`--quantization`); without one the weights stay float32.
QUANTIZATIONS = ("int8", "int8_float32", "float16", "bfloat16")


# The positional encodings each format holds: added to the embeddings, and for CTranslate2 also Shaw et al.'s
# relative positions and rotary ones, in its attention (transformers' seq2seq classes have neither).
_POSITIONS = {
    "ctranslate2": ("sinusoidal", "learned", "relative", "rotary"),
    "huggingface": ("sinusoidal", "learned"),
}


def huggingface_architecture(config: ml_collections.ConfigDict) -> str:
    """The `transformers` class a translation model maps onto: 'marian' (post-LN) or 'blenderbot' (pre-LN).

    Marian is the paper's post-LN Transformer with the paper's sinusoids, and no LayerNorm
    after the stacks. Blenderbot is the pre-LN Transformer with a LayerNorm after each stack
    and a positions table that is read from the weights: it holds learned positions, and
    sinusoidal ones as a table, in this project's interleaved layout with no reordering.
    (Pegasus is pre-LN too, but computes its sinusoids itself.)
    """
    return "blenderbot" if config.model.norm_placement == "pre" else "marian"


def _unsupported(config: ml_collections.ConfigDict, export_format: str) -> str | None:
    """Why `export_format` cannot hold the model `config` describes, naming the field; None if it can."""
    model = config.model
    if config.task != "translation":
        return (
            f"config.task is {config.task!r}: the model is an encoder classifier, and {export_format} holds "
            "encoder-decoder translation models only"
        )
    positions = _POSITIONS[export_format]
    if model.positional_encoding not in positions:
        return (
            f"config.model.positional_encoding is {model.positional_encoding!r}: the {export_format} export "
            f"holds {' or '.join(repr(p) for p in positions)} positions"
        )
    if model.key_dim and model.key_dim != model.d_model // model.num_heads:
        return (
            f"config.model.key_dim is {model.key_dim} (d_v is {model.d_model // model.num_heads}): {export_format} "
            "attention has one head size for queries, keys and values"
        )
    if export_format == "huggingface":
        if model.norm_placement == "post" and model.positional_encoding == "learned":
            return (
                "config.model.positional_encoding is 'learned' with norm_placement 'post': transformers' post-LN "
                "translation model (Marian) computes sinusoidal positions and cannot hold a learned table"
            )
        if not model.tie_embeddings:
            return (
                "config.model.tie_embeddings is False: the huggingface export holds one embedding matrix shared "
                "by the source, the target and the output layer"
            )
        if config.tokenizer.model_type != "unigram":
            return (
                f"config.tokenizer.model_type is {config.tokenizer.model_type!r}: the huggingface export converts "
                "unigram SentencePiece models only"
            )
    return None


def check_exportable(config: ml_collections.ConfigDict, export_format: str) -> None:
    """Checks that `export_format` can hold the model `config` describes.

    Raises:
        UserInputError: an unknown format, or the config field the format cannot express.
    """
    if export_format not in FORMATS:
        raise UserInputError(f"Unknown --format={export_format}; choose one of {', '.join(FORMATS)}.")
    if (reason := _unsupported(config, export_format)) is not None:
        raise UserInputError(f"Cannot export to {export_format}: {reason}.")
