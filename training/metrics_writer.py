"""Scalars and figures to TensorBoard event files, scalars also as JSON lines and to the log, from process 0 only."""

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
from absl import logging
from tensorboardX import SummaryWriter

from training import metric_log

if TYPE_CHECKING:  # matplotlib is imported only by the code that draws figures.
    from matplotlib.figure import Figure


class MetricWriter:
    """Writes scalar metrics and figures under <workdir>/tensorboard/<name>, scalars also to `metric_log`."""

    def __init__(self, workdir: str, name: str):
        self._writer = SummaryWriter(os.path.join(workdir, "tensorboard", name)) if jax.process_index() == 0 else None
        self._workdir = workdir
        self._name = name

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()
        metric_log.append(self._workdir, self._name, step, metrics)
        logging.info("[%d] %s: %s", step, self._name, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def write_figures(self, step: int, figures: Mapping[str, "Figure"]) -> None:
        """Renders each matplotlib figure into an image summary tagged by its key.

        The figures stay open: the caller owns them (and may, say, also save them as files).
        """
        if self._writer is None:
            return
        for tag, figure in figures.items():
            self._writer.add_figure(tag, figure, step, close=False)
        self._writer.flush()
        logging.info("[%d] %s: wrote %d figures", step, self._name, len(figures))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
