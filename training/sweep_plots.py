"""The sweep's two pictures: test BLEU per variant with error bars, and validation perplexity curves.

Plain `matplotlib.figure.Figure` objects on an Agg canvas (no pyplot, no display), saved as PNG.
"""

from collections.abc import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from training.sweep_report import VariantSummary

_DPI = 120


def bleu_bars(path: str, summaries: Sequence[VariantSummary]) -> None:
    """Horizontal bars of the mean test BLEU per variant (top: the base), ± one standard deviation over seeds.

    Variants without a finished run are left out; those with fewer seeds than planned say n=k.
    """
    shown = [s for s in summaries if s.estimates["test_bleu"] is not None]
    means = np.array([s.estimates["test_bleu"].mean for s in shown])
    errors = np.array([s.estimates["test_bleu"].std or 0.0 for s in shown])
    labels = [_label(s) for s in shown]
    figure = Figure(figsize=(8, 1.2 + 0.32 * len(shown)), dpi=_DPI)
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
    figure = Figure(figsize=(10, 6), dpi=_DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    cmap = colormaps["tab20"]  # 20 colours; dashed lines past them.
    for index, s in enumerate(s for s in summaries if s.results):
        steps = sorted(set.intersection(*(set(r.valid_curve) for r in s.results)))
        if not steps:
            continue
        mean = [float(np.mean([r.valid_curve[step] for r in s.results])) for step in steps]
        base = s is summaries[0]
        axes.plot(
            steps,
            mean,
            label=_label(s),
            color="black" if base else cmap(index % 20),
            linestyle="-" if base or index < 20 else "--",
            linewidth=2.2 if base else 1.3,
            marker="o",
            markersize=3,
        )
    axes.set_yscale("log")
    axes.set_xlabel("training step")
    axes.set_ylabel("validation perplexity (mean over seeds, log scale)")
    axes.set_title("Validation perplexity during training", fontsize=11)
    axes.grid(which="both", alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path)


def _label(summary: VariantSummary) -> str:
    """'heads_1 (h=1, d_k=d_v=256)', with n=k when fewer seeds than planned finished."""
    n = len(summary.results)
    seeds = f", n={n}" if n < summary.planned else ""
    return f"{summary.variant.name} ({summary.variant.description}{seeds})"
