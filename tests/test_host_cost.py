"""The host-cost shortcuts of the debug path never change an answer: route templates (`DebugQuantizer`), the
session memo (`tedebug.memo`) behind `schedule_of` and LogTensorStats' `inspect_plan`, the plan's prebuilt log line,
the gate's next iteration and its renewed quantizers, and `DebugQuantizer`'s direct inspect route and
LogTensorStats' prepared form of it.
Each shortcut is compared with the path it replaces, and its invalidation (new session, changed config, patched
hook, spy) is exercised."""

from __future__ import annotations

import re

import pytest
import torch

import tedebug
import tedebug.features.log_tensor_stats as log_tensor_stats
import tedebug.memo
from tedebug import debug_api
from tedebug import debug_quantization
from tedebug.debug_quantization import TEMPLATE_TABLE, DebugQuantizer, te_namespace
from tedebug.features.log_tensor_stats import inspect_plan
from tedebug.namespace import TransformerEngineNamespace
from tedebug.nn.debug_gate import ROLE_TO_TENSOR, LayerDebugState
from tedebug.quantization import Float8CurrentScalingQuantizer
from tedebug.recipe import Float8CurrentScaling

from support.features import RecordingSink, debug_session, section

TENSORS = ("activation", "weight", "gradient", "output", "wgrad", "dgrad")
PARENTED = ("activation", "weight", "gradient")


def routed(q):
    """Everything `_route` fixes on a DebugQuantizer."""
    return (q.inspect_tensor_enabled, q.rowwise_tensor_plan, q.columnwise_tensor_plan,
            q.rowwise_postquantize_enabled, q.columnwise_postquantize_enabled, q.get_next_debug_iter())


def parent_for(tensor):
    return Float8CurrentScalingQuantizer("E5M2" if tensor == "gradient" else "E4M3") if tensor in PARENTED else None


@pytest.fixture
def route_calls(monkeypatch):
    """Count full `_route` runs (a templated construction runs none)."""
    calls = []
    real = DebugQuantizer._route

    def counting(self, asked=None):
        calls.append(self.tensor_name)
        return real(self, asked)

    monkeypatch.setattr(DebugQuantizer, "_route", counting)
    return calls


def templates():
    return debug_api.session().memo(TEMPLATE_TABLE)


# ------------------------------------------------------------------------------------------------ route templates
@pytest.mark.parametrize("with_parent", [False, True])
def test_templated_construction_equals_full_routing_every_iteration(start, route_calls, with_parent):
    """DebugInspect (a feature's own inspect_tensor_enabled, called every time) on a freq-3 schedule: for twelve
    iterations, a construction from the template gives exactly the full routing's attributes, and the features see
    exactly the same calls."""
    module = start({"DebugInspect": {"enabled": True, "tensors": list(TENSORS), "freq": 3, "start_step": 2}})
    for iteration in range(12):
        for tensor in TENSORS:
            parent = parent_for(tensor) if with_parent else None
            templates().clear()
            module.CALLS.clear()
            route_calls.clear()
            reference = DebugQuantizer("L", tensor, parent, None)
            reference_calls = list(module.CALLS)
            assert route_calls == [tensor]
            module.CALLS.clear()
            route_calls.clear()
            fast = DebugQuantizer("L", tensor, parent, None)
            assert route_calls == []  # the template was used
            assert routed(fast) == routed(reference), (iteration, tensor)
            assert module.CALLS == reference_calls == [
                ("inspect_tensor_enabled", "L", {"tensor_name": tensor, "iteration": iteration})]
            active = iteration >= 2 and iteration % 3 == 0
            next_active = max(2, iteration + 1)
            next_active += -next_active % 3
            assert fast.inspect_tensor_enabled is active and fast.get_next_debug_iter() == next_active
            expected_plan = "Quantize" if with_parent and tensor in PARENTED else "High Precision"
            assert fast.rowwise_tensor_plan == expected_plan
        debug_api.step()


