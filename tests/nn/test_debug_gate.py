"""Tests of tedebug.nn.debug_gate.LayerDebugState (a layer's debug on/off decision): O(1) off path, once-per-iteration
decision, next-iteration skipping without losing scheduled iterations, permanent opt-out, reset on re-initialisation."""

import pytest
import torch

from tedebug import debug_api
from tedebug.debug_quantization import DebugQuantizer
from tedebug.nn import debug_gate
from tedebug.nn.debug_gate import ROLE_TO_TENSOR, LayerDebugState
from tedebug.quantization import Float8CurrentScalingQuantizer

LAYER = "model.layers.1.proj"
ALL_TENSORS = ["activation", "weight", "output", "dgrad", "wgrad", "gradient"]


@pytest.fixture
def constructions(monkeypatch):
    """Count the DebugQuantizers the gate builds, as (iteration, tensor name)."""
    built = []

    class CountingDebugQuantizer(DebugQuantizer):
        def __init__(self, layer_name, tensor_name, *args, **kwargs):
            built.append((debug_api.get_iteration(), tensor_name))
            super().__init__(layer_name, tensor_name, *args, **kwargs)

    monkeypatch.setattr(debug_gate, "DebugQuantizer", CountingDebugQuantizer)
    return built


def normal_quantizers():
    return {
        "input": Float8CurrentScalingQuantizer("E4M3"),
        "weight": Float8CurrentScalingQuantizer("E4M3"),
        "output": None,
        "grad_input": None,
        "grad_weight": None,
        "grad_output": Float8CurrentScalingQuantizer("E5M2"),
    }


def run_layer(state, x, w, layer=LAYER):
    """What a layer does with the gate: quantize its operands through the debug quantizers when given."""
    qs = state.debug_quantizers(layer, normal_quantizers())
    if qs is not None:
        qs["input"].quantize(x)
        qs["weight"].quantize(w)
        qs["output"].process_gemm_output(x @ w.t())
    return qs


def inspect_enabled_calls(module):
    return [kw for hook, _, kw in module.CALLS if hook == "inspect_tensor_enabled"]


X = torch.arange(8.0).reshape(2, 4) - 3.0
W = torch.arange(12.0).reshape(3, 4) / 4.0


def test_off_when_not_initialized(constructions):
    assert debug_api.DEBUG_MANAGER is None
    state = LayerDebugState()
    assert state.debug_quantizers(LAYER, normal_quantizers()) is None
    assert constructions == [] and state.next_iter == 0


def test_construction_order_and_parents(start, constructions):
    start({"DebugInspect": {"enabled": True, "tensors": ALL_TENSORS}})
    state = LayerDebugState()
    normal = normal_quantizers()
    qs = state.debug_quantizers(LAYER, normal, tp_group="tp", tp_size=2)
    assert [t for _, t in constructions] == ["activation", "weight", "output", "dgrad", "wgrad", "gradient"]
    assert [(role, q.tensor_name) for role, q in qs.items()] == list(ROLE_TO_TENSOR)
    for role, q in qs.items():
        assert q.parent_quantizer is normal[role] and q.layer_name == LAYER
        assert q.tp_group == "tp" and q.tp_size == 2 and q.is_debug
    # missing roles get parent None
    qs = state.debug_quantizers(LAYER, {"weight": normal["weight"]})
    assert qs["input"].parent_quantizer is None and qs["weight"].parent_quantizer is normal["weight"]
    with pytest.raises(KeyError, match="unknown quantizer roles \\['inputs'\\]"):
        state.debug_quantizers(LAYER, {"inputs": None})


def test_idle_costs_nothing(start, constructions):
    """A feature active only at iteration 0: 6 routing calls in total over 20 iterations, no later construction."""
    mod = start({"DebugInspect": {"enabled": True, "tensors": ALL_TENSORS, "start_step": 0, "end_step": 0}})
    state = LayerDebugState()
    for iteration in range(20):
        qs = run_layer(state, X, W)
        assert (qs is not None) == (iteration == 0)
        debug_api.step()
    calls = inspect_enabled_calls(mod)
    assert len(calls) == 6
    assert sorted(c["tensor_name"] for c in calls) == sorted(ALL_TENSORS)
    assert {c["iteration"] for c in calls} == {0}
    assert len(constructions) == 6 and {it for it, _ in constructions} == {0}
    assert state.next_iter is None  # never again in this session
    inspected = [kw["tensor_name"] for hook, _, kw in mod.CALLS if hook == "inspect_tensor"]
    assert inspected == ["activation", "weight", "output"]


