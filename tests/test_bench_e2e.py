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
    rows = bench.bench_end_to_end(
        layers=layers,
        hidden=32,
        heads=2,
        batch=1,
        seq=8,
        iters=iters,
        warmup=warmup,
        rounds=rounds,
        device="cpu",
        dtype=torch.float32,
    )
    assert [r["setting"] for r in rows] == [
        "no debug_api (baseline)",
        "initialised, nothing active",
        "LogTensorStats, 6 tensors x 8 GEMMs, freq 1",
    ]
    for row in rows:
        assert 0 < row["min_ms"] <= row["ms"] <= row["max_ms"]
        assert row["overhead"] == pytest.approx(row["ms"] / rows[0]["ms"] - 1.0)
    assert rows[0]["overhead"] == 0.0
    gemms = 4 * layers  # qkv, proj, fc1, fc2
    assert len(fed) == rounds * (warmup + iters) * gemms * 6  # the idle config fed nothing
    assert {t for _, t in fed} == {"activation", "weight", "output", "gradient", "wgrad", "dgrad"}
    assert len({layer for layer, _ in fed}) == gemms
    assert not debug_api.is_enabled()  # every session was closed
    assert all(row["gc_ms"] >= 0.0 for row in rows)
    text = bench.format_e2e(rows)
    assert text.splitlines()[2].startswith("no debug_api (baseline)") and text.count("%") == 3
    assert "GC ms/step" in text.splitlines()[0]


def test_timed_steps_start_after_a_full_collection_and_the_clock_times_the_timed_ones(monkeypatch):
    """A round's timed steps start after `gc.collect()` (a full collection made due by earlier rounds lands in none
    of them), and `CollectorClock` counts the collections inside the timed steps only, by generation."""
    import gc

    events = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: events.append("collect") or real_collect(*a))
    calls = iter(range(100))

    def one():  # a step that collects generation 1 once, in its third call
        i = next(calls)
        events.append(f"step {i}")
        if i == 2:
            real_collect(1)

    was_enabled = gc.isenabled()
    gc.disable()  # (no automatic collection during the test: only the steps' and the round's own)
    try:
        clock = bench.CollectorClock()
        bench.timed_steps_ms(one, warmup=2, iters=2, on_gpu=False, collector=clock)
    finally:
        if was_enabled:
            gc.enable()
    assert events == ["step 0", "step 1", "collect", "step 2", "step 3"]
    assert clock.collections == [0, 1, 0] and clock.seconds > 0.0
    assert clock._callback not in gc.callbacks


