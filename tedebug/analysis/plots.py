"""Figures of the report: statistic lines over iterations, layer × iteration heatmaps, comparison heatmaps.

matplotlib (the field's default; its Agg renderer needs no display and writes PNG, SVG and PDF alike) draws every
figure through the object API (`matplotlib.figure.Figure`, no pyplot state), so building a report never touches a
user's interactive backend.  Each function takes plain numpy arrays and returns a `Figure`; `encode` turns one into
bytes of a format.

Large runs stay fast: a matrix with more than `MAX_COLUMNS` iterations (`MAX_LINE_POINTS` for line charts) is binned
to that many columns keeping the
*largest* value of each bin (a spike survives downsampling), and all ordinary lines of a chart are one
`LineCollection` (a single draw call).  Lines of the highlighted (worst) layers are drawn on top in colour, every
other layer in thin grey.
"""

from __future__ import annotations

import io
from typing import List, Optional, Sequence, Tuple

import numpy as np

MAX_COLUMNS = 400
MAX_LINE_POINTS = 250
HIGHLIGHT_COLOURS = ("#d62728", "#1f77b4", "#ff7f0e")
GREY = "#9a9a9a"
DPI = 80


def downsample(
    iterations: np.ndarray, matrix: np.ndarray, max_columns: int = MAX_COLUMNS
) -> Tuple[np.ndarray, np.ndarray]:
    """(iterations, matrix) with at most `max_columns` columns: equal-width bins of columns, each keeping the first
    iteration of the bin and, per row, the largest value (NaN where the whole bin is NaN; a NaN among numbers is
    not a maximum: non-finite values are reported in their own table)."""
    n = matrix.shape[1]
    if n <= max_columns:
        return iterations, matrix
    edges = np.linspace(0, n, max_columns + 1).astype(np.int64)
    starts = edges[:-1]
    missing = np.isnan(matrix)
    binned = np.maximum.reduceat(np.where(missing, -np.inf, matrix), starts, axis=1)
    counts = np.add.reduceat((~missing).astype(np.int64), starts, axis=1)
    binned[counts == 0] = np.nan
    return iterations[starts], binned


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI)  # margins set by _margins (constrained layout: 2x slower)


def _margins(
    figure,
    *,
    left: float,
    right: float = 0.25,
    top: float = 0.65,
    bottom: float = 0.5,
    gap: float = 0.6,
    panels: int = 1,
) -> None:
    """Fixed margins in inches (`gap`: between panels)."""
    width, height = figure.get_size_inches()
    panel = max((width - left - right - gap * (panels - 1)) / panels, 0.5)
    figure.subplots_adjust(
        left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height, wspace=gap / panel
    )


