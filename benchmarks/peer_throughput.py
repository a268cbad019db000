r"""This project's train step vs PyTorch's `nn.Transformer` on CPU, at config R.

  pip install -e '.[benchmark]'   # PyTorch 2.13 (CPU), for this benchmark only
  python -m benchmarks.peer_throughput --variants=float32,bfloat16,bfloat16-dropout0 --rounds=5 --steps=10

Config R, the model both frameworks train: d_model 256, 4 heads, d_ff 1024, 3 + 3 layers,
post-LN, a shared 8k vocabulary (embeddings and output layer tied, sinusoidal positions),
dropout 0.1, label smoothing 0.1, Adam (β 0.9/0.98, ε 1e-9), a batch of 32 x 64 random ids
with no padding (every position a real token). Target tokens/s = 32 * 64 / seconds per step,
a step being a full update (forward, loss, backward, Adam).

- This project: the train step exactly as train.py builds it (configs/default.py with the
  overrides of `config_r`, `make_model`, `make_optimizer`, `configured_train_step`, the
  translation loss) on a 1 x 1 x 1 mesh. bfloat16 is `model.dtype='bfloat16'`: bf16 matmul
  operands accumulating in float32, float32 parameters, LayerNorm, softmax and logits.
- PyTorch: what a researcher would write: `nn.Transformer(batch_first=True, norm_first=False)`,
  an `nn.Embedding` scaled by sqrt(d_model) plus the same sinusoidal positions, an output
  `nn.Linear` tied to the embedding, a causal target mask, `nn.CrossEntropyLoss(label_smoothing)`,
  `torch.optim.Adam`; bfloat16 is `torch.autocast('cpu', dtype=torch.bfloat16)` around the
  forward pass and loss. Thread counts are PyTorch's defaults (printed).

What differs, as each framework's standard layers have it: PyTorch's attention has biases on
its q, k, v and output projections, both of its stacks end with a LayerNorm even post-LN
(tests/test_config_r.py counts the parameters), its `dropout` also drops attention
weights and the feed-forward hidden units (this project: attention_dropout_rate 0, no inner
dropout), and its LayerNorm ε is 1e-5 (here 1e-6). The `bfloat16-dropout0` row takes dropout
out of the comparison.

Both run in one process, alternating in rounds (each round: every variant's JAX step, then its
PyTorch step, `--steps` steps each) so that a noisy neighbour affects all alike; the reported
figure is the median over rounds. Warm-up steps (the first compiles the JAX step) are not
timed; compile time is the first step minus a median step. Each round also times 2048^2
matmuls in JAX (float32; bfloat16 operands with float32 output), the peaks against which the
JAX step's model FLOPs give its MFU (float32 rows against the float32 peak, bfloat16 rows
against the bfloat16 one).

Both frameworks share the process and its malloc, set at start-up as train.py sets it
(training/runtime/host_memory.py). `--frameworks=jax` times this project's step alone
(PyTorch need not be installed); `--rounds_from_stdin` lets benchmarks/host_allocators.py run
the rounds of several such processes, one per allocator, in turn.

Take figures on a quiet machine: PyTorch's OpenMP threads suffer far more than XLA's pool from
other work on the same cores (under load, a PyTorch step with its default threads can run
several times slower than with one).
"""

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import jax
import ml_collections
from absl import app, flags

from benchmarks import records
from benchmarks.config_r import ProjectStep, TorchStep, config_r, num_layers, random_batch
from models.build import make_model
from training import flops
from training.reporting.logs import quiet_library_logs
from training.runtime import compilation_cache, host_memory

# name -> (compute dtype, dropout rate).
VARIANTS = {
    "float32": ("float32", 0.1),
    "bfloat16": ("bfloat16", 0.1),
    "bfloat16-dropout0": ("bfloat16", 0.0),
}

_VARIANTS = flags.DEFINE_list("variants", list(VARIANTS), f"Rows to measure, of: {', '.join(VARIANTS)}.")
FRAMEWORKS = ("jax", "torch")  # This project's step, PyTorch's.
_FRAMEWORKS = flags.DEFINE_list("frameworks", list(FRAMEWORKS), "Steps to time: this project's (jax), PyTorch's.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds; each runs every variant in both frameworks.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per variant, framework and round.", lower_bound=1)
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", 2, "Untimed steps before the rounds (the first compiles).", lower_bound=1
)
_OUTPUT = flags.DEFINE_string(
    "output", "", "Record path without suffix (default: docs/results/peer_throughput_<cpu kind>); 'none': no record."
)
_ROUNDS_FROM_STDIN = flags.DEFINE_bool(
    "rounds_from_stdin",
    False,
    "Instead of --rounds, a round for each line read from stdin until it closes; each round's tokens/s "
    "printed as a line of JSON (benchmarks/host_allocators.py).",
)
_MATMUL_SIZE = 2048
_MATMUL_REPEATS = 5  # Timed matmuls per dtype and round.


