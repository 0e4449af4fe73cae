"""The host-cost shortcuts of the features never change an answer: the identity-checked config memo
(`feature_support.config_memoized`) behind `cached_schedule` and LogTensorStats' `inspect_plan`, the tuple form of
the reduction parameters and the prebuilt log line; and a whole run with the compiled plans (`tedebug.plan`, whose
own promises tests/test_plan.py pins by counting calls) logs exactly what it logs with the plan cache and the config
memos off."""

from __future__ import annotations

import re

import pytest
import torch

import tedebug
import tedebug.feature_support as feature_support
import tedebug.features.log_tensor_stats as log_tensor_stats
from tedebug import debug_api
from tedebug.feature_support import (
    CONFIG_MEMO_SIZE,
    ReductionParams,
    cached_schedule,
    config_memoized,
    memoized,
    reduction_args,
    reduction_params,
)
from tedebug.features.log_tensor_stats import feed_arguments, inspect_plan, look_message
from tedebug.recipe import Float8CurrentScaling

from support.features import RecordingSink, debug_session, section

TENSORS = ("activation", "weight", "gradient", "output", "wgrad", "dgrad")


# ------------------------------------------------------------------------------------------------ config memo
def test_config_memoized_serves_the_content_memos_object_and_notices_every_change(tmp_path):
    calls = []

    def compute(config):
        def run():
            calls.append(1)
            return memoized("content", feature_support.exact_key([config.get(k) for k in ("a", "b")]),
                            lambda: object())
        return run

    keys = ("a", "b")
    with debug_session(section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}),
                       tmp_path):
        config = {"a": 5, "b": ["x", "y"]}
        first = config_memoized("t", config, keys, None, compute(config))
        assert config_memoized("t", config, keys, None, compute(config)) is first and len(calls) == 1
        assert config_memoized("t", config, keys, "other", compute(config)) is first and len(calls) == 2  # extra
        config["a"] = 5.0  # equal value, another type
        second = config_memoized("t", config, keys, None, compute(config))
        assert len(calls) == 3 and second is not first
        config["a"] = 5
        assert config_memoized("t", config, keys, None, compute(config)) is first and len(calls) == 4
        config["b"][1] = "z"  # an item replaced in place
        third = config_memoized("t", config, keys, None, compute(config))
        assert len(calls) == 5 and third is not first
        config["b"].append("w")  # the list grows in place
        assert config_memoized("t", config, keys, None, compute(config)) is not third and len(calls) == 6
        config["b"] = ["x", "y"]  # an equal new list: computed again, same content -> the same object
        assert config_memoized("t", config, keys, None, compute(config)) is first and len(calls) == 7
        config["c"] = 1  # a key it does not depend on
        assert config_memoized("t", config, keys, None, compute(config)) is first and len(calls) == 7
        copy = dict(config)  # another object: its own entry
        assert config_memoized("t", copy, keys, None, compute(copy)) is first and len(calls) == 8

        mutable = {"a": 1, "b": [{"k": 1}]}  # a mutable item: never stored
        config_memoized("t", mutable, keys, None, compute(mutable))
        config_memoized("t", mutable, keys, None, compute(mutable))
        nested = {"a": [[1, 2]], "b": None}  # a nested list: never stored
        config_memoized("t", nested, keys, None, compute(nested))
        config_memoized("t", nested, keys, None, compute(nested))
        assert len(calls) == 12
        assert all(entry[0] is not mutable and entry[0] is not nested for entry in debug_api.session().memo("t")
                   .values())
        ended = debug_api.session()
    assert ended.memo("t") == {}  # dropped with the session
    config_memoized("t", config, keys, None, compute(config))
    config_memoized("t", config, keys, None, compute(config))
    assert len(calls) == 14  # no session: computed every time


def test_config_memoized_is_bounded_and_raising_stores_nothing(tmp_path):
    with debug_session(section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}),
                       tmp_path):
        configs = [{"a": i} for i in range(CONFIG_MEMO_SIZE + 10)]
        for config in configs:
            config_memoized("bounded", config, ("a",), None, lambda: 0)
        assert 0 < len(debug_api.session().memo("bounded")) <= CONFIG_MEMO_SIZE

        def fail():
            raise ValueError("bad")

        with pytest.raises(ValueError, match="bad"):
            config_memoized("raising", {"a": 1}, ("a",), None, fail)
        assert debug_api.session().memo("raising") == {}


def test_cached_schedule_by_identity_follows_a_mutated_config(tmp_path):
    with debug_session(section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}),
                       tmp_path):
        config = {"freq": 2, "start_end_list": [[0, 9]]}  # nested list: content memo only
        assert cached_schedule(config).query(3) == (False, 4)
        config["start_end_list"][0][1] = 3
        assert cached_schedule(config).query(2) == (True, None)
        plain = {"freq": 2, "start_step": 4}
        assert cached_schedule(plain).query(4) == (True, 6)
        assert cached_schedule(plain) is cached_schedule(dict(plain))  # one content entry for both objects
        plain["start_step"] = 6
        assert cached_schedule(plain).query(4) == (False, 6)
        plain["freq"] = 2.0
        with pytest.raises(ValueError, match="freq"):
            cached_schedule(plain)


