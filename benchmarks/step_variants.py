"""The models and variants of benchmarks/peer_throughput.py's accelerator mode: what one GPU run A/Bs.

A variant is this project's step with config fields set ('default': none), written
`field=value` and joined with '+': `prng_impl=unsafe_rbg+loss_chunks=8`,
`model.attention_implementation=xla`, `per_device_batch_size=128`. Values are read as Python
literals where they parse as one (8, 1e-3, True), else as strings. An XLA flag set
(`XLA_FLAG_SETS`) cannot change in a running process: each runs in a process of its own.
"""

import ast
import os
import subprocess
import sys

import ml_collections

from common import records
from configs import default, tiny

DEFAULT_VARIANT = "default"
# XLA flags that JAX's GPU performance guide (docs.jax.dev, "GPU performance tips") and NVIDIA's
# JAX-Toolbox recommend for one GPU, by name; each applies to GPU backends only.
XLA_FLAG_SETS = {
    # JAX's guide: Triton's GEMM emitter for every matmul it supports; the latency-hiding scheduler.
    "jax_guide": "--xla_gpu_triton_gemm_any=true --xla_gpu_enable_latency_hiding_scheduler=true",
    # JAX-Toolbox's images: cuBLAS for every matmul, no Triton GEMMs.
    "cublas": "--xla_gpu_enable_triton_gemm=false",
}


def transformer_base() -> ml_collections.ConfigDict:
    """configs/default.py's Transformer-base in bfloat16, 96 rows x 256 on one device (the paper's ~25k tokens)."""
    config = default.get_config()
    config.model.dtype = "bfloat16"
    config.per_device_batch_size = 96
    config.dataset.max_length = 256
    # An explicit peak: PyTorch's side trains at it as a constant rate (the step time does not depend on it).
    config.optimizer.update(schedule="rsqrt", peak_learning_rate=7e-4)
    config.mesh.data = 1
    return config


def tiny_model() -> ml_collections.ConfigDict:
    """configs/tiny.py's model in bfloat16, 4 rows x 16: the accelerator mode's path on a CPU, in seconds."""
    config = tiny.get_config()
    config.model.dtype = "bfloat16"
    config.per_device_batch_size = 4
    config.dataset.max_length = 16
    config.mesh.data = 1
    return config


MODELS = {"base": transformer_base, "tiny": tiny_model}


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def with_variant(config: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
    """A copy of `config` with `variant`'s fields set; ValueError names a setting that is not `field=value` of a
    field the config has."""
    config = config.copy_and_resolve_references()
    if variant == DEFAULT_VARIANT:
        return config
    for setting in variant.split("+"):
        field, equals, value = setting.partition("=")
        if not equals or not field:
            raise ValueError(f"{setting!r} is not field=value")
        *parents, leaf = field.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        if leaf not in node:
            raise ValueError(f"the config has no field {field!r}")
        node[leaf] = _literal(value)
    return config


def run_with_xla_flags(xla_flags: str, arguments: list[str], output: str) -> dict:
    """Runs peer_throughput with `arguments` in a process of its own under `xla_flags`; returns its record.

    The flags are added to the environment's XLA_FLAGS. Returns {'error': its last line of output}
    where the process fails (an XLA that does not know a flag stops at start-up).
    """
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip())
    command = [sys.executable, "-m", "benchmarks.peer_throughput", *arguments, f"--output={output}"]
    done = subprocess.run(command, env=env, cwd=records.REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
        return {"error": lines[-1]}
    return records.read(os.path.basename(output), os.path.dirname(output))
