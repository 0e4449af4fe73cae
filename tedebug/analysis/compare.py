"""`tedebug compare RUN_A RUN_B`: where two runs' statistics part, e.g. a bf16 run and its FP8 twin (same seed and
data), or one config before and after a change.

The two records (`tedebug.analysis.load.load_stats`) are aligned on (layer, tensor, stat, iteration); points that
only one run logged are counted, not compared.  The relative difference of a point is

    rel = |b - a| / max(|a|, |b|)        (0 when a == b, including both zero or both NaN; inf when exactly one
                                          value is non-finite or they are infinities of opposite sign)

so it is symmetric and, for finite values of one sign, at most 1.  A point *departs* when rel > threshold
(`DEFAULT_THRESHOLD` = 0.05: the values differ by more than 5 % of the larger one).  For every statistic the
comparison names the first iteration at which any (layer, tensor) departs and, at that iteration, the departing
layers in model order (forward order, `tedebug.analysis.load.model_depth_order`), the shallowest first: the place
to start looking.  It also lists, per layer in model order, the first iteration at which any chosen statistic
departs, which shows how a departure travels through the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from tedebug.analysis.load import load_stats, model_depth_order, one_value_per_point

DEFAULT_THRESHOLD = 0.05
KEYS = ["layer", "tensor", "stat", "iteration"]


def relative_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise ``|b - a| / max(|a|, |b|)`` with the conventions of the module docstring."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        scale = np.maximum(np.abs(a), np.abs(b))
        rel = np.abs(b - a) / scale
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    rel = np.where(same, 0.0, rel)
    return np.where(np.isnan(rel), np.inf, rel)  # one value non-finite (or opposite infinities)


@dataclass(frozen=True)
class Departure:
    """The first departure of one statistic: at `iteration`, `layer` / `tensor` is the shallowest departing point;
    `others` are the further (layer, tensor) pairs departing at that iteration, in model order."""

    stat: str
    iteration: int
    layer: str
    tensor: str
    a: float
    b: float
    rel: float
    others: tuple


@dataclass
class Comparison:
    """The aligned points of two runs and what departs (see the module docstring)."""

    run_a: str
    run_b: str
    threshold: float
    aligned: object  # DataFrame: layer, tensor, stat, iteration, a, b, rel, depth
    layers: List[str]  # model order
    stats: List[str]
    only_a: int
    only_b: int
    departures: List[Departure]  # by (iteration, depth)
    layer_first: List[tuple]  # (layer, iteration, stat, tensor, rel) per departing layer, in model order
    missing_stats: List[str]  # requested with --stat but logged by neither run

    @property
    def departed(self) -> bool:
        return bool(self.departures)


def align(frame_a, frame_b):
    """Inner join of two `load_stats` frames on (layer, tensor, stat, iteration) with columns a, b, rel, depth
    (model order: the layers of A, then those only B has); also returns (layers, only_a, only_b)."""
    import pandas as pd

    layers = model_depth_order(frame_a)
    layers += [layer for layer in model_depth_order(frame_b) if layer not in set(layers)]
    plain = []
    for frame in (frame_a, frame_b):
        frame = one_value_per_point(frame)
        plain.append(
            pd.DataFrame(
                {key: frame[key].astype(str) if key != "iteration" else frame[key] for key in KEYS}
                | {"value": frame["value"]}
            )
        )
    merged = plain[0].merge(plain[1], on=KEYS, how="outer", suffixes=("_a", "_b"), indicator=True)
    only_a = int((merged["_merge"] == "left_only").sum())
    only_b = int((merged["_merge"] == "right_only").sum())
    both = merged[merged["_merge"] == "both"].drop(columns="_merge").rename(columns={"value_a": "a", "value_b": "b"})
    both["rel"] = relative_difference(both["a"].to_numpy(), both["b"].to_numpy())
    depth = {layer: i for i, layer in enumerate(layers)}
    both["depth"] = both["layer"].map(depth).astype(np.int64)
    both = both.sort_values(["stat", "iteration", "depth", "tensor"], kind="stable").reset_index(drop=True)
    return both, layers, only_a, only_b


def compare_frames(
    frame_a,
    frame_b,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    stats: Optional[Sequence[str]] = None,
    run_a: str = "A",
    run_b: str = "B",
) -> Comparison:
    """Compare two `load_stats` frames (see the module docstring); `stats` limits the statistics (default: all)."""
    if not threshold >= 0:
        raise ValueError(f"compare: threshold must be >= 0, got {threshold}")
    aligned, layers, only_a, only_b = align(frame_a, frame_b)
    logged = set(frame_a["stat"].astype(str)) | set(frame_b["stat"].astype(str))
    missing = [s for s in stats if s not in logged] if stats else []
    if stats:
        aligned = aligned[aligned["stat"].isin(list(stats))].reset_index(drop=True)
    departing = aligned[aligned["rel"] > threshold]
    departures = []
    for stat, rows in departing.groupby("stat", sort=False):
        first_iteration = rows["iteration"].min()
        at = rows[rows["iteration"] == first_iteration].sort_values(["depth", "tensor"], kind="stable")
        head = at.iloc[0]
        others = tuple(zip(at["layer"].iloc[1:], at["tensor"].iloc[1:]))
        departures.append(
            Departure(
                stat,
                int(first_iteration),
                head["layer"],
                head["tensor"],
                float(head["a"]),
                float(head["b"]),
                float(head["rel"]),
                others,
            )
        )
    depth = {layer: i for i, layer in enumerate(layers)}
    departures.sort(key=lambda d: (d.iteration, depth[d.layer], d.stat))
    layer_first = []
    if len(departing):
        firsts = departing.sort_values(["iteration", "depth", "stat", "tensor"], kind="stable")
        firsts = firsts.drop_duplicates("layer", keep="first").sort_values("depth", kind="stable")
        layer_first = [(r.layer, int(r.iteration), r.stat, r.tensor, float(r.rel)) for r in firsts.itertuples()]
    return Comparison(
        run_a,
        run_b,
        threshold,
        aligned,
        layers,
        sorted(set(aligned["stat"]), key=str),
        only_a,
        only_b,
        departures,
        layer_first,
        missing,
    )


def compare_runs(
    run_a: str, run_b: str, *, threshold: float = DEFAULT_THRESHOLD, stats: Optional[Sequence[str]] = None
) -> Comparison:
    """`compare_frames` of the records of two run directories."""
    return compare_frames(
        load_stats(run_a), load_stats(run_b), threshold=threshold, stats=stats, run_a=run_a, run_b=run_b
    )


def _number(value: float) -> str:
    if not np.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def format_comparison(comparison: Comparison, *, max_others: int = 3) -> str:
    """The text report of a comparison (terminals and CI logs)."""
    c = comparison
    lines = [
        f"compare A={c.run_a}  B={c.run_b}",
        f"  {len(c.aligned)} aligned points (layer, tensor, stat, iteration) over {len(c.stats)} statistic(s); "
        f"only in A: {c.only_a}, only in B: {c.only_b}",
        f"  departs: |b - a| / max(|a|, |b|) > {c.threshold:g}",
    ]
    for stat in c.missing_stats:
        lines.append(f"  warning: statistic {stat!r} was logged by neither run")
    if not len(c.aligned):
        lines.append("nothing to compare: the runs share no (layer, tensor, stat, iteration)")
        return "\n".join(lines)
    if not c.departures:
        worst = c.aligned.loc[c.aligned["rel"].idxmax()]
        lines.append(
            f"no statistic departs; the largest relative difference is {_number(worst['rel'])} "
            f"({worst['stat']} of {worst['layer']} {worst['tensor']} at iteration {worst['iteration']})"
        )
        return "\n".join(lines)
    lines.append("")
    lines.append("First departure per statistic (earliest first; at that iteration the shallowest layer):")
    width = max(len(d.stat) for d in c.departures)
    for d in c.departures:
        more = ""
        if d.others:
            shown = ", ".join(f"{layer} {tensor}" for layer, tensor in d.others[:max_others])
            extra = len(d.others) - max_others
            more = f"; also {shown}" + (f" (+{extra} more)" if extra > 0 else "")
        lines.append(
            f"  {d.stat:<{width}}  iteration {d.iteration:>6}  {d.layer} {d.tensor}: "
            f"A={_number(d.a)} B={_number(d.b)} rel={_number(d.rel)}{more}"
        )
    departed = {stat for stat in (d.stat for d in c.departures)}
    steady = [s for s in c.stats if s not in departed]
    if steady:
        lines.append(f"  within the threshold throughout: {', '.join(steady)}")
    lines.append("")
    lines.append("First departure per layer, in model order:")
    width = max(len(row[0]) for row in c.layer_first)
    for layer, iteration, stat, tensor, rel in c.layer_first:
        lines.append(f"  {layer:<{width}}  iteration {iteration:>6}  {stat} of {tensor} (rel={_number(rel)})")
    quiet = [layer for layer in c.layers if layer not in {row[0] for row in c.layer_first}]
    if quiet:
        lines.append(f"  never departs: {', '.join(quiet)}")
    return "\n".join(lines)
