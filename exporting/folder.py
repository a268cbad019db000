"""The export's output folder, written whole or not at all.

Everything is written into a temporary sibling of the destination (same filesystem), which is
renamed into place only once complete: a failed or interrupted export leaves no half-written
folder where an engine would load it.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from common.errors import UserInputError


def check_destination(path: str, *, overwrite: bool) -> None:
    """Refuses an existing destination that is not an empty folder, unless `overwrite`.

    Raises:
        UserInputError: `path` is a file, or a non-empty folder and `overwrite` is False.
    """
    if os.path.isfile(path):
        raise UserInputError(f"--output={path} is a file; name a folder.")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise UserInputError(f"--output={path} exists and is not empty; pass --overwrite to replace it.")


def _make_readable(root: str) -> None:
    """Opens the folder and its files to every reader: mkdtemp's folder (and some writers' files) are private."""
    os.chmod(root, 0o755)
    for folder, subfolders, files in os.walk(root):
        for name in subfolders:
            os.chmod(os.path.join(folder, name), 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)


@contextlib.contextmanager
def written_whole(path: str, *, overwrite: bool) -> Iterator[str]:
    """Yields an empty temporary folder to fill; on success it replaces `path`, on failure it is removed.

    Raises:
        UserInputError: as `check_destination`.
    """
    check_destination(path, overwrite=overwrite)
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    check_destination(path, overwrite=overwrite)  # Again: something may have written there meanwhile.
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
        os.replace(path, os.path.join(old, "replaced"))
    _make_readable(staging)
    os.replace(staging, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
