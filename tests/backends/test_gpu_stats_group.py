"""The grouped statistics launch (``ted_stats_group``, `cupy_stats.basic_stats_group_into`) on the GPU: each
tensor's row is bit for bit the row of a lone ``ted_stats`` launch with as many blocks as the group gave it (the
oracle: the lone kernel launched with that grid), for tensors with NaN, infinities, signed zeros and subnormals, of
every kernel dtype, in groups of two and three whose lone grids fit in one wave (then the rows are the rows of
`basic_stats_into` itself) and groups that share the wave; strided and misaligned inputs give their contiguous
copy's row; and a tedebug `Linear` on the GPU logs with two grouped launches per step what it logs with lone
launches.  Every test needs CUDA and CuPy."""

import numpy as np
import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.backends import cupy_stats
from tedebug.backends.cupy_runtime import THREADS, TICKETS, dtype_options, get_kernel, sm_count, workspace
from tedebug.backends.launch import launch
from tedebug.stats import launch_group

from support.kernel_inputs import sprinkled

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROW = len(cupy_stats.BASIC_ROW_KEYS)


def _tensor(numel: int, dtype, seed: int) -> torch.Tensor:
    return sprinkled(numel, dtype, seed, DEV)


def _lone_row(x: torch.Tensor, grid: int) -> torch.Tensor:
    """The row of ``ted_stats`` launched alone on `x` with `grid` blocks."""
    row = torch.empty(ROW, dtype=torch.float64, device=DEV)
    partials, tickets = workspace(DEV)
    kernel = get_kernel("stats.cu", "ted_stats", dtype_options(x))
    args = (x.data_ptr(), np.int64(x.numel()), partials, tickets + 4 * TICKETS["stats"], row.data_ptr())
    launch(kernel, grid, THREADS, args, DEV)
    return row


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "numels",
    [
        (1000, 37, 5000),  # small: every lone grid fits, the rows are `basic_stats_into`'s
        (3, 1 << 20),
        (1 << 22, 1 << 21, 1 << 23),  # large: the wave is shared
        (1 << 23, 17, 1 << 22),
    ],
)
def test_rows_are_lone_launches_with_the_group_grids(dtype, numels):
    xs = [_tensor(n, dtype, i + sum(numels)) for i, n in enumerate(numels)]
    rows = torch.full((len(xs), ROW), float("nan"), dtype=torch.float64, device=DEV)
    cupy_stats.basic_stats_group_into([(x, rows[i].data_ptr()) for i, x in enumerate(xs)])
    vec = 16 // xs[0].element_size()
    grids = cupy_stats.group_grids(list(numels), vec, cupy_stats.STATS_BLOCKS_PER_SM * sm_count(0))
    for i, (x, grid) in enumerate(zip(xs, grids)):
        assert torch.equal(_bits(rows[i]), _bits(_lone_row(x, grid))), (dtype, numels, i)
        lone = torch.empty(ROW, dtype=torch.float64, device=DEV)
        cupy_stats.basic_stats_into(x, lone.data_ptr())
        if sum(min(cupy_stats.STATS_BLOCKS_PER_SM * sm_count(0), (max(n // vec, 1) + 255) // 256) for n in numels) <= (
            cupy_stats.STATS_BLOCKS_PER_SM * sm_count(0)
        ):
            assert torch.equal(_bits(rows[i]), _bits(lone))  # the lone grids fit: `basic_stats_into`'s rows
        else:  # fewer blocks than alone: extrema and counts the same; sums up to their summation order (the
            # kernel adds 16-element fp32 chunks, whose members follow the grid: fp32 rounding of each chunk)
            keys = cupy_stats.BASIC_ROW_KEYS
            value = dict(zip(keys, lone.tolist()))
            for j, k in enumerate(keys):
                a, b = rows[i, j].item(), lone[j].item()
                if k not in ("sum", "m2", "abs_sum", "sq_sum"):
                    assert torch.equal(_bits(rows[i, j]), _bits(lone[j])), k
                elif not (a == b or (a != a and b != b)):
                    scale = value["abs_sum"] if k in ("sum", "abs_sum") else value["sq_sum"]
                    assert abs(a - b) <= 2.0**-20 * scale, (k, a, b)


def test_strided_and_misaligned_inputs():
    base = _tensor(4096 + 8, torch.bfloat16, 5)
    strided = base[: 64 * 64].reshape(64, 64).t()
    misaligned = base[1 : 1 + 4096]
    rows = torch.empty((2, ROW), dtype=torch.float64, device=DEV)
    cupy_stats.basic_stats_group_into([(strided, rows[0].data_ptr()), (misaligned, rows[1].data_ptr())])
    for i, x in enumerate((strided, misaligned)):
        lone = torch.empty(ROW, dtype=torch.float64, device=DEV)
        cupy_stats.basic_stats_into(x.contiguous().clone(), lone.data_ptr())
        assert torch.equal(_bits(rows[i]), _bits(lone))


def test_a_layer_logs_the_same_with_grouped_launches(tmp_path, monkeypatch):
    stats = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
    tensors = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]

    def run(name):
        torch.manual_seed(3)
        layer = tedebug.nn.Linear(64, 48, name="lin").to(DEV, torch.bfloat16)
        x = torch.randn(4, 16, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        section = {"LogTensorStats": {"enabled": True, "stats": stats, "tensors": tensors, "freq": 1}}
        config = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": section}}
        debug_api.initialize(config, log_dir=str(tmp_path / name))
        try:
            for _ in range(2):
                y = layer(x)
                y.float().square().sum().backward()
                debug_api.step()
        finally:
            debug_api.end_debug()
        (log,) = (tmp_path / name).rglob("*.jsonl")
        return log.read_text().splitlines()

    groups = []
    original = cupy_stats.basic_stats_group_scratch_into  # (the engine's launch: rows written at the step's end)
    monkeypatch.setattr(
        cupy_stats, "basic_stats_group_scratch_into", lambda items: groups.append(len(items)) or original(items)
    )
    grouped = run("grouped")
    assert groups == [3, 3, 3, 3]  # per step: the forward's and the backward's three tensors, one launch each
    monkeypatch.setattr(launch_group, "pending", lambda: None)
    assert run("alone") == grouped and len(grouped) == 2 * 6 * len(stats)
