"""A CPU feed whose statistics are read on the host keeps its row as Python floats (`StatBuffer.host_row`): it emits
exactly what the per-partial torch path emits (one feed, microbatches merged, a weight's first feed, a buffer fed
from both paths in one step), builds no tensor besides the statistics' own two sums, and the small-tensor pass of
`torch_ref` raises no numpy floating-point warning on any float dtype (NaN, infinities, float64 overflow)."""

from __future__ import annotations

import math
import types
import warnings

import numpy as np
import pytest
import torch

from tedebug.backends import torch_ref
from tedebug.stats import StatsEngine
from tedebug.stats import engine as engine_module
from support.concurrency import AtenCounter

STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range", "nan_count", "inf_count")


class _Capture:
    def __init__(self):
        self.records = []

    def log_scalar(self, name, value, iteration, **kw):
        self.records.append((name, value, iteration))


def _bits(value):
    return ("nan",) if math.isnan(value) else (value, math.copysign(1.0, value))


#: the reference backend without its host values: every partial is a 0-d tensor and the row one stacked tensor
_PER_PARTIAL = types.SimpleNamespace(basic_partials=torch_ref.basic_partials)


def _emitted(monkeypatch, feeds, *, per_partial, is_weight=False, steps=1):
    """{(name, step): value bits} emitted for `feeds` (a list of (layer, tensor) per step)."""
    with monkeypatch.context() as patch:
        if per_partial:
            patch.setattr(engine_module, "backend_for", lambda x, kernel=None: _PER_PARTIAL)
        log = _Capture()
        engine = StatsEngine(log)
        for step in range(steps):
            for layer, x in feeds:
                engine.feed(
                    layer, "weight" if is_weight else "activation", STATS, x, iteration=step, is_weight=is_weight
                )
            engine.step(step)
    return {(name, iteration): _bits(value) for name, value, iteration in log.records}


def _tensors():
    g = torch.Generator().manual_seed(21)
    x = torch.randn(8, 32, generator=g) * 3
    x[0, :4] = 0.0
    x[1, 0] = -0.0
    nonfinite = torch.randn(4, 8, generator=g)
    nonfinite[0, 0], nonfinite[2, 3] = float("nan"), float("inf")
    return [
        ("a", x),
        ("b", torch.relu(torch.randn(32, 32, generator=g))),
        ("c", nonfinite.to(torch.bfloat16)),
        ("d", (torch.randn(5, 7, generator=g) * 1e200).double()),
    ]


def test_host_rows_emit_the_per_partial_values(monkeypatch):
    feeds = _tensors()
    expected = _emitted(monkeypatch, feeds, per_partial=True, steps=2)
    assert len(expected) == 2 * len(feeds) * len(STATS)
    assert _emitted(monkeypatch, feeds, per_partial=False, steps=2) == expected


def test_microbatches_merge_as_tensor_rows(monkeypatch):
    """Three feeds of one buffer in a step: the host row is merged with the exact combiners."""
    g = torch.Generator().manual_seed(22)
    feeds = [("m", torch.randn(8, 32, generator=g) + i) for i in range(3)]
    expected = _emitted(monkeypatch, feeds, per_partial=True)
    assert _emitted(monkeypatch, feeds, per_partial=False) == expected
    whole = torch.cat([x for _, x in feeds])
    assert expected[("m_activation_max", 0)] == _bits(whole.max().item())
    assert expected[("m_activation_std", 0)][0] == pytest.approx(whole.double().std().item(), rel=1e-12)


def test_weight_keeps_its_first_host_row(monkeypatch):
    g = torch.Generator().manual_seed(23)
    first, second = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g) * 9
    emitted = _emitted(monkeypatch, [("w", first), ("w", second)], per_partial=False, is_weight=True)
    assert emitted == _emitted(monkeypatch, [("w", first)], per_partial=True, is_weight=True)
    assert emitted[("w_weight_max", 0)] == _bits(first.max().item())


