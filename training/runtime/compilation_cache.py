"""JAX's persistent compilation cache: a restarted or repeated run reuses its compiled steps.

XLA compiles the train step, the evaluation step and each decoding shape on first use;
with the cache on, the executables are written to `config.compilation_cache_dir` and a
later run with the same program, devices and JAX version reads them back instead of
compiling again. Runs and processes may share it: an entry read while another process
is still writing it fails to load, with a warning, and that program compiles anew.
"""

import os

import jax
from absl import logging

# Where the cache lives unless config.compilation_cache_dir says otherwise: per user, not per run.
DEFAULT_DIR = "~/.cache/aiayn/jax_compilation"


def cache_folder(cache_dir: str) -> str | None:
    """`cache_dir` ('~' expanded) made if needed; None for '' or a folder that cannot be made (logged: a run
    without the cache is only slower to start)."""
    if not cache_dir:
        return None
    path = os.path.abspath(os.path.expanduser(cache_dir))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        logging.warning("No compilation cache: cannot create %s (%s); every step compiles anew.", path, e.strerror)
        return None
    return path


def enable(cache_dir: str) -> str | None:
    """Turns the persistent cache on in `cache_dir` ('~' expanded); '' leaves it off.

    Returns:
        The cache folder, or None when it is off or cannot be created.
    """
    path = cache_folder(cache_dir)
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, not only those compiling for over a second (JAX's default): decoding compiles a few
    # small programs per bucket, each under that, which together are much of translate.py's start.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logging.info("Compilation cache: %s", path)
    return path
