"""StatsEngine on one process: every statistic against float64 oracles, the "two feeds == concatenation"
property for every statistic, buffering rules (weights, iterations, options, empty tensors), TransformerEngine's
numerics oracles, quantized statistics on real quantizers, the first-non-finite report and the single readback."""

import logging
import math

import pytest
import torch

from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from tedebug.quantization.mxfp8 import MXFP8Quantizer
from tedebug.stats import HP_KINDS, StatRequest, StatsEngine


class Capture:
    def __init__(self):
        self.records = []
        self.flushes = 0

    def log_scalar(self, name, value, iteration, **kw):
        self.records.append((name, value, iteration, kw))

    def flush(self):
        self.flushes += 1

    def values(self):
        return {name: value for name, value, _, _ in self.records}


def run(feeds, stats, *, tensor_name="activation", quantized_for=None, **kw):
    """Feed each tensor of `feeds` into one buffer, step, and return {stat name: value}."""
    log = Capture()
    engine = StatsEngine(log)
    for x in feeds:
        quantized = quantized_for(x) if quantized_for else None
        engine.feed("L", tensor_name, stats, x, iteration=7, quantized=quantized, **kw)
    engine.step(7)
    return {name[len(f"L_{tensor_name}_") :]: v for name, v in log.values().items()}


