"""LogFp8TensorStats / LogNvfp4TensorStats on CPU: every statistic (training recipe and what-if recipes) against a
direct computation from the corresponding quantizer's raw data, hybrid and mixed plans, skips and errors."""

import os

import pytest
import torch

from tedebug import debug_api
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from tedebug.quantization.float8_block import Float8BlockQuantizer
from tedebug.quantization.hybrid import HybridQuantizer
from tedebug.quantization.mxfp8 import MXFP8Quantizer
from tedebug.quantization.nvfp4 import NVFP4Quantizer

from support.features import RecordingSink, debug_session, section

STATS = ("underflows%", "mse", "scale_inv_min", "scale_inv_max", "scale_inv_std")


def sample(rows=128, cols=256, seed=0):
    """Values over many binades, with exact zeros and a run of -0.0 (zeros are not underflows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-24, 8, (rows, cols), generator=g).float())
    x[3, :40] = 0.0
    x[5, 10:50] = -0.0
    return x


def scale_values(q, usage):
    """The real decode scales of one representation, straight from the raw fields."""
    name = type(q).__name__
    if name == "Float8Tensor":
        return q.scale_inv.double().reshape(1)
    if name == "MXFP8Tensor":
        return torch.exp2(getattr(q, f"{usage}_scale_inv").double() - 127).flatten()
    if name == "Float8BlockwiseTensor":
        return getattr(q, f"{usage}_scale_inv").double().flatten()
    raise AssertionError(name)


def oracle(x, q, stat, usage="rowwise"):
    deq = q.dequantize(usage=usage, dtype=torch.float64)
    xd = x.double()
    if stat == "underflows%":
        return ((deq == 0).sum() - (x == 0).sum()).item() * 100.0 / x.numel()
    if stat == "mse":
        return ((deq - xd) ** 2).mean().item()
    s = scale_values(q, usage)
    if stat == "scale_inv_min":
        return s[s != 0].min().item()
    if stat == "scale_inv_max":
        return s.max().item()
    if stat == "scale_inv_std":
        return s.std(unbiased=False).item()
    raise AssertionError(stat)


def inspect(te, x, rowwise, columnwise, quantizer, *, tensor_name="activation", iteration=0):
    """One LogFp8TensorStats / LogNvfp4TensorStats feed of layer "L" through the session's API (no TP group)."""
    te.inspect_tensor(
        "L",
        tensor=x,
        tensor_name=tensor_name,
        iteration=iteration,
        tp_group=None,
        rowwise_quantized_tensor=rowwise,
        columnwise_quantized_tensor=columnwise,
        quantizer=quantizer,
    )


def run_fp8_stats(tmp_path, stats, x, rowwise, columnwise, quantizer, tensor_name="activation"):
    sink = RecordingSink()
    config = section({"LogFp8TensorStats": {"enabled": True, "stats": list(stats), "tensors": [tensor_name]}})
    with debug_session(config, tmp_path, sink) as te:
        inspect(te, x, rowwise, columnwise, quantizer, tensor_name=tensor_name, iteration=4)
        debug_api.step()
    return {name[len(f"L_{tensor_name}_") :]: v for (name, it), v in sink.values().items() if it == 4}


def main_log(tmp_path):
    return open(os.path.join(tmp_path, "nvdlfw_inspect_logs", "nvdlfw_inspect_globalrank-0.log")).read()


# ------------------------------------------------------------------------------------------------ what-if
WHAT_IF = {
    "fp8_current_scaling": lambda fmt: Float8CurrentScalingQuantizer(fmt),
    "mxfp8": lambda fmt: MXFP8Quantizer(fmt),
    "fp8_block_scaling": lambda fmt: Float8BlockQuantizer(fmt, block_scaling_dim=2, force_pow_2_scales=True),
}


