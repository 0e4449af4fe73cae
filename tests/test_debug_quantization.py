"""Tests of tedebug.debug_quantization: plans, routing-call order, shared parent quantization, usage rules,
modify/inspect hooks, GEMM outputs, save/restore and the DebugQuantizedTensor usage routing, with hybrid quantizers."""

import itertools
from pathlib import Path

import pytest
import torch

from tedebug import debug_api
from tedebug.debug_quantization import (
    API_CALL_MODIFY,
    HIGH_PRECISION,
    STANDARD_QUANTIZE,
    DebugQuantizedTensor,
    DebugQuantizer,
    enabled_and_next,
)
from tedebug.session import DebugSession
from tedebug.quantization import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Tensor,
    HybridQuantizedTensor,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
)

LAYER = "decoder.1.fc1"
TP_GROUP = object()  # stands for a process group: only its identity is checked


class HookSpy:
    """Stands in for debug_api.transformer_engine: records (hook, kwargs-without-tensors) then forwards."""

    def __init__(self, real):
        self.real = real
        self.calls = []

    def __getattr__(self, hook):
        method = getattr(self.real, hook)

        def call(layer_name, **kwargs):
            self.calls.append((hook, layer_name, {k: kwargs[k] for k in ("gemm", "tensor_name") if k in kwargs}))
            return method(layer_name, **kwargs)

        return call


@pytest.fixture
def spy():
    """Install a HookSpy (call after a session started with ``plan_cache=False``, so that every hook question
    goes through ``debug_api.transformer_engine``).

    The spy shadows the module-level `__getattr__` of debug_api as a plain module attribute; teardown deletes it
    again.  (monkeypatch.setattr would "restore" the session's namespace object it read through `__getattr__` as a
    module attribute, which then shadows every later session's namespace.)
    """
    installed = []

    def _install():
        recorder = HookSpy(debug_api.transformer_engine)
        debug_api.transformer_engine = recorder
        installed.append(recorder)
        return recorder

    yield _install
    if installed:
        del debug_api.transformer_engine


@pytest.fixture
def messages(monkeypatch):
    """Capture the sessions' main-log messages (still forwarded to the real method)."""
    captured = []
    real = DebugSession.log_message

    def log_message(self, msg, layer_name=None, *args, **kwargs):
        captured.append((msg, layer_name))
        return real(self, msg, layer_name, *args, **kwargs)

    monkeypatch.setattr(DebugSession, "log_message", log_message)
    return captured


def counting(quantizer):
    """Wrap quantizer._quantize to record the usage flags of every call; returns the record list."""
    record = []
    real = quantizer._quantize

    def _quantize(tensor):
        record.append((quantizer.rowwise_usage, quantizer.columnwise_usage))
        return real(tensor)

    quantizer._quantize = _quantize
    return record


def calls_of(module, hook):
    return [(layer, kw) for h, layer, kw in module.CALLS if h == hook]


X = torch.tensor([[1.0, -2.0, 3.0, 0.5], [0.25, -4.0, 6.0, -8.0]])


# ------------------------------------------------------------------------------------------------ (bool, next)
def test_enabled_and_next_convention():
    assert enabled_and_next((True, 7), 3, hook="h", layer_name="l") == (True, 7)
    assert enabled_and_next((False, None), 3, hook="h", layer_name="l") == (False, None)
    # bare bool (deprecated): ask again next iteration
    assert enabled_and_next(True, 3, hook="h", layer_name="l") == (True, 4)
    assert enabled_and_next(False, 3, hook="h", layer_name="l") == (False, 4)
    with pytest.raises(TypeError, match="h\\(\\) for layer 'l'"):
        enabled_and_next("yes", 3, hook="h", layer_name="l")
    with pytest.raises(TypeError, match="length 3"):
        enabled_and_next((True, 1, 2), 3, hook="h", layer_name="l")


# ------------------------------------------------------------------------------------------------ plans
DIRECTION_FEATURES = ("modify", "disable", "none")


def _features_for(tensor_name, gemms_by_kind):
    features = {}
    if gemms_by_kind["modify"]:
        features["DebugModify"] = {"enabled": True, "gemms": gemms_by_kind["modify"], "tensors": [tensor_name]}
    if gemms_by_kind["disable"]:
        features["DebugDisableGemm"] = {"enabled": True, "gemms": gemms_by_kind["disable"]}
    if not features:
        features["DebugInspect"] = {"enabled": False, "tensors": [tensor_name]}
    return features


