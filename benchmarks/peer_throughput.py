r"""This project's train step against PyTorch's, in one process: config R on a CPU, Transformer-base on a GPU.

  pip install -e '.[benchmark]'   # PyTorch 2.13 (CPU), for this benchmark only
  python -m benchmarks.peer_throughput --variants=float32,bfloat16,bfloat16-dropout0 --rounds=5 --steps=10
  python -m benchmarks.peer_throughput --model=base --variants=default,prng_impl=unsafe_rbg --profile_steps=10

docs/speed.md says what each mode measures. Config R (benchmarks/config_r.py says what differs
between the two models): a step is a full update on 32 x 64 random ids with no padding, target
tokens/s = 32 * 64 / seconds per step; each round also times 2048^2 matmuls in JAX, the peaks
against which each row's model FLOPs give its MFU. `--model=base` (`tiny`: the same path on a
CPU, in seconds) times variants of this project's step (benchmarks/step_variants.py) against
PyTorch eager and `torch.compile` on the device, MFU over its dense bf16 peak.

The contenders alternate in rounds, so that a noisy neighbour affects all alike; figures are
medians over rounds, compile time the first step minus a median step. Both frameworks share
the process and its malloc, set up as train.py sets it (training/runtime/host_memory.py).
"""

import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import ml_collections
from absl import app, flags

from benchmarks import step_variants, xla_profile
from benchmarks.config_r import ProjectStep, TorchStep, config_r, random_batch
from common import records
from common.errors import UserInputError
from models.build import make_model
from training import flops, step_options
from training.reporting.logs import quiet_library_logs
from training.runtime import compilation_cache, host_memory

records.define_software_note_flag()

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
_MATMUL_SIZE = 2048
_MATMUL_REPEATS = 5  # Timed matmuls per dtype and round.


def _seconds_per_step(step: Callable[[], object], num_steps: int) -> float:
    start = time.perf_counter()
    for _ in range(num_steps):
        loss = step()
    float(loss)  # Waits for JAX's asynchronous dispatch to finish.
    return (time.perf_counter() - start) / num_steps


@dataclasses.dataclass
class _Measurements:
    first_step_seconds: dict[tuple[str, str], float]  # (variant, 'jax' or 'torch') -> seconds.
    tokens_per_second: dict[tuple[str, str], list[float]]  # (variant, framework) -> one per round.
    matmul_gflops: dict[str, list[float]]  # Operand dtype -> one per round.


def _runners(configs: dict[str, ml_collections.ConfigDict], frameworks: list[str]) -> dict:
    """(variant, framework) -> its step: each variant in this project, then in PyTorch; on a model other than
    config R, PyTorch's steps once, as the first variant's (the variants are this project's config fields)."""
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    runners = {}
    if "jax" in frameworks:
        runners = {(name, "jax"): ProjectStep(config, random_batch(config)) for name, config in configs.items()}
    for name in configs if _MODEL.value == "config_r" else [next(iter(configs))]:
        for framework, backend in (("torch", None), ("torch_compile", _COMPILE_BACKEND.value)):
            if framework in frameworks:
                config = configs[name]
                runners[name, framework] = TorchStep(config, random_batch(config), device, compile_backend=backend)
    return runners


