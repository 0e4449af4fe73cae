"""The host fast paths of the debug hot path keep their promise, pinned by counting calls (never by timing), and
they compute exactly what the paths they replace compute:

- a logged CPU tensor with basic statistics costs one host pass (one row of `torch_ref.basic_partial_rows`, the
  step's batch; `torch_ref.basic_partial_values` for the lone tensor gives the same bits), never the per-partial
  reference (`torch_ref.basic_partials`);
- a converted model in high precision with no debug path runs torch's own linear: no Python autograd function,
  the same outputs and gradients as the plain torch model; with a debug path or a recipe it takes the tedebug path.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.backends import torch_ref
from tedebug.nn import base as nn_base
from tedebug.recipe import Float8CurrentScaling

from support.features import RecordingSink, debug_session, section

STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range", "nan_count", "inf_count"]
TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]


def _bits(values):
    """Values as comparable keys: NaN as one marker, the sign of a zero kept."""
    return [("nan",) if math.isnan(v) else (v, math.copysign(1.0, v)) for v in values]


def _reference(x):
    partials = torch_ref.basic_partials(x)
    return [partials[key].item() for key in torch_ref.BASIC_KEYS]


def _cases():
    g = torch.Generator().manual_seed(14)
    yield torch.tensor([0.0, -0.0, 1.0, float("nan")])
    yield torch.tensor([0.0, -0.0, -1.0, float("inf")])
    yield torch.tensor([-0.0, 0.0] * 9)
    yield torch.tensor([0.0, -0.0] * 9)
    yield -torch.zeros(7)
    yield torch.zeros(5)
    yield torch.tensor([2.5])
    yield torch.tensor([1e308, 1e308, -1e308], dtype=torch.float64)  # finite values, overflowing float64 sum
    yield torch.tensor([float("-inf"), float("inf"), 3.0])
    for i in range(60):
        n = (1, 3, 8, 17, 64, 256, 1000, 4096)[i % 8]
        dtype = (torch.float32, torch.bfloat16, torch.float16, torch.float64)[i % 4]
        x = torch.randn(n, generator=g).to(dtype)
        mask = torch.rand(n, generator=g)
        x[mask < 0.2] = 0.0
        x[mask > 0.9] = -0.0
        if i % 7 == 0:
            x[(i * 5) % n] = float("nan")
        if i % 11 == 0:
            x[(i * 3) % n] = float("-inf")
        yield x.reshape(-1, 1) if i % 3 == 0 else x


@pytest.mark.parametrize("x", list(_cases()), ids=lambda x: f"{str(x.dtype)[6:]}-{x.numel()}")
def test_host_values_equal_the_reference_partials_bit_for_bit(x):
    """min / max in the input dtype (with the sign of a zero), sums, counts: every value is the reference's."""
    values = torch_ref.basic_partial_values(x)
    assert _bits(values) == _bits(_reference(x))
    row = torch_ref.basic_partials_row(x)
    assert row.dtype == torch.float64 and _bits(row.tolist()) == _bits(_reference(x))


def test_overflowing_sum_still_counts_no_nonfinite_element():
    """The shortcut "finite sum: no NaN, no infinity" is not taken for a float64 sum that overflows: the counts
    are taken from the elements (0 here), and amax is the largest magnitude."""
    values = dict(
        zip(
            torch_ref.BASIC_KEYS,
            torch_ref.basic_partial_values(torch.tensor([1e308, 1e308, -1e308], dtype=torch.float64)),
        )
    )
    assert values["sum"] == math.inf and values["nan_count"] == 0.0 and values["inf_count"] == 0.0
    assert values["amax"] == 1e308 and values["nz_abs_min"] == 1e308 and values["nonzero_count"] == 3.0


