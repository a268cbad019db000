"""Steps whose loss or gradients are not finite: skipped on the device, then stop or go on as the config says.

The train step checks every update on the device and never applies one whose loss,
gradients or resulting parameters hold a NaN or an infinity (training/steps.py);
it reports a 'finite' flag with each step's metrics. The loop hands the flags to a
`NonFiniteGuard` as it dispatches the steps and calls `check` where it waits for the
device anyway (logging, and always before it evaluates or saves), so detection
costs no extra synchronization, and a state after an update that should stop the
run is never saved, evaluated or kept as the best.

config.nonfinite:
  'stop'  stop at the first non-finite step (the default: a diverged run rarely recovers).
  'skip'  skip such steps and go on; stop after config.max_nonfinite_in_a_row in a row.
"""

from collections.abc import Callable

import jax
import numpy as np
from absl import logging

from common.errors import TrainingStopped

MODES = ("stop", "skip")
EXIT_STATUS = 3  # Not 1 (a crash) or 2 (bad input): rerunning the same command diverges again.
_LOWER_LEARNING_RATE = (
    "with a lower config.optimizer.peak_learning_rate (or learning_rate_scale, with schedule 'paper')"
)


class NonFiniteGuard:
    """Watches the train step's 'finite' flags and stops training as config.nonfinite says.

    Args:
        mode: 'stop' or 'skip' (see the module's docstring).
        max_in_a_row: with 'skip', the number of non-finite steps in a row that stops training.
        last_checkpoint: describes the last checkpoint saved ('step 300 in <dir>'), or None.
    """

    def __init__(self, mode: str, max_in_a_row: int, last_checkpoint: Callable[[], str | None]):
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}; choose one of {MODES}.")
        self._limit = 1 if mode == "stop" else max_in_a_row
        self._mode = mode
        self._last_checkpoint = last_checkpoint
        self._unchecked: list[tuple[int, jax.Array]] = []
        self.skipped = 0  # Steps skipped since this process started training.
        self._in_a_row = 0

    def record(self, step: int, finite: jax.Array) -> None:
        """Notes step's flag, still on the device (reading it now would wait for the step)."""
        self._unchecked.append((step, finite))

    def check(self) -> None:
        """Reads the flags recorded since the last check (waiting for those steps).

        Raises:
            TrainingStopped: with exit status EXIT_STATUS, when a step was not finite
                ('stop') or config.max_nonfinite_in_a_row were not finite in a row ('skip').
        """
        if not self._unchecked:
            return
        steps = [step for step, _ in self._unchecked]
        flags = np.asarray(jax.device_get([flag for _, flag in self._unchecked]), bool)
        self._unchecked.clear()
        for step, finite in zip(steps, flags, strict=True):
            self._in_a_row = 0 if finite else self._in_a_row + 1
            self.skipped += int(not finite)
            if self._in_a_row >= self._limit:
                raise TrainingStopped(self._message(step), EXIT_STATUS)
        if skipped := [step for step, finite in zip(steps, flags, strict=True) if not finite]:
            logging.warning(
                "Skipped the update of %s %s: the loss or gradients were not finite (%d skipped so far).",
                "step" if len(skipped) == 1 else "steps",
                ", ".join(map(str, skipped)),
                self.skipped,
            )

    def _message(self, step: int) -> str:
        if self._mode == "stop":
            what = f"the loss or gradients of step {step} are not finite (NaN or infinite)"
            change = f"{_LOWER_LEARNING_RATE}, or --config.nonfinite=skip to skip such steps"
        else:
            what = (
                f"steps {step - self._in_a_row + 1} to {step} had a non-finite loss or gradients, "
                f"{self._in_a_row} in a row (config.max_nonfinite_in_a_row), {self.skipped} skipped in all"
            )
            change = _LOWER_LEARNING_RATE
        checkpoint = self._last_checkpoint()
        if checkpoint is None:
            return f"error: {what}; stopped before saving any checkpoint: start again {change}."
        return (
            f"error: {what}; stopped without applying the update. The last checkpoint, {checkpoint}, "
            f"is good: resume from it (the same command) {change}."
        )
