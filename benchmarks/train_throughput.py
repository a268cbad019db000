r"""Training throughput on a config's real data: packed rows vs length buckets, and compute dtypes.

  python benchmarks/train_throughput.py --config=configs/quickstart.py \
      --batchings=bucketed,packed --steps=30 --rounds=3

For each (batching, dtype), in one process:

- `packed`: the training stream as train.py runs it (input_pipeline/streaming.py: grain, packed
  rows of dataset.max_length, prefetched while the step runs);
- `bucketed`: the length buckets translation trained on before packing: the whole train split
  tokenized in memory, batches of one bucket padded to its length (`batching.TrainBatches`,
  about per_device_batch_size x max_length padded tokens each; one compiled step per bucket);
- `replayed`: the packed stream's first `--steps` batches, taken once and replayed from memory:
  the packed step without the stream's reading, tokenizing and packing on the same cores.

Each variant first compiles its step shapes (compile time: the first calls minus ordinary
steps), then runs `--steps` steps per round; variants alternate in rounds so that a noisy
neighbour affects all alike, every other round in reverse order so that a machine that speeds
up or slows down over the run favours none. The steps run as train.py's loop runs them: the
next step's batch is taken, placed and the step dispatched while the one before runs, so that
the host's work between steps overlaps the device's. A step is timed from the end of the one
before (the first of a round from asking for its batch) to having its metrics, so a data
pipeline that cannot keep up (or takes the device's CPU) shows. Reported per variant:
real (non-pad) target tokens/s of each round (its tokens over its seconds: buckets of different
lengths average out) and their median over rounds, the real share of the target positions, the
step time per target position (median over rounds: tokens/s = real share / time per position,
so a ratio of two rows splits into what padding and what the step's cost per position made of
it), and the process's kernel CPU time per step (faulting in the step's fresh buffers, see
training/runtime/host_memory.py, and on a shared VM occasional longer stalls). Then, per step shape, the
median step time and its cost per position. Last, the ratio of packed to bucketed tokens/s:
the median over rounds of each round's ratio (within a round the two variants run one after the
other, so a round's ratio is free of the machine's slower drifts) and their range; then the
ratio of the variants' medians split into its factors: the real shares' ratio (padding), the
buckets' cost per position over the replayed rows' (the step), and the replayed rows' over the
live stream's (the stream); and the last two again within rounds, as the medians of each round's
factor (the variants' medians come from different rounds, minutes apart on a machine that drifts).

With `--rounds_from_stdin`, benchmarks/host_allocators.py runs the rounds of several such
processes, one per host allocator, in turn.
"""

import collections
import itertools
import json
import resource
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from input_pipeline import datasets
from input_pipeline.corpus import load_corpus
from models.build import compute_dtype, make_model
from training.loop import configured_train_step, initial_state, state_shardings
from training.optimizer import make_optimizer
from training.runtime import compilation_cache, host_memory, sharding
from training.tasks import base
from training.tasks.translation import TranslationTask

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Config file.")
_BATCHINGS = flags.DEFINE_list(
    "batchings", ["bucketed", "packed"], "Training batches to compare: bucketed, packed, replayed."
)
_DTYPES = flags.DEFINE_list("dtypes", [], "Compute dtypes to compare (default: the config's model.dtype).")
_STEPS = flags.DEFINE_integer("steps", 30, "Timed steps per variant and round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds; each runs every variant once.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where data and tokenizer are prepared (default: a temporary folder).")
_ROUNDS_FROM_STDIN = flags.DEFINE_bool(
    "rounds_from_stdin",
    False,
    "Instead of --rounds, a round for each line read from stdin until it closes; each round's real target "
    "tokens/s printed as a line of JSON (benchmarks/host_allocators.py).",
)
_MAX_WARMUP_STEPS = 200


