"""The train state (a pytree) and the model built from a config."""

import dataclasses
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from input_pipeline.tokenizer import BOS_ID, PAD_ID
from models import Transformer, TransformerConfig
from models.classifier import Classifier, ClassifierConfig

Model = Transformer | Classifier


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training; saved whole in each checkpoint."""

    step: jax.Array  # [] int32, optimizer updates done.
    params: Any
    opt_state: optax.OptState
    rng: jax.Array  # [2] uint32, the base key that step keys fold in from.


def is_classification(config: ml_collections.ConfigDict) -> bool:
    """Whether config.task is 'classification' (configs written before tasks existed translate)."""
    return config.get("task", "translation") == "classification"


def make_model(config: ml_collections.ConfigDict, vocab_size: int, num_classes: int = 0) -> Model:
    """The model config.task asks for, described by config.model, for a vocabulary of `vocab_size`.

    'translation': the encoder-decoder Transformer; 'classification': the encoder
    Classifier over `num_classes` classes (config.model's decoder fields unused).
    """
    model = config.model
    transformer_config = TransformerConfig(
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
        dtype=model.dtype,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
    )
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


def create_train_state(model: Model, tx: optax.GradientTransformation, seed: int, *, boxed: bool = False) -> TrainState:
    """A fresh state: parameters from `seed`, Adam moments at zero, step 0.

    With `boxed`, parameters and the optimizer moments derived from them stay in
    their logical-axis boxes (for `jax.eval_shape`, to read the shardings off);
    otherwise every leaf is a plain array.
    """
    init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
    params = init_boxed_params(model, init_rng)
    if not boxed:
        params = nn.unbox(params)
    return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params), rng=train_rng)
