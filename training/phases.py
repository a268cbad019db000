"""Wall seconds of a training run's phases, with XLA's compiling and tracing counted apart from where it happened.

    clock = PhaseClock()
    with clock.counting_compiles():
        with clock.phase("setup"): ...
        with clock.phase("train"):
            ...
            with clock.phase("evaluation"): ...  # Nested: not counted in "train" too.
    clock.seconds  # {'setup': 9.1, 'train': 512.3, 'evaluation': 31.0, 'compile': 14.2}

Each phase's seconds exclude those of the phases nested in it and the compiling inside it
(jax.monitoring's compile and tracing events, common/compile_events.py), which goes to 'compile':
a first step's 6 s of compiling is not training time, and a cached program costs only its tracing.
The phases of an attempt plus 'compile' add up to its wall time inside the clock.
"""

import collections
import contextlib
import dataclasses
import os
import re
import time
from collections.abc import Iterator

from common.compile_events import compile_events

COMPILE = "compile"


@dataclasses.dataclass
class _Open:
    """A phase being timed: when it began, the first compile event in it, and what its nested phases took."""

    start: float
    first_event: int
    nested_seconds: float = 0.0  # Wall time of the phases nested in it, their compiling included.
    nested_compiling: float = 0.0


class PhaseClock:
    """Seconds per phase name; see the module docstring."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._events: list = []
        self._open: list[_Open] = []

    @contextlib.contextmanager
    def counting_compiles(self) -> Iterator["PhaseClock"]:
        """Counts the compiling and tracing of the block's programs (under any phase) as 'compile'."""
        with compile_events() as events:
            self._events = events
            try:
                yield self
            finally:
                self._events = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as `name`, less its nested phases and its compiling."""
        self._open.append(_Open(time.perf_counter(), len(self._events)))
        try:
            yield
        finally:
            timed = self._open.pop()
            elapsed = time.perf_counter() - timed.start
            compiling = sum(seconds for _, seconds, _ in self._events[timed.first_event :])
            own_compiling = compiling - timed.nested_compiling
            self.seconds[name] += max(0.0, elapsed - timed.nested_seconds - own_compiling)
            self.seconds[COMPILE] += own_compiling
            if self._open:
                self._open[-1].nested_seconds += elapsed
                self._open[-1].nested_compiling += compiling


def process_age_seconds() -> float | None:
    """Seconds since this process started, its imports included (Linux's /proc); None elsewhere."""
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # The name, in parentheses, may hold spaces.
        return uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # stat's field 22: start, in ticks after boot.
    except (OSError, ValueError, IndexError):
        return None


def describe(seconds: dict[str, float]) -> str:
    """'imports 2.1 s, restore 0.6 s, ...' in the dict's order: a log line that `parse` reads back."""
    return ", ".join(f"{name} {value:.2f} s" for name, value in seconds.items())


def parse(line: str) -> dict[str, float]:
    """The seconds a `describe` line in `line` (a log, say) names, by phase."""
    return {name: float(value) for name, value in re.findall(r"([a-z_]+) (\d+\.\d+) s\b", line)}
