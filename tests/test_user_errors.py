"""Errors a user can act on are one `error:` line, and nothing written before is lost.

Storage failures (disk full, read-only workdir, file size limit), a resume that
cannot work, a damaged tokenizer, input that is not UTF-8, and a beam too large
for memory. The CLI cases run the real entry points on a tiny trained run.
"""

import dataclasses
import errno
import hashlib
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest
from conftest import TINY_MODEL, copy_of_trained_tiny_run, read_events, run_entry_point, tiny_config
from test_bad_input import assert_clean_failure, snapshot

from common import io_errors
from common.errors import UserInputError
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.text_lines import decode_lines
from models import Transformer
from models.build import init_params
from models.decoding_checks import decoding_memory_bytes
from training.config_checks import validate_config
from training.reporting import metric_log

# The message Orbax raised (from TensorStore) when a checkpoint save filled a tmpfs, as it was.
ORBAX_DISK_FULL = (
    'RESOURCE_EXHAUSTED: Error writing "a/0" in OCDBT database at local file "/w/checkpoints/2.orbax-checkpoint-tmp/'
    'state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed writing: "/w/checkpoints/2.orbax-checkpoint-tmp/'
    'state.orbax-checkpoint-tmp/ocdbt.process_0/d/6e68": Failed to write 2726240 bytes to file 7: '
    "No space left on device [os_error_code='28']"
)

# What safetensors' and tokenizers' (Rust) writers raised when a Hugging Face export filled a tmpfs, as they were.
SAFETENSORS_DISK_FULL = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
TOKENIZERS_DISK_FULL = Exception("No space left on device (os error 28)")


# --- Storage failures, function level ---------------------------------------------------------------------


def test_storage_errors_name_path_and_cause():
    full = OSError(errno.ENOSPC, "No space left on device", "/w/config.json")
    assert io_errors.describe(full, "/w") == (
        "cannot write /w/config.json: No space left on device (errno 28); free space on that disk or choose "
        "another --workdir"
    )
    read_only = OSError(errno.EROFS, "Read-only file system", "/w/train.lock")
    assert "cannot write /w/train.lock: Read-only file system (errno 30); remount it read-write" in (
        io_errors.describe(read_only, "/w")
    )
    orbax = ValueError(ORBAX_DISK_FULL)
    assert io_errors.describe(orbax, "/w").startswith(
        "cannot write /w/checkpoints/2.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/d/6e68: "
        "No space left on device (errno 28)"
    )
    # ArrayRecord's writer (through Riegeli) names the call, strerror's text and the file.
    array_record = RuntimeError(
        "write() failed: No space left on device; writing /w/tfds/parallel_text/en-de/incomplete.X_2.0.0/"
        "parallel_text-train.array_record-00000-of-00001; at byte 102400; Failed to close chunk_writer"
    )
    assert io_errors.describe(array_record, "/w") == (
        "cannot write /w/tfds/parallel_text/en-de/incomplete.X_2.0.0/parallel_text-train.array_record-00000-of-00001: "
        "No space left on device (errno 28); free space on that disk or choose another --workdir"
    )
    read_only = RuntimeError("open() failed: Read-only file system; opening /w/a.array_record; Failed to create")
    assert io_errors.storage_errno(read_only) == (errno.EROFS, "/w/a.array_record")
    # Rust libraries (safetensors, tokenizers) give Rust's text for the OS error, and no file: the folder is named.
    for rust in (SAFETENSORS_DISK_FULL, TOKENIZERS_DISK_FULL):
        assert io_errors.describe(rust, "runs/x", elsewhere="write elsewhere") == (
            f"cannot write in {os.path.abspath('runs/x')}: No space left on device (errno 28); free space on that "
            "disk or write elsewhere"
        )
    # Python's buffered writes do not know their file: the folder is named instead.
    too_large = OSError(errno.EFBIG, "File too large")
    assert io_errors.describe(too_large, "runs/x", elsewhere="write elsewhere").endswith(
        f"in {os.path.abspath('runs/x')}: File too large (errno 27); raise the file size limit (`ulimit -f`) or "
        "write elsewhere"
    )


