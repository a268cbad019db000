"""Shared fixtures: a small slice of the bundled corpus, the tiny config, and a tiny run trained once per test run."""

import contextlib
import fcntl
import functools
import gzip
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import types
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache
from tensorboardX.proto import event_pb2
from without_tensorflow import finders_without_tensorflow

from common.compile_events import BACKEND_COMPILE_EVENT, compile_events
from input_pipeline.tokenizer import train_tokenizer
from models import TransformerConfig
from training.runtime import compilation_cache as project_compilation_cache

# Every process of the test run compiles fast rather than well: the suite is mostly compiling small programs.
# LLVM's code generation unoptimized (~1.6x as fast), and XLA:CPU's older fusion emitters, which write a fusion's
# LLVM IR directly, not through MLIR as its newer ones do (a decoding program compiles in about half the time, a
# train step in two thirds; the steps run 23-31% slower). The HLO is the same; the kernels are slower and may round
# differently (fewer fused multiply-adds), within the float32 bounds the tests use. JAX reads XLA_FLAGS once,
# when its backend starts (after the imports, before the first test); the entry points the tests start inherit
# it (`entry_point_env`), unless a test sets flags of its own.
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if FAST_COMPILE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAGS}".strip()

# OpenMP's threads (CTranslate2's and PyTorch's, in the processes the tests start; CTranslate2's in this one) sleep
# while they wait for work instead of spinning: the two workers of a test run share two cores, and CTranslate2
# translating beside a busy process spun several times slower. Read when an OpenMP runtime starts, so PyTorch's in
# this process (loaded by the imports above) keeps spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED_CORPUS = os.path.join(REPO_ROOT, "data", "libreoffice_help_en_de")


# A tiny model for unit tests; vary it with dataclasses.replace.
TINY_MODEL = TransformerConfig(
    vocab_size=50,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    dropout_rate=0.1,
    attention_dropout_rate=0.1,
    positional_encoding='sinusoidal',
    max_len=16,
    norm_placement='post',
    tie_embeddings=True,
    dtype='float32',
)


def bundled_tokenizer(path: str, vocab_size: int, lines_per_language: int = 300):
    """A SentencePiece model trained on the first lines of the bundled corpus's training split, both languages."""
    sentences = []
    for lang in ("en", "de"):
        with gzip.open(os.path.join(BUNDLED_CORPUS, f"train.{lang}.gz"), "rt", encoding="utf-8") as f:
            sentences += [next(f) for _ in range(lines_per_language)]
    return train_tokenizer(sentences, path, vocab_size=vocab_size)


def random_params(model, *ids, seed: int = 0, scale: float = 0.1):
    """Numpy parameters of `model`'s shapes for inputs `ids`, normal with `scale` (Flax's eager `init` would
    cost seconds of compiles)."""
    init = functools.partial(model.init, deterministic=True)
    shapes = nn.unbox(jax.eval_shape(init, jax.random.key(seed), *ids)["params"])
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.normal(scale=scale, size=s.shape).astype(s.dtype), shapes)


# Programs that take at least this long to compile are kept in JAX's persistent cache, in pytest's cache folder
# (.pytest_cache/d/jax_compilation; `pytest --cache-clear` empties it), shared by the workers of a run and by later
# runs: a test compiling a program that another test (or an earlier run) compiled reads it back instead, in
# about a tenth of the time. Smaller ones (eager operations) compile faster than they would be written and read.
# At most TEST_CACHE_BYTES, the least recently used entries evicted first.
TEST_CACHE_MIN_COMPILE_S = 0.5
TEST_CACHE_BYTES = 2 * 1024**3