@pytest.mark.parametrize(
    "training, what_if_fmt",
    [
        (lambda: Float8Quantizer.from_recipe_defaults("E5M2"), "E5M2"),  # per-tensor FP8 training: its format
        (lambda: MXFP8Quantizer("E5M2"), "E4M3"),  # otherwise E4M3
    ],
)
def test_every_what_if_stat_matches_its_quantizer(training, what_if_fmt, tmp_path):
    x = sample()
    quantizer = training()
    q = quantizer.quantize(x)
    stats = [
        f"{r}_{s}{c}"
        for r in WHAT_IF
        for s in STATS
        for c in ("", "_columnwise")
        if not (c and r == "fp8_current_scaling") and r != quantizer.recipe_name
    ]
    got = run_fp8_stats(tmp_path, stats, x, q, q, quantizer)
    assert set(got) == set(stats)
    for recipe, make in WHAT_IF.items():
        if recipe == quantizer.recipe_name:
            continue
        reference = make(what_if_fmt).quantize(x)
        for stat in STATS:
            for suffix, usage in (("", "rowwise"), ("_columnwise", "columnwise")):
                name = f"{recipe}_{stat}{suffix}"
                if name in got:
                    assert got[name] == pytest.approx(oracle(x, reference, stat, usage), rel=1e-12, abs=1e-300), name
    assert got["mxfp8_underflows%"] > 0 if quantizer.recipe_name != "mxfp8" else True


def test_training_recipe_stats_and_overflows_under_delayed_scaling(tmp_path):
    x = sample() * 1e-3
    x[0, 0], x[1, 1], x[2, 2] = 300.0, -250.0, 100.0
    quantizer = Float8Quantizer(torch.tensor(2.0), torch.zeros(4), "E4M3")  # 300 * 2 > 448: overflow
    q = quantizer.quantize(x)
    stats = list(STATS) + ["overflows%", "fp8_delayed_scaling_overflows%", "fp8_delayed_scaling_mse"]
    got = run_fp8_stats(tmp_path, stats, x, q, q, quantizer)
    for stat in STATS:
        assert got[stat] == pytest.approx(oracle(x, q, stat), rel=1e-12), stat
    expected_overflows = 200.0 / x.numel()  # 300 and -250 exceed 448 / 2 = 224
    assert got["overflows%"] == pytest.approx(expected_overflows, rel=1e-12)
    assert got["fp8_delayed_scaling_overflows%"] == got["overflows%"]
    assert got["fp8_delayed_scaling_mse"] == got["mse"]
    assert got["scale_inv_min"] == got["scale_inv_max"] == 0.5 and got["scale_inv_std"] == 0.0


def test_mxfp8_training_scale_inv_are_real_values_and_columnwise_reads_columnwise(tmp_path):
    x = sample(seed=3)
    quantizer = MXFP8Quantizer("E4M3")
    q = quantizer.quantize(x)
    stats = [s + c for s in STATS for c in ("", "_columnwise")] + ["mxfp8_scale_inv_max"]
    got = run_fp8_stats(tmp_path, stats, x, q, q, quantizer)
    for stat in STATS:
        assert got[stat] == pytest.approx(oracle(x, q, stat, "rowwise"), rel=1e-12)
        assert got[stat + "_columnwise"] == pytest.approx(oracle(x, q, stat, "columnwise"), rel=1e-12)
    assert got["mse"] != got["mse_columnwise"]  # really the columnwise dequantization
    assert got["mxfp8_scale_inv_max"] == got["scale_inv_max"]
    assert got["scale_inv_max"] == 2.0 ** (q.rowwise_scale_inv.double().max().item() - 127)


def test_one_what_if_quantization_per_recipe_per_feed(tmp_path, monkeypatch):
    calls = []
    original = MXFP8Quantizer._quantize

    def counting(self, tensor):
        calls.append(tensor.shape)
        return original(self, tensor)

    monkeypatch.setattr(MXFP8Quantizer, "_quantize", counting)
    x = sample()
    quantizer = Float8CurrentScalingQuantizer("E4M3")
    q = quantizer.quantize(x)
    run_fp8_stats(tmp_path, ["mxfp8_mse", "mxfp8_underflows%", "mxfp8_scale_inv_min_columnwise"], x, q, q, quantizer)
    assert len(calls) == 1


