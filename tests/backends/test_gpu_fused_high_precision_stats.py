"""The statistics pass that is also the amax pass (``ted_stats_amax``): its statistics row is bit for bit the row of
the plain statistics launch, and in every mode of the amax pass (current scaling, NVFP4's two slots with the
non-zero count, a delayed-scaling history entry) it writes what that pass writes, so the codes are the same bytes;
and on the debug path a LogTensorStats feed of an FP8-quantized tensor takes that row (no statistics launch of its
own) and logs what the separate launch logs.  Every test needs CUDA and CuPy."""

import pytest
import torch

from tedebug import debug_api
from tedebug.backends import cupy_fp8_tensor, cupy_stats, dispatch, fused_stats
from tedebug.debug_quantization import DebugQuantizer
from tedebug.plan import InspectCall
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

from support.features import RecordingSink, debug_session, section
from support.kernel_inputs import bits, normal_and_special

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: M % 64 and K % 128 both zero (the single-launch cast) and not; a scalar tail of the statistics pass
SHAPES = [(64, 128), (256, 384), (70, 130), (1, 9), (4096, 1025)]


def inputs(shape, dtype, seed):
    """A normal tensor, one with the special values (NaN, infinities, signed zeros, subnormals, FP8 maxima) spread
    in, one of zeros and subnormals only (amax below the normal range), and one of NaN only (amax 0)."""
    normal, special = normal_and_special(shape, dtype, torch.Generator().manual_seed(seed))
    tiny = torch.zeros(shape, dtype=dtype).reshape(-1)
    tiny[::3] = torch.finfo(dtype).tiny / 4
    tiny[1::5] = -torch.finfo(dtype).tiny / 2
    nan = torch.full(shape, float("nan"), dtype=dtype)
    return [t.reshape(shape).to(DEV) for t in (normal, special, tiny, nan)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt, pow2, epsilon", [("E4M3", False, 0.0), ("E5M2", True, 0.0), ("E4M3", False, 1e-3)])
def test_statistics_pass_gives_the_row_and_the_scale_of_the_two_passes(dtype, shape, fmt, pow2, epsilon):
    for x in inputs(shape, dtype, sum(shape)):
        x2d = x.reshape(-1, shape[-1])
        fused = cupy_fp8_tensor.fp8_current_quantize(x2d, fmt, epsilon, pow2, True, True, high_precision_stats=True)
        plain = cupy_fp8_tensor.fp8_current_quantize(x2d, fmt, epsilon, pow2, True, True)
        row = torch.empty(len(cupy_stats.BASIC_ROW_KEYS), dtype=torch.float64, device=DEV)
        cupy_stats.basic_stats_into(x2d, row.data_ptr())
        assert plain.high_precision_stats is None
        assert torch.equal(bits(fused.high_precision_stats), bits(row))  # NaN payloads and signed zeros included
        assert torch.equal(bits(fused.scale_inv), bits(plain.scale_inv))
        assert torch.equal(bits(fused.rowwise_data), bits(plain.rowwise_data))
        assert torch.equal(bits(fused.columnwise_data), bits(plain.columnwise_data))
        assert torch.equal(bits(fused.stats), bits(plain.stats))
        assert torch.equal(bits(scale_vector(fused)), bits(scale_vector(plain)))  # amax, scale, scale_inv
        want_amax = x.float().abs().nan_to_num(nan=0.0, posinf=float("inf")).max().item()
        assert scale_vector(fused)[0].item() == want_amax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8 * 256 * 7 + 5, 3 * 2**20 + 3])
@pytest.mark.parametrize("mode", ["amax", "both_slots_count", "record", "current"])
def test_every_amax_mode_writes_what_the_amax_pass_writes(dtype, n, mode):
    """`amax_launch(..., high_precision_out=)` in each mode: the same outputs (amax slots, non-zero count, history
    entry with its NaN rule, scale_inv of the stale scale, current scale) as the amax pass, and the plain row."""
    for x in inputs((n,), dtype, n):
        results = []
        for fused in (False, True):
            # one slot past the row: the statistics pass writes the 13 values and nothing beyond them
            guarded = torch.full((cupy_stats.BASIC_ROW_LEN + 1,), -1.0, dtype=torch.float64, device=DEV)
            row = guarded[: cupy_stats.BASIC_ROW_LEN]
            out = torch.full((8,), 7.0, dtype=torch.float32, device=DEV)
            count = torch.full((1,), -1, dtype=torch.int64, device=DEV)
            kwargs = {"high_precision_out": row} if fused else {}
            if mode == "amax":
                cupy_fp8_tensor.amax_launch(x, out[:1], **kwargs)
            elif mode == "both_slots_count":
                cupy_fp8_tensor.amax_launch(x, out[:2], count_out=count, **kwargs)
            elif mode == "record":
                out[0] = float("nan") if n == 7 else 0.5  # a NaN history entry stays NaN
                scale = torch.full((1,), 3.0, dtype=torch.float32, device=DEV)
                cupy_fp8_tensor.amax_launch(x, out[:4], record=(scale, out[4:5]), **kwargs)
            else:
                cupy_fp8_tensor.amax_launch(x, out, "E4M3", 1e-6, False, scale_inv_slot=4, **kwargs)
            results.append((bits(out), count.item(), row, guarded[-1].item()))
        assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]
        if mode == "both_slots_count":  # subnormals count (the scalar tail of the amax pass flushed them once)
            assert results[0][1] == torch.count_nonzero(x).item()
        plain_row = torch.empty(cupy_stats.BASIC_ROW_LEN, dtype=torch.float64, device=DEV)
        cupy_stats.basic_stats_into(x, plain_row.data_ptr())
        assert torch.equal(bits(results[1][2]), bits(plain_row))
        assert results[1][3] == -1.0  # nothing written past the row
    with pytest.raises(ValueError, match="high_precision_out must be a contiguous float64 tensor of 13"):
        cupy_fp8_tensor.amax_launch(x, out[:1], high_precision_out=row.float())


