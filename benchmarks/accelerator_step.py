"""The accelerator check's train step: its model sizes, copy-task batches, blind control and device.

benchmarks/accelerator_check.py's sections run a `Check`: one size's train step as train.py
builds it (benchmarks/config_r.py's `ProjectStep`), in bfloat16, compiled per row count, on
fresh packed rows of a copy task (target = source, input_pipeline/synthetic.py). Sizes: 'tiny'
(configs/tiny.py's model, for CPUs and the test), 'base' (configs/default.py, Transformer-base),
'big' (the paper's Table 3: d_model 1024, d_ff 4096, 16 heads, dropout 0.3). Nothing here needs
the data stack.
"""

import dataclasses
import functools
import importlib
import time

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import app

from benchmarks.config_r import ProjectStep
from configs import default, tiny
from input_pipeline import synthetic
from models.packing import BATCH_KEYS
from training import flops
from training.optimizer import paper_peak
from training.runtime import sharding

COPY_WARMUP_STEPS = 100


@dataclasses.dataclass(frozen=True)
class Size:
    """A model size: its config, batch shape and copy task."""

    name: str
    config: ml_collections.ConfigDict
    rows: int  # Per device, of `length` positions.
    length: int
    num_symbols: int  # Of the copy task.
    min_pair: int  # A copy pair's length range, <eos> included.
    max_pair: int
    copy_steps: int  # That the copy section passes in, where the step is right.


def make_size(name: str, rows: int = 0) -> Size:
    """Size `name` (tiny, base, big) in bfloat16, warming up fast for the copy task; `rows` > 0 overrides."""
    if name == "tiny":
        config = tiny.get_config()
        # One layer of width 32 learns to copy in 300 steps only at a high rate (at 1e-3 or 5e-3 it learns the
        # symbols' frequencies alone).
        config.optimizer.peak_learning_rate, config.optimizer.warmup_steps = 1e-2, 30
        size = Size(name, config, rows=16, length=64, num_symbols=64, min_pair=4, max_pair=16, copy_steps=300)
    elif name in ("base", "big"):
        config = default.get_config()
        if name == "big":
            config.model.d_model, config.model.d_ff, config.model.num_heads = 1024, 4096, 16
            config.model.dropout_rate = 0.3
        # The paper's peak learning rate for this width (at 4000 warm-up steps), reached after COPY_WARMUP_STEPS.
        config.optimizer.schedule = "rsqrt"
        config.optimizer.peak_learning_rate = paper_peak(config.model.d_model, config.optimizer.warmup_steps)
        config.optimizer.warmup_steps = COPY_WARMUP_STEPS
        # 96 rows x 256 = 24.6k target positions on one device, the paper's ~25k tokens a batch. Post-LN base at
        # the paper's peak only starts to use the source in 300 copy steps (docs/accelerator_check.md).
        size = Size(name, config, rows=96, length=256, num_symbols=512, min_pair=8, max_pair=64, copy_steps=1500)
    else:
        raise app.UsageError(f"--sizes: unknown size {name!r}; choose tiny, base or big.")
    config.model.dtype = "bfloat16"
    config.dataset.max_length = size.length
    return dataclasses.replace(size, rows=rows or size.rows)


def with_peak_learning_rate(size: Size, rate: float) -> Size:
    """`size` trained at peak learning rate `rate`, named for it."""
    config = size.config.copy_and_resolve_references()
    config.optimizer.peak_learning_rate = rate
    return dataclasses.replace(size, name=f"{size.name} lr {rate:g}", config=config)


def without_regularisation(size: Size) -> Size:
    """`size` with no dropout and no label smoothing, named for it."""
    config = size.config.copy_and_resolve_references()
    config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
    config.optimizer.label_smoothing = 0.0
    return dataclasses.replace(size, name=f"{size.name} no reg", config=config)


def _zero_cross_attention(next_method, args, kwargs, context):
    """A flax method interceptor: every cross-attention sub-layer outputs zeros [batch, tgt_len, d_model]."""
    if context.module.name == "cross_attention" and context.method_name == "__call__":
        return jax.numpy.zeros_like(args[0])  # The queries' shape: the decoder stream's.
    return next_method(*args, **kwargs)


def without_cross_attention(loss_fn):
    """`loss_fn` of a model whose decoder never sees the source: the copy section's negative control."""

    def blind_loss_fn(*args, **kwargs):
        with nn.intercept_methods(_zero_cross_attention):  # Active while the step is traced.
            return loss_fn(*args, **kwargs)

    return blind_loss_fn


