"""The debug path's per-operand shortcuts keep their promise, pinned by counting calls (never by timing):

- `DebugQuantizer.set_usage` (every operand of a logged GEMM) passes the usages on to the parent quantizer only
  when a direction of the tensor is quantized by it, and then exactly as the parent-usage rule says;
- a logged high-precision layer's debug gate renews its six quantizers once per call (no new quantizer), at the
  session's iteration, asking an inspection answer that consecutive quantizers share once, and noting in the
  statistics engine what asking every question notes;
- LogTensorStats' inspection of a logged tensor is one `InspectPlan.feed` call;
- an inspect-only GEMM call reaches that feed through its plan's bound call, without `DebugQuantizer._inspect` or
  `InspectCall.__call__` per tensor (`inspect_group`), and still through the namespace once a hook replaces its
  ``inspect_tensor``.
"""

from __future__ import annotations

import torch

from tedebug import debug_api
from tedebug.features import log_tensor_stats
from tedebug.debug_quantization import HIGH_PRECISION, STANDARD_QUANTIZE, DebugQuantizer, inspect_group
from tedebug.nn import Linear, debug_gate
from tedebug.plan import InspectCall, ScheduledAnswer
from tedebug.quantization import Float8CurrentScalingQuantizer

from support.features import RecordingSink, debug_session, section

LAYER = "decoder.1.fc1"


def _counting_set_usage(quantizer):
    calls = []
    real = quantizer.set_usage

    def set_usage(*, rowwise=None, columnwise=None):
        calls.append((rowwise, columnwise))
        real(rowwise=rowwise, columnwise=columnwise)

    quantizer.set_usage = set_usage
    return calls


def test_set_usage_reaches_the_parent_only_when_it_quantizes(start):
    start({"DebugDisableGemm": {"enabled": True, "gemms": ["fprop", "wgrad"]}})
    parent = Float8CurrentScalingQuantizer("E4M3")
    calls = _counting_set_usage(parent)
    q = DebugQuantizer(LAYER, "activation", parent, None)  # both GEMMs of the activation in high precision
    assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == (HIGH_PRECISION, HIGH_PRECISION)
    q.set_usage(rowwise=True, columnwise=False)
    assert calls == [] and (q.rowwise_usage, q.columnwise_usage) == (True, False)
    gradient = DebugQuantizer(LAYER, "gradient", None, None)  # no parent at all
    gradient.set_usage(rowwise=False, columnwise=True)
    assert (gradient.rowwise_usage, gradient.columnwise_usage) == (False, True)


def test_set_usage_passes_the_quantized_directions_on(start):
    start({"DebugDisableGemm": {"enabled": True, "gemms": ["fprop"]}})
    parent = Float8CurrentScalingQuantizer("E4M3")
    calls = _counting_set_usage(parent)
    q = DebugQuantizer(LAYER, "activation", parent, None)  # fprop high precision, wgrad quantized
    assert (q.rowwise_tensor_plan, q.columnwise_tensor_plan) == (HIGH_PRECISION, STANDARD_QUANTIZE)
    q.set_usage(rowwise=True, columnwise=True)
    q.set_usage(columnwise=False)
    assert calls == [(False, True), (False, False)]


def test_logged_layer_renews_its_quantizers_once_per_call(tmp_path, monkeypatch):
    """After the first call the gate builds no quantizer: one renewal of the same six per call, at the session's
    iteration, which asks the inspection question of the two logged tensors (one section's: one shared answer) once."""
    config = section(
        {"LogTensorStats": {"enabled": True, "stats": ["min"], "tensors": ["activation", "weight"], "freq": 1}}
    )
    layer = Linear(8, 4, name="lin")
    x = torch.randn(2, 8)
    built, renewed, asked = [], [], []
    real_init, real_renew, real_ask = DebugQuantizer.__init__, debug_gate.renew_quantizers, ScheduledAnswer.ask

    def init(self, *args, **kwargs):
        built.append(args[1])
        real_init(self, *args, **kwargs)

    def renew(quantizers, iteration):
        renewed.append(([q.tensor_name for q in quantizers], iteration))
        assert all(q is first[i] for i, q in enumerate(quantizers))  # the quantizers of the first call
        return real_renew(quantizers, iteration)

    def ask(answer, iteration):
        asked.append(iteration)
        return real_ask(answer, iteration)

    monkeypatch.setattr(DebugQuantizer, "__init__", init)
    monkeypatch.setattr(debug_gate, "renew_quantizers", renew)
    monkeypatch.setattr(ScheduledAnswer, "ask", ask)
    with debug_session(config, tmp_path):
        for _ in range(3):
            layer(x).sum().backward()
            if not renewed:
                first = layer.gemm_state._debug_state._last[6]
            debug_api.step()
    assert built == ["activation", "weight", "output", "dgrad", "wgrad", "gradient"]  # the first call only
    tensors = ["activation", "weight", "output", "dgrad", "wgrad", "gradient"]
    assert renewed == [(tensors, 1), (tensors, 2)]
    assert asked == [0, 0, 1, 2]  # each new plan asks once; a renewal asks the shared answer once


