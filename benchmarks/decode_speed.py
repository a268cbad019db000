r"""Decoding speed with and without the key/value cache, in one process.

  python benchmarks/decode_speed.py --config=configs/quickstart.py --batch_size=32 \
      --beam_sizes=1,4 --length=64 [--workdir=runs/quickstart]

Decodes the same batch of real test sources (the bundled corpus, or the
config's dataset) with every beam size, cached and uncached, alternating in
rounds so that a noisy neighbour affects both alike, and reports the median
time of a batch. <eos> is disabled so that every run generates exactly
`--length` tokens per hypothesis: the cost per generated token at that target
length. With --workdir the run's trained parameters and tokenizer are used;
otherwise freshly initialised ones (decoding cost does not depend on the values).
"""

import functools
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from common.special_ids import BOS_ID, PAD_ID
from input_pipeline import batching
from input_pipeline.corpus import load_corpus
from models.build import compute_dtype, make_model
from models.decoding import beam_search
from training.reporting.logs import quiet_library_logs
from training.runtime import host_memory, sharding
from training.state import init_params

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A trained run whose latest parameters to use (optional).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Sentences per batch.")
_BEAM_SIZES = flags.DEFINE_list("beam_sizes", ["1", "4"], "Beam sizes to time (1 is greedy).")
_LENGTH = flags.DEFINE_integer("length", 64, "Tokens generated per hypothesis.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds; each decodes the batch once per setting.")

_NEVER = -1  # An <eos> id no token has: every hypothesis runs to --length.


def _sources(config, workdir: str | None, batch_size: int) -> tuple[np.ndarray, int]:
    """[batch_size, length] ids of test sentences, and the vocabulary size."""
    with tempfile.TemporaryDirectory() as scratch:
        corpus = load_corpus(config, workdir or scratch, ("test",), allow_training_tokenizer=workdir is None)
    sources = corpus.ids["test"].sources
    indices = np.arange(batch_size)
    length = int(min(sources.lengths[indices].max(), config.dataset.max_length))
    return batching.pad_ids(sources, indices, length, batch_size, keep_eos=True), corpus.tokenizer.vocab_size()


def main(argv):
    del argv
    config = _CONFIG.value
    host_memory.set_up()  # As train.py runs.
    quiet_library_logs()
    inputs, vocab_size = _sources(config, _WORKDIR.value, _BATCH_SIZE.value)
    model = make_model(config, vocab_size)
    mesh = sharding.make_mesh()
    if _WORKDIR.value:
        from training.inference import load_trained_model  # pylint: disable=g-import-not-at-top

        params = load_trained_model(config, _WORKDIR.value).params
    else:
        params = sharding.replicate(init_params(model, jax.random.PRNGKey(config.seed)), mesh)
    inputs = sharding.shard_batch({"inputs": inputs}, mesh)["inputs"]

    settings = {}
    for beam_size in map(int, _BEAM_SIZES.value):
        for use_cache in (True, False):
            decode = functools.partial(
                beam_search,
                model=model,
                beam_size=beam_size,
                alpha=0.6,
                max_length=_LENGTH.value,
                bos_id=BOS_ID,
                eos_id=_NEVER,
                pad_id=PAD_ID,
                use_cache=use_cache,
            )
            settings[(beam_size, use_cache)] = jax.jit(decode)

    compile_seconds, seconds = {}, {key: [] for key in settings}
    for key, decode in settings.items():
        start = time.perf_counter()
        jax.block_until_ready(decode(params, inputs))
        compile_seconds[key] = time.perf_counter() - start
    for _ in range(_ROUNDS.value):
        for key, decode in settings.items():
            start = time.perf_counter()
            jax.block_until_ready(decode(params, inputs))
            seconds[key].append(time.perf_counter() - start)

    batch, length = inputs.shape[0], _LENGTH.value
    print(
        f"batch {batch}, source length {inputs.shape[1]}, {length} generated tokens per hypothesis, "
        f"median of {_ROUNDS.value} rounds, {compute_dtype(config.model.dtype)}"
    )
    header = ("beam", "cache", "first call s", "batch s", "out tok/s", "hyp tok/s", "speed-up")
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, (4, 6, 12, 8, 10, 10, 8))))
    for (beam_size, use_cache), times in seconds.items():
        median = statistics.median(times)
        uncached = statistics.median(seconds[(beam_size, False)])
        print(
            f"{beam_size:>4} {'yes' if use_cache else 'no':>6} {compile_seconds[(beam_size, use_cache)]:>12.1f} "
            f"{median:>8.2f} {batch * length / median:>10.0f} {batch * beam_size * length / median:>10.0f} "
            f"{uncached / median:>7.1f}x"
        )


if __name__ == "__main__":
    app.run(main)
