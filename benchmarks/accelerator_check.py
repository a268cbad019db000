r"""The train step on one accelerator: speed, memory, attention kernels, matmul dtypes and learning.

  PYTHONPATH=. python benchmarks/accelerator_check.py --sizes=base,big   # a GPU: ~13 minutes, copy ~2/3 of it
  PYTHONPATH=. python benchmarks/accelerator_check.py --sizes=tiny       # the same path on a CPU: ~1 minute

Needs only jax, flax, optax, orbax, absl, ml_collections and NumPy (no TensorFlow, grain or
SentencePiece: the batches are synthetic, `input_pipeline/synthetic.py`), so it runs on a
GPU machine without the data stack; docs/accelerator_check.md says how to carry the wheels
there. The step is the one train.py compiles (`make_model`, `make_optimizer`,
`configured_train_step` over a 1-device mesh, the translation loss) in bfloat16, on packed rows
of a copy task (target = source). Sizes: 'base' (configs/default.py, Transformer-base),
'big' (Transformer-big: d_model 1024, d_ff 4096, 16 heads, dropout 0.3, the paper's Table 3),
'tiny' (configs/tiny.py's model, for CPUs and the test).

Sections, per size, in this order (the cheapest and most needed first, so that a run stopped
at its time limit keeps them):

- step: compile time, then the median of `--steps` steps, each timed from dispatch to its
  metrics being on the host (one step at a time, on one placed batch); real target tokens/s;
  MFU (training/flops.py's model FLOPs over the device's dense bf16 peak); the compiled step's
  memory (arguments + outputs - donated + temporaries) and the device's peak bytes in use so
  far in the process (None on CPU).
- dtypes: every dot_general of the step's StableHLO, counted by (lhs, rhs -> result) dtypes;
  models/precision.py's policy is bf16 x bf16 -> f32 for every product forward and backward.
  Others are listed with the source location JAX gave them. Fused attention kernels are custom
  calls, counted apart.
- copy: `--copy_steps` steps (the size's own: tiny 300, base and big 1500) from fresh parameters
  on fresh copy batches, learning rate warming up over COPY_WARMUP_STEPS to the paper's peak for
  the size, then the same training again as a negative control whose cross-attention
  sub-layers output zeros, so its decoder never sees the source. A model blind to the source
  cannot beat log(symbols) (`synthetic.blind_nll`); the bar is COPY_PASS_FRACTION x log(symbols).
  PASS if the mean target NLL of the last 10 steps is under the bar and the control's is above
  it: a step that leaks the target to the decoder (a wrong causal mask, say) passes the bar
  blind too, and the control fails the section.
- attention: the loss and gradient (forward and backward, no update) with cuDNN's fused
  attention and with XLA's (`jax.nn.dot_product_attention`), same parameters, batch and
  dropout key; on a CPU, where cuDNN does not exist, the project's explicit formula and XLA's.
  The rows are `--attention_length` long (default: the size's own): packed copy pairs, most rows
  ending in padding, whose query rows have no key (64 is the quick-start's length, and a key
  length of 64 mod 128 is where cuDNN 9.19's backward once gave NaN on an H100). Each one's
  median time, and how far they differ against bfloat16's unit roundoff u = 2^-8 (8
  significant bits): the two round in different places (a fused kernel keeps its own running
  softmax), so differences of a few u are rounding, while a wrong mask or scale differs by
  O(1). Bars: loss within u, gradient norm within 2u, and the gradients' difference
  (L2) within 8u of the gradient's norm.
- max_batch: the largest batch per device: the compiled step's memory at the step's rows and
  at twice as many (compile only) is fitted as fixed + per-row bytes, the rows that fit in
  92% of the device's memory limit predicted (a multiple of 8), then compiled and run there
  (3 steps, the median of the last 2), halving on RESOURCE_EXHAUSTED. On a CPU only with
  `--memory_limit_mib` (a CPU has no device memory limit).

A section that fails records its error and the others go on. The record (JSON: the command,
devices, versions, CPU, git commit, every figure) and a Markdown table beside it are written
again after every section, so a run killed at its time limit keeps what it measured.
"""

import dataclasses
import functools
import importlib
import json
import os
import re
import statistics
import sys
import time
import traceback

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax
from absl import app, flags

