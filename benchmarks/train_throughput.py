r"""Train-step throughput on a config's real batches: compile time, steps/s, target tokens/s.

  python benchmarks/train_throughput.py --config=configs/quickstart.py \
      --dtypes=float32,bfloat16 --steps=40

For each compute dtype, in one process: compiles the step for every bucket
shape (compile time = first calls minus ordinary steps), then times `--steps` steps on the training stream
and reports the median step time after warm-up. Dtypes alternate in rounds so
that a noisy neighbour affects both alike. The step is compiled as the training
loop compiles it: config.step_compilation over config.mesh, with
config.grad_accumulation_steps (override any of them, e.g. --config.mesh.fsdp=2).
"""

import statistics
import tempfile
import time

import jax
from absl import app, flags
from ml_collections import config_flags

from input_pipeline import batching
from input_pipeline.corpus import load_corpus
from models.build import make_model
from training import sharding
from training.loop import TranslationTask, batch_sizes, configured_train_step, initial_state, state_shardings
from training.optimizer import make_optimizer

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Config file.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Compute dtypes to compare.")
_STEPS = flags.DEFINE_integer("steps", 40, "Timed steps per dtype and round.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds; each runs every dtype once.")
_MAX_WARMUP_STEPS = 200


def _runner(config, corpus, dtype, mesh):
    """The train step as the training loop compiles it (config.step_compilation, config.mesh), for `dtype`."""
    config = config.copy_and_resolve_references()
    config.model.dtype = dtype
    model = make_model(config, corpus.tokenizer.vocab_size())
    tx, schedule = make_optimizer(config.optimizer)
    shardings = state_shardings(config, model, tx, mesh)
    state = initial_state(config, model, tx, shardings)
    loss_fn = TranslationTask().loss_fn(config, model)
    train_step = configured_train_step(config, loss_fn, tx, schedule, mesh, shardings)
    sizes = batch_sizes(config, config.per_device_batch_size, mesh, config.grad_accumulation_steps)
    stream = batching.TrainBatches(
        corpus.ids[config.dataset.train_split], config.dataset.bucket_boundaries, sizes, config.seed
    )
    return {"state": train_step.enter(state), "train_step": train_step, "stream": stream, "first_call_seconds": 0.0}


def _time_steps(runner, num_steps):
    """Runs `num_steps` steps; returns their seconds, target tokens and padded lengths."""
    step_seconds, tokens, lengths = [], [], []
    state = runner["state"]
    for i in range(num_steps):
        batch = next(runner["stream"])
        lengths.append(batch["inputs"].shape[1])
        batch = runner["train_step"].place_batch(batch)
        start = time.perf_counter()
        state, metrics = runner["train_step"].run(state, batch, jax.random.PRNGKey(i))
        tokens.append(float(metrics["tokens"]))  # Waits for the step.
        step_seconds.append(time.perf_counter() - start)
    runner["state"] = state
    return step_seconds, tokens, lengths


def main(argv):
    del argv
    config = _CONFIG.value
    mesh = sharding.make_mesh(config.mesh)
    with tempfile.TemporaryDirectory() as workdir:
        splits = (config.dataset.train_split,)
        corpus = load_corpus(config, workdir, splits, allow_training_tokenizer=True)
        runners = {dtype: _runner(config, corpus, dtype, mesh) for dtype in _DTYPES.value}
        # Warm up: the first step of each bucket shape compiles it (timed, with the step).
        for runner in runners.values():
            seen = set()
            for _ in range(_MAX_WARMUP_STEPS):
                seconds, _, lengths = _time_steps(runner, 1)
                if lengths[0] not in seen:
                    seen.add(lengths[0])
                    runner["first_call_seconds"] += seconds[0]
                if len(seen) == len(config.dataset.bucket_boundaries):
                    break
        timings = {dtype: ([], []) for dtype in runners}
        for _ in range(_ROUNDS.value):
            for dtype, runner in runners.items():
                seconds, tokens, _ = _time_steps(runner, _STEPS.value)
                timings[dtype][0].extend(seconds)
                timings[dtype][1].extend(tokens)

    num_timed = _ROUNDS.value * _STEPS.value
    print(f"{'dtype':<10} {'compile s':>10} {'steps/s':>8} {'tgt tok/s':>10}  (median of {num_timed} steps)")
    baseline = None
    for dtype, (seconds, tokens) in timings.items():
        median_step = statistics.median(seconds)
        tokens_per_second = statistics.median(t / s for t, s in zip(tokens, seconds))
        compile_seconds = runners[dtype]["first_call_seconds"] - len(config.dataset.bucket_boundaries) * median_step
        baseline = baseline or median_step
        print(
            f"{dtype:<10} {compile_seconds:>10.1f} {1 / median_step:>8.2f} {tokens_per_second:>10.0f}"
            f"  speed-up vs {_DTYPES.value[0]}: {baseline / median_step:.2f}x"
        )


if __name__ == "__main__":
    app.run(main)
