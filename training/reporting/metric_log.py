"""Scalar metrics as JSON lines, <workdir>/metrics/<name>.jsonl: what TensorBoard shows, for programs to read.

One line per write, `{"step": 300, "loss": 2.61, ...}`, appended. A resumed run
repeats the steps after its checkpoint, so a step may appear more than once: the
last value of each metric at a step is the one that counts (`read`). Non-finite
values are null.
"""

import json
import math
import os
from collections.abc import Mapping

from common import io_errors
from common.workdir import Workdir


def append(workdir: str, name: str, step: int, metrics: Mapping[str, float]) -> None:
    """Appends one line: the step and `metrics` (NaN and infinities as null)."""
    record = {"step": int(step), **{key: _finite_or_none(value) for key, value in metrics.items()}}
    log_path = Workdir(workdir).metrics(name)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with io_errors.naming(log_path), open(log_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def read(workdir: str, name: str) -> dict[int, dict[str, float | None]]:
    """step -> its metrics (each metric's last value at that step), in step order; {} if nothing was logged.

    A last line cut short (the process killed while writing it) is ignored.
    """
    try:
        with open(Workdir(workdir).metrics(name), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return {}
    by_step = {}
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_step.setdefault(record.pop("step"), {}).update(record)
    return dict(sorted(by_step.items()))


def _finite_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None
