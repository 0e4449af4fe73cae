"""The outputs of a per-tensor FP8 kernel quantization (`cupy_fp8_tensor._outputs`, built here on the CPU: it only
allocates and makes views): the codes in their shapes, contiguous, each in its own allocation; the float64
statistics and the float32 scale vector (scale_inv 16-byte aligned) as disjoint views of one small allocation;
writing one output leaves the others unchanged.  The GPU tests run the kernels on them
(tests/backends/test_gpu_kernels.py)."""

import pytest
import torch

from tedebug.backends.cupy_fp8_tensor import _outputs


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("m, k", [(1, 1), (8, 32), (64, 128), (3, 1000), (0, 16)])
@pytest.mark.parametrize("rowwise, columnwise", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("stats_len", [3, 9])
def test_outputs_layout(m, k, rowwise, columnwise, stats_len):
    out = _outputs(m, k, torch.device("cpu"), rowwise, columnwise, stats_len)
    base = out.stats.data_ptr()  # the statistics open the small allocation
    assert out.stats.dtype == torch.float64 and out.stats.shape == (stats_len,)
    assert out.vector.dtype == torch.float32 and out.vector.shape == (8,)
    assert _storage(out.vector) == _storage(out.stats)
    assert base + 8 * stats_len <= out.vector.data_ptr() == base + 128 and out.vector[4].data_ptr() == base + 144
    present = [out.stats, out.vector]
    for codes, shape, on in ((out.rowwise, (m, k), rowwise), (out.columnwise, (k, m), columnwise)):
        if not on:
            assert codes is None
            continue
        assert codes.dtype == torch.uint8 and codes.shape == shape and codes.is_contiguous()
        assert codes.storage_offset() == 0 and _storage(codes) != _storage(out.stats)
        present.append(codes)
    if rowwise and columnwise and m * k:
        assert _storage(out.rowwise) != _storage(out.columnwise)
    fills = [float(i + 1) for i in range(len(present))]
    for t, v in zip(present, fills):
        t.fill_(v)
    for t, v in zip(present, fills):
        assert bool((t == v).all())
