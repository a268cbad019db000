"""Storage failures a user can act on (disk full, read-only folder, quota, file size limit) as one line.

They surface from many depths: Python's own writes (config, tokenizer, evaluation
files, TensorBoard events), TFDS, ArrayRecord's writer, whose `RuntimeError` names
the failed call and the C library's text for the error (`write() failed: No space
left on device; writing <path>; ...`), and Orbax, whose asynchronous saves fail in a
background thread and are raised later, from the next save or the final wait, as
a TensorStore `ValueError` whose text carries the OS error code
(`... Failed writing: "<path>": ... No space left on device [os_error_code='28']`), and
Rust libraries (safetensors, tokenizers: the Hugging Face export), whose exceptions end in
Rust's text for an OS error (`Error while serializing: I/O error: No space left on device
(os error 28)`).
`describe` finds the OS error in an exception, its causes and its contexts, and
names the path and the cause. Where it names none (Python's buffered writes report a
full disk when they flush, without the file; Orbax writes its metadata so), the writer
names what it was writing (`naming`).
"""

import contextlib
import errno
import os
import re

from common.errors import UserInputError

# The errors a user fixes by freeing space or choosing another folder, not bugs.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})

_ADVICE = {  # Followed by "or <elsewhere>".
    errno.ENOSPC: "free space on that disk",
    errno.EDQUOT: "free space within your quota",
    errno.EROFS: "remount it read-write",
    errno.EACCES: "make it writable",
    errno.EPERM: "make it writable",
    errno.EFBIG: "raise the file size limit (`ulimit -f`)",
}
# TensorStore (Orbax's array storage) reports OS errors in its message, not as OSError.
_TENSORSTORE_ERRNO = re.compile(r"\[os_error_code='?(\d+)'?\]")
_TENSORSTORE_PATH = re.compile(
    r'(?:Failed writing|Error opening|Failed to open|Error writing[^"]*local file): "([^"]+)"'
)
# Riegeli (ArrayRecord's file layer) names the system call, then strerror's text, then the file.
_RIEGELI_FAILURE = re.compile(r"\b\w+\(\) failed: ([^;]+); (?:writing|opening) ([^;]+)")
_ERRNO_OF_STRERROR = {os.strerror(number): number for number in STORAGE_ERRNOS}
# Rust's `std::io::Error` shows an OS error as its text then "(os error N)", naming no file.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _chain(exc: BaseException):
    """`exc`, then its causes and contexts, each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def storage_errno(exc: BaseException) -> tuple[int, str | None] | None:
    """(errno, path or None) of the first storage failure in the exception chain, if there is one."""
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno in STORAGE_ERRNOS:
            return link.errno, link.filename
        match = _TENSORSTORE_ERRNO.search(str(link))
        if match and int(match[1]) in STORAGE_ERRNOS:
            path = _TENSORSTORE_PATH.search(str(link))
            return int(match[1]), path[1] if path else None
        match = _RIEGELI_FAILURE.search(str(link))
        if match and match[1] in _ERRNO_OF_STRERROR:
            return _ERRNO_OF_STRERROR[match[1]], match[2]
        match = _RUST_OS_ERROR.search(str(link))
        if match and int(match[1]) in STORAGE_ERRNOS:
            return int(match[1]), None
    return None


@contextlib.contextmanager
def naming(path: str):
    """Re-raises a storage failure that names no file as an `OSError` naming `path`, the file or folder written.

    Other errors, and storage failures that name their file, pass through unchanged.
    """
    try:
        yield
    except Exception as e:  # pylint: disable=broad-except
        found = storage_errno(e)
        if found is None or found[1] is not None:
            raise
        number = found[0]
        raise OSError(number, os.strerror(number), path) from e


def describe(exc: BaseException, folder: str | None, *, elsewhere: str = "choose another --workdir") -> str | None:
    """One line for a storage failure anywhere in the chain of `exc`; None if it is not one.

    Args:
        exc: what was raised.
        folder: where the command writes, named when the error does not say which file failed
            (None: its standard output).
        elsewhere: how to write somewhere else.

    Returns:
        e.g. "cannot write /w/checkpoints/800.orbax-checkpoint-tmp/...: No space left on device (errno 28);
        free space on that disk or choose another --workdir".
    """
    found = storage_errno(exc)
    if found is None:
        return None
    number, path = found
    verb = "cannot access" if number in (errno.EACCES, errno.EPERM) else "cannot write"
    if path is not None:
        where = f"in {path}" if os.path.isdir(path) else path  # A folder: from `naming`.
    else:
        where = f"in {os.path.abspath(folder)}" if folder else "the standard output"
    return f"{verb} {where}: {os.strerror(number)} (errno {number}); {_ADVICE[number]} or {elsewhere}"


def user_error_message(
    exc: BaseException, folder: str | None, *, elsewhere: str = "choose another --workdir"
) -> str | None:
    """What an entry point prints after `error: ` for an error the user can act on; None for a bug.

    A `UserInputError`'s message, or a storage failure as `describe` puts it.
    """
    if isinstance(exc, UserInputError):
        return str(exc)
    return describe(exc, folder, elsewhere=elsewhere)
