"""Statistics of a finished run as data: `load_stats(run_dir)` reads the JSONL record into a pandas DataFrame.

The record is what `tedebug.sinks.jsonl.JsonlSink` writes for every session: one file per rank,
``<log_dir>/tedebug_statistics/metrics_globalrank-<R>.jsonl``, one JSON object per statistic with ``iteration``,
``name``, ``layer``, ``tensor``, ``stat``, ``value`` (``null`` plus ``nonfinite`` for NaN / ±Inf).  This module owns
reading it back; the report and the comparison (`tedebug.analysis.report`, `tedebug.analysis.compare`) start from
its DataFrame.

DataFrame columns: ``iteration`` (int64), ``layer``, ``tensor``, ``stat`` (categoricals), ``value`` (float64, NaN /
±Inf restored), ``rank`` (int64, from the file name).  The ``layer`` categories are in the order in which layers
first appear in the record, which is the order of the forward pass (the statistics engine emits buffers in feed
order): `model_depth_order` relies on it.  Scalars logged without layer / tensor / stat (a plain ``log_scalar(name,
...)``) are not statistics of a layer and are left out; `load_stats` counts them in ``df.attrs["unstructured"]``.

Reading: files exactly as `JsonlSink` writes them take a fast path (`_canonical_columns`); any other file is decoded
with one C-level ``json.loads`` per file (the lines joined into one array); a malformed line is reported with its
file and line number.  A last line cut short (a run killed while writing) is dropped with a warning.
"""

from __future__ import annotations

import glob
import json
import os
import re
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

RECORD_DIR = "tedebug_statistics"  # tedebug.session.JSONL_DIR (not imported: the session pulls in torch)
RECORD_FILE = re.compile(r"metrics_globalrank-(\d+)\.jsonl$")
COLUMNS = ("iteration", "layer", "tensor", "stat", "value", "rank")
_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _pandas():
    try:
        import pandas
    except ImportError as error:  # pragma: no cover - pandas is in the test extra
        raise ImportError("tedebug.load_stats needs pandas: pip install 'tedebug[report]'") from error
    return pandas


def record_files(run_dir: str) -> List[Tuple[int, str]]:
    """(rank, path) of every record file of a run, by rank.  `run_dir` is the run's ``log_dir``, its
    ``tedebug_statistics`` folder, or one ``metrics_globalrank-<R>.jsonl`` file; FileNotFoundError when none."""
    run_dir = os.fspath(run_dir)
    if os.path.isfile(run_dir):
        candidates = [run_dir]
    else:
        folder = os.path.join(run_dir, RECORD_DIR)
        candidates = glob.glob(os.path.join(folder if os.path.isdir(folder) else run_dir, "*.jsonl"))
    files = []
    for path in candidates:
        match = RECORD_FILE.search(os.path.basename(path))
        if match is None:
            if os.path.isfile(run_dir):
                raise ValueError(
                    f"{path}: not a tedebug statistics record (expected a file named metrics_globalrank-<R>.jsonl)"
                )
            continue  # another tool's .jsonl next to ours
        files.append((int(match.group(1)), path))
    if not files:
        raise FileNotFoundError(
            f"no tedebug statistics record under {run_dir!r}: expected "
            f"{os.path.join(run_dir, RECORD_DIR, 'metrics_globalrank-<R>.jsonl')} (the "
            f"log_dir given to debug_api.initialize)"
        )
    return sorted(files)


def _parse_lines(text: str, path: str) -> List[Dict[str, Any]]:
    """The JSON objects of the lines of `text` (the content of `path`, named in errors)."""
    body = text.strip()
    if not body:
        return []
    try:
        return json.loads("[" + body.replace("\n", ",") + "]")  # JSON strings never hold a raw newline
    except json.JSONDecodeError:
        pass  # find the bad line, with its number
    lines = text.split("\n")
    last = max(i for i, line in enumerate(lines) if line.strip())
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number - 1 == last and not text.endswith("\n"):
                warnings.warn(f"{path}:{number}: dropped a last line cut short (the run stopped while writing)")
                continue
            raise ValueError(f"{path}:{number}: not a JSON object ({error.msg}): {line.strip()[:200]}") from None
    return records


def _columns(records: List[Dict[str, Any]], path: str, rank: int, out: Dict[str, list]) -> int:
    """Append the structured records of one file to `out`; returns how many records were unstructured."""
    try:
        kept = [r for r in records if r["layer"] is not None and r["tensor"] is not None and r["stat"] is not None]
        out["iteration"].extend([r["iteration"] for r in kept])
        out["layer"].extend([r["layer"] for r in kept])
        out["tensor"].extend([r["tensor"] for r in kept])
        out["stat"].extend([r["stat"] for r in kept])
        values = [r["value"] for r in kept]
        for i in [i for i, v in enumerate(values) if v is None]:
            values[i] = _NONFINITE[kept[i]["nonfinite"]]
        out["value"].extend(values)
    except (KeyError, TypeError) as error:
        required = set(COLUMNS[:5])
        bad = next((r for r in records if not isinstance(r, dict) or not required <= set(r)), None)
        raise ValueError(f"{path}: not a tedebug statistics record ({error!r} in {str(bad)[:200]})") from None
    out["rank"].extend([rank] * len(kept))
    return len(records) - len(kept)


