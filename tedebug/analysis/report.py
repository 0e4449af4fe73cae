"""`tedebug report RUN_DIR`: one self-contained HTML page (or a folder of figures) about a finished run.

Sections, in page order:

1. Overview: iterations, layers (model order), tensors, statistics and ranks in the record.
2. Non-finite events: every (layer, tensor) whose ``nan_count`` / ``inf_count`` was ever > 0 (with the GEMMs that
   read the tensor, first / last iteration and the largest count), every statistic whose *value* was NaN / Inf,
   and the engine's "First non-finite values" line from the main log.
3. Worst layers: per statistic the three (layer, tensor) pairs with the largest peak magnitude over the run, with
   their value at the last logged iteration.
4. Heatmaps (layers × iterations, one panel per tensor) of the quantization statistics whose name contains
   ``underflows%``, ``overflows%``, ``mse`` or ``dynamic_range`` (so also ``mxfp8_mse``, ``nvfp4_underflows%``,
   ``max_blockwise_dynamic_range``...).  MSE uses a log colour scale.
5. One chart per statistic: a panel per tensor, a line per layer over the iterations, the three worst layers (largest
   peak magnitude) in colour and the rest in grey.
6. With ``--compare OTHER_RUN``: the comparison of `tedebug.analysis.compare` (its text report, and a heatmap of the
   relative difference per statistic).
7. The config: the file named by the main log's "Reading config from ..." line (or ``--config``).

Images are PNG embedded as ``data:`` URIs, so the page opens offline and can be mailed; every figure is a
``<figure class="chart" data-kind=... data-stat=...>``.  ``--format png|svg|pdf`` writes the figures into a folder
instead (for papers), one file per figure, plus ``report.txt`` with the tables.  Lines and heatmaps are binned to at
most `tedebug.analysis.plots.MAX_COLUMNS` iterations (largest value per bin), so large runs stay fast.
"""

from __future__ import annotations

import base64
import glob
import html
import os
import re
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tedebug.analysis import plots
from tedebug.analysis.load import load_stats, model_depth_order, one_value_per_point

HEATMAP_STATS = ("underflows%", "overflows%", "mse", "dynamic_range")
NONFINITE_COUNTS = ("nan_count", "inf_count")
MAIN_LOG_DIR = "nvdlfw_inspect_logs"  # tedebug.logging's folder of the main text log
FIGURE_FORMATS = ("png", "svg", "pdf")
WORST_PER_STAT = 3


@dataclass
class ReportFigure:
    """One figure of the report: `name` is its file stem; `kind` lines / heatmap / compare."""

    name: str
    kind: str
    stat: str
    title: str
    figure: object  # matplotlib Figure


@dataclass
class Section:
    anchor: str
    title: str
    html: str = ""
    text: str = ""
    figures: List[ReportFigure] = field(default_factory=list)


@dataclass
class Report:
    run_dir: str
    sections: List[Section]
    seconds: float = 0.0

    @property
    def figures(self) -> List[ReportFigure]:
        return [f for s in self.sections for f in s.figures]


# ------------------------------------------------------------------------------------------------- data
@dataclass
class Grid:
    """The values of one (stat, tensor): `matrix` [layers × iterations] (NaN = not logged) for `layers`."""

    stat: str
    tensor: str
    iterations: np.ndarray
    layers: List[str]
    matrix: np.ndarray


