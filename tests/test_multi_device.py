"""The train step on 8 (simulated CPU) devices equals the one-device step.

Runs in a subprocess: the device count must be set before JAX starts.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from configs import default
    from training import sharding
    from training.optimizer import make_optimizer
    from training.state import create_train_state, make_model
    from training.steps import jit_train_step

    assert len(jax.devices()) == 8, jax.devices()
    config = default.get_config()
    config.dataset.max_length = config.eval.max_decode_length = 16
    config.model.update(d_model=32, num_heads=4, d_ff=64, num_layers=2, norm_placement="pre")
    model = make_model(config, vocab_size=32)
    tx, schedule = make_optimizer(config.optimizer)
    rng = np.random.default_rng(0)
    batches = [
        {key: rng.integers(4, 32, (16, 12)).astype(np.int32) for key in ("inputs", "targets")}
        for _ in range(3)
    ]

    def run(devices):
        mesh = Mesh(np.asarray(devices), (sharding.DATA_AXIS,))
        state = sharding.replicate(create_train_state(model, tx, seed=0), mesh)
        step = jit_train_step(model, tx, schedule, label_smoothing=0.1)
        losses = []
        for i, batch in enumerate(batches):
            state, metrics = step(state, sharding.shard_batch(batch, mesh), jax.random.fold_in(state.rng, i))
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state.params)

    one_losses, one_params = run(jax.devices()[:1])
    eight_losses, eight_params = run(jax.devices())
    np.testing.assert_allclose(eight_losses, one_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), eight_params, one_params)
    print("losses", one_losses, eight_losses)
    """
)


def test_data_parallel_step_on_8_devices_equals_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "losses" in result.stdout
