"""A sweep's results: per variant, mean ± standard deviation over seeds, differences to the base.

`collect` reads every finished run of a sweep (sweeps/runner.py) and writes under the root:
results.md (the table, with each variant's paired bootstrap significance against the base,
sweeps/significance.py, and the paper's numbers beside each row), results.csv (the same per
variant, machine-readable), results_runs.csv (one line per run), results_bleu.png (test BLEU
per variant with error bars) and valid_curves.png (validation perplexity against step, the
mean over seeds, one line per variant). `record_figures` and `page` give the same for a record.

Where the numbers come from: test BLEU, chrF and the step from the final evaluation's
scores.json, the significance from its hypotheses.txt and references.txt; the validation
perplexity at each step, the parameter count and the training seconds of each logging
interval from <workdir>/metrics/*.jsonl (training/reporting/metric_log.py).
"""

import csv
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from common.errors import UserInputError
from common.workdir import Workdir
from configs.sweeps import Variant
from sweeps.runner import Run, Sweep, config_changes, final_scores
from sweeps.significance import LEVEL, Significance, Translations, against_base, read_translations
from training.reporting import metric_log


@dataclasses.dataclass(frozen=True)
class RunResult:
    """The numbers of one finished run."""

    run: Run
    steps: int
    num_params: int | None
    train_seconds: float | None  # In the training steps, validation and test evaluation excluded.
    valid_perplexity: float | None  # At the last step.
    valid_curve: dict[int, float]  # step -> validation perplexity.
    test_bleu: float | None
    test_chrf: float | None
    signature: str
    decoding: str
    test_translations: Translations | None = None  # None: the evaluation's outputs are missing.


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The mean of n values and their sample standard deviation (None for one value)."""

    mean: float
    std: float | None
    n: int


def estimate(values: Sequence[float | None]) -> Estimate | None:
    """Mean and sample standard deviation (ddof 1) of the values that are not None; None if there are none."""
    present = [value for value in values if value is not None]
    if not present:
        return None
    std = float(np.std(present, ddof=1)) if len(present) > 1 else None
    return Estimate(float(np.mean(present)), std, len(present))


def seed_differences(values: Mapping[int, float | None], base: Mapping[int, float | None]) -> dict[int, float]:
    """seed -> value - base, in seed order, over the seeds both have (seed -> value)."""
    common = sorted(seed for seed in values if values[seed] is not None and base.get(seed) is not None)
    return {seed: values[seed] - base[seed] for seed in common}


def paired_difference(values: Mapping[int, float | None], base: Mapping[int, float | None]) -> Estimate | None:
    """value - base over the seeds both have (seed -> value): paired, as runs with one seed share the
    data order and the tokenizer, so the differences vary less than the values."""
    return estimate(list(seed_differences(values, base).values()))


def format_estimate(value: Estimate | None, digits: int, planned: int, *, signed: bool = False) -> str:
    """'20.19 ± 0.31'; '(n=2)' added when fewer than `planned` values went in; '–' for none."""
    if value is None:
        return "–"
    sign = "+" if signed else ""
    text = f"{value.mean:{sign}.{digits}f}"
    if value.std is not None:
        text += f" ± {value.std:.{digits}f}"
    if value.n < planned:
        text += f" (n={value.n})"
    return text


def read_run(run: Run, config) -> RunResult | None:
    """The numbers of `run` (whose config is `config`), or None if it has not finished."""
    scores = final_scores(config, run.workdir)
    if scores is None:
        return None
    train, valid = metric_log.read(run.workdir, "train"), metric_log.read(run.workdir, "valid")
    curve = {step: m["perplexity"] for step, m in valid.items() if m.get("perplexity") is not None}
    params = [m["num_params"] for m in train.values() if m.get("num_params") is not None]
    seconds = [m["seconds"] for step, m in train.items() if m.get("seconds") is not None and step <= scores["step"]]
    return RunResult(
        run=run,
        steps=scores["step"],
        num_params=int(params[-1]) if params else None,
        train_seconds=float(sum(seconds)) if seconds else None,
        valid_perplexity=curve.get(scores["step"]),
        valid_curve=curve,
        test_bleu=scores["bleu"],
        test_chrf=scores["chrf"],
        signature=scores["signature"],
        decoding=scores["decoding"],
        test_translations=read_translations(Workdir(run.workdir).evaluation(config.eval.split), run.references),
    )


# The per-variant columns of results.csv: column -> (RunResult field, scale).
_METRICS = {
    "train_minutes": ("train_seconds", 1 / 60),
    "valid_perplexity": ("valid_perplexity", 1.0),
    "test_bleu": ("test_bleu", 1.0),
    "test_chrf": ("test_chrf", 1.0),
}
_COMPARED = ("valid_perplexity", "test_bleu", "test_chrf")  # Differences to the base row (also RunResult fields).


@dataclasses.dataclass(frozen=True)
class VariantSummary:
    """A variant's row: its finished runs, estimates of each metric and differences to the base."""

    variant: Variant
    results: list[RunResult]
    planned: int
    estimates: dict[str, Estimate | None]
    differences: dict[str, Estimate | None]
    significance: Significance | None = None  # Test BLEU against the base, seed by seed.
    # seed -> test BLEU minus the same seed's base run's ({} for the base): which way each seed's difference goes.
    bleu_differences: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def num_params(self) -> int | None:
        return next((r.num_params for r in self.results if r.num_params is not None), None)

    @property
    def steps(self) -> int | None:
        return max((r.steps for r in self.results), default=None)