def grids(frame) -> Dict[str, List[Grid]]:
    """stat -> one `Grid` per tensor (tensors in record order), layers in model order, only layers that logged."""
    frame = one_value_per_point(frame)
    layer_order = model_depth_order(frame)
    depth = {layer: i for i, layer in enumerate(layer_order)}
    layer_rows = np.array([depth.get(name, -1) for name in frame["layer"].cat.categories], dtype=np.int64)
    rows_of = layer_rows[frame["layer"].cat.codes.to_numpy()]
    iterations = frame["iteration"].to_numpy()
    values = frame["value"].to_numpy()
    out: Dict[str, List[Grid]] = {}
    groups = frame.groupby(["stat", "tensor"], observed=True, sort=False).indices
    tensor_rank = {t: i for i, t in enumerate(frame["tensor"].cat.categories)}
    for (stat, tensor), index in sorted(groups.items(), key=lambda kv: tensor_rank[kv[0][1]]):
        its, columns = np.unique(iterations[index], return_inverse=True)
        used, local_rows = np.unique(rows_of[index], return_inverse=True)
        matrix = np.full((used.size, its.size), np.nan)
        matrix[local_rows.ravel(), columns.ravel()] = values[index]
        out.setdefault(str(stat), []).append(Grid(str(stat), str(tensor), its, [layer_order[i] for i in used], matrix))
    stat_order = list(frame["stat"].cat.categories)
    return {stat: out[stat] for stat in stat_order if stat in out}


def _fmt(value: float) -> str:
    """Five significant digits (``nan``, ``inf`` as such)."""
    return f"{value:.5g}" if np.isfinite(value) else str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> Tuple[str, str]:
    """(html table, fixed-width text table)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    text = ["  ".join(f"{str(c):<{w}}" for c, w in zip(line, widths)) for line in (header, *rows)]
    text.insert(1, "  ".join("-" * w for w in widths))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>", "\n".join(text)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text.replace("%", "pct")).strip("_")


# ------------------------------------------------------------------------------------------------- sections
def overview_section(frame, run_dir: str, data: Dict[str, List[Grid]]) -> Section:
    iterations = np.unique(frame["iteration"].to_numpy())
    layers = model_depth_order(frame)
    rows = [
        ("run", run_dir),
        (
            "records",
            f"{len(frame)} values in {len(frame.attrs.get('files', []))} file(s), ranks "
            f"{', '.join(map(str, sorted(frame['rank'].unique())))}",
        ),
        (
            "iterations",
            f"{iterations.size} logged, {iterations.min()} to {iterations.max()}" if iterations.size else "none",
        ),
        ("layers", f"{len(layers)} (model order): {', '.join(layers[:8])}{' ...' if len(layers) > 8 else ''}"),
        ("tensors", ", ".join(map(str, dict.fromkeys(g.tensor for gs in data.values() for g in gs)))),
        ("statistics", ", ".join(data)),
    ]
    if frame.attrs.get("unstructured"):
        rows.append(
            ("other scalars", f"{frame.attrs['unstructured']} values logged without layer/tensor/stat (not shown)")
        )
    table_html, text = _table(("", ""), rows)
    return Section("overview", "Overview", table_html, text)


def main_log_lines(run_dir: str, pattern: str) -> List[str]:
    """Lines of the run's main logs (every rank) that contain `pattern`."""
    found = []
    for path in sorted(glob.glob(os.path.join(run_dir, MAIN_LOG_DIR, "*.log"))):
        with open(path, encoding="utf-8", errors="replace") as handle:
            found.extend(line.rstrip("\n") for line in handle if pattern in line)
    return found


