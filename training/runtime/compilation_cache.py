"""JAX's persistent compilation cache: a restarted or repeated run reuses its compiled steps.

XLA compiles the train step, the evaluation step and each decoding shape on first use;
with the cache on, the executables are written to `config.compilation_cache_dir` and a
later run with the same program, devices and JAX version reads them back instead of
compiling again. Runs and processes may share it: an entry read while another process
is still writing it fails to load, with a warning, and that program compiles anew.

An entry is machine code that a later run executes, so the cache is used only in a folder
that this user owns and no one else can write (`is_private`); elsewhere every program
compiles, with a warning.
"""

import os
import stat

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
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        logging.warning("No compilation cache: cannot create %s (%s); every step compiles anew.", path, e.strerror)
        return None
    if not is_private(path):
        logging.warning(
            "No compilation cache: %s is %s; every step compiles anew.",
            path,
            "writable by other users (chmod go-w)" if _owned(os.stat(path)) else "another user's",
        )
        return None
    return path


def is_private(path: str | int) -> bool:
    """Whether the folder or open file `path` is this user's (or root's) and no one else can write it: what it
    holds was written by this user."""
    status = os.stat(path)
    return _owned(status) and not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _owned(status: os.stat_result) -> bool:
    return status.st_uid in (os.getuid(), 0)


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
