r"""Decoding speed: this project's jitted search, cached and uncached, beside CTranslate2, in one process.

  python -m benchmarks.decode_speed --workdir=runs/quickstart    # CTranslate2 rows need the export extra

Decodes the same batch of real test sources (the bundled corpus, or the config's dataset) with
every setting, alternating in rounds so that a noisy neighbour affects all alike, and reports
the median time of a batch. This project decodes as translate.py does: greedy search for beam
1, beam search otherwise. Every hypothesis generates exactly `--length` tokens, so that all
settings do the same work: this project's search gets an <eos> id no token has, CTranslate2 a
minimum and maximum decoding length of `--length`. Settings, for each beam size: this project
with the key/value cache and without it (the whole prefix rerun at every step), and CTranslate2
in float32 and int8 on the same parameters, converted with export.py's code
(`exporting.to_ctranslate2`), its threads the machine's cores. With --workdir the run's latest
parameters and tokenizer are used; otherwise freshly initialised ones (decoding cost does not
depend on the values). With --profile_calls, this project's cached settings are also profiled
(benchmarks/xla_profile.py, by decoding's buckets: the model's matmuls, the search's top-k and
beam reordering, cache writes, ...), after the timed rounds. Writes a record (common/records.py).

  python -m benchmarks.decode_speed --workdir=runs/quickstart --test_set    # the whole test split

With --test_set, it decodes the whole test split instead, as translate.py and evaluation do
(`inference.translate_lines`: each sentence with its own budget, the run's batches), greedy and
with beam 4 at the run's alpha, in this project's 'auto' and float32 dtypes, beside CTranslate2
float32 and int8 on the run exported with export.py's code (--ct2_batch_size sentences a batch, the
machine's cores as threads; greedy at the one budget `max_decode_length`, beam search at each
sentence's budget, as benchmarks/export_agreement.py runs it), alternating in rounds; it reports
output subwords per second (with `</s>`) and BLEU of each. Then it times whole processes on the
same lines, start to end (import, load, compile, decode, write): translate.py against a
CTranslate2 script that loads the export and translates the file (--whole_processes).
"""

import dataclasses
import functools
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from benchmarks import hlo_buckets, test_set_speed, xla_profile
from common import records
from common.special_ids import BOS_ID, EOS_ID, PAD_ID
from exporting import support
from exporting.network import network_from_params
from input_pipeline import batching
from input_pipeline.corpus import load_corpus
from models.build import compute_dtype, make_model
from models.decoding import beam_search, generate
from models.search import argmax_token
from training.inference import load_trained_model
from training.reporting.logs import quiet_library_logs
from training.runtime import host_memory, sharding
from training.state import init_params

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A trained run whose latest parameters to use (optional).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Sentences per batch.")
_BEAM_SIZES = flags.DEFINE_list("beam_sizes", ["1", "4"], "Beam sizes to time (1 is greedy).")
_LENGTH = flags.DEFINE_integer("length", 64, "Tokens generated per hypothesis.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds; each decodes the batch once per setting.")
_ENGINES = flags.DEFINE_list(
    "engines", ["jax", "ctranslate2"], "jax (this project, cached and uncached), ctranslate2 (float32 and int8)."
)
_DTYPES = flags.DEFINE_list(
    "dtypes", ["auto", "float32"], "This project's compute dtypes (model.dtype values); uncached runs the first only."
)
_PROFILE_CALLS = flags.DEFINE_integer(
    "profile_calls", 0, "Batches to profile with each of this project's cached settings (0: no profile)."
)
_OUTPUT = flags.DEFINE_string("output", "", "Record path without suffix (default: decode_speed_<cpu kind>).")
_TEST_SET = flags.DEFINE_bool("test_set", False, "Decode the whole test split (needs --workdir); see above.")
_SOURCES = flags.DEFINE_string("sources", "data/libreoffice_help_en_de/test.en.gz", "--test_set's sources.")
_REFERENCES = flags.DEFINE_string("references", "data/libreoffice_help_en_de/test.de.gz", "--test_set's references.")
_CT2_BATCH_SIZE = flags.DEFINE_integer("ct2_batch_size", 32, "--test_set: CTranslate2's sentences a batch.")
_WHOLE_PROCESSES = flags.DEFINE_bool("whole_processes", True, "--test_set: also time whole processes.")

_NEVER = -1  # An <eos> id no token has: every hypothesis runs to --length.


@dataclasses.dataclass(frozen=True)
class Setting:
    engine: str  # "this project, bfloat16, cached", "CTranslate2, int8", ...
    beam_size: int
    decode: Callable[[], object]  # Decodes the batch once, blocking until done.
    hlo: Callable[[], str] | None = None  # The compiled module, where it is this project's.


