"""A GEMM call whose debug quantizers only inspect (high precision, no modification) runs torch's own linear with
the backward tensors inspected by a hook on its autograd node (`tedebug.nn.base._inspected_linear`).  It must log
exactly what the generic path (`_LinearFunction`, forced here by marking the device as not taking the short path)
logs - the same text log, byte for byte, the same values in the same order - and train the same numbers.  Each
test runs with the compiled linear (kernels/inspected_linear.cpp) and with the Python path (`inspected_linear`)."""

from __future__ import annotations

import contextlib
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tedebug import debug_api
from tedebug.nn import LayerNormLinear, LayerNormMLP, Linear
from tedebug.nn import base as nn_base

from support.compile import compiled_backward
from support.features import RecordingSink, debug_session, section

STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
TENSORS = ["activation", "weight", "output", "gradient", "wgrad", "dgrad"]
LOG_STATS = section({"LogTensorStats": {"enabled": True, "stats": STATS, "tensors": TENSORS, "freq": 1}})


class Stack(torch.nn.Module):
    """Every tedebug linear layer kind, with and without bias, on a 3-D input; `checkpointed`: the MLP under
    torch.utils.checkpoint (None: not checkpointed; "reentrant" or "non_reentrant")."""

    def __init__(self, dim: int = 32, checkpointed=None) -> None:
        super().__init__()
        self.qkv = LayerNormLinear(dim, 3 * dim, name="qkv")
        self.proj = Linear(3 * dim, dim, bias=False, name="proj")
        self.mlp = LayerNormMLP(dim, 2 * dim, name="mlp")
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(F.gelu(self.qkv(x)))
        if self.checkpointed is None:
            return x + self.mlp(x)
        return x + checkpoint(self.mlp, x, use_reentrant=self.checkpointed == "reentrant")


#: the compiled linear's calls that ran it (not handed back to the Python path), by the test's `_paths`
COMPILED_RUNS: list = []


@contextlib.contextmanager
def _paths(short: bool, device: str = "cpu"):
    """Yield a list that gets one entry per `_LinearFunction` call; `short=False` marks `device` as not taking the
    inspection-only path, so that every call goes through `_LinearFunction`.  `COMPILED_RUNS` gets one entry per
    call the compiled linear ran."""
    calls: list = []
    generic_apply = nn_base._LinearFunction.apply
    saved = dict(nn_base._FAST_DEVICES)
    if not short:
        nn_base._FAST_DEVICES[device] = False
    nn_base._LinearFunction.apply = lambda *a: calls.append(1) or generic_apply(*a)
    linear_function = nn_base.compiled_linear.linear_function

    def counted():
        compiled = linear_function()
        if compiled is None:
            return None

        def run(*args):
            done = compiled(*args)
            if done is not None:
                COMPILED_RUNS.append(1)
            return done

        return run

    nn_base.compiled_linear.linear_function = counted
    COMPILED_RUNS.clear()
    try:
        yield calls
    finally:
        nn_base._LinearFunction.apply = generic_apply
        nn_base.compiled_linear.linear_function = linear_function
        nn_base._FAST_DEVICES.clear()
        nn_base._FAST_DEVICES.update(saved)