def pytest_configure(config: pytest.Config) -> None:
    """JAX's persistent compilation cache on for the test process (see TEST_CACHE_MIN_COMPILE_S); a test that
    needs a cache of its own turns on `compilation_cache`, the entry points their own (train.py's default)."""
    if getattr(config, "cache", None) is None:  # `-p no:cacheprovider`: every program compiles.
        return
    jax.config.update("jax_compilation_cache_dir", str(config.cache.mkdir("jax_compilation")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", TEST_CACHE_MIN_COMPILE_S)
    jax.config.update("jax_compilation_cache_max_size", TEST_CACHE_BYTES)
    jax_compilation_cache.reset_cache()  # Decided anew, whatever compiled before.


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a `slow` test first, each file's tests in their order: `-n 2 --dist loadfile` hands files
    out in this order (pyproject.toml turns xdist's reorder by test count off), so the long ones start at once
    and short files fill the end, not one long file after all the others."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def pretend_gpu(monkeypatch, platform_version: str = "cuda 13000", **device) -> None:
    """JAX reports one GPU here: backend 'gpu', its client's `platform_version` ('rocm ...' on AMD's) and the
    `device` attributes given (`compute_capability="9.0"`: an H100), which models/build.py reads."""
    gpu = types.SimpleNamespace(client=types.SimpleNamespace(platform_version=platform_version), **device)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *args: [gpu])


@contextlib.contextmanager
def compiled_programs() -> Iterator[list[dict]]:
    """A list that gets the details (fun_name, ...) of each program XLA compiles, or reads from the persistent
    compilation cache, inside the block."""
    programs = []
    with compile_events() as events:
        yield programs
        programs += [details for event, _, details in events if event == BACKEND_COMPILE_EVENT]


@contextlib.contextmanager
def compilation_cache_on(folder: str) -> Iterator[str]:
    """JAX's persistent compilation cache on in `folder` inside the block, as train.py turns it on
    (training/runtime/compilation_cache.py); as it was before, after.

    For runs of the loop in the test process: a second run (a resumption, the same config again) reads
    the programs the first compiled, as a restarted train.py does, instead of compiling them again. A
    program is looked up by a hash of its HLO and compile options, so a run that traces anything
    differently still compiles its own.
    """
    before = {
        name: getattr(jax.config, name)
        for name in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    }
    assert project_compilation_cache.enable(folder) is not None
    jax_compilation_cache.reset_cache()  # JAX decides once whether the cache is used: decided anew with it on.
    try:
        yield folder
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        jax_compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def compilation_cache_folder(tmp_path_factory) -> str:
    """One folder of compiled programs per xdist worker (each has its own basetemp), shared by its tests."""
    return str(tmp_path_factory.mktemp("compilation_cache"))


@pytest.fixture
def compilation_cache(compilation_cache_folder) -> Iterator[str]:
    """The persistent compilation cache on in a folder of its own during this test (`compilation_cache_on`), as
    train.py turns it on; other tests use the test run's (`pytest_configure`)."""
    with compilation_cache_on(compilation_cache_folder) as folder:
        yield folder


def write_corpus_slice(folder: str, lines_per_split: dict[str, int]) -> str:
    """Writes the first lines of each bundled split as plain `{split}.{en,de}` files."""
    os.makedirs(folder, exist_ok=True)
    for split, count in lines_per_split.items():
        for lang in ("en", "de"):
            with gzip.open(os.path.join(BUNDLED_CORPUS, f"{split}.{lang}.gz"), "rt", encoding="utf-8") as f:
                lines = [next(f) for _ in range(count)]
            with open(os.path.join(folder, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.writelines(lines)
    return folder


def once_per_test_run(tmp_path_factory, name: str, make: Callable[[str], object]) -> str:
    """The folder `name` of this test run, made by `make(folder)` once, by whichever xdist worker asks first;
    the others wait for it (a lock), then share it. Made anew after a failure."""
    basetemp = tmp_path_factory.getbasetemp()
    root = basetemp.parent if "PYTEST_XDIST_WORKER" in os.environ else basetemp  # What every worker sees.
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            make(str(folder))
            done.touch()
    return str(folder)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> str:
    """A folder with 1,500 train, 40 valid and 40 test pairs of the bundled corpus, one for the test run."""
    lines = {"train": 1500, "valid": 40, "test": 40}
    return once_per_test_run(tmp_path_factory, "small_corpus", lambda folder: write_corpus_slice(folder, lines))


@pytest.fixture(scope="session")
def trained_tiny_run(small_corpus, tmp_path_factory) -> str:
    """configs/tiny.py on `small_corpus`, trained once for the test run by train.py where TensorFlow is not
    installed (the base install): checkpoints at steps 3 and 6, validation BLEU at both (the best kept apart),
    the test split evaluated with its attention maps, its config.json and tokenizer. Read it, or copy it
    (`copy_of_trained_tiny_run`) to change it: the command-line tests of evaluation, translation and checkpoints
    share this one run instead of each training its own."""

    def train(workdir: str) -> None:
        trained = run_entry_point(
            WITHOUT_TENSORFLOW,
            "train.py",
            "--config=configs/tiny.py",
            f"--workdir={workdir}",
            f"--config.dataset.path={small_corpus}",
            "--config.eval.attention_maps=True",  # Read by test_translate's test of the evaluation page.
        )
        assert trained.returncode == 0, trained.stderr[-3000:]

    return once_per_test_run(tmp_path_factory, "trained_tiny_run", train)


def copy_of_trained_tiny_run(trained_tiny_run: str, folder: pathlib.Path) -> str:
    """A copy of the shared tiny run in `folder`/run, for a test that writes into it."""
    return str(shutil.copytree(trained_tiny_run, folder / "run"))


def tiny_config(corpus_dir: str | None = None, **overrides):
    """configs/tiny.py (pointed at `corpus_dir` if given), with dotted-name overrides."""
    from configs import tiny

    config = tiny.get_config()
    if corpus_dir is not None:
        config.dataset.path = corpus_dir
    for name, value in overrides.items():
        node = config
        *parents, leaf = name.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def entry_point_env() -> dict[str, str]:
    """The environment the entry points run in, in tests: the CPU, quiet TensorFlow."""
    return dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")


# `run_entry_point(WITHOUT_TENSORFLOW, script, args...)`: the script as where TensorFlow (the `tensorflow` extra) is not
# installed.
WITHOUT_TENSORFLOW = os.path.join(REPO_ROOT, "tests", "without_tensorflow.py")


@pytest.fixture
def without_tensorflow(monkeypatch):
    """`import tensorflow` fails in this test, as where the `tensorflow` extra is not installed."""
    for name in [name for name in sys.modules if name.partition(".")[0] == "tensorflow"]:
        monkeypatch.delitem(sys.modules, name)  # Imported by an earlier test: imported anew (and failing) here.
    monkeypatch.setattr(sys, "meta_path", finders_without_tensorflow(sys.meta_path))


def on_one_device(tree, heads: bool = False):
    """Continuous batching's `Place` on one device: host arrays to device arrays, attention caches (heads) alike."""
    del heads
    return jax.tree.map(jax.numpy.asarray, tree)


def run_entry_point(
    script: str, *args: str, stdin: str | bytes | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Runs `python <script> <args>` from the repository root as a user would, on the CPU, with a timeout.

    `stdin` bytes go in as they are; stdout and stderr come back as text either way, with universal
    newlines (tqdm's carriage returns end lines). `env`: variables besides `entry_point_env()`'s.
    """
    result = subprocess.run(
        [sys.executable, script, *args],
        cwd=REPO_ROOT,
        input=stdin.encode("utf-8") if isinstance(stdin, str) else stdin,
        capture_output=True,
        env=entry_point_env() | (env or {}),
        timeout=600,
    )
    result.stdout, result.stderr = (
        out.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        for out in (result.stdout, result.stderr)
    )
    return result


def write_tfds_metadata(data_dir, name: str, splits: dict[str, int], file_format: str = "array_record") -> str:
    """Writes into `data_dir` the metadata of the TFDS dataset `name` prepared in `file_format`, without examples.

    `tfds.testing.mock_data` (policy USE_FILES, data_dir=the returned folder) reads the split names from it;
    without it the mocked builder has no splits at all.
    """
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (only the named-dataset tests)

    with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE):
        builder = tfds.builder(name, file_format=file_format)
        builder.info.set_splits(
            tfds.core.SplitDict(
                [
                    tfds.core.SplitInfo(name=split, shard_lengths=[n], num_bytes=0, filename_template=None)
                    for split, n in splits.items()
                ]
            )
        )
        version_dir = os.path.join(str(data_dir), builder.info.full_name)  # name[/config]/version
        os.makedirs(version_dir)
        builder.info.write_to_directory(version_dir)
    return str(data_dir)


def read_events(directory: str) -> list[event_pb2.Event]:
    """Events of every event file in `directory`, as TensorBoard reads them.

    TFRecord framing: length (8 bytes), its CRC (4), the data, its CRC (4). A record cut short
    at the end of a file (a write that failed) is left out, as TensorBoard leaves it out.
    """
    events = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            if offset + 12 + length + 4 > len(data):
                break
            events.append(event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length]))
            offset += 12 + length + 4
    return events