def _sources(config, workdir: str | None, batch_size: int):
    """[batch_size, length] ids of test sentences (<eos> kept), and the tokenizer."""
    with tempfile.TemporaryDirectory() as scratch:
        corpus = load_corpus(config, workdir or scratch, ("test",), allow_training_tokenizer=workdir is None)
    sources = corpus.ids["test"].sources
    indices = np.arange(batch_size)
    length = int(min(sources.lengths[indices].max(), config.dataset.max_length))
    return batching.pad_ids(sources, indices, length, batch_size, keep_eos=True), corpus.tokenizer


def _jax_settings(model, params, inputs, beam_size: int, alpha: float, with_uncached: bool) -> list[Setting]:
    """This project's decoding as translate.py runs it: greedy (`generate`) for beam 1, else beam search."""
    settings = []
    special = dict(max_length=_LENGTH.value, bos_id=BOS_ID, eos_id=_NEVER, pad_id=PAD_ID)
    for use_cache in (True, False) if with_uncached else (True,):
        if beam_size == 1:
            search = functools.partial(generate, model=model, choose_token=argmax_token, use_cache=use_cache, **special)
        else:
            search = functools.partial(
                beam_search, model=model, beam_size=beam_size, alpha=alpha, use_cache=use_cache, **special
            )
        decode = jax.jit(search)
        engine = f"this project, {model.config.dtype}, {'cached' if use_cache else 'uncached'}"
        settings.append(
            Setting(
                engine,
                beam_size,
                lambda decode=decode: jax.block_until_ready(decode(params, inputs)),
                lambda decode=decode: decode.lower(params, inputs).compile().as_text(),
            )
        )
    return settings


def _ctranslate2_settings(translators: dict, pieces: list[list[str]], beam_size: int, alpha: float) -> list[Setting]:
    def decode(translator):
        results = translator.translate_batch(
            pieces,
            beam_size=beam_size,
            length_penalty=alpha,
            min_decoding_length=_LENGTH.value,
            max_decoding_length=_LENGTH.value,
        )
        lengths = {len(result.hypotheses[0]) for result in results}
        if lengths != {_LENGTH.value}:  # The same work as this project's rows, or the comparison is void.
            raise RuntimeError(f"CTranslate2 generated {sorted(lengths)} tokens, not {_LENGTH.value}.")

    return [
        Setting(f"CTranslate2, {weights}", beam_size, functools.partial(decode, translator))
        for weights, translator in translators.items()
    ]


def _ctranslate2_translators(model, params, tokenizer, scratch: str) -> dict:
    """CTranslate2 translators of the parameters: float32 and int8 weights."""
    import ctranslate2  # pylint: disable=g-import-not-at-top  (the export extra: only for these rows)

    from exporting import to_ctranslate2  # pylint: disable=g-import-not-at-top

    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size())]
    network = network_from_params(model.config, jax.device_get(params))
    translators = {}
    for weights, quantization in (("float32", None), ("int8", "int8")):
        folder = os.path.join(scratch, weights)
        os.makedirs(folder)
        # `save` quantizes the spec in place: one spec a weight type.
        to_ctranslate2.save(to_ctranslate2.transformer_spec_of(network, pieces), folder, quantization)
        translators[weights] = ctranslate2.Translator(folder, device="cpu", intra_threads=os.cpu_count())
    return translators


