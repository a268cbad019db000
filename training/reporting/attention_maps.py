"""Attention maps as labelled heat maps: one figure per (stack, layer, kind of attention), one panel per head.

`attention_figures` draws a `SentenceAttention` (attention_weights.py); `save_attention_maps` writes
the figures as PNG files and `write_attention_summaries` sends them to TensorBoard. The same weights
also make an interactive page (attention_page.py).

Figures are plain `matplotlib.figure.Figure` objects on an Agg canvas, never registered with
pyplot: nothing needs a display, no global backend is switched, and a figure is freed as soon
as the caller drops it.
"""

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from training.reporting.attention_page import PAGE_FILE, PageSentence, write_attention_page
from training.reporting.attention_weights import SentenceAttention
from training.reporting.metrics_writer import MetricWriter

if TYPE_CHECKING:  # matplotlib is imported only when a map is drawn (half a second of every translate.py start).
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.figure import Figure

# Up to this many tokens on an axis, heat map cells and tick labels keep their full size
# (_CELL_INCHES, _FONT_POINTS). Longer sentences still render completely, but the panel is
# capped at this many cells' worth of space and cells and labels shrink in proportion, so
# labels never overlap (they become small: 4.5 pt at 80 tokens).
READABLE_TOKENS = 40
_CELL_INCHES = 0.22
_FONT_POINTS = 9.0
_MIN_PANEL_INCHES = 1.6  # Short sentences get larger cells rather than a postage stamp.
_DPI = 100
_TITLE_POINTS, _AXIS_NAME_POINTS = 12.0, 10.0
# Inches: between panels; for the figure title; for an axis name; right of the grid for the
# colour bar and its labels; the least space around a title or axis name.
_GAP, _SUPTITLE, _OUTER_LABEL, _COLORBAR, _MARGIN = 0.25, 0.55, 0.4, 1.0, 0.2

# Per kind of attention: what the rows (queries) and columns (keys) are labelled with.
_AXIS_LABELS = {
    "self_attention": {
        "encoder": ("query: source token", "key: source token"),
        "decoder": ("query: token being predicted", "key: decoder input token"),
    },
    "cross_attention": {"decoder": ("query: token being predicted", "key: source token")},
}


# --------------------------------------------------------------------------- #
# Drawing.
# --------------------------------------------------------------------------- #


def _title(name: str) -> str:
    """'decoder/layer_1/cross_attention' -> 'Decoder layer 1: cross-attention'."""
    stack, layer, kind = name.split("/")
    return f"{stack.capitalize()} {layer.replace('_', ' ')}: {kind.replace('_', '-')}"


def _grid_shape(num_heads: int) -> tuple[int, int]:
    """(rows, columns) of head panels: square-ish, wider than tall (4 -> 2x2, 8 -> 2x4)."""
    rows = math.isqrt(num_heads)
    return rows, math.ceil(num_heads / rows)


