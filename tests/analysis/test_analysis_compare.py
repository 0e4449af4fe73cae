"""tedebug compare: relative differences and the first departure, found in synthetic runs with a planted divergence."""

import math
import os

import numpy as np
import pytest

from tedebug import cli
from tedebug.analysis import compare
from tedebug.sinks.jsonl import JsonlSink

# 12 blocks: names whose text order (blocks.10 < blocks.2) differs from model order
LAYERS = [f"blocks.{b}.{kind}" for b in range(12) for kind in ("attn.qkv", "mlp.fc1")]
TENSORS = ("activation", "gradient")
STATS = ("std", "max", "underflows%")
ITERATIONS = range(0, 101, 5)


def base_value(layer_index, tensor_index, stat_index, iteration):
    return 1.0 + 0.01 * layer_index + 0.1 * tensor_index + stat_index + 0.001 * iteration


def write_run(run_dir, planted=()):
    """A run in the forward order of LAYERS; `planted`: (layer, tensor, stat, from_iteration, factor)."""
    sink = JsonlSink(os.path.join(run_dir, "tedebug_statistics", "metrics_globalrank-0.jsonl"))
    for iteration in ITERATIONS:
        records = []
        for li, layer in enumerate(LAYERS):
            for ti, tensor in enumerate(TENSORS):
                for si, stat in enumerate(STATS):
                    value = base_value(li, ti, si, iteration)
                    for p_layer, p_tensor, p_stat, start, factor in planted:
                        if (p_layer, p_tensor, p_stat) == (layer, tensor, stat) and iteration >= start:
                            value *= factor
                    records.append((f"{layer}_{tensor}_{stat}", value, iteration, layer, tensor, stat))
        sink.log_scalars(records)
    sink.close()
    return str(run_dir)


PLANTED = [
    ("blocks.10.mlp.fc1", "gradient", "std", 35, 1.3),  # the first departure of std (iteration 35) ...
    ("blocks.2.attn.qkv", "activation", "std", 35, 1.2),  # ... also at 35, shallower: named first
    ("blocks.1.attn.qkv", "activation", "std", 60, 2.0),  # shallowest, but later
    ("blocks.7.mlp.fc1", "activation", "max", 80, 1.04),  # below the default threshold of 5 %
    ("blocks.9.attn.qkv", "gradient", "max", 90, 0.5),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return write_run(root / "a"), write_run(root / "b", PLANTED)


def test_relative_difference_conventions():
    a = np.array([1.0, 0.0, 2.0, -1.0, math.nan, math.nan, math.inf, math.inf, 4.0])
    b = np.array([1.5, 0.0, 1.0, 1.0, math.nan, 1.0, math.inf, -math.inf, 3.0])
    got = compare.relative_difference(a, b)
    assert got.tolist() == [0.5 / 1.5, 0.0, 0.5, 2.0, 0.0, math.inf, 0.0, math.inf, 0.25]


def test_planted_divergence_is_found_at_its_layer_and_iteration(runs):
    result = compare.compare_runs(*runs)
    assert result.only_a == result.only_b == 0
    assert len(result.aligned) == len(LAYERS) * len(TENSORS) * len(STATS) * len(ITERATIONS)
    by_stat = {d.stat: d for d in result.departures}
    assert set(by_stat) == {"std", "max"}
    std = by_stat["std"]
    assert (std.iteration, std.layer, std.tensor) == (35, "blocks.2.attn.qkv", "activation")
    a = base_value(LAYERS.index("blocks.2.attn.qkv"), 0, 0, 35)
    assert (std.a, std.b) == (a, a * 1.2) and std.rel == pytest.approx(0.2 / 1.2, rel=1e-12)
    assert std.others == (("blocks.10.mlp.fc1", "gradient"),)
    mx = by_stat["max"]  # the 4 % change of blocks.7 stays below 5 %; blocks.9's halving departs at 90
    assert (mx.iteration, mx.layer, mx.tensor, mx.rel) == (90, "blocks.9.attn.qkv", "gradient", 0.5)
    assert [d.stat for d in result.departures] == ["std", "max"]  # earliest first
    assert [(layer, it, stat, tensor) for layer, it, stat, tensor, _ in result.layer_first] == [
        ("blocks.1.attn.qkv", 60, "std", "activation"),
        ("blocks.2.attn.qkv", 35, "std", "activation"),
        ("blocks.9.attn.qkv", 90, "max", "gradient"),
        ("blocks.10.mlp.fc1", 35, "std", "gradient"),
    ]  # model order

    text = compare.format_comparison(result)
    assert a == 1.075  # layer index 4 (blocks.2.attn.qkv), tensor 0, stat 0, iteration 35
    assert (
        "  std  iteration     35  blocks.2.attn.qkv activation: A=1.075 B=1.29 rel=0.1667; also "
        "blocks.10.mlp.fc1 gradient\n" in text
    )
    assert "  blocks.10.mlp.fc1  iteration     35  std of gradient (rel=0.2308)\n" in text  # 0.3 / 1.3
    assert "within the threshold throughout: underflows%" in text


def test_threshold_and_stat_selection(runs):
    low = compare.compare_runs(*runs, threshold=0.03, stats=["max"])
    [d] = low.departures
    assert (d.stat, d.iteration, d.layer, d.tensor) == ("max", 80, "blocks.7.mlp.fc1", "activation")
    assert set(low.aligned["stat"]) == {"max"}
    high = compare.compare_runs(*runs, threshold=0.45)  # only the 2x and 0.5x changes (rel 0.5) depart
    assert [(d.stat, d.iteration, d.layer) for d in high.departures] == [
        ("std", 60, "blocks.1.attn.qkv"),
        ("max", 90, "blocks.9.attn.qkv"),
    ]
    none = compare.compare_runs(runs[0], runs[0])
    assert not none.departed and "no statistic departs" in compare.format_comparison(none)
    missing = compare.compare_runs(*runs, stats=["l2norm"])
    assert missing.missing_stats == ["l2norm"] and "logged by neither run" in compare.format_comparison(missing)
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        compare.compare_runs(*runs, threshold=-1)


def test_compare_command(runs, capsys, tmp_path):
    assert cli.main(["compare", *runs, "--stat", "std"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"compare A={runs[0]}  B={runs[1]}\n")
    assert "  std  iteration     35  blocks.2.attn.qkv activation" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", *runs, "--fail-on-departure"])
    assert exit_info.value.code == 1
    assert cli.main(["compare", runs[0], runs[0], "--fail-on-departure"]) == 0
    with pytest.raises(SystemExit):
        cli.main(["compare", runs[0], str(tmp_path / "nothing")])
    assert "no tedebug statistics record" in capsys.readouterr().err