def test_schedule_only_templates_note_the_next_iteration_like_the_full_routing(tmp_path, monkeypatch):
    """LogTensorStats (answered from its schedule by the namespace): templated constructions record the same next
    iterations in the stats engine as full routings, iteration after iteration."""
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation", "wgrad"],
                                         "start_end_list": [[1, 2], [6, 7]]}})
    with debug_session(config, tmp_path):
        notes = []
        stats = debug_api.session().stats
        real_note = stats.note_next_iteration
        monkeypatch.setattr(stats, "note_next_iteration", lambda layer, nxt: (notes.append(nxt), real_note(layer, nxt)))
        for iteration in range(9):
            for tensor in ("activation", "wgrad", "weight"):
                templates().clear()
                notes.clear()
                reference = DebugQuantizer("L", tensor, None, None)
                reference_notes = list(notes)
                notes.clear()
                fast = DebugQuantizer("L", tensor, None, None)
                assert (routed(fast), notes) == (routed(reference), reference_notes), (iteration, tensor)
                if tensor != "weight":
                    assert fast.inspect_tensor_enabled is (iteration in (1, 2, 6, 7))
            debug_api.step()


@pytest.mark.parametrize("features, tensor", [
    ({"DebugModify": {"enabled": True, "tensors": ["activation"], "gemms": ["fprop"]}}, "activation"),
    ({"DebugModify": {"enabled": True, "tensors": ["output"], "gemms": ["fprop"]}}, "output"),
    ({"DebugDisableGemm": {"enabled": True, "gemms": ["wgrad"]}}, "gradient"),
    ({"DebugPostquantize": {"enabled": True, "tensors": ["weight"]}}, "weight"),
])
def test_no_template_when_a_feature_serves_another_hook(start, route_calls, features, tensor):
    """A hook other than inspect_tensor_enabled served by a feature may answer differently at every call: no
    template, every construction routes fully and calls that feature again."""
    module = start(features)
    parent = parent_for(tensor)
    per_build = None
    for _ in range(3):
        module.CALLS.clear()
        route_calls.clear()
        DebugQuantizer("L", tensor, parent, None)
        assert route_calls == [tensor]
        assert module.CALLS, "the serving feature is asked at every construction"
        assert per_build is None or [c[0] for c in module.CALLS] == per_build
        per_build = [c[0] for c in module.CALLS]
        assert ("L", tensor, parent is not None) not in templates()
        debug_api.step()


def test_templates_are_per_session_and_follow_its_config(tmp_path, start):
    """A template made in one session is never used in the next, whose config disables the fprop GEMM."""
    with debug_session(section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}),
                       tmp_path / "a"):
        for _ in range(2):
            q = DebugQuantizer("L", "weight", parent_for("weight"), None)
        assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == ("Quantize", "Quantize")
        assert ("L", "weight", True) in templates()
    start({"DebugInspect": {"enabled": True, "tensors": ["weight"]},
           "DebugDisableGemm": {"enabled": True, "gemms": ["fprop"]}})
    assert templates() == {}
    for _ in range(2):
        q = DebugQuantizer("L", "weight", parent_for("weight"), None)
        assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == ("High Precision", "Quantize")


def test_parent_presence_is_part_of_the_template_key(tmp_path):
    with debug_session(section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}),
                       tmp_path):
        for _ in range(2):
            with_parent = DebugQuantizer("L", "weight", parent_for("weight"), None)
            without = DebugQuantizer("L", "weight", None, None)
            assert routed(with_parent)[1:3] == ("Quantize", "Quantize")
            assert routed(without)[1:3] == ("High Precision", "High Precision")
        assert {key for key in templates()} == {("L", "weight", True), ("L", "weight", False)}


def test_patched_hooks_and_spies_bypass_the_templates(tmp_path, route_calls):
    """A hook overridden on the namespace instance, or a stand-in installed as debug_api.transformer_engine, sees
    every call even after templates exist."""
    with debug_session(section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}),
                       tmp_path) as api:
        DebugQuantizer("L", "weight", parent_for("weight"), None)
        assert ("L", "weight", True) in templates()
        patched = []
        real = api.fp8_gemm_enabled

        def fp8_gemm_enabled(layer_name, **kwargs):
            patched.append(kwargs["gemm"])
            return real(layer_name, **kwargs)

        api.fp8_gemm_enabled = fp8_gemm_enabled
        route_calls.clear()
        DebugQuantizer("L", "weight", parent_for("weight"), None)
        assert patched == ["fprop", "dgrad"] and route_calls == ["weight"]
        del api.fp8_gemm_enabled

        seen = []

        class Spy:
            def __getattr__(self, hook):
                method = getattr(api, hook)

                def call(layer_name, **kwargs):
                    seen.append(hook)
                    return method(layer_name, **kwargs)

                return call

        debug_api.transformer_engine = Spy()
        try:
            assert te_namespace() is debug_api.transformer_engine
            q = DebugQuantizer("L", "weight", parent_for("weight"), None)
        finally:
            del debug_api.transformer_engine
        assert seen == ["inspect_tensor_enabled", "inspect_tensor_postquantize_enabled",
                        "inspect_tensor_postquantize_enabled", "modify_tensor_enabled", "fp8_gemm_enabled",
                        "modify_tensor_enabled", "fp8_gemm_enabled"]
        assert routed(q)[1:3] == ("Quantize", "Quantize")
        assert te_namespace() is api