def summarize(variants: Sequence[Variant], results: Sequence[RunResult], planned: Mapping[str, int]):
    """One `VariantSummary` per variant, in order; differences and significance are to the first variant (the base)."""

    def by_seed(name: str, field: str) -> dict[int, float | None]:
        return {r.run.seed: getattr(r, field) for r in results if r.run.variant == name}

    translations = {
        variant.name: {seed: found for seed, found in by_seed(variant.name, "test_translations").items() if found}
        for variant in variants
    }
    tests = against_base(translations, variants[0].name)
    summaries = []
    for variant in variants:
        mine = [r for r in results if r.run.variant == variant.name]
        estimates = {
            column: estimate([_scaled(getattr(r, field), scale) for r in mine])
            for column, (field, scale) in _METRICS.items()
        }
        differences = {
            column: paired_difference(by_seed(variant.name, column), by_seed(variants[0].name, column))
            if variant is not variants[0]
            else None
            for column in _COMPARED
        }
        bleu_differences = {}
        if variant is not variants[0]:
            bleu_differences = seed_differences(
                by_seed(variant.name, "test_bleu"), by_seed(variants[0].name, "test_bleu")
            )
        summaries.append(
            VariantSummary(
                variant, mine, planned[variant.name], estimates, differences, tests.get(variant.name), bleu_differences
            )
        )
    return summaries


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def record_figures(summaries: Sequence[VariantSummary]) -> dict:
    """The table as a record's figures: per variant its runs, estimates, differences to the base and p-values.

    Each variant's test BLEU is also given seed by seed, with its difference to the base run of that seed:
    a seed's p-value says whether it differs, the sign which way (seeds may differ in opposite directions).
    """
    results = [r for s in summaries for r in s.results]
    return {
        "significance_level": LEVEL,
        "significance_test": sorted({s.significance.signature for s in summaries if s.significance}),
        "bleu_signature": sorted({r.signature for r in results if r.signature}),
        "decoding": sorted({r.decoding for r in results if r.decoding}),
        "variants": {s.variant.name: _variant_figures(s) for s in summaries},
    }


def _variant_figures(s: VariantSummary) -> dict:
    tested = s.significance
    by_seed = {r.run.seed: r.test_bleu for r in sorted(s.results, key=lambda r: r.run.seed)}
    return {
        "group": s.variant.group,
        "description": s.variant.description,
        "runs_finished": len(s.results),
        "runs_planned": s.planned,
        "params": s.num_params,
        "steps": s.steps,
        **{column: _estimate_figures(s.estimates[column]) for column in _METRICS},
        **{f"{column}_diff": _estimate_figures(s.differences[column]) for column in _COMPARED},
        "test_bleu_by_seed": {str(seed): bleu for seed, bleu in by_seed.items()},
        "test_bleu_diff_by_seed": {str(seed): difference for seed, difference in s.bleu_differences.items()},
        "test_bleu_p_values": None if tested is None else {str(seed): p for seed, p in tested.p_values.items()},
        "test_bleu_significant_seeds": None if tested is None else tested.significant,
        "test_bleu_holm_p_values": None
        if tested is None
        else {str(seed): p for seed, p in tested.holm_p_values.items()},
        "test_bleu_significant_seeds_after_holm": None if tested is None else tested.significant_after_holm,
        "paper": None if s.variant.paper is None else dataclasses.asdict(s.variant.paper),
    }


