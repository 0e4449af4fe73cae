"""The outputs of a per-tensor FP8 kernel quantization (`cupy_fp8_tensor._outputs`, built here on the CPU: it only
allocates): the codes in their shapes, contiguous, each in its own allocation, and one small float64 allocation
whose views the quantizers return (the statistics vector at its start, scale_inv 16-byte aligned at the float32
index of each scaling mode, the basic statistics row after the float32 vector); writing one output leaves the
others unchanged.  The GPU tests run the kernels on them (tests/backends/test_gpu_kernels.py)."""

import pytest
import torch

from tedebug.backends import cupy_fp8_tensor as fp8k
from tedebug.backends.cupy_fp8_tensor import _outputs
from tedebug.backends.cupy_stats import BASIC_ROW_LEN


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("m, k", [(1, 1), (8, 32), (64, 128), (3, 1000), (0, 16)])
@pytest.mark.parametrize("rowwise, columnwise", [(True, True), (True, False), (False, True)])
def test_outputs_layout(m, k, rowwise, columnwise):
    out = _outputs(m, k, torch.device("cpu"), rowwise, columnwise)
    small = out.small
    base = small.data_ptr()
    assert small.dtype == torch.float64 and small.is_contiguous() and base % 16 == 0
    # the views the quantizers make: statistics (9 at most), the float32 vector, scale_inv of each mode, the row
    stats = small[:9]
    vector = small.view(torch.float32)[fp8k._VECTOR_AT // 4 : fp8k._VECTOR_AT // 4 + 8]
    current = small.view(torch.float32)[fp8k._CURRENT_SCALE_INV]
    delayed = small.view(torch.float32)[fp8k._DELAYED_SCALE_INV]
    row = small[fp8k._HIGH_PRECISION_AT // 8 : fp8k._SMALL_WORDS]
    assert stats.data_ptr() + 8 * 9 <= vector.data_ptr() == base + 128
    assert current.data_ptr() == base + 144 and delayed.data_ptr() == base + 128  # both 16-byte aligned
    assert current.dim() == 0 and delayed.dim() == 0
    assert vector.data_ptr() + 4 * 8 == row.data_ptr() and row.shape == (BASIC_ROW_LEN,)
    assert row.data_ptr() + 8 * BASIC_ROW_LEN == base + 8 * small.numel()  # the row closes the allocation
    present = [stats, vector, row]
    for codes, shape, on in ((out.rowwise, (m, k), rowwise), (out.columnwise, (k, m), columnwise)):
        if not on:
            assert codes is None
            continue
        assert codes.dtype == torch.uint8 and codes.shape == shape and codes.is_contiguous()
        assert codes.storage_offset() == 0 and _storage(codes) != _storage(small)
        present.append(codes)
    if rowwise and columnwise and m * k:
        assert _storage(out.rowwise) != _storage(out.columnwise)
    fills = [float(i + 1) for i in range(len(present))]
    for t, v in zip(present, fills):
        t.fill_(v)
    for t, v in zip(present, fills):
        assert bool((t == v).all())
