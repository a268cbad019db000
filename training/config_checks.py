"""Checks that a config can work before anything is built or written."""

import os

import jax
import ml_collections
import numpy as np

from common.errors import UserInputError
from common.mesh_axes import MESH_AXES, logical_rules, mesh_axes_of, mesh_shape
from input_pipeline.batching import bucket_batch_sizes
from models.build import make_model
from models.decoding import decode_length, decoding_memory_bytes

_CHOICES = {
    "model.positional_encoding": ("sinusoidal", "learned", "relative", "rotary"),
    "model.norm_placement": ("post", "pre"),
    "model.dtype": ("float32", "bfloat16", "auto"),
    "model.attention_implementation": ("auto", "explicit", "xla", "cudnn"),
    "tokenizer.model_type": ("unigram", "bpe"),
    "step_compilation": ("jit", "pmap"),
    "nonfinite": ("stop", "skip"),
    "task": ("translation", "classification"),
    "model.pooling": ("mean", "cls"),
    "optimizer.schedule": ("paper", "rsqrt"),
}
# Datasets read from config.dataset.path, per task.
_LOCAL_DATASETS = {"translation": "parallel_text", "classification": "labelled_text"}
_POSITIVE = (
    "num_train_steps",
    "log_every_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "keep_checkpoints",
    "per_device_batch_size",
    "grad_accumulation_steps",
    "max_nonfinite_in_a_row",
    "dataset.max_length",
    "tokenizer.vocab_size",
    "tokenizer.max_training_sentences",
    "model.d_model",
    "model.num_heads",
    "model.d_ff",
    "model.num_layers",
    "model.max_len",
    "eval.max_decode_length",
    "eval.per_device_batch_size",
    "eval.beam_size",
)


# Logical axes of the parameters (models/) and the config fields that size them.
_MODEL_DIMENSIONS = {
    "embed": "model.d_model",
    "heads": "model.num_heads",
    "mlp": "model.d_ff",
    "vocab": "tokenizer.vocab_size",
}


# Fields that configs (and workdirs' config.json) written before they existed lack.
_DEFAULTS = {
    "task": "translation",
    "model.pooling": "mean",
    "nonfinite": "stop",
    "max_nonfinite_in_a_row": 10,
    "dataset.packing": True,
    "dataset.packing_lookahead": 0,  # Runs before it packed first fit.
    "dataset.num_workers": 0,
    "model.attention_implementation": "auto",
    "model.key_dim": 0,
    "model.relative_clip": 16,
    "model.relative_values": False,
    "optimizer.schedule": "rsqrt",  # Configs before the 'paper' schedule gave a peak_learning_rate.
    "optimizer.learning_rate_scale": 1.0,
}