class Check(ProjectStep):
    """One size's train step (compiled per row count) and the state it runs on, with copy-task batches.

    With `blind`, the step trains a decoder that never sees the source (`without_cross_attention`).
    """

    def __init__(self, size: Size, blind: bool = False):
        super().__init__(size.config, wrap_loss=without_cross_attention if blind else None)
        self.size = size
        self.rng = np.random.default_rng(size.config.seed)
        self.compiled = {}  # rows -> (lowered, compiled, compile seconds)

    def batch(self, rows: int, length: int = 0) -> dict:
        """A fresh copy-task batch of `rows` rows of `length` (0: the size's), placed on the mesh."""
        size = self.size
        length = length or size.length
        batch = synthetic.packed_copy_batch(
            self.rng,
            rows,
            length,
            num_symbols=size.num_symbols,
            min_length=size.min_pair,
            max_length=min(size.max_pair, length),
        )
        return self.train_step.place_batch(batch)

    def lower(self, rows: int):
        """The train step lowered for batches of `rows` rows."""
        shape = jax.ShapeDtypeStruct((rows, self.size.length), np.int32, sharding=sharding.batch_sharding(self.mesh))
        batch = {key: shape for key in ("inputs", "targets", *BATCH_KEYS)}
        return self.train_step.run.lower(self.state, batch, self.base_rng)

    def compile(self, rows: int) -> tuple:
        """(lowered, compiled, compile seconds) of the train step for `rows` rows, compiled once."""
        if rows not in self.compiled:
            lowered = self.lower(rows)
            start = time.perf_counter()
            compiled = lowered.compile()
            self.compiled[rows] = (lowered, compiled, time.perf_counter() - start)
        return self.compiled[rows]

    def run_steps(self, compiled, batches, first_step: int = 0) -> tuple[list[float], list[dict]]:
        """Runs a step on each of `batches`, each timed from dispatch to its metrics on the host."""
        seconds, metrics = [], []
        for step, batch in enumerate(batches, start=first_step):
            start = time.perf_counter()
            self.state, step_metrics = compiled(self.state, batch, jax.random.fold_in(self.base_rng, step))
            metrics.append(jax.device_get(step_metrics))
            seconds.append(time.perf_counter() - start)
        return seconds, metrics

    def speed(self, rows: int, seconds: float, tokens: float) -> dict:
        """Step time, real target tokens/s and MFU of a `rows`-row step of `seconds` with `tokens` real targets."""
        model_flops = flops.train_step_flops(self.model.config, rows, self.size.length, self.size.length)
        return {
            "rows": rows,
            "target_positions": rows * self.size.length,
            "step_ms": seconds * 1e3,
            "target_tokens_per_s": tokens / seconds,
            "model_tflops_per_step": model_flops / 1e12,
            "mfu": model_flops / seconds / peak()[0],
        }


@functools.cache
def peak() -> tuple[float, str]:
    """The device's dense bf16 peak and where it comes from (on a CPU a measurement: taken once)."""
    return flops.peak_flops_per_device("bfloat16")


def compiled_memory(compiled) -> dict:
    """What a compiled step holds on its device: arguments + outputs - donated (aliased) + temporaries."""
    analysis = compiled.memory_analysis()
    figures = {
        f"{part}_bytes": getattr(analysis, f"{part}_size_in_bytes") for part in ("argument", "output", "alias", "temp")
    }
    figures["total_bytes"] = (
        figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"] + figures["temp_bytes"]
    )
    return figures


def device_memory() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {key: stats.get(key) for key in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}


def is_out_of_memory(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)


def accelerator() -> dict:
    """The devices: kind, count, their dense bf16 peak, and the CUDA stack where there is one."""
    device = jax.devices()[0]
    return {
        "platform": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "devices_used": 1,
        "peak_bf16_flops_per_device": peak()[0],
        "peak_source": peak()[1],
        "platform_version": getattr(device.client, "platform_version", None),
        "cuda": _cuda_versions(),
    }


def _cuda_versions() -> dict | None:
    """CUDA runtime, driver and cuDNN versions from the JAX CUDA plugin, where one is installed."""
    for plugin in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jaxlib.cuda"):
        try:
            module = importlib.import_module(f"{plugin}._versions")
        except ImportError:
            continue
        found = {"plugin": plugin}
        for name in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version"):
            try:
                found[name.removesuffix("_get_version")] = getattr(module, name)()
            except Exception as error:  # noqa: BLE001 - a version we cannot read is recorded, not fatal.
                found[name.removesuffix("_get_version")] = f"unreadable: {error}"
        return found
    return None