def test_storage_errors_are_found_when_wrapped():
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", "/w/tfds/x")
        except OSError as e:
            raise RuntimeError("Failed to prepare the dataset") from e
    except RuntimeError as e:
        wrapped = e
    assert io_errors.storage_errno(wrapped) == (errno.EDQUOT, "/w/tfds/x")
    try:
        try:
            raise ValueError(ORBAX_DISK_FULL)
        except ValueError:
            raise KeyError("cleanup failed")  # An error while handling it: the context holds the cause.
    except KeyError as e:
        assert io_errors.storage_errno(e)[0] == errno.ENOSPC


def test_other_errors_stay_bugs():
    for error in (
        OSError(errno.ENOENT, "No such file or directory", "/x"),
        ValueError("shapes do not match"),
        ValueError("Failed writing [os_error_code='4']"),  # EINTR: not the user's to fix.
        RuntimeError("write() failed: Input/output error; writing /w/a.array_record"),  # EIO: a failing disk.
        Exception("Error while serializing: I/O error: Input/output error (os error 5)"),
    ):
        assert io_errors.user_error_message(error, "/w") is None
    assert io_errors.user_error_message(UserInputError("bad"), "/w") == "bad"


def test_a_write_that_fails_without_naming_its_file_is_named_by_its_writer(tmp_path):
    """A full disk surfaces when Python flushes a buffered file, as an `OSError` naming no file (/dev/full here)."""
    log = tmp_path / "metrics" / "train.jsonl"
    log.parent.mkdir()
    log.symlink_to("/dev/full")
    with pytest.raises(OSError) as raised:
        metric_log.append(str(tmp_path), "train", 1, {"loss": 2.5})
    assert io_errors.describe(raised.value, "/w").startswith(f"cannot write {log}: No space left on device (errno 28)")
    # A folder being written is named as a folder: Orbax's asynchronous saves fail so in their metadata writes.
    with pytest.raises(OSError) as raised, io_errors.naming(str(tmp_path)), open("/dev/full", "w") as full:
        full.write("x")
    assert io_errors.describe(raised.value, "/w").startswith(f"cannot write in {tmp_path}: No space left on device")
    # A failure that names its file, and any other error, passes through unchanged.
    with pytest.raises(ValueError, match="OCDBT"), io_errors.naming(str(tmp_path)):
        raise ValueError(ORBAX_DISK_FULL)
    with pytest.raises(OSError) as raised, io_errors.naming(str(tmp_path)):
        raise OSError(errno.EIO, "Input/output error")
    assert raised.value.filename is None


# --- Tokenizer and input, function level ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_path(small_corpus, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tokenizer") / "tokenizer.model")
    with open(os.path.join(small_corpus, "train.en"), encoding="utf-8") as f:
        tokenizer_lib.train_tokenizer(f.read().splitlines(), path, vocab_size=300)
    return path


def test_damaged_tokenizer_is_one_line(tmp_path, tokenizer_path):
    empty, garbage = tmp_path / "empty.model", tmp_path / "garbage.model"
    empty.write_bytes(b"")
    garbage.write_bytes(b"\x0a\xff" + hashlib.sha256(b"x").digest() * 8)
    with pytest.raises(UserInputError, match=rf"^{empty} is empty: the run's tokenizer is damaged\. Restore it"):
        tokenizer_lib.load_tokenizer(str(empty))
    with pytest.raises(UserInputError, match=rf"^{garbage} is not a SentencePiece model \("):
        tokenizer_lib.load_tokenizer(str(garbage))
    assert tokenizer_lib.load_tokenizer(tokenizer_path).vocab_size() == 300


def test_tokenizer_must_match_the_config(tokenizer_path):
    tokenizer = tokenizer_lib.load_tokenizer(tokenizer_path)
    assert tokenizer_lib.model_type(tokenizer) == "unigram"
    tokenizer_lib.check_tokenizer_matches(tokenizer, tokenizer_path, vocab_size=300, kind="unigram")
    with pytest.raises(
        UserInputError, match=r"vocab_size is 400 but .* trained with 300: .*--config\.tokenizer\.vocab_size=300,"
    ):
        tokenizer_lib.check_tokenizer_matches(tokenizer, tokenizer_path, vocab_size=400, kind="unigram")
    with pytest.raises(UserInputError, match=r"model_type is 'bpe' but .* trained with 'unigram'"):
        tokenizer_lib.check_tokenizer_matches(tokenizer, tokenizer_path, vocab_size=300, kind="bpe")