# ------------------------------------------------------------------------------------------------ hybrid / mixed
def test_hybrid_quantizer_each_direction_in_its_own_format(tmp_path):
    x = sample(seed=5)
    quantizer = HybridQuantizer(MXFP8Quantizer("E4M3"), Float8BlockQuantizer("E5M2", block_scaling_dim=1))
    hq = quantizer.quantize(x)
    stats = [
        "underflows%",
        "mse",
        "scale_inv_max",
        "underflows%_columnwise",
        "mse_columnwise",
        "scale_inv_min_columnwise",
        "fp8_block_scaling_mse_columnwise",
        "mxfp8_mse_columnwise",
    ]
    got = run_fp8_stats(tmp_path, stats, x, hq, hq, quantizer)
    row, col = hq.rowwise_sub_storage, hq.columnwise_sub_storage
    for stat in ("underflows%", "mse", "scale_inv_max"):
        assert got[stat] == pytest.approx(oracle(x, row, stat, "rowwise"), rel=1e-12)
    for stat in ("underflows%", "mse", "scale_inv_min"):
        assert got[stat + "_columnwise"] == pytest.approx(oracle(x, col, stat, "columnwise"), rel=1e-12)
    # naming the columnwise operand's own recipe reads it; naming another recipe is a what-if (format: E5M2,
    # the block child's FP8 format)
    assert got["fp8_block_scaling_mse_columnwise"] == got["mse_columnwise"]
    what_if = MXFP8Quantizer("E5M2").quantize(x)
    assert got["mxfp8_mse_columnwise"] == pytest.approx(oracle(x, what_if, "mse", "columnwise"), rel=1e-12)


def test_mixed_plan_high_precision_direction_is_skipped_with_one_warning(tmp_path):
    x = sample(seed=7)
    quantizer = MXFP8Quantizer("E4M3")
    q = quantizer.quantize(x)
    stats = ["underflows%", "mse_columnwise", "underflows%_columnwise", "fp8_current_scaling_mse"]
    sink = RecordingSink()
    config = section({"LogFp8TensorStats": {"enabled": True, "stats": stats, "tensors": ["activation"]}})
    with debug_session(config, tmp_path, sink) as te:
        for _ in range(2):  # fprop disabled: the rowwise operand is the high-precision tensor
            inspect(te, x, x, q, quantizer, tensor_name="activation", iteration=0)
        debug_api.step()
        log = main_log(tmp_path)
    got = {n: v for (n, _), v in sink.values().items()}
    assert set(got) == {
        "L_activation_mse_columnwise",
        "L_activation_underflows%_columnwise",
        "L_activation_fp8_current_scaling_mse",
    }
    assert got["L_activation_mse_columnwise"] == pytest.approx(oracle(x, q, "mse", "columnwise"), rel=1e-12)
    assert got["L_activation_underflows%_columnwise"] == pytest.approx(
        oracle(x, q, "underflows%", "columnwise"), rel=1e-12
    )
    assert (
        log.count("skipping ['underflows%'] of tensor activation: its rowwise GEMM operand runs in high precision") == 1
    )


def test_mixed_plan_two_quantized_objects(tmp_path):
    x = sample(seed=8)
    parent = MXFP8Quantizer("E4M3")
    row = parent.quantize(x)
    col = Float8BlockQuantizer("E4M3", block_scaling_dim=1).quantize(x)  # e.g. a modified columnwise operand
    got = run_fp8_stats(tmp_path, ["mse", "mse_columnwise", "scale_inv_min_columnwise"], x, row, col, parent)
    assert got["mse"] == pytest.approx(oracle(x, row, "mse"), rel=1e-12)
    assert got["mse_columnwise"] == pytest.approx(oracle(x, col, "mse", "columnwise"), rel=1e-12)
    assert got["scale_inv_min_columnwise"] == pytest.approx(oracle(x, col, "scale_inv_min", "columnwise"))