# ------------------------------------------------------------------------------------------------ LogTensorStats
def hand_stats(x):
    v = x.double().flatten()
    return {"min": v.min().item(), "max": v.max().item(), "mean": (v.sum() / v.numel()).item(),
            "l1_norm": v.abs().sum().item(), "cur_amax": v.abs().max().item()}


def test_inspect_plan_follows_a_mutated_stats_list_and_keeps_the_error_order(tmp_path):
    """Direct calls with one user dict: statistics follow the mutated list; a bad entry fails only on an active
    iteration, after the tensor check, as before the plan existed."""
    sink = RecordingSink()
    feature = log_tensor_stats.LogTensorStats()
    config = {"stats": ["min", "max"], "freq": 2}
    x = torch.tensor([[1.5, -3.0], [0.25, 2.0]])
    with debug_session(section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}),
                       tmp_path, sink):
        feature.inspect_tensor(config, "L", tensor_name="activation", iteration=0, tensor=x)
        debug_api.step()
        config["stats"][1] = "l1_norm"
        config["stats"].append("mean")
        feature.inspect_tensor(config, "L", tensor_name="activation", iteration=1, tensor=x)  # inactive (freq 2)
        feature.inspect_tensor(config, "L", tensor_name="activation", iteration=2, tensor=-x)
        debug_api.step()
        assert inspect_plan(config, "activation").feed == feed_arguments(config, "activation")
        config["stats"].append("no_such_stat")
        feature.inspect_tensor(config, "L", tensor_name="activation", iteration=3, tensor=x)  # inactive: no error
        with pytest.raises(ValueError, match="must be in high precision"):
            feature.inspect_tensor(config, "L", tensor_name="activation", iteration=4, tensor=x.int())
        with pytest.raises(ValueError, match="no_such_stat"):
            feature.inspect_tensor(config, "L", tensor_name="activation", iteration=4, tensor=x)
    expect, expect2 = hand_stats(x), hand_stats(-x)
    assert sink.values() == {
        ("L_activation_min", 0): expect["min"], ("L_activation_max", 0): expect["max"],
        ("L_activation_min", 2): expect2["min"], ("L_activation_l1_norm", 2): expect2["l1_norm"],
        ("L_activation_mean", 2): expect2["mean"]}


def test_reduction_args_equal_reduction_params(tmp_path):
    group = object()
    with debug_session(section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}),
                       tmp_path):
        current = debug_api.session()
        for reduce_weights in (True, False):
            current.weight_tensor_tp_group_reduce = reduce_weights
            current.reduction_group = object()
            for tensor in ("activation", "weight", "gradient"):
                for tp_group, tp_size in ((None, 1), (group, 1), (group, 4), (None, 4), (group, None)):
                    args = reduction_args(current, tensor, tp_group, tp_size)
                    assert ReductionParams(*args) == reduction_params(tensor, tp_group, tp_size)
        assert reduction_args(current, "weight", group, 4) == (None, True, True)  # reduce_weights False
        current.weight_tensor_tp_group_reduce = True
        assert reduction_args(current, "weight", group, 4) == (group, False, True)
        assert reduction_args(current, "gradient", group, 4) == (current.reduction_group, False, False)


def test_look_message_is_the_feature_line():
    assert look_message("LogTensorStats", "wgrad") == "Feature=LogTensorStats, API=look_at_tensor_before_process: wgrad"
    assert look_message("LogTensorStats", "wgrad") is look_message("LogTensorStats", "wgrad")


# ------------------------------------------------------------------------------------------------ whole runs
def _run_model(tmp_path, config, **initialize_kwargs):
    """Three-layer model under Float8CurrentScaling for six iterations: (statistics rows, main-log lines)."""
    sink = RecordingSink()
    torch.manual_seed(0)
    model = torch.nn.Sequential(tedebug.nn.Linear(16, 24, name="m.0"), tedebug.nn.LayerNormMLP(24, 32, name="m.1"),
                                tedebug.nn.Linear(24, 8, name="m.2"))
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
    config = section({
        "LogTensorStats": {"enabled": True, "stats": ["min", "max", "mean", "std", "l1_norm", "l2_norm",
                                                      "cur_amax", "dynamic_range"],
                           "tensors": list(TENSORS), "freq": 2, "start_step": 1},
        "DisableFP8GEMM": {"enabled": True, "gemms": ["wgrad"]},
    })
    fast = _run_model(tmp_path / "fast", config)
    assert fast[0] and any("Tensor: activation, gemm wgrad - High Precision" in line for line in fast[1])
    assert sorted({it for _, _, it in fast[0]}) == [2, 4]  # freq 2 from step 1
    monkeypatch.setattr(feature_support, "config_memoized",
                        lambda table, config, keys, extra, compute: compute())
    monkeypatch.setattr(log_tensor_stats, "config_memoized", lambda table, config, keys, extra, compute: compute())
    slow = _run_model(tmp_path / "slow", config, plan_cache=False)
    assert fast == slow