def test_te_namespace_without_a_session():
    assert debug_api.DEBUG_MANAGER is None
    with pytest.raises(RuntimeError):
        te_namespace()


# ------------------------------------------------------------------------------------------------ the gate
def test_gate_next_iteration_is_the_minimum_over_its_quantizers(start):
    """Per-tensor schedules: the gate's next iteration is the smallest next iteration of its six quantizers."""
    start({"DebugInspect": {"enabled": True, "tensors_struct": [
        {"tensor": "activation", "start_step": 7}, {"tensor": "wgrad", "start_step": 4},
        {"tensor": "gradient", "start_step": 9}]}})
    state = LayerDebugState()
    quantizers = {role: parent_for(tensor) for role, tensor in ROLE_TO_TENSOR}
    assert state.debug_quantizers("L", quantizers) is None  # iteration 0: nothing enabled
    assert state.next_iter == 4
    with pytest.raises(KeyError, match="unknown quantizer roles \\['bogus'\\]"):
        LayerDebugState().debug_quantizers("L", {"bogus": None})


# ------------------------------------------------------------------------------------------------ config memo
def test_gate_renews_its_quantizers_and_they_equal_new_ones(start, route_calls):
    """DebugInspect on a freq-3 schedule: from the second call on, the gate renews the six quantizers of the previous
    call (no construction, the same dict) and every routed attribute, and every feature call, equals what six new
    quantizers give at that iteration."""
    module = start({"DebugInspect": {"enabled": True, "tensors": list(TENSORS), "freq": 3, "start_step": 2}})
    state = LayerDebugState()
    parents = {role: parent_for(tensor) for role, tensor in ROLE_TO_TENSOR}
    built = []
    real_init = DebugQuantizer.__init__

    def counting_init(self, *args, **kwargs):
        built.append(args[1])
        real_init(self, *args, **kwargs)

    previous = None
    for iteration in range(12):
        module.CALLS.clear()
        built.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DebugQuantizer, "__init__", counting_init)
            answer = state._build("L", parents, None, 1)
        result = state._last[2]
        active = iteration >= 2 and iteration % 3 == 0
        assert answer is (result if active else None)  # None: nothing enabled in this iteration
        gate_calls = list(module.CALLS)
        if iteration:
            assert built == [] and result is previous  # renewed, not rebuilt
        else:
            assert built == [tensor for _, tensor in ROLE_TO_TENSOR]
        module.CALLS.clear()
        fresh = {role: DebugQuantizer("L", tensor, parents[role], None) for role, tensor in ROLE_TO_TENSOR}
        assert module.CALLS == gate_calls  # the features saw the same calls
        for role, tensor in ROLE_TO_TENSOR:
            assert routed(result[role]) == routed(fresh[role]), (iteration, tensor)
            assert result[role].iteration == iteration and result[role].inspect_tensor_enabled is active
            assert (result[role].rowwise_usage, result[role].columnwise_usage) == (True, True)
            result[role].set_usage(rowwise=False, columnwise=True)  # renew restores the constructor's usage
        previous = result
        debug_api.step()
    assert route_calls.count("activation") == 1  # one full routing per tensor: the gate's first build