def _text_inches(renderer: "RendererAgg", texts: Sequence[str], font_points: float) -> float:
    """Length of the longest of `texts` set in `font_points`, measured by the renderer that draws them."""
    from matplotlib.font_manager import FontProperties  # pylint: disable=g-import-not-at-top

    font = FontProperties(size=font_points)
    return max(renderer.get_text_width_height_descent(text, font, ismath=False)[0] for text in set(texts)) / _DPI


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the parts of an attention figure go, in inches from its top left corner.

    The head panels form a grid; each panel is its row labels, the heat map, its column
    labels below and the head's title above, with `_GAP` to the next panel. The colour bar
    stands right of the grid, the figure title above it, the axis names left of it and below.
    """

    width: float
    height: float
    font: float  # Tick labels, in points.
    columns: int
    grid_left: float  # Left edge of the first panel's row labels.
    row_labels: float
    head_title: float
    heat_width: float
    heat_height: float
    panel_width: float
    panel_height: float
    heat_maps_top: float  # Top of the first row of heat maps.
    heat_maps_bottom: float  # Bottom of the last row of heat maps.
    query_label_center: float  # Vertical centre of the rotated query axis name.

    @classmethod
    def fit(
        cls,
        renderer: "RendererAgg",
        shape: tuple[int, int, int],
        query_pieces: Sequence[str],
        key_pieces: Sequence[str],
        title: str,
        query_label: str,
    ) -> "_Layout":
        """Sizes the figure for `shape` [heads, q_len, kv_len], measuring the labels it will carry."""
        num_heads, q_len, kv_len = shape
        shrink = min(1.0, READABLE_TOKENS / max(q_len, kv_len))
        font = _FONT_POINTS * shrink
        cell = max(_CELL_INCHES * shrink, _MIN_PANEL_INCHES / max(q_len, kv_len))
        tick = 5 / 72  # Tick length and padding.
        row_labels = _text_inches(renderer, query_pieces, font) + tick
        column_labels = _text_inches(renderer, key_pieces, font) + tick
        head_title = 1.6 * (font + 1) / 72
        rows, columns = _grid_shape(num_heads)
        heat_width, heat_height = kv_len * cell, q_len * cell
        panel_width = row_labels + heat_width + _GAP
        panel_height = head_title + heat_height + column_labels + _GAP
        grid_width, grid_height = columns * panel_width, rows * panel_height - _GAP

        # The title is centred over the grid; a grid narrower than the title is moved right
        # to keep the title clear of the query axis name.
        title_width = _text_inches(renderer, [title], _TITLE_POINTS)
        grid_left = _OUTER_LABEL + max(0.0, title_width / 2 - grid_width / 2)
        width = max(grid_left + grid_width + _COLORBAR, grid_left + grid_width / 2 + title_width / 2 + _MARGIN)
        # The query axis name is centred on the heat maps, and the figure tall enough to hold it.
        heat_maps_top = _SUPTITLE + head_title
        heat_maps_bottom = heat_maps_top + (rows - 1) * panel_height + heat_height
        query_label_length = _text_inches(renderer, [query_label], _AXIS_NAME_POINTS)
        height = max(_SUPTITLE + grid_height + _OUTER_LABEL, query_label_length + 2 * _MARGIN)
        center = (heat_maps_top + heat_maps_bottom) / 2
        center = min(max(center, query_label_length / 2 + _MARGIN), height - query_label_length / 2 - _MARGIN)
        # Whole pixels, so that every renderer (PNG, TensorBoard) makes the same image size.
        return cls(
            width=math.ceil(width * _DPI) / _DPI,
            height=math.ceil(height * _DPI) / _DPI,
            font=font,
            columns=columns,
            grid_left=grid_left,
            row_labels=row_labels,
            head_title=head_title,
            heat_width=heat_width,
            heat_height=heat_height,
            panel_width=panel_width,
            panel_height=panel_height,
            heat_maps_top=heat_maps_top,
            heat_maps_bottom=heat_maps_bottom,
            query_label_center=center,
        )

    def _fractions(self, left: float, top: float, width: float, height: float) -> list[float]:
        """[left, bottom, width, height] in figure fractions, as `Figure.add_axes` takes them."""
        return [left / self.width, 1 - (top + height) / self.height, width / self.width, height / self.height]

    def heat_map(self, head: int) -> list[float]:
        row, column = divmod(head, self.columns)
        left = self.grid_left + column * self.panel_width + self.row_labels
        top = _SUPTITLE + row * self.panel_height + self.head_title
        return self._fractions(left, top, self.heat_width, self.heat_height)

    def colorbar(self) -> list[float]:
        """Right of the grid, as tall as the heat maps."""
        left = self.grid_left + self.columns * self.panel_width
        return self._fractions(left, self.heat_maps_top, 0.15, self.heat_maps_bottom - self.heat_maps_top)

    def title_x(self) -> float:
        return (self.grid_left + self.columns * self.panel_width / 2) / self.width


def attention_figure(
    weights: np.ndarray, query_pieces: Sequence[str], key_pieces: Sequence[str], name: str
) -> "Figure":
    """One heat map per head of `weights` [heads, q_len, kv_len], on a shared colour scale.

    Rows are queries, labelled with `query_pieces` [q_len]; columns are keys, labelled with
    `key_pieces` [kv_len] (written vertically). Cells are square and every panel carries its
    own labels. The figure grows with the number of tokens; past READABLE_TOKENS it stops
    growing and cells and labels shrink instead.

    The layout is computed from measured label sizes (`_Layout`) rather than by matplotlib's
    constrained layout, which re-measures every tick label several times per draw (seconds
    for a figure of 8 heads x 50 tokens).
    """
    num_heads, q_len, kv_len = weights.shape
    if (len(query_pieces), len(key_pieces)) != (q_len, kv_len):
        raise ValueError(
            f"{name}: weights are [{num_heads}, {q_len}, {kv_len}] but there are {len(query_pieces)} query "
            f"and {len(key_pieces)} key pieces."
        )
    stack, _, kind = name.split("/")
    query_label, key_label = _AXIS_LABELS[kind][stack]
    title = _title(name)

    from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
    from matplotlib.colors import Normalize  # pylint: disable=g-import-not-at-top
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

    figure = Figure(dpi=_DPI)
    renderer = FigureCanvasAgg(figure).get_renderer()
    layout = _Layout.fit(renderer, weights.shape, query_pieces, key_pieces, title, query_label)
    figure.set_size_inches(layout.width, layout.height)

    # One scale for all heads so their colours compare; up to the largest weight rather
    # than 1, so that diffuse attention over a long sentence is still visible.
    norm = Normalize(vmin=0.0, vmax=max(float(weights.max()), 1e-6))
    text_style = {"fontsize": layout.font, "parse_math": False}  # Pieces may hold '$'.
    for head in range(num_heads):
        ax = figure.add_axes(layout.heat_map(head))
        image = ax.imshow(weights[head], cmap="viridis", norm=norm, interpolation="nearest", aspect="auto")
        ax.set_xticks(range(kv_len), labels=key_pieces, rotation=90, **text_style)
        ax.set_yticks(range(q_len), labels=query_pieces, **text_style)
        ax.tick_params(length=2, pad=1)
        # A fixed title position and fixed (empty) axis label positions spare matplotlib
        # from measuring every tick label again to dodge them: a third of the drawing time.
        ax.set_title(f"head {head}", fontsize=layout.font + 1, pad=3, y=1.0)
        ax.xaxis.set_label_coords(0.5, 0.0)
        ax.yaxis.set_label_coords(0.0, 0.5)
    figure.colorbar(image, cax=figure.add_axes(layout.colorbar()), label="attention weight")

    figure.suptitle(title, x=layout.title_x(), y=1 - 0.15 / layout.height, va="top", fontsize=_TITLE_POINTS)
    axis_name = {"fontsize": _AXIS_NAME_POINTS, "parse_math": False}
    figure.text(layout.title_x(), 0.1 / layout.height, key_label, ha="center", va="bottom", **axis_name)
    query_label_y = 1 - layout.query_label_center / layout.height
    figure.text(0.1 / layout.width, query_label_y, query_label, rotation=90, ha="left", va="center", **axis_name)
    return figure


def attention_figures(attention: SentenceAttention) -> dict[str, "Figure"]:
    """A figure per map of `attention`, under the same names, its rows and columns labelled with the pieces."""
    return {name: attention_figure(w, *attention.axis_pieces(name), name) for name, w in attention.weights.items()}


def figure_file_name(name: str) -> str:
    """'encoder/layer_0/self_attention' -> 'encoder_layer0_self_attention.png'."""
    return name.replace("layer_", "layer").replace("/", "_") + ".png"


def save_attention_maps(figures: Mapping[str, "Figure"], out_dir: str) -> list[str]:
    """Writes each figure of `attention_figures` as `out_dir/<figure_file_name(name)>`; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, figure in figures.items():
        path = os.path.join(out_dir, figure_file_name(name))
        figure.savefig(path)
        paths.append(path)
    return paths


def save_attention(sentences: Sequence[PageSentence], out_dir: str, title: str) -> str:
    """Each sentence's maps as PNGs in `out_dir/<its name, '_' for ' '>/`, and all of them on one page,
    `out_dir/index.html` (attention_page.py); returns the page's path."""
    for sentence in sentences:
        folder = os.path.join(out_dir, sentence.name.replace(" ", "_"))
        paths = save_attention_maps(attention_figures(sentence.attention), folder)
        logging.info("%s: %d attention maps in %s.", sentence.name.capitalize(), len(paths), folder)
    path = write_attention_page(sentences, os.path.join(out_dir, PAGE_FILE), title)
    logging.info("Every line's attention on one page: %s", path)
    return path


def write_attention_summaries(writer: MetricWriter, step: int, figures: Mapping[str, "Figure"]) -> None:
    """Adds each figure of `attention_figures` to TensorBoard as an image tagged 'attention/<name>'."""
    writer.write_figures(step, {f"attention/{name}": figure for name, figure in figures.items()})


def write_attention_summary(writer, step: int, attention: SentenceAttention) -> None:
    """Puts the attention maps of one sentence (pair) into TensorBoard."""
    write_attention_summaries(writer, step, attention_figures(attention))