def _use_log_scale(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return finite.size > 0 and bool(np.all(finite > 0)) and finite.max() / finite.min() > 1e3


def line_chart(title: str, panels: Sequence[Tuple[str, np.ndarray, np.ndarray, Sequence[str], Sequence[int]]]):
    """One row of panels; each panel is (tensor, iterations, matrix [layers × iterations], layer names, indices of
    the rows to highlight, worst first)."""
    from matplotlib.collections import LineCollection

    figure = _figure(4.6 * len(panels) + 0.4, 3.4)
    _margins(figure, left=0.75, gap=0.75, panels=len(panels))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (tensor, iterations, matrix, names, highlight) in zip(axes, panels):
        iterations, matrix = downsample(iterations, matrix, MAX_LINE_POINTS)
        x = iterations.astype(np.float64)
        log = _use_log_scale(matrix)
        plotted = np.where(np.isfinite(matrix), matrix, np.nan)
        if log:
            ax.set_yscale("log")
        rest = [np.column_stack([x, row]) for i, row in enumerate(plotted) if i not in set(highlight)]
        if rest:
            ax.add_collection(
                LineCollection(
                    rest, colors=GREY, linewidths=0.6, antialiaseds=len(rest) < 64, label=f"other layers ({len(rest)})"
                )
            )
        for colour, i in zip(HIGHLIGHT_COLOURS, highlight):
            ax.plot(x, plotted[i], color=colour, linewidth=1.6, label=names[i])
        finite = plotted[np.isfinite(plotted)]
        if finite.size:
            low, high = finite.min(), finite.max()
            pad = (high - low) * 0.05 or abs(high) * 0.05 or 1.0
            ax.set_ylim(low / 1.5 if log else low - pad, high * 1.5 if log else high + pad)
        if x.size:
            ax.set_xlim(x.min(), x.max() if x.max() > x.min() else x.min() + 1)
        ax.set_title(f"{tensor}", fontsize=10)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", framealpha=0.7)  # "best" scans every line: slow
    figure.suptitle(title, fontsize=11)
    return figure


def heatmap(
    title: str,
    panels: Sequence[Tuple[str, np.ndarray, np.ndarray, Sequence[str]]],
    *,
    log_colour: bool = False,
    colour_label: str = "",
    cmap: str = "viridis",
    vmin: Optional[float] = None,
    vmax: Optional[float] = None,
):
    """Panels of (tensor, iterations, matrix [layers × iterations], layer names): layers top to bottom in model
    order, iterations left to right; missing points blank.  `log_colour` uses a log colour scale (positive values
    only; zeros shown blank)."""
    from matplotlib.colors import LogNorm, Normalize

    rows = max(len(p[3]) for p in panels)
    label = 0.15 + 0.045 * max((len(name) for p in panels for name in p[3]), default=4)  # layer names, 6 pt
    figure = _figure((3.6 + label) * len(panels) + 1.4, min(2.0 + 0.07 * rows, 11.0))
    _margins(figure, left=label, right=1.3, gap=label + 0.1, panels=len(panels))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    shown = []
    for tensor, iterations, matrix, names in panels:
        iterations, matrix = downsample(iterations, matrix)
        values = np.where(np.isfinite(matrix), matrix, np.nan)
        if log_colour:
            values = np.where(values > 0, values, np.nan)
        shown.append((tensor, iterations, values, names))
    everything = np.concatenate([v.ravel() for _, _, v, _ in shown])
    finite = everything[np.isfinite(everything)]
    low = vmin if vmin is not None else (finite.min() if finite.size else 0.0)
    high = vmax if vmax is not None else (finite.max() if finite.size else 1.0)
    if high <= low:
        high = low + (abs(low) or 1.0) * 1e-6 if not log_colour else low * 10
    norm = LogNorm(vmin=low, vmax=high) if log_colour and finite.size else Normalize(vmin=low, vmax=high)
    image = None
    for ax, (tensor, iterations, values, names) in zip(axes, shown):
        x0 = float(iterations[0]) if iterations.size else 0.0
        x1 = float(iterations[-1]) if iterations.size else 0.0
        half = (x1 - x0) / (2 * (iterations.size - 1)) if iterations.size > 1 else 0.5  # columns centred
        image = ax.imshow(
            np.ma.masked_invalid(values),
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            norm=norm,
            extent=(x0 - half, x1 + half, len(names) - 0.5, -0.5),
        )
        ax.set_title(tensor, fontsize=10)
        ax.set_xlabel("iteration")
        step = max(1, -(-len(names) // 48))  # at most 48 labels
        ax.set_yticks(range(0, len(names), step))
        ax.set_yticklabels([names[i] for i in range(0, len(names), step)], fontsize=6)
    if image is not None:
        width = figure.get_size_inches()[0]
        bar = figure.add_axes(
            (1 - 1.05 / width, axes[0].get_position().y0, 0.18 / width, axes[0].get_position().height)
        )
        figure.colorbar(image, cax=bar, label=colour_label)
    figure.suptitle(title, fontsize=11)
    return figure


def encode(figure, fmt: str = "png") -> bytes:
    """The figure as bytes of `fmt` (png, svg, pdf)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt, dpi=DPI if fmt == "png" else None)
    return buffer.getvalue()


def highlight_rows(matrix: np.ndarray, k: int = 3) -> List[int]:
    """Rows with the largest peak magnitude over all columns (non-finite values ignored), worst first."""
    magnitude = np.where(np.isfinite(matrix), np.abs(matrix), -np.inf)
    peaks = magnitude.max(axis=1) if magnitude.size else np.full(matrix.shape[0], -np.inf)
    order = [int(i) for i in np.argsort(-peaks, kind="stable") if np.isfinite(peaks[i])]
    return order[:k]
