"""benchmarks/config_r.py compares like with like: the same model in JAX and PyTorch, both training."""

import jax
import numpy as np
import pytest

pytest.importorskip("torch")

from benchmarks import config_r  # noqa: E402
from models.build import make_model  # noqa: E402
from training.optimizer import make_optimizer  # noqa: E402
from training.state import create_train_state  # noqa: E402


def _num_project_params(config) -> int:
    model = make_model(config, config.tokenizer.vocab_size)
    tx, _ = make_optimizer(config.optimizer, d_model=config.model.d_model)
    state = jax.eval_shape(lambda: create_train_state(model, tx, config.seed))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(state.params))


def test_torch_model_has_config_r_parameters_plus_torch_only_biases_and_final_norms():
    config = config_r.config_r()
    torch_step = config_r.TorchStep(config, config_r.random_batch(config))
    num_torch_params = sum(p.numel() for p in torch_step.modules.parameters())  # The tied weight once.

    d, layers = config.model.d_model, config.model.num_layers
    # nn.MultiheadAttention has q, k, v and output biases (this project's attention has none):
    # 4d in each of the encoder's self-attentions and the decoder's self- and cross-attentions;
    # nn.Transformer ends both stacks with a LayerNorm (scale and bias) even when post-LN.
    torch_only = (layers + 2 * layers) * 4 * d + 2 * 2 * d
    assert num_torch_params - _num_project_params(config) == torch_only == 10_240


def _small_config(dtype: str):
    config = config_r.config_r(dtype, dropout_rate=0.0)
    config.model.update(d_model=32, num_heads=4, d_ff=64, num_layers=1, max_len=8)
    config.dataset.max_length = 8
    config.tokenizer.vocab_size = 64
    config.per_device_batch_size = 4
    config.optimizer.warmup_steps = 1  # The peak learning rate from the first step.
    return config


# The project's bfloat16 step is the same code with another model.dtype (and takes ~10 s to compile);
# the PyTorch one goes through autocast, this benchmark's own code.
@pytest.mark.parametrize(
    "step_class, dtype",
    [
        (config_r.ProjectStep, "float32"),
        (config_r.TorchStep, "float32"),
        (config_r.TorchStep, "bfloat16"),
    ],
)
def test_each_step_trains_on_its_repeated_batch(step_class, dtype):
    config = _small_config(dtype)
    step = step_class(config, config_r.random_batch(config))
    losses = [float(step()) for _ in range(3)]  # Each the loss before that step's update.
    assert losses[2] < losses[1] < losses[0]