def test_host_row_then_tensor_row_in_one_step(monkeypatch):
    """A buffer fed first through the host values, then through a backend giving tensor rows (as a CUDA feed would)
    in the same step, emits what two tensor-row feeds emit."""
    g = torch.Generator().manual_seed(24)
    a, b = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g) - 2
    expected = _emitted(monkeypatch, [("x", a), ("x", b)], per_partial=True)
    log = _Capture()
    engine = StatsEngine(log)
    engine.feed("x", "activation", STATS, a, iteration=0)
    with monkeypatch.context() as patch:
        patch.setattr(engine_module, "backend_for", lambda x, kernel=None: _PER_PARTIAL)
        engine.feed("x", "activation", STATS, b, iteration=0)
    engine.step(0)
    assert {(name, it): _bits(v) for name, v, it in log.records} == expected


def test_a_cpu_feed_computes_nothing_and_the_step_sums_once_per_shape():
    """No tensor is built for the row: a feed runs no computing operator at all (its tensor is copied into the step's
    staging, `tedebug.stats.host_batch`), and the step's only computing operators are the statistics' sums - the two
    of the per-tensor pass plus Σx² and Σ|x| - run once for all the staged tensors of one shape."""
    engine = StatsEngine(_Capture())
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(25)) + 10.0
    engine.feed("warm", "activation", STATS, x, iteration=0)
    engine.feed("L", "activation", STATS, x, iteration=0)
    engine.step(0)
    ignored = ("view", "detach", "alias", "_local_scalar_dense", "slice", "select", "lift_fresh")  # no computation
    with AtenCounter() as counter:
        engine.feed("L", "activation", STATS, x, iteration=1)
        engine.feed("warm", "activation", STATS, x, iteration=1)
    assert [op for op in counter.ops if op not in ignored] == [], counter.ops
    with AtenCounter() as counter:
        engine.step(1)
    assert [op for op in counter.ops if op not in ignored] == ["sum"] * 4, counter.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_small_pass_raises_no_numpy_warning(dtype):
    """NaN (with and without zeros), infinities of both signs (a NaN sum and an infinite one), only zeros and, in
    float64, squares that overflow: the values are the reference's and numpy reports nothing, even with every
    floating-point error set to raise."""
    big = 1e300 if dtype == torch.float64 else 1.0
    cases = [
        torch.tensor([1.0, float("nan"), -2.0, float("inf"), 0.0]),
        torch.tensor([1.0, float("nan"), -2.0]),  # a NaN and no zero
        torch.tensor([0.0, -0.0, 0.0]),  # only zeros
        torch.tensor([1.0, float("inf"), float("-inf"), 3.0]),
        torch.tensor([1.0, float("inf"), 3.0, -0.0]),
        torch.tensor([2.0, -3.0]) * big,
    ]
    old = np.seterr(all="raise")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for x in cases:
                x = x.to(dtype)
                got = torch_ref.basic_partial_values(x)
                reference = torch_ref.basic_partials(x)
                assert [_bits(v) for v in got] == [_bits(reference[k].item()) for k in torch_ref.BASIC_KEYS]
    finally:
        np.seterr(**old)
    assert np.geterr() == old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_small_pass_reads_strided_and_grad_tensors_as_the_reference(dtype):
    """A transposed (non-contiguous) tensor, a slice and a tensor that requires grad give the reference's values,
    signed zero extremes included."""
    g = torch.Generator().manual_seed(26)
    x = torch.randn(12, 20, generator=g)
    x[x.abs() < 0.3] = 0.0
    x[0, 0] = -0.0
    relu = torch.relu(torch.randn(16, 6, generator=g))
    strided = (x.t(), x[:, 3:11], relu.t(), -relu[2:, :].t())
    assert not any(t.is_contiguous() for t in strided)
    for t in strided:
        t = t.to(dtype) if dtype != torch.float32 else t
        reference = torch_ref.basic_partials(t)
        assert [_bits(v) for v in torch_ref.basic_partial_values(t)] == [
            _bits(reference[k].item()) for k in torch_ref.BASIC_KEYS
        ]
    needs_grad = x.to(dtype).requires_grad_() * 1
    reference = torch_ref.basic_partials(x.to(dtype))
    values = torch_ref.basic_partial_values(needs_grad)
    assert [_bits(v) for v in values] == [_bits(reference[k].item()) for k in torch_ref.BASIC_KEYS]