def _bucketed_batches(config, workdir: str, corpus, mesh) -> base.TrainBatchIterator:
    """The whole train split tokenized in memory, in length-bucketed batches."""
    dataset = config.dataset
    builder = datasets.make_builder(dataset, workdir, required_splits=(dataset.train_split,))
    text = datasets.load_text_pairs(builder, dataset.train_split, dataset.source_lang, dataset.target_lang)
    ids = datasets.filter_by_length(datasets.tokenize(text, corpus.tokenizer), dataset.max_length)
    return base.bucketed_train_batches(config, ids, mesh, None)


class _Replayed:
    """A stream's first `count` batches, taken once, then returned again and again from memory."""

    def __init__(self, stream: base.TrainBatchIterator, count: int):
        batches = [next(stream) for _ in range(count)]
        stream.close()
        self._batches = itertools.cycle(batches)

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._batches)

    def close(self) -> None:
        pass


def _runner(config, workdir, corpus, mesh, batching: str, dtype: str) -> dict:
    """The train step as the training loop compiles it, for `dtype`, and its batches."""
    config = config.copy_and_resolve_references()
    config.model.dtype = dtype
    model = make_model(config, corpus.tokenizer.vocab_size())
    tx, schedule = make_optimizer(config.optimizer, d_model=config.model.d_model)
    shardings = state_shardings(config, model, tx, mesh)
    task = TranslationTask()
    train_step = configured_train_step(config, task.loss_fn(config, model), tx, schedule, mesh, shardings)
    if batching == "packed":
        batches = task.train_batches(config, corpus, mesh, None, 0)
    elif batching == "replayed":
        batches = _Replayed(task.train_batches(config, corpus, mesh, None, 0), _STEPS.value)
    elif batching == "bucketed":
        batches = _bucketed_batches(config, workdir, corpus, mesh)
    else:
        raise app.UsageError(f"--batchings: unknown {batching!r}; choose bucketed, packed or replayed.")
    state = train_step.enter(initial_state(config, model, tx, shardings))
    return {"train_step": train_step, "batches": batches, "state": state, "shapes": set(), "first_calls": 0.0}


def _dispatch_step(runner: dict, index: int) -> tuple[dict, int, tuple]:
    """Takes the next batch and dispatches its step: (its metrics, not waited for; target positions; shape)."""
    batch = next(runner["batches"])
    shape = batch["targets"].shape
    placed = runner["train_step"].place_batch(batch)
    runner["state"], metrics = runner["train_step"].run(runner["state"], placed, jax.random.PRNGKey(index))
    return metrics, int(np.prod(shape)), shape


def _run_steps(runner: dict, num_steps: int) -> list[tuple[float, float, int, tuple]]:
    """Runs `num_steps` steps; each gives (seconds, real target tokens, target positions, batch shape).

    Step i + 1 is dispatched before waiting for step i (the module docstring), as train.py's loop
    does. Waiting for each step before taking the next batch would put the host's batch placement
    and dispatch between steps, and the stream's thread, which starts a batch as one is taken,
    would slow the placing.
    """
    results = []
    in_flight = None  # The step dispatched last.
    last_end = time.perf_counter()
    for index in range(num_steps + 1):
        dispatched = _dispatch_step(runner, index) if index < num_steps else None
        if in_flight is not None:
            metrics, positions, shape = in_flight
            tokens = float(metrics["tokens"])  # Waits for the step.
            end = time.perf_counter()
            results.append((end - last_end, tokens, positions, shape))
            last_end = end
        in_flight = dispatched
    return results


def _warm_up(runner: dict, num_shapes: int) -> None:
    """Compiles every step shape: steps until `num_shapes` shapes have been seen (their first calls timed)."""
    for _ in range(_MAX_WARMUP_STEPS):
        ((seconds, _, _, shape),) = _run_steps(runner, 1)
        if shape not in runner["shapes"]:
            runner["shapes"].add(shape)
            runner["first_calls"] += seconds
        if len(runner["shapes"]) == num_shapes:
            return


