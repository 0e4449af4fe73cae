"""GEMM calls inside ``torch.func`` transforms (``grad``, ``vmap``, per-sample gradients as in DP-SGD) while a debug
session logs: they compute what they compute without a session and log nothing, with one warning for the session
(their tensors are functorch wrappers without data to read; before, the debug path raised on them), and the
ordinary calls of the same iteration still log."""

from __future__ import annotations

import warnings

import torch

import tedebug
from tedebug import debug_api

from support.features import RecordingSink, debug_session, section

TENSORS = ["activation", "weight", "output", "gradient", "wgrad", "dgrad"]
CONFIG = section({"LogTensorStats": {"enabled": True, "stats": ["max", "l1_norm"], "tensors": TENSORS, "freq": 1}})


def _model():
    torch.manual_seed(0)
    return tedebug.convert_model(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32)))


def _transforms(model, x):
    """grad, vmap and per-sample gradients of the model, through `functional_call`."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p, xi):
        return torch.func.functional_call(model, p, (xi,)).pow(2).sum()

    return (
        torch.func.grad(loss)(params, x),
        torch.func.vmap(lambda xi: torch.func.functional_call(model, params, (xi,)))(x),
        torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x),
    )


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return all(_equal(u, v) for u, v in zip(a, b))
    return torch.equal(a, b)


def test_calls_inside_torch_func_run_as_without_a_session(tmp_path, no_debug_session):
    model = _model()
    x = torch.randn(4, 8, 32)
    expected = _transforms(model, x)
    sink = RecordingSink()
    with debug_session(CONFIG, tmp_path, sink=sink):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = _transforms(model, x)
            assert _transforms(model, x) is not None  # (again: no second warning)
        model(x).sum().backward()  # an ordinary call of the same iteration
        debug_api.step()
    assert _equal(results, expected)
    said = [str(w.message) for w in caught if "torch.func transform" in str(w.message)]
    assert len(said) == 1 and "'0'" in said[0]
    names = {name for name, _, _ in sink.rows}
    logged = {(layer, tensor) for layer in "02" for tensor in TENSORS} - {("0", "dgrad")}  # (x takes no gradient)
    assert names == {f"{layer}_{tensor}_{stat}" for layer, tensor in logged for stat in ("max", "l1_norm")}
    rows = {name: value for name, value, _ in sink.rows}
    assert rows["0_weight_max"] == model[0].weight.max().item()  # the ordinary call's tensors only
    assert rows["0_activation_max"] == x.max().item()


def test_an_idle_iteration_asks_nothing_more(tmp_path, no_debug_session, monkeypatch):
    """The transform is looked for only on a call that would debug: an iteration that logs nothing never asks,
    whether the calls run inside grad, vmap or neither."""
    from tedebug.nn import base

    asked = []
    real = base._functorch_active
    monkeypatch.setattr(base, "_functorch_active", lambda: asked.append(1) or real())
    model = _model()
    x = torch.randn(4, 8, 32)
    idle = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"], "start_step": 5}})
    with debug_session(idle, tmp_path):
        _transforms(model, x)  # (grad, vmap and per-sample gradients)
        model(x).sum().backward()
        debug_api.step()
    assert asked == []
