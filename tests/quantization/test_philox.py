"""Philox4x32-10 random bytes (`tedebug.quantization.philox`): Random123's known-answer vectors, the byte layout
against a plain-integer oracle, and the quantizer's use (same bytes for one seed, a new draw per call)."""

import pytest
import torch

from tedebug.quantization.nvfp4 import NVFP4Quantizer
from tedebug.quantization.philox import _bytes_torch, philox4x32_10, philox_bytes

# Random123 kat_vectors: philox4x32 10 <counter> <key> -> <output>
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_known_answers(counter, key, expected):
    out = philox4x32_10(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), key)
    assert tuple(int(w) for w in out) == expected


def _oracle_block(j: int, seed: int, offset: int):
    """Philox4x32-10 with Python integers (the textbook round), for counter block j."""
    m0, m1, w0, w1, mask = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF
    c = [j & mask, j >> 32, offset & mask, offset >> 32]
    k0, k1 = seed & mask, seed >> 32
    for r in range(10):
        if r:
            k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & mask, (p0 >> 32) ^ c[3] ^ k1, p0 & mask]
    return b"".join(w.to_bytes(4, "little") for w in c)


@pytest.mark.parametrize("seed, offset, n", [(0, 0, 16), (1234, 7, 37), (2**40 + 5, 2**33 + 1, 100)])
def test_bytes_follow_the_documented_layout(seed, offset, n):
    expected = b"".join(_oracle_block(j, seed, offset) for j in range(-(-n // 16)))[:n]
    assert bytes(philox_bytes(seed, offset, n).tolist()) == expected  # the CPU (numpy) path
    assert bytes(_bytes_torch(seed, offset, n, torch.device("cpu")).tolist()) == expected  # the torch path


def test_sr_quantizer_draws_a_new_offset_per_direction_and_repeats_for_a_seed():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    a = NVFP4Quantizer(stochastic_rounding=True, seed=5)
    b = NVFP4Quantizer(stochastic_rounding=True, seed=5)
    qa, qb = a(x), b(x)
    assert torch.equal(qa.rowwise_data, qb.rowwise_data) and torch.equal(qa.columnwise_data, qb.columnwise_data)
    assert a.sr_offset == 2  # rowwise draw 0, columnwise draw 1
    assert not torch.equal(a(x).rowwise_data, qa.rowwise_data)  # draw 2 differs


def test_unseeded_quantizer_follows_torch_manual_seed():
    torch.manual_seed(3)
    a = NVFP4Quantizer(stochastic_rounding=True)
    torch.manual_seed(3)
    b = NVFP4Quantizer(stochastic_rounding=True)
    assert a.sr_seed == b.sr_seed