def _seconds_per_step(step: Callable[[], object], num_steps: int) -> float:
    start = time.perf_counter()
    for _ in range(num_steps):
        loss = step()
    float(loss)  # Waits for JAX's asynchronous dispatch to finish.
    return (time.perf_counter() - start) / num_steps


def _warm_up(step: Callable[[], object], num_steps: int) -> float:
    """Runs `num_steps` (>= 1) untimed steps; returns the seconds of the first (a JAX step's includes compiling)."""
    first = _seconds_per_step(step, 1)
    if num_steps > 1:
        _seconds_per_step(step, num_steps - 1)
    return first


@dataclasses.dataclass
class _Measurements:
    first_step_seconds: dict[tuple[str, str], float]  # (variant, 'jax' or 'torch') -> seconds.
    tokens_per_second: dict[tuple[str, str], list[float]]  # (variant, framework) -> one per round.
    matmul_gflops: dict[str, list[float]]  # Operand dtype -> one per round.


def _measure(
    configs: dict[str, ml_collections.ConfigDict],
    rounds: Iterable,
    steps: int,
    warmup_steps: int,
    frameworks: list[str],
    print_rounds: bool = False,
) -> _Measurements:
    """Builds and warms up every variant's steps in `frameworks`, then times them (and the matmuls) in
    alternating rounds, one for each item of `rounds`; with `print_rounds`, prints each round's tokens/s as JSON."""
    runners, first_step_seconds = {}, {}
    for name, config in configs.items():
        batch = random_batch(config)
        for framework, make_step in (("jax", ProjectStep), ("torch", TorchStep)):
            if framework not in frameworks:
                continue
            runners[name, framework] = make_step(config, batch)
            first_step_seconds[name, framework] = _warm_up(runners[name, framework], warmup_steps)

    tokens_per_second = {key: [] for key in runners}
    matmul_gflops = {dtype: [] for dtype in ("float32", "bfloat16")}
    for round_index, _ in enumerate(rounds):
        for dtype, values in matmul_gflops.items():
            values.append(flops.measured_matmul_peak(dtype, _MATMUL_SIZE, _MATMUL_REPEATS) / 1e9)
        for (name, framework), step in runners.items():
            tokens = configs[name].per_device_batch_size * configs[name].dataset.max_length
            tokens_per_second[name, framework].append(tokens / _seconds_per_step(step, steps))
        if print_rounds:
            figures = {f"{name} {framework}": values[-1] for (name, framework), values in tokens_per_second.items()}
            print(json.dumps({"round": round_index, "tokens_per_second": figures}), flush=True)
    return _Measurements(first_step_seconds, tokens_per_second, matmul_gflops)


def _figures(configs: dict[str, ml_collections.ConfigDict], measured: _Measurements) -> dict:
    """Per variant, medians over rounds: both frameworks' tokens/s, their ratio, model GFLOP/s, MFU; and every round."""
    config = next(iter(configs.values()))
    batch_size, length = config.per_device_batch_size, config.dataset.max_length
    tokens = batch_size * length
    step_flops = flops.train_step_flops(
        make_model(config, config.tokenizer.vocab_size).config, batch_size, length, length
    )
    median = {key: statistics.median(values) for key, values in measured.tokens_per_second.items()}
    peak = {dtype: statistics.median(values) for dtype, values in measured.matmul_gflops.items()}
    variants = {}
    for name, variant_config in configs.items():
        ours, theirs = median.get((name, "jax"), math.nan), median.get((name, "torch"), math.nan)
        gflops = step_flops / (tokens / ours) / 1e9
        jax_first = measured.first_step_seconds.get((name, "jax"), math.nan)
        variants[name] = {
            "tokens_per_second": ours,
            "torch_tokens_per_second": theirs,
            "ratio": ours / theirs,
            "model_gflops_per_second": gflops,
            "mfu": gflops / peak[variant_config.model.dtype],
            "compile_seconds": jax_first - tokens / ours,
            "torch_first_step_seconds": measured.first_step_seconds.get((name, "torch"), math.nan),
            "round_tokens_per_second": measured.tokens_per_second.get((name, "jax"), []),
            "torch_round_tokens_per_second": measured.tokens_per_second.get((name, "torch"), []),
        }
    return {
        "step_gflop": step_flops / 1e9,
        "tokens_per_step": tokens,
        "matmul_peak_gflops_per_second": peak,
        "matmul_round_gflops_per_second": measured.matmul_gflops,
        "variants": variants,
    }


