"""Who asks a quantizer for the input's basic statistics (`Quantizer.high_precision_stats`) and where the row waits
for its feed (`fused_stats.attach_high_precision`): the debug quantizer asks exactly while an inspection that feeds
basic statistics (LogTensorStats) quantizes the tensor, and a kept row answers only for the very tensor, unchanged.
The GPU side (the statistics pass that is also the amax pass): tests/backends/test_gpu_fused_high_precision_stats.py.
"""

import threading

import pytest
import torch

from tedebug import debug_api
from tedebug.backends import fused_stats
from tedebug.debug_quantization import DebugQuantizer
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

from support.features import debug_session, section


def test_a_kept_row_answers_for_its_tensor_only():
    x = torch.randn(4, 8)
    row = torch.arange(13, dtype=torch.float64)
    fused_stats.attach_high_precision(x, row)
    assert fused_stats.high_precision_row(x) is row
    assert fused_stats.high_precision_row(x.clone()) is None
    assert fused_stats.high_precision_row(x.view(8, 4)) is None  # another tensor object
    x.mul_(2.0)
    assert fused_stats.high_precision_row(x) is None  # changed in place since the row was computed
    y = torch.randn(3)
    fused_stats.attach_high_precision(y, row)
    assert fused_stats.high_precision_row(y) is row


def test_a_kept_row_is_its_threads_own():
    """The slot is per thread: another thread (autograd's device thread feeds the backward's tensors) sees no row,
    before it attached any and after, and its own attach leaves this thread's row alone."""
    x = torch.randn(4, 8)
    row, other_row = torch.zeros(13, dtype=torch.float64), torch.ones(13, dtype=torch.float64)
    fused_stats.attach_high_precision(x, row)
    seen = []

    def other():
        seen.append(fused_stats.high_precision_row(x))  # a thread that never attached
        fused_stats.attach_high_precision(x, other_row)
        seen.append(fused_stats.high_precision_row(x))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen[0] is None and seen[1] is other_row
    assert fused_stats.high_precision_row(x) is row


class FlagSpy(Float8CurrentScalingQuantizer):
    """Records `high_precision_stats` at every quantization."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def _quantize(self, tensor):
        self.seen.append(self.high_precision_stats)
        return super()._quantize(tensor)


@pytest.mark.parametrize(
    "features, plan_cache, expected",
    [
        ({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}}, True, True),
        (
            {
                "LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]},
                "LogFp8TensorStats": {"enabled": True, "stats": ["mse"], "tensors": ["activation"]},
            },
            True,
            True,
        ),
        ({"LogFp8TensorStats": {"enabled": True, "stats": ["mse"], "tensors": ["activation"]}}, True, False),
        ({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}}, False, False),
    ],
)
def test_the_debug_quantizer_asks_for_the_row_only_for_a_feed_of_basic_statistics(
    tmp_path, features, plan_cache, expected
):
    """Asked while the inspected tensor is quantized, never outside it: the second quantizer (weight, not
    inspected) and the quantizer after the call keep the default.  Through the namespace (plan cache off) the
    features are not known in advance: not asked."""
    with debug_session(section(features), tmp_path, plan_cache=plan_cache):
        activation = FlagSpy("E4M3")
        weight = FlagSpy("E4M3")
        for _ in range(2):
            DebugQuantizer("L", "activation", activation, None).quantize(torch.randn(8, 16))
            DebugQuantizer("L", "weight", weight, None).quantize(torch.randn(16, 16))
            debug_api.step()
        assert activation.seen == [expected, expected]
        assert weight.seen == [False, False]
        assert activation.high_precision_stats is False
