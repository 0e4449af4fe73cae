"""The compiled plans (`tedebug.plan`) keep their promise, pinned by counting calls (never by timing): a hook that no
feature serves, or that only schedule-only features serve, never reaches a feature; a hook any other feature serves,
or one overridden on the namespace instance, is asked at every construction; ``plan_cache=False`` lets a stand-in see
every call; the debug gate renews its quantizers only while their plans hold; the bound inspect call gives the
features what a namespace call gives.  Answers are compared with schedules computed by hand."""

from __future__ import annotations

import functools

import pytest
import torch

import tedebug
import tedebug.features.log_tensor_stats as log_tensor_stats
from tedebug import debug_api
from tedebug.debug_quantization import DebugQuantizer
from tedebug.features.base import ScheduledInspectFeature
from tedebug.namespace import TransformerEngineNamespace
from tedebug.nn.debug_gate import ROLE_TO_TENSOR, LayerDebugState
from tedebug.plan import Plan, declared_by_owner, schedule_only
from tedebug.quantization import Float8CurrentScalingQuantizer

from support.features import RecordingSink, debug_session, section

TENSORS = ("activation", "weight", "gradient", "output", "wgrad", "dgrad")
PARENTED = ("activation", "weight", "gradient")


def parent_for(tensor):
    return Float8CurrentScalingQuantizer("E5M2" if tensor == "gradient" else "E4M3") if tensor in PARENTED else None


def decided(q):
    """Everything a DebugQuantizer takes from its plan."""
    return (
        q.inspect_tensor_enabled,
        q.rowwise_tensor_plan,
        q.columnwise_tensor_plan,
        q.rowwise_postquantize_enabled,
        q.columnwise_postquantize_enabled,
        q.get_next_debug_iter(),
    )


def freq_schedule(iteration, freq, start):
    """Oracle: (active, next active) of ``freq`` from ``start`` with no end."""
    nxt = max(start, iteration + 1)
    nxt += -nxt % freq
    return iteration >= start and iteration % freq == 0, nxt


class Counter:
    """Counts the calls of ``owner.name`` (still forwarded), optionally recording what `record` returns."""

    def __init__(self, monkeypatch, owner, name, record=None):
        self.calls = []
        real = getattr(owner, name)

        @functools.wraps(real)  # keeps the markers the registry reads (`api_method`)
        def counting(*args, **kwargs):
            self.calls.append(record(*args, **kwargs) if record else None)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)


# ------------------------------------------------------------------------------------------------ the plan enum
def test_plan_values_are_the_log_strings():
    assert [p.value for p in Plan] == ["modify_tensor()", "Quantize", "High Precision"]
    assert f"{Plan.QUANTIZE}" == "Quantize" and str(Plan.MODIFY) == "modify_tensor()"
    assert Plan.HIGH_PRECISION == "High Precision" and f"[{Plan.QUANTIZE:>10}]" == "[  Quantize]"


# ------------------------------------------------------------------------------------------------ declarations
def test_schedule_only_counts_on_the_class_that_defines_the_hook():
    class Base:
        SCHEDULE_ONLY_HOOKS = frozenset({"inspect_tensor_enabled"})

        def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
            return False, None

    class Inherits(Base):
        pass

    class Overrides(Base):
        def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
            return True, iteration + 1

    class Redeclares(Overrides):
        SCHEDULE_ONLY_HOOKS = frozenset({"inspect_tensor_enabled"})

        def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
            return False, None

    assert schedule_only(Base(), "inspect_tensor_enabled") and schedule_only(Inherits(), "inspect_tensor_enabled")
    assert not schedule_only(Overrides(), "inspect_tensor_enabled")
    assert schedule_only(Redeclares(), "inspect_tensor_enabled")
    assert not schedule_only(Base(), "fp8_gemm_enabled")
    patched = Inherits()
    patched.inspect_tensor_enabled = lambda *args, **kwargs: (True, None)
    assert not schedule_only(patched, "inspect_tensor_enabled")
    assert schedule_only(log_tensor_stats.LogTensorStats(), "inspect_tensor_enabled")

    class Custom(log_tensor_stats.LogTensorStats):
        def inspect_tensor(self, config, layer_name, **kwargs):
            return super().inspect_tensor(config, layer_name, **kwargs)

    def binds(cls):
        return "bind_inspect_tensor" in cls.__dict__

    assert declared_by_owner(log_tensor_stats.LogTensorStats(), "inspect_tensor", binds)
    assert not declared_by_owner(Custom(), "inspect_tensor", binds)  # its own inspect_tensor must run