@pytest.mark.parametrize("row_kind,col_kind", list(itertools.product(DIRECTION_FEATURES, repeat=2)))
@pytest.mark.parametrize("with_parent", [False, True])
def test_plans_every_combination(start, messages, row_kind, col_kind, with_parent):
    kinds = {"modify": [], "disable": [], "none": []}
    kinds[row_kind].append("fprop")
    kinds[col_kind].append("dgrad")
    start(_features_for("weight", kinds))
    parent = Float8CurrentScalingQuantizer("E4M3") if with_parent else None
    q = DebugQuantizer(LAYER, "weight", parent, None)

    def expected(kind):
        if kind == "modify":
            return API_CALL_MODIFY
        if kind == "none" and with_parent:
            return STANDARD_QUANTIZE
        return HIGH_PRECISION

    assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == (expected(row_kind), expected(col_kind))
    assert (f"Tensor: weight, gemm fprop - {expected(row_kind)}", LAYER) in messages
    assert (f"Tensor: weight, gemm dgrad - {expected(col_kind)}", LAYER) in messages
    # any_feature_enabled: a modify direction, or quantization switched off while a parent exists
    plans = (expected(row_kind), expected(col_kind))
    assert q.any_feature_enabled() == (API_CALL_MODIFY in plans or (with_parent and HIGH_PRECISION in plans))

    # the operands follow the plans
    out = q.quantize(X)
    for operand, plan in ((out.rowwise_gemm_tensor, plans[0]), (out.columnwise_gemm_tensor, plans[1])):
        if plan == API_CALL_MODIFY:
            assert torch.equal(operand, X * 2)
        elif plan == HIGH_PRECISION:
            assert operand is X
        else:
            assert isinstance(operand, Float8Tensor)
    if plans == (STANDARD_QUANTIZE, STANDARD_QUANTIZE):
        assert out.rowwise_gemm_tensor is out.columnwise_gemm_tensor


def test_plan_lines_in_main_log(start, tmp_path):
    start({"DebugModify": {"enabled": True, "gemms": ["wgrad"], "tensors": ["gradient"]}})
    for _ in range(2):  # the lines are written once per session, however many quantizers are built
        DebugQuantizer(LAYER, "gradient", Float8CurrentScalingQuantizer("E5M2"), None)
    (log_file,) = (tmp_path / "nvdlfw_inspect_logs").glob("*.log")
    text = log_file.read_text()
    assert text.count(f"LAYER={LAYER}: Tensor: gradient, gemm dgrad - Quantize") == 1
    assert text.count(f"LAYER={LAYER}: Tensor: gradient, gemm wgrad - modify_tensor()") == 1


def test_routing_call_order(start, spy):
    start({"DebugInspect": {"enabled": False, "tensors": ["activation"]}}, plan_cache=False)
    recorder = spy()
    DebugQuantizer(LAYER, "activation", Float8CurrentScalingQuantizer("E4M3"), None)
    assert recorder.calls == [
        ("inspect_tensor_enabled", LAYER, {"tensor_name": "activation"}),
        ("inspect_tensor_postquantize_enabled", LAYER, {"tensor_name": "activation", "gemm": "fprop"}),
        ("inspect_tensor_postquantize_enabled", LAYER, {"tensor_name": "activation", "gemm": "wgrad"}),
        ("modify_tensor_enabled", LAYER, {"gemm": "fprop", "tensor_name": "activation"}),
        ("fp8_gemm_enabled", LAYER, {"gemm": "fprop"}),
        ("modify_tensor_enabled", LAYER, {"gemm": "wgrad", "tensor_name": "activation"}),
        ("fp8_gemm_enabled", LAYER, {"gemm": "wgrad"}),
    ]
    recorder.calls.clear()
    DebugQuantizer(LAYER, "gradient", None, None)  # no parent: fp8_gemm_enabled is not consulted
    assert [c[0] for c in recorder.calls] == [
        "inspect_tensor_enabled",
        "inspect_tensor_postquantize_enabled",
        "inspect_tensor_postquantize_enabled",
        "modify_tensor_enabled",
        "modify_tensor_enabled",
    ]
    assert [c[2].get("gemm") for c in recorder.calls] == [None, "dgrad", "wgrad", "dgrad", "wgrad"]
    recorder.calls.clear()
    DebugQuantizer(LAYER, "wgrad", None, None)  # GEMM output: inspect + modify of its producing GEMM only
    assert recorder.calls == [
        ("inspect_tensor_enabled", LAYER, {"tensor_name": "wgrad"}),
        ("modify_tensor_enabled", LAYER, {"gemm": "wgrad", "tensor_name": "wgrad"}),
    ]