def _train(tmp_path: pathlib.Path, *, short: bool, device: str = "cpu", dtype=torch.float32, steps: int = 3, **kw):
    """Train `Stack` under LogTensorStats; (text log without time stamps, sink values in emission order, losses,
    parameters, the number of `_LinearFunction` calls).  `short=False` sends every call through `_LinearFunction`."""
    torch.manual_seed(0)
    model = Stack(**kw).to(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(2, 8, 32, generator=g).to(device, dtype) for _ in range(steps)]
    if kw.get("checkpointed") == "reentrant":
        data = [x.requires_grad_(True) for x in data]
    sink = RecordingSink()
    log_dir = tmp_path / ("short" if short else "generic")
    losses = []
    with _paths(short, device) as applied:
        with debug_session(LOG_STATS, log_dir, sink=sink, default_logging_enabled=True):
            for x in data:
                loss = model(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
                debug_api.step()
    text = (log_dir / "nvdlfw_inspect_statistics_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    text = re.sub(r"(?m)^[0-9-]+ [0-9:,]+ - ", "", text)  # the lines without their time stamps
    params = [p.detach().clone() for p in model.parameters()]
    return text, sink.rows, torch.stack(losses), params, len(applied), len(COMPILED_RUNS)


def _assert_same(short, generic, mode: str) -> None:
    text, rows, losses, params, applied, compiled = short
    g_text, g_rows, g_losses, g_params, g_applied, g_compiled = generic
    assert applied == 0 and g_applied > 0  # each run took the path it was meant to
    assert (compiled > 0) == (mode == "compiled") and g_compiled == 0
    assert text == g_text
    assert rows == g_rows
    assert torch.equal(losses, g_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, g_params))


def test_short_path_logs_and_trains_what_the_generic_path_does(tmp_path, inspected_linear):
    short = _train(tmp_path, short=True)
    _assert_same(short, _train(tmp_path, short=False), inspected_linear)
    text, rows = short[0], short[1]
    names = {name for name, _, _ in rows}
    for gemm in ("qkv", "proj", "mlp.fc1", "mlp.fc2"):  # every tensor of every GEMM, the backward ones included
        for tensor in TENSORS:
            assert f"{gemm}_{tensor}_l1_norm" in names
    assert "proj_wgrad_max" in text


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_short_path_logs_once_what_the_generic_path_does(tmp_path, mode, inspected_linear):
    """The recompute runs the same linear without inspecting again; the backward tensors are inspected once, by the
    node of whichever graph the backward runs through."""
    short = _train(tmp_path, short=True, checkpointed=mode)
    _assert_same(short, _train(tmp_path, short=False, checkpointed=mode), inspected_linear)
    plain = _train(tmp_path / "plain", short=True)
    assert short[1] == plain[1]  # the checkpointed run logs what the plain one logs


def _one_layer(tmp_path: pathlib.Path, *, short: bool, x_grad: bool, w_grad: bool, compiled_autograd: bool = False):
    """One `Linear` under LogTensorStats whose input / weight may take no gradient: the rows logged
    (`compiled_autograd`: the backward under torch._dynamo's compiled autograd)."""
    torch.manual_seed(0)
    layer = Linear(32, 16, name="fc")
    layer.weight.requires_grad_(w_grad)
    x = torch.randn(4, 32, requires_grad=x_grad)
    sink = RecordingSink()
    with _paths(short), debug_session(LOG_STATS, tmp_path / str(short), sink=sink):
        loss = layer(x).sum()
        with compiled_backward() if compiled_autograd else contextlib.nullcontext():
            loss.backward()
        debug_api.step()
    return sink.rows


def test_compiled_autograd_logs_what_the_generic_path_does(tmp_path, monkeypatch, inspected_linear):
    """Compiled autograd calls no C++ hook: it asks each hook for a Python callable to call instead.  The compiled
    linear's hook answers the Python path's hook, so such a backward logs the backward tensors too, the same values
    as the generic path without compiled autograd (before, the compiled hook's refusal ended the backward).  On
    both paths the hook runs untraced: Dynamo never follows the backward inspection (before, it traced the Python
    path's hook through the statistics engine until its recompile limit)."""
    traced = []
    real = nn_base._inspect_backward

    def recording(*args):
        traced.append(torch.compiler.is_compiling())
        return real(*args)

    monkeypatch.setattr(nn_base, "_inspect_backward", recording)
    rows = _one_layer(tmp_path, short=True, x_grad=True, w_grad=True, compiled_autograd=True)
    assert traced and not any(traced)
    assert (len(COMPILED_RUNS) > 0) == (inspected_linear == "compiled")
    assert rows == _one_layer(tmp_path, short=False, x_grad=True, w_grad=True)
    assert {"fc_gradient_max", "fc_dgrad_max", "fc_wgrad_max"} <= {name for name, _, _ in rows}


@pytest.mark.parametrize("x_grad, w_grad", [(False, True), (True, False), (False, False)])
def test_a_tensor_without_gradient_has_no_backward_statistics(tmp_path, x_grad, w_grad, inspected_linear):
    """No dgrad where the input takes no gradient, no wgrad where the weight takes none (the node's output is
    None), and no gradient either where neither does (only the bias does): as on the generic path."""
    rows = _one_layer(tmp_path, short=True, x_grad=x_grad, w_grad=w_grad)
    assert rows == _one_layer(tmp_path, short=False, x_grad=x_grad, w_grad=w_grad)
    names = {name for name, _, _ in rows}
    assert ("fc_dgrad_max" in names) == x_grad
    assert ("fc_wgrad_max" in names) == w_grad
    assert ("fc_gradient_max" in names) == (x_grad or w_grad)
    assert "fc_output_max" in names


def test_an_unexpected_autograd_node_falls_back_to_the_generic_path(tmp_path, monkeypatch):
    """Where a 2-D linear records a node the hook cannot read, the call is redone on the generic path and the
    device takes it from then on; nothing logged changes.  (The Python path's table of nodes is emptied; the
    compiled linear has its own, which a test cannot empty: it answers None for another node, and the Python path
    then runs this very branch.)"""
    monkeypatch.setenv(nn_base.compiled_linear.ENV_VAR, "python")
    monkeypatch.setattr(nn_base, "_LINEAR_NODES", {})
    monkeypatch.setattr(nn_base, "_NODE_POSITIONS", {})
    text, rows, losses, params, applied, _ = _train(tmp_path, short=True)
    assert applied > 0 and nn_base._FAST_DEVICES["cpu"] is True  # (restored by _train)
    g_text, g_rows, g_losses, g_params, _, _ = _train(tmp_path, short=False)
    assert (text, rows) == (g_text, g_rows)
    assert torch.equal(losses, g_losses)


def test_a_modifying_feature_keeps_the_generic_path(tmp_path):
    """FakeQuant modifies the activation: that call is not inspect-only and goes through `_LinearFunction`."""
    cfg = section(
        {"FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"], "quant_format": "FP8E4M3"}}
    )
    layer = Linear(32, 16, name="fc")
    with _paths(True) as calls, debug_session(cfg, tmp_path):
        layer(torch.randn(4, 32)).sum().backward()
        debug_api.step()
    assert calls == [1]


