"""The demo's summary: tables of the worst layers by a statistic, read back from the JSONL statistics record.

Reads every ``<log_dir>/tedebug_statistics/*.jsonl`` file (one JSON object per line with ``iteration``, ``name``,
``layer``, ``tensor``, ``stat``, ``value`` and, for NaN/Inf, ``value: null`` plus ``nonfinite``; see
tedebug/sinks/jsonl.py).  For each statistic it takes the last iteration at which that statistic was logged and
ranks the (layer, tensor) rows by value, largest first; a non-finite value ranks above every finite one.

Run on its own: ``python examples/summary.py runs/demo``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

JSONL_DIR = "tedebug_statistics"  # tedebug.session.JSONL_DIR

# The statistics the summary ranks: (title, candidate stat names). The first name present in the record is used:
# LogFp8TensorStats logs `underflows%` / `mse`; LogNvfp4TensorStats logs them with an `nvfp4_` prefix.
DEFAULT_TABLES = (
    ("underflow% (nonzero values that quantize to zero)", ("underflows%", "nvfp4_underflows%")),
    ("MSE (quantized vs high precision)", ("mse", "nvfp4_mse")),
)


@dataclass(frozen=True)
class Row:
    """One statistic of one (layer, tensor) at one iteration; `value` is float (NaN/±Inf for non-finite)."""

    iteration: int
    layer: str
    tensor: str
    stat: str
    value: float


def record_files(log_dir: str) -> List[str]:
    """The JSONL files under `log_dir` (sorted); FileNotFoundError when there are none."""
    pattern = os.path.join(log_dir, JSONL_DIR, "*.jsonl")
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(
            f"no statistics record found: nothing matches {pattern} (was the run made with log_dir={log_dir!r}?)"
        )
    return files


def _record_value(record: dict) -> float:
    if record["value"] is not None:
        return float(record["value"])
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[record["nonfinite"]]


def parse_record(line: str, where: str) -> Optional[Row]:
    """The `Row` of one JSONL line, or None for a scalar logged without layer/tensor/stat."""
    try:
        record = json.loads(line)
        if record["layer"] is None or record["tensor"] is None or record["stat"] is None:
            return None
        return Row(int(record["iteration"]), record["layer"], record["tensor"], record["stat"], _record_value(record))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{where}: not a tedebug statistics record ({error!r}): {line.strip()[:200]}") from error


def read_rows(log_dir: str) -> List[Row]:
    """Every structured statistic recorded under `log_dir`, in file order."""
    rows: List[Row] = []
    for path in record_files(log_dir):
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    row = parse_record(line, f"{path}:{number}")
                    if row is not None:
                        rows.append(row)
    return rows


def _rank_key(row: Row):
    """Sort key: non-finite values first (NaN before ±Inf), then larger values first."""
    if math.isnan(row.value):
        return (0, 0.0)
    if math.isinf(row.value):
        return (1, 0.0)
    return (2, -row.value)


def worst(rows: Iterable[Row], stat: str, k: int = 5) -> List[Row]:
    """The `k` largest values of `stat` at the last iteration it was logged (ties keep record order)."""
    if k < 1:
        raise ValueError(f"worst: k must be >= 1, got {k}")
    matching = [row for row in rows if row.stat == stat]
    if not matching:
        return []
    last = max(row.iteration for row in matching)
    return sorted((row for row in matching if row.iteration == last), key=_rank_key)[:k]


def format_value(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"


def format_table(title: str, rows: Sequence[Row]) -> str:
    """A fixed-width table of `rows` (layer, tensor, value) under `title` and the iteration."""
    if not rows:
        return f"{title}: nothing logged"
    stat = rows[0].stat
    header = ("layer", "tensor", stat)
    body = [(row.layer, row.tensor, format_value(row.value)) for row in rows]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(3)]

    def line(cells) -> str:
        return f"  {cells[0]:<{widths[0]}}  {cells[1]:<{widths[1]}}  {cells[2]:>{widths[2]}}"

    rule = "  " + "-" * (sum(widths) + 4)
    return "\n".join([f"{title}, iteration {rows[0].iteration}:", line(header), rule, *map(line, body)])


def pick_stat(rows: Sequence[Row], candidates: Sequence[str]) -> Optional[str]:
    """The first of `candidates` that occurs in `rows`, or None."""
    present = {row.stat for row in rows}
    return next((name for name in candidates if name in present), None)


def nonfinite_report(rows: Sequence[Row]) -> str:
    """One line per (layer, tensor) whose nan_count / inf_count was ever > 0 (first iteration), or 'none'."""
    first: Dict[tuple, Row] = {}
    for row in rows:
        if row.stat in ("nan_count", "inf_count") and row.value != 0:
            key = (row.layer, row.tensor, row.stat)
            if key not in first or row.iteration < first[key].iteration:
                first[key] = row
    if not first:
        return "Non-finite values (nan_count / inf_count): none"
    lines = [
        f"  {r.layer} {r.tensor}: {r.stat}={format_value(r.value)} first at iteration {r.iteration}"
        for r in sorted(first.values(), key=lambda r: (r.iteration, r.layer, r.tensor, r.stat))
    ]
    return "\n".join(["Non-finite values (nan_count / inf_count):", *lines])


def summarize(log_dir: str, k: int = 5, tables=DEFAULT_TABLES) -> str:
    """The summary text: one table per entry of `tables` and the non-finite report."""
    rows = read_rows(log_dir)
    parts = []
    for title, candidates in tables:
        stat = pick_stat(rows, candidates)
        if stat is None:
            parts.append(f"Worst layers by {title}: not logged (the config logs none of {list(candidates)})")
        else:
            parts.append(format_table(f"Worst layers by {title}", worst(rows, stat, k)))
    if any(row.stat in ("nan_count", "inf_count") for row in rows):
        parts.append(nonfinite_report(rows))
    return "\n\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Summarise a tedebug run: worst layers by underflow%% and MSE.")
    parser.add_argument("log_dir", help="the log_dir given to debug_api.initialize (e.g. runs/demo)")
    parser.add_argument("-k", type=int, default=5, help="rows per table (default 5)")
    args = parser.parse_args(argv)
    print(summarize(args.log_dir, args.k))
    return 0


if __name__ == "__main__":
    main()
