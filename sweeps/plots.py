"""The sweep's two pictures: test BLEU per variant with error bars, and validation perplexity curves.

Plain `matplotlib.figure.Figure` objects on an Agg canvas (no pyplot, no display), saved as PNG.
"""

import os
from collections.abc import Sequence

import numpy as np
from matplotlib import colormaps, ticker
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sweeps.report import VariantSummary

_DPI = 120


def draw(root: str, summaries: Sequence[VariantSummary]) -> None:
    """<root>/results_bleu.png and valid_curves.png, once some variant has a test BLEU."""
    if any(s.estimates["test_bleu"] for s in summaries):
        bleu_bars(os.path.join(root, "results_bleu.png"), summaries)
        valid_curves(os.path.join(root, "valid_curves.png"), summaries)


def draw_beside_record(record_path: str, summaries: Sequence[VariantSummary]) -> None:
    """The two pictures as <record_path>_bleu.png and <record_path>_valid_curves.png, beside the record's page,
    once some variant has a test BLEU."""
    if any(s.estimates["test_bleu"] for s in summaries):
        bleu_bars(f"{record_path}_bleu.png", summaries)
        valid_curves(f"{record_path}_valid_curves.png", summaries)


def record_pictures(record_path: str, summaries: Sequence[VariantSummary]) -> list[str]:
    """The Markdown lines that show `draw_beside_record`'s pictures on the record's page (none if it draws none)."""
    if not any(s.estimates["test_bleu"] for s in summaries):
        return []
    name = os.path.basename(record_path)
    return [
        f"![Test BLEU per variant, mean ± std over seeds]({name}_bleu.png)",
        "",
        f"![Validation perplexity per variant, the mean over its seeds]({name}_valid_curves.png)",
    ]


def bleu_bars(path: str, summaries: Sequence[VariantSummary]) -> None:
    """Horizontal bars of the mean test BLEU per variant (top: the base), ± one standard deviation over seeds.

    Variants without a finished run are left out; those with fewer seeds than planned say n=k.
    """
    shown = [s for s in summaries if s.estimates["test_bleu"] is not None]
    means = np.array([s.estimates["test_bleu"].mean for s in shown])
    errors = np.array([s.estimates["test_bleu"].std or 0.0 for s in shown])
    labels = [_label(s) for s in shown]
    figure = Figure(figsize=(11, max(2.5, 1.2 + 0.32 * len(shown))), dpi=_DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    rows = np.arange(len(shown))
    colors = ["tab:gray" if i == 0 and shown[0] is summaries[0] else "tab:blue" for i in range(len(shown))]
    axes.barh(rows, means, xerr=errors, color=colors, ecolor="black", capsize=3, height=0.65)
    if shown[0] is summaries[0]:  # The base's mean, to read the differences against.
        axes.axvline(means[0], color="tab:gray", linestyle="--", linewidth=1)
    for row, (mean, error) in enumerate(zip(means, errors)):
        axes.text(mean + error + 0.2, row, f"{mean:.2f}", va="center", fontsize=8)
    axes.set_yticks(rows, labels, fontsize=9)
    axes.invert_yaxis()
    axes.set_xlim(0, float(np.max(means + errors)) * 1.12 + 1)
    axes.set_xlabel("test BLEU (mean ± std over seeds)")
    axes.set_title("Test BLEU per variant", fontsize=11)
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)


def valid_curves(path: str, summaries: Sequence[VariantSummary]) -> None:
    """Validation perplexity (log scale) against step, one line per variant: the mean over its finished seeds
    at the steps they all have."""
    figure = Figure(figsize=(13, 6.5), dpi=_DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    tab20 = colormaps["tab20"]
    colors = [tab20(i) for i in range(0, 20, 2)] + [tab20(i) for i in range(1, 20, 2)]  # Strong shades first.
    curves = {s.variant.name: _mean_curve(s) for s in summaries if s.results}
    base = summaries[0]
    if base.results:  # The base: thick and black, first in the legend.
        axes.plot(*curves[base.variant.name], label=_label(base), color="black", linewidth=2.4, marker="o")
    for index, s in enumerate(s for s in summaries[1:] if s.results):
        axes.plot(
            *curves[s.variant.name],
            label=_label(s),
            color=colors[index % len(colors)],
            linestyle="-" if index < len(colors) else "--",
            linewidth=1.3,
            marker="o",
            markersize=3,
        )
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axes.yaxis.set_minor_formatter(ticker.FuncFormatter(_label_2_3_and_5))
    axes.set_xticks(evaluation_ticks(sorted({step for steps, _ in curves.values() for step in steps})))
    axes.set_xlabel("training step")
    axes.set_ylabel("validation perplexity (mean over seeds, log scale)")
    axes.set_title("Validation perplexity during training", fontsize=11)
    axes.grid(which="both", alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path)


def evaluation_ticks(steps: Sequence[int], max_ticks: int = 12) -> list[int]:
    """The steps to mark on the x axis: the evaluation steps, every k-th one (the last always) if there are many."""
    every = max(1, -(-len(steps) // max_ticks))  # Ceiling division; no steps give no ticks.
    return list(steps[::-1][::every][::-1])


def _label_2_3_and_5(value: float, _) -> str:
    """Minor ticks of a log axis labelled at 2, 3 and 5 times a power of ten only (20, 30, 50, 200, ...)."""
    leading = value / 10 ** np.floor(np.log10(value))
    return f"{value:g}" if round(leading) in (2, 3, 5) and abs(leading - round(leading)) < 1e-6 else ""


def _mean_curve(summary: VariantSummary) -> tuple[list[int], list[float]]:
    """The steps every finished seed validated at, and the mean perplexity there."""
    steps = sorted(set.intersection(*(set(r.valid_curve) for r in summary.results)))
    return steps, [float(np.mean([r.valid_curve[step] for r in summary.results])) for step in steps]


def _label(summary: VariantSummary) -> str:
    """'heads_1 (h=1, d_k=d_v=256)', with n=k when fewer seeds than planned finished."""
    n = len(summary.results)
    seeds = f", n={n}" if n < summary.planned else ""
    return f"{summary.variant.name} ({summary.variant.description}{seeds})"
