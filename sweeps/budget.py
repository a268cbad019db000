"""A sweep's time budget: a run starts only if its predicted wall time fits what is left of it.

A run's wall time is predicted as its training FLOPs (training/flops.py: the model's matmuls over
all its steps, so a variant of 2.6x the base's FLOPs is predicted 2.6x the base's time) times
the wall seconds per FLOP measured so far: this sweep's own finished runs where there are some,
else the ledger's runs on the same CPU kind. With nothing measured, a run starts unpredicted.
"""

import dataclasses
import time
from collections.abc import Callable, Sequence

import ml_collections

from models.build import transformer_config_of
from training import flops


def run_flops(config: ml_collections.ConfigDict) -> int:
    """Model FLOPs of a translation run's training: its train step on full rows, times its steps."""
    rows = config.per_device_batch_size * config.grad_accumulation_steps
    length = config.dataset.max_length
    model = transformer_config_of(config.model, config.tokenizer.vocab_size)  # Starts no JAX backend.
    return flops.train_step_flops(model, rows, length, length) * config.num_train_steps


@dataclasses.dataclass
class Budget:
    """`seconds` from now (None: no limit); the wall seconds per training FLOP measured so far."""

    seconds: float | None
    ledger_rates: Sequence[float] = ()  # Wall seconds per FLOP of the ledger's runs on this CPU kind.
    clock: Callable[[], float] = time.monotonic
    _start: float = dataclasses.field(init=False)
    _own_rates: list[float] = dataclasses.field(default_factory=list, init=False)

    def __post_init__(self):
        self._start = self.clock()

    def left(self) -> float | None:
        return None if self.seconds is None else self.seconds - (self.clock() - self._start)

    def predicted_seconds(self, config: ml_collections.ConfigDict) -> float | None:
        """The run's predicted wall time: the median seconds per FLOP measured, times its FLOPs."""
        rates = sorted(self._own_rates or self.ledger_rates)
        return rates[len(rates) // 2] * run_flops(config) if rates else None

    def allows(self, config: ml_collections.ConfigDict) -> tuple[bool, float | None]:
        """Whether a run of `config` predicted to fit starts now, and its predicted seconds."""
        predicted = self.predicted_seconds(config)
        left = self.left()
        return left is None or (predicted or 0.0) <= left, predicted

    def observe(self, config: ml_collections.ConfigDict, wall_seconds: float) -> None:
        """A run of `config` took `wall_seconds` here."""
        self._own_rates.append(wall_seconds / run_flops(config))