def _measure(runners: dict, configs: dict, matmul_dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> _Measurements:
    """Warms up every step of `runners` ((variant, framework) -> step, of `configs[variant]`), then times them (and
    the matmuls of `matmul_dtypes`) in --rounds alternating rounds."""
    first_step_seconds = {}
    for key, step in runners.items():  # Untimed but the first step, whose time includes compiling a JAX step.
        first_step_seconds[key] = _seconds_per_step(step, 1)
        if _WARMUP_STEPS.value > 1:
            _seconds_per_step(step, _WARMUP_STEPS.value - 1)
    tokens_per_second = {key: [] for key in runners}
    matmul_gflops = {dtype: [] for dtype in matmul_dtypes}
    for _ in range(_ROUNDS.value):
        for dtype, values in matmul_gflops.items():
            values.append(flops.measured_matmul_peak(dtype, _MATMUL_SIZE, _MATMUL_REPEATS) / 1e9)
        for (name, framework), step in runners.items():
            seconds = _seconds_per_step(step, _STEPS.value)
            tokens_per_second[name, framework].append(_tokens_per_step(configs[name]) / seconds)
    return _Measurements(first_step_seconds, tokens_per_second, matmul_gflops)


def _tokens_per_step(config: ml_collections.ConfigDict) -> int:
    return config.per_device_batch_size * config.dataset.max_length


def _step_flops(config: ml_collections.ConfigDict) -> int:
    rows, length = config.per_device_batch_size, config.dataset.max_length
    return flops.train_step_flops(make_model(config, config.tokenizer.vocab_size).config, rows, length, length)


def _model_line(config: ml_collections.ConfigDict) -> str:
    """The model, batch and update that `config` trains, in words."""
    model = make_model(config, config.tokenizer.vocab_size).config
    return (
        f"d_model {model.d_model}, {model.num_heads} heads, d_ff {model.d_ff}, {model.num_encoder_layers}+"
        f"{model.num_decoder_layers} layers, {model.norm_placement}-LN, vocab {model.vocab_size:,}, batch "
        f"{config.per_device_batch_size} x {config.dataset.max_length} (no padding), dropout {model.dropout_rate}, "
        f"label smoothing {config.optimizer.label_smoothing}, Adam."
    )


def _figures(configs: dict[str, ml_collections.ConfigDict], measured: _Measurements) -> dict:
    """Per variant, medians over rounds: both frameworks' tokens/s, their ratio, model GFLOP/s, MFU; and every round."""
    config = next(iter(configs.values()))  # The variants differ in dtype and dropout: the same FLOPs.
    tokens, step_flops = _tokens_per_step(config), _step_flops(config)
    median = {key: statistics.median(values) for key, values in measured.tokens_per_second.items()}
    peak = {dtype: statistics.median(values) for dtype, values in measured.matmul_gflops.items()}
    variants = {}
    for name, variant_config in configs.items():
        ours, theirs = median.get((name, "jax"), math.nan), median.get((name, "torch"), math.nan)
        gflops = step_flops / (tokens / ours) / 1e9
        variants[name] = {
            "tokens_per_second": ours,
            "torch_tokens_per_second": theirs,
            "ratio": ours / theirs,
            "model_gflops_per_second": gflops,
            "mfu": gflops / peak[variant_config.model.dtype],
            "compile_seconds": measured.first_step_seconds.get((name, "jax"), math.nan) - tokens / ours,
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


def _table(figures: dict) -> list[str]:
    """The medians as a Markdown table, with the matmul peaks and compile times."""
    peak = figures["matmul_peak_gflops_per_second"]
    return [
        f"Matmul {_MATMUL_SIZE}^2 in JAX: float32 {peak['float32']:.0f} GFLOP/s, bfloat16 operands -> float32 "
        f"{peak['bfloat16']:.0f} GFLOP/s. Train step: {figures['step_gflop']:.1f} GFLOP (model FLOPs, "
        "training/flops.py).",
        "",
        "| variant | this project tok/s | PyTorch tok/s | ratio | JAX GFLOP/s | MFU | compile s |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {name} | {row['tokens_per_second']:,.0f} | {row['torch_tokens_per_second']:,.0f} | {row['ratio']:.2f} "
            f"| {row['model_gflops_per_second']:.0f} | {row['mfu']:.0%} | {row['compile_seconds']:.1f} |"
            for name, row in figures["variants"].items()
        ),
    ]


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
    return {"peak_flops_per_second": peak, "peak_source": peak_source, "contenders": contenders, "profiles": profiles}


def _accelerator_table(figures: dict) -> list[str]:
    """The contenders as a Markdown table, then each profiled variant's buckets."""
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
    for name, profile in figures["profiles"].items():
        lines += [
            "",
            f"Where {name}'s step spends its time, by kind of kernel:",
            "",
            *xla_profile.bucket_table(profile),
        ]
    return lines


def _exit_with_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)  # As the entry points exit on a user's error.


