"""The persistent compilation cache: on in the configured folder, off with '', never fatal."""

import os
import subprocess
import sys

from training.runtime import compilation_cache

# Compiles one function in a fresh process and prints how many compilations the cache answered.
_COMPILE = """
import sys
import jax, jax.numpy as jnp
from training.runtime import compilation_cache
hits = []
jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event == "/jax/compilation_cache/cache_hits"))
compilation_cache.enable(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(jnp.ones((64, 64))).block_until_ready()
print(sum(hits))
"""


def _cache_hits(cache_dir: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE, cache_dir],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return int(result.stdout.strip().splitlines()[-1])


def test_compiled_programs_are_written_to_the_cache_folder(tmp_path):
    cache = tmp_path / "cache"
    assert _cache_hits(str(cache)) == 0
    assert os.listdir(cache), "nothing was cached"
    assert _cache_hits(str(cache)) >= 1, "the second process compiled anew instead of reading the cache"


def test_empty_folder_turns_the_cache_off():
    assert compilation_cache.enable("") is None


def test_a_folder_that_cannot_be_created_leaves_the_cache_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert compilation_cache.enable(str(blocker / "cache")) is None


def test_a_folder_others_can_write_leaves_the_cache_off(tmp_path):
    """Its entries are code a later run executes: only a folder of this user's alone is used."""
    cache = tmp_path / "cache"
    assert compilation_cache.cache_folder(str(cache)) == str(cache)
    assert os.stat(cache).st_mode & 0o077 == 0  # Made for this user alone.
    os.chmod(cache, 0o777)
    assert compilation_cache.cache_folder(str(cache)) is None
