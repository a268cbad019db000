"""Scalars to TensorBoard event files and to the log, from process 0 only."""

import os

import jax
from absl import logging
from tensorboardX import SummaryWriter


class MetricWriter:
    """Writes scalar metrics under <workdir>/tensorboard/<name>."""

    def __init__(self, workdir: str, name: str):
        self._writer = SummaryWriter(os.path.join(workdir, "tensorboard", name)) if jax.process_index() == 0 else None
        self._name = name

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()
        logging.info("[%d] %s: %s", step, self._name, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
