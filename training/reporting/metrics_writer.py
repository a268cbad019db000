"""Scalars and figures to TensorBoard event files, scalars also as JSON lines and to the log, from process 0 only."""

import contextlib
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import jax
from absl import logging

from common import io_errors
from common.workdir import Workdir
from training.reporting import metric_log


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """`import torch` fails inside, unless torch is imported already.

    tensorboardX's package imports torch where it is installed (the export extra), for its
    SummaryWriter's tensors: seconds and memory at the start of every train.py, translate.py and
    classify.py process. The modules used here need no torch.
    """
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # An import of a module set to None raises ImportError.
    try:
        yield
    finally:
        del sys.modules["torch"]


with _torch_hidden():
    from tensorboardX import summary
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.record_writer import RecordWriter
    from tensorboardX.utils import figure_to_image

if TYPE_CHECKING:  # matplotlib is imported only by the code that draws figures.
    from matplotlib.figure import Figure


class EventFile:
    """One TensorBoard event file, written and flushed in the caller's thread.

    Not tensorboardX's `SummaryWriter`: it writes from a background thread, where a failed
    write (a full disk) only prints a traceback. The thread then dies, the run goes on
    without its TensorBoard events, and once ten more events wait in its queue, the next
    write blocks forever. Here a failed write raises `OSError` naming the file, where the
    entry points report it as one line.
    """

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        # TensorBoard reads every file with "tfevents" in its name. Writers started in the same
        # second on one host (containers all with pid 1, say) get different names from the suffix.
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.path = os.path.join(folder, name)
        self._records = RecordWriter(self.path)
        self.append([Event(wall_time=time.time(), file_version="brain.Event:2")])

    def append(self, events: list[Event]) -> None:
        """Writes `events` and flushes them to disk (fsync)."""
        with io_errors.naming(self.path):
            for event in events:
                self._records.write(event.SerializeToString())
            self._records.flush()

    def close(self) -> None:
        self._records.close()


class MetricWriter:
    """Writes scalar metrics and figures under <workdir>/tensorboard/<name>, scalars also to `metric_log`."""

    def __init__(self, workdir: str, name: str):
        self._events = EventFile(Workdir(workdir).tensorboard(name)) if jax.process_index() == 0 else None
        self._workdir = workdir
        self._name = name

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._events is None:
            return
        metric_log.append(self._workdir, self._name, step, metrics)  # First: the record programs read.
        self._events.append([_event(step, summary.scalar(key, value)) for key, value in metrics.items()])
        logging.info("[%d] %s: %s", step, self._name, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def write_figures(self, step: int, figures: Mapping[str, "Figure"]) -> None:
        """Renders each matplotlib figure into an image summary tagged by its key.

        The figures stay open: the caller owns them (and may, say, also save them as files).
        """
        if self._events is None:
            return
        self._events.append(
            [_event(step, summary.image(tag, figure_to_image(figure, close=False))) for tag, figure in figures.items()]
        )
        logging.info("[%d] %s: wrote %d figures", step, self._name, len(figures))

    def close(self) -> None:
        if self._events is not None:
            self._events.close()


def _event(step: int, value: Summary) -> Event:
    return Event(wall_time=time.time(), step=int(step), summary=value)
