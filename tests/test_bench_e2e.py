"""The end-to-end part of `tedebug bench` on CPU (tiny shapes): three settings measured in interleaved rounds, the
idle config feeding nothing, the full config feeding all six tensors of every GEMM at every iteration."""

import pytest
import torch

from tedebug import bench, debug_api
from tedebug.stats import engine as engine_module


@pytest.fixture(autouse=True)
def no_session():
    debug_api.end_debug()
    yield
    debug_api.end_debug()


def test_end_to_end_bench_runs_its_three_settings(monkeypatch):
    fed = []
    real_feed = engine_module.StatsEngine.feed

    def counting_feed(self, layer, tensor_name, *args, **kwargs):
        fed.append((layer, tensor_name))
        return real_feed(self, layer, tensor_name, *args, **kwargs)

    monkeypatch.setattr(engine_module.StatsEngine, "feed", counting_feed)
    layers, iters, warmup, rounds = 2, 2, 1, 2
    rows = bench.bench_end_to_end(layers=layers, hidden=32, heads=2, batch=1, seq=8, iters=iters, warmup=warmup,
                                  rounds=rounds, device="cpu", dtype=torch.float32)
    assert [r["setting"] for r in rows] == ["no debug_api (baseline)", "initialised, nothing active",
                                            "LogTensorStats, 6 tensors x 8 GEMMs, freq 1"]
    for row in rows:
        assert 0 < row["min_ms"] <= row["ms"] <= row["max_ms"]
        assert row["overhead"] == pytest.approx(row["ms"] / rows[0]["ms"] - 1.0)
    assert rows[0]["overhead"] == 0.0
    gemms = 4 * layers  # qkv, proj, fc1, fc2
    assert len(fed) == rounds * (warmup + iters) * gemms * 6  # the idle config fed nothing
    assert {t for _, t in fed} == {"activation", "weight", "output", "gradient", "wgrad", "dgrad"}
    assert len({layer for layer, _ in fed}) == gemms
    assert not debug_api.is_enabled()  # every session was closed
    text = bench.format_e2e(rows)
    assert text.splitlines()[2].startswith("no debug_api (baseline)") and text.count("%") == 3