def _setting(config: ml_collections.ConfigDict, torch_module) -> list[str]:
    """What was measured: the model, batch and the two frameworks."""
    model = config.model
    encoder_layers, decoder_layers = num_layers(model)
    torch_threads = (
        f"PyTorch {torch_module.__version__} (default threads: {torch_module.get_num_threads()} intra-op, "
        f"{torch_module.get_num_interop_threads()} inter-op)"
        if torch_module
        else "PyTorch not timed"
    )
    return [
        f"Config R: d_model {model.d_model}, {model.num_heads} heads, d_ff {model.d_ff}, "
        f"{encoder_layers}+{decoder_layers} layers, {model.norm_placement}-LN, vocab {config.tokenizer.vocab_size:,}, "
        f"batch {config.per_device_batch_size} x {config.dataset.max_length} (no padding), "
        f"label smoothing {config.optimizer.label_smoothing}, Adam.",
        f"JAX {jax.__version__} ({jax.default_backend()}), {torch_threads}; {os.cpu_count()} CPUs visible.",
    ]


def _table(figures: dict) -> list[str]:
    """The medians as a Markdown table, with the matmul peaks and compile times."""
    peak = figures["matmul_peak_gflops_per_second"]
    lines = [
        f"Matmul {_MATMUL_SIZE}^2 in JAX: float32 {peak['float32']:.0f} GFLOP/s, bfloat16 operands -> float32 "
        f"{peak['bfloat16']:.0f} GFLOP/s. Train step: {figures['step_gflop']:.1f} GFLOP (model FLOPs, "
        "training/flops.py).",
        "",
        "| variant | this project tok/s | PyTorch tok/s | ratio | JAX GFLOP/s | MFU | compile s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in figures["variants"].items():
        lines.append(
            f"| {name} | {row['tokens_per_second']:,.0f} | {row['torch_tokens_per_second']:,.0f} | {row['ratio']:.2f} "
            f"| {row['model_gflops_per_second']:.0f} | {row['mfu']:.0%} | {row['compile_seconds']:.1f} |"
        )
    return lines


def _format_rounds(values: list[float]) -> str:
    return " ".join(f"{value:,.0f}" for value in values)


def _exit_with_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)  # As the entry points exit on a user's error.


def main(argv):
    del argv
    host_memory.set_up()  # As train.py runs; before JAX or PyTorch starts.
    torch = None
    if "torch" in _FRAMEWORKS.value:
        try:
            import torch
        except ImportError:
            _exit_with_error("PyTorch is not installed; install this benchmark's extra: pip install -e '.[benchmark]'")
    for flag, names, known in (("variants", _VARIANTS.value, VARIANTS), ("frameworks", _FRAMEWORKS.value, FRAMEWORKS)):
        if unknown := [name for name in names if name not in known]:
            _exit_with_error(f"--{flag}: unknown {', '.join(unknown)}; choose among {', '.join(known)}.")
    quiet_library_logs()
    compilation_cache.enable("")  # Compile times as on a cold start.
    configs = {name: config_r(*VARIANTS[name]) for name in _VARIANTS.value}
    rounds = sys.stdin if _ROUNDS_FROM_STDIN.value else range(_ROUNDS.value)
    measured_source = records.source()
    measured = _measure(configs, rounds, _STEPS.value, _WARMUP_STEPS.value, _FRAMEWORKS.value, _ROUNDS_FROM_STDIN.value)
    figures = _figures(configs, measured)
    setting, table = _setting(next(iter(configs.values())), torch), _table(figures)
    print("\n".join([*setting, "", *table]))
    if _OUTPUT.value != "none":
        record = records.new(
            "this project's train step against PyTorch's, config R",
            figures=figures,
            packages=(*records.DEFAULT_PACKAGES, "torch"),
            setting=setting,
            rounds=len(figures["matmul_round_gflops_per_second"]["float32"]),
            steps_per_round=_STEPS.value,
            **measured_source,
        )
        path = _OUTPUT.value or os.path.join(records.RESULTS_DIR, f"peer_throughput_{record['machine']['cpu_kind']}")
        print("wrote", records.write(record, path, [*setting, "", *table]))


if __name__ == "__main__":
    app.run(main)