from common import records
from configs import default, tiny
from input_pipeline import synthetic
from models.build import make_model
from models.packing import BATCH_KEYS
from training import flops
from training.optimizer import make_optimizer, paper_peak
from training.runtime import sharding
from training.state import initial_state, state_shardings
from training.steps import configured_train_step, translation_loss

SECTIONS = ("step", "dtypes", "copy", "attention", "max_batch")
_SIZES = flags.DEFINE_list("sizes", ["base", "big"], "Model sizes to check, in turn: tiny, base, big.")
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), "Sections to run (the module docstring).")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps of the step and attention sections (after warm-up).")
_COPY_STEPS = flags.DEFINE_integer("copy_steps", 0, "Steps of the copy task (0: the size's own, tiny 300, else 1500).")
_ROWS = flags.DEFINE_integer("rows", 0, "Rows per batch (0: the size's own; base and big ~25k target positions).")
_ATTENTION_LENGTH = flags.DEFINE_integer(
    "attention_length", 0, "Row length of the attention section's batch (0: the size's own; 64 for the quick-start's)."
)
_ATTENTION = flags.DEFINE_list(
    "attention", [], "The two attention implementations to compare (default: cudnn,xla on a GPU, else explicit,xla)."
)
_PEAK_LEARNING_RATES = flags.DEFINE_list(
    "peak_learning_rates", [], "Peak learning rates to run the sections at, each in turn (default: the size's own)."
)
_REGULARISATION = flags.DEFINE_list(
    "regularisation",
    ["paper"],
    "Per size, in turn: paper (the size's dropout and label smoothing), none (both 0: how fast the copy "
    "task is learned without them).",
)
_MEMORY_LIMIT_MIB = flags.DEFINE_integer(
    "memory_limit_mib", 0, "Memory the max_batch search fills (0: the device's bytes_limit; a CPU has none)."
)
_OUTPUT = flags.DEFINE_string(
    "output", "", "Record path (default docs/results/accelerator_check_<sizes>_<platform>.json); a .md beside it."
)

BF16_UNIT_ROUNDOFF = 2.0**-8
# The attention section's bars, in bfloat16 unit roundoffs (the module docstring).
BARS = {"loss": 1 * BF16_UNIT_ROUNDOFF, "grad_norm": 2 * BF16_UNIT_ROUNDOFF, "grad_diff": 8 * BF16_UNIT_ROUNDOFF}
COPY_WARMUP_STEPS = 100
COPY_PASS_FRACTION = 0.25
COPY_LAST_STEPS = 10  # The copy task's final NLL: their mean, as one step's is noisy.
MEMORY_MARGIN = 0.92  # Of the limit: room for what the compiled step's figures leave out (allocator slack).
POLICY_DOT = "bf16 x bf16 -> f32"


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
    """Size `name` (the module docstring) in bfloat16, warming up fast for the copy task; `rows` > 0 overrides."""
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


class Check:
    """One size's model, optimizer and train step (compiled per row count), and the state it runs on.

    With `blind`, the step trains a decoder that never sees the source (`without_cross_attention`).
    """

    def __init__(self, size: Size, blind: bool = False):
        self.size = size
        config = self.config = size.config
        self.mesh = sharding.make_mesh(config.mesh, devices=jax.devices()[:1])
        self.model = make_model(config, config.tokenizer.vocab_size)
        self.tx, schedule = make_optimizer(config.optimizer, d_model=config.model.d_model)
        self.shardings = state_shardings(config, self.model, self.tx, self.mesh)
        self.loss_fn = functools.partial(
            translation_loss, model=self.model, label_smoothing=config.optimizer.label_smoothing
        )
        if blind:
            self.loss_fn = without_cross_attention(self.loss_fn)
        self.train_step = configured_train_step(config, self.loss_fn, self.tx, schedule, self.mesh, self.shardings)
        self.rng = np.random.default_rng(config.seed)
        self.state = None
        self.reset_state()
        self.base_rng = self.state.rng.copy()  # Step keys fold in from it, as in training/loop.py.
        self.compiled = {}  # rows -> (lowered, compiled, compile seconds)

    def reset_state(self) -> None:
        """A fresh train state from config.seed on the mesh."""
        self.state = None  # Frees the old one first.
        self.state = initial_state(self.config, self.model, self.tx, self.shardings)

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
            "mfu": model_flops / seconds / _peak()[0],
        }


@functools.cache
def _peak() -> tuple[float, str]:
    """The device's dense bf16 peak and where it comes from (on a CPU a measurement: taken once)."""
    return flops.peak_flops_per_device("bfloat16")