def _estimate_figures(value: Estimate | None) -> dict | None:
    """{'mean', 'std', 'n'}, with None for what is not finite (JSON has no NaN)."""
    if value is None:
        return None
    finite = {name: getattr(value, name) for name in ("mean", "std")}
    finite = {name: x if x is not None and math.isfinite(x) else None for name, x in finite.items()}
    return {**finite, "n": value.n}


@dataclasses.dataclass(frozen=True)
class Collected:
    """What `collect` found: each variant's row, the runs not finished, and results.md's text without its title."""

    summaries: list[VariantSummary]
    unfinished: list[Run]
    page: list[str]


def collect(sweep: Sweep, root: str, runs: Sequence[Run]) -> Collected:
    """Reads `runs` of `sweep` and writes the results under `root`.

    `runs` are every planned (variant, seed): those not finished are left out of the numbers and listed.
    """
    results, unfinished, changed = [], [], {}
    for run in runs:
        try:
            config = sweep.run_config(run)
        except UserInputError:  # A variant of a feature this checkout lacks: it cannot have run.
            unfinished.append(run)
            continue
        if (result := read_run(run, config)) is not None:
            results.append(result)
        else:
            unfinished.append(run)
            if changes := config_changes(config, run.workdir):
                changed[run] = changes
    planned = {variant.name: sum(run.variant == variant.name for run in runs) for variant in sweep.variants}
    summaries = summarize(sweep.variants, results, planned)
    lines = page(summaries, unfinished, changed)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join([f"# Sweep results: {os.path.basename(sweep.path)}", "", *lines]) + "\n")
    _write_csv(os.path.join(root, "results.csv"), summaries)
    _write_runs_csv(os.path.join(root, "results_runs.csv"), results)
    return Collected(summaries, unfinished, lines)


def _tests_count(summaries: Sequence[VariantSummary]) -> int:
    return sum(len(s.significance.p_values) for s in summaries if s.significance)


def _params(count: int | None) -> str:
    return "–" if count is None else f"{count / 1e6:.2f}M"


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def page(
    summaries: Sequence[VariantSummary], unfinished: Sequence[Run], changed: Mapping[Run, Sequence[str]]
) -> list[str]:
    """results.md's lines after its title: what the cells mean, the table, the runs left out and their changes."""
    results = [r for s in summaries for r in s.results]
    seeds = max(s.planned for s in summaries)
    signatures = sorted({r.signature for r in results if r.signature})
    decodings = sorted({r.decoding for r in results if r.decoding})
    tests = sorted({s.significance.signature for s in summaries if s.significance})
    lines = [
        f"{len(results)} of {len(results) + len(unfinished)} runs finished ({seeds} seed{'s' * (seeds != 1)} planned "
        "per variant). "
        "Each cell is the mean ± sample standard deviation over the finished seeds ((n=k): only k finished). "
        "Δ: the difference to the base run of the same seed (same data order and tokenizer), mean ± standard "
        "deviation over the seeds both finished, then (by seed) each seed's, in seed order. BLEU p: sacreBLEU's "
        "paired bootstrap resampling of the test sentences, each seed's run against the base run of the same seed "
        f"({'; '.join(tests) or 'no test yet'}); k/n: k of the n seeds compared differ at p < "
        f"{LEVEL}, then each seed's p-value. Holm: the same after Holm's step-down correction over all "
        f"the table's tests ({_tests_count(summaries)}), which keeps the chance of any false difference in the "
        f"table under {LEVEL}. Validation perplexity per subword at the last step; test BLEU "
        f"and chrF detokenized sacreBLEU ({'; '.join(signatures) or 'no scores yet'}), decoding: "
        f"{', '.join(decodings) or '–'}. Train min: the training steps, evaluation excluded. Paper: Vaswani et "
        "al. (2017), Table 3 (newstest2013, perplexity per wordpiece, BLEU, parameters): another corpus and "
        "scale, so compare the direction and size of the differences, not the numbers.",
        "",
        "| variant | row | what | n | params | steps | train min | valid PPL | Δ PPL | test BLEU | Δ BLEU "
        "| Δ BLEU by seed | BLEU p | Holm | chrF | Δ chrF | paper row | paper PPL | paper BLEU | paper params |",
        "|" + "---|" * 20,
    ]
    for s in summaries:
        e, d, paper = s.estimates, s.differences, s.variant.paper
        cells = [
            s.variant.name,
            s.variant.group,
            s.variant.description,
            f"{len(s.results)}/{s.planned}",
            _params(s.num_params),
            "–" if s.steps is None else str(s.steps),
            format_estimate(e["train_minutes"], 1, s.planned),
            format_estimate(e["valid_perplexity"], 2, s.planned),
            format_estimate(d["valid_perplexity"], 2, s.planned, signed=True),
            format_estimate(e["test_bleu"], 2, s.planned),
            format_estimate(d["test_bleu"], 2, s.planned, signed=True),
            ", ".join(f"{difference:+.2f}" for difference in s.bleu_differences.values()) or "–",
            s.significance.describe() if s.significance else "–",
            s.significance.describe_holm() if s.significance else "–",
            format_estimate(e["test_chrf"], 1, s.planned),
            format_estimate(d["test_chrf"], 1, s.planned, signed=True),
            paper.row if paper else "–",
            _number(paper.perplexity if paper else None, 2),
            _number(paper.bleu if paper else None, 1),
            "–" if paper is None or paper.params_millions is None else f"{paper.params_millions:g}M",
        ]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    if unfinished:
        lines += ["", f"Not finished ({len(unfinished)}), left out of the numbers:", ""]
        lines += [
            f"- {run.label}" + (f" (trained with another config: {'; '.join(changed[run])})" if run in changed else "")
            for run in unfinished
        ]
    return lines