def nonfinite_section(frame, run_dir: str) -> Section:
    from tedebug.config.parsing import GEMMS_OF_TENSOR

    rows = []
    counts = frame[frame["stat"].isin(NONFINITE_COUNTS) & (frame["value"] != 0)]
    odd = frame[~frame["stat"].isin(NONFINITE_COUNTS) & ~np.isfinite(frame["value"].to_numpy())]
    for label, events in (("count > 0", counts), ("value is NaN/Inf", odd)):
        if not len(events):
            continue
        grouped = events.groupby(["layer", "tensor", "stat"], observed=True, sort=False)
        summary = (
            grouped.agg(
                first=("iteration", "min"), last=("iteration", "max"), n=("iteration", "nunique"), peak=("value", "max")
            )
            .reset_index()
            .sort_values(["first", "layer"])
        )
        for r in summary.itertuples():
            gemms = "/".join(g for g in GEMMS_OF_TENSOR.get(str(r.tensor), ()) if g) or "-"
            rows.append(
                (
                    r.layer,
                    r.tensor,
                    gemms,
                    r.stat,
                    label,
                    r.first,
                    r.last,
                    r.n,
                    _fmt(r.peak) if label == "count > 0" else "-",
                )
            )
    log_lines = main_log_lines(run_dir, "First non-finite values")
    if not rows and not log_lines:
        text = "none: no nan_count / inf_count above zero and no NaN / Inf statistic"
        if not frame["stat"].isin(NONFINITE_COUNTS).any():
            text += " (the config logs neither nan_count nor inf_count)"
        return Section("nonfinite", "Non-finite events", f"<p>{html.escape(text)}</p>", text)
    table_html, text = (
        _table(
            (
                "layer",
                "tensor",
                "GEMMs",
                "statistic",
                "event",
                "first iteration",
                "last iteration",
                "iterations",
                "largest count",
            ),
            rows,
        )
        if rows
        else ("", "")
    )
    if log_lines:
        table_html += "<p>From the main log:</p><pre>" + html.escape("\n".join(log_lines)) + "</pre>"
        text += ("\n" if text else "") + "\n".join(log_lines)
    return Section("nonfinite", "Non-finite events", table_html, text)


def worst_section(data: Dict[str, List[Grid]]) -> Section:
    rows = []
    for stat, stat_grids in data.items():
        candidates = []
        for grid in stat_grids:
            magnitude = np.where(np.isfinite(grid.matrix), np.abs(grid.matrix), -np.inf)
            if not magnitude.size:
                continue
            peak_at = magnitude.argmax(axis=1)
            for i, layer in enumerate(grid.layers):
                if not magnitude[i, peak_at[i]] > 0:  # all zero (e.g. nan_count of a healthy run) or not finite
                    continue
                logged = np.flatnonzero(~np.isnan(grid.matrix[i]))
                last = logged[-1]
                candidates.append(
                    (
                        magnitude[i, peak_at[i]],
                        layer,
                        grid.tensor,
                        grid.matrix[i, peak_at[i]],
                        grid.iterations[peak_at[i]],
                        grid.matrix[i, last],
                        grid.iterations[last],
                    )
                )
        candidates.sort(key=lambda c: -c[0])
        for place, (_, layer, tensor, peak, peak_it, last, last_it) in enumerate(candidates[:WORST_PER_STAT], 1):
            rows.append((stat, place, layer, tensor, _fmt(peak), peak_it, _fmt(last), last_it))
    table_html, text = _table(
        ("statistic", "#", "layer", "tensor", "peak", "at iteration", "last value", "last iteration"), rows
    )
    note = (
        f"<p>Per statistic, the {WORST_PER_STAT} (layer, tensor) pairs with the largest peak magnitude over the "
        f"run.</p>"
    )
    return Section("worst", "Worst layers", note + table_html, text)


def heatmap_section(data: Dict[str, List[Grid]]) -> Section:
    section = Section("heatmaps", "Heatmaps: layers × iterations")
    for stat, stat_grids in data.items():
        if not any(key in stat for key in HEATMAP_STATS):
            continue
        log = "mse" in stat
        panels = [(g.tensor, g.iterations, g.matrix, g.layers) for g in stat_grids]
        figure = plots.heatmap(
            f"{stat} (layers in model order)",
            panels,
            log_colour=log,
            colour_label=stat + (" (log scale)" if log else ""),
            cmap="magma" if log else "viridis",
        )
        section.figures.append(
            ReportFigure(f"heatmap_{_slug(stat)}", "heatmap", stat, f"{stat}: layers × iterations", figure)
        )
    if not section.figures:
        section.html = "<p>No quantization statistic (underflows%, overflows%, mse, dynamic_range) in this record.</p>"
        section.text = "no quantization statistic (underflows%, overflows%, mse, dynamic_range) logged"
    return section