def test_delayed_scaling_and_nvfp4_quantizers_keep_the_row_with_the_same_bytes():
    """Float8Quantizer (delayed scaling: the history entry and the codes) and NVFP4Quantizer without RHT (global
    amax, block scales, codes, with the non-zero count of its fast kernel) give the same bytes with the statistics
    pass as with the amax pass, and keep the plain statistics row for their input."""
    from tedebug.quantization.float8 import Float8Quantizer
    from tedebug.quantization.nvfp4 import NVFP4Quantizer

    source = inputs((128, 256), torch.bfloat16, 5)[1]
    plain_row = torch.empty(cupy_stats.BASIC_ROW_LEN, dtype=torch.float64, device=DEV)
    cupy_stats.basic_stats_into(source, plain_row.data_ptr())
    for make in (
        lambda: Float8Quantizer(torch.full((1,), 2.0), torch.zeros(4), "E4M3"),
        lambda: NVFP4Quantizer(with_rht=False, stochastic_rounding=True, seed=3),
        lambda: NVFP4Quantizer(with_rht=False, with_2d_quantization=True),
    ):
        outputs = []
        for fused in (False, True):
            x = source.clone()  # a tensor of its own: no row kept for an earlier quantizer's input answers for it
            q = make()
            q.high_precision_stats = fused
            with dispatch.use_backend("cupy"):
                quantized = q.quantize(x)
            fields = [getattr(quantized, name) for name in quantized._tensor_fields()]
            state = [q.amax_history] if isinstance(q, Float8Quantizer) else []
            outputs.append([bits(t) for t in fields + state if t is not None])
            row = fused_stats.high_precision_row(x)
            if fused:
                assert row is not None and torch.equal(bits(row), bits(plain_row))
            else:
                assert row is None  # not asked for: the amax pass alone
        assert len(outputs[0]) == len(outputs[1]) and all(torch.equal(a, b) for a, b in zip(*outputs))


def scale_vector(buffers):
    """amax, scale, -, -, scale_inv: the float32 vector the amax (or statistics) pass writes, which holds scale_inv."""
    inv = buffers.scale_inv
    vector = torch.empty(0, dtype=torch.float32, device=DEV)
    vector.set_(inv.untyped_storage(), inv.storage_offset() - 4, (5,))
    return vector[[0, 1, 4]]


def test_the_quantizer_keeps_the_row_for_exactly_its_input():
    x = torch.randn(64, 128, device=DEV, dtype=torch.bfloat16)
    q = Float8CurrentScalingQuantizer("E4M3")
    q.high_precision_stats = True
    with dispatch.use_backend("cupy"):
        q.quantize(x)
    row = fused_stats.high_precision_row(x)
    want = torch.empty(len(cupy_stats.BASIC_ROW_KEYS), dtype=torch.float64, device=DEV)
    cupy_stats.basic_stats_into(x, want.data_ptr())
    assert row is not None and torch.equal(bits(row), bits(want))
    assert fused_stats.high_precision_row(x.clone()) is None  # another tensor
    x.add_(1.0)
    assert fused_stats.high_precision_row(x) is None  # changed in place since
    q.high_precision_stats = False
    y = torch.randn(64, 128, device=DEV, dtype=torch.bfloat16)
    with dispatch.use_backend("cupy"):
        q.quantize(y)
    assert fused_stats.high_precision_row(y) is None  # not asked for: the amax pass alone


def test_log_tensor_stats_of_an_fp8_tensor_takes_the_quantizers_row(tmp_path, monkeypatch):
    """LogTensorStats (and LogFp8TensorStats) on FP8 current-scaled activation and weight: with the fused pass the
    feeds launch no statistics kernel, and every logged value equals the run whose quantizer skips the fused pass
    (the separate statistics launch)."""
    config = section(
        {
            "LogTensorStats": {
                "enabled": True,
                "stats": ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"],
                "tensors": ["activation", "weight"],
            },
            "LogFp8TensorStats": {"enabled": True, "stats": ["underflows%", "mse"], "tensors": ["activation"]},
        }
    )
    tensors = {
        "activation": [torch.randn(256, 128, device=DEV, dtype=torch.bfloat16) * (i + 1) for i in range(3)],
        "weight": [torch.randn(128, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3)],
    }
    launches = []
    for lone in ("basic_stats_into", "basic_stats_scratch_into"):  # (the engine launches the second)
        real = getattr(cupy_stats, lone)
        monkeypatch.setattr(cupy_stats, lone, lambda x, ptr, real=real: launches.append(x.shape) or real(x, ptr))
    logged = {}
    for fused in (True, False):
        if not fused:  # the separate statistics launch: the plan says no feature feeds basic statistics
            monkeypatch.setattr(InspectCall, "feeds_basic_statistics", lambda self: False)
        launches.clear()
        sink = RecordingSink()
        with debug_session(config, tmp_path / str(fused), sink=sink):
            quantizers = {
                name: DebugQuantizer("L", name, Float8CurrentScalingQuantizer("E4M3"), None) for name in tensors
            }
            for i in range(3):
                for name, q in quantizers.items():
                    q.quantize(tensors[name][i])
                debug_api.step()
        logged[fused] = (sink.values(), len(launches))
    assert logged[True][0] == logged[False][0]
    assert logged[True][1] == 0 and logged[False][1] > 0  # fused: no statistics launch of the feeds' own
    assert logged[True][0][("L_activation_max", 1)] == tensors["activation"][1].float().max().item()
