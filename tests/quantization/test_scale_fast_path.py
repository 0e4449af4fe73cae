"""`compute_scale_from_amax` of one CPU value (numpy fp32 scalars) equals the tensor path bit for bit: subnormal,
tiny, huge, infinite and NaN amaxes, both FP8 maxima, epsilons, power-of-two rounding and both values for an
infinite quotient."""

import itertools

import torch

from tedebug.quantization.formats import FLT_MAX, compute_scale_from_amax

BF16_MAX = 3.3895313892515355e38


def _values():
    special = [
        0.0,
        1e-45,
        1e-40,
        1.1754942e-38,
        1e-30,
        3e-3,
        0.1,
        1.0,
        448.0,
        449.0,
        57344.0,
        1e30,
        3.4e38,
        FLT_MAX,
        float("inf"),
        float("nan"),
        2.5e-3,
        1.5e-5,
        7.0e-6,
    ]
    g = torch.Generator().manual_seed(0)
    spread = torch.rand(100, generator=g) * torch.exp2(torch.randint(-149, 128, (100,), generator=g).float())
    return special + spread.tolist()


def test_one_cpu_value_equals_the_tensor_path():
    mismatches = []
    for v, fp8_max, eps, pow2, for_inf in itertools.product(
        _values(), (448.0, 57344.0), (0.0, 1e-12, 2.5e-3, 1.0), (False, True), (FLT_MAX, BF16_MAX)
    ):
        amax = torch.tensor(v, dtype=torch.float32)
        fast = compute_scale_from_amax(amax, fp8_max, epsilon=eps, pow2=pow2, value_for_inf=for_inf)
        ref = compute_scale_from_amax(amax.reshape(1), fp8_max, epsilon=eps, pow2=pow2, value_for_inf=for_inf)[0]
        assert fast.dtype == torch.float32 and fast.dim() == 0
        if fast.view(torch.int32).item() != ref.view(torch.int32).item():
            mismatches.append((v, fp8_max, eps, pow2, for_inf, fast.item(), ref.item()))
    assert not mismatches, mismatches[:5]


def test_one_value_equals_the_tensor_path_over_random_bit_patterns():
    """The scalar rule (a double division rounded once to fp32) against the tensor path's fp32 division, over
    random positive fp32 bit patterns (every exponent) and the amaxes around the quotient's overflow threshold."""
    g = torch.Generator().manual_seed(14)
    bits = torch.randint(0, 0x7F800000, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    around = []
    for fp8_max in (448.0, 57344.0):
        edge = torch.tensor(fp8_max / FLT_MAX, dtype=torch.float32).view(torch.int32).item()
        around += list(range(edge - 64, edge + 64))
    amaxes = torch.cat([bits, torch.tensor(around, dtype=torch.int32)]).view(torch.float32)
    for fp8_max, pow2 in itertools.product((448.0, 57344.0), (False, True)):
        ref = compute_scale_from_amax(amaxes, fp8_max, pow2=pow2).view(torch.int32).tolist()
        fast = [compute_scale_from_amax(a, fp8_max, pow2=pow2).view(torch.int32).item() for a in amaxes.unbind()]
        mismatches = [(a, f, r) for a, f, r in zip(amaxes.tolist(), fast, ref) if f != r]
        assert not mismatches, mismatches[:5]