def test_missing_direction_is_added_temporarily_or_skipped(tmp_path):
    x = sample(seed=9)
    block = Float8BlockQuantizer("E4M3", block_scaling_dim=2, columnwise=False)
    bq = block.quantize(x)
    got = run_fp8_stats(tmp_path / "a", ["scale_inv_max_columnwise"], x, bq, bq, block)
    assert got["scale_inv_max_columnwise"] == scale_values(bq, "rowwise").max().item()
    assert not bq.has_columnwise  # restored
    mx = MXFP8Quantizer("E4M3", columnwise=False)
    mq = mx.quantize(x)
    got = run_fp8_stats(tmp_path / "b", ["mse", "mse_columnwise"], x, mq, mq, mx)
    assert set(got) == {"mse"}
    assert "skipping ['mse_columnwise']" in main_log(tmp_path / "b")


def test_fp8_stats_that_cannot_be_computed_are_skipped_with_one_warning(tmp_path):
    """A statistic never stops training: each case logs nothing for the statistic and one warning naming the
    layer, tensor, statistic and reason; a statistic of the same feed that can be computed is still logged."""
    x = sample()
    mx = MXFP8Quantizer("E4M3")
    mq = mx.quantize(x)
    nv = NVFP4Quantizer()
    nq = nv.quantize(x)
    cases = [
        (["overflows%"], x, mq, mx, "overflows% exists only for delayed scaling"),
        (["fp8_delayed_scaling_mse"], x, mq, mx, "need a tensor trained with delayed scaling"),
        (["underflows%"], x, nq, nv, "use LogNvfp4TensorStats"),
        (["underflows%"], None, mq, mx, "the high-precision tensor is not available"),
        (
            ["fp8_current_scaling_scale_inv_min"],
            None,
            mq,
            mx,
            "a what-if statistic quantizes the high-precision tensor",
        ),
    ]
    for i, (stats, tensor, q, quantizer, message) in enumerate(cases):
        sink = RecordingSink()
        kept = "mxfp8_scale_inv_max" if q is nq else "scale_inv_max"
        config = section({"LogFp8TensorStats": {"enabled": True, "stats": stats + [kept], "tensors": ["weight"]}})
        with debug_session(config, tmp_path / str(i), sink) as te:
            for _ in range(2):
                inspect(te, tensor, q, q, quantizer, tensor_name="weight", iteration=0)
            debug_api.step()
            log = main_log(tmp_path / str(i))
        assert set(n for n, _, _ in sink.rows) == {f"L_weight_{kept}"}, stats
        warnings = [line for line in log.splitlines() if "WARNING" in line and "skipping" in line]
        assert len(warnings) == 1, warnings
        assert f"LAYER=L: Feature=LogFp8TensorStats: skipping {stats} of tensor weight" in warnings[0]
        assert message in warnings[0]


def test_fp8_what_if_shape_the_format_cannot_take_is_skipped(tmp_path):
    x = torch.randn(3, 20)  # MXFP8 needs the last dim divisible by 32
    sink = RecordingSink()
    config = section(
        {
            "LogFp8TensorStats": {
                "enabled": True,
                "stats": ["mxfp8_mse", "fp8_current_scaling_mse"],
                "tensors": ["activation"],
            }
        }
    )
    with debug_session(config, tmp_path, sink) as te:
        inspect(te, x, x, x, None, tensor_name="activation", iteration=0)
        debug_api.step()
        log = main_log(tmp_path)
    cur = Float8CurrentScalingQuantizer("E4M3", amax_epsilon=0.0, force_pow_2_scales=False).quantize(x)
    assert set(n for n, _, _ in sink.rows) == {"L_activation_fp8_current_scaling_mse"}
    assert sink.values()[("L_activation_fp8_current_scaling_mse", 0)] == pytest.approx(oracle(x, cur, "mse"), rel=1e-12)
    assert "skipping ['mxfp8_mse'] of tensor activation: the what-if mxfp8 quantization of shape (3, 20) failed" in log