def lines_section(data: Dict[str, List[Grid]]) -> Section:
    section = Section("statistics", "Statistics over iterations")
    for stat, stat_grids in data.items():
        panels = [(g.tensor, g.iterations, g.matrix, g.layers, plots.highlight_rows(g.matrix)) for g in stat_grids]
        figure = plots.line_chart(f"{stat} (a line per layer; coloured: largest peak magnitude)", panels)
        section.figures.append(ReportFigure(f"lines_{_slug(stat)}", "lines", stat, f"{stat} over iterations", figure))
    return section


def comparison_section(
    frame, other_dir: str, run_dir: str, *, threshold: float, stats: Optional[Sequence[str]]
) -> Section:
    from tedebug.analysis.compare import compare_frames, format_comparison

    other = load_stats(other_dir)
    comparison = compare_frames(frame, other, threshold=threshold, stats=stats, run_a=run_dir, run_b=other_dir)
    text = format_comparison(comparison)
    section = Section("comparison", f"Comparison with {other_dir}", f"<pre>{html.escape(text)}</pre>", text)
    aligned = comparison.aligned
    if not len(aligned):
        return section
    layer_pos = {layer: i for i, layer in enumerate(comparison.layers)}
    tensor_order = {str(t): i for i, t in enumerate(frame["tensor"].cat.categories)}
    stat_order = {str(t): i for i, t in enumerate(frame["stat"].cat.categories)}
    stat_groups = sorted(aligned.groupby("stat", sort=False), key=lambda g: stat_order.get(g[0], len(stat_order)))
    for stat, rows in stat_groups:  # in the order of this run's record, as the other sections
        panels = []
        tensor_groups = sorted(
            rows.groupby("tensor", sort=False), key=lambda g: tensor_order.get(g[0], len(tensor_order))
        )
        for tensor, part in tensor_groups:
            its, columns = np.unique(part["iteration"].to_numpy(), return_inverse=True)
            layer_idx = part["layer"].map(layer_pos).to_numpy()
            used, local = np.unique(layer_idx, return_inverse=True)
            matrix = np.full((used.size, its.size), np.nan)
            matrix[local.ravel(), columns.ravel()] = np.minimum(part["rel"].to_numpy(), 2.0)
            panels.append((tensor, its, matrix, [comparison.layers[i] for i in used]))
        figure = plots.heatmap(
            f"{stat}: |b - a| / max(|a|, |b|), threshold {threshold:g}",
            panels,
            colour_label="relative difference (capped at 2)",
            cmap="inferno",
            vmin=0.0,
            vmax=max(2 * threshold, float(np.nanmax(np.minimum(rows["rel"], 2.0))) or 1.0),
        )
        section.figures.append(
            ReportFigure(f"compare_{_slug(stat)}", "compare", stat, f"{stat}: relative difference", figure)
        )
    return section


def config_section(run_dir: str, config_path: Optional[str]) -> Section:
    source = config_path
    note = ""
    if source is None:
        lines = main_log_lines(run_dir, "Reading config from")
        match = re.search(r"Reading config from (.*)\.$", lines[0]) if lines else None
        if lines and "Python dictionary" in lines[0]:
            note = "The run was configured from a Python dictionary; pass --config FILE to show a file."
        elif match:
            source = match.group(1)
        else:
            note = f"No 'Reading config from' line in {os.path.join(run_dir, MAIN_LOG_DIR)}; pass --config FILE."
    if source is not None:
        if os.path.isfile(source):
            with open(source, encoding="utf-8", errors="replace") as handle:
                content = handle.read()
            body = f"<p>{html.escape(source)}</p><pre>{html.escape(content)}</pre>"
            return Section("config", "Config", body, f"{source}:\n{content}")
        note = f"The config file {source} named by the run's main log no longer exists here."
    return Section("config", "Config", f"<p>{html.escape(note)}</p>", note)