def _memory(compiled) -> dict:
    """What a compiled step holds on its device: arguments + outputs - donated (aliased) + temporaries."""
    analysis = compiled.memory_analysis()
    figures = {
        "argument_bytes": analysis.argument_size_in_bytes,
        "output_bytes": analysis.output_size_in_bytes,
        "alias_bytes": analysis.alias_size_in_bytes,
        "temp_bytes": analysis.temp_size_in_bytes,
    }
    figures["total_bytes"] = (
        figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"] + figures["temp_bytes"]
    )
    return figures


def _device_memory() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {key: stats.get(key) for key in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}


def _is_out_of_memory(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)


# --------------------------------------------------------------------------- #
# Sections: each takes the size's Check and returns its figures.
# --------------------------------------------------------------------------- #


def step_section(check: Check) -> dict:
    """Compile time, median step time, tokens/s, MFU and memory at the size's batch."""
    rows = check.size.rows
    _, compiled, compile_seconds = check.compile(rows)
    batch = check.batch(rows)
    check.run_steps(compiled, [batch] * 2)  # Warm-up: the first runs allocate and load.
    seconds, metrics = check.run_steps(compiled, [batch] * _STEPS.value, first_step=2)
    median = statistics.median(seconds)
    return {
        "compile_s": compile_seconds,
        **check.speed(rows, median, float(metrics[-1]["tokens"])),
        "timing": f"median of {len(seconds)} steps, each blocked on (dispatch to metrics on the host)",
        "real_target_share": float(metrics[-1]["tokens"]) / (rows * check.size.length),
        "loss": float(metrics[-1]["loss"]),
        "compiled_memory": _memory(compiled),
        "device_memory": _device_memory(),
    }


_DOT = re.compile(
    r"stablehlo\.dot_general .*: \(tensor<(?:[\dx?]*x)?(\w+)>, tensor<(?:[\dx?]*x)?(\w+)>\) "
    r"-> tensor<(?:[\dx?]*x)?(\w+)> loc\((#loc\d+)\)"
)
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.\-]+)")
_LOCATION = re.compile(r'^(#loc\d+) = loc\("([^"]*)"', re.MULTILINE)


def dot_dtypes(stablehlo: str) -> dict:
    """dot_generals of StableHLO text (with debug info) counted by dtypes; where those off the policy come from."""
    names = dict(_LOCATION.findall(stablehlo))
    counts, off_policy = {}, {}
    for lhs, rhs, result, location in _DOT.findall(stablehlo):
        kind = f"{lhs} x {rhs} -> {result}"
        counts[kind] = counts.get(kind, 0) + 1
        if kind != POLICY_DOT:
            where = names.get(location, location)
            off_policy[f"{kind} at {where}"] = off_policy.get(f"{kind} at {where}", 0) + 1
    custom_calls = {}
    for target in _CUSTOM_CALL.findall(stablehlo):
        custom_calls[target] = custom_calls.get(target, 0) + 1
    return {
        "dot_generals": sum(counts.values()),
        "by_dtypes": counts,
        "off_policy": off_policy,
        "all_on_policy": not off_policy,
        "custom_calls": custom_calls,
    }


def dtypes_section(check: Check) -> dict:
    """The dtypes of every dot_general of the step's StableHLO (lowered again if the step section did not run)."""
    lowered = check.compiled[check.size.rows][0] if check.size.rows in check.compiled else check.lower(check.size.rows)
    return dot_dtypes(lowered.as_text(debug_info=True))


def train_copy(check: Check, steps: int) -> dict:
    """`steps` steps of `check`'s train step from fresh parameters on fresh copy batches: NLL first and last."""
    rows = check.size.rows
    _, compiled, _ = check.compile(rows)
    check.reset_state()
    start = time.perf_counter()
    metrics = []
    for step in range(steps):  # Not blocked per step: the next batch is made while the step runs.
        check.state, step_metrics = compiled(check.state, check.batch(rows), jax.random.fold_in(check.base_rng, step))
        metrics.append(step_metrics)
    metrics = jax.device_get(metrics)
    nll = [float(m["nll"]) for m in metrics]
    return {
        "seconds": time.perf_counter() - start,
        "first_nll": nll[0],
        "final_nll": statistics.mean(nll[-COPY_LAST_STEPS:]),
        "skipped_steps": sum(not m["finite"] for m in metrics),
        "peak_learning_rate": max(float(m["learning_rate"]) for m in metrics),
    }


