"""<workdir>/attempts.jsonl: one JSON line per training attempt (a resumed run adds one).

Each line says what ran the attempt and how long its phases took: the code commit, the machine,
the platform, devices and compute dtype, the last step logged, the seconds since the process
started and per phase (training/loop.py writes it; sweeps/ledger.py sums a run's attempts).
"""

import json

from common import io_errors


def append(path: str, attempt: dict) -> None:
    """Appends `attempt` as one JSON line to `path`."""
    with io_errors.naming(path), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(attempt, sort_keys=True) + "\n")


def read(path: str) -> list[dict]:
    """Every attempt of `path`, in order; [] if there is none. A line cut short (a killed process) is left out."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found