def test_decode_lines_names_the_line():
    assert decode_lines(b"a\r\nb\n\nc", "x") == ["a", "b", "", "c"]
    assert decode_lines("caf\u00e9 \u2028 ok\n".encode(), "x") == ["caf\u00e9 \u2028 ok"]  # One line, as written.
    with pytest.raises(
        UserInputError, match=r"^stdin, line 3: bytes that are not UTF-8 \(invalid start byte at byte 1\)"
    ):
        decode_lines(b"ok\n\na\xff\n", "stdin")


# --- Beam size against memory -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoding_memory_counts_the_cache_and_logits(dtype):
    """The estimate's cache terms are exactly the bytes of the cache the model builds, the self-attention part twice
    (beam search reorders it into a new copy; rows moving on to a shorter stage get a new one), the cross-attention
    part once a sentence."""
    config = dataclasses.replace(TINY_MODEL, dtype=dtype)
    model = Transformer(config)
    batch, beam, source_length, max_length = 3, 4, 5, 7
    rows = batch * beam
    encoded = jax.ShapeDtypeStruct((rows, source_length, TINY_MODEL.d_model), jnp.float32)
    params = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
    cache = jax.eval_shape(
        lambda p, e: model.apply({"params": p}, e, max_length, method=Transformer.init_cache), params, encoded
    )
    nbytes = {"self": 0, "cross": 0}
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        nbytes[str(path[-1].key).split("_")[0]] += leaf.size * leaf.dtype.itemsize
    logits = rows * TINY_MODEL.vocab_size * 4
    kwargs = dict(batch_size=batch, source_length=source_length, max_length=max_length)
    # The cache built for rows hypotheses; the decoders keep one cross-attention part a sentence.
    cross = nbytes["cross"] // beam
    assert decoding_memory_bytes(config, beam_size=beam, **kwargs) == 2 * nbytes["self"] + cross + logits
    greedy = decoding_memory_bytes(config, beam_size=1, **kwargs)
    assert greedy == (2 * nbytes["self"] + nbytes["cross"] + logits) // beam


def test_beam_too_large_for_memory_names_the_limit():
    validate_config(tiny_config(**{"eval.beam_size": 4}))
    with pytest.raises(UserInputError) as error:
        # 10^9 hypotheses of 300 float32 logits alone: 1.2 TB per sentence.
        validate_config(tiny_config(**{"eval.beam_size": 10**9}))
    message = str(error.value)
    # Batches hold eval.per_device_batch_size hypotheses: one sentence of 10^9 is the least there is.
    assert re.match(r"config\.eval\.beam_size=1000000000: decoding a batch of [12] sentences? of \d+ subwords", message)
    figures = re.search(
        r"a batch of (\d+) sentences? of \d+ subwords needs at least ([\d,.]+) GB .* is ([\d,.]+) GB: "
        r"(?:at most ([\d,]+) hypotheses|not even one hypothesis) of that length fits?\.",
        message,
    )
    assert figures, message
    sentences, needed, available = (float(figures.group(i).replace(",", "")) for i in (1, 2, 3))
    fit = int(figures.group(4).replace(",", "")) if figures.group(4) else 0
    # The hypotheses that fit, from the GB the message prints, each rounded by up to 0.05 GB.
    expected = available / needed * sentences * 10**9  # 10**9 hypotheses a sentence.
    rounding = 0.05 / available + 0.05 / needed
    assert abs(fit - expected) <= rounding * expected + 1, (fit, expected)


# --- The command line, on a tiny trained run --------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(trained_tiny_run, tmp_path_factory):
    """A copy of the shared tiny run (checkpoints at steps 3 and 6), trained through the CLI."""
    return copy_of_trained_tiny_run(trained_tiny_run, tmp_path_factory.mktemp("user_errors"))


def run_train(workdir: str, corpus: str, *args: str) -> subprocess.CompletedProcess:
    return run_entry_point(
        "train.py",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--config.dataset.path={corpus}",
        *args,
    )


def assert_names_what_failed_in(result: subprocess.CompletedProcess, workdir: str) -> None:
    """The error names the file in `workdir` that failed or, where the writer names none (Orbax's metadata),
    the folder written (a checkpoints' folder), not only `workdir`."""
    error = result.stderr.strip().splitlines()[-1]
    assert re.match(f"error: cannot write (in )?{re.escape(workdir)}/", error), error


