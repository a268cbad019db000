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

On an accelerator, `--model=base` (benchmarks/step_variants.py) A/Bs the train step of
configs/default.py's Transformer-base in bfloat16 (96 x 256 random ids, no padding) against
PyTorch eager and `torch.compile` (inductor) on the same device, in one process:

  python -m benchmarks.peer_throughput --model=base \
    --variants=default,prng_impl=unsafe_rbg,loss_chunks=8 --xla_flag_sets=jax_guide,cublas --profile_steps=10

PyTorch runs under `torch.autocast` (bf16) with fused Adam, once for all variants (they are this
project's config fields). Every contender's steps are timed as whole runs with one
synchronisation at the end (a loss read back), in alternating rounds; MFU is training/flops.py's
model FLOPs over the device's dense bf16 peak (its table). Each XLA flag set
(step_variants.XLA_FLAG_SETS) times the default step in a process of its own, after the rounds;
`--profile_steps` > 0 profiles each variant's step by kind of kernel (benchmarks/xla_profile.py).
JAX and PyTorch share the device: JAX allocates as it goes (XLA_PYTHON_CLIENT_PREALLOCATE=false).
`--model=tiny` runs the same on configs/tiny.py's model, for a CPU in seconds.
"""

import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

import jax
import ml_collections
from absl import app, flags

from benchmarks import step_variants, xla_profile
from benchmarks.config_r import ProjectStep, TorchStep, config_r, num_layers, random_batch
from common import records
from common.errors import UserInputError
from models.build import make_model
from training import flops, step_options
from training.reporting.logs import quiet_library_logs
from training.runtime import compilation_cache, host_memory

# name -> (compute dtype, dropout rate).
VARIANTS = {
    "float32": ("float32", 0.1),
    "bfloat16": ("bfloat16", 0.1),
    "bfloat16-dropout0": ("bfloat16", 0.0),
}

MODELS = ("config_r", *step_variants.MODELS)
_MODEL = flags.DEFINE_enum(
    "model", "config_r", MODELS, "config_r (the CPU comparison), base (Transformer-base on a GPU), tiny (base's path)."
)
_VARIANTS = flags.DEFINE_list(
    "variants",
    [],
    f"Rows to measure. config_r: of {', '.join(VARIANTS)} (default: all). base, tiny: 'default' or config "
    "fields field=value joined by '+' (benchmarks/step_variants.py); default: default.",
)
FRAMEWORKS = ("jax", "torch", "torch_compile")  # This project's step, PyTorch's eager, under torch.compile.
_FRAMEWORKS = flags.DEFINE_list(
    "frameworks", [], "Steps to time, of jax, torch, torch_compile (default: config_r jax,torch; base, tiny: all)."
)
_XLA_FLAG_SETS = flags.DEFINE_list(
    "xla_flag_sets",
    [],
    f"base, tiny on a GPU: XLA flag sets to time the default step under, each in a process of its own, of "
    f"{', '.join(step_variants.XLA_FLAG_SETS)}.",
)
_PROFILE_STEPS = flags.DEFINE_integer(
    "profile_steps", 0, "base, tiny: steps of each variant to profile by kind of kernel (0: none).", lower_bound=0
)
_COMPILE_BACKEND = flags.DEFINE_string(
    "torch_compile_backend", "inductor", "torch.compile's backend ('eager' checks the path without compiling)."
)
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


def _config_r_runners(configs: dict[str, ml_collections.ConfigDict], frameworks: list[str]) -> dict:
    """(variant, framework) -> its step: each variant in this project and in PyTorch (on the CPU)."""
    runners = {}
    for name, config in configs.items():
        batch = random_batch(config)
        for framework, make_step in (("jax", ProjectStep), ("torch", TorchStep)):
            if framework in frameworks:
                runners[name, framework] = make_step(config, batch)
    return runners


def _accelerator_runners(
    configs: dict[str, ml_collections.ConfigDict], frameworks: list[str], compile_backend: str
) -> dict:
    """(variant, framework) -> its step: each variant in this project; PyTorch's two once, as the first variant's."""
    first, config = next(iter(configs.items()))
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    runners = {}
    if "jax" in frameworks:
        runners = {(name, "jax"): ProjectStep(variant, random_batch(variant)) for name, variant in configs.items()}
    for framework, backend in (("torch", None), ("torch_compile", compile_backend)):
        if framework in frameworks:
            runners[first, framework] = TorchStep(config, random_batch(config), device, compile_backend=backend)
    return runners


def _measure(
    runners: dict,
    tokens: dict,
    rounds: Iterable,
    steps: int,
    warmup_steps: int,
    matmul_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    print_rounds: bool = False,
) -> _Measurements:
    """Warms up every step of `runners` ((variant, framework) -> step), then times them (and the matmuls of
    `matmul_dtypes`) in alternating rounds, one for each item of `rounds`; with `print_rounds`, prints each
    round's tokens/s as JSON. A step of `runners[key]` is `tokens[key]` target tokens."""
    first_step_seconds = {key: _warm_up(step, warmup_steps) for key, step in runners.items()}
    tokens_per_second = {key: [] for key in runners}
    matmul_gflops = {dtype: [] for dtype in matmul_dtypes}
    for round_index, _ in enumerate(rounds):
        for dtype, values in matmul_gflops.items():
            values.append(flops.measured_matmul_peak(dtype, _MATMUL_SIZE, _MATMUL_REPEATS) / 1e9)
        for key, step in runners.items():
            tokens_per_second[key].append(tokens[key] / _seconds_per_step(step, steps))
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


def _tokens_per_step(config: ml_collections.ConfigDict) -> int:
    return config.per_device_batch_size * config.dataset.max_length


def _step_flops(config: ml_collections.ConfigDict) -> int:
    rows, length = config.per_device_batch_size, config.dataset.max_length
    return flops.train_step_flops(make_model(config, config.tokenizer.vocab_size).config, rows, length, length)


def _accelerator_figures(
    configs: dict[str, ml_collections.ConfigDict], measured: _Measurements, flag_sets: dict, profiles: dict
) -> dict:
    """Per contender (each variant of this project's step, PyTorch eager, torch.compile, each XLA flag set's
    default step), medians over rounds: step ms, tokens/s, MFU, ratios to PyTorch's two; and the profiles."""
    first = next(iter(configs))
    peak, peak_source = flops.peak_flops_per_device("bfloat16")
    median = {key: statistics.median(values) for key, values in measured.tokens_per_second.items()}
    torch_medians = {framework: median.get((first, framework), math.nan) for framework in FRAMEWORKS[1:]}

    def row(config, tokens_per_second, **fields):
        return {
            "tokens_per_second": tokens_per_second,
            "step_ms": _tokens_per_step(config) / tokens_per_second * 1e3,
            "mfu": _step_flops(config) / (_tokens_per_step(config) / tokens_per_second) / peak,
            "vs_torch": tokens_per_second / torch_medians["torch"],
            "vs_torch_compile": tokens_per_second / torch_medians["torch_compile"],
            **fields,
        }

    contenders = {}
    for (name, framework), value in median.items():
        contenders[name if framework == "jax" else framework] = row(
            configs[name],
            value,
            framework=framework,
            first_step_seconds=measured.first_step_seconds[name, framework],
            round_tokens_per_second=measured.tokens_per_second[name, framework],
        )
    for name, record in flag_sets.items():
        label = f"{step_variants.DEFAULT_VARIANT}, XLA flags {name}"
        if "error" in record:
            contenders[label] = {"framework": "jax", "error": record["error"]}
            continue
        child = record["figures"]["contenders"][step_variants.DEFAULT_VARIANT]
        contenders[label] = row(
            configs[first],
            child["tokens_per_second"],
            framework="jax",
            process="its own",  # The ratios compare across processes.
            xla_flags=step_variants.XLA_FLAG_SETS[name],
            first_step_seconds=child["first_step_seconds"],
            round_tokens_per_second=child["round_tokens_per_second"],
        )
    return {
        "peak_flops_per_second": peak,
        "peak_source": peak_source,
        "contenders": contenders,
        "profiles": profiles,
    }


def _accelerator_table(figures: dict) -> list[str]:
    """The contenders as a Markdown table; each profiled variant's buckets side by side."""
    lines = [
        "| contender | step ms | target tok/s | MFU | x PyTorch eager | x torch.compile | first step s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in figures["contenders"].items():
        if "error" in row:
            lines.append(f"| {name} | failed: {row['error']} | | | | | |")
            continue
        lines.append(
            f"| {name} | {row['step_ms']:.1f} | {row['tokens_per_second']:,.0f} | {row['mfu']:.1%} "
            f"| {row['vs_torch']:.2f} | {row['vs_torch_compile']:.2f} | {row['first_step_seconds']:.1f} |"
        )
    if profiles := figures["profiles"]:
        names, clock = list(profiles), next(iter(profiles.values()))["clock"]
        key = f"{clock}_ms_per_call"
        lines += [
            "",
            f"Profile by kind of kernel ({clock} ms a step, share):",
            "",
            "| operations | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names),
        ]
        for label in next(iter(profiles.values()))["buckets"]:
            cells = [profiles[name]["buckets"][label] for name in names]
            lines.append(f"| {label} | " + " | ".join(f"{c[key]:.2f} ({c['share']:.0%})" for c in cells) + " |")
        totals = [
            f"{p[f'profiled_{key}']:.1f} of {figures['contenders'][name]['step_ms']:.1f}"
            for name, p in profiles.items()
        ]
        lines.append("| all kernels, of the step's wall time | " + " | ".join(totals) + " |")
    return lines


def _format_rounds(values: list[float]) -> str:
    return " ".join(f"{value:,.0f}" for value in values)


def _exit_with_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)  # As the entry points exit on a user's error.


def _config_r_main(torch_module, variants: list[str], frameworks: list[str]) -> None:
    if unknown := [name for name in variants if name not in VARIANTS]:
        _exit_with_error(f"--variants: unknown {', '.join(unknown)}; choose among {', '.join(VARIANTS)}.")
    compilation_cache.enable("")  # Compile times as on a cold start.
    configs = {name: config_r(*VARIANTS[name]) for name in variants}
    rounds = sys.stdin if _ROUNDS_FROM_STDIN.value else range(_ROUNDS.value)
    measured_source = records.source()
    runners = _config_r_runners(configs, frameworks)
    tokens = {key: _tokens_per_step(configs[key[0]]) for key in runners}
    measured = _measure(
        runners, tokens, rounds, _STEPS.value, _WARMUP_STEPS.value, print_rounds=_ROUNDS_FROM_STDIN.value
    )
    figures = _figures(configs, measured)
    setting, table = _setting(next(iter(configs.values())), torch_module), _table(figures)
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


def _accelerator_main(torch_module, variants: list[str], frameworks: list[str]) -> None:
    base = step_variants.MODELS[_MODEL.value]()
    try:
        configs = {name: step_variants.with_variant(base, name) for name in variants}
        for config in configs.values():
            step_options.check_step_options(config)
    except (ValueError, KeyError, UserInputError) as e:
        _exit_with_error(f"--variants: {e}")
    if unknown := [name for name in _XLA_FLAG_SETS.value if name not in step_variants.XLA_FLAG_SETS]:
        _exit_with_error(
            f"--xla_flag_sets: unknown {', '.join(unknown)}; choose among {', '.join(step_variants.XLA_FLAG_SETS)}."
        )
    if _XLA_FLAG_SETS.value and jax.default_backend() != "gpu":
        _exit_with_error(f"--xla_flag_sets: XLA's GPU flags apply on a GPU; this backend is {jax.default_backend()}.")
    measured_source = records.source()
    with tempfile.TemporaryDirectory() as scratch:
        # Compiled steps are kept, so that a profile reads its step's module back instead of compiling it again.
        compilation_cache.enable(os.path.join(scratch, "compilation_cache"))
        runners = _accelerator_runners(configs, frameworks, _COMPILE_BACKEND.value)
        tokens = {key: _tokens_per_step(configs[key[0]]) for key in runners}
        measured = _measure(runners, tokens, range(_ROUNDS.value), _STEPS.value, _WARMUP_STEPS.value, ())
        profiles = {
            name: xla_profile.profile(lambda step=step: float(step()), step.compiled_hlo(), calls=_PROFILE_STEPS.value)
            for (name, framework), step in runners.items()
            if framework == "jax" and _PROFILE_STEPS.value
        }
        runners.clear()  # Frees the device for the flag sets' processes.
        arguments = [
            f"--model={_MODEL.value}",
            f"--variants={step_variants.DEFAULT_VARIANT}",
            "--frameworks=jax",
            f"--rounds={_ROUNDS.value}",
            f"--steps={_STEPS.value}",
            f"--warmup_steps={_WARMUP_STEPS.value}",
        ]
        flag_sets = {
            name: step_variants.run_with_xla_flags(
                step_variants.XLA_FLAG_SETS[name], arguments, os.path.join(scratch, name)
            )
            for name in _XLA_FLAG_SETS.value
        }
    figures = _accelerator_figures(configs, measured, flag_sets, profiles)
    config = next(iter(configs.values()))
    device = jax.devices()[0]
    setting = [
        f"configs/default.py's model ({_MODEL.value}): d_model {config.model.d_model}, {config.model.num_heads} heads, "
        f"d_ff {config.model.d_ff}, {'+'.join(map(str, num_layers(config.model)))} layers, "
        f"{config.model.norm_placement}-LN, vocab {config.tokenizer.vocab_size:,}, {config.model.dtype}, batch "
        f"{config.per_device_batch_size} x {config.dataset.max_length} (no padding), "
        f"dropout {config.model.dropout_rate}, "
        f"label smoothing {config.optimizer.label_smoothing}, Adam.",
        f"JAX {jax.__version__} on {device.device_kind} ({jax.default_backend()}); "
        + (f"PyTorch {torch_module.__version__} (autocast bf16, fused Adam on a GPU)." if torch_module else "")
        + f" MFU over {figures['peak_flops_per_second'] / 1e12:.1f} TFLOP/s ({figures['peak_source']}). "
        f"Medians of {_ROUNDS.value} rounds of {_STEPS.value} steps.",
    ]
    table = _accelerator_table(figures)
    print("\n".join([*setting, "", *table]))
    if _OUTPUT.value != "none":
        record = records.new(
            f"this project's train step and its variants against PyTorch eager and torch.compile, {_MODEL.value}",
            figures=figures,
            packages=(*records.DEFAULT_PACKAGES, "torch"),
            setting=setting,
            xla_flags=os.environ.get("XLA_FLAGS", ""),
            jax_backend=jax.default_backend(),
            **measured_source,
        )
        record["machine"]["accelerator"] = f"{device.device_kind} ({jax.default_backend()})"
        default_path = os.path.join(records.RESULTS_DIR, f"peer_throughput_{_MODEL.value}_{jax.default_backend()}")
        print("wrote", records.write(record, _OUTPUT.value or default_path, [*setting, "", *table]))


def main(argv):
    del argv
    host_memory.set_up()  # As train.py runs; before JAX or PyTorch starts.
    accelerator_mode = _MODEL.value != "config_r"
    frameworks = _FRAMEWORKS.value or list(FRAMEWORKS if accelerator_mode else FRAMEWORKS[:2])
    if unknown := [name for name in frameworks if name not in FRAMEWORKS]:
        _exit_with_error(f"--frameworks: unknown {', '.join(unknown)}; choose among {', '.join(FRAMEWORKS)}.")
    torch = None
    if any(framework.startswith("torch") for framework in frameworks):
        # JAX would otherwise take most of the device's memory at start-up, leaving PyTorch little.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        try:
            import torch
        except ImportError:
            _exit_with_error("PyTorch is not installed; install this benchmark's extra: pip install -e '.[benchmark]'")
    quiet_library_logs()
    if accelerator_mode:
        _accelerator_main(torch, _VARIANTS.value or [step_variants.DEFAULT_VARIANT], frameworks)
    else:
        _config_r_main(torch, _VARIANTS.value or list(VARIANTS), frameworks)


if __name__ == "__main__":
    app.run(main)