def test_train_step_gives_each_phases_host_time(monkeypatch, tmp_path):
    """`train_step(phases=...)` appends one (forward, backward, optimizer, step()) tuple per step: here each phase
    is held up by a sleep of its own length, 80 ms apart, so each phase's time lies between its sleep and the
    next one's (a phase timed with its neighbour's sleep, or in another place, falls outside)."""
    import time

    model, x, opt = bench.training_setup(1, 16, 2, 1, 4, "cpu", torch.float32)
    slow = {"forward": 0.02, "backward": 0.1, "optimizer": 0.18, "step": 0.26}

    def held(seconds, real):
        def call(*args, **kwargs):
            time.sleep(seconds)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(model, "forward", held(slow["forward"], model.forward))
    monkeypatch.setattr(torch.Tensor, "backward", held(slow["backward"], torch.Tensor.backward))
    monkeypatch.setattr(opt, "step", held(slow["optimizer"], opt.step))
    monkeypatch.setattr(debug_api, "step", held(slow["step"], debug_api.step))
    phases = []
    debug_api.initialize(bench.logging_config("hp-log"), log_dir=str(tmp_path))
    try:
        bench.train_step(model, x, opt, None)  # (the first step also builds the session's plans)
        for _ in range(2):
            bench.train_step(model, x, opt, None, phases)
    finally:
        debug_api.end_debug()
    assert len(phases) == 2
    for step in phases:
        assert len(step) == 4
        for seconds, floor in zip(step, slow.values()):
            assert floor <= seconds < floor + 0.07


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
    rows = bench.bench_recipes(
        layers=1, hidden=64, heads=2, batch=1, seq=32, iters=1, warmup=1, rounds=1, device="cpu", dtype=torch.float32
    )
    assert [r["setting"] for r in rows] == ["plain torch (baseline)", "converted, high precision", *bench.RECIPES]
    assert rows[0]["ratio"] == 1.0 and all(r["ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert set(used) == {
        "Float8CurrentScalingQuantizer",
        "Float8Quantizer",
        "Float8BlockQuantizer",
        "MXFP8Quantizer",
        "NVFP4Quantizer",
    }


def test_recipe_bench_command_on_cpu(capsys):
    from tedebug.cli import main

    code = main(
        [
            "bench",
            "--e2e",
            "--recipes",
            "--device",
            "cpu",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--layers",
            "1",
            "--only",
            "MXFP8BlockScaling",
        ]
    )
    out = capsys.readouterr().out
    assert not code  # main returns 0 (or None) on success and raises SystemExit otherwise
    assert "plain torch (baseline)" in out and "MXFP8BlockScaling" in out and "NVFP4BlockScaling" not in out


def test_end_to_end_bench_fp8_rows_feed_three_tensors_each(monkeypatch):
    """`--fp8`: the FP8 baseline feeds nothing, the two logging rows feed activation, weight and gradient of every
    GEMM at every step, and their overheads are against the FP8 baseline."""
    fed = []
    real_feed = engine_module.StatsEngine.feed

    def counting_feed(self, layer, tensor_name, *args, **kwargs):
        fed.append((layer, tensor_name, bool(kwargs.get("quantized"))))
        return real_feed(self, layer, tensor_name, *args, **kwargs)

    monkeypatch.setattr(engine_module.StatsEngine, "feed", counting_feed)
    layers, iters, warmup = 1, 1, 1
    rows = bench.bench_end_to_end(
        layers=layers,
        hidden=32,
        heads=2,
        batch=1,
        seq=16,
        iters=iters,
        warmup=warmup,
        rounds=1,
        device="cpu",
        dtype=torch.float32,
        fp8=True,
    )
    labels = [r["setting"] for r in rows]
    assert labels[3:] == [
        "FP8 current scaling, no debug_api (FP8 baseline)",
        "FP8 + LogFp8TensorStats, 3 tensors x 4 GEMMs",
        "FP8 + LogTensorStats + LogFp8TensorStats, 3 x 4",
    ]
    assert rows[3]["overhead"] == 0.0 and rows[3]["per_tensor_us"] is None
    assert rows[4]["overhead"] == pytest.approx(rows[4]["ms"] / rows[3]["ms"] - 1.0)
    assert rows[4]["per_tensor_us"] == pytest.approx((rows[4]["ms"] - rows[3]["ms"]) * 1e3 / 12)
    steps = warmup + iters
    gemms = 4 * layers
    fp8_fed = [f for f in fed if f[1] in ("activation", "weight", "gradient") and f[2]]
    # LogFp8TensorStats in both FP8 logging rows; LogTensorStats only in the HP row (6 tensors) and the last row
    assert len(fp8_fed) == 2 * steps * gemms * 3
    assert {t for _, t, _ in fp8_fed} == {"activation", "weight", "gradient"}


def test_end_to_end_bench_command_on_cpu(capsys):
    from tedebug.cli import main

    code = main(
        [
            "bench",
            "--e2e",
            "--device",
            "cpu",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--layers",
            "1",
            "--hidden",
            "32",
            "--seq",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert not code
    assert "no debug_api (baseline)" in out and "us/tensor" in out and "FP8" not in out
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--fp8"])  # --fp8 needs --e2e
    assert exit_info.value.code == 2


def _recording(monkeypatch, seen, name, note):
    """Replace ``debug_api.<name>`` by a wrapper that appends ``note(*args, **kwargs)`` to `seen`, then calls it."""
    from tedebug import debug_api as api

    real = getattr(api, name)

    def recording(*args, **kwargs):
        seen.append(note(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, name, recording)


def test_end_to_end_bench_writer_thread_rows_follow_each_logging_row(monkeypatch):
    """`--writer-thread`: each row that logs (with the writer process, the default) is followed by the same setting
    with background_logging=True, whose overhead is against the same baseline (the high-precision or the FP8 one)."""
    used = []
    _recording(monkeypatch, used, "initialize", lambda *args, **kwargs: kwargs.get("background_logging"))
    rows = bench.bench_end_to_end(
        layers=1, hidden=32, heads=2, batch=1, seq=16, iters=1, warmup=1, rounds=1, device="cpu",
        dtype=torch.float32, fp8=True, writer_thread=True,
    )  # fmt: skip
    labels = [r["setting"] for r in rows]
    assert labels == [
        "no debug_api (baseline)",
        "initialised, nothing active",
        "LogTensorStats, 6 tensors x 4 GEMMs, freq 1",
        "LogTensorStats, 6 tensors x 4 GEMMs, freq 1, writer thread",
        "FP8 current scaling, no debug_api (FP8 baseline)",
        "FP8 + LogFp8TensorStats, 3 tensors x 4 GEMMs",
        "FP8 + LogFp8TensorStats, 3 tensors x 4 GEMMs, writer thread",
        "FP8 + LogTensorStats + LogFp8TensorStats, 3 x 4",
        "FP8 + LogTensorStats + LogFp8TensorStats, 3 x 4, writer thread",
    ]
    assert used == ["process", "process", True, "process", True, "process", True]
    assert rows[3]["overhead"] == pytest.approx(rows[3]["ms"] / rows[0]["ms"] - 1.0)
    assert rows[6]["overhead"] == pytest.approx(rows[6]["ms"] / rows[4]["ms"] - 1.0)
    assert rows[6]["per_tensor_us"] == pytest.approx((rows[6]["ms"] - rows[4]["ms"]) * 1e3 / 12)


def test_end_to_end_bench_tensorboard_rows_follow_the_logging_row(monkeypatch, tmp_path):
    """`--tensorboard`: after the LogTensorStats row, the same setting with a TensorBoardSink(log_dir) and with a
    tb_writer, against the high-precision baseline; the FP8 rows keep their own baseline."""
    from tedebug.sinks.tensorboard import TensorBoardSink

    seen = []
    _recording(monkeypatch, seen, "initialize", lambda *args, **kwargs: type(kwargs.get("tb_writer")).__name__)
    _recording(monkeypatch, seen, "add_statistics_sink", lambda sink: type(sink).__name__)
    rows = bench.bench_end_to_end(
        layers=1, hidden=32, heads=2, batch=1, seq=16, iters=1, warmup=1, rounds=1, device="cpu",
        dtype=torch.float32, fp8=True, tensorboard=True,
    )  # fmt: skip
    assert [r["setting"] for r in rows][2:6] == [
        "LogTensorStats, 6 tensors x 4 GEMMs, freq 1",
        "LogTensorStats + TensorBoardSink(log_dir)",
        "LogTensorStats + tb_writer (no text file)",
        "FP8 current scaling, no debug_api (FP8 baseline)",
    ]
    assert seen[:5] == ["NoneType", "NoneType", "NoneType", TensorBoardSink.__name__, "SummaryWriter"]
    assert rows[4]["per_tensor_us"] == pytest.approx((rows[4]["ms"] - rows[0]["ms"]) * 1e3 / 24)
    assert rows[7]["overhead"] == pytest.approx(rows[7]["ms"] / rows[5]["ms"] - 1.0)  # FP8 + both vs the FP8 baseline