# ------------------------------------------------------------------------------------------------ answers
@pytest.mark.parametrize("with_parent", [False, True])
def test_a_called_hook_is_asked_once_per_construction(start, with_parent):
    """DebugInspect (its own inspect_tensor_enabled) on a freq-3 schedule: every construction asks it exactly once,
    nothing else reaches a feature, and the quantizer holds the schedule's answers."""
    module = start({"DebugInspect": {"enabled": True, "tensors": list(TENSORS), "freq": 3, "start_step": 2}})
    for iteration in range(12):
        for tensor in TENSORS:
            parent = parent_for(tensor) if with_parent else None
            for _ in range(2):
                module.CALLS.clear()
                q = DebugQuantizer("L", tensor, parent, None)
                assert module.CALLS == [
                    ("inspect_tensor_enabled", "L", {"tensor_name": tensor, "iteration": iteration})
                ]
                active, nxt = freq_schedule(iteration, 3, 2)
                plan = Plan.QUANTIZE if with_parent and tensor in PARENTED else Plan.HIGH_PRECISION
                columnwise = None if tensor not in PARENTED else plan
                assert decided(q) == (active, plan, columnwise, False, False, nxt), (iteration, tensor)
        debug_api.step()


def test_schedule_only_features_are_never_called_and_note_what_they_would(tmp_path, monkeypatch):
    """LogTensorStats answers from its schedule: its inspect_tensor_enabled is never called, the quantizers hold the
    schedule's answers and the stats engine gets the next iteration the feature would record, every construction."""
    hook = Counter(monkeypatch, ScheduledInspectFeature, "inspect_tensor_enabled")
    config = section(
        {
            "LogTensorStats": {
                "enabled": True,
                "stats": ["max"],
                "tensors": ["activation", "wgrad"],
                "start_end_list": [[1, 2], [6, 7]],
            }
        }
    )
    expected_next = {0: 1, 1: 2, 2: 6, 3: 6, 4: 6, 5: 6, 6: 7, 7: None, 8: None}
    with debug_session(config, tmp_path):
        notes = Counter(
            monkeypatch, debug_api.session().stats, "note_next_iteration", record=lambda layer, nxt: (layer, nxt)
        )
        for iteration in range(9):
            for tensor in ("activation", "wgrad", "weight"):
                notes.calls.clear()
                q = DebugQuantizer("L", tensor, None, None)
                selected = tensor != "weight"
                assert q.inspect_tensor_enabled is (selected and iteration in (1, 2, 6, 7))
                assert q.get_next_debug_iter() == (expected_next[iteration] if selected else None)
                assert notes.calls == ([("L", expected_next[iteration])] if selected else [])
            debug_api.step()
    assert hook.calls == []


def test_several_schedule_only_features_combine_and_each_notes_its_own(tmp_path, monkeypatch):
    """LogTensorStats (notes) and DumpTensors (does not) on one tensor: enabled when either is, the earlier next
    iteration, and only LogTensorStats' next iteration recorded."""
    config = section(
        {
            "LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"], "freq": 3, "start_step": 2},
            "DumpTensors": {"enabled": True, "tensors": ["weight"], "freq": 4, "high_precision_tensor": True},
        }
    )
    with debug_session(config, tmp_path):
        notes = Counter(monkeypatch, debug_api.session().stats, "note_next_iteration", record=lambda layer, nxt: nxt)
        for iteration in range(13):
            notes.calls.clear()
            q = DebugQuantizer("L", "weight", None, None)
            stats_active, stats_next = freq_schedule(iteration, 3, 2)
            dump_active, dump_next = freq_schedule(iteration, 4, 0)
            assert q.inspect_tensor_enabled is (stats_active or dump_active)
            assert q.get_next_debug_iter() == min(stats_next, dump_next)
            assert notes.calls == [stats_next]
            debug_api.step()