def _get(config: ml_collections.ConfigDict, dotted: str):
    value = config
    for part in dotted.split("."):
        if part not in value and dotted in _DEFAULTS:
            return _DEFAULTS[dotted]
        value = value[part]
    return value


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Raises UserInputError naming the first field that cannot work.

    Args:
        config: the config.
        num_devices: the devices the mesh spans; default: all of them (jax.device_count()).
    """
    for field in _POSITIVE:
        if not _get(config, field) > 0:
            raise UserInputError(f"config.{field} is {_get(config, field)!r}; it must be positive.")
    for field, choices in _CHOICES.items():
        if _get(config, field) not in choices:
            raise UserInputError(f"config.{field} is {_get(config, field)!r}; choose one of {choices}.")

    seed = config.seed
    # The data's shuffles hash the seed with NumPy's SeedSequence (non-negative only); JAX's keys take int64.
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise UserInputError(f"config.seed is {seed!r}; it must be an integer in [0, 2**63).")

    model = config.model
    if model.d_model % model.num_heads:
        raise UserInputError(
            f"config.model.d_model ({model.d_model}) is not divisible by "
            f"config.model.num_heads ({model.num_heads}); pick a head count that "
            "divides it."
        )
    _validate_attention_sizes(config)
    for field in ("num_encoder_layers", "num_decoder_layers"):
        if model[field] == 0 or model[field] < -1:
            raise UserInputError(
                f"config.model.{field} is {model[field]}; use a positive count, or -1 to take config.model.num_layers."
            )
    for field in ("dropout_rate", "attention_dropout_rate"):
        if not 0.0 <= model[field] < 1.0:
            raise UserInputError(f"config.model.{field} must be in [0, 1).")
    if _get(config, "model.attention_implementation") == "cudnn" and jax.default_backend() != "gpu":
        raise UserInputError(
            f"config.model.attention_implementation is 'cudnn', which needs an NVIDIA GPU; this run has "
            f"{jax.default_backend()}. Use 'auto' (cuDNN where it can run) or 'explicit'."
        )
    if not 0.0 <= config.optimizer.label_smoothing < 1.0:
        raise UserInputError("config.optimizer.label_smoothing must be in [0, 1).")
    if config.optimizer.warmup_steps < 0 or config.optimizer.grad_clip_norm < 0:
        raise UserInputError("config.optimizer.warmup_steps and grad_clip_norm must be >= 0.")
    _validate_schedule(config)

    for field in ("dataset.max_length", "eval.max_decode_length"):
        if _get(config, field) > model.max_len:
            raise UserInputError(
                f"config.{field} ({_get(config, field)}) exceeds config.model.max_len "
                f"({model.max_len}), the number of positions the model encodes; raise max_len."
            )
    _validate_decoding(config.eval)
    if not isinstance(_get(config, "dataset.packing"), bool):
        raise UserInputError(
            f"config.dataset.packing is {_get(config, 'dataset.packing')!r}; it must be True or False."
        )
    lookahead = _get(config, "dataset.packing_lookahead")
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
        raise UserInputError(
            f"config.dataset.packing_lookahead is {lookahead!r}; it must be 0 (first fit) or the pairs per row "
            "the packer picks from (e.g. 8)."
        )
    workers = _get(config, "dataset.num_workers")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise UserInputError(
            f"config.dataset.num_workers is {workers!r}; it must be 0 (a background thread of the training process) "
            "or a number of worker processes."
        )
    if config.eval.num_bleu_sentences < 0:
        raise UserInputError("config.eval.num_bleu_sentences must be >= 0 (0 skips the BLEU check).")

    boundaries = list(config.dataset.bucket_boundaries)
    if (
        not boundaries
        or boundaries != sorted(set(boundaries))
        or boundaries[0] < 2
        or boundaries[-1] != config.dataset.max_length
    ):
        raise UserInputError(
            f"config.dataset.bucket_boundaries {tuple(boundaries)} must be strictly "
            "increasing lengths >= 2 ending at config.dataset.max_length "
            f"({config.dataset.max_length})."
        )
    task = _get(config, "task")
    local = _LOCAL_DATASETS[task]
    other_local = [name for t, name in _LOCAL_DATASETS.items() if t != task]
    if config.dataset.name in other_local:
        raise UserInputError(
            f"config.dataset.name is {config.dataset.name!r}, a dataset for another task than config.task "
            f"({task!r}); use {local!r} (files in config.dataset.path) or a TFDS dataset of the task."
        )
    if config.dataset.name == local and not config.dataset.path:
        raise UserInputError(
            f"config.dataset.name is {local!r} but config.dataset.path is "
            "empty; set --config.dataset.path to a folder of train/valid/test files."
        )
    if (
        task == "classification"
        and _get(config, "model.pooling") == "cls"
        and config.dataset.max_length + 1 > model.max_len
    ):
        raise UserInputError(
            f"config.model.pooling='cls' puts a token before sentences of up to config.dataset.max_length "
            f"({config.dataset.max_length}) subwords: config.model.max_len ({model.max_len}) must be at least "
            f"{config.dataset.max_length + 1}."
        )
    _validate_mesh(config, jax.device_count() if num_devices is None else num_devices)
    if task == "translation":
        if config.dataset.source_lang == config.dataset.target_lang:
            raise UserInputError(
                f"config.dataset.source_lang and target_lang are both {config.dataset.source_lang!r}; they must differ."
            )
        _validate_decoding_memory(config)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_attention_sizes(config: ml_collections.ConfigDict) -> None:
    """model.key_dim, and the relative and rotary positions' fields (model.d_model % num_heads is checked)."""
    key_dim = _get(config, "model.key_dim")
    if not _is_int(key_dim) or key_dim < 0:
        raise UserInputError(
            f"config.model.key_dim is {key_dim!r}; it must be a per-head query/key size >= 1, "
            "or 0 for d_model // num_heads."
        )
    clip = _get(config, "model.relative_clip")
    if not _is_int(clip) or clip < 1:
        raise UserInputError(
            f"config.model.relative_clip is {clip!r}; it must be a distance >= 1 (Shaw et al. use 16)."
        )
    if not isinstance(_get(config, "model.relative_values"), bool):
        raise UserInputError(
            f"config.model.relative_values is {_get(config, 'model.relative_values')!r}; it must be True or False."
        )
    d_k = key_dim or config.model.d_model // config.model.num_heads
    if config.model.positional_encoding == "rotary" and d_k % 2:
        raise UserInputError(
            f"config.model.positional_encoding='rotary' rotates pairs of query/key dimensions, but each head has "
            f"{d_k} (config.model.key_dim, or d_model // num_heads); make it even."
        )