def test_fp8_stats_without_quantizer_or_tensor(tmp_path):
    x = sample()
    mx = MXFP8Quantizer("E4M3")
    mq = mx.quantize(x)
    sink = RecordingSink()
    config = section(
        {
            "LogFp8TensorStats": {
                "enabled": True,
                "stats": ["scale_inv_min", "mxfp8_scale_inv_max", "fp8_block_scaling_mse"],
                "tensors": ["weight", "activation"],
            }
        }
    )
    with debug_session(config, tmp_path, sink) as te:
        inspect(te, x, x, x, None, tensor_name="activation", iteration=0)
        inspect(te, None, mq, mq, mx, tensor_name="weight", iteration=0)
        debug_api.step()
        log = main_log(tmp_path)
    # a high-precision layer still answers the what-if statistics (quantizing its high-precision tensor)
    assert set(n for n, _, _ in sink.rows) == {
        "L_weight_scale_inv_min",
        "L_weight_mxfp8_scale_inv_max",
        "L_activation_mxfp8_scale_inv_max",
        "L_activation_fp8_block_scaling_mse",
    }
    assert sink.values()[("L_weight_scale_inv_min", 0)] == oracle(x, mq, "scale_inv_min")
    assert sink.values()[("L_activation_mxfp8_scale_inv_max", 0)] == oracle(x, mq, "scale_inv_max")
    block = Float8BlockQuantizer("E4M3", block_scaling_dim=2, amax_epsilon=0.0, force_pow_2_scales=True).quantize(x)
    assert sink.values()[("L_activation_fp8_block_scaling_mse", 0)] == pytest.approx(oracle(x, block, "mse"), rel=1e-12)
    assert "skipping ['scale_inv_min'] of tensor activation: its rowwise GEMM operand runs in high precision" in log


# ------------------------------------------------------------------------------------------------ NVFP4
def nvfp4_sample():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(128, 128, generator=g) * 1e-3
    x[:, :16] *= 1e-3  # blocks of tiny values: some elements underflow
    x[7, :] = 0.0
    return x.bfloat16()


def test_nvfp4_stats_match_the_oracle(tmp_path):
    x = nvfp4_sample()
    quantizer = NVFP4Quantizer()
    q = quantizer.quantize(x)
    sink = RecordingSink()
    config = section(
        {
            "LogNvfp4TensorStats": {"enabled": True, "stats": ["underflows%", "mse"], "tensors": ["activation"]},
            "LogFp8TensorStats": {"enabled": True, "stats": ["mxfp8_mse"], "tensors": ["activation"]},
        }
    )
    with debug_session(config, tmp_path, sink) as te:
        inspect(te, x, q, q, quantizer, tensor_name="activation", iteration=2)
        debug_api.step()
    got = sink.values()
    deq = q.dequantize(dtype=torch.float64)
    underflows = ((deq == 0).sum() - (x == 0).sum()).item() * 100.0 / x.numel()
    assert underflows > 0
    assert got[("L_activation_nvfp4_underflows%", 2)] == pytest.approx(underflows, rel=1e-12)
    assert got[("L_activation_nvfp4_mse", 2)] == pytest.approx(((deq - x.double()) ** 2).mean().item(), rel=1e-12)
    # the FP8 logger still gives what-if statistics under NVFP4 training (E4M3)
    mx = MXFP8Quantizer("E4M3").quantize(x)
    assert got[("L_activation_mxfp8_mse", 2)] == pytest.approx(oracle(x, mx, "mse"), rel=1e-12)


