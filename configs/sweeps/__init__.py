"""The format of a sweep file: a config file whose `get_config(variant)` is a base config with named overrides.

A sweep file (e.g. configs/sweeps/table3.py) defines

    VARIANTS = (Variant('base', ...), Variant('heads_1', ..., overrides={'model.num_heads': 1}), ...)

    def get_config(variant='base'):
        return config_for(base_config(), VARIANTS, variant)

so that each run of the sweep is an ordinary train.py command (`path:arg` is
ml_collections' way of passing `arg` to `get_config`):

    python train.py --config=configs/sweeps/table3.py:heads_1 --config.seed=1 --workdir=runs/table3/heads_1/seed_1

sweep.py runs these commands, one per (variant, seed), and collects their results.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from common.errors import UserInputError


@dataclasses.dataclass(frozen=True)
class Paper:
    """A published result to show beside a variant: what it is, and its numbers where reported."""

    row: str  # E.g. '(A) h=1, d_k=d_v=512'.
    perplexity: float | None = None  # Per wordpiece, on the paper's development set.
    bleu: float | None = None
    params_millions: float | None = None


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of a sweep: config overrides on the sweep's base config.

    Attributes:
        name: the row's name, also its folder under the sweep's root and the `get_config` argument.
        group: what the row varies, e.g. '(A) attention heads'.
        description: one line for the results table, e.g. 'h=1, d_k=d_v=256'.
        overrides: dotted config field -> value, e.g. {'model.num_heads': 1}; every field must exist
            in the base config (a misspelled field would otherwise train the base under another name).
        paper: the published result this row corresponds to, if any.
    """

    name: str
    group: str
    description: str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    paper: Paper | None = None


def config_for(base: ml_collections.ConfigDict, variants: Sequence[Variant], name: str) -> ml_collections.ConfigDict:
    """`base` with the overrides of the variant called `name`.

    Raises:
        UserInputError: no variant has that name, or the variant overrides a field the base config lacks
            or sets it to a value of another type.
    """
    by_name = {variant.name: variant for variant in variants}
    if name not in by_name:
        raise UserInputError(f"No variant {name!r} in this sweep; its variants: {', '.join(by_name)}.")
    config = base.copy_and_resolve_references()
    for field, value in by_name[name].overrides.items():
        *parents, leaf = field.split(".")
        node = config
        for parent in parents:
            node = node.get(parent)
            if not isinstance(node, ml_collections.ConfigDict):
                break
        if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
            raise UserInputError(
                f"Variant {name!r} sets {field}, a field this version's config does not have "
                "(a variant for a feature not in this checkout?)."
            )
        try:
            node[leaf] = value
        except (TypeError, ValueError) as e:  # ml_collections keeps each field's type.
            raise UserInputError(f"Variant {name!r} sets {field}={value!r}, of another type than the config's: {e}")
    return config