def _validate_schedule(config: ml_collections.ConfigDict) -> None:
    """The learning rate of config.optimizer.schedule is given by its own fields, and only by them."""
    schedule = _get(config, "optimizer.schedule")
    peak = config.optimizer.get("peak_learning_rate")
    scale = _get(config, "optimizer.learning_rate_scale")
    if schedule == "rsqrt":
        if peak is None or not peak > 0:
            raise UserInputError(
                f"config.optimizer.peak_learning_rate is {peak!r}; schedule 'rsqrt' needs a positive peak."
            )
        if scale != 1.0:
            raise UserInputError(
                f"config.optimizer.learning_rate_scale is {scale!r} but applies to schedule 'paper' only; "
                "with schedule 'rsqrt', scale config.optimizer.peak_learning_rate instead."
            )
        return
    if not scale > 0:
        raise UserInputError(f"config.optimizer.learning_rate_scale is {scale!r}; it must be positive.")
    if peak is not None:
        paper_peak = scale * (config.model.d_model * max(config.optimizer.warmup_steps, 1)) ** -0.5
        raise UserInputError(
            f"config.optimizer.peak_learning_rate is {peak!r} but schedule 'paper' takes its peak from "
            f"config.model.d_model and warmup_steps ({paper_peak:.2e} here): use --config.optimizer.schedule=rsqrt "
            "for a peak of your own, or config.optimizer.learning_rate_scale to scale the paper's."
        )


def _validate_decoding(eval_config: ml_collections.ConfigDict) -> None:
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