def test_renewed_quantizers_note_what_asking_every_question_notes(tmp_path):
    """Tensors on other schedules alternate in the quantizers' order (activation and output every 2nd iteration,
    the weight every 3rd): a renewal asks again every answer that the quantizer before did not ask, so the
    statistics engine's table of next iterations (the last note of the layer wins) is after every call the one
    noted when every question reaches the feature (the plan cache off)."""
    config = section(
        {
            "LogTensorStats": {
                "enabled": True,
                "stats": ["min"],
                "tensors_struct": [
                    {"tensor": "activation", "freq": 2},
                    {"tensor": "weight", "freq": 3},
                    {"tensor": "output", "freq": 2},
                ],
            }
        }
    )
    tables = {}
    for plan_cache in (True, False):
        layer = Linear(8, 4, name="lin")
        noted = tables[plan_cache] = []
        with debug_session(config, tmp_path / str(plan_cache), plan_cache=plan_cache):
            for _ in range(7):
                layer(torch.randn(2, 8)).sum().backward()
                noted.append(dict(debug_api.DEBUG_MANAGER.stats._next_iter))
                debug_api.step()
    assert tables[True] == tables[False]
    assert [table["lin"] for table in tables[True]] == [2, 2, 4, 4, 6, 6, 8]  # the output's schedule, noted last


def test_log_tensor_stats_bound_inspection_is_one_feed_per_logged_tensor(tmp_path, monkeypatch):
    """Through the debug path, LogTensorStats' inspection of a tensor is one `InspectPlan.feed` call (bound to the
    layer, no wrapper object), its main-log line written once per layer, and the statistics are the tensors'."""
    feeds = []
    real_feed = log_tensor_stats.InspectPlan.feed

    def feed(plan, layer_name, *args):
        feeds.append((layer_name, plan.tensor_name))
        return real_feed(plan, layer_name, *args)

    monkeypatch.setattr(log_tensor_stats.InspectPlan, "feed", feed)
    sink = RecordingSink()
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation", "gradient"]}})
    layer = Linear(4, 2, name="lin")
    xs = [torch.tensor([[1.0, -2.0, 3.0, 0.5]]) * (i + 1) for i in range(3)]
    with debug_session(config, tmp_path, sink):
        for x in xs:
            layer(x).sum().backward()
            debug_api.step()
        log = (tmp_path / "nvdlfw_inspect_logs").glob("*.log")
    assert feeds == [("lin", "activation"), ("lin", "gradient")] * 3
    lines = [
        line for path in log for line in path.read_text().splitlines() if "API=look_at_tensor_before_process" in line
    ]
    assert [line.split(" - ", 2)[2] for line in lines] == [
        "LAYER=lin: Feature=LogTensorStats, API=look_at_tensor_before_process: activation",
        "LAYER=lin: Feature=LogTensorStats, API=look_at_tensor_before_process: gradient",
    ]
    assert {k: v for k, v in sink.values().items() if k[0] == "lin_activation_max"} == {
        ("lin_activation_max", i): 3.0 * (i + 1) for i in range(3)
    }


ALL_TENSORS = ["activation", "weight", "output", "gradient", "dgrad", "wgrad"]