def test_modify_beats_disable_and_parent_flags_forced(start):
    # modify and disable on the same GEMM: modify wins, fp8_gemm_enabled is not even asked
    mod = start(
        {
            "DebugModify": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"]},
            "DebugDisableGemm": {"enabled": True, "gemms": ["fprop", "wgrad"]},
        }
    )
    parent = Float8CurrentScalingQuantizer("E4M3")
    q = DebugQuantizer(LAYER, "activation", parent, None)
    assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == (API_CALL_MODIFY, HIGH_PRECISION)
    assert [kw["gemm"] for _, kw in calls_of(mod, "fp8_gemm_enabled")] == ["wgrad"]
    parent.internal, parent.optimize_for_gemm = True, True
    DebugQuantizer(LAYER, "activation", parent, None)
    assert (parent.internal, parent.optimize_for_gemm) == (False, False)


def test_unknown_tensor_name_and_bad_parent(start):
    start({})
    with pytest.raises(ValueError, match="unknown tensor name 'input'"):
        DebugQuantizer(LAYER, "input", None, None)
    with pytest.raises(TypeError, match="parent_quantizer must be a Quantizer"):
        DebugQuantizer(LAYER, "weight", "fp8", None)


# ------------------------------------------------------------------------------------------------ Quantize plan
def test_shared_parent_quantization(start):
    start({})
    parent = Float8CurrentScalingQuantizer("E4M3")
    record = counting(parent)
    q = DebugQuantizer(LAYER, "activation", parent, None)
    assert not q.any_feature_enabled()  # all defaults: nothing to debug
    out = q.quantize(X)
    assert record == [(True, True)]  # one parent quantization for both directions
    assert out.rowwise_gemm_tensor is out.columnwise_gemm_tensor
    assert isinstance(out.rowwise_gemm_tensor, Float8Tensor)
    assert out.get_tensor(False) is out.rowwise_gemm_tensor and out.get_tensor(True) is out.columnwise_gemm_tensor
    # the shared object is the parent's own result: both representations present, equal values
    qt = out.rowwise_gemm_tensor
    assert qt.has_rowwise and qt.has_columnwise
    assert torch.equal(qt.dequantize(usage="rowwise"), qt.dequantize(usage="columnwise"))


def test_parent_usage_rule(start):
    start({"DebugDisableGemm": {"enabled": True, "gemms": ["fprop"]}})
    parent = Float8CurrentScalingQuantizer("E4M3")
    record = counting(parent)
    q = DebugQuantizer(LAYER, "activation", parent, None)  # fprop HP, wgrad Quantize
    assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == (HIGH_PRECISION, STANDARD_QUANTIZE)
    out = q.quantize(X)
    # the parent would be columnwise-only: rowwise is forced on
    assert record == [(True, True)]
    assert out.rowwise_gemm_tensor is X and isinstance(out.columnwise_gemm_tensor, Float8Tensor)
    # columnwise usage off: the Quantize direction is not needed; the parent still runs rowwise-only
    q.set_usage(columnwise=False)
    assert (parent.rowwise_usage, parent.columnwise_usage) == (False, False)
    q.quantize(X)
    assert record[-1] == (True, False)


def test_parent_usage_rowwise_quantize_only(start):
    start({"DebugDisableGemm": {"enabled": True, "gemms": ["wgrad"]}})
    parent = Float8CurrentScalingQuantizer("E4M3")
    record = counting(parent)
    q = DebugQuantizer(LAYER, "activation", parent, None)
    out = q.quantize(X)
    assert record == [(True, False)]
    assert isinstance(out.rowwise_gemm_tensor, Float8Tensor) and out.columnwise_gemm_tensor is X
    assert not out.rowwise_gemm_tensor.has_columnwise


def test_hybrid_parent_shares_one_object(start):
    start({})
    parent = HybridQuantizer(Float8CurrentScalingQuantizer("E4M3"), MXFP8Quantizer("E4M3"))
    q = DebugQuantizer(LAYER, "weight", parent, None)
    assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == (STANDARD_QUANTIZE, STANDARD_QUANTIZE)
    w = torch.linspace(-3.0, 5.0, 64 * 32).reshape(64, 32)
    out = q.quantize(w)
    assert isinstance(out.rowwise_gemm_tensor, HybridQuantizedTensor)
    assert out.rowwise_gemm_tensor is out.columnwise_gemm_tensor
    assert out.rowwise_gemm_tensor.rowwise_sub_storage is not None
    assert out.rowwise_gemm_tensor.columnwise_sub_storage is not None


