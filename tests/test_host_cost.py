"""The host-cost shortcuts of the features never change an answer: the session memo (`tedebug.memo`) behind
`schedule_of` and LogTensorStats' `inspect_plan` and its prebuilt log line; and a whole run with the compiled plans
(`tedebug.plan`, whose own promises tests/test_plan.py pins by counting calls) logs exactly what it logs with the plan
cache and the memos off."""

from __future__ import annotations

import re

import pytest
import torch

import tedebug
import tedebug.memo
from tedebug import debug_api
from tedebug.features import log_tensor_stats
from tedebug.features.log_tensor_stats import inspect_plan
from tedebug.recipe import Float8CurrentScaling

from support.features import RecordingSink, debug_session, section

TENSORS = ("activation", "weight", "gradient", "output", "wgrad", "dgrad")


def hand_stats(x):
    v = x.double().flatten()
    return {
        "min": v.min().item(),
        "max": v.max().item(),
        "mean": (v.sum() / v.numel()).item(),
        "l1_norm": v.abs().sum().item(),
        "cur_amax": v.abs().max().item(),
    }


def test_inspect_plan_follows_a_mutated_stats_list_and_keeps_the_error_order(tmp_path):
    """Direct calls with one user dict: statistics follow the mutated list; a bad entry fails only on an active
    iteration, after the tensor check, as before the plan existed."""
    sink = RecordingSink()
    feature = log_tensor_stats.LogTensorStats()
    config = {"stats": ["min", "max"], "freq": 2}
    x = torch.tensor([[1.5, -3.0], [0.25, 2.0]])
    with debug_session(
        section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}), tmp_path, sink
    ):
        feature.inspect_tensor(config, "L", tensor_name="activation", iteration=0, tensor=x)
        debug_api.step()
        config["stats"][1] = "l1_norm"
        config["stats"].append("mean")
        feature.inspect_tensor(config, "L", tensor_name="activation", iteration=1, tensor=x)  # inactive (freq 2)
        feature.inspect_tensor(config, "L", tensor_name="activation", iteration=2, tensor=-x)
        debug_api.step()
        plan = inspect_plan(config, "activation")
        assert [r.name for r in plan.requests] == ["min", "l1_norm", "mean"]
        assert plan.message == "Feature=LogTensorStats, API=look_at_tensor_before_process: activation"
        config["stats"].append("no_such_stat")
        feature.inspect_tensor(config, "L", tensor_name="activation", iteration=3, tensor=x)  # inactive: no error
        with pytest.raises(ValueError, match="must be in high precision"):
            feature.inspect_tensor(config, "L", tensor_name="activation", iteration=4, tensor=x.int())
        with pytest.raises(ValueError, match="no_such_stat"):
            feature.inspect_tensor(config, "L", tensor_name="activation", iteration=4, tensor=x)
    expect, expect2 = hand_stats(x), hand_stats(-x)
    assert sink.values() == {
        ("L_activation_min", 0): expect["min"],
        ("L_activation_max", 0): expect["max"],
        ("L_activation_min", 2): expect2["min"],
        ("L_activation_l1_norm", 2): expect2["l1_norm"],
        ("L_activation_mean", 2): expect2["mean"],
    }


# ------------------------------------------------------------------------------------------------ whole runs


# ------------------------------------------------------------------------------------------------ whole runs
def _run_model(tmp_path, config, **initialize_kwargs):
    """Three-layer model under Float8CurrentScaling for six iterations: (statistics rows, main-log lines)."""
    sink = RecordingSink()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        tedebug.nn.Linear(16, 24, name="m.0"),
        tedebug.nn.LayerNormMLP(24, 32, name="m.1"),
        tedebug.nn.Linear(24, 8, name="m.2"),
    )
    x = torch.randn(4, 16)
    with debug_session(config, tmp_path, sink, **initialize_kwargs):
        for _ in range(6):
            for _micro in range(2):
                with tedebug.autocast(recipe=Float8CurrentScaling()):
                    model(x).square().sum().backward()
            debug_api.step()
        log_path = debug_api.session().text_log.path
    lines = [re.sub(r"^.*? - ", "", line) for line in open(log_path, encoding="utf-8").read().splitlines()]
    return sink.rows, [line for line in lines if "Reading config" not in line and "Default logging" not in line]


def test_whole_runs_equal_the_uncached_path(tmp_path, monkeypatch):
    """Statistics and main-log lines of a real model are identical with every shortcut on and with each off."""
    config = section(
        {
            "LogTensorStats": {
                "enabled": True,
                "stats": ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"],
                "tensors": list(TENSORS),
                "freq": 2,
                "start_step": 1,
            },
            "DisableFP8GEMM": {"enabled": True, "gemms": ["wgrad"]},
        }
    )
    fast = _run_model(tmp_path / "fast", config)
    assert fast[0] and any("Tensor: activation, gemm wgrad - High Precision" in line for line in fast[1])
    assert sorted({it for _, _, it in fast[0]}) == [2, 4]  # freq 2 from step 1
    monkeypatch.setattr(tedebug.memo, "memoized", lambda table, key, compute: compute())
    slow = _run_model(tmp_path / "slow", config, plan_cache=False)
    assert fast == slow


@pytest.mark.parametrize("what_if", [False, True])
def test_fp8_statistics_runs_equal_the_uncached_path_and_skip_the_full_planning(tmp_path, monkeypatch, what_if):
    """LogFp8TensorStats on a real model under FP8 current scaling (microbatches, freq 2): the same statistics and
    main-log lines with the bound debug path as through the namespace; the bound path answers feeds of the training
    recipe without `inspect_tensor` (call counter), and takes it for a what-if statistic (a quantization per feed)."""
    stats = ["underflows%", "mse", "scale_inv_min", "scale_inv_max"] + (["mxfp8_underflows%"] if what_if else [])
    tensors = ["activation", "weight", "gradient"]
    config = section({"LogFp8TensorStats": {"enabled": True, "stats": stats, "tensors": tensors, "freq": 2}})
    import sys

    calls = []

    def count_calls(*args, **kwargs):  # wraps the class's inspect_tensor in every loaded copy of the module
        for name, module in list(sys.modules.items()):
            cls = getattr(module, "LogFp8TensorStats", None) if name.endswith("log_fp8_tensor_stats") else None
            real = getattr(cls, "inspect_tensor", None)
            if real is not None and not hasattr(real, "counted"):

                def spy(self, *a, real=real, **k):
                    calls.append(1)
                    return real(self, *a, **k)

                spy.counted = True
                spy.is_api = True
                monkeypatch.setattr(cls, "inspect_tensor", spy)

    monkeypatch.setattr(debug_api, "step", _counting_first_step(debug_api.step, count_calls))
    fast = _run_model(tmp_path / "fast", config)
    names = {name.rsplit("_", 1)[0] for name, _, _ in fast[0]}
    assert fast[0] and sorted({it for _, _, it in fast[0]}) == [0, 2, 4]
    feeds_after_step_0 = 2 * 2 * 3 * 4  # iterations 2 and 4, 2 microbatches, 3 tensors, 4 GEMMs
    assert len(calls) == (feeds_after_step_0 if what_if else 0), names
    calls.clear()
    slow = _run_model(tmp_path / "slow", config, plan_cache=False)
    assert fast == slow


def _counting_first_step(step, install):
    """debug_api.step that installs the call counter after the first step (when every feature module is loaded)."""
    done = []

    def wrapped(*args, **kwargs):
        result = step(*args, **kwargs)
        if not done:
            install()
            done.append(1)
        return result

    return wrapped