def main(argv):
    del argv
    config = _CONFIG.value
    host_memory.set_up()  # As train.py runs.
    compilation_cache.enable("")  # Compile times as on a cold start.
    mesh = sharding.make_mesh(config.mesh)
    dtypes = [compute_dtype(dtype) for dtype in _DTYPES.value or [config.model.dtype]]  # 'auto' named.
    with tempfile.TemporaryDirectory() as temporary:
        workdir = _WORKDIR.value or temporary
        corpus = load_corpus(config, workdir, (config.dataset.train_split,), allow_training_tokenizer=True)
        runners = {
            (batching, dtype): _runner(config, workdir, corpus, mesh, batching, dtype)
            for batching in _BATCHINGS.value
            for dtype in dtypes
        }
        for (batching, _), runner in runners.items():
            _warm_up(runner, len(config.dataset.bucket_boundaries) if batching == "bucketed" else 1)
        timed = {variant: [] for variant in runners}  # Per round: its steps' results.
        kernel_seconds = dict.fromkeys(runners, 0.0)
        order = list(runners.items())
        for round_index, _ in enumerate(sys.stdin if _ROUNDS_FROM_STDIN.value else range(_ROUNDS.value)):
            for variant, runner in order[::-1] if round_index % 2 else order:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
                timed[variant].append(_run_steps(runner, _STEPS.value))
                kernel_seconds[variant] += resource.getrusage(resource.RUSAGE_SELF).ru_stime - before
            if _ROUNDS_FROM_STDIN.value:
                figures = {" ".join(variant): _tokens_per_second(rounds[-1]) for variant, rounds in timed.items()}
                print(json.dumps({"round": round_index, "tokens_per_second": figures}), flush=True)
        for runner in runners.values():
            runner["batches"].close()

    _report(runners, timed, kernel_seconds)


def _figures(runner: dict, rounds: list, kernel_seconds: float) -> dict:
    """A variant's summary figures (the module docstring) from its rounds of (seconds, tokens, positions, shape)."""
    results = [result for round_results in rounds for result in round_results]
    median_seconds = statistics.median(s for s, _, _, _ in results)
    round_tokens_per_second = [_tokens_per_second(round_results) for round_results in rounds]
    round_seconds_per_position = [
        sum(s for s, _, _, _ in round_results) / sum(p for _, _, p, _ in round_results) for round_results in rounds
    ]
    return {
        "shapes": len(runner["shapes"]),
        "compile_seconds": runner["first_calls"] - len(runner["shapes"]) * median_seconds,
        "round_tokens_per_second": round_tokens_per_second,
        "tokens_per_second": statistics.median(round_tokens_per_second),
        "real_share": sum(t for _, t, _, _ in results) / sum(p for _, _, p, _ in results),
        "round_seconds_per_position": round_seconds_per_position,
        "seconds_per_position": statistics.median(round_seconds_per_position),
        "kernel_per_step": kernel_seconds / len(results),
    }


def _tokens_per_second(round_results: list) -> float:
    """A round's real target tokens over its seconds, from its steps' (seconds, tokens, positions, shape)."""
    return sum(t for _, t, _, _ in round_results) / sum(s for s, _, _, _ in round_results)