# ------------------------------------------------------------------------------------------------ modify
def test_modify_order_values_and_dtype(start):
    mod = start(
        {"DebugModify": {"enabled": True, "gemms": ["fprop", "wgrad"], "tensors": ["activation"], "factor": 0.5}}
    )
    parent = Float8CurrentScalingQuantizer("E4M3")
    record = counting(parent)
    q = DebugQuantizer(LAYER, "activation", parent, None)
    out = q.quantize(X, dtype=torch.bfloat16)
    assert record == []  # no Quantize plan: the parent is not used
    calls = calls_of(mod, "modify_tensor")
    assert [kw["gemm"] for _, kw in calls] == ["wgrad", "fprop"]  # columnwise first, then rowwise
    for _, kw in calls:
        assert kw["tensor"] is X and kw["default_quantizer"] is parent and kw["dtype"] == torch.bfloat16
        assert kw["iteration"] == 0 and kw["out"] is None
    expected = (X * 0.5).to(torch.bfloat16)
    assert out.rowwise_gemm_tensor.dtype == torch.bfloat16
    assert torch.equal(out.rowwise_gemm_tensor, expected) and torch.equal(out.columnwise_gemm_tensor, expected)
    assert out.rowwise_gemm_tensor is not out.columnwise_gemm_tensor  # one call per GEMM


def test_high_precision_dtype_cast(start):
    start({})
    q = DebugQuantizer(LAYER, "activation", None, None)
    out = q.quantize(X, dtype=torch.float16)
    assert out.rowwise_gemm_tensor is out.columnwise_gemm_tensor
    assert torch.equal(out.rowwise_gemm_tensor, X.to(torch.float16))
    assert q.quantize(X).rowwise_gemm_tensor is X