def assert_translates(workdir: str) -> None:
    result = run_entry_point("translate.py", f"--workdir={workdir}", stdin="Click OK.\n")
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 1, result.stderr[-3000:]


@pytest.mark.slow
def test_rejected_resume_writes_nothing(trained_run, small_corpus):
    cases = [
        ("--config.model.d_model=64", ["does not fit the model", "is (32,) in the checkpoint but (64,)"]),
        ("--config.tokenizer.vocab_size=400", ["config.tokenizer.vocab_size is 400", "trained with 300"]),
        ("--config.tokenizer.model_type=bpe", ["config.tokenizer.model_type is 'bpe'", "trained with 'unigram'"]),
    ]
    for override, names in cases:
        before = snapshot(trained_run)
        result = run_train(trained_run, small_corpus, "--config.num_train_steps=9", override)
        assert_clean_failure(result, *names)
        assert snapshot(trained_run) == before, override  # config.json included.
    assert_translates(trained_run)


@pytest.mark.slow
def test_translate_and_evaluation_report_bad_input_in_one_line(trained_run, small_corpus, tmp_path):
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"Click OK.\na\xff\n")
    for args, stdin, names in [
        ([], b"a\xff\n", ["stdin, line 1: bytes that are not UTF-8", "iconv"]),
        ([f"--input={bad}"], None, [f"--input={bad}, line 2: bytes that are not UTF-8"]),
        (
            ["--beam_size=1000000000"],
            b"Click OK.\n",
            ["config.eval.beam_size=1000000000", "hypotheses of that length fit"],
        ),
    ]:
        result = run_entry_point("translate.py", f"--workdir={trained_run}", *args, stdin=stdin)
        assert_clean_failure(result, *names)
        assert result.returncode == 2 and result.stdout == ""

    damaged = str(tmp_path / "damaged")
    shutil.copytree(trained_run, damaged)
    tokenizer_path = os.path.join(damaged, "tokenizer.model")
    with open(tokenizer_path, "wb"):
        pass  # Empty.
    result = run_entry_point("translate.py", f"--workdir={damaged}", stdin="Click OK.\n")
    assert_clean_failure(result, f"{tokenizer_path} is empty", "Restore it")
    with open(tokenizer_path, "wb") as f:
        f.write(b"\x0a\xff" + bytes(range(256)))
    for mode in ("train", "eval"):
        result = run_train(damaged, small_corpus, f"--mode={mode}")
        assert_clean_failure(result, f"{tokenizer_path} is not a SentencePiece model")


# `python -c` this, LIMIT, script, args: runs the script with writes past LIMIT bytes in one file failing
# with EFBIG (Python ignores SIGXFSZ), as a full disk fails them with ENOSPC.
_WITH_FILE_SIZE_LIMIT = (
    "import resource, runpy, sys; "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY)); "
    "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.slow
def test_a_failed_checkpoint_save_is_one_line_and_keeps_earlier_checkpoints(trained_run, small_corpus, tmp_path):
    """A file size limit makes Orbax's asynchronous save fail in its background threads, as a full disk would."""
    workdir = str(tmp_path / "run")
    shutil.copytree(trained_run, workdir)
    step_6 = snapshot(os.path.join(workdir, "checkpoints", "6"))
    # 30 kB: the config, position and event files fit; a checkpoint's tree metadata (`_sharding` ~38 kB,
    # `_METADATA` ~46 kB) does not. Not the array data: TensorStore splits it into files of 0.2-160 kB,
    # differently from run to run (once, in CI, all of a step's stayed under 100 kB and the save succeeded).
    args = ("--config=configs/tiny.py", f"--workdir={workdir}", f"--config.dataset.path={small_corpus}")
    result = run_entry_point("-c", _WITH_FILE_SIZE_LIMIT, "30000", "train.py", *args, "--config.num_train_steps=9")
    assert_clean_failure(
        result,
        "File too large (errno 27); raise the file size limit (`ulimit -f`) or choose another --workdir",
        "checkpoints up to step 6 are intact",
    )
    assert_names_what_failed_in(result, workdir)
    assert snapshot(os.path.join(workdir, "checkpoints", "6")) == step_6
    resumed = run_train(workdir, small_corpus, "--config.num_train_steps=9")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step 6" in resumed.stderr
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["6", "9"]


