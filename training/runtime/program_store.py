"""Compiled programs and abstract shapes kept on disk, so that a repeated command neither traces nor lowers them.

JAX's compilation cache (compilation_cache.py) skips XLA's compiling, but its key is the lowered module:
every process still traces and lowers each jitted function to find it. For translate.py's one line on
the quick-start model that was most of its start-up: ~0.6 s tracing and ~1.2 s lowering the decoding
program and ~0.6 s tracing the model's initialisation for its shapes, against ~0.2 s to read back the
executable. Here an executable (`jax.experimental.serialize_executable`) or an `eval_shape` result is
stored under a key made before tracing: what the caller says the function is (its config and a name),
the shapes, dtypes and shardings of its arguments, the source of the packages it runs, the JAX version,
XLA's flags and the devices. A stale or unreadable entry is made anew, with a warning. One process
only, with JAX's cache off (`program_store`): several processes keep their programs in JAX's cache.

An entry is code, not data: machine code, and the Python objects around it that JAX's
`serialize_executable` pickles (as does this store: tree structures have no other format). Like the
compilation cache's, it is read only from a folder, and a file, that this user owns and no one else
can write (`compilation_cache.is_private`); elsewhere every program is compiled, with a warning.
translate.py takes the folder from the machine's config, never from a run's (which may have been
downloaded).
"""

import contextlib
import hashlib
import json
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import flax
import jax
import jaxlib
import numpy as np
from absl import logging
from jax.experimental import serialize_executable

from training.runtime.compilation_cache import is_private

# Bump to discard every stored entry (a change of what is stored or how).
FORMAT_VERSION = 1


def source_fingerprint(modules: Sequence[ModuleType]) -> str:
    """sha256 of the Python sources of `modules` (a package: every .py file of its folder): what stored programs
    compute."""
    digest = hashlib.sha256()
    for module in modules:
        folder, file = os.path.split(module.__file__)
        for name in sorted(os.listdir(folder)) if file == "__init__.py" else [file]:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(f"{module.__name__}/{name}".encode() + b"\0" + f.read())
    return digest.hexdigest()


def _abstract(tree) -> list:
    """Shapes, dtypes and shardings of a pytree's leaves, and its structure, as JSON-able values."""
    leaves, treedef = jax.tree.flatten(tree)
    return [str(treedef), [(np.shape(x), str(np.result_type(x)), str(getattr(x, "sharding", ""))) for x in leaves]]


class ProgramStore:
    """Executables and abstract shapes in `folder`, each under a key of what it was made from."""

    def __init__(self, folder: str, code: str):
        self.folder, self.code = folder, code  # code: `source_fingerprint` of what the programs run.
        self._loaded = {}  # This process's, by a key of shapes only: no file or hash a call.
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.trusted = is_private(folder)
        if not self.trusted:
            logging.warning(
                "Program store %s is not this user's alone (another user owns it, or others can write it): its "
                "programs are compiled, not read or written.",
                folder,
            )

    def _path(self, kind: str, description: Any, *parts: Any) -> str:
        devices = jax.devices()
        key = {
            "format": FORMAT_VERSION,
            "kind": kind,
            "description": description,
            "parts": parts,
            "code": self.code,
            "versions": [jax.__version__, jaxlib.__version__, flax.__version__],
            "jax_config": [jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision],
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "devices": [len(devices), devices[0].platform, devices[0].device_kind],
        }
        name = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
        return os.path.join(self.folder, f"{kind}_{name}.pkl")

    def _read(self, path: str):
        if not self.trusted:
            return None
        try:
            with open(path, "rb") as f:
                if not is_private(f.fileno()):
                    logging.warning("Stored program %s is writable by others; making it anew.", path)
                    return None
                return pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception as e:  # pylint: disable=broad-except  (any damage: made anew)
            logging.warning("Stored program %s is unreadable (%s); making it anew.", path, e)
            return None

    def _write(self, path: str, make_value: Callable[[], Any]) -> None:
        """Writes `make_value()` to `path` whole or not at all (a file of its own, renamed: writers may race)."""
        if not self.trusted:
            return
        temporary = None
        try:
            descriptor, temporary = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(descriptor, "wb") as f:
                pickle.dump(make_value(), f)
            os.replace(temporary, path)
        except Exception as e:  # pylint: disable=broad-except  (a full disk, a read-only folder, an executable that does not serialize)
            logging.warning("Could not store %s (%s); the next process compiles it again.", path, e)
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.remove(temporary)

    def shapes(self, description: Any, make: Callable[[], Any], *args) -> Any:
        """`make()`, an `eval_shape` of `args`, read back if `description` and the arguments' shapes were seen."""
        key = ("shapes", json.dumps(description, sort_keys=True, default=str), _shapes(args))
        if key not in self._loaded:
            path = self._path("shapes", description, _abstract(args))
            self._loaded[key] = self._read(path)
            if self._loaded[key] is None:
                self._loaded[key] = make()
                self._write(path, lambda: self._loaded[key])
        return self._loaded[key]

    def compiled(self, description: Any, jitted, *args, **static) -> Callable:
        """`jitted.lower(*args, **static).compile()`, loaded instead if stored: call it with `args` alone."""
        key = ("executable", json.dumps(description, sort_keys=True, default=str), _shapes(args), str(static))
        if key not in self._loaded:
            path = self._path("executable", description, _abstract(args), static)
            self._loaded[key] = self._load(path)
            if self._loaded[key] is None:
                self._loaded[key] = jitted.lower(*args, **static).compile()
                self._write(path, lambda: serialize_executable.serialize(self._loaded[key]))
        return self._loaded[key]

    def _load(self, path: str):
        """The executable stored at `path`, or None (none, or one that does not load: compiled anew)."""
        stored = self._read(path)
        try:
            return None if stored is None else serialize_executable.deserialize_and_load(*stored)
        except Exception as e:  # pylint: disable=broad-except  (another jaxlib's, damaged)
            logging.warning("Stored program %s does not load (%s); compiling it anew.", path, e)
            return None


def _shapes(tree) -> tuple:
    """Shapes and dtypes of a pytree's leaves: this process's key of a stored entry."""
    return tuple((np.shape(x), np.result_type(x).str) for x in jax.tree.leaves(tree))


def program_store(folder: str | None, code: Sequence[ModuleType]) -> ProgramStore | None:
    """The store in `folder`/programs of programs that run `code`'s modules and packages, for one process whose
    JAX compilation cache is off (None otherwise).

    An executable that XLA:CPU reads back from JAX's cache does not serialize again (its functions are
    missing when that copy is loaded: "Function ... not found"), so a process keeps its programs in one or
    the other; with several processes, in JAX's cache.
    """
    if folder is None or jax.process_count() > 1 or jax.config.jax_compilation_cache_dir is not None:
        return None
    return ProgramStore(os.path.join(folder, "programs"), source_fingerprint(code))