def main(argv):
    del argv
    if _TEST_SET.value:
        if not _WORKDIR.value:
            raise app.UsageError("--test_set needs --workdir: a trained run to translate with.")
        return test_set_speed.main(
            _WORKDIR.value,
            sources=_SOURCES.value,
            references=_REFERENCES.value,
            dtypes=_DTYPES.value,
            beam_sizes=[int(b) for b in _BEAM_SIZES.value],
            rounds=_ROUNDS.value,
            ct2_batch_size=_CT2_BATCH_SIZE.value,
            whole_processes=_WHOLE_PROCESSES.value,
            output=_OUTPUT.value,
        )
    config = _CONFIG.value
    host_memory.set_up()  # As train.py runs.
    quiet_library_logs()
    measured_source = records.source()
    inputs, tokenizer = _sources(config, _WORKDIR.value, _BATCH_SIZE.value)
    dtypes = list(dict.fromkeys(str(compute_dtype(dtype)) for dtype in _DTYPES.value))  # 'auto' may be float32.
    models = []
    for dtype in dtypes:
        dtype_config = config.copy_and_resolve_references()
        dtype_config.model.dtype = dtype
        models.append(make_model(dtype_config, tokenizer.vocab_size()))
    model = models[0]
    mesh = sharding.make_mesh()
    if _WORKDIR.value:
        params = load_trained_model(config, _WORKDIR.value).params
    else:
        params = sharding.replicate(init_params(model, jax.random.PRNGKey(config.seed)), mesh)
    # CTranslate2's sources: the same sentences as pieces, without the </s> it appends itself.
    pieces = [[tokenizer.id_to_piece(int(i)) for i in row if i not in (PAD_ID, EOS_ID)] for row in inputs]
    placed = sharding.shard_batch({"inputs": inputs}, mesh)["inputs"]

    beam_sizes = [int(b) for b in _BEAM_SIZES.value]
    with tempfile.TemporaryDirectory() as scratch:
        translators = {}
        if "ctranslate2" in _ENGINES.value:
            if importlib.util.find_spec("ctranslate2") is None:
                raise app.UsageError('--engines=ctranslate2 needs the export extra: pip install -e ".[export]".')
            support.check_exportable(config, "ctranslate2")
            translators = _ctranslate2_translators(model, params, tokenizer, scratch)
        settings = []
        for beam_size in beam_sizes:
            if "jax" in _ENGINES.value:
                for i, dtype_model in enumerate(models):
                    settings += _jax_settings(
                        dtype_model, params, placed, beam_size, config.eval.length_penalty, with_uncached=i == 0
                    )
            settings += _ctranslate2_settings(translators, pieces, beam_size, config.eval.length_penalty)

        # Seconds of each setting's calls, in order: the first (compiling, for this project) then a round each.
        seconds = [[] for _ in settings]
        for _ in range(1 + _ROUNDS.value):
            for setting, times in zip(settings, seconds):
                start = time.perf_counter()
                setting.decode()
                times.append(time.perf_counter() - start)
        baseline_engine = f"this project, {dtypes[0]}, cached"
        profiles = {
            setting.beam_size: xla_profile.profile(
                setting.decode, setting.hlo(), calls=_PROFILE_CALLS.value, buckets=hlo_buckets.DECODE_BUCKETS
            )
            for setting in settings
            if _PROFILE_CALLS.value and setting.engine == baseline_engine
        }

    batch, length = inputs.shape[0], _LENGTH.value
    rows = []
    for setting, (first_call, *timed) in zip(settings, seconds):
        median = statistics.median(timed)
        rows.append(
            {
                "engine": setting.engine,
                "beam_size": setting.beam_size,
                "first_call_seconds": first_call,
                "batch_seconds": median,
                "batch_seconds_all": timed,
                "output_tokens_per_second": batch * length / median,
                "hypothesis_tokens_per_second": batch * setting.beam_size * length / median,
            }
        )
    baseline = {row["beam_size"]: row["batch_seconds"] for row in rows if row["engine"] == baseline_engine}

    def versus_cached(row: dict) -> str:
        return f"{baseline[row['beam_size']] / row['batch_seconds']:.2f}x" if row["beam_size"] in baseline else "-"

    table = [
        f"A batch of {batch} test sentences (sources padded to {inputs.shape[1]} subwords), {length} generated "
        f"tokens per hypothesis, median of {_ROUNDS.value} rounds; this project on "
        f"{len(jax.devices())} {jax.default_backend()} device(s); "
        f"CTranslate2 with {os.cpu_count()} threads.",
        "",
        f"| engine | beam | first call s | batch s | output tokens/s | hypothesis tokens/s | vs {baseline_engine} |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {row['engine']} | {row['beam_size']} | {row['first_call_seconds']:.1f} | {row['batch_seconds']:.2f} "
            f"| {row['output_tokens_per_second']:,.0f} | {row['hypothesis_tokens_per_second']:,.0f} "
            f"| {versus_cached(row)} |"
            for row in rows
        ),
    ]
    if profiles:
        table += [
            "",
            f"Where {baseline_engine} decoding spends a batch's time ({_PROFILE_CALLS.value} profiled batches): "
            "CPU ms of XLA instructions over all threads.",
            "",
            "| operations | " + " | ".join(f"beam {beam_size}" for beam_size in profiles) + " |",
            "|---|" + "---:|" * len(profiles),
            *(
                f"| {label} | "
                + " | ".join(
                    f"{p['buckets'][label]['cpu_ms_per_call']:.0f} ({p['buckets'][label]['share']:.0%})"
                    for p in profiles.values()
                )
                + " |"
                for label, _ in hlo_buckets.DECODE_BUCKETS
            ),
            "| all instructions | "
            + " | ".join(f"{p['profiled_cpu_ms_per_call']:.0f}" for p in profiles.values())
            + " |",
            "| wall time a batch x threads (unprofiled) | "
            + " | ".join(f"{baseline[beam_size] * 1e3 * os.cpu_count():.0f}" for beam_size in profiles)
            + " |",
        ]
    record = records.new(
        "decoding speed: this project's search, cached and uncached, and CTranslate2",
        figures={
            "rows": rows,
            "batch": batch,
            "source_length": int(inputs.shape[1]),
            "length": length,
            "profiles": {f"beam {beam_size}": profile for beam_size, profile in profiles.items()},
        },
        packages=(*records.DEFAULT_PACKAGES, "ctranslate2"),
        compute_dtypes=dtypes,
        workdir=_WORKDIR.value,
        **measured_source,
    )
    path = _OUTPUT.value or os.path.join(records.RESULTS_DIR, f"decode_speed_{record['machine']['cpu_kind']}")
    print("\n".join(table))
    print("wrote", records.write(record, path, table))


if __name__ == "__main__":
    app.run(main)