def _counting(monkeypatch, owner, name, calls):
    real = getattr(owner, name)

    def counted(self, *args, **kwargs):
        calls.append(name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def test_inspect_only_gemm_call_feeds_through_the_bound_call(tmp_path, monkeypatch):
    """A logged high-precision Linear (every tensor inspect-only): each of its six tensors is one `InspectPlan.feed`,
    in the layer's order (x, W, y in the forward; dy, dx, dW in the backward), reached without
    `DebugQuantizer._inspect` or `InspectCall.__call__`; the statistics are the tensors'."""
    calls, feeds = [], []
    _counting(monkeypatch, DebugQuantizer, "_inspect", calls)
    _counting(monkeypatch, InspectCall, "__call__", calls)
    real_feed = log_tensor_stats.InspectPlan.feed

    def feed(plan, layer_name, *args):
        feeds.append(plan.tensor_name)
        return real_feed(plan, layer_name, *args)

    monkeypatch.setattr(log_tensor_stats.InspectPlan, "feed", feed)
    sink = RecordingSink()
    layer = Linear(3, 2, bias=False, name="lin")
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, -4.0]]))
    x = torch.tensor([[1.0, 2.0, -1.0], [0.5, -3.0, 2.0]], requires_grad=True)  # (so that dx is computed)
    with debug_session(
        section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ALL_TENSORS}}), tmp_path, sink
    ):
        for _ in range(2):
            layer(x).sum().backward()
            debug_api.step()
    assert calls == []
    assert feeds == ["activation", "weight", "output", "gradient", "dgrad", "wgrad"] * 2
    w, x = layer.weight.detach(), x.detach()
    expected = {  # the loss is y.sum(): dy is all ones, dx = dy·W, dW = dyᵀ·x
        "activation": x.max(),
        "weight": w.max(),
        "output": (x @ w.t()).max(),
        "gradient": 1.0,
        "dgrad": w.sum(0).max(),
        "wgrad": x.sum(0).max(),
    }
    assert sink.values() == {(f"lin_{t}_max", i): float(v) for t, v in expected.items() for i in range(2)}


def test_inspect_group_follows_an_override_of_inspect_tensor(tmp_path):
    """Once bound, the group's calls still check the namespace: a hook set on the instance afterwards sees every
    logged tensor of the next GEMM calls (then the features again once it is removed)."""
    seen = []
    layer = Linear(3, 2, name="lin")
    x = torch.randn(4, 3, requires_grad=True)
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ALL_TENSORS}})
    with debug_session(config, tmp_path) as api:
        layer(x).sum().backward()  # every call bound
        debug_api.step()
        real = api.inspect_tensor

        def inspect_tensor(layer_name, **kwargs):
            seen.append(kwargs["tensor_name"])
            return real(layer_name, **kwargs)

        y = layer(x)  # the forward's calls bound before the hook is set; the backward's quantizers are the same
        api.inspect_tensor = inspect_tensor
        y.sum().backward()
        debug_api.step()
        layer(x).sum().backward()  # (new plans: the namespace's hook from the start)
        debug_api.step()
        del api.inspect_tensor
        layer(x).sum().backward()
        debug_api.step()
    assert seen == ["gradient", "dgrad", "wgrad"] + ["activation", "weight", "output", "gradient", "dgrad", "wgrad"]


def test_inspect_group_hands_other_quantizers_to_inspect_and_skips_absent_tensors(tmp_path, monkeypatch):
    """A quantizer that is not inspect-only (it has a parent that quantizes) is inspected by its own `_inspect`
    with the entry's operands; an entry whose tensor is None (a gradient autograd did not compute) or whose
    quantizer does not inspect this iteration is left out."""
    inspected = []
    real = DebugQuantizer._inspect

    def _inspect(q, tensor, rowwise, columnwise):
        inspected.append((q.tensor_name, tensor, rowwise, columnwise))
        return real(q, tensor, rowwise, columnwise)

    monkeypatch.setattr(DebugQuantizer, "_inspect", _inspect)
    sink = RecordingSink()
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation", "weight"]}})
    with debug_session(config, tmp_path, sink):
        quantized = DebugQuantizer("L", "activation", Float8CurrentScalingQuantizer("E4M3"), None)
        plain = DebugQuantizer("L", "weight", None, None)
        silent = DebugQuantizer("L", "gradient", None, None)  # not logged
        assert not quantized.inspect_only and plain.inspect_only and not silent.inspect_tensor_enabled
        silent.plan.inspect.target = lambda *args: inspected.append("the silent quantizer's bound call")
        a, b, c = torch.ones(2, 2), torch.full((2, 2), 2.0), torch.full((2, 2), 5.0)
        # (a weight keeps its first feed of a step: the weight's row is b's only if the None entry fed nothing)
        inspect_group(((quantized, a, "row", "col"), (plain, None, c, c), (silent, c, c, c), (plain, b, b, b)))
        debug_api.step()
    assert len(inspected) == 1 and inspected[0][0] == "activation"
    assert inspected[0][1] is a and inspected[0][2:] == ("row", "col")
    assert sink.values() == {("L_activation_max", 0): 1.0, ("L_weight_max", 0): 2.0}
