"""Log filtering: INFO lines from this project, only warnings from libraries."""

import logging
import os

from absl import logging as absl_logging

_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _ProjectInfoFilter(logging.Filter):
    """Passes warnings from anywhere, but INFO only from this project's files."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or (
            record.pathname.startswith(_PROJECT_ROOT) and "site-packages" not in record.pathname
        )


def quiet_library_logs() -> None:
    """Keeps the log readable: Orbax and TFDS log every file they touch at INFO."""
    absl_logging.get_absl_handler().addFilter(_ProjectInfoFilter())
