"""Checks of config.model before models/build.py builds the model: each names the field that cannot work."""

import jax
import ml_collections

from common.config_fields import is_int, require_bool, require_choice, require_positive
from common.errors import UserInputError

_CHOICES = {
    "positional_encoding": ("sinusoidal", "learned", "relative", "rotary"),
    "norm_placement": ("post", "pre"),
    "dtype": ("float32", "bfloat16", "auto"),
    "attention_implementation": ("auto", "explicit", "xla", "cudnn"),
    "pooling": ("mean", "cls"),
}
_POSITIVE = ("d_model", "num_heads", "d_ff", "num_layers", "max_len")


def check_model(config: ml_collections.ConfigDict) -> None:
    """Raises UserInputError naming the first field of config.model that cannot work.

    Besides config.model's own fields, the lengths the model must encode: config.dataset.max_length
    and config.eval.max_decode_length (and the [CLS] token before a classified sentence).
    """
    model = config.model
    for name in _POSITIVE:
        require_positive(f"model.{name}", model[name])
    for name, choices in _CHOICES.items():
        require_choice(f"model.{name}", model[name], choices)
    if model.d_model % model.num_heads:
        raise UserInputError(
            f"config.model.d_model ({model.d_model}) is not divisible by "
            f"config.model.num_heads ({model.num_heads}); pick a head count that "
            "divides it."
        )
    _check_attention_sizes(model)
    for field in ("num_encoder_layers", "num_decoder_layers"):
        if model[field] == 0 or model[field] < -1:
            raise UserInputError(
                f"config.model.{field} is {model[field]}; use a positive count, or -1 to take config.model.num_layers."
            )
    for field in ("dropout_rate", "attention_dropout_rate"):
        if not 0.0 <= model[field] < 1.0:
            raise UserInputError(f"config.model.{field} must be in [0, 1).")
    if model.attention_implementation == "cudnn" and jax.default_backend() != "gpu":
        raise UserInputError(
            f"config.model.attention_implementation is 'cudnn', which needs an NVIDIA GPU; this run has "
            f"{jax.default_backend()}. Use 'auto' (cuDNN where it can run) or 'explicit'."
        )
    _check_lengths(config)


def _d_k(model: ml_collections.ConfigDict) -> int:
    """Each head's query/key size: config.model.key_dim, or d_model // num_heads."""
    return model.key_dim or model.d_model // model.num_heads


def _check_attention_sizes(model: ml_collections.ConfigDict) -> None:
    """model.key_dim, and the relative and rotary positions' fields (model.d_model % num_heads is checked)."""
    if not is_int(model.key_dim) or model.key_dim < 0:
        raise UserInputError(
            f"config.model.key_dim is {model.key_dim!r}; it must be a per-head query/key size >= 1, "
            "or 0 for d_model // num_heads."
        )
    if not is_int(model.relative_clip) or model.relative_clip < 1:
        raise UserInputError(
            f"config.model.relative_clip is {model.relative_clip!r}; it must be a distance >= 1 (Shaw et al. use 16)."
        )
    require_bool("model.relative_values", model.relative_values)
    if model.positional_encoding == "rotary" and _d_k(model) % 2:
        raise UserInputError(
            f"config.model.positional_encoding='rotary' rotates pairs of query/key dimensions, but each head has "
            f"{_d_k(model)} (config.model.key_dim, or d_model // num_heads); make it even."
        )


def _check_lengths(config: ml_collections.ConfigDict) -> None:
    """The model encodes the positions of the longest sentences it reads and writes."""
    max_len = config.model.max_len
    for field, length in (
        ("dataset.max_length", config.dataset.max_length),
        ("eval.max_decode_length", config.eval.max_decode_length),
    ):
        if length > max_len:
            raise UserInputError(
                f"config.{field} ({length}) exceeds config.model.max_len "
                f"({max_len}), the number of positions the model encodes; raise max_len."
            )
    max_length = config.dataset.max_length
    if config.task == "classification" and config.model.pooling == "cls" and max_length + 1 > max_len:
        raise UserInputError(
            f"config.model.pooling='cls' puts a token before sentences of up to config.dataset.max_length "
            f"({max_length}) subwords: config.model.max_len ({max_len}) must be at least {max_length + 1}."
        )


def sharded_sizes(config: ml_collections.ConfigDict) -> dict[str, tuple[tuple[str, int], ...]]:
    """The sizes of the parameters' logical axes that config.mesh.rules may split (`common.mesh_axes.check_mesh`).

    Logical axis -> (subject, size) pairs, the subject naming the size where an error begins.
    """
    model = config.model
    d_k, d_v = _d_k(model), model.d_model // model.num_heads  # 'kv' names both head sizes.
    fields = {
        "embed": ("model.d_model", model.d_model),
        "heads": ("model.num_heads", model.num_heads),
        "mlp": ("model.d_ff", model.d_ff),
        "vocab": ("tokenizer.vocab_size", config.tokenizer.vocab_size),
    }
    sizes = {axis: ((f"config.{field} ({size}) is", size),) for axis, (field, size) in fields.items()}
    sizes["kv"] = (
        (f"Each head's query/key size d_k (config.model.key_dim, or d_model // num_heads) is {d_k},", d_k),
        (f"Each head's value size d_v (config.model.d_model // num_heads) is {d_v},", d_v),
    )
    return sizes