def test_modify_wrong_dtype_is_an_error(start):
    start({"DebugModify": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"], "wrong_dtype": True}})
    q = DebugQuantizer(LAYER, "activation", None, None)
    with pytest.raises((ValueError, TypeError), match="dtype"):  # the namespace's output check may come first
        q.quantize(X, dtype=torch.float32)


def test_modify_quantized_result_dtype_checked(start):
    start({"DebugModify": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"], "return_quantized": True}})
    parent = Float8CurrentScalingQuantizer("E4M3")
    q = DebugQuantizer(LAYER, "activation", parent, None)
    out = q.quantize(X)  # a QuantizedTensor from modify_tensor is a valid operand
    assert isinstance(out.rowwise_gemm_tensor, Float8Tensor) and out.rowwise_gemm_tensor.dtype == torch.float32
    assert out.rowwise_gemm_tensor is not out.columnwise_gemm_tensor  # wgrad: its own Quantize
    with pytest.raises(ValueError, match="returned dtype torch.float32; expected torch.bfloat16"):
        q.quantize(X, dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------------ inspect
def test_inspect_arguments_and_postquantize(start):
    mod = start(
        {
            "DebugInspect": {"enabled": True, "tensors": ["gradient"]},
            "DebugPostquantize": {"enabled": True, "tensors": ["gradient"]},
            "DebugDisableGemm": {"enabled": True, "gemms": ["wgrad"]},
        }
    )
    for _ in range(2):
        debug_api.step()
    parent = Float8CurrentScalingQuantizer("E5M2")
    with pytest.warns(DeprecationWarning):
        q = DebugQuantizer(LAYER, "gradient", parent, TP_GROUP, tp_size=4)
    assert q.iteration == 2
    assert q.any_feature_enabled()
    with pytest.warns(DeprecationWarning):
        out = q.quantize(X)
    ((layer, kw),) = calls_of(mod, "inspect_tensor")
    assert layer == LAYER and kw["tensor"] is X and kw["tensor_name"] == "gradient"
    assert kw["rowwise_quantized_tensor"] is out.rowwise_gemm_tensor
    assert kw["columnwise_quantized_tensor"] is out.columnwise_gemm_tensor is X
    assert kw["quantizer"] is parent and kw["tp_group"] is TP_GROUP and kw["tp_size"] == 4
    assert kw["iteration"] == 2
    # postquantize: only the Quantize/modify direction (rowwise = dgrad here), with its operand
    ((layer, kw),) = calls_of(mod, "inspect_tensor_postquantize")
    assert kw["rowwise"] is True and kw["tensor"] is out.rowwise_gemm_tensor and kw["tp_size"] == 4


def test_next_debug_iter_from_schedules(start):
    start({"DebugInspect": {"enabled": True, "tensors": ["weight"], "freq": 4, "start_step": 2}})
    debug_api.step()  # iteration 1
    q = DebugQuantizer(LAYER, "weight", None, None)
    assert q.get_next_debug_iter() == 4 and not q.any_feature_enabled()
    other = DebugQuantizer(LAYER, "activation", None, None)  # only defaults: never again
    assert other.get_next_debug_iter() is None


def test_bare_bool_means_next_iteration(start):
    start({"DebugInspect": {"enabled": True, "tensors": ["weight"], "freq": 4, "bare_bool": True}})
    for _ in range(5):
        debug_api.step()
    q = DebugQuantizer(LAYER, "weight", None, None)
    assert q.get_next_debug_iter() == 6 and not q.inspect_tensor_enabled


# ------------------------------------------------------------------------------------------------ GEMM outputs
def test_process_gemm_output_modify_then_inspect(start):
    mod = start(
        {
            "DebugModify": {"enabled": True, "gemms": ["dgrad"], "tensors": ["dgrad"], "factor": 4.0},
            "DebugInspect": {"enabled": True, "tensors": ["dgrad"]},
        }
    )
    q = DebugQuantizer(LAYER, "dgrad", None, TP_GROUP)
    assert q.rowwise_tensor_plan == API_CALL_MODIFY and q.columnwise_tensor_plan is None
    assert q.any_feature_enabled()
    result = q.process_gemm_output(X)
    assert torch.equal(result, X * 4)
    ((_, mkw),) = calls_of(mod, "modify_tensor")
    assert mkw["gemm"] == "dgrad" and mkw["tensor"] is X and mkw["default_quantizer"] is None
    ((_, ikw),) = calls_of(mod, "inspect_tensor")
    assert ikw["tensor"] is result and ikw["rowwise_quantized_tensor"] is None
    assert ikw["columnwise_quantized_tensor"] is None and ikw["quantizer"] is None
    with pytest.raises(RuntimeError, match="process_gemm_output"):
        q.quantize(X)


def test_gemm_output_without_features_and_with_parent(start):
    start({})
    q = DebugQuantizer(LAYER, "output", None, None)
    assert not q.any_feature_enabled() and q.rowwise_tensor_plan == HIGH_PRECISION
    assert q.process_gemm_output(X) is X
    quantized_output = DebugQuantizer(LAYER, "output", Float8CurrentScalingQuantizer("E4M3"), None)
    with pytest.raises(RuntimeError, match="quantized GEMM outputs .* not supported in debug mode"):
        quantized_output.process_gemm_output(X)
    with pytest.raises(RuntimeError, match="not a GEMM output"):
        DebugQuantizer(LAYER, "weight", None, None).process_gemm_output(X)


# ------------------------------------------------------------------------------------------------ usage routing
class ChildSpy:
    """Records the update_usage calls a Float8Tensor receives."""

    def __init__(self, tensor):
        self.calls = []
        real = tensor.update_usage

        def update_usage(rowwise_usage=None, columnwise_usage=None):
            self.calls.append((rowwise_usage, columnwise_usage))
            real(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage)

        tensor.update_usage = update_usage


def _fp8(x):
    return Float8CurrentScalingQuantizer("E4M3").quantize(x)


def test_usage_routing_distinct_children():
    row, col = _fp8(X), _fp8(X * 3)
    row_spy, col_spy = ChildSpy(row), ChildSpy(col)
    dqt = DebugQuantizedTensor(row, col, None, LAYER, "weight")
    dqt.update_usage(columnwise_usage=True)
    assert col_spy.calls == [(None, True)] and row_spy.calls == []
    dqt.update_usage(rowwise_usage=True)
    assert row_spy.calls == [(True, None)] and col_spy.calls == [(None, True)]


def test_usage_routing_dropped_direction_cannot_come_back():
    row, col = _fp8(X), _fp8(X * 3)
    row_spy, col_spy = ChildSpy(row), ChildSpy(col)
    dqt = DebugQuantizedTensor(row, col, None, LAYER, "activation")
    dqt.update_usage(rowwise_usage=False)
    assert dqt.rowwise_gemm_tensor is None and dqt.columnwise_gemm_tensor is col
    with pytest.raises(RuntimeError, match="Cannot recreate rowwise tensor .* in debug mode"):
        dqt.update_usage(rowwise_usage=True, columnwise_usage=True)
    assert dqt.columnwise_gemm_tensor is col  # validated before anything changed
    assert row_spy.calls == [] and col_spy.calls == []
    dqt.update_usage(columnwise_usage=False, rowwise_usage=None)
    assert dqt.columnwise_gemm_tensor is None
    with pytest.raises(RuntimeError, match="Cannot recreate columnwise tensor .* in debug mode"):
        dqt.update_usage(columnwise_usage=True)
    with pytest.raises(RuntimeError, match="holds no tensor"):
        dqt.dequantize()


def test_usage_routing_shared_child_one_combined_call():
    shared = _fp8(X)
    spy_ = ChildSpy(shared)
    dqt = DebugQuantizedTensor(shared, shared, None)
    dqt.update_usage(rowwise_usage=True, columnwise_usage=False)
    assert spy_.calls == [(True, False)]
    assert dqt.rowwise_gemm_tensor is shared and dqt.columnwise_gemm_tensor is shared
    assert shared.has_rowwise and not shared.has_columnwise


def test_usage_plain_tensors():
    dqt = DebugQuantizedTensor(X, X * 2, None)
    dqt.update_usage(rowwise_usage=True, columnwise_usage=True)  # plain tensors: nothing to forward
    dqt.update_usage(columnwise_usage=False)
    assert dqt.columnwise_gemm_tensor is None and dqt.rowwise_gemm_tensor is X
    with pytest.raises(ValueError, match="drop both"):
        dqt.update_usage(rowwise_usage=False, columnwise_usage=False)


# ------------------------------------------------------------------------------------------------ wgrad all-gather
def test_wgrad_allgather_usage_without_parent(start):
    start({})
    q = DebugQuantizer(LAYER, "activation", None, None)
    q.set_usage(rowwise=False, columnwise=True)
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)
    assert not q.supports_only_rowwise_all_gather()


def test_wgrad_allgather_usage_fp8_block_1d_parent(start):
    start({})
    parent = Float8BlockQuantizer("E4M3", block_scaling_dim=1)
    q = DebugQuantizer(LAYER, "activation", parent, None)
    q.set_usage(rowwise=False, columnwise=True)
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)
    assert (parent.rowwise_usage, parent.columnwise_usage) == (False, True)  # synchronised
    q.set_usage(rowwise=True, columnwise=False)
    assert (parent.rowwise_usage, parent.columnwise_usage) == (True, False)


def test_wgrad_allgather_usage_hybrid_parent(start):
    start({})
    row_child, col_child = Float8CurrentScalingQuantizer("E4M3"), MXFP8Quantizer("E4M3")
    parent = HybridQuantizer(row_child, col_child)
    children_before = [(c.rowwise_usage, c.columnwise_usage) for c in (row_child, col_child)]
    q = DebugQuantizer(LAYER, "activation", parent, None)
    q.set_usage(rowwise=False, columnwise=True)
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)
    assert (parent.rowwise_usage, parent.columnwise_usage) == (False, True)
    assert [(c.rowwise_usage, c.columnwise_usage) for c in (row_child, col_child)] == children_before


def test_set_usage_ignores_non_quantize_directions(start):
    start({"DebugDisableGemm": {"enabled": True, "gemms": ["wgrad"]}})
    parent = Float8CurrentScalingQuantizer("E4M3")
    q = DebugQuantizer(LAYER, "activation", parent, None)  # fprop Quantize, wgrad HP
    q.set_usage(rowwise=True, columnwise=True)
    assert (parent.rowwise_usage, parent.columnwise_usage) == (True, False)


# ------------------------------------------------------------------------------------------------ save / restore
def _fields(qt):
    return [getattr(qt, f) for f in qt._tensor_fields()]


def test_save_restore_shared_object(start):
    start({})
    q = DebugQuantizer(LAYER, "weight", Float8CurrentScalingQuantizer("E4M3"), None)
    out = q.quantize(X)
    shared = out.rowwise_gemm_tensor
    before = [None if t is None else t.clone() for t in _fields(shared)]
    tensors, obj = out.prepare_for_saving()
    assert obj is out
    assert len(tensors) == len(before)  # the shared object is saved once
    assert out.rowwise_gemm_tensor is None and out.columnwise_gemm_tensor is None
    extra = torch.zeros(1)
    rest = out.restore_from_saved(tensors + [extra])
    assert rest == [extra] or (len(rest) == 1 and rest[0] is extra)
    assert out.rowwise_gemm_tensor is shared and out.columnwise_gemm_tensor is shared
    for a, b in zip(_fields(shared), before):
        assert (a is None and b is None) or torch.equal(a, b)


def test_save_restore_two_distinct_objects(start):
    start({"DebugDisableGemm": {"enabled": True, "gemms": ["wgrad"]}})
    q = DebugQuantizer(LAYER, "activation", Float8CurrentScalingQuantizer("E4M3"), None)
    out = q.quantize(X)
    row, col = out.rowwise_gemm_tensor, out.columnwise_gemm_tensor
    assert isinstance(row, Float8Tensor) and col is X
    n_row = len(_fields(row))
    tensors, _ = out.prepare_for_saving()
    assert len(tensors) == n_row + 1 and tensors[-1] is X
    rest = out.restore_from_saved(tensors)
    assert rest == []
    assert out.rowwise_gemm_tensor is row and out.columnwise_gemm_tensor is X
    assert torch.equal(out.dequantize(), row.dequantize())
    with pytest.raises(RuntimeError, match="without prepare_for_saving"):
        out.restore_from_saved([])


# ------------------------------------------------------------------------------------------------ other methods
def test_update_quantized_refreshes_in_place(start):
    mod = start(
        {
            "DebugModify": {"enabled": True, "gemms": ["dgrad"], "tensors": ["weight"], "factor": 3.0},
            "DebugInspect": {"enabled": True, "tensors": ["weight"]},
        }
    )
    parent = Float8CurrentScalingQuantizer("E4M3")
    q = DebugQuantizer(LAYER, "weight", parent, None)  # fprop Quantize, dgrad modify
    w1, w2 = X.clone(), X.flip(0).clone()
    out = q.quantize(w1)
    row, col = out.rowwise_gemm_tensor, out.columnwise_gemm_tensor
    assert q.update_quantized(w2, out) is out
    assert out.rowwise_gemm_tensor is row and out.columnwise_gemm_tensor is col  # same objects, new data
    assert torch.equal(row.dequantize(), Float8CurrentScalingQuantizer("E4M3").quantize(w2).dequantize())
    assert torch.equal(col, w2 * 3)
    mod_calls = calls_of(mod, "modify_tensor")
    assert mod_calls[-1][1]["out"] is col and mod_calls[-1][1]["tensor"] is w2
    assert calls_of(mod, "inspect_tensor")[-1][1]["tensor"] is w2
    with pytest.raises(RuntimeError, match="noop_flag"):
        out.quantize_(w1, noop_flag=torch.zeros(1))
    # quantize(out=...) is the same refresh
    assert q.quantize(w1, out=out) is out and torch.equal(col, w1 * 3)


def test_update_quantized_high_precision_copy(start):
    start({})
    q = DebugQuantizer(LAYER, "weight", None, None)
    buffer = torch.zeros_like(X)
    out = q.quantize(buffer)
    q.update_quantized(X, out)
    assert out.rowwise_gemm_tensor is buffer and torch.equal(buffer, X)


def test_wrap_quantized_tensor(start):
    mod = start({"DebugInspect": {"enabled": True, "tensors": ["weight"]}})
    parent = Float8CurrentScalingQuantizer("E4M3")
    q = DebugQuantizer(LAYER, "weight", parent, None)
    qt = parent.quantize(X)
    out = q.wrap_quantized_tensor(qt)
    assert out.rowwise_gemm_tensor is qt and out.columnwise_gemm_tensor is qt
    ((_, kw),) = calls_of(mod, "inspect_tensor")
    assert kw["tensor"] is None and kw["rowwise_quantized_tensor"] is qt and kw["columnwise_quantized_tensor"] is qt
    debug_api.end_debug()
    start({"DebugDisableGemm": {"enabled": True, "gemms": ["dgrad"]}})
    q = DebugQuantizer(LAYER, "weight", parent, None)
    with pytest.raises(RuntimeError, match="cannot be modified by any feature"):
        q.wrap_quantized_tensor(qt)


def test_make_empty_calibrate_recipe_name(start):
    start({})
    parent = Float8CurrentScalingQuantizer("E4M3")
    with_parent = DebugQuantizer(LAYER, "weight", parent, None)
    assert isinstance(with_parent.make_empty((2, 4), dtype=torch.bfloat16), Float8Tensor)
    assert with_parent.recipe_name == "fp8_current_scaling"
    plain = DebugQuantizer(LAYER, "weight", None, None).make_empty((2, 4), dtype=torch.bfloat16)
    assert isinstance(plain, torch.Tensor) and plain.shape == (2, 4) and plain.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="calibration"):
        with_parent.calibrate(X)
    assert DebugQuantizer.is_debug and DebugQuantizedTensor.is_debug


def test_multi_tensor_quantize(start):
    mod = start({"DebugModify": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"]}})
    qs = [DebugQuantizer(f"moe.gemm_{i}", "activation", None, None) for i in range(3)]
    x = torch.arange(12.0).reshape(6, 2)
    outs = DebugQuantizer.multi_tensor_quantize(x, qs, [1, 3, 2], torch.float32)
    assert [tuple(o.shape) for o in outs] == [(1, 2), (3, 2), (2, 2)]
    assert torch.equal(outs[1].rowwise_gemm_tensor, x[1:4] * 2) and torch.equal(outs[2].columnwise_gemm_tensor, x[4:6])
    assert [layer for layer, _ in calls_of(mod, "modify_tensor")] == ["moe.gemm_0", "moe.gemm_1", "moe.gemm_2"]
    with pytest.raises(ValueError, match="sum to 5"):
        DebugQuantizer.multi_tensor_quantize(x, qs, [1, 3, 1], torch.float32)


def test_dequantize_shape_dtype_device(start):
    start({})
    q = DebugQuantizer(LAYER, "activation", IdentityQuantizer(), None)
    out = q.quantize(X.to(torch.bfloat16))
    assert out.shape == X.shape and out.size(1) == 4 and out.dtype == torch.bfloat16
    assert out.device == X.device
    assert torch.equal(out.dequantize(dtype=torch.float32), X.to(torch.bfloat16).float())


# ------------------------------------------------------------------------------------------------ built-in features
def test_builtin_disable_quantization_gemm_and_layer(start):
    start({"DisableQuantizationGEMM": {"enabled": True, "gemms": ["dgrad"]}})
    parent = Float8CurrentScalingQuantizer("E4M3")
    weight = DebugQuantizer(LAYER, "weight", parent, None)
    gradient = DebugQuantizer(LAYER, "gradient", Float8CurrentScalingQuantizer("E5M2"), None)
    # both operands of dgrad (weight columnwise, gradient rowwise) run in high precision
    assert (weight.rowwise_tensor_plan, weight.columnwise_tensor_plan) == (STANDARD_QUANTIZE, HIGH_PRECISION)
    assert (gradient.rowwise_tensor_plan, gradient.columnwise_tensor_plan) == (HIGH_PRECISION, STANDARD_QUANTIZE)
    assert weight.any_feature_enabled() and weight.get_next_debug_iter() == 1
    debug_api.end_debug()
    start({"DisableQuantizationLayer": {"enabled": True}})
    for tensor in ("activation", "weight", "gradient"):
        q = DebugQuantizer(LAYER, tensor, Float8CurrentScalingQuantizer("E4M3"), None)
        assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == (HIGH_PRECISION, HIGH_PRECISION)
        out = q.quantize(X)
        assert out.rowwise_gemm_tensor is X and out.columnwise_gemm_tensor is X


def test_builtin_fake_quant_modifies_and_partner_goes_high_precision(start):
    start(
        {
            "FakeQuant": {
                "enabled": True,
                "gemms": ["fprop"],
                "tensors_struct": [{"tensor": "activation", "quant_format": "FP8E4M3"}],
            }
        }
    )
    act = DebugQuantizer(LAYER, "activation", Float8CurrentScalingQuantizer("E4M3"), None)
    weight = DebugQuantizer(LAYER, "weight", Float8CurrentScalingQuantizer("E4M3"), None)
    assert (act.rowwise_tensor_plan, act.columnwise_tensor_plan) == (API_CALL_MODIFY, STANDARD_QUANTIZE)
    assert (weight.rowwise_tensor_plan, weight.columnwise_tensor_plan) == (HIGH_PRECISION, STANDARD_QUANTIZE)
    x = torch.tensor([[448.0, 1.0, -0.3, 17.0]])  # amax 448 -> scale 1: values round to the E4M3 grid
    out = act.quantize(x)
    # E4M3 neighbours: 0.3 lies between 0.28125 and 0.3125 (step 2^-5 in [0.25, 0.5)) -> 0.3125 is nearer;
    # 17 lies between 16 and 18 (step 2 in [16, 32)) -> ties to even mantissa: 16
    assert torch.equal(out.rowwise_gemm_tensor, torch.tensor([[448.0, 1.0, -0.3125, 16.0]]))
    assert isinstance(out.columnwise_gemm_tensor, Float8Tensor)


def test_builtin_log_tensor_stats_logged_on_iterations_3_or_5(start, tmp_path):
    """TE's test_log_every_3_or_5_layers through DebugQuantizers built by the gate."""
    from tedebug.nn.debug_gate import LayerDebugState

    start(
        {
            "LogTensorStats": {
                "enabled": True,
                "stats": ["max"],
                "tensors_struct": [
                    {"tensor": "activation", "start_step": 1, "freq": 3},
                    {"tensor": "weight", "start_step": 1, "freq": 5},
                ],
            }
        }
    )
    state = LayerDebugState()
    for _ in range(20):
        qs = state.debug_quantizers(
            LAYER, {"input": Float8CurrentScalingQuantizer("E4M3"), "weight": Float8CurrentScalingQuantizer("E4M3")}
        )
        if qs is not None:
            qs["input"].quantize(X)
            qs["weight"].quantize(X * 2)
        debug_api.step()
    debug_api.end_debug()
    from tedebug.sinks.text import stats_log_path

    text = Path(stats_log_path(str(tmp_path), 0)).read_text()
    logged = {i for i in range(20) if f"iteration={i:06d}" in text}
    assert logged == {i for i in range(1, 20) if i % 3 == 0 or i % 5 == 0}
    assert f"{LAYER}_activation_max" in text and f"{LAYER}_weight_max" in text
