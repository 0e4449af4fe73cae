"""The end-to-end part of `tedebug bench` on CPU (tiny shapes): three settings measured in interleaved rounds, the
idle config feeding nothing, the full config feeding all six tensors of every GEMM at every iteration."""

import pytest
import torch

from tedebug import bench, debug_api
from tedebug.stats import engine as engine_module


pytestmark = pytest.mark.usefixtures("no_debug_session")  # tests/conftest.py


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


def test_recipe_bench_runs_every_recipe_on_cpu(monkeypatch):
    """`tedebug bench --e2e --recipes --device cpu`: the baseline, the converted model and every recipe, each
    recipe really quantizing with its own quantizer class."""
    from tedebug.quantization.tensor import Quantizer

    used = []
    real = Quantizer.quantize

    def counting(self, tensor, **kwargs):
        used.append(type(self).__name__)
        return real(self, tensor, **kwargs)

    monkeypatch.setattr(Quantizer, "quantize", counting)
    rows = bench.bench_recipes(layers=1, hidden=64, heads=2, batch=1, seq=32, iters=1, warmup=1, rounds=1,
                               device="cpu", dtype=torch.float32)
    assert [r["setting"] for r in rows] == ["plain torch (baseline)", "converted, high precision", *bench.RECIPES]
    assert rows[0]["ratio"] == 1.0 and all(r["ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert set(used) == {"Float8CurrentScalingQuantizer", "Float8Quantizer", "Float8BlockQuantizer",
                         "MXFP8Quantizer", "NVFP4Quantizer"}


def test_recipe_bench_command_on_cpu(capsys):
    from tedebug.cli import main

    code = main(["bench", "--e2e", "--recipes", "--device", "cpu", "--rounds", "1", "--steps", "1", "--layers", "1",
                 "--only", "MXFP8BlockScaling"])
    out = capsys.readouterr().out
    assert not code  # main returns 0 (or None) on success and raises SystemExit otherwise
    assert "plain torch (baseline)" in out and "MXFP8BlockScaling" in out and "NVFP4BlockScaling" not in out
