"""Checks that a config can work before anything is built or written: each part checks its own fields.

The run's own fields here; the data's in input_pipeline/config_checks.py, the model's in
models/config_checks.py, decoding's in models/decoding_checks.py, the optimizer's in
training/optimizer.py, the mesh's in common/mesh_axes.py and training/runtime/sharding.py.
"""

import jax
import ml_collections

from common.config_fields import is_int, require_choice, require_positive
from common.errors import UserInputError
from common.mesh_axes import check_mesh
from input_pipeline.batching import bucket_batch_sizes
from input_pipeline.config_checks import check_data
from models import config_checks as model_checks
from models import decoding_checks
from models.build import make_model
from models.decoding import sentences_per_batch
from training import divergence, optimizer, step_options
from training.runtime import device_memory, sharding

TASKS = ("translation", "classification")
STEP_COMPILATIONS = ("jit", "pmap")
_POSITIVE = (
    "num_train_steps",
    "log_every_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "keep_checkpoints",
    "per_device_batch_size",
    "grad_accumulation_steps",
    "max_nonfinite_in_a_row",
)


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Raises UserInputError naming the first field that cannot work.

    Args:
        config: the config.
        num_devices: the devices the mesh spans; default: all of them (jax.device_count()).
    """
    _check_run(config)
    step_options.check_step_options(config)
    check_data(config)
    model_checks.check_model(config)
    optimizer.check_optimizer(config.optimizer, config.model.d_model)
    decoding_checks.check_decoding(config.eval)
    num_devices = jax.device_count() if num_devices is None else num_devices
    shape = check_mesh(config.mesh, num_devices, model_checks.sharded_sizes(config))
    if config.step_compilation == "pmap":
        sharding.check_pmap(shape)
    if config.task == "translation":
        _check_decoding_memory(config)


def _check_run(config: ml_collections.ConfigDict) -> None:
    """The run's own fields: its task, steps, intervals, batches, compilation, seed and evaluation."""
    for field in _POSITIVE:
        require_positive(field, config[field])
    require_positive("eval.per_device_batch_size", config.eval.per_device_batch_size)
    require_choice("task", config.task, TASKS)
    require_choice("step_compilation", config.step_compilation, STEP_COMPILATIONS)
    require_choice("nonfinite", config.nonfinite, divergence.MODES)
    seed = config.seed
    # The data's shuffles hash the seed with NumPy's SeedSequence (non-negative only); JAX's keys take int64.
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise UserInputError(f"config.seed is {seed!r}; it must be an integer in [0, 2**63).")
    if config.eval.num_bleu_sentences < 0:
        raise UserInputError("config.eval.num_bleu_sentences must be >= 0 (0 skips the BLEU check).")


def _check_decoding_memory(config: ml_collections.ConfigDict) -> None:
    """Evaluation's decoding fits in one device: each bucket's batch, sized as translation_decoding sizes rows."""
    tokens = sentences_per_batch(config.eval.per_device_batch_size, config.eval.beam_size) * config.dataset.max_length
    available, where = device_memory.memory_per_device()
    decoding_checks.check_decoding_memory(
        make_model(config, config.tokenizer.vocab_size).config,
        config.eval,
        bucket_batch_sizes(config.dataset.bucket_boundaries, tokens, 1),
        available,
        where,
    )
