"""`tedebug.backends.cublaslt`'s host-side helpers on CPU: how a 2-D view is described to cuBLAS, and the pointer
alignment its algorithm choice may assume (the GEMM itself runs in tests/backends/test_gpu_emulated_gemm.py)."""

import torch

from tedebug.backends.cublaslt import OP_N, OP_T, _alignment, as_cublas


def test_row_major_is_the_transpose_without_an_operation():
    t = torch.empty(3, 5)
    assert as_cublas(t) == (OP_N, 5)
    assert as_cublas(torch.empty(3, 8)[:, :5]) == (OP_N, 8)  # a column slice keeps the row stride


def test_column_major_is_read_with_a_transpose():
    t = torch.empty(5, 3).t()  # [3, 5], stride (1, 3)
    assert as_cublas(t) == (OP_T, 3)


def test_other_strides_are_refused():
    assert as_cublas(torch.empty(4, 6)[:, ::2]) is None  # neither dimension contiguous
    assert as_cublas(torch.empty(4, 4).as_strided((4, 4), (2, 1))) is None  # rows overlap


def test_alignment_is_the_largest_power_of_two_up_to_256():
    assert _alignment(0) == 256
    assert _alignment(512) == 256
    assert _alignment(256 + 64) == 64
    assert _alignment(2) == 2 and _alignment(3) == 1
