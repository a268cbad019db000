"""Log filtering: INFO lines from this project, only warnings from libraries, storage errors once."""

import logging
import os
import sys
import warnings

from absl import logging as absl_logging

from common import io_errors

_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # training/reporting/


def _is_project_file(pathname: str) -> bool:
    return pathname.startswith(_PROJECT_ROOT) and "site-packages" not in pathname


class _ProjectInfoFilter(logging.Filter):
    """Passes warnings from anywhere, but INFO only from this project's files."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or _is_project_file(record.pathname)


class _LibraryStorageErrorFilter(logging.Filter):
    """Drops libraries' records of a storage failure (disk full, read-only), traceback and all.

    Orbax saves from background threads: each thread that fails to write logs the
    error with its traceback, and asyncio logs the tasks it abandoned, dozens of
    records for one full disk. The same error is raised again in the main thread,
    where the entry point reports it as one `error:` line (`io_errors.describe`).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if _is_project_file(record.pathname) or not record.exc_info or record.exc_info[1] is None:
            return True
        return io_errors.storage_errno(record.exc_info[1]) is None


def _drop_closed_loop_callbacks(default_hook):
    """An unraisable-exception hook that ignores TensorStore callbacks into an event loop Orbax has closed.

    When one write of an Orbax save fails, Orbax stops waiting and closes its event
    loop; the writes still in flight then complete into the closed loop, and each
    prints a 'RuntimeError: Event loop is closed' traceback that says nothing more.
    """

    def hook(unraisable):
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        default_hook(unraisable)

    return hook


def quiet_library_logs() -> None:
    """Keeps the log readable: Orbax and TFDS log every file they touch at INFO, and a full disk many times."""
    handler = absl_logging.get_absl_handler()
    handler.addFilter(_ProjectInfoFilter())
    handler.addFilter(_LibraryStorageErrorFilter())
    sys.unraisablehook = _drop_closed_loop_callbacks(sys.unraisablehook)
    # The same failed save leaves the writes Orbax never started as coroutines that Python
    # warns about when it collects them at exit, after the run's own `error:` line.
    warnings.filterwarnings(
        "ignore", message=r"coroutine 'async_serialize\S*' was never awaited", category=RuntimeWarning
    )