_CANONICAL_LINE = re.compile(r'^\{"iteration": (-?\d+), (.*), "value": (.*)\}$', re.MULTILINE)


def _canonical_columns(text: str, rank: int, out: Dict[str, list]) -> Optional[int]:
    """The fast path for files written by `JsonlSink`: every line is ``{"iteration": N, <names>, "value": V}`` with
    the names part repeating across iterations, so one regex scan splits all lines, each distinct names part is
    decoded once, and N and V are converted by C loops (`map`).  Returns the number of unstructured records, or
    None (nothing appended) when a line does not have that form; the caller then decodes everything as JSON."""
    if "\n\n" in text or text.startswith("\n"):  # blank lines: the general path
        return None
    lines = _CANONICAL_LINE.findall(text)
    if len(lines) != text.count("\n"):  # a line of another form
        return None
    if not lines:
        return 0
    numbers = [line[0] for line in lines]  # (zip(*lines) is slower for millions of lines)
    parts = [line[1] for line in lines]
    value_texts = [line[2] for line in lines]
    names: Dict[str, Optional[tuple]] = {}
    for part in set(parts):
        try:
            decoded = json.loads("{" + part + "}")
        except json.JSONDecodeError:
            return None
        if list(decoded) != ["name", "layer", "tensor", "stat"]:
            return None
        names[part] = (
            None
            if None in (decoded["layer"], decoded["tensor"], decoded["stat"])
            else (decoded["layer"], decoded["tensor"], decoded["stat"])
        )
    try:
        iterations = list(map(int, numbers))
        values = (
            list(map(float, value_texts))
            if '"value": null' not in text
            else [
                _NONFINITE[json.loads('{"value": ' + v + "}")["nonfinite"]] if v.startswith("null") else float(v)
                for v in value_texts
            ]
        )
    except (ValueError, KeyError, json.JSONDecodeError):
        return None
    keys = [names[p] for p in parts]
    skipped = keys.count(None)
    if skipped:
        kept = [i for i, key in enumerate(keys) if key is not None]
        keys = [keys[i] for i in kept]
        iterations = [iterations[i] for i in kept]
        values = [values[i] for i in kept]
    if keys:
        out["layer"].extend([key[0] for key in keys])
        out["tensor"].extend([key[1] for key in keys])
        out["stat"].extend([key[2] for key in keys])
    out["iteration"].extend(iterations)
    out["value"].extend(values)
    out["rank"].extend([rank] * len(keys))
    return skipped


def load_stats(run_dir: str):
    """Every statistic of a run as a DataFrame with columns (iteration, layer, tensor, stat, value, rank); see the
    module docstring.

    >>> df = tedebug.load_stats("runs/demo")
    >>> df[df.stat == "underflows%"].pivot_table(index="iteration", columns="layer", values="value", observed=True)
    """
    pd = _pandas()
    out: Dict[str, list] = {name: [] for name in COLUMNS}
    unstructured = 0
    files = record_files(run_dir)
    for rank, path in files:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        skipped = _canonical_columns(text, rank, out) if text.endswith("\n") or not text else None
        unstructured += skipped if skipped is not None else _columns(_parse_lines(text, path), path, rank, out)
    frame = pd.DataFrame(
        {
            "iteration": np.asarray(out["iteration"], dtype=np.int64),
            "layer": pd.Categorical(out["layer"], categories=list(dict.fromkeys(out["layer"]))),
            "tensor": pd.Categorical(out["tensor"], categories=list(dict.fromkeys(out["tensor"]))),
            "stat": pd.Categorical(out["stat"], categories=list(dict.fromkeys(out["stat"]))),
            "value": np.asarray(out["value"], dtype=np.float64),
            "rank": np.asarray(out["rank"], dtype=np.int64),
        }
    )
    frame.attrs["run_dir"] = os.fspath(run_dir)
    frame.attrs["files"] = [path for _, path in files]
    frame.attrs["unstructured"] = unstructured
    return frame


def model_depth_order(frame) -> List[str]:
    """Layer names in model order (first appearance in the record, i.e. forward order), only those in `frame`."""
    present = set(frame["layer"].unique())
    return [layer for layer in frame["layer"].cat.categories if layer in present]


def one_value_per_point(frame):
    """`frame` with one row per (layer, tensor, stat, iteration): the lowest rank's value where several ranks
    logged the same point (statistics reduced across ranks are the same on every rank that logs them)."""
    if frame["rank"].nunique() <= 1:
        return frame
    ordered = frame.sort_values("rank", kind="stable")
    return ordered.drop_duplicates(["layer", "tensor", "stat", "iteration"], keep="first").sort_index()
