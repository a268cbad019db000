"""Storage failures a user can act on (disk full, read-only folder, quota, file size limit) as one line.

They surface from many depths: Python's own writes (config, tokenizer, evaluation
files), TFDS, TensorBoard writers, and Orbax, whose asynchronous saves fail in a
background thread and are raised later, from the next save or the final wait, as
a TensorStore `ValueError` whose text carries the OS error code
(`... Failed writing: "<path>": ... No space left on device [os_error_code='28']`).
`describe` finds the OS error in an exception, its causes and its contexts, and
names the path and the cause.
"""

import errno
import os
import re

# The errors a user fixes by freeing space or choosing another folder, not bugs.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})

_ADVICE = {
    errno.ENOSPC: "free space on that disk or write elsewhere",
    errno.EDQUOT: "free space within your quota or write elsewhere",
    errno.EROFS: "the filesystem is read-only; write elsewhere",
    errno.EACCES: "make it writable or write elsewhere",
    errno.EPERM: "make it writable or write elsewhere",
    errno.EFBIG: "a file reached the size limit (`ulimit -f`); raise it or write elsewhere",
}
# TensorStore (Orbax's array storage) reports OS errors in its message, not as OSError.
_TENSORSTORE_ERRNO = re.compile(r"\[os_error_code='?(\d+)'?\]")
_TENSORSTORE_PATH = re.compile(
    r'(?:Failed writing|Error opening|Failed to open|Error writing[^"]*local file): "([^"]+)"'
)


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
    return None


def describe(exc: BaseException, folder: str) -> str | None:
    """One line for a storage failure anywhere in the chain of `exc`; None if it is not one.

    Args:
        exc: what was raised.
        folder: where the command writes, named when the error does not say which file failed.

    Returns:
        e.g. "cannot write /w/checkpoints/800.orbax-checkpoint-tmp/...: No space left on device (errno 28);
        free space on that disk or write elsewhere".
    """
    found = storage_errno(exc)
    if found is None:
        return None
    number, path = found
    verb = "cannot access" if number in (errno.EACCES, errno.EPERM) else "cannot write"
    where = path if path else f"in {os.path.abspath(folder)}"
    return f"{verb} {where}: {os.strerror(number)} (errno {number}); {_ADVICE[number]}"
