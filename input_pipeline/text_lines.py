"""Sentences as text: UTF-8 lines of files and byte streams (errors name the line), and sentence pairs.

Kept apart from the TFDS builders (`parallel_text.py`, `datasets.py`) so that translating and
evaluating import no TensorFlow Datasets.
"""

import dataclasses
import gzip
from collections.abc import Iterator

from common.errors import UserInputError


def open_text(path: str):
    """The file opened for reading bytes, through gzip if its name ends in .gz."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def decode_line(raw: bytes, name: str, number: int) -> str:
    """Line `number` (1-based) of `name` without its line end ('\\n', and a trailing '\\r').

    Raises:
        UserInputError: if the line is not valid UTF-8, naming `name` and the line.
    """
    try:
        return raw.rstrip(b"\n").decode("utf-8").rstrip("\r")
    except UnicodeDecodeError as e:
        raise UserInputError(
            f"{name}, line {number}: bytes that are not UTF-8 ({e.reason} at "
            f"byte {e.start}); convert it, e.g. `iconv -f latin1 -t utf-8`."
        ) from None


def read_lines(path: str) -> Iterator[str]:
    """The lines of a UTF-8 text file (gzipped if it ends in .gz), one at a time, split at '\\n' only.

    Raises:
        UserInputError: if a line is not valid UTF-8, naming the line.
    """
    with open_text(path) as f:
        for number, raw in enumerate(f, start=1):  # Binary files split lines at b'\n' only.
            yield decode_line(raw, path, number)


def decode_lines(data: bytes, name: str) -> list[str]:
    """The lines of UTF-8 text, split at '\\n' only (a trailing '\\r' is dropped).

    Args:
        data: the bytes.
        name: what they were read from (a path, 'stdin'), for the error.

    Raises:
        UserInputError: if a line is not valid UTF-8, naming `name` and the line.
    """
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()  # The newline that ends the last line.
    return [decode_line(raw, name, number) for number, raw in enumerate(raw_lines, start=1)]


@dataclasses.dataclass(frozen=True)
class TextPairs:
    """A split's sentence pairs, line i of `sources` translated by line i of `targets`."""

    sources: list[str]
    targets: list[str]

    def __len__(self) -> int:
        return len(self.sources)