@pytest.mark.parametrize(
    "features, tensor",
    [
        ({"DebugModify": {"enabled": True, "tensors": ["activation"], "gemms": ["fprop"]}}, "activation"),
        ({"DebugModify": {"enabled": True, "tensors": ["output"], "gemms": ["fprop"]}}, "output"),
        ({"DebugDisableGemm": {"enabled": True, "gemms": ["wgrad"]}}, "gradient"),
        ({"DebugPostquantize": {"enabled": True, "tensors": ["weight"]}}, "weight"),
    ],
)
def test_a_feature_serving_a_direction_hook_is_asked_at_every_construction(start, features, tensor):
    module = start(features)
    parent = parent_for(tensor)
    per_build = []
    for iteration in range(3):
        module.CALLS.clear()
        DebugQuantizer("L", tensor, parent, None)
        assert module.CALLS and all(kwargs["iteration"] == iteration for _, _, kwargs in module.CALLS)
        per_build.append([c[0] for c in module.CALLS])
        debug_api.step()
    assert per_build[0] == per_build[1] == per_build[2]


def test_plans_are_per_session_and_follow_its_config(tmp_path, start):
    with debug_session(
        section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}}), tmp_path / "a"
    ):
        for _ in range(2):
            q = DebugQuantizer("L", "weight", parent_for("weight"), None)
            assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == ("Quantize", "Quantize")
            assert DebugQuantizer("L", "weight", None, None).rowwise_tensor_plan == "High Precision"
    start(
        {
            "DebugInspect": {"enabled": True, "tensors": ["weight"]},
            "DebugDisableGemm": {"enabled": True, "gemms": ["fprop"]},
        }
    )
    for _ in range(2):
        q = DebugQuantizer("L", "weight", parent_for("weight"), None)
        assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == ("High Precision", "Quantize")


def test_an_override_on_the_namespace_instance_is_called_every_time(tmp_path):
    """A hook overridden on the namespace instance after plans exist: every later construction (and inspection)
    calls it; removing it goes back to the features."""
    sink = RecordingSink()
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}})
    x = torch.tensor([[1.0, -5.0], [2.0, 3.0]])
    with debug_session(config, tmp_path, sink) as api:
        q = DebugQuantizer("L", "weight", parent_for("weight"), None)
        q.quantize(x)  # the inspect call is bound now
        seen = []
        real_fp8, real_inspect = api.fp8_gemm_enabled, api.inspect_tensor

        def fp8_gemm_enabled(layer_name, **kwargs):
            seen.append(("fp8_gemm_enabled", kwargs["gemm"]))
            return real_fp8(layer_name, **kwargs)

        def inspect_tensor(layer_name, **kwargs):
            seen.append(("inspect_tensor", kwargs["tensor_name"]))
            return real_inspect(layer_name, **kwargs)

        api.fp8_gemm_enabled = fp8_gemm_enabled
        api.inspect_tensor = inspect_tensor
        for _ in range(2):
            DebugQuantizer("L", "weight", parent_for("weight"), None)
        q.quantize(x)
        assert seen == [("fp8_gemm_enabled", "fprop"), ("fp8_gemm_enabled", "dgrad")] * 2 + [
            ("inspect_tensor", "weight")
        ]
        del api.fp8_gemm_enabled
        del api.inspect_tensor
        seen.clear()
        DebugQuantizer("L", "weight", parent_for("weight"), None).quantize(x)
        assert seen == []
        debug_api.step()
    assert sink.values() == {("L_weight_max", 0): 3.0}  # the statistics still reach the sink


def test_plan_cache_off_lets_a_stand_in_see_every_call(tmp_path):
    """``initialize(plan_cache=False)``: a stand-in installed as debug_api.transformer_engine sees every question of
    every construction, in TransformerEngine's order, and the inspection."""
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}})
    with debug_session(config, tmp_path, plan_cache=False) as api:
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
            for _ in range(2):
                q = DebugQuantizer("L", "weight", parent_for("weight"), None)
                q.quantize(torch.ones(2, 2))
        finally:
            del debug_api.transformer_engine
    order = [
        "inspect_tensor_enabled",
        "inspect_tensor_postquantize_enabled",
        "inspect_tensor_postquantize_enabled",
        "modify_tensor_enabled",
        "fp8_gemm_enabled",
        "modify_tensor_enabled",
        "fp8_gemm_enabled",
        "inspect_tensor",
    ]
    assert seen == order * 2
    assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == ("Quantize", "Quantize")
    with pytest.raises(TypeError, match="plan_cache must be a bool"):
        debug_api.initialize("", log_dir=str(tmp_path), plan_cache="no")


def test_a_debug_quantizer_needs_a_session():
    assert debug_api.DEBUG_MANAGER is None
    with pytest.raises(RuntimeError):
        DebugQuantizer("L", "weight", None, None)