def copy_passed(final_nll: float, control_final_nll: float, bar: float) -> bool:
    """The copy section's verdict: the model learned to copy and the blind control did not (NaN fails)."""
    return final_nll < bar < control_final_nll


def copy_section(check: Check) -> dict:
    """Trains on the copy task, then a control that cannot see the source; PASS if only the first beats the bar."""
    steps = _COPY_STEPS.value or check.size.copy_steps
    learned = train_copy(check, steps)
    control = train_copy(Check(check.size, blind=True), steps)
    blind = synthetic.blind_nll(check.size.num_symbols)
    bar = COPY_PASS_FRACTION * blind
    return {
        "steps": steps,
        "symbols": check.size.num_symbols,
        **learned,
        "blind_nll": blind,
        "pass_below": bar,
        "control": control,  # The same training with cross-attention zeroed: must stay above the bar.
        "passed": copy_passed(learned["final_nll"], control["final_nll"], bar),
    }


def attention_section(check: Check) -> dict:
    """Loss and gradients with two attention implementations, same parameters, batch and dropout key."""
    implementations = tuple(_ATTENTION.value) or (
        ("cudnn", "xla") if jax.default_backend() == "gpu" else ("explicit", "xla")
    )
    params = check.state.params
    length = _ATTENTION_LENGTH.value or check.size.length
    batch = check.batch(check.size.rows, length)
    rng = jax.random.fold_in(check.base_rng, 0)
    results, gradients = {}, {}
    for implementation in implementations:
        config = check.config.copy_and_resolve_references()
        config.model.attention_implementation = implementation
        model = make_model(config, config.tokenizer.vocab_size)
        loss_fn = functools.partial(translation_loss, model=model, label_smoothing=config.optimizer.label_smoothing)

        def mean_loss_grads(params, batch, rng, loss_fn=loss_fn):
            grads, sums = jax.grad(loss_fn, has_aux=True)(params, batch, rng)
            return sums["loss"] / sums["tokens"], jax.tree.map(lambda g: g / sums["tokens"], grads)

        start = time.perf_counter()
        compiled = jax.jit(mean_loss_grads).lower(params, batch, rng).compile()
        compile_seconds = time.perf_counter() - start
        seconds = []
        for _ in range(_STEPS.value + 1):  # The first call warms up.
            start = time.perf_counter()
            loss, grads = jax.block_until_ready(compiled(params, batch, rng))
            seconds.append(time.perf_counter() - start)
        gradients[implementation] = grads
        results[implementation] = {
            "compile_s": compile_seconds,
            "loss_and_grad_ms": statistics.median(seconds[1:]) * 1e3,
            "loss": float(loss),
            "grad_norm": float(optax.global_norm(grads)),
        }
    first, second = implementations
    reference = results[second]
    difference = jax.tree.map(lambda a, b: a - b, gradients[first], gradients[second])
    agreement = {
        "loss_relative_difference": abs(results[first]["loss"] - reference["loss"]) / abs(reference["loss"]),
        "grad_norm_relative_difference": abs(results[first]["grad_norm"] - reference["grad_norm"])
        / reference["grad_norm"],
        "grad_difference_norm_relative": float(optax.global_norm(difference)) / reference["grad_norm"],
        "grad_max_abs_difference_relative": float(_max_abs(difference)) / float(_max_abs(gradients[second])),
    }
    bars = {
        "loss_relative_difference": BARS["loss"],
        "grad_norm_relative_difference": BARS["grad_norm"],
        "grad_difference_norm_relative": BARS["grad_diff"],
    }
    return {
        "compared": f"{first} vs {second}",
        "length": length,
        "timing": f"forward and backward (no update), median of {_STEPS.value} calls",
        "dropout": check.config.model.dropout_rate,
        **{implementation: results[implementation] for implementation in implementations},
        **agreement,
        "bars": bars,
        "agree": all(agreement[key] <= bar for key, bar in bars.items()),
    }


def _max_abs(tree) -> jax.Array:
    return max(jax.numpy.max(jax.numpy.abs(leaf)) for leaf in jax.tree.leaves(tree))


