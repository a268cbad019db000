r"""The train step on one accelerator: speed, matmul dtypes, learning, attention kernels, the largest batch.

  PYTHONPATH=. python benchmarks/accelerator_check.py --sizes=base,big   # a GPU: ~13 minutes, copy ~2/3 of it
  PYTHONPATH=. python benchmarks/accelerator_check.py --sizes=tiny --memory_limit_mib=64   # a CPU: ~1 minute

docs/accelerator_check.md says what each section measures and how to read it; the step and the
sizes are benchmarks/accelerator_step.py's. It needs no data stack (TensorFlow, grain,
SentencePiece), only jax, flax, optax, orbax, absl, ml_collections and NumPy, so it runs on a
GPU machine that has JAX alone. The sections run per size in SECTIONS' order, the cheapest and
most needed first; one that fails records its error and the others go on. The record
(common/records.py) and its Markdown page are written again after every section, so that a run
stopped at its time limit keeps what it measured.
"""

import json
import os
import re
import statistics
import sys
import time
import traceback
from collections import Counter

import jax
import optax
from absl import app, flags

from benchmarks.accelerator_step import (
    Check,
    accelerator,
    compiled_memory,
    device_memory,
    is_out_of_memory,
    make_size,
    with_peak_learning_rate,
    without_regularisation,
)
from benchmarks.config_r import translation_loss_fn
from common import records
from input_pipeline import synthetic
from models.build import make_model

records.define_software_note_flag()

SECTIONS = ("step", "dtypes", "copy", "attention", "max_batch")
_SIZES = flags.DEFINE_list("sizes", ["base", "big"], "Model sizes to check, in turn: tiny, base, big.")
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), "Sections to run (docs/accelerator_check.md).")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps of the step and attention sections (after warm-up).")
_COPY_STEPS = flags.DEFINE_integer("copy_steps", 0, "Steps of the copy task (0: the size's own, tiny 300, else 1500).")
_ROWS = flags.DEFINE_integer("rows", 0, "Rows per batch (0: the size's own; base and big ~25k target positions).")
_ATTENTION_LENGTH = flags.DEFINE_integer(
    "attention_length", 0, "Row length of the attention section's batch (0: the size's own; 64 for the quick-start's)."
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

# The attention section's bars on its relative differences, in bfloat16's unit roundoff u = 2^-8: the two
# implementations round in different places (a fused kernel keeps its own running softmax), so a few u is
# rounding, where a wrong mask or scale differs by O(1).
BF16_UNIT_ROUNDOFF = 2.0**-8
BARS = {
    "loss_relative_difference": 1 * BF16_UNIT_ROUNDOFF,
    "grad_norm_relative_difference": 2 * BF16_UNIT_ROUNDOFF,
    "grad_difference_norm_relative": 8 * BF16_UNIT_ROUNDOFF,
}
COPY_PASS_FRACTION = 0.25
COPY_LAST_STEPS = 10  # The copy task's final NLL: their mean, as one step's is noisy.
MEMORY_MARGIN = 0.92  # Of the limit: room for what the compiled step's figures leave out (allocator slack).
POLICY_DOT = "bf16 x bf16 -> f32"


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
        "compiled_memory": compiled_memory(compiled),
        "device_memory": device_memory(),
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
    dots = [(f"{lhs} x {rhs} -> {result}", location) for lhs, rhs, result, location in _DOT.findall(stablehlo)]
    off_policy = Counter(f"{kind} at {names.get(where, where)}" for kind, where in dots if kind != POLICY_DOT)
    return {
        "dot_generals": len(dots),
        "by_dtypes": dict(Counter(kind for kind, _ in dots)),
        "off_policy": dict(off_policy),
        "all_on_policy": not off_policy,
        "custom_calls": dict(Counter(_CUSTOM_CALL.findall(stablehlo))),
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
    implementations = ("cudnn", "xla") if jax.default_backend() == "gpu" else ("explicit", "xla")
    params = check.state.params
    length = _ATTENTION_LENGTH.value or check.size.length
    batch = check.batch(check.size.rows, length)
    rng = jax.random.fold_in(check.base_rng, 0)
    results, gradients = {}, {}
    for implementation in implementations:
        config = check.config.copy_and_resolve_references()
        config.model.attention_implementation = implementation
        loss_fn = translation_loss_fn(config, make_model(config, config.tokenizer.vocab_size))

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
    return {
        "compared": f"{first} vs {second}",
        "length": length,
        "timing": f"forward and backward (no update), median of {_STEPS.value} calls",
        "dropout": check.config.model.dropout_rate,
        **{implementation: results[implementation] for implementation in implementations},
        **agreement,
        "bars": BARS,
        "agree": all(agreement[key] <= bar for key, bar in BARS.items()),  # NaN agrees with no bar.
    }


def _max_abs(tree) -> jax.Array:
    return max(jax.numpy.max(jax.numpy.abs(leaf)) for leaf in jax.tree.leaves(tree))


def max_batch_section(check: Check) -> dict:
    """The largest batch per device, predicted from two compiles' memory and checked by running there."""
    rows = check.size.rows
    small = compiled_memory(check.compile(rows)[1])["total_bytes"]
    lowered = check.lower(2 * rows)
    large = compiled_memory(lowered.compile())["total_bytes"]  # Compile only: not kept.
    per_row = (large - small) / rows
    fixed = small - per_row * rows
    figures = {"fitted_fixed_bytes": fixed, "fitted_bytes_per_row": per_row}
    limit = _MEMORY_LIMIT_MIB.value * 2**20 or device_memory()["bytes_limit"]
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
            if not is_out_of_memory(error):
                raise
            check.compiled.pop(candidate, None)
            check.reset_state()  # A failed step may have consumed the donated state.
            candidate //= 2
            continue
        return {
            **figures,
            "compile_s": compile_seconds,
            **check.speed(candidate, statistics.median(seconds[1:]), float(metrics[-1]["tokens"])),
            "compiled_memory": compiled_memory(compiled),
            "device_memory": device_memory(),
        }
    return {**figures, "error": "no batch fits"}


SECTION_FUNCTIONS = {
    "step": step_section,
    "dtypes": dtypes_section,
    "copy": copy_section,
    "attention": attention_section,
    "max_batch": max_batch_section,
}


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
    return [
        f"Device: {devices['device_kind']} ({devices['platform']}, {devices['device_count']} present, 1 used); "
        f"bf16 peak {devices['peak_bf16_flops_per_device'] / 1e12:.1f} TFLOP/s ({devices['peak_source']}); "
        f"CUDA: {devices['cuda']}. docs/accelerator_check.md says what each figure means.",
        "",
        "| size | section | result |",
        "|---|---|---|",
        *(
            f"| {size} | {section} | {summary(section, figures).replace('|', '/')} |"
            for size, sections in record["figures"].items()
            for section, figures in sections.items()
        ),
    ]


def _error(error: Exception) -> dict:
    return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


def main(argv):
    del argv
    if unknown := set(_SECTIONS.value) - set(SECTIONS):
        raise app.UsageError(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}.")
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