# ------------------------------------------------------------------------------------------------ the gate
def test_gate_renews_its_quantizers_and_they_equal_new_ones(start, monkeypatch):
    """DebugInspect on a freq-3 schedule: six quantizers built once, then renewed (the same dict) at every call, and
    each renewed quantizer equals a new one of that iteration; the features see the same calls either way."""
    module = start({"DebugInspect": {"enabled": True, "tensors": list(TENSORS), "freq": 3, "start_step": 2}})
    state = LayerDebugState()
    parents = {role: parent_for(tensor) for role, tensor in ROLE_TO_TENSOR}
    built = Counter(monkeypatch, DebugQuantizer, "__init__", record=lambda self, *args, **kwargs: args[1])
    previous = None
    for iteration in range(12):
        module.CALLS.clear()
        built.calls.clear()
        answer = state._build("L", parents, None, 1)
        result = state._last[5]
        active, _ = freq_schedule(iteration, 3, 2)
        assert answer is (result if active else None)
        assert built.calls == ([] if iteration else [tensor for _, tensor in ROLE_TO_TENSOR])
        assert previous is None or result is previous
        gate_calls = list(module.CALLS)
        module.CALLS.clear()
        fresh = {role: DebugQuantizer("L", tensor, parents[role], None) for role, tensor in ROLE_TO_TENSOR}
        assert module.CALLS == gate_calls
        for role, tensor in ROLE_TO_TENSOR:
            assert decided(result[role]) == decided(fresh[role]), (iteration, tensor)
            assert result[role].iteration == iteration and result[role].inspect_tensor_enabled is active
            assert (result[role].rowwise_usage, result[role].columnwise_usage) == (True, True)
            result[role].set_usage(rowwise=False, columnwise=True)  # renewing restores the constructor's usage
        previous = result
        debug_api.step()


def test_gate_builds_new_quantizers_when_renewal_would_differ(start, monkeypatch):
    """A new layer name, other normal quantizers, another TP group, a hook overridden on the namespace, the plan
    cache off: the gate builds six new quantizers."""
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
        assert patched is not grouped
        assert state._build("M", other, group, 2) is patched
    finally:
        del api.inspect_tensor_enabled
    again = state._build("M", other, group, 2)
    assert again is not patched and state._build("M", other, group, 2) is again
    monkeypatch.setattr(debug_api.session(), "plan_cache", False)
    assert state._build("M", other, group, 2) is not again


def test_gate_next_iteration_is_the_minimum_over_its_quantizers(start):
    start(
        {
            "DebugInspect": {
                "enabled": True,
                "tensors_struct": [
                    {"tensor": "activation", "start_step": 7},
                    {"tensor": "wgrad", "start_step": 4},
                    {"tensor": "gradient", "start_step": 9},
                ],
            }
        }
    )
    state = LayerDebugState()
    quantizers = {role: parent_for(tensor) for role, tensor in ROLE_TO_TENSOR}
    assert state.debug_quantizers("L", quantizers) is None  # iteration 0: nothing enabled
    assert state.next_iter == 4
    with pytest.raises(KeyError, match="unknown quantizer roles \\['bogus'\\]"):
        LayerDebugState().debug_quantizers("L", {"bogus": None})


# ------------------------------------------------------------------------------------------------ inspection
def namespace_inspection(x):
    """An inspection of L's activation `x` at iteration 0 through the namespace's call (what the direct calls must
    reproduce for the features)."""
    debug_api.transformer_engine.inspect_tensor(
        "L",
        tensor=x,
        tensor_name="activation",
        iteration=0,
        tp_group=None,
        tp_size=1,
        rowwise_quantized_tensor=x,
        columnwise_quantized_tensor=x,
        quantizer=None,
    )


