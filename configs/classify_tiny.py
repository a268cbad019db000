r"""A tiny classifier on the bundled labelled help sentences, for tests (seconds, not minutes).

  python train.py --config=configs/classify_tiny.py --workdir=runs/classify_tiny

Expected: runs end to end; accuracy near the majority class (it trains for a handful of steps).
"""

from configs import classify, tiny


def get_config():
    """Returns the classification test config."""
    return tiny.shrink(classify.get_config())