class _RowCounter:
    """Counts the rows (tensors) reduced by `torch_ref.basic_partial_rows`, the step's batch of host passes."""

    def __init__(self, monkeypatch):
        self.rows = 0
        real = torch_ref.basic_partial_rows

        def counting(values, dtype):
            self.rows += values.shape[0]
            return real(values, dtype)

        monkeypatch.setattr(torch_ref, "basic_partial_rows", counting)


class _Counter:
    def __init__(self, monkeypatch, owner, name):
        self.calls = 0
        real = getattr(owner, name)

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _train_step(model, x, recipe=None):
    with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    y.square().mean().backward()
    return y


def test_logged_cpu_tensor_takes_one_host_pass(monkeypatch, tmp_path):
    """Two layers x six tensors (but the first layer's dgrad: its input needs no gradient) logged for three
    iterations: 33 host passes (rows of the step's batch, no lone pass), no per-partial reference call, and the
    logged values are the reference formulas of the tensors (checked for the activation of the first layer)."""
    host = _RowCounter(monkeypatch)
    lone = _Counter(monkeypatch, torch_ref, "basic_partial_values")
    per_partial = _Counter(monkeypatch, torch_ref, "basic_partials")
    model = tedebug.convert_model(_model())
    x = torch.randn(4, 16)
    sink = RecordingSink()
    cfg = section({"LogTensorStats": {"enabled": True, "stats": STATS, "tensors": TENSORS, "freq": 1}})
    with debug_session(cfg, tmp_path, sink=sink):
        for _ in range(3):
            _train_step(model, x)
            debug_api.step()
    assert host.rows == (2 * 6 - 1) * 3
    assert lone.calls == 0
    assert per_partial.calls == 0
    values = sink.values()
    x64 = x.double()
    assert values[("0_activation_min", 0)] == x.min().item()
    assert values[("0_activation_max", 2)] == x.max().item()
    assert values[("0_activation_l1_norm", 1)] == x64.abs().sum().item()
    assert values[("0_activation_std", 0)] == pytest.approx(x64.std().item(), rel=1e-12)
    assert values[("0_activation_nan_count", 0)] == 0.0


def test_converted_model_without_debug_runs_torchs_linear(monkeypatch):
    """High precision, no debug_api: no `_LinearFunction` call, outputs and gradients equal the plain model's."""
    applied = _Counter(monkeypatch, nn_base._LinearFunction, "apply")
    plain = _model()
    converted = tedebug.convert_model(copy.deepcopy(plain))
    x = torch.randn(2, 5, 16)
    y_plain, y_conv = _train_step(plain, x), _train_step(converted, x)
    assert applied.calls == 0
    assert torch.equal(y_plain, y_conv)
    for p, c in zip(plain.parameters(), converted.parameters()):
        assert torch.equal(p.grad, c.grad)


def test_recipe_or_debug_path_takes_the_tedebug_path(monkeypatch, tmp_path):
    """A recipe goes through `_LinearFunction`, a debug path in high precision that only inspects (LogTensorStats
    on) through `_inspected_linear` (once per linear layer and call); an initialised session whose features are
    not active this iteration takes neither."""
    applied = _Counter(monkeypatch, nn_base._LinearFunction, "apply")
    inspected = _Counter(monkeypatch, nn_base, "_inspected_linear")
    model = tedebug.convert_model(_model())
    x = torch.randn(3, 16)
    _train_step(model, x, Float8CurrentScaling())
    assert (applied.calls, inspected.calls) == (2, 0)
    cfg = section(
        {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": TENSORS, "start_step": 1, "end_step": 1}}
    )
    with debug_session(cfg, tmp_path, sink=RecordingSink()):
        _train_step(model, x)  # iteration 0: nothing active
        assert (applied.calls, inspected.calls) == (2, 0)
        debug_api.step()
        _train_step(model, x)  # iteration 1: logged
        assert (applied.calls, inspected.calls) == (2, 2)
        debug_api.step()
        _train_step(model, x)  # iteration 2: never again
        assert (applied.calls, inspected.calls) == (2, 2)
