"""An evaluation's scores as JSON, where a non-finite score becomes a named null."""

import json
import math
import os

from absl import logging

from common import io_errors
from common.workdir import SCORES_FILE


def write_scores(scores: dict, out_dir: str) -> None:
    """Writes <out_dir>/scores.json: valid JSON, a NaN or infinite score null and named (`nulls_for_nonfinite`)."""
    path = os.path.join(out_dir, SCORES_FILE)
    with io_errors.naming(path), open(path, "w", encoding="utf-8") as f:
        json.dump(nulls_for_nonfinite(scores), f, indent=2, allow_nan=False)


def nulls_for_nonfinite(scores: dict) -> dict:
    """`scores` with each NaN or infinite number as None (JSON null), named in 'not_finite', with a warning.

    Python's json module would write them as NaN and Infinity, which JSON does not have.
    """
    names = [name for name, value in scores.items() if isinstance(value, float) and not math.isfinite(value)]
    if not names:
        return scores
    logging.warning(
        "%s, %s: %s not finite (NaN or infinite parameters?); written as null.",
        scores.get("split"),
        scores.get("checkpoint"),
        ", ".join(names),
    )
    return {**{name: None if name in names else value for name, value in scores.items()}, "not_finite": names}
