"""Reading and writing the text of the command-line tools (translate.py, classify.py), with one-line errors."""

import os
import sys
from collections.abc import Callable

from common import io_errors
from common.errors import UserInputError
from input_pipeline.text_lines import decode_lines


def run_command(command: Callable[[], None], output_folder: str | None) -> None:
    """Runs a command-line tool's work; an error the user can act on is one `error:` line and exit status 2.

    Args:
        command: the tool's work.
        output_folder: where it writes (named when a storage error does not say which file failed);
            None: its standard output.
    """
    try:
        command()
    except KeyboardInterrupt:
        print("Interrupted by SIGINT.", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # pylint: disable=broad-except
        if (message := io_errors.user_error_message(e, output_folder, elsewhere="write elsewhere")) is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def read_input_lines(path: str | None) -> list[str]:
    """The lines of `path`, or of stdin when `path` is None, alike: bytes decoded as strict UTF-8.

    Raises:
        UserInputError: the file cannot be read, or a line is not UTF-8 (named by its number).
    """
    try:
        if path is None:
            return decode_lines(sys.stdin.buffer.read(), "stdin")
        with open(path, "rb") as f:
            return decode_lines(f.read(), f"--input={path}")
    except OSError as e:
        raise UserInputError(f"Cannot read --input={path}: {e}") from None


def write_output_lines(lines: list[str], path: str | None) -> None:
    """Writes one line per entry to `path` (UTF-8), or to stdout when `path` is None.

    A reader of stdout that stops early (`| head`) ends the tool quietly with status 141, as
    SIGPIPE ends other tools of a pipeline.

    Raises:
        UserInputError: the file cannot be written (a missing folder, no permission, a full disk).
    """
    text = "".join(line + "\n" for line in lines)
    if path is None:
        try:
            sys.stdout.flush()  # What was written as text before, first.
            sys.stdout.buffer.write(text.encode("utf-8"))  # UTF-8 whatever the locale, as the input is read.
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            # Python flushes stdout again at exit: it must find somewhere to write.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(141) from None
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UserInputError(f"Cannot write --output={path}: {e}") from None
