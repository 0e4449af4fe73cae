"""tedebug.load_stats: the JSONL record (written by JsonlSink itself) read back as a DataFrame."""

import json
import math
import os
import warnings

import pandas as pd
import pytest

import tedebug
from tedebug.analysis import load
from tedebug.sinks.jsonl import JsonlSink


def write_run(run_dir, rank, records):
    """A record file of `rank` written by the real sink; records: (name, value, iteration, layer, tensor, stat)."""
    sink = JsonlSink(os.path.join(run_dir, "tedebug_statistics", f"metrics_globalrank-{rank}.jsonl"))
    sink.log_scalars(records)
    sink.close()


RECORDS_0 = [
    ("b.1.fc2_activation_max", 2.5, 0, "b.1.fc2", "activation", "max"),
    ("b.0.fc1_activation_max", 1.25, 0, "b.0.fc1", "activation", "max"),  # logged second: deeper in the frame?
    ("b.1.fc2_gradient_std", float("nan"), 0, "b.1.fc2", "gradient", "std"),
    ("loss", 3.0, 0, None, None, None),  # a plain scalar: not a layer statistic
    ("b.1.fc2_activation_max", float("inf"), 10, "b.1.fc2", "activation", "max"),
    ("b.0.fc1_activation_max", -float("inf"), 10, "b.0.fc1", "activation", "max"),
]
RECORDS_1 = [("b.1.fc2_activation_max", 2.5, 0, "b.1.fc2", "activation", "max")]


def expected_rows():
    rows = [(it, layer, tensor, stat, value, 0) for _, value, it, layer, tensor, stat in RECORDS_0 if layer]
    rows += [(it, layer, tensor, stat, value, 1) for _, value, it, layer, tensor, stat in RECORDS_1]
    return rows


def frame_rows(frame):
    return [tuple(r) for r in frame[list(load.COLUMNS)].astype(object).itertuples(index=False)]


def same_rows(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[:4] == w[:4] and g[5] == w[5]
        assert (math.isnan(g[4]) and math.isnan(w[4])) or g[4] == w[4]


def test_load_stats_columns_values_ranks_and_order(tmp_path):
    write_run(tmp_path, 0, RECORDS_0)
    write_run(tmp_path, 1, RECORDS_1)
    frame = tedebug.load_stats(str(tmp_path))
    assert list(frame.columns) == list(load.COLUMNS)
    assert str(frame["iteration"].dtype) == "int64" and str(frame["rank"].dtype) == "int64"
    assert str(frame["value"].dtype) == "float64" and str(frame["layer"].dtype) == "category"
    same_rows(frame_rows(frame), expected_rows())
    assert list(frame["layer"].cat.categories) == ["b.1.fc2", "b.0.fc1"]  # first appearance in the record
    assert load.model_depth_order(frame) == ["b.1.fc2", "b.0.fc1"]
    assert frame.attrs["unstructured"] == 1
    # the same point logged by two ranks: the lowest rank's row is kept
    single = load.one_value_per_point(frame)
    assert len(single) == len(frame) - 1 and set(single["rank"]) == {0}
    # a run directory, its tedebug_statistics folder or one file
    same_rows(frame_rows(load.load_stats(os.path.join(tmp_path, "tedebug_statistics"))), expected_rows())
    one = load.load_stats(os.path.join(tmp_path, "tedebug_statistics", "metrics_globalrank-1.jsonl"))
    same_rows(frame_rows(one), expected_rows()[-1:])


def test_fast_path_equals_the_json_decoder(tmp_path):
    """Files as JsonlSink writes them take the regex path; the same records with other spacing take the JSON
    decoder; both give the same frame."""
    write_run(tmp_path / "fast", 0, RECORDS_0)
    with open(tmp_path / "fast" / "tedebug_statistics" / "metrics_globalrank-0.jsonl") as f:
        objects = [json.loads(line) for line in f]
    os.makedirs(tmp_path / "slow" / "tedebug_statistics")
    with open(tmp_path / "slow" / "tedebug_statistics" / "metrics_globalrank-0.jsonl", "w") as f:
        f.write("\n".join(json.dumps(o, separators=(",", ":")) for o in objects) + "\n")
    out = {name: [] for name in load.COLUMNS}
    with open(tmp_path / "slow" / "tedebug_statistics" / "metrics_globalrank-0.jsonl") as f:
        assert load._canonical_columns(f.read(), 0, out) is None  # not the sink's spacing
    fast, slow = load.load_stats(str(tmp_path / "fast")), load.load_stats(str(tmp_path / "slow"))
    pd.testing.assert_frame_equal(fast, slow, check_like=False)
    assert fast.attrs["unstructured"] == slow.attrs["unstructured"] == 1


def test_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics_globalrank-<R>.jsonl"):
        load.load_stats(str(tmp_path))
    write_run(tmp_path, 0, RECORDS_0[:2])
    path = os.path.join(tmp_path, "tedebug_statistics", "metrics_globalrank-0.jsonl")
    with open(path, "a") as f:
        f.write('{"iteration": 20, "name": "x"\n{"iteration": 30')  # a bad line, then a last line cut short
    with pytest.raises(ValueError, match=r"metrics_globalrank-0.jsonl:3: not a JSON object"):
        load.load_stats(str(tmp_path))
    with open(path, "w") as f:
        f.write(
            json.dumps({"iteration": 0, "name": "a", "layer": "a", "tensor": "activation", "stat": "max", "value": 1.0})
            + "\n"
            + '{"iteration": 1, "na'
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        frame = load.load_stats(str(tmp_path))
    assert len(frame) == 1 and "cut short" in str(caught[0].message)
    with open(path, "w") as f:
        f.write(json.dumps({"iteration": 0, "value": 1.0}) + "\n")
    with pytest.raises(ValueError, match="not a tedebug statistics record"):
        load.load_stats(str(tmp_path))
    with pytest.raises(ValueError, match="expected a file named"):
        other = tmp_path / "other.jsonl"
        other.write_text("")
        load.load_stats(str(other))