def random_tensor(dtype, shape=(64, 48), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3 + 0.5
    x[x.abs() < 0.1] = 0.0
    x[0, :5] = -0.0
    return x.to(dtype)


def oracle(kind, x):
    d = x.double().reshape(-1)
    if kind == "min":
        return d.min().item()
    if kind == "max":
        return d.max().item()
    if kind == "mean":
        return d.mean().item()
    if kind == "std":
        return d.std().item()
    if kind == "l1_norm":
        return d.abs().sum().item()
    if kind == "l2_norm":
        return torch.linalg.vector_norm(d).item()
    if kind == "cur_amax":
        return d.abs().max().item()
    if kind == "dynamic_range":
        nz = [abs(v) for v in d.tolist() if v != 0]
        return math.log2(max(nz)) - math.log2(min(nz))
    if kind == "nan_count":
        return float(sum(1 for v in d.tolist() if v != v))
    if kind == "inf_count":
        return float(sum(1 for v in d.tolist() if v in (math.inf, -math.inf)))
    raise AssertionError(kind)


EXACT = {"min", "max", "cur_amax", "nan_count", "inf_count"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_hp_stat_vs_float64_oracle(dtype):
    x = random_tensor(dtype)
    got = run([x], list(HP_KINDS))
    assert set(got) == set(HP_KINDS)
    for kind in HP_KINDS:
        assert isinstance(got[kind], float), kind
        if kind in EXACT:
            assert got[kind] == oracle(kind, x), kind
        else:
            assert got[kind] == pytest.approx(oracle(kind, x), rel=1e-12), kind


def test_nonfinite_counts_and_report():
    x = torch.ones(4, 8)
    x[0, 0] = float("nan")
    x[1, 1:4] = float("inf")
    x[2, 0] = -float("inf")
    log, messages = Capture(), []
    engine = StatsEngine(log, log_message=lambda msg, **kw: messages.append((msg, kw)))
    engine.feed("dec.3", "gradient", ["nan_count", "inf_count", "min"], x, iteration=12)
    engine.step(12)
    vals = log.values()
    assert vals["dec.3_gradient_nan_count"] == 1.0 and vals["dec.3_gradient_inf_count"] == 4.0
    assert math.isnan(vals["dec.3_gradient_min"])
    assert messages == [
        (
            "First non-finite values: layer=dec.3 tensor=gradient gemm=dgrad/wgrad iteration=12 nan_count=1 "
            "inf_count=4",
            {"layer_name": "dec.3", "level": logging.WARNING},
        )
    ]
    # only the first time in the session, even for another buffer; and not for a finite buffer
    engine.feed("dec.4", "activation", ["max"], x, iteration=13)
    engine.step(13)
    assert len(messages) == 1
    engine.reset()
    engine.feed("dec.4", "activation", ["max"], torch.ones(2), iteration=14)
    engine.step(14)
    assert len(messages) == 1
    engine.feed("dec.4", "activation", ["max"], x, iteration=15)  # report kept for basic stats not requested
    engine.step(15)
    assert len(messages) == 2
    assert "layer=dec.4 tensor=activation gemm=fprop/wgrad iteration=15 nan_count=1" in messages[1][0]


def test_a_count_that_is_not_a_number_is_reported_not_raised(monkeypatch):
    """A row whose NaN count is itself NaN (a row no kernel wrote properly) gives the message with that value; the
    step goes on and emits the row (a slab row, written by the stand-in backend with a corrupted count)."""
    from support.slab_backend import slab_backend

    from tedebug.backends import torch_ref
    from tedebug.stats import engine as engine_module

    real = torch_ref.basic_partials

    def corrupted(x):
        partials = dict(real(x))
        partials["nan_count"] = torch.tensor(float("nan"), dtype=torch.float64)
        return partials

    backend = slab_backend()
    monkeypatch.setattr(engine_module, "backend_for", lambda x: backend)
    monkeypatch.setattr(torch_ref, "basic_partials", corrupted)
    log, messages = Capture(), []
    engine = StatsEngine(log, log_message=lambda msg, **kw: messages.append((msg, kw)))
    engine.feed("dec.3", "gradient", ["nan_count", "inf_count", "max"], torch.ones(64, 64), iteration=5)
    engine.step(5)
    assert [m for m, _ in messages] == [
        "First non-finite values: layer=dec.3 tensor=gradient gemm=dgrad/wgrad iteration=5 nan_count=nan inf_count=0"
    ]
    assert log.values()["dec.3_gradient_max"] == 1.0


# ------------------------------------------------------------------------------------------------ concatenation
BLOCKWISE = [StatRequest.blockwise(4, 1, True), StatRequest.blockwise(4, 2, False), StatRequest.blockwise(8, 1, False)]
MX_QUANTIZED = [
    StatRequest(f"mxfp8_{kind}{suffix}", kind, recipe="mxfp8", columnwise=bool(suffix))
    for kind in ("underflows%", "mse", "scale_inv_min", "scale_inv_max", "scale_inv_std")
    for suffix in ("", "_columnwise")
]
OVERFLOW = StatRequest("overflows%", "overflows%")


def _mx(x):
    return {"mxfp8": MXFP8Quantizer("E4M3").quantize(x)}


def _delayed(x):
    q = Float8Quantizer(torch.tensor(2.0), torch.zeros(1), "E4M3")  # fixed scale: parts quantize like the whole
    return {"": q.quantize(x)}


ALL_REQUESTS = [StatRequest.parse_hp(k) for k in HP_KINDS] + BLOCKWISE + MX_QUANTIZED + [OVERFLOW]


@pytest.mark.parametrize("request_", ALL_REQUESTS, ids=lambda r: r.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_feeds_equal_concatenation(request_, dtype):
    a = random_tensor(dtype, (32, 64), seed=1) * 40
    b = random_tensor(dtype, (64, 64), seed=2) * 0.01
    b[5, 7] = 500.0  # the global extremes sit in different feeds
    a[3, 3] = -1e-4
    if request_.kind in ("nan_count", "inf_count"):  # non-finite values in both feeds
        a[0, :3] = float("nan")
        b[1, 2:4] = float("inf")
        b[2, 0] = -float("inf")
    if request_.kind == "overflows%":
        quantized_for = _delayed
    elif request_.recipe:
        quantized_for = _mx
    else:
        quantized_for = None
    split = run([a, b], [request_], quantized_for=quantized_for)[request_.name]
    whole = run([torch.cat([a, b])], [request_], quantized_for=quantized_for)[request_.name]
    if request_.kind in ("std", "mean", "l1_norm", "l2_norm", "mse", "scale_inv_std"):
        assert split == pytest.approx(whole, rel=1e-12)
    else:
        assert split == whole
    if request_.kind in ("overflows%", "nan_count", "inf_count"):
        assert split > 0  # the test exercises real overflows / non-finite values


def test_std_catastrophic_cancellation():
    g = torch.Generator().manual_seed(3)
    a = 1e6 + 1e-3 * torch.randn(1000, generator=g, dtype=torch.float64)
    b = 1e6 + 2e-3 + 1e-3 * torch.randn(3000, generator=g, dtype=torch.float64)
    whole = torch.cat([a, b])
    expected = whole.std().item()
    got = run([a, b], ["std", "mean"])
    # float64 limit of the (n, sum, M2) partials: the feed means carry ulp(1e6) ~ 1.2e-10 against a mean gap of
    # 2e-3, i.e. ~1e-7 relative on the between-feed term; the exact value (rational arithmetic) agrees with
    # torch's two-pass float64 std to 1e-14.
    assert got["std"] == pytest.approx(expected, rel=1e-7)
    assert got["mean"] == pytest.approx(whole.mean().item(), rel=1e-15)
    # the textbook one-pass formula fails here, so this check can fail
    n = whole.numel()
    naive = ((whole * whole).sum() - whole.sum() ** 2 / n) / (n - 1)
    assert abs(math.sqrt(abs(naive.item())) - expected) > 1e-2 * expected


# ------------------------------------------------------------------------------------------------ buffering
def test_weight_keeps_first_feed_and_last_iteration():
    log = Capture()
    engine = StatsEngine(log)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([10.0, -20.0])
    engine.feed("L", "weight", ["max", "min"], a, iteration=4, is_weight=True)
    engine.feed("L", "weight", ["max", "min"], b, iteration=5, is_weight=True)
    engine.feed("L", "activation", ["max", "min"], a, iteration=4)
    engine.feed("L", "activation", ["max", "min"], b, iteration=5)
    engine.step(5)
    assert [(n, v, i) for n, v, i, _ in log.records] == [
        ("L_weight_max", 2.0, 5),
        ("L_weight_min", 1.0, 5),
        ("L_activation_max", 10.0, 5),
        ("L_activation_min", -20.0, 5),
    ]
    assert log.records[0][3] == {"layer": "L", "tensor": "weight", "stat": "max"}
    assert log.flushes == 1
    # the next step starts fresh: the weight takes its new first feed
    engine.feed("L", "weight", ["max", "min"], b, iteration=6, is_weight=True)
    engine.step(6)
    assert log.records[-1][:3] == ("L_weight_min", -20.0, 6)


def test_options_separate_buffers_and_empty_tensors_skipped():
    log = Capture()
    engine = StatsEngine(log)
    engine.feed("L", "activation", ["max"], torch.tensor([1.0]), iteration=1, options=(0, 10, "fp8"))
    engine.feed("L", "activation", ["max"], torch.tensor([5.0]), iteration=1, options=(0, 10))
    engine.feed("L", "activation", ["max"], torch.empty(0, 4), iteration=1, options=(0, 10))
    engine.feed("L", "gradient", ["max"], torch.empty(0), iteration=1)
    engine.step(1)
    assert [v for _, v, _, _ in log.records] == [1.0, 5.0]
    engine.step(2)  # nothing fed: nothing emitted, no flush
    assert len(log.records) == 2 and log.flushes == 1


def test_feed_errors_are_clear():
    engine = StatsEngine(Capture())
    with pytest.raises(ValueError, match=r"stats \['min'\] need the high-precision tensor"):
        engine.feed(
            "L",
            "weight",
            ["min", StatRequest("scale_inv_min", "scale_inv_min")],
            None,
            iteration=0,
            quantized=_mx(torch.ones(32, 32)),
        )
    with pytest.raises(ValueError, match="no quantized tensor for recipe 'mxfp8'"):
        engine.feed("L", "activation", [MX_QUANTIZED[0]], torch.ones(32, 32), iteration=0)
    with pytest.raises(TypeError, match="floating-point"):
        engine.feed("L", "activation", ["min"], torch.ones(3, dtype=torch.int32), iteration=0)
    with pytest.raises(TypeError, match="quantized tensors go in"):
        engine.feed("L", "activation", ["min"], _mx(torch.ones(32, 32))["mxfp8"], iteration=0)
    with pytest.raises(ValueError, match="Statistic median is not supported"):
        engine.feed("L", "activation", ["median"], torch.ones(3), iteration=0)
    with pytest.raises(ValueError, match="layer 'L', tensor 'activation'.*not divisible by block_size 32"):
        engine.feed("L", "activation", [{"max_blockwise_dynamic_range": {}}], torch.ones(3, 5), iteration=0)
    engine.feed("L", "gradient", ["min"], torch.ones(3), iteration=0)
    with pytest.raises(ValueError, match="one buffer must get the same stats every feed"):
        engine.feed("L", "gradient", ["max"], torch.ones(3), iteration=0)


def test_scale_stats_without_hp_tensor():
    x = random_tensor(torch.float32, (64, 64), seed=4)
    q = MXFP8Quantizer("E4M3").quantize(x)
    reqs = [
        StatRequest("scale_inv_min", "scale_inv_min"),
        StatRequest("scale_inv_max_columnwise", "scale_inv_max", columnwise=True),
    ]
    got = run([None], reqs, tensor_name="weight", quantized_for=lambda _: {"": q})
    rs, cs = q.scale_inv_values("rowwise"), q.scale_inv_values("columnwise")
    assert got["scale_inv_min"] == rs[rs != 0].min().item()
    assert got["scale_inv_max_columnwise"] == cs.max().item()


def test_single_readback_and_no_item_calls(monkeypatch):
    """Every fed row reaches the host as one list (one transfer per device), never scalar by scalar."""
    log = Capture()
    engine = StatsEngine(log)
    for i in range(3):
        engine.feed(f"L{i}", "activation", list(HP_KINDS), torch.randn(8, 8), iteration=0)
        engine.feed(f"L{i}", "activation", list(HP_KINDS), torch.randn(8, 8), iteration=0)
    counts = {"tolist": 0, "item": 0}
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(self, *a, **k):
        counts["tolist"] += 1
        return real_tolist(self, *a, **k)

    def item(self):
        counts["item"] += 1
        return real_item(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "item", item)
    engine.step(0)
    assert counts == {"tolist": 1, "item": 0}
    assert len(log.records) == 3 * len(HP_KINDS)


# ------------------------------------------------------------------------------------------------ TE oracles
@pytest.mark.parametrize("tensor_name", ["activation", "weight", "gradient"])
def test_te_log_stats_numerics(tensor_name):
    """Port of TE's test_log_stats_numerics: 1e-10 everywhere, row 0 = 1000, rows 1-3 = 50."""
    eps = 1e-10
    x = torch.zeros(1024, 1024) + eps
    x[0, :] = 1000.0
    x[1:4, :] = 50.0
    stats = [
        "dynamic_range",
        {"max_blockwise_dynamic_range": {"block_size": 4, "dims": 1}},
        {"max_blockwise_dynamic_range": {"block_size": 4, "dims": 2}},
    ]
    got = run([x], stats, tensor_name=tensor_name, is_weight=tensor_name == "weight")
    suffix = "_max_over_orientations" if tensor_name in ("activation", "weight") else ""
    assert set(got) == {
        "dynamic_range",
        f"max_blockwise_dynamic_range_block_size_4_dims_1{suffix}",
        f"max_blockwise_dynamic_range_block_size_4_dims_2{suffix}",
    }
    eps32 = torch.tensor(eps).item()  # the fp32 value actually stored
    assert got["dynamic_range"] == math.log2(1000.0) - math.log2(eps32)
    assert got["dynamic_range"] == pytest.approx(math.log2(1000) - math.log2(eps), abs=1e-4)
    d1 = got[f"max_blockwise_dynamic_range_block_size_4_dims_1{suffix}"]
    assert d1 == (pytest.approx(math.log2(1000) - math.log2(50), abs=1e-12) if suffix else 0.0)
    d2 = got[f"max_blockwise_dynamic_range_block_size_4_dims_2{suffix}"]
    assert d2 == pytest.approx(math.log2(1000) - math.log2(50), abs=1e-12)


def test_dynamic_range_of_all_zero_tensor_is_inf():
    assert run([torch.zeros(4, 4)], ["dynamic_range"])["dynamic_range"] == math.inf
    # a zero feed does not disturb the range of the others (TE would give +inf here)
    got = run([torch.zeros(4, 4), torch.tensor([0.25, -8.0])], ["dynamic_range"])
    assert got["dynamic_range"] == 5.0


@pytest.mark.parametrize(
    "quantizer", [Float8CurrentScalingQuantizer("E4M3"), MXFP8Quantizer("E4M3")], ids=["current", "mxfp8"]
)
def test_te_quantized_stats_numerics(quantizer):
    """Port of TE's test_log_quantized_stats_numerics (1024x1024 with a run of -0.0)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1024, generator=g)
    x[0, 100:200] = -0.0
    x[5, :300] *= 1e-6  # values that underflow under both recipes
    q = quantizer.quantize(x)
    reqs = [
        StatRequest("underflows%", "underflows%"),
        StatRequest("mse", "mse"),
        StatRequest("scale_inv_min", "scale_inv_min"),
        StatRequest("scale_inv_max", "scale_inv_max"),
    ]
    if q.has_columnwise and isinstance(quantizer, MXFP8Quantizer):
        reqs += [
            StatRequest("underflows%_columnwise", "underflows%", columnwise=True),
            StatRequest("mse_columnwise", "mse", columnwise=True),
        ]
    got = run([x], reqs, quantized_for=lambda _: {"": q})
    n = x.numel()
    for usage, suffix in (("rowwise", ""), ("columnwise", "_columnwise")):
        if f"mse{suffix}" not in got:
            continue
        deq = q.dequantize(usage=usage)
        expected_uf = ((deq == 0).sum() - (x == 0).sum()).item() / n * 100
        assert expected_uf > 0
        assert got[f"underflows%{suffix}"] == pytest.approx(expected_uf, rel=1e-12)
        expected_mse = ((deq.double() - x.double()) ** 2).mean().item()
        assert got[f"mse{suffix}"] == pytest.approx(expected_mse, rel=1e-12)
        assert got[f"mse{suffix}"] == pytest.approx(torch.nn.functional.mse_loss(deq, x).item(), abs=1e-4)
    scales = q.scale_inv_values("rowwise")
    assert got["scale_inv_min"] == scales[scales != 0].min().item()
    assert got["scale_inv_max"] == scales.max().item()


def test_overflows_delayed_scaling():
    x = random_tensor(torch.float32, (32, 32), seed=9) * 100
    q = Float8Quantizer(torch.tensor(1.0), torch.zeros(1), "E4M3").quantize(x)  # scale_inv 1: threshold 448
    got = run([x], [StatRequest("overflows%", "overflows%")], quantized_for=lambda _: {"": q})
    expected = sum(1 for v in x.reshape(-1).tolist() if abs(v) > 448.0) / x.numel() * 100
    assert expected > 0
    assert got["overflows%"] == pytest.approx(expected, rel=1e-12)


def test_nvfp4_stats_numerics():
    """Port of TE's test_nvfp4_numeric: 128x128 bf16 with tiny values; nvfp4_underflows% and nvfp4_mse."""
    from tedebug.quantization.nvfp4 import NVFP4Quantizer

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(128, 128, generator=g) * 1e-3).to(torch.bfloat16)
    x[3, :40] = 2.0  # a few large values push many small ones to zero
    x[7, 10:20] = 0.0
    q = NVFP4Quantizer().quantize(x)
    reqs = [
        StatRequest("nvfp4_underflows%", "underflows%", recipe="nvfp4"),
        StatRequest("nvfp4_mse", "mse", recipe="nvfp4"),
    ]
    got = run([x], reqs, quantized_for=lambda _: {"nvfp4": q})
    # the exact dequantized values (fp32), not rounded to the nominal bf16 (TE rounds; see definitions.py)
    deq = q.dequantize(usage="rowwise", dtype=torch.float32)
    expected_uf = ((deq == 0).sum() - (x == 0).sum()).item() / x.numel() * 100
    assert expected_uf > 0
    assert got["nvfp4_underflows%"] == pytest.approx(expected_uf, rel=1e-12)
    assert got["nvfp4_mse"] == pytest.approx(((deq.double() - x.double()) ** 2).mean().item(), rel=1e-12)


def test_overflows_threshold_is_strict():
    """An element exactly at fp8_max * scale_inv does not overflow; the next fp32 above it does (TE: |x| > max)."""
    x = torch.tensor([448.0, -448.0, 448.00003, -449.0])
    q = Float8Quantizer(torch.tensor(1.0), torch.zeros(1), "E4M3").quantize(x)
    got = run([x], [StatRequest("overflows%", "overflows%")], quantized_for=lambda _: {"": q})
    assert got["overflows%"] == 50.0


def test_deferred_read_back_emits_what_the_finished_step_was_fed():
    """A deferred step keeps a snapshot of each fed buffer: the next step may change the buffer's statistics,
    iteration or reduction settings without changing what the finished step emits (and in which order)."""
    log = Capture()
    engine = StatsEngine(log, defer_read_back=True)
    engine.feed("L", "activation", ["min", "max"], torch.tensor([3.0, -1.0, 2.0]), iteration=0)
    engine.feed("L", "weight", ["max"], torch.tensor([0.5, 4.0]), iteration=0, is_weight=True)
    engine.step(0)
    assert engine.has_in_flight and log.records == []
    engine.feed("L", "activation", ["std"], torch.tensor([1.0, 3.0]), iteration=1, skip_reduction=True)
    engine.step(1)
    assert [(r[0], r[1], r[2]) for r in log.records] == [
        ("L_activation_min", -1.0, 0),
        ("L_activation_max", 3.0, 0),
        ("L_weight_max", 4.0, 0),
    ]
    engine.finish_pending()
    assert (log.records[-1][0], log.records[-1][1], log.records[-1][2]) == ("L_activation_std", math.sqrt(2.0), 1)
    assert not engine.has_in_flight and len(log.records) == 4