def max_batch_section(check: Check) -> dict:
    """The largest batch per device, predicted from two compiles' memory and checked by running there."""
    rows = check.size.rows
    small = _memory(check.compile(rows)[1])["total_bytes"]
    lowered = check.lower(2 * rows)
    large = _memory(lowered.compile())["total_bytes"]  # Compile only: not kept.
    per_row = (large - small) / rows
    fixed = small - per_row * rows
    figures = {"fitted_fixed_bytes": fixed, "fitted_bytes_per_row": per_row}
    limit = _MEMORY_LIMIT_MIB.value * 2**20 or _device_memory()["bytes_limit"]
    if not limit:
        return {**figures, "skipped": f"no device memory limit on {jax.default_backend()}: pass --memory_limit_mib"}
    predicted = int((MEMORY_MARGIN * limit - fixed) / per_row)
    predicted = predicted // 8 * 8 if predicted >= 8 else predicted
    figures.update({"memory_limit_bytes": limit, "predicted_rows": predicted, "tried_rows": []})
    candidate = predicted
    while candidate >= 1:
        figures["tried_rows"].append(candidate)
        try:
            _, compiled, compile_seconds = check.compile(candidate)
            batch = check.batch(candidate)
            seconds, metrics = check.run_steps(compiled, [batch] * 3)
        except Exception as error:  # noqa: BLE001 - only running out of memory is expected; others go up.
            if not _is_out_of_memory(error):
                raise
            check.compiled.pop(candidate, None)
            check.reset_state()  # A failed step may have consumed the donated state.
            candidate //= 2
            continue
        return {
            **figures,
            "compile_s": compile_seconds,
            **check.speed(candidate, statistics.median(seconds[1:]), float(metrics[-1]["tokens"])),
            "compiled_memory": _memory(compiled),
            "device_memory": _device_memory(),
        }
    return {**figures, "error": "no batch fits"}


SECTION_FUNCTIONS = {
    "step": step_section,
    "dtypes": dtypes_section,
    "copy": copy_section,
    "attention": attention_section,
    "max_batch": max_batch_section,
}


# --------------------------------------------------------------------------- #
# The record (common/records.py): the devices, figures, a Markdown table.
# --------------------------------------------------------------------------- #