def test_nvfp4_stats_skip_non_nvfp4_layers_and_read_a_hybrid_columnwise_operand(tmp_path):
    x = nvfp4_sample()
    mx = MXFP8Quantizer("E4M3")
    mq = mx.quantize(x)
    hybrid = HybridQuantizer(MXFP8Quantizer("E4M3"), NVFP4Quantizer())
    hq = hybrid.quantize(x)
    sink = RecordingSink()
    config = section(
        {"LogNvfp4TensorStats": {"enabled": True, "stats": ["mse"], "tensors": ["activation", "gradient"]}}
    )
    with debug_session(config, tmp_path, sink) as te:
        inspect(te, x, mq, mq, mx, tensor_name="activation", iteration=0)
        inspect(te, x, hq, hq, hybrid, tensor_name="gradient", iteration=0)
        debug_api.step()
    assert set(n for n, _, _ in sink.rows) == {"L_gradient_nvfp4_mse", "L_activation_nvfp4_mse"}
    deq = hq.columnwise_sub_storage.dequantize(usage="columnwise", dtype=torch.float64)
    assert sink.values()[("L_gradient_nvfp4_mse", 0)] == pytest.approx(
        ((deq - x.double()) ** 2).mean().item(), rel=1e-12
    )
    # the MXFP8 activation gets the what-if NVFP4 statistics (1x16 blocks, round to nearest)
    what_if = NVFP4Quantizer().quantize(x).dequantize(dtype=torch.float64)
    assert sink.values()[("L_activation_nvfp4_mse", 0)] == pytest.approx(
        ((what_if - x.double()) ** 2).mean().item(), rel=1e-12
    )


def test_nvfp4_what_if_on_a_high_precision_layer_and_skip_of_a_bad_shape(tmp_path):
    x = nvfp4_sample()
    w = nvfp4_sample()[:64]
    bad = torch.randn(5, 20)
    sink = RecordingSink()
    config = section(
        {"LogNvfp4TensorStats": {"enabled": True, "stats": ["underflows%", "mse"], "tensors": ["activation", "weight"]}}
    )
    with debug_session(config, tmp_path, sink) as te:
        for name, t, layer in (("activation", x, "L"), ("weight", w, "L"), ("activation", bad, "M")):
            te.inspect_tensor(
                layer,
                tensor=t,
                tensor_name=name,
                iteration=0,
                tp_group=None,
                rowwise_quantized_tensor=t,
                columnwise_quantized_tensor=t,
                quantizer=None,
            )
        debug_api.step()
        log = main_log(tmp_path)
    got = sink.values()
    assert set(n for n, _, _ in sink.rows) == {
        f"L_{t}_nvfp4_{s}" for t in ("activation", "weight") for s in ("underflows%", "mse")
    }
    for name, t, q in (("activation", x, NVFP4Quantizer()), ("weight", w, NVFP4Quantizer(with_2d_quantization=True))):
        deq = q.quantize(t).dequantize(dtype=torch.float64)
        under = ((deq == 0).sum() - (t == 0).sum()).item() * 100.0 / t.numel()
        assert got[(f"L_{name}_nvfp4_underflows%", 0)] == pytest.approx(under, rel=1e-12)
        assert got[(f"L_{name}_nvfp4_mse", 0)] == pytest.approx(((deq - t.double()) ** 2).mean().item(), rel=1e-12)
    assert (
        "LAYER=M: Feature=LogNvfp4TensorStats: skipping ['underflows%', 'mse'] of tensor activation: the "
        "what-if NVFP4 quantization of shape (5, 20) failed" in log
    )