def test_gate_builds_new_quantizers_when_renewal_would_differ(start):
    """A new layer name, other normal quantizers, another TP group, a hook patched on the namespace, a spy: the gate
    builds six new quantizers."""
    start({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": list(TENSORS)}})
    state = LayerDebugState()
    parents = {role: parent_for(tensor) for role, tensor in ROLE_TO_TENSOR}
    first = state._build("L", parents, None, 1)
    assert state._build("L", parents, None, 1) is first
    renamed = state._build("M", parents, None, 1)
    assert renamed is not first and renamed["input"].layer_name == "M"
    assert state._build("M", parents, None, 1) is renamed
    other = dict(parents, weight=parent_for("weight"))
    reparented = state._build("M", other, None, 1)
    assert reparented is not renamed and reparented["weight"].parent_quantizer is other["weight"]
    group = object()
    grouped = state._build("M", other, group, 2)
    assert grouped is not reparented and grouped["input"].tp_group is group and grouped["input"].tp_size == 2
    assert state._build("M", other, group, 2) is grouped
    api = debug_api.transformer_engine
    api.inspect_tensor_enabled = lambda layer_name, **kwargs: (True, None)
    try:
        patched = state._build("M", other, group, 2)
        assert patched is not grouped and not patched["input"].from_template
    finally:
        del api.inspect_tensor_enabled
    again = state._build("M", other, group, 2)
    assert again is not patched  # quantizers routed without templates are never renewed
    assert state._build("M", other, group, 2) is again

    class Spy:
        def __getattr__(self, hook):
            return getattr(api, hook)

    debug_api.transformer_engine = Spy()
    try:
        assert state._build("M", other, group, 2) is not again
    finally:
        del debug_api.transformer_engine


def test_inspect_goes_direct_after_one_call_and_the_feature_sees_the_same_calls(start, monkeypatch):
    """After one call through the namespace, `DebugQuantizer._inspect` calls the routed feature method directly:
    the feature receives exactly the kwargs of a namespace call; a hook patched on the namespace instance later
    still sees every call."""
    module = start({"DebugInspect": {"enabled": True, "tensors": ["activation", "output"]}})
    api = debug_api.transformer_engine
    through = []
    real_call = type(api)._call

    def counting_call(self, hook, layer_name, kwargs):
        through.append(hook)
        return real_call(self, hook, layer_name, kwargs)

    monkeypatch.setattr(type(api), "_call", counting_call)
    x = torch.randn(4, 8)
    q = DebugQuantizer("L", "activation", None, None)
    out = DebugQuantizer("L", "output", None, None)
    rounds = []
    for _ in range(3):
        module.CALLS.clear()
        through.clear()
        q.quantize(x)
        out.process_gemm_output(x)
        assert [c[0] for c in module.CALLS] == ["inspect_tensor", "inspect_tensor"]
        assert module.CALLS[0][2]["tensor"] is x and module.CALLS[0][2]["tensor_name"] == "activation"
        assert module.CALLS[1][2]["rowwise_quantized_tensor"] is None and module.CALLS[1][2]["quantizer"] is None
        rounds.append(list(through))
    assert rounds == [["inspect_tensor", "inspect_tensor"], [], []]  # through the namespace once, then direct
    direct = list(module.CALLS)
    module.CALLS.clear()
    api.inspect_tensor(
        "L", tensor=x, tensor_name="activation", iteration=0, tp_group=None, tp_size=1, rowwise_quantized_tensor=x,
        columnwise_quantized_tensor=x, quantizer=None)
    assert module.CALLS[0] == direct[0]  # a namespace call gives the feature the very same kwargs
    patched = []
    api.inspect_tensor = lambda layer_name, **kwargs: patched.append(kwargs["tensor_name"])
    try:
        module.CALLS.clear()
        q.quantize(x)
        assert patched == ["activation"] and module.CALLS == []
    finally:
        del api.inspect_tensor


def test_direct_route_only_for_a_single_plain_inspect_route(start):
    start({"DebugInspect": {"enabled": True, "tensors": ["activation"]},
           "DebugPostquantize": {"enabled": True, "tensors": ["activation"]}})
    api = debug_api.transformer_engine
    assert api.direct_route("inspect_tensor", "L", None, "activation") is None  # not routed yet
    DebugQuantizer("L", "activation", None, None).quantize(torch.ones(2, 2))
    route = api.direct_route("inspect_tensor", "L", None, "activation")
    assert route is not None and route.feature == "DebugInspect"
    assert api.direct_route("inspect_tensor_enabled", "L", None, "activation") is None  # not an inspect hook
    assert api.direct_route("inspect_tensor", "L", None, "weight") is None  # routing key never called
    api.inspect_tensor(
        "L", tensor=torch.ones(2), tensor_name="weight", iteration=0, tp_group=None, tp_size=1,
        rowwise_quantized_tensor=None, columnwise_quantized_tensor=None, quantizer=None)
    assert api.direct_route("inspect_tensor", "L", None, "weight") is None  # no feature serves it


def test_a_non_none_inspect_result_is_rejected_on_the_direct_path_too(start, monkeypatch):
    module = start({"DebugInspect": {"enabled": True, "tensors": ["activation"]}})
    q = DebugQuantizer("L", "activation", None, None)
    q.quantize(torch.ones(2, 2))
    assert q._inspect_route is not None
    monkeypatch.setattr(type(q._inspect_route.method.__self__), "inspect_tensor",
                        lambda self, config, layer_name, **kwargs: 5)
    # the direct route holds the bound method of the old class attribute: rebind it as routing would
    route = q._inspect_route
    q._inspect_route = type(route)(route.feature, getattr(route.method.__self__, "inspect_tensor"), route.config,
                                   route.drop)
    with pytest.raises(TypeError, match="feature 'DebugInspect', hook 'inspect_tensor', layer 'L': inspect hooks "
                                        "must return None, got int"):
        q.quantize(torch.ones(2, 2))
    assert module.CALLS[-1][0] == "inspect_tensor"  # the first, real call went through the namespace


def test_log_tensor_stats_prepared_call_is_the_inspect_call(tmp_path, monkeypatch):
    """Through a DebugQuantizer, LogTensorStats is called through the namespace once, then through its prepared form
    (its plan looked up once); both give the statistics a namespace call gives, and a subclass overriding
    inspect_tensor is never bypassed."""
    plans = []
    real_plan = log_tensor_stats.inspect_plan

    def counting_plan(config, tensor_name, *args):
        plans.append(tensor_name)
        return real_plan(config, tensor_name, *args)

    monkeypatch.setattr(log_tensor_stats, "inspect_plan", counting_plan)
    sink = RecordingSink()
    config = section({"LogTensorStats": {"enabled": True, "stats": ["min", "max", "l1_norm"],
                                         "tensors": ["activation"], "freq": 2}})
    xs = [torch.tensor([[1.5, -3.0], [0.25, 2.0]]) * (i + 1) for i in range(6)]
    with debug_session(config, tmp_path, sink):
        q = DebugQuantizer("L", "activation", None, None)
        for i, x in enumerate(xs):
            q.iteration = debug_api.get_iteration()
            q.inspect_tensor_enabled = True
            q.quantize(x)
            if i == 0:
                assert plans == ["activation", "activation"]  # the namespace call, then the preparation
                assert q._inspect_prepared is not None
            debug_api.step()
        assert plans == ["activation", "activation"]  # never again
        feature = q._inspect_route.method.__self__
        assert type(feature).__name__ == "LogTensorStats"
    expected = {}
    for i in (0, 2, 4):  # freq 2: the feature re-checks its own schedule on every call
        ref = hand_stats(xs[i])
        expected.update({("L_activation_min", i): ref["min"], ("L_activation_max", i): ref["max"],
                         ("L_activation_l1_norm", i): ref["l1_norm"]})
    assert sink.values() == expected

    class Custom(log_tensor_stats.LogTensorStats):
        def inspect_tensor(self, config, layer_name, **kwargs):
            return super().inspect_tensor(config, layer_name, **kwargs)

    assert Custom().prepare_inspect_tensor({"stats": ["min"]}, "L", "activation") is None


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
        ("L_activation_min", 0): expect["min"], ("L_activation_max", 0): expect["max"],
        ("L_activation_min", 2): expect2["min"], ("L_activation_l1_norm", 2): expect2["l1_norm"],
        ("L_activation_mean", 2): expect2["mean"]}


# ------------------------------------------------------------------------------------------------ whole runs
def _run_model(tmp_path, config):
    """Three-layer model under Float8CurrentScaling for six iterations: (statistics rows, main-log lines)."""
    sink = RecordingSink()
    torch.manual_seed(0)
    model = torch.nn.Sequential(tedebug.nn.Linear(16, 24, name="m.0"), tedebug.nn.LayerNormMLP(24, 32, name="m.1"),
                                tedebug.nn.Linear(24, 8, name="m.2"))
    x = torch.randn(4, 16)
    with debug_session(config, tmp_path, sink):
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
    monkeypatch.setattr(debug_quantization, "route_templates", lambda api: None)
    monkeypatch.setattr(tedebug.memo, "memoized", lambda table, key, compute: compute())
    monkeypatch.setattr(TransformerEngineNamespace, "direct_route", lambda self, hook, layer_name, gemm, tensor: None)
    slow = _run_model(tmp_path / "slow", config)
    assert fast == slow