def _write_csv(path: str, summaries: Sequence[VariantSummary]) -> None:
    header = ["variant", "group", "description", "runs_finished", "runs_planned", "params", "steps"]
    for column in _METRICS:
        header += [f"{column}_mean", f"{column}_std"]
        if column in _COMPARED:
            header += [f"{column}_diff", f"{column}_diff_std"]
    # 'seed:p' for each seed compared, space-separated; how many of them are below LEVEL.
    header += ["test_bleu_p_values", "test_bleu_significant_seeds"]
    header += ["test_bleu_holm_p_values", "test_bleu_significant_seeds_after_holm"]
    header += ["paper_row", "paper_perplexity", "paper_bleu", "paper_params_millions"]
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for s in summaries:
            row = [s.variant.name, s.variant.group, s.variant.description, len(s.results), s.planned]
            row += [_blank(s.num_params), _blank(s.steps)]
            for column in _METRICS:
                row += _mean_std(s.estimates[column])
                if column in _COMPARED:
                    row += _mean_std(s.differences[column])
            row += _significance_cells(s.significance)
            paper = s.variant.paper
            row += (
                [paper.row, _blank(paper.perplexity), _blank(paper.bleu), _blank(paper.params_millions)]
                if paper
                else [""] * 4
            )
            writer.writerow(row)


def _write_runs_csv(path: str, results: Sequence[RunResult]) -> None:
    header = ["variant", "seed", "params", "steps", "train_seconds", "valid_perplexity", "test_bleu", "test_chrf"]
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for r in results:
            writer.writerow(
                [r.run.variant, r.run.seed, _blank(r.num_params), r.steps]
                + [_blank(r.train_seconds), _blank(r.valid_perplexity), _blank(r.test_bleu), _blank(r.test_chrf)]
            )


def _significance_cells(tested: Significance | None) -> list[str]:
    if tested is None:
        return [""] * 4
    return [
        " ".join(f"{seed}:{p!r}" for seed, p in sorted(tested.p_values.items())),
        str(tested.significant),
        " ".join(f"{seed}:{p!r}" for seed, p in sorted(tested.holm_p_values.items())),
        str(tested.significant_after_holm),
    ]


def _blank(value) -> str:
    """A CSV cell: '' for None or a number that is not finite."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def _mean_std(value: Estimate | None) -> list[str]:
    return ["", ""] if value is None else [_blank(value.mean), _blank(value.std)]