def test_a_single_inspecting_feature_gets_the_kwargs_of_a_namespace_call_directly(start, monkeypatch):
    """One feature serving inspect_tensor: no inspection goes through the namespace's call, and the feature receives
    exactly the kwargs a namespace call gives it."""
    module = start({"DebugInspect": {"enabled": True, "tensors": ["activation", "output"]}})
    through = Counter(monkeypatch, TransformerEngineNamespace, "_call", record=lambda self, hook, *args: hook)
    x = torch.randn(4, 8)
    q = DebugQuantizer("L", "activation", None, None)
    out = DebugQuantizer("L", "output", None, None)
    for _ in range(3):
        module.CALLS.clear()
        q.quantize(x)
        out.process_gemm_output(x)
        assert [c[0] for c in module.CALLS] == ["inspect_tensor", "inspect_tensor"]
        assert module.CALLS[0][2]["tensor"] is x and module.CALLS[0][2]["tensor_name"] == "activation"
        assert module.CALLS[1][2]["rowwise_quantized_tensor"] is None and module.CALLS[1][2]["quantizer"] is None
    assert "inspect_tensor" not in through.calls
    direct = list(module.CALLS)
    module.CALLS.clear()
    namespace_inspection(x)
    assert module.CALLS[0] == direct[0]


def test_several_inspecting_features_are_each_called_directly_in_config_order(start, monkeypatch):
    """Two features inspecting one tensor: no inspection goes through the namespace's call, each feature is called
    once per inspected tensor in the namespace's order, and DebugInspect gets the kwargs a namespace call gives it."""
    module = start(
        {
            "DebugInspect": {"enabled": True, "tensors": ["activation"]},
            "LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]},
        }
    )
    order = []
    Counter(monkeypatch, module.DebugInspect, "inspect_tensor", record=lambda *a, **k: order.append("DebugInspect"))
    Counter(monkeypatch, log_tensor_stats.InspectPlan, "feed", record=lambda *a, **k: order.append("LogTensorStats"))
    through = Counter(monkeypatch, TransformerEngineNamespace, "_call", record=lambda self, hook, *args: hook)
    q = DebugQuantizer("L", "activation", None, None)
    x = torch.ones(2, 2)
    for _ in range(3):
        q.quantize(x)
    debug_api.step()
    assert "inspect_tensor" not in through.calls
    assert order == ["DebugInspect", "LogTensorStats"] * 3
    direct = [c for c in module.CALLS if c[0] == "inspect_tensor"]
    assert len(direct) == 3 and direct[0][2]["tensor"] is x and direct[0][2]["tensor_name"] == "activation"
    module.CALLS.clear()
    namespace_inspection(x)
    assert module.CALLS[0] == direct[0]


def test_several_inspecting_features_log_what_the_namespace_path_logs(tmp_path):
    """LogTensorStats and LogFp8TensorStats on one FP8 tensor: the statistics of the direct calls (plan cache on)
    equal those of the namespace path (plan cache off), which calls each feature's inspect_tensor."""
    config = section(
        {
            "LogTensorStats": {"enabled": True, "stats": ["max", "min", "l1_norm"], "tensors": ["activation"]},
            "LogFp8TensorStats": {"enabled": True, "stats": ["underflows%", "mse"], "tensors": ["activation"]},
        }
    )
    tensors = [torch.linspace(-3.0, 2.0, 64).reshape(8, 8) * (i + 1) for i in range(3)]
    logged = []
    for plan_cache in (True, False):
        sink = RecordingSink()
        with debug_session(config, tmp_path / str(plan_cache), sink=sink, plan_cache=plan_cache):
            q = DebugQuantizer("L", "activation", Float8CurrentScalingQuantizer("E4M3"), None)
            for x in tensors:
                q.quantize(x)
                debug_api.step()
        logged.append(sink.values())
    assert logged[0] == logged[1]
    assert logged[0][("L_activation_max", 2)] == 6.0 and logged[0][("L_activation_l1_norm", 0)] == hand_l1(tensors[0])
    assert any("underflows%" in name for name, _ in logged[0])


def hand_l1(x):
    return x.double().abs().sum().item()


def test_a_non_none_inspect_result_is_rejected_on_the_direct_path(start, monkeypatch):
    module = start({"DebugInspect": {"enabled": True, "tensors": ["activation"]}})
    monkeypatch.setattr(module.DebugInspect, "inspect_tensor", lambda self, config, layer_name, **kwargs: 5)
    q = DebugQuantizer("L", "activation", None, None)
    for _ in range(2):
        with pytest.raises(
            TypeError,
            match="feature 'DebugInspect', hook 'inspect_tensor', layer 'L': inspect hooks must return None, got int",
        ):
            q.quantize(torch.ones(2, 2))


def hand_stats(x):
    v = x.double().flatten()
    return {"min": v.min().item(), "max": v.max().item(), "l1_norm": v.abs().sum().item()}


