"""Whether a variant's test BLEU differs from the base's beyond chance: sacreBLEU's paired bootstrap, seed by seed.

Each variant run is compared with the base run of the same seed (the same data order) on the
same test sentences, by sacreBLEU's own paired bootstrap resampling (`PairedTest`, test type
'bs': `RESAMPLES` resamples of the test sentences drawn with sacreBLEU's fixed seed, 12345 unless
SACREBLEU_SEED says otherwise; its signature names both). The seeds are tested apart, not
pooled: the test resamples sentences, so it measures the test set's variance only, and a pool
of a variant's three runs would count three translations of one sentence as three independent
samples. How many seeds are significant shows whether a difference holds beyond one run.
"""

import contextlib
import dataclasses
import gzip
import logging
import os
from collections.abc import Mapping, Sequence

from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

LEVEL = 0.05  # A p-value below it is significant.
# A bootstrap of n resamples gives p >= 1/(n + 1), and Holm multiplies the smallest of m p-values by m, so a
# table of m tests can reject nothing unless m/(n + 1) < LEVEL. sacreBLEU's default, 1,000, stops at m = 50;
# Table 3 holds 66 tests (22 variants x 3 seeds), and 10,000 keeps its smallest adjusted p near 0.007.
RESAMPLES = 10_000  # sacreBLEU holds [resamples, sentences, statistics] at once: ~0.9 GB for 2,212 sentences.


@dataclasses.dataclass(frozen=True)
class Translations:
    """A run's translations of the test split and their references, line by line."""

    hypotheses: tuple[str, ...]
    references: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Significance:
    """A variant's p-values against the base, seed -> p, Holm's adjusted ones, and the test's sacreBLEU signature.

    `holm_p_values` are adjusted over every test of the table (each variant's seeds alike, `against_base`):
    with 66 tests at 0.05, about 3 would be 'significant' by chance alone.
    """

    p_values: dict[int, float]
    signature: str
    holm_p_values: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def significant(self) -> int:
        """How many seeds differ from the base at p < LEVEL."""
        return sum(p < LEVEL for p in self.p_values.values())

    @property
    def significant_after_holm(self) -> int:
        """How many seeds differ from the base at Holm-adjusted p < LEVEL."""
        return sum(p < LEVEL for p in self.holm_p_values.values())

    def describe(self) -> str:
        """'2/3 (0.0001, 0.0120, 0.2400)': seeds significant of seeds compared, then each seed's p, in seed order
        (four decimals: a bootstrap of `RESAMPLES` gives p in steps of about 0.0001, and never 0)."""
        p_values = ", ".join(f"{self.p_values[seed]:.4f}" for seed in sorted(self.p_values))
        return f"{self.significant}/{len(self.p_values)} ({p_values})"

    def describe_holm(self) -> str:
        """'1/3 (0.0300, 0.5400, 1.0000)': the same after Holm's correction over the table's tests."""
        p_values = ", ".join(f"{self.holm_p_values[seed]:.4f}" for seed in sorted(self.holm_p_values))
        return f"{self.significant_after_holm}/{len(self.holm_p_values)} ({p_values})"


def holm(p_values: Mapping[object, float]) -> dict[object, float]:
    """Holm's step-down adjusted p-values (Holm, 1979) of a family of tests, by the same keys.

    The i-th smallest of m p-values becomes max over j <= i of min(1, (m - j + 1) p_(j)); an adjusted p
    below a level rejects at that level with the chance of any false rejection in the family at most it.
    """
    adjusted, running = {}, 0.0
    ordered = sorted(p_values.items(), key=lambda item: item[1])
    for rank, (key, p_value) in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - rank) * p_value))
        adjusted[key] = running
    return adjusted


def _lines(path: str) -> tuple[str, ...]:
    """The lines of `path`, gzipped where it ends with .gz or only `path`.gz exists (a ledger's: sweeps/ledger.py)."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    # Evaluation writes one line per sentence, each ended by '\n' (newlines inside replaced).
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8", newline="\n") as f:
        return tuple(f.read().split("\n")[:-1])


def read_translations(folder: str, references: str | None = None) -> Translations | None:
    """hypotheses.txt and references.txt (or `references`, where given) of an evaluation folder, gzipped or not;
    None if either is missing or they differ in length."""
    try:
        hypotheses = _lines(os.path.join(folder, "hypotheses.txt"))
        found = Translations(hypotheses, _lines(references or os.path.join(folder, "references.txt")))
    except FileNotFoundError:
        return None
    return found if len(found.hypotheses) == len(found.references) else None


def paired_p_values(
    base: Sequence[str], systems: Sequence[Sequence[str]], references: Sequence[str]
) -> tuple[list[float], str]:
    """The p-value of each system's corpus BLEU difference to `base`'s, all translating `references`' sources.

    A system whose translations are the base's own gets p = 1: sacreBLEU gives it 1/(RESAMPLES + 1),
    as it counts the resamples whose difference exceeds the real one (0) and none does.

    Returns:
        The p-values in the order of `systems`, and the test's signature (BLEU's, with the seed and resamples).
    """
    different = [i for i, system in enumerate(systems) if list(system) != list(base)]
    named = [("base", list(base))] + [(f"system {i}", list(systems[i])) for i in different]
    with _quiet(logging.getLogger("sacrebleu")):  # Its INFO lines tell each comparison's progress.
        signatures, scores = PairedTest(
            named, {"BLEU": BLEU()}, [list(references)], test_type="bs", n_samples=RESAMPLES
        )()
    (metric,) = signatures
    p_values = [1.0] * len(systems)
    for i, result in zip(different, scores[metric][1:], strict=True):
        p_values[i] = result.p_value
    return p_values, str(signatures[metric])


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def against_base(translations: Mapping[str, Mapping[int, Translations]], base: str) -> dict[str, Significance]:
    """Each variant's significance against the `base` variant, over the seeds both have with the same references.

    Args:
        translations: variant -> seed -> its run's test translations (finished runs only).
        base: the variant the others are compared with.

    Returns:
        variant -> its `Significance`, for the variants with at least one seed compared; Holm's
        correction is over all of them.
    """
    p_values, signature = {}, None
    for seed, reference_run in sorted(translations.get(base, {}).items()):
        compared = [
            (name, runs[seed])
            for name, runs in translations.items()
            if name != base and seed in runs and runs[seed].references == reference_run.references
        ]
        if not compared:
            continue
        found, signature = paired_p_values(
            reference_run.hypotheses, [run.hypotheses for _, run in compared], reference_run.references
        )
        for (name, _), p_value in zip(compared, found, strict=True):
            p_values.setdefault(name, {})[seed] = p_value
    adjusted = holm({(name, seed): p for name, by_seed in p_values.items() for seed, p in by_seed.items()})
    return {
        name: Significance(found, signature, {seed: adjusted[name, seed] for seed in found})
        for name, found in p_values.items()
    }
