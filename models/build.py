"""The model a run's config describes: the encoder-decoder Transformer, or the encoder classifier; its parameters."""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from common.special_ids import BOS_ID, PAD_ID
from models.classifier import Classifier, ClassifierConfig
from models.config import TransformerConfig
from models.transformer import Transformer

Model = Transformer | Classifier


def is_classification(config: ml_collections.ConfigDict) -> bool:
    """Whether config.task is 'classification' (else 'translation')."""
    return config.task == "classification"


# CPU feature flags (Linux /proc/cpuinfo: x86 'flags', Arm 'Features') of bf16 matmul instructions.
_BF16_MATMUL_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def compute_dtype(requested: str, cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The compute dtype to run: `requested`, with 'auto' resolved for this backend.

    'auto' is bfloat16 on TPUs, on NVIDIA GPUs from Ampere on (compute capability 8.0: bf16 tensor
    cores) and on CPUs with bf16 matmul instructions (AVX512-BF16, AMX, Arm's BF16); float32 on
    older GPUs and other CPUs, where bf16 matmuls are emulated, more slowly than float32 ones (on
    a CPU without bf16 matmul instructions the quick-start's step ran markedly slower in bfloat16
    than in float32).
    """
    if requested != "auto":
        return requested
    backend = jax.default_backend()
    if backend == "gpu":
        capability = getattr(jax.devices()[0], "compute_capability", None)  # None on ROCm: bf16 since MI100.
        return "bfloat16" if capability is None or float(capability) >= 8.0 else "float32"
    if backend != "cpu":
        return "bfloat16"
    try:
        with open(cpuinfo_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:  # Not Linux: no flags to read.
        return "float32"
    flags = set()
    for line in lines:
        name, colon, value = line.partition(":")
        if colon and name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return "bfloat16" if flags & _BF16_MATMUL_FLAGS else "float32"


def attention_implementation(requested: str, dtype: str, head_dim: int) -> str:
    """The attention implementation to run: `requested`, with 'auto' resolved for this backend.

    'auto' is cuDNN's fused attention (through `jax.nn.dot_product_attention`) on GPUs where it
    applies (bfloat16, head_dim a multiple of 8 up to 128) and is not known to fail: at key
    lengths of a known kernel defect (`models.attention.cudnn_has_known_defect`) each call falls
    back to the explicit formula ('cudnn_where_safe'), as TransformerEngine turns cuDNN attention
    off for the versions and shapes of known bugs. Elsewhere 'auto' is the explicit formula:
    XLA:CPU and TPU compile it well, and its matmuls follow models/precision.py, which XLA's own
    implementation of `jax.nn.dot_product_attention` does not (its backward products multiply
    float32 cotangents with bfloat16 operands). An explicit 'cudnn' is cuDNN at every shape.
    """
    if requested != "auto":
        return requested
    backend = jax.default_backend()
    platform_version = jax.devices()[0].client.platform_version if backend == "gpu" else ""
    return "cudnn_where_safe" if cudnn_applies(backend, platform_version, dtype, head_dim) else "explicit"


def cudnn_applies(backend: str, platform_version: str, dtype: str, head_dim: int) -> bool:
    """Whether 'auto' attention is cuDNN's: an NVIDIA GPU (ROCm's 'gpu' backend has no cuDNN; its platform
    version names rocm), bfloat16, and head_dim a multiple of 8 up to 128."""
    nvidia = backend == "gpu" and "rocm" not in platform_version.lower()
    return nvidia and dtype == "bfloat16" and head_dim % 8 == 0 and head_dim <= 128


def make_model(config: ml_collections.ConfigDict, vocab_size: int, num_classes: int = 0) -> Model:
    """The model config.task asks for, described by config.model, for a vocabulary of `vocab_size`.

    'translation': the encoder-decoder Transformer; 'classification': the encoder
    Classifier over `num_classes` classes (config.model's decoder fields unused).
    """
    model = config.model
    dtype = compute_dtype(model.dtype)
    attention = attention_implementation(model.attention_implementation, dtype, model.d_model // model.num_heads)
    transformer_config = transformer_config_of(model, vocab_size, dtype=dtype, attention=attention)
    if is_classification(config):
        encoder = dataclasses.replace(transformer_config, num_decoder_layers=0)
        return Classifier(ClassifierConfig(encoder, num_classes, model.pooling))
    return Transformer(transformer_config)


def init_boxed_params(model: Model, rng: jax.Array) -> Any:
    """Float32 parameters in flax `LogicallyPartitioned` boxes naming each dimension's logical axis.

    Shapes do not depend on the dummy sequence lengths.
    """
    dummy = jnp.ones((1, 2), jnp.int32)
    sequences = (dummy,) if isinstance(model, Classifier) else (dummy, dummy)  # Classifier: no target.
    return model.init({"params": rng}, *sequences, deterministic=True)["params"]


def init_params(model: Model, rng: jax.Array) -> Any:
    """Float32 parameters of `model`: a plain pytree of arrays (the checkpointed layout)."""
    return nn.unbox(init_boxed_params(model, rng))


def transformer_config_of(
    model: ml_collections.ConfigDict, vocab_size: int, *, dtype: str = "float32", attention: str = "explicit"
) -> TransformerConfig:
    """The TransformerConfig of config.model with `dtype` and `attention` as given: nothing asks the devices, so its
    sizes (for FLOPs: sweeps/budget.py) come without starting a JAX backend; `make_model` resolves them for the run."""
    return TransformerConfig(
        vocab_size=vocab_size,
        d_model=model.d_model,
        num_heads=model.num_heads,
        d_ff=model.d_ff,
        num_encoder_layers=(model.num_encoder_layers if model.num_encoder_layers > 0 else model.num_layers),
        num_decoder_layers=(model.num_decoder_layers if model.num_decoder_layers > 0 else model.num_layers),
        dropout_rate=model.dropout_rate,
        attention_dropout_rate=model.attention_dropout_rate,
        positional_encoding=model.positional_encoding,
        max_len=model.max_len,
        norm_placement=model.norm_placement,
        tie_embeddings=model.tie_embeddings,
        dtype=dtype,
        key_dim=model.key_dim,
        relative_clip=model.relative_clip,
        relative_values=model.relative_values,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        attention_implementation=attention,
    )
