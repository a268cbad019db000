"""Reading and writing the text of the command-line tools (translate.py, classify.py), with one-line errors."""

import sys

from training.errors import UserInputError


def read_input_lines(path: str | None) -> list[str]:
    """The lines of `path` (UTF-8), or of stdin when `path` is None, without their line ends.

    Raises:
        UserInputError: the file cannot be read or is not UTF-8.
    """
    if path is None:
        return sys.stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserInputError(f"Cannot read --input={path}: {e}") from None


def write_output_lines(lines: list[str], path: str | None) -> None:
    """Writes one line per entry to `path` (UTF-8), or to stdout when `path` is None.

    Raises:
        UserInputError: the file cannot be written (a missing folder, no permission, a full disk).
    """
    text = "".join(line + "\n" for line in lines)
    if path is None:
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UserInputError(f"Cannot write --output={path}: {e}") from None
