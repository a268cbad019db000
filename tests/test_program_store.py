"""The program store: a second process reads back what the first compiled, and never a stale or damaged entry."""

import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO_ROOT, compiled_programs
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

from training.runtime import compilation_cache, program_store

# A process that computes f(x) through a store in argv[1] (code fingerprint argv[2]) and prints what it compiled.
_PROCESS = """
import sys
import jax, jax.numpy as jnp, numpy as np
from common.compile_events import BACKEND_COMPILE_EVENT, compile_events
from training.runtime.program_store import ProgramStore

store = ProgramStore(sys.argv[1], code=sys.argv[2])
f = jax.jit(lambda x, scale: jnp.cumsum(x) * scale, static_argnames="scale")
x = np.arange(6, dtype=np.float32)
with compile_events() as events:
    shapes = store.shapes(["shapes of f"], lambda: jax.eval_shape(f, x, scale=2.0), x)
    y = store.compiled(["f"], f, x, scale=2.0)(x)
print(sum(event == BACKEND_COMPILE_EVENT for event, _, _ in events), shapes.shape, np.asarray(y).tolist())
"""


@pytest.fixture(autouse=True)
def without_jax_cache():
    """JAX's compilation cache off, as wherever a store is used: an executable read back from it does not
    serialize again (the test run keeps its programs there, conftest.pytest_configure)."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    jax_compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    jax_compilation_cache.reset_cache()


def _run(folder, code="code 1"):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", _PROCESS, str(folder), code], capture_output=True, text=True, env=env, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip(), result.stderr


@pytest.mark.slow
def test_a_second_process_reads_the_program_back_and_other_code_compiles_its_own(tmp_path):
    expected = "(6,) [0.0, 2.0, 6.0, 12.0, 20.0, 30.0]"
    assert _run(tmp_path)[0] == f"1 {expected}"  # Compiled, and stored.
    assert _run(tmp_path)[0] == f"0 {expected}"  # Read back: nothing compiled.
    assert _run(tmp_path, code="code 2")[0] == f"1 {expected}"  # Changed code: compiled anew.
    assert sorted(name.split("_")[0] for name in os.listdir(tmp_path)) == ["executable"] * 2 + ["shapes"] * 2


@pytest.mark.slow
def test_a_damaged_entry_is_made_anew_with_a_warning(tmp_path):
    _run(tmp_path)
    for name in os.listdir(tmp_path):
        with open(tmp_path / name, "r+b") as f:
            f.truncate(os.path.getsize(tmp_path / name) // 2)
    output, stderr = _run(tmp_path)
    assert output == "1 (6,) [0.0, 2.0, 6.0, 12.0, 20.0, 30.0]"
    assert "is unreadable" in stderr and "making it anew" in stderr
    assert _run(tmp_path)[0].startswith("0 ")  # Written whole again.


def test_the_store_is_off_where_jax_keeps_its_own_cache(tmp_path):
    """An executable XLA:CPU reads back from JAX's cache does not serialize again: one or the other."""
    assert program_store.program_store(None, code=(program_store,)) is None
    assert program_store.program_store(str(tmp_path), code=(program_store,)) is not None
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    assert program_store.program_store(str(tmp_path), code=(program_store,)) is None


def test_stored_shapes_are_the_eval_shape_of_the_arguments_given(tmp_path):
    store = program_store.ProgramStore(str(tmp_path), code="code")

    def shapes(x):
        return store.shapes(["rows"], lambda: jax.eval_shape(lambda y: jnp.concatenate([y, y]), x), x)

    assert shapes(np.zeros(3, np.float32)).shape == (6,)
    assert shapes(np.zeros(5, np.float32)).shape == (10,)  # Other arguments, another entry.
    assert shapes(np.zeros(5, np.int32)).dtype == np.int32


def test_another_static_argument_or_description_is_another_program(tmp_path):
    store = program_store.ProgramStore(str(tmp_path), code="code")
    f = jax.jit(lambda x, scale: x * scale, static_argnames="scale")
    x = np.ones(3, np.float32)
    assert store.compiled(["f"], f, x, scale=2.0)(x).tolist() == [2.0] * 3
    assert store.compiled(["f"], f, x, scale=3.0)(x).tolist() == [3.0] * 3
    assert store.compiled(["g"], f, x, scale=3.0) is not store.compiled(["f"], f, x, scale=3.0)
    assert len([name for name in os.listdir(tmp_path) if name.startswith("executable_")]) == 3


def test_a_folder_others_can_write_is_never_read(tmp_path, caplog):
    """A stored entry is code: read only from a folder of this user's alone, compiled anew elsewhere."""
    x = np.zeros(2, np.float32)

    def f():  # A function JAX has not compiled in this process.
        return jax.jit(lambda y: y + 1)

    program_store.ProgramStore(str(tmp_path), code="code").compiled(["f"], f(), x)
    (entry,) = os.listdir(tmp_path)
    assert os.stat(tmp_path / entry).st_mode & 0o077 == 0  # Written for this user alone.
    with compiled_programs() as programs:
        program_store.ProgramStore(str(tmp_path), code="code").compiled(["f"], f(), x)
    assert programs == []  # Read back.
    written = os.stat(tmp_path / entry).st_mtime_ns
    os.chmod(tmp_path, 0o777)
    with compiled_programs() as programs:
        store = program_store.ProgramStore(str(tmp_path), code="code")
        assert store.compiled(["f"], f(), x)(x).tolist() == [1.0, 1.0]
        store.compiled(["g"], f(), x)
    assert len(programs) == 2 and "not this user's alone" in caplog.text
    assert os.listdir(tmp_path) == [entry] and os.stat(tmp_path / entry).st_mtime_ns == written  # Nor written.
    os.chmod(tmp_path, 0o700)
    os.chmod(tmp_path / entry, 0o666)
    with compiled_programs() as programs:
        program_store.ProgramStore(str(tmp_path), code="code").compiled(["f"], f(), x)
    assert len(programs) == 1 and "writable by others" in caplog.text


def test_only_this_users_folders_and_files_are_private(tmp_path, monkeypatch):
    os.chmod(tmp_path, 0o755)
    assert compilation_cache.is_private(str(tmp_path))
    os.chmod(tmp_path, 0o775)
    assert not compilation_cache.is_private(str(tmp_path))  # Others (its group) can write.
    os.chmod(tmp_path, 0o700)
    mine = os.stat(tmp_path)
    monkeypatch.setattr(os, "getuid", lambda: mine.st_uid + 1)
    assert compilation_cache.is_private(str(tmp_path)) == (mine.st_uid == 0)  # Another user's: only root's trusted.
    monkeypatch.setattr(os, "stat", lambda path: types.SimpleNamespace(st_uid=mine.st_uid + 2, st_mode=0o40700))
    assert not compilation_cache.is_private(str(tmp_path))