def _print_and_record(
    measurement: str, figures: dict, setting: list[str], table: list[str], path: str, **fields
) -> None:
    """Prints the setting and table; unless --output=none, writes them and `figures` as the record at `path`."""
    print("\n".join([*setting, "", *table]))
    if _OUTPUT.value != "none":
        packages = (*records.DEFAULT_PACKAGES, "torch")
        record = records.new(measurement, figures=figures, packages=packages, setting=setting, **fields)
        print("wrote", records.write(record, _OUTPUT.value or path, [*setting, "", *table]))


def _config_r_main(torch_module, variants: list[str], frameworks: list[str]) -> None:
    if unknown := [name for name in variants if name not in VARIANTS]:
        _exit_with_error(f"--variants: unknown {', '.join(unknown)}; choose among {', '.join(VARIANTS)}.")
    compilation_cache.enable("")  # Compile times as on a cold start.
    configs = {name: config_r(*VARIANTS[name]) for name in variants}
    measured_source = records.source()
    figures = _figures(configs, _measure(_runners(configs, frameworks), configs))
    torch_threads = (
        f"PyTorch {torch_module.__version__} (default threads: {torch_module.get_num_threads()} intra-op, "
        f"{torch_module.get_num_interop_threads()} inter-op)"
        if torch_module
        else "PyTorch not timed"
    )
    setting = [
        f"Config R: {_model_line(next(iter(configs.values())))}",
        f"JAX {jax.__version__} ({jax.default_backend()}), {torch_threads}; {os.cpu_count()} CPUs visible.",
    ]
    _print_and_record(
        "this project's train step against PyTorch's, config R",
        figures,
        setting,
        _table(figures),
        os.path.join(records.RESULTS_DIR, f"peer_throughput_{records.machine()['cpu_kind']}"),
        rounds=_ROUNDS.value,
        steps_per_round=_STEPS.value,
        **measured_source,
    )


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
        runners = _runners(configs, frameworks)
        measured = _measure(runners, configs, matmul_dtypes=())
        profiles = {
            name: xla_profile.profile(lambda step=step: float(step()), step.compiled_hlo(), calls=_PROFILE_STEPS.value)
            for (name, framework), step in runners.items()
            if framework == "jax" and _PROFILE_STEPS.value
        }
        runners.clear()  # Frees the device for the flag sets' processes.
        arguments = [f"--model={_MODEL.value}", f"--variants={step_variants.DEFAULT_VARIANT}", "--frameworks=jax"]
        arguments += [f"--{flag.name}={flag.value}" for flag in (_ROUNDS, _STEPS, _WARMUP_STEPS)]
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
        f"configs/default.py's model ({_MODEL.value}) in {config.model.dtype}: {_model_line(config)}",
        f"JAX {jax.__version__} on {device.device_kind} ({jax.default_backend()}); "
        + (f"PyTorch {torch_module.__version__} (autocast bf16, fused Adam on a GPU)." if torch_module else "")
        + f" MFU over {figures['peak_flops_per_second'] / 1e12:.1f} TFLOP/s ({figures['peak_source']}). "
        f"Medians of {_ROUNDS.value} rounds of {_STEPS.value} steps.",
    ]
    _print_and_record(
        f"this project's train step and its variants against PyTorch eager and torch.compile, {_MODEL.value}",
        figures,
        setting,
        _accelerator_table(figures),
        os.path.join(records.RESULTS_DIR, f"peer_throughput_{_MODEL.value}_{jax.default_backend()}"),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        jax_backend=jax.default_backend(),
        machine={**records.machine(), "accelerator": f"{device.device_kind} ({jax.default_backend()})"},
        **measured_source,
    )


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