def test_log_tensor_stats_bound_form_looks_its_plan_up_once(tmp_path, monkeypatch):
    """Through DebugQuantizers, LogTensorStats' inspection is bound once: its plan looked up once for the whole
    run, its inspect_tensor method never called, and the statistics are those of the tensors (freq 2: the feature
    re-checks its own schedule)."""
    plans = Counter(
        monkeypatch, log_tensor_stats, "inspect_plan", record=lambda config, tensor_name, *feature_name: tensor_name
    )
    method = Counter(monkeypatch, log_tensor_stats.LogTensorStats, "inspect_tensor")
    sink = RecordingSink()
    config = section(
        {"LogTensorStats": {"enabled": True, "stats": ["min", "max", "l1_norm"], "tensors": ["activation"], "freq": 2}}
    )
    xs = [torch.tensor([[1.5, -3.0], [0.25, 2.0]]) * (i + 1) for i in range(6)]
    with debug_session(config, tmp_path, sink):
        for x in xs:
            q = DebugQuantizer("L", "activation", None, None)
            q.inspect_tensor_enabled = True  # every iteration: the feature's own schedule decides
            q.quantize(x)
            debug_api.step()
    assert plans.calls == ["activation"] and method.calls == []
    expected = {}
    for i in (0, 2, 4):
        ref = hand_stats(xs[i])
        expected.update({(f"L_activation_{stat}", i): ref[stat] for stat in ("min", "max", "l1_norm")})
    assert sink.values() == expected


def test_a_logged_model_reaches_the_features_only_where_it_must(tmp_path, monkeypatch):
    """TE's test_perf promise for a real model: LogTensorStats on every tensor at freq 1 over four steps of two
    converted layers - the schedule hook never reaches the feature, inspect_tensor reaches it once per logged tensor,
    and each GEMM builds its six quantizers once."""
    enabled = Counter(monkeypatch, ScheduledInspectFeature, "inspect_tensor_enabled")
    inspected = Counter(
        monkeypatch, log_tensor_stats.InspectPlan, "feed", record=lambda plan, layer, *args: (layer, plan.tensor_name)
    )
    built = Counter(monkeypatch, DebugQuantizer, "__init__")
    torch.manual_seed(0)
    model = tedebug.convert_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)))
    x = torch.randn(3, 8)
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": list(TENSORS)}})
    with debug_session(config, tmp_path, RecordingSink()):
        for _ in range(4):
            model(x).square().sum().backward()
            debug_api.step()
    assert enabled.calls == []
    per_step = 2 * 6 - 1  # the first layer computes no dgrad (its input needs no gradient)
    assert len(inspected.calls) == 4 * per_step
    assert len(built.calls) == 2 * 6


SUBCLASS_FEATURES = '''
from tedebug.features.log_tensor_stats import LogTensorStats
from tedebug.registry import api_method, register_feature

CALLS = []


@register_feature(namespace="transformer_engine")
class OddIterationStats(LogTensorStats):
    """LogTensorStats on odd iterations only: its own inspect_tensor_enabled, which no schedule describes."""

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        CALLS.append(iteration)
        return iteration % 2 == 1, iteration + 1
'''


def test_a_subclass_overriding_a_schedule_only_hook_is_called_every_time(tmp_path):
    """A custom LogTensorStats whose inspect_tensor_enabled answers what no schedule can say: asked at every
    construction, its answers (not the inherited schedule's) decide, and its statistics are logged on odd
    iterations only."""
    import os
    import sys

    from tedebug.registry import user_module_name

    feature_dir = tmp_path / "features"
    feature_dir.mkdir()
    path = feature_dir / "odd_stats.py"
    path.write_text(SUBCLASS_FEATURES)
    sink = RecordingSink()
    config = section({"OddIterationStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}})
    with debug_session(config, tmp_path / "logs", sink, feature_dirs=[str(feature_dir)]):
        module = sys.modules[user_module_name(os.path.realpath(path))]
        for iteration in range(4):
            q = DebugQuantizer("L", "activation", None, None)
            assert (q.inspect_tensor_enabled, q.get_next_debug_iter()) == (iteration % 2 == 1, iteration + 1)
            if q.inspect_tensor_enabled:
                q.quantize(torch.tensor([float(iteration), -1.0]))
            debug_api.step()
        assert module.CALLS == [0, 1, 2, 3]
    assert sink.values() == {("L_activation_max", 1): 1.0, ("L_activation_max", 3): 3.0}