def _report(runners: dict, timed: dict, kernel_seconds: dict) -> None:
    """Prints each variant's figures, each step shape's, and the packed/bucketed ratio's factors."""
    figures = {variant: _figures(runners[variant], timed[variant], kernel_seconds[variant]) for variant in timed}
    print(
        f"{'batches':<9} {'dtype':<9} {'shapes':>6} {'compile s':>9} {'real tgt tok/s':>14} {'real share':>10} "
        f"{'us/position':>11} {'kernel s/step':>13}  (median of {len(next(iter(timed.values())))} rounds of "
        f"{_STEPS.value} steps)"
    )
    baseline = next(iter(figures.values()))["tokens_per_second"]
    for (batching, dtype), f in figures.items():
        print(
            f"{batching:<9} {dtype:<9} {f['shapes']:>6} {f['compile_seconds']:>9.1f} {f['tokens_per_second']:>14.0f} "
            f"{f['real_share']:>10.1%} {f['seconds_per_position'] * 1e6:>11.1f} {f['kernel_per_step']:>13.2f}  "
            f"{f['tokens_per_second'] / baseline:.2f}x the first row"
        )
    print()
    print(
        f"{'batches':<9} {'dtype':<9} {'shape':>10} {'steps':>5} {'median ms':>9} {'us/position':>11} "
        f"{'real share':>10}"
    )
    for (batching, dtype), rounds in timed.items():
        by_shape = collections.defaultdict(list)
        for seconds, tokens, positions, shape in (result for round_results in rounds for result in round_results):
            by_shape[shape].append((seconds, tokens, positions))
        for shape, steps in sorted(by_shape.items(), key=lambda item: item[0][1]):
            median_seconds = statistics.median(s for s, _, _ in steps)
            real_share = sum(t for _, t, _ in steps) / sum(p for _, _, p in steps)
            print(
                f"{batching:<9} {dtype:<9} {'x'.join(map(str, shape)):>10} {len(steps):>5} "
                f"{median_seconds * 1e3:>9.0f} {median_seconds / steps[0][2] * 1e6:>11.1f} {real_share:>10.1%}"
            )
    for dtype in dict.fromkeys(dtype for _, dtype in figures):
        if ("bucketed", dtype) in figures and ("packed", dtype) in figures:
            _print_ratio_factors(figures, dtype)


def _print_ratio_factors(figures: dict, dtype: str) -> None:
    """packed / bucketed tokens/s: the median of the rounds' ratios, then the medians' ratio = real shares' ratio x
    costs per position's ratio, the cost split by `replayed` into the step's and the stream's."""
    bucketed, packed = figures[("bucketed", dtype)], figures[("packed", dtype)]
    round_ratios = [p / b for p, b in zip(packed["round_tokens_per_second"], bucketed["round_tokens_per_second"])]
    print(
        f"\n{dtype}: packed / bucketed {statistics.median(round_ratios):.3f}x (median of the {len(round_ratios)} "
        f"rounds' ratios, which range over {min(round_ratios):.3f}-{max(round_ratios):.3f}x)"
    )
    padding = packed["real_share"] / bucketed["real_share"]
    cost = bucketed["seconds_per_position"] / packed["seconds_per_position"]
    print(
        f"{'':>{len(dtype)}}  medians' ratio {packed['tokens_per_second'] / bucketed['tokens_per_second']:.3f}x "
        f"~ padding {padding:.3f}x * cost per position {cost:.3f}x"
    )
    replayed = figures.get(("replayed", dtype))
    if replayed:
        step = bucketed["seconds_per_position"] / replayed["seconds_per_position"]
        stream = replayed["seconds_per_position"] / packed["seconds_per_position"]
        print(
            f"{'':>{len(dtype)}}  cost per position {cost:.3f}x = the step's {step:.3f}x * the stream's {stream:.3f}x"
        )
        # The medians above come from different rounds; within a round the variants ran a minute apart.
        steps = _round_cost_ratios(bucketed, replayed)
        streams = _round_cost_ratios(replayed, packed)
        print(
            f"{'':>{len(dtype)}}  within rounds (medians of the rounds' factors): the step's "
            f"{statistics.median(steps):.3f}x ({min(steps):.3f}-{max(steps):.3f}), the stream's "
            f"{statistics.median(streams):.3f}x ({min(streams):.3f}-{max(streams):.3f})"
        )


def _round_cost_ratios(first: dict, second: dict) -> list[float]:
    """Each round's cost per position of the `first` variant over that of the `second`."""
    return [a / b for a, b in zip(first["round_seconds_per_position"], second["round_seconds_per_position"])]


if __name__ == "__main__":
    app.run(main)
