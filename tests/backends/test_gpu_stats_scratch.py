"""The statistics launches that leave their block partials in a row scratch (``ted_stats_scratch``,
``ted_stats_group_scratch``) and the launch that turns the scratches into rows (``ted_stats_finish_rows``), on the
GPU: the rows are bit for bit those of the launches that write their rows themselves (`basic_stats_into`,
`basic_stats_group_into`: the oracle), for tensors with NaN, infinities, signed zeros and subnormals of every kernel
dtype, alone and in groups that fit in a wave and that share it; a scratch is written once, a row that no scratch
launch wrote is left alone; and a CUDA `RowSlab` writes its scratch rows before it is read.  Every test needs CUDA and
CuPy."""

import pytest
import torch

from tedebug.backends import cupy_stats
from tedebug.stats.slab import RowSlab

from support.kernel_inputs import bits, sprinkled

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROW = len(cupy_stats.BASIC_ROW_KEYS)


class _Scratch:
    """`count` row scratches and their rows (NaN until written)."""

    def __init__(self, count: int) -> None:
        self.bytes = cupy_stats.row_scratch_bytes(DEV)
        self.area = torch.zeros((count, self.bytes), dtype=torch.uint8, device=DEV)
        self.rows = torch.full((count, ROW), float("nan"), dtype=torch.float64, device=DEV)

    def address(self, i: int) -> int:
        return self.area[i].data_ptr()

    def finish(self) -> None:
        cupy_stats.finish_rows(DEV, self.area.data_ptr(), self.bytes, self.rows.data_ptr(), ROW, self.rows.shape[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 7, 1000, 4097, (1 << 20) + 3, 1 << 24])
def test_a_lone_launch_and_its_finish_write_the_lone_launch_row(dtype, numel):
    x = sprinkled(numel, dtype, numel, DEV)
    scratch = _Scratch(1)
    cupy_stats.basic_stats_scratch_into(x, scratch.address(0))
    scratch.finish()
    row = torch.empty(ROW, dtype=torch.float64, device=DEV)
    cupy_stats.basic_stats_into(x, row.data_ptr())
    assert torch.equal(bits(scratch.rows[0]), bits(row)), (dtype, numel)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numels", [(1000, 37, 5000), (3, 1 << 20), (1 << 22, 1 << 21, 1 << 23), (1 << 23, 17)])
def test_a_group_launch_and_its_finish_write_the_group_launch_rows(dtype, numels):
    xs = [sprinkled(n, dtype, i + sum(numels), DEV) for i, n in enumerate(numels)]
    scratch = _Scratch(len(xs))
    cupy_stats.basic_stats_group_scratch_into([(x, scratch.address(i)) for i, x in enumerate(xs)])
    scratch.finish()
    rows = torch.empty((len(xs), ROW), dtype=torch.float64, device=DEV)
    cupy_stats.basic_stats_group_into([(x, rows[i].data_ptr()) for i, x in enumerate(xs)])
    assert torch.equal(bits(scratch.rows), bits(rows)), (dtype, numels)


def test_a_scratch_is_written_once_and_a_row_without_one_is_left_alone():
    xs = [sprinkled(n, torch.bfloat16, n, DEV) for n in (5000, 1 << 20)]
    expected = torch.empty((2, ROW), dtype=torch.float64, device=DEV)
    for i, x in enumerate(xs):
        cupy_stats.basic_stats_into(x, expected[i].data_ptr())
    scratch = _Scratch(3)
    cupy_stats.basic_stats_scratch_into(xs[0], scratch.address(0))
    cupy_stats.basic_stats_scratch_into(xs[1], scratch.address(2))
    scratch.finish()
    assert torch.equal(bits(scratch.rows[0]), bits(expected[0]))
    assert torch.equal(bits(scratch.rows[2]), bits(expected[1]))
    assert scratch.rows[1].isnan().all()  # no scratch launch for row 1: not written
    scratch.rows.fill_(-1.0)
    scratch.finish()  # the scratches were marked empty: nothing is written again
    assert (scratch.rows == -1.0).all()
    cupy_stats.basic_stats_scratch_into(xs[0], scratch.address(1))  # a scratch used again
    scratch.finish()
    assert torch.equal(bits(scratch.rows[1]), bits(expected[0])) and (scratch.rows[0] == -1.0).all()


def test_a_cuda_slab_writes_its_scratch_rows_before_they_are_read():
    xs = [sprinkled(n, torch.float16, n + 1, DEV) for n in (300, 1 << 18, 77)]
    slab = RowSlab(DEV, ROW)
    taken = [slab.take_scratch(cupy_stats) for _ in xs]
    for (_, address), x in zip(taken, xs):
        cupy_stats.basic_stats_scratch_into(x, address)
    expected = torch.empty((len(xs), ROW), dtype=torch.float64, device=DEV)
    for i, x in enumerate(xs):
        cupy_stats.basic_stats_into(x, expected[i].data_ptr())
    slab.start_host_copy()
    torch.cuda.synchronize()
    assert torch.equal(bits(slab.host_tensor()), bits(expected))
    assert torch.equal(bits(slab.row(taken[1][0])), bits(expected[1]))
