"""`tedebug.backends.launch`: argument typing and mode selection on any machine; on a GPU, the driver launch and
CuPy's own launch give identical results, and statistics reach the engine's slab through the driver launch (read back
at the step or, deferred, at the next one)."""

import numpy as np
import pytest
import torch

from tedebug.backends import launch


def test_arguments_need_a_fixed_c_type():
    assert launch._ctype_value(7, "k", 0).value == 7  # a device pointer
    assert launch._ctype_value(np.int32(-3), "k", 1).value == -3
    assert launch._ctype_value(np.float32(0.1), "k", 2).value == pytest.approx(np.float32(0.1), abs=0)
    with pytest.raises(TypeError, match=r"kernel 'ted_x', argument 3: float has no fixed C type"):
        launch._ctype_value(0.5, "ted_x", 3)
    with pytest.raises(TypeError, match="bool"):
        launch._ctype_value(True, "ted_x", 0)


def test_launch_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv(launch.ENV_VAR, "cupy")
    assert launch.launch_mode() == "cupy"
    monkeypatch.setenv(launch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=r"TEDEBUG_LAUNCH='fast': expected one of \('driver', 'cupy'\)"):
        launch.launch_mode()
    monkeypatch.setattr(launch, "_driver", lambda: None)
    monkeypatch.setenv(launch.ENV_VAR, "driver")
    with pytest.raises(RuntimeError, match="libcuda could not be loaded"):
        launch.launch_mode()
    monkeypatch.delenv(launch.ENV_VAR)
    assert launch.launch_mode() == "cupy"


def test_stream_handle_speaks_the_cuda_stream_protocol():
    assert launch._StreamHandle(1234).__cuda_stream__() == (0, 1234)


@pytest.mark.gpu
def test_driver_and_cupy_launches_agree(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("cupy")
    from tedebug.backends import cupy_kernels

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4099, 33, generator=g) * 7 + 3).to("cuda", torch.bfloat16)
    rows = {}
    for mode in ("driver", "cupy"):
        monkeypatch.setenv(launch.ENV_VAR, mode)
        assert launch.launch_mode() == mode
        out = torch.full((13,), -1.0, dtype=torch.float64, device="cuda")
        cupy_kernels.basic_stats_into(x, out.data_ptr())
        rows[mode] = out.cpu()
    assert torch.equal(rows["driver"], rows["cupy"])
    assert rows["driver"][0].item() == x.numel()
    assert rows["driver"][1].item() == x.float().min().item() and rows["driver"][2].item() == x.float().max().item()


@pytest.mark.gpu
def test_engine_slab_rows_on_the_gpu_equal_the_torch_path():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("cupy")
    from tedebug.backends import dispatch
    from tedebug.stats.engine import StatsEngine
    from test_features_helpers import RecordingSink

    stats = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range", "nan_count")
    g = torch.Generator().manual_seed(2)
    xs = [(torch.randn(300, 257, generator=g) * s).to("cuda", dt)
          for s, dt in ((1.0, torch.bfloat16), (1e-3, torch.float16), (50.0, torch.float32))]
    blockwise = ({"max_blockwise_dynamic_range": {"block_size": 4, "dims": 1}},)  # a row tensor, not a slab row
    emitted = {}
    for name, backend, defer in (("torch", "torch", False), ("cupy", "cupy", False), ("deferred", "cupy", True)):
        sink = RecordingSink()
        engine = StatsEngine(sink, defer_read_back=defer)
        with dispatch.use_backend(backend):
            for step in range(3):
                for i, x in enumerate(xs):
                    engine.feed(f"l{i}", "activation", stats, x * (step + 1), iteration=step)
                    engine.feed(f"l{i}", "activation", stats, x[:7], iteration=step)  # a second microbatch
                    engine.feed(f"l{i}", "weight", blockwise, x.float() - step, iteration=step)
                engine.step(step)
            engine.finish_pending()
        emitted[name] = [r for r in sink.rows if "blockwise" not in r[0]]
        emitted[name + " blockwise"] = [r for r in sink.rows if "blockwise" in r[0]]
    assert repr(emitted["deferred"]) == repr(emitted["cupy"])  # the deferred read-back changes nothing
    assert emitted["deferred blockwise"] == emitted["cupy blockwise"] == emitted["torch blockwise"]
    assert len(emitted["cupy blockwise"]) == 3 * 3
    assert len(emitted["torch"]) == len(emitted["cupy"]) == 3 * 3 * len(stats)
    for (name, ref, it), (name2, got, it2) in zip(emitted["torch"], emitted["cupy"]):
        assert (name, it) == (name2, it2)
        if name.endswith(("_min", "_max", "_cur_amax", "_nan_count", "_dynamic_range")):
            assert ref == got, name
        else:  # sums: fp32 chunks then fp64 (kernels/stats.cu) vs the torch reference
            assert got == pytest.approx(ref, rel=1e-5), name