# Writes a scalar, then a figure too large for the file size limit; prints the error as the entry points would.
_WRITE_EVENTS = """
import sys
import numpy as np
from matplotlib.figure import Figure
from common import io_errors
from training.reporting.metrics_writer import MetricWriter

writer = MetricWriter(sys.argv[1], "eval")
writer.write(1, {"loss": 2.5})
noise = Figure(figsize=(4, 4))
noise.add_subplot().imshow(np.random.default_rng(0).random((100, 100)))  # A PNG of ~50 kB.
try:
    writer.write_figures(2, {"noise": noise})
except OSError as e:
    print(io_errors.describe(e, sys.argv[1]))
"""


def test_a_failed_tensorboard_write_raises_naming_the_event_file(tmp_path):
    """Not lost in a writer thread: the write that fails raises, and what was written before stays readable."""
    script = tmp_path / "write_events.py"
    script.write_text(_WRITE_EVENTS)
    workdir = str(tmp_path / "run")
    result = run_entry_point("-c", _WITH_FILE_SIZE_LIMIT, "20000", str(script), workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    [event_file] = os.listdir(os.path.join(workdir, "tensorboard", "eval"))
    assert result.stdout.strip() == (
        f"cannot write {workdir}/tensorboard/eval/{event_file}: File too large (errno 27); raise the file size "
        "limit (`ulimit -f`) or choose another --workdir"
    )
    scalars = [
        (event.step, value.tag, value.simple_value)
        for event in read_events(os.path.join(workdir, "tensorboard", "eval"))
        for value in event.summary.value
    ]
    assert scalars == [(1, "loss", 2.5)]
    assert metric_log.read(workdir, "eval") == {1: {"loss": 2.5}}


def test_a_failed_dataset_preparation_is_one_line_and_leaves_no_dataset(small_corpus, tmp_path):
    """ArrayRecord's writer fails past the limit (the train split's file is ~390 kB); TFDS keeps nothing half-made."""
    workdir = str(tmp_path / "run")
    args = ("--config=configs/tiny.py", f"--workdir={workdir}", f"--config.dataset.path={small_corpus}")
    result = run_entry_point("-c", _WITH_FILE_SIZE_LIMIT, "30000", "train.py", *args)
    assert_clean_failure(
        result,
        f"cannot write {workdir}/tfds/parallel_text/",
        "/parallel_text-train.array_record-00000-of-00001: File too large (errno 27); raise the file size limit",
    )
    [dataset_config] = os.listdir(os.path.join(workdir, "tfds", "parallel_text"))
    assert os.listdir(os.path.join(workdir, "tfds", "parallel_text", dataset_config)) == []  # No version to trust.


@pytest.fixture
def tmpfs(tmp_path):
    """A 20 MB tmpfs (needs CAP_SYS_ADMIN, e.g. root outside a container that forbids mounts)."""
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield str(folder)
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.slow
def test_full_disk_and_read_only_workdir(trained_run, small_corpus, tmpfs):
    workdir = os.path.join(tmpfs, "run")
    shutil.copytree(trained_run, workdir)
    step_6 = snapshot(os.path.join(workdir, "checkpoints", "6"))
    stats = os.statvfs(tmpfs)
    used_kb = (stats.f_blocks - stats.f_bfree) * stats.f_frsize // 1024
    # Room for the config and event files, not for another checkpoint (~700 kB with the best one).
    subprocess.run(["mount", "-o", f"remount,size={used_kb + 300}k", tmpfs], check=True)
    result = run_train(workdir, small_corpus, "--config.num_train_steps=9")
    assert_clean_failure(
        result,
        "No space left on device (errno 28); free space on that disk or choose another --workdir",
        "checkpoints up to step 6 are intact",
    )
    assert_names_what_failed_in(result, workdir)
    assert snapshot(os.path.join(workdir, "checkpoints", "6")) == step_6

    subprocess.run(["mount", "-o", "remount,ro", tmpfs], check=True)
    result = run_train(workdir, small_corpus, "--config.num_train_steps=9")
    assert_clean_failure(result, f"cannot write {workdir}/train.lock: Read-only file system (errno 30)")
    assert_translates(workdir)  # Reading needs no writes.
