"""Current scaling of one tensor-parallel shard with the scale of the whole tensor on the GPU
(`cupy_fp8_tensor.fp8_current_quantize` with `reduce_amax`, which `TPCurrentScalingQuantizer` gives on CUDA): the
shard's amax pass (or statistics pass), the caller's in-place reduction of that amax, the scale kernel and the cast.

Checked against two independent answers: the torch path with the reduced amax (`compute_scale_from_amax`,
`_cast_per_tensor`: the same codes and scale_inv), and the quantization of the whole tensor the shards come from
(the shard's rows of its codes, its scale_inv and, for the statistics, the cast kernel with that scale).  A logged
shard's basic statistics row is that of a lone statistics launch on the shard.  Every test needs CUDA and CuPy."""

import datetime
import socket

import pytest
import torch
import torch.distributed as dist

from tedebug.backends import cupy_fp8_tensor, dispatch
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, _cast_per_tensor
from tedebug.quantization.formats import tensor_amax

from support.kernel_inputs import bits, cast_inputs, lone_row

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
#: the 16-bit fast shape (64 x 128 tiles) and a general one
SHAPES = [(128, 256), (96, 200)]


def raised_to(other_amax):
    """A stand-in for the TP group's all-reduce MAX: the shard's amax becomes max(it, the other shard's), in place."""

    def reduce_amax(amax):
        assert amax.dtype is torch.float32 and amax.numel() == 1 and amax.device.type == "cuda"
        torch.maximum(amax, other_amax.reshape(1), out=amax)

    return reduce_amax


@pytest.mark.parametrize("logged", (False, True))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt, pow2, epsilon", [("E4M3", False, 0.0), ("E5M2", True, 1e-3)])
def test_a_shard_is_cast_with_the_whole_tensors_scale(shape, dtype, fmt, pow2, epsilon, logged):
    for seed, (x, other) in enumerate(zip(cast_inputs(shape, dtype, 11, DEV), cast_inputs(shape, dtype, 12, DEV))):
        other = other * (seed + 2)  # the other rank's shard, mostly the larger amax
        whole_amax = torch.maximum(tensor_amax(x), tensor_amax(other)).float()
        got = cupy_fp8_tensor.fp8_current_quantize(
            x, fmt, epsilon, pow2, True, True, logged, reduce_amax=raised_to(tensor_amax(other).float())
        )
        # the torch path with the reduced amax
        q = Float8CurrentScalingQuantizer(fmt, amax_epsilon=epsilon, force_pow_2_scales=pow2)
        want = _cast_per_tensor(q, x, q.compute_scale(whole_amax), q.fp8_format)
        assert torch.equal(bits(got.scale_inv), bits(want.scale_inv.reshape(())))
        assert torch.equal(got.rowwise_data, want.rowwise_data.reshape(shape))
        assert torch.equal(got.columnwise_data, want.columnwise_data.reshape(shape[::-1]))
        # the whole tensor's current scaling: the shard's rows of its codes, its scale_inv
        whole = cupy_fp8_tensor.fp8_current_quantize(torch.cat([x, other]), fmt, epsilon, pow2, True, False)
        assert torch.equal(got.rowwise_data, whole.rowwise_data[: shape[0]])
        assert torch.equal(bits(got.scale_inv), bits(whole.scale_inv))
        # the fused statistics: those of the cast kernel with that scale
        scale, _ = cupy_fp8_tensor.fp8_current_scale(whole_amax, fmt, epsilon, pow2)
        cast = cupy_fp8_tensor.fp8_quantize(x, scale, fmt, True, True)
        assert torch.equal(bits(got.stats), bits(cast.stats))
        if logged:
            assert torch.equal(bits(got.high_precision_stats), bits(lone_row(x)))
        else:
            assert got.high_precision_stats is None


def test_an_empty_shard_joins_the_reduction():
    calls = []

    def reduce_amax(amax):
        calls.append(amax.clone())
        amax.fill_(3.5)

    got = cupy_fp8_tensor.fp8_current_quantize(
        torch.empty(0, 64, device=DEV, dtype=torch.bfloat16), "E4M3", 0.0, False, True, True, reduce_amax=reduce_amax
    )
    assert [c.tolist() for c in calls] == [[0.0]]
    assert got.scale_inv.item() == pytest.approx(3.5 / 448.0, rel=2**-23)


def test_the_tp_quantizer_takes_the_kernel_path(monkeypatch):
    """`TPCurrentScalingQuantizer` on CUDA hands its all-reduce to the kernel path
    (`dispatch.quantize_fp8_current`'s `reduce_amax`; a one-rank NCCL group: the reduced amax is the tensor's own, so
    the bytes are plain current scaling's) and its tensor carries the cast's statistics vector."""
    from tedebug.backends.fused_stats import fused_vector
    from tedebug.nn.parallel import TPCurrentScalingQuantizer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        reductions = []
        real = dispatch.quantize_fp8_current

        def spy(*args):
            reductions.append(args[-1])
            return real(*args)

        monkeypatch.setattr(dispatch, "quantize_fp8_current", spy)
        x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16) * 7
        q = TPCurrentScalingQuantizer("E4M3", amax_group=dist.group.WORLD)
        tp = q(x)
        plain = Float8CurrentScalingQuantizer("E4M3")(x)
        assert reductions == [q.reduce_amax, None]  # (a bound method: equal, not identical, at each access)
        assert torch.equal(tp.rowwise_data, plain.rowwise_data) and torch.equal(tp.scale_inv, plain.scale_inv)
        assert fused_vector(tp, x, "rowwise") is not None
    finally:
        dist.destroy_process_group()