def _calls_of(tmp_path: pathlib.Path, layer: torch.nn.Module, x: torch.Tensor):
    """(`_LinearFunction` calls, rows logged) of one step of `layer` under LogTensorStats."""
    sink = RecordingSink()
    with _paths(True) as calls, debug_session(LOG_STATS, tmp_path, sink=sink):
        layer(x).square().sum().backward()
        debug_api.step()
    return len(calls), sink.rows


def test_a_column_major_weight_or_input_keeps_the_generic_path(tmp_path, inspected_linear):
    """torch's backward computes the gradient of a column-major operand as another GEMM (``xᵀ·dy`` for Conv1D's
    ``[in, out]`` weight), whose bits may differ from `_LinearFunction`'s: such calls keep `_LinearFunction`."""
    from tedebug.nn.hf import Conv1DLinear

    torch.manual_seed(0)
    conv = Conv1DLinear(24, 32, name="conv")  # weight [32, 24] = [in, out]: the GEMM's W is its transpose
    calls, rows = _calls_of(tmp_path / "conv", conv, torch.randn(2, 5, 32, requires_grad=True))
    assert calls == 1 and any(name == "conv_wgrad_max" for name, _, _ in rows)
    layer = Linear(32, 16, name="fc")
    transposed = torch.randn(32, 6).t().requires_grad_(True)  # [6, 32], column-major
    calls, rows = _calls_of(tmp_path / "fc", layer, transposed)
    assert calls == 1 and any(name == "fc_dgrad_max" for name, _, _ in rows)
    assert _calls_of(tmp_path / "fc2", layer, transposed.detach().contiguous())[0] == 0


@pytest.mark.gpu
def test_short_path_logs_what_the_generic_path_does_on_the_gpu(tmp_path, inspected_linear):
    """On CUDA the statistics kernels read each tensor in memory order: the hook's dW (the gradient of Wᵀ, transposed
    back) and dy must be laid out as `_LinearFunction`'s for the sums to come out in the same order."""
    kw = dict(device="cuda", dtype=torch.bfloat16)
    _assert_same(_train(tmp_path, short=True, **kw), _train(tmp_path, short=False, **kw), inspected_linear)