def accelerator() -> dict:
    """The devices: kind, count, their dense bf16 peak, and the CUDA stack where there is one."""
    device = jax.devices()[0]
    return {
        "platform": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "devices_used": 1,
        "peak_bf16_flops_per_device": _peak()[0],
        "peak_source": _peak()[1],
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


def summary(section: str, figures: dict) -> str:
    """One line of a section's main figures."""
    if "error" in figures:
        return f"ERROR {figures['error'].splitlines()[0][:300]}"
    if figures.get("skipped"):
        return f"skipped: {figures['skipped']}"
    if section in ("step", "max_batch"):
        peak = (figures.get("device_memory") or {}).get("peak_bytes_in_use")
        return (
            f"{figures['rows']} x {figures['target_positions'] // figures['rows']} rows, compile "
            f"{figures['compile_s']:.1f} s, step {figures['step_ms']:.1f} ms, {figures['target_tokens_per_s']:,.0f} "
            f"real tgt tok/s, MFU {figures['mfu']:.1%}, compiled step "
            f"{figures['compiled_memory']['total_bytes'] / 2**30:.2f} GiB, peak in use "
            + (f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a")
            + (
                f" (predicted {figures['predicted_rows']}, tried {figures['tried_rows']})"
                if section == "max_batch"
                else ""
            )
        )
    if section == "dtypes":
        counts = ", ".join(f"{kind}: {n}" for kind, n in figures["by_dtypes"].items())
        calls = ", ".join(f"{name}: {n}" for name, n in figures["custom_calls"].items()) or "none"
        verdict = "all on policy" if figures["all_on_policy"] else f"OFF POLICY: {figures['off_policy']}"
        return f"{figures['dot_generals']} dot_generals ({counts}); {verdict}; custom calls: {calls}"
    if section == "copy":
        control = figures["control"]
        return (
            f"{'PASS' if figures['passed'] else 'FAIL'}: NLL {figures['first_nll']:.3f} -> {figures['final_nll']:.3f} "
            f"(bar {figures['pass_below']:.3f} = {COPY_PASS_FRACTION} x log {figures['symbols']}) in "
            f"{figures['steps']} steps, {figures['seconds']:.1f} s; control without cross-attention "
            f"{control['first_nll']:.3f} -> {control['final_nll']:.3f} (must stay above the bar), "
            f"{control['seconds']:.1f} s"
        )
    if section == "attention":
        first, second = figures["compared"].split(" vs ")
        return (
            f"{figures['compared']} at length {figures['length']}: {figures[first]['loss_and_grad_ms']:.1f} vs "
            f"{figures[second]['loss_and_grad_ms']:.1f} ms; loss rel diff {figures['loss_relative_difference']:.2e}, "
            f"grad norm rel diff {figures['grad_norm_relative_difference']:.2e}, grad diff / norm "
            f"{figures['grad_difference_norm_relative']:.2e}, max abs diff / max abs "
            f"{figures['grad_max_abs_difference_relative']:.2e}: "
            + ("agree (within bars)" if figures["agree"] else "DISAGREE (beyond bars)")
        )
    return json.dumps(figures)


def table(record: dict) -> list[str]:
    """The record's page below its header: the devices, then one row per size and section."""
    devices = record["accelerator"]
    lines = [
        f"Device: {devices['device_kind']} ({devices['platform']}, {devices['device_count']} present, 1 used); "
        f"bf16 peak {devices['peak_bf16_flops_per_device'] / 1e12:.1f} TFLOP/s ({devices['peak_source']}); "
        f"CUDA: {devices['cuda']}. Every figure is defined in benchmarks/accelerator_check.py's docstring.",
        "",
        "| size | section | result |",
        "|---|---|---|",
    ]
    for size, sections in record["figures"].items():
        for section, figures in sections.items():
            lines.append(f"| {size} | {section} | {summary(section, figures).replace('|', '/')} |")
    return lines


def _error(error: Exception) -> dict:
    return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


def main(argv):
    del argv
    unknown = set(_SECTIONS.value) - set(SECTIONS)
    if unknown:
        raise app.UsageError(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}.")
    if _ATTENTION.value and len(_ATTENTION.value) != 2:
        raise app.UsageError(f"--attention: name two implementations, not {len(_ATTENTION.value)}.")
    sizes = [make_size(name, _ROWS.value) for name in _SIZES.value]  # Unknown names fail before any work.
    if rates := [float(rate) for rate in _PEAK_LEARNING_RATES.value]:
        sizes = [with_peak_learning_rate(size, rate) for size in sizes for rate in rates]
    if unknown := set(_REGULARISATION.value) - {"paper", "none"}:
        raise app.UsageError(f"--regularisation: unknown {sorted(unknown)}; choose paper, none.")
    variants = {"paper": lambda size: size, "none": without_regularisation}
    sizes = [variants[name](size) for size in sizes for name in _REGULARISATION.value]
    path = _OUTPUT.value or os.path.join(
        records.RESULTS_DIR, f"accelerator_check_{'_'.join(_SIZES.value)}_{jax.default_backend()}"
    )
    devices = accelerator()
    record = records.new(
        "the train step on one accelerator: speed, memory, attention kernels, matmul dtypes, learning",
        figures={},
        packages=(*records.DEFAULT_PACKAGES, "ml_collections", "absl-py"),
        accelerator=devices,
    )
    if devices["platform"] != "cpu":  # A CPU is described as the host is, model and kind.
        record["machine"]["accelerator"] = f"{devices['device_kind']} ({devices['platform']})"
    print(f"{devices['device_kind']}: jax {record['software']['jax']}", flush=True)
    for size in sizes:
        figures = record["figures"][size.name] = {}
        try:
            check = Check(size)
        except Exception as error:  # noqa: BLE001 - recorded; the next size may still run.
            figures["setup"] = _error(error)
            print(f"{size.name:<5} setup      {summary('setup', figures['setup'])}", flush=True)
            records.write(record, path, table(record))
            continue
        for section in (name for name in SECTIONS if name in _SECTIONS.value):
            start = time.perf_counter()
            try:
                figures[section] = SECTION_FUNCTIONS[section](check)
            except Exception as error:  # noqa: BLE001 - recorded; the other sections still run.
                figures[section] = _error(error)
            figures[section]["section_s"] = time.perf_counter() - start
            print(f"{size.name:<5} {section:<10} {summary(section, figures[section])}", flush=True)
            records.write(record, path, table(record))
        del check
    record["loaded_modules"] = sorted({name.partition(".")[0] for name in sys.modules})
    print("\n".join(table(record)), flush=True)
    print("wrote", records.write(record, path, table(record)))


if __name__ == "__main__":
    app.run(main)