def test_feeds_of_one_kind_are_planned_once_and_added_usages_every_time(tmp_path, monkeypatch):
    """The plan of a feed depends only on the statistics, whether the high-precision tensor exists and each usage's
    recipe and presence: made once per session for such a kind (call counter), giving the values of a feed planned
    afresh; a feed whose storage lacks a usage is planned every time, and a usage added for it is removed again."""
    import sys

    calls = []

    def count_plans():  # in every loaded copy of the feature module (the session loads its feature directories)
        for name, module in list(sys.modules.items()):
            real = getattr(module, "_fill_plan", None) if name.endswith("log_fp8_tensor_stats") else None
            if real is not None and not hasattr(real, "counted"):
                spy = lambda *a, real=real, **k: calls.append(1) or real(*a, **k)  # noqa: E731
                spy.counted = True
                monkeypatch.setattr(module, "_fill_plan", spy)

    def feed(te, tensor_name, quantizer, it):
        q = quantizer.quantize(xs[it])  # a new storage of the same kind, of other values, at every feed
        inspect(te, xs[it], q, q, quantizer, tensor_name=tensor_name, iteration=it)
        return q

    xs = [sample(seed=12 + it) for it in range(3)]
    current = Float8CurrentScalingQuantizer("E4M3")
    block = Float8BlockQuantizer("E4M3", block_scaling_dim=2, columnwise=False)  # no columnwise usage
    sink = RecordingSink()
    stats = ["underflows%", "mse", "scale_inv_max"]
    config = section({"LogFp8TensorStats": {"enabled": True, "stats": stats, "tensors": ["activation", "weight"]}})
    with debug_session(config, tmp_path, sink) as te:
        count_plans()
        for it in range(3):
            feed(te, "activation", current, it)
            assert not feed(te, "weight", block, it).has_columnwise
            debug_api.step()
    # the activation's storage holds both usages: planned once; the weight's lacks one: planned at every feed
    assert len(calls) == 1 + 3
    for it, x in enumerate(xs):  # each feed's values: those of the same feed planned afresh in its own session
        q = current.quantize(x)
        fresh = run_fp8_stats(tmp_path / f"fresh{it}", stats, x, q, q, current)
        assert {stat: sink.values()[(f"L_activation_{stat}", it)] for stat in stats} == fresh, it
    calls.clear()
    config = section(
        {"LogFp8TensorStats": {"enabled": True, "stats": ["scale_inv_max_columnwise"], "tensors": ["weight"]}}
    )
    with debug_session(config, tmp_path / "b", RecordingSink()) as te:
        count_plans()
        for it in range(2):
            assert not feed(te, "weight", block, it).has_columnwise  # added for the feed, removed after it
            debug_api.step()
    assert len(calls) == 2  # planned at every feed


def test_the_bound_feed_finds_the_storage_of_every_operand_type():
    """The bound LogFp8TensorStats feed takes each usage's storage from the operand's type: the same answers as
    `storage_for` for high precision, plain quantized tensors, the identity format and hybrids (both orders)."""
    from tedebug.features import log_fp8_tensor_stats as module
    from tedebug.features.base import storage_for
    from tedebug.quantization.hybrid import HybridQuantizer
    from tedebug.quantization.identity import IdentityQuantizer
    from tedebug.quantization.mxfp8 import MXFP8Quantizer

    x = sample(seed=31)
    operands = [
        None,
        x,
        Float8CurrentScalingQuantizer("E4M3").quantize(x),
        IdentityQuantizer().quantize(x),
        HybridQuantizer(IdentityQuantizer(), MXFP8Quantizer("E4M3")).quantize(x),
        HybridQuantizer(MXFP8Quantizer("E4M3"), Float8CurrentScalingQuantizer("E4M3")).quantize(x),
    ]
    found = 0
    for _ in range(2):  # the second round answers from the type table
        for operand in operands:
            for usage in ("rowwise", "columnwise"):
                got = module._operand_storage(operand, usage)
                assert got is storage_for(operand, usage), (type(operand).__name__, usage)
                found += got is not None
    assert found == 2 * (2 + 1 + 2)  # FP8 both usages, one hybrid's MXFP8 half, the other hybrid's two halves