def test_logged_exactly_on_iterations_divisible_by_3_or_5(start, constructions):
    mod = start(
        {
            "DebugInspect": {
                "enabled": True,
                "tensors_struct": [
                    {"tensor": "activation", "start_step": 1, "freq": 3},
                    {"tensor": "weight", "start_step": 1, "freq": 5},
                ],
            }
        }
    )
    state = LayerDebugState()
    active_iterations = []
    for iteration in range(20):
        if run_layer(state, X, W) is not None:
            active_iterations.append(iteration)
        debug_api.step()
    inspected = {kw["iteration"] for hook, _, kw in mod.CALLS if hook == "inspect_tensor"}
    expected = {i for i in range(1, 20) if i % 3 == 0 or i % 5 == 0}
    assert inspected == expected
    assert active_iterations == sorted(expected)
    by_tensor = {
        t: sorted(kw["iteration"] for hook, _, kw in mod.CALLS if hook == "inspect_tensor" and kw["tensor_name"] == t)
        for t in ("activation", "weight")
    }
    assert by_tensor == {"activation": [3, 6, 9, 12, 15, 18], "weight": [5, 10, 15]}
    # quantizers were built only at iteration 0 (first call) and on the scheduled iterations
    assert sorted({it for it, _ in constructions}) == [0] + sorted(expected)
    assert len(constructions) == 6 * (1 + len(expected))


def test_decision_reused_for_microbatches(start, constructions):
    start({"DebugInspect": {"enabled": True, "tensors": ["activation"], "freq": 2}})
    state = LayerDebugState()
    results = []
    for iteration in range(4):
        results.append([run_layer(state, X, W) is not None for _ in range(3)])
        debug_api.step()
    assert results == [[True] * 3, [False] * 3, [True] * 3, [False] * 3]
    # every microbatch of an active iteration gets fresh quantizers; idle iterations build nothing
    assert [it for it, _ in constructions] == [0] * 18 + [2] * 18


def test_inactive_build_is_remembered_for_the_iteration(start, constructions):
    start({"DebugInspect": {"enabled": True, "tensors": ["activation"], "freq": 3}})
    state = LayerDebugState()
    debug_api.step()  # iteration 1: next_iter is still 0, so the first call builds and finds nothing
    assert run_layer(state, X, W) is None and run_layer(state, X, W) is None
    assert len(constructions) == 6 and state.next_iter == 3


def test_permanent_opt_out(start, constructions):
    mod = start({"DebugInspect": {"enabled": True, "tensors": ["activation"]}}, regex="other_layer")
    state = LayerDebugState()
    for _ in range(5):
        assert run_layer(state, X, W) is None
        debug_api.step()
    assert state.next_iter is None and len(constructions) == 6
    assert inspect_enabled_calls(mod) == []  # the layer is not selected: defaults only


def test_disabled_quantization_keeps_layer_in_debug(start, constructions):
    start({"DebugDisableGemm": {"enabled": True, "gemms": ["wgrad"]}})
    state = LayerDebugState()
    for iteration in range(3):
        qs = state.debug_quantizers(LAYER, normal_quantizers())
        assert qs is not None and state.next_iter == iteration + 1
        assert qs["input"].columnwise_tensor_plan == "High Precision"
        debug_api.step()


def test_reinitialize_resets_state(start, constructions):
    start({"DebugInspect": {"enabled": True, "tensors": ["activation"]}}, regex="other_layer")
    state = LayerDebugState()
    assert run_layer(state, X, W) is None and state.next_iter is None
    debug_api.end_debug()
    assert run_layer(state, X, W) is None  # off: one attribute check
    mod = start({"DebugInspect": {"enabled": True, "tensors": ["activation"]}})
    assert run_layer(state, X, W) is not None
    assert [kw["tensor_name"] for hook, _, kw in mod.CALLS if hook == "inspect_tensor"] == ["activation"]
    # a session ending and a new one starting within the same iteration number still resets the decision
    debug_api.end_debug()
    start({"DebugInspect": {"enabled": True, "tensors": ["activation"]}}, regex="other_layer")
    assert run_layer(state, X, W) is None and state.next_iter is None


def test_linear_layer_switches_to_non_debug_mode(start, constructions):
    """TE's test_perf through a real layer: forward + backward for 20 iterations, a feature active at iteration 0
    only -> inspect_tensor_enabled is called exactly 6 times and no DebugQuantizer is built afterwards."""
    from tedebug.autocast import autocast
    from tedebug.nn import Linear
    from tedebug.recipe import Float8CurrentScaling

    mod = start({"DebugInspect": {"enabled": True, "tensors": ALL_TENSORS, "start_step": 0, "end_step": 0}})
    layer = Linear(32, 16, name="lin")
    x = torch.linspace(-2.0, 2.0, 8 * 32).reshape(8, 32).requires_grad_()
    for _ in range(20):
        with autocast(recipe=Float8CurrentScaling()):
            y = layer(x)
        y.sum().backward()
        debug_api.step()
    calls = inspect_enabled_calls(mod)
    assert len(calls) == 6 and {c["iteration"] for c in calls} == {0}
    assert sorted(c["tensor_name"] for c in calls) == sorted(ALL_TENSORS)
    assert {it for it, _ in constructions} == {0} and len(constructions) == 6
    inspected = sorted(kw["tensor_name"] for hook, _, kw in mod.CALLS if hook == "inspect_tensor")
    assert inspected == sorted(ALL_TENSORS)  # all six tensors inspected once, at iteration 0
