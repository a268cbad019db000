r"""Train-step throughput on a config's real batches: compile time, steps/s, target tokens/s.

  python benchmarks/train_throughput.py --config=configs/quickstart.py \
      --dtypes=float32,bfloat16 --steps=40

For each compute dtype, in one process: compiles the step for every bucket
shape (reporting the time), then times `--steps` steps on the training stream
and reports the median step time after warm-up. Dtypes alternate in rounds so
that a noisy neighbour affects both alike.
"""

import statistics
import tempfile
import time

import jax
from absl import app, flags
from ml_collections import config_flags

from input_pipeline import batching
from input_pipeline.corpus import load_corpus
from training import sharding
from training.loop import batch_sizes
from training.optimizer import make_optimizer
from training.state import create_train_state, make_model
from training.steps import jit_train_step

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Config file.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Compute dtypes to compare.")
_STEPS = flags.DEFINE_integer("steps", 40, "Timed steps per dtype and round.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds; each runs every dtype once.")


def _runner(config, corpus, dtype, mesh):
    config = config.copy_and_resolve_references()
    config.model.dtype = dtype
    model = make_model(config, corpus.tokenizer.vocab_size())
    tx, schedule = make_optimizer(config.optimizer)
    state = sharding.replicate(create_train_state(model, tx, config.seed), mesh)
    step_fn = jit_train_step(model, tx, schedule, config.optimizer.label_smoothing)
    sizes = batch_sizes(config, config.per_device_batch_size, mesh)
    stream = batching.TrainBatches(
        corpus.ids[config.dataset.train_split], config.dataset.bucket_boundaries, sizes, config.seed
    )
    # Compile every bucket shape up front, timing it.
    compile_seconds = 0.0
    for length, size in sizes.items():
        example = batching.pad_batch(corpus.ids[config.dataset.train_split], [0], length, size)
        start = time.perf_counter()
        step_fn.lower(state, sharding.shard_batch(example, mesh), state.rng).compile()
        compile_seconds += time.perf_counter() - start
    return {"state": state, "step_fn": step_fn, "stream": stream, "compile_seconds": compile_seconds}


def _time_steps(runner, mesh, num_steps):
    """Runs `num_steps` steps; returns their seconds, target tokens and padded lengths."""
    step_seconds, tokens, lengths = [], [], []
    state = runner["state"]
    for i in range(num_steps):
        batch = next(runner["stream"])
        lengths.append(batch["inputs"].shape[1])
        batch = sharding.shard_batch(batch, mesh)
        start = time.perf_counter()
        state, metrics = runner["step_fn"](state, batch, jax.random.fold_in(state.rng, i))
        tokens.append(float(metrics["tokens"]))  # Waits for the step.
        step_seconds.append(time.perf_counter() - start)
    runner["state"] = state
    return step_seconds, tokens, lengths


def main(argv):
    del argv
    config = _CONFIG.value
    mesh = sharding.make_mesh()
    with tempfile.TemporaryDirectory() as workdir:
        splits = (config.dataset.train_split,)
        corpus = load_corpus(config, workdir, splits, allow_training_tokenizer=True)
        runners = {dtype: _runner(config, corpus, dtype, mesh) for dtype in _DTYPES.value}
        # Warm up until every bucket shape has run once (jit compiles it again on first call).
        for runner in runners.values():
            seen = set()
            while len(seen) < len(config.dataset.bucket_boundaries):
                seen.add(_time_steps(runner, mesh, 1)[2][0])
        timings = {dtype: ([], []) for dtype in runners}
        for _ in range(_ROUNDS.value):
            for dtype, runner in runners.items():
                seconds, tokens, _ = _time_steps(runner, mesh, _STEPS.value)
                timings[dtype][0].extend(seconds)
                timings[dtype][1].extend(tokens)

    print(
        f"{'dtype':<10} {'compile s':>10} {'steps/s':>8} {'tgt tok/s':>10}  (median of {_ROUNDS.value * _STEPS.value} steps)"
    )
    baseline = None
    for dtype, (seconds, tokens) in timings.items():
        median_step = statistics.median(seconds)
        tokens_per_second = statistics.median(t / s for t, s in zip(tokens, seconds))
        baseline = baseline or median_step
        print(
            f"{dtype:<10} {runners[dtype]['compile_seconds']:>10.1f} {1 / median_step:>8.2f} "
            f"{tokens_per_second:>10.0f}  speed-up vs {_DTYPES.value[0]}: {baseline / median_step:.2f}x"
        )


if __name__ == "__main__":
    app.run(main)