def _validate_mesh(config: ml_collections.ConfigDict, num_devices: int) -> None:
    """The mesh fits the devices, every sharded model dimension divides evenly, pmap has no model axes."""
    shape = mesh_shape(config.mesh, num_devices)
    rules = config.mesh.rules
    try:
        for axis in ("batch", *_MODEL_DIMENSIONS):
            mesh_axes_of(axis, rules)
    except (TypeError, ValueError):
        raise UserInputError(
            f"config.mesh.rules {rules!r} must be pairs (logical axis, mesh axis or tuple of mesh axes or None)."
        ) from None
    for name, mesh_axes in logical_rules(rules):
        unknown = set((mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes or ()) - set(MESH_AXES)
        if unknown:
            raise UserInputError(f"config.mesh.rules maps {name!r} to {sorted(unknown)}; mesh axes are {MESH_AXES}.")
    for logical_axis, field in _MODEL_DIMENSIONS.items():
        mesh_axes = mesh_axes_of(logical_axis, rules)
        parts = int(np.prod([shape[axis] for axis in mesh_axes]))
        if _get(config, field) % parts:
            raise UserInputError(
                f"config.{field} ({_get(config, field)}) is not divisible by {parts}, the size of mesh axes "
                f"{mesh_axes} that config.mesh.rules split {logical_axis!r} over; change the model or the mesh "
                f"({', '.join(f'{a}={n}' for a, n in shape.items())})."
            )
    # 'kv' names both head sizes: d_k (queries, keys) and d_v (values).
    kv_parts = int(np.prod([shape[axis] for axis in mesh_axes_of("kv", rules)]))
    d_v = config.model.d_model // config.model.num_heads
    head_sizes = {
        "query/key size d_k (config.model.key_dim, or d_model // num_heads)": _get(config, "model.key_dim") or d_v,
        "value size d_v (config.model.d_model // num_heads)": d_v,
    }
    for name, size in head_sizes.items():
        if size % kv_parts:
            raise UserInputError(
                f"Each head's {name} is {size}, not divisible by {kv_parts}, the size of mesh axes "
                f"{mesh_axes_of('kv', rules)} that config.mesh.rules split 'kv' over; change the model or the mesh "
                f"({', '.join(f'{a}={n}' for a, n in shape.items())})."
            )
    if config.step_compilation == "pmap" and (shape["fsdp"] > 1 or shape["tensor"] > 1):
        raise UserInputError(
            "config.step_compilation='pmap' is data parallel only; set config.mesh.fsdp and config.mesh.tensor to 1 "
            "or use step_compilation='jit'."
        )
    if config.step_compilation == "pmap" and jax.process_count() > 1:
        raise UserInputError(
            f"config.step_compilation='pmap' runs in one process (its devices on one host); this run has "
            f"{jax.process_count()} processes: use step_compilation='jit', data parallel across all of them by default."
        )


def _device_memory() -> tuple[int, str]:
    """(bytes one local device can hold, a description): the accelerator's limit, or on CPU
    the host's available memory shared by its local devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"], f"the memory of {device.platform}:{device.id}"
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo", encoding="ascii") as f:  # Counts reclaimable caches, unlike SC_AVPHYS_PAGES.
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    devices = jax.local_device_count()
    return available // devices, "the host's available memory" + (
        f" per CPU device (of {devices})" if devices > 1 else ""
    )


def _validate_decoding_memory(config: ml_collections.ConfigDict) -> None:
    """Evaluation's decoding of its largest batch fits in one device's memory (a lower bound, before allocating).

    Every length bucket's batch carries about the same tokens, so shorter buckets decode more sentences at
    once; a device decodes eval.per_device_batch_size * max_length / bucket sentences of each bucket.
    """
    model_config = make_model(config, config.tokenizer.vocab_size).config
    beam_size = config.eval.beam_size if config.eval.temperature == 0 else 1
    tokens = config.eval.per_device_batch_size * config.dataset.max_length
    batch_sizes = bucket_batch_sizes(config.dataset.bucket_boundaries, tokens, 1)
    needs = {
        length: decoding_memory_bytes(
            model_config,
            batch_size=batch_size,
            beam_size=beam_size,
            source_length=length,
            max_length=decode_length(length, config.eval.max_decode_length),
        )
        for length, batch_size in batch_sizes.items()
    }
    length = max(needs, key=needs.get)
    available, where = _device_memory()
    if needs[length] <= available:
        return
    per_beam = needs[length] / beam_size
    fits = f"no beam size above {int(available // per_beam)} fits" if available >= 2 * per_beam else "no beam fits"
    raise UserInputError(
        f"config.eval.beam_size={beam_size}: decoding a batch of {batch_sizes[length]} sentences of {length} subwords "
        f"needs at least {needs[length] / 1e9:,.1f} GB (keys and values of {beam_size} hypotheses each, and their "
        f"logits over {config.tokenizer.vocab_size} subwords) but {where} is {available / 1e9:,.1f} GB: {fits}. "
        "Lower the beam size or config.eval.per_device_batch_size."
    )