def build_report(
    run_dir: str,
    *,
    compare_to: Optional[str] = None,
    threshold: Optional[float] = None,
    stats: Optional[Sequence[str]] = None,
    config_path: Optional[str] = None,
) -> Report:
    """Every section of the report of `run_dir` (figures not yet encoded)."""
    from tedebug.analysis.compare import DEFAULT_THRESHOLD

    start = time.perf_counter()
    frame = load_stats(run_dir)
    if stats:
        frame = frame[frame["stat"].isin(list(stats))]
    data = grids(frame)
    sections = [
        overview_section(frame, run_dir, data),
        nonfinite_section(frame, run_dir),
        worst_section(data),
        heatmap_section(data),
        lines_section(data),
    ]
    if compare_to is not None:
        sections.append(
            comparison_section(
                frame, compare_to, run_dir, stats=stats, threshold=DEFAULT_THRESHOLD if threshold is None else threshold
            )
        )
    sections.append(config_section(run_dir, config_path))
    return Report(run_dir, sections, time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------- output
STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1500px;padding:0 1.5em;
color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.8em}
nav a{margin-right:1em}table{border-collapse:collapse;font-size:.85em}
td,th{border:1px solid #ddd;padding:.2em .6em;text-align:left}th{background:#f3f3f3}
pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:.8em}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{font-size:.85em;color:#555}
"""


def render_html(report: Report) -> str:
    """The self-contained page (figures encoded as PNG data URIs)."""
    nav = " ".join(f'<a href="#{s.anchor}">{html.escape(s.title)}</a>' for s in report.sections)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>tedebug report: {html.escape(report.run_dir)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>tedebug report: {html.escape(report.run_dir)}</h1>",
        f"<nav>{nav}</nav>",
    ]
    for section in report.sections:
        parts.append(f'<section id="{section.anchor}"><h2>{html.escape(section.title)}</h2>{section.html}')
        for fig in section.figures:
            data = base64.b64encode(plots.encode(fig.figure, "png")).decode("ascii")
            parts.append(
                f'<figure class="chart" id="{fig.name}" data-kind="{fig.kind}" '
                f'data-stat="{html.escape(fig.stat)}"><img alt="{html.escape(fig.title)}" '
                f'src="data:image/png;base64,{data}"><figcaption>{html.escape(fig.title)}</figcaption>'
                f"</figure>"
            )
        parts.append("</section>")
    parts.append(f"<footer><p>Made by tedebug report in {report.seconds:.1f} s (data and figures).</p></footer>")
    parts.append("</body></html>")
    return "\n".join(parts)


def report_text(report: Report) -> str:
    """The tables and texts of every section, for report.txt and terminals."""
    return "\n\n".join(f"== {s.title} ==\n{s.text}" for s in report.sections if s.text)


def write_report(report: Report, output: str, fmt: str = "html") -> List[str]:
    """Write `report` as one HTML file (`fmt` html) or a folder of figures (png, svg, pdf) plus report.txt;
    returns the paths written."""
    if fmt == "html":
        parent = os.path.dirname(os.path.abspath(output))
        os.makedirs(parent, exist_ok=True)
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(render_html(report))
        return [output]
    if fmt not in FIGURE_FORMATS:
        raise ValueError(f"report format must be html or one of {FIGURE_FORMATS}, got {fmt!r}")
    os.makedirs(output, exist_ok=True)
    written = []
    for fig in report.figures:
        path = os.path.join(output, f"{fig.name}.{fmt}")
        with open(path, "wb") as handle:
            handle.write(plots.encode(fig.figure, fmt))
        written.append(path)
    text_path = os.path.join(output, "report.txt")
    with open(text_path, "w", encoding="utf-8") as handle:
        handle.write(report_text(report) + "\n")
    written.append(text_path)
    return written
