"""The multi-rank deferred read-back's batched code on a CUDA device, which the CPU tests
(tests/stats/test_deferred_merge.py, tests/stats/test_stats_definitions.py) never run:

- the vector a rank sends over an NCCL group (`GroupReducer._vector` with the CUDA device): the slab rows the
  statistics kernels wrote are gathered on the device (`RowSlab.rows` with an index tensor made through `_on`:
  pinned memory and a non-blocking copy), the quantize kernels' statistics vectors are stacked on the device, and
  every other buffer gets its own row (`_device_row`).  Fed by a real `StatsEngine` with CUDA tensors (bf16 and
  fp32), so the kernel backend's scratch launches leave the slab rows to be written by ``finish_rows`` when they
  are read, and FP8 current scaling / MXFP8 quantize on the GPU.  Every slot must hold, bit for bit, the row the
  rule per buffer gives (`_device_row`, one buffer at a time; a slab row alone also the row of a lone statistics
  launch), and the vector must be bit for bit the one built for a gloo group (the CPU device: every CUDA row takes
  its own row through a blocking copy).
- `combine_row_batches` against `combine_rows` of each batch, bit for bit, on the CPU and on CUDA, for the columns
  of every high-precision statistic and of every FP8 statistic (both directions, two recipes), with zeros, tiny,
  huge, negative and non-finite values and counts of zero.

(`_merge_slots` is not here: it merges the gathered matrix on the host, whose rows it reads through numpy; it
takes no device tensor.)

The tests marked ``gpu`` need CUDA and CuPy (skipped otherwise, tests/conftest.py)."""

import math

import pytest
import torch

from tedebug.stats import StatsEngine
from tedebug.stats import distributed
from tedebug.stats import launch_group
from tedebug.stats.definitions import (
    HP_KINDS,
    QUANTIZED_KINDS,
    StatRequest,
    columns_for,
    combine_row_batches,
    combine_rows,
)
from tedebug.stats.distributed import _SLOT_HEADER, GroupLayout, GroupReducer

from support.features import RecordingSink
from support.kernel_inputs import bits, lone_row

DEV = torch.device("cuda")
CPU = torch.device("cpu")


def _nccl_device() -> torch.device:
    """The device an NCCL group's collectives take (`distributed.collective_device`): the current CUDA device, with
    its index, as the tensors' devices have it (a plain ``cuda`` device compares unequal to ``cuda:0``, and every
    buffer would take its own row)."""
    return torch.device("cuda", torch.cuda.current_device())


HP_REQUESTS = tuple(StatRequest.parse_hp(name) for name in ("min", "max", "std", "l1_norm"))
FP8_REQUESTS = tuple(StatRequest(name, name, recipe="") for name in ("underflows%", "mse", "scale_inv_min"))
#: a row of the general path (basic and quantization families together): a float64 tensor on the feed's device
MIXED_REQUESTS = (StatRequest.parse_hp("min"), StatRequest("underflows%", "underflows%", recipe=""))


def _vector_engine():
    """A `StatsEngine` fed one step of buffers of every kind, most from CUDA tensors, through the real kernel
    backend; returns (engine, {layer: the high-precision tensor of each slab row fed alone, outside a launch group})."""
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer
    from tedebug.quantization.mxfp8 import MXFP8Quantizer

    engine = StatsEngine(RecordingSink())
    g = torch.Generator().manual_seed(11)

    def randn(*shape, dtype=torch.float32, scale=1.0, device=DEV):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype).to(device)

    alone = {}
    # a CPU tensor: its row is read on the host and travels in the header
    engine.feed("host", "activation", HP_REQUESTS, randn(8, 16, device=CPU), iteration=0)
    for i in range(5):  # one slab row each (bf16 and fp32): batched
        x = randn(32, 64, dtype=torch.bfloat16 if i % 2 else torch.float32, scale=10.0**i)
        engine.feed(f"l{i}", "activation", HP_REQUESTS, x, iteration=0)
        alone[f"l{i}"] = x
    for dtype in (torch.bfloat16, torch.float32):  # two slab rows (microbatches): its own row
        engine.feed("twice", "activation", HP_REQUESTS, randn(16, 64, dtype=dtype), iteration=0)
    x = randn(8, 8)  # other columns: batched with the slab's other rows of its positions
    engine.feed("few", "gradient", HP_REQUESTS[:1], x, iteration=0)
    alone["few"] = x
    opened = launch_group.open_group()  # one grouped scratch launch of three slab rows (LogTensorStats' usual feed)
    try:
        for i in range(3):
            engine.feed(f"g{i}", "output", HP_REQUESTS, randn(24, 40, dtype=torch.bfloat16, scale=3.0), iteration=0)
    finally:
        launch_group.close_group(opened)
    x = randn(64, 128, dtype=torch.bfloat16)  # a row of the general path, on the device: its own row
    q = Float8CurrentScalingQuantizer("E4M3").quantize(x)
    engine.feed("mixed", "activation", MIXED_REQUESTS, x, iteration=0, quantized={"": q})
    # a quantize kernel's statistics vector holding every column (numel included), on the device: batched (the
    # one-launch cast of the 16-bit fast shape, an fp32 input, a shape off the fast one)
    for i, (shape, dtype) in enumerate(
        (((64, 128), torch.bfloat16), ((16, 32), torch.float32), ((96, 64), torch.bfloat16))
    ):
        x = randn(*shape, dtype=dtype, scale=10.0 ** (2 * i - 2))
        q = Float8CurrentScalingQuantizer("E4M3").quantize(x)
        engine.feed(f"q{i}", "activation", FP8_REQUESTS, x, iteration=0, quantized={"": q})
    x = randn(64, 64, dtype=torch.bfloat16)  # an MXFP8 kernel's vector, without the count: its own row
    q = MXFP8Quantizer("E4M3").quantize(x)
    engine.feed("no_count", "activation", FP8_REQUESTS[:2], x, iteration=0, quantized={"": q})
    x = randn(16, 32, device=CPU)  # the host cast's vector, on the CPU: its own row (copied to the device)
    q = Float8CurrentScalingQuantizer("E4M3").quantize(x)
    engine.feed("cpu_vector", "activation", FP8_REQUESTS, x, iteration=0, quantized={"": q})
    return engine, alone


def _slot(layout, vector, key, width):
    at = layout.offsets[key] + _SLOT_HEADER
    return vector[at : at + width]


@pytest.mark.gpu
def test_the_cuda_vector_holds_every_buffers_row_and_batches_the_usual_ones(monkeypatch):
    from tedebug.backends import cupy_stats

    finished = []  # rows written per `finish_rows` launch (the slab's scratch rows, written when they are read)
    real_finish = cupy_stats.finish_rows
    monkeypatch.setattr(cupy_stats, "finish_rows", lambda *args: finished.append(args[-1]) or real_finish(*args))
    engine, alone = _vector_engine()
    buffers = engine._store.fed()
    kinds = {b.key.layer: b for b in buffers}
    assert kinds["host"].host_row is not None and not kinds["host"].slab_rows
    one_slab_row = [b.key.layer for b in buffers if len(b.slab_rows) == 1 and not b.vector_rows]
    assert one_slab_row == ["l0", "l1", "l2", "l3", "l4", "few", "g0", "g1", "g2"]
    assert len(kinds["twice"].slab_rows) == 2
    slabs = {slab for b in buffers for slab, _ in b.slab_rows}
    assert len(slabs) == 1 and next(iter(slabs)).device.type == "cuda"  # one slab of kernel rows on the GPU
    assert kinds["mixed"].row is not None and kinds["mixed"].row.device.type == "cuda"
    vectors = {b.key.layer: b.vector_rows for b in buffers if b.vector_rows}
    assert sorted(vectors) == ["cpu_vector", "no_count", "q0", "q1", "q2"] and all(
        len(v) == 1 for v in vectors.values()
    )
    assert all(
        vectors[f"q{i}"][0].vector.device.type == "cuda" and -1 not in vectors[f"q{i}"][0].positions for i in range(3)
    )
    assert vectors["no_count"][0].vector.device.type == "cuda" and -1 in vectors["no_count"][0].positions
    assert vectors["cpu_vector"][0].vector.device.type == "cpu"
    assert finished == []  # every slab row still in its scratch

    layout = GroupLayout()
    layout.extend({b.key: b.columns for b in buffers})
    layout.extend({("unfed", "activation", ()): kinds["l0"].columns})  # a slot of the layout this rank did not feed
    replicas = {("l1", "activation"): 0.0, ("q2", "activation"): 4.0, ("twice", "activation"): 2.0}
    reducer = GroupReducer()
    own_rows = []
    real = reducer._device_row
    monkeypatch.setattr(reducer, "_device_row", lambda b, d: own_rows.append(b.key.layer) or real(b, d))
    device = _nccl_device()
    vector, mine = reducer._vector(layout, buffers, True, replicas, device)
    # the others went in batches (slab rows gathered, vectors stacked on the device) or with the header
    assert sorted(own_rows) == ["cpu_vector", "mixed", "no_count", "twice"]
    assert finished == [11]  # the scratch rows were written (one chunk) before the vector read them
    assert vector.device.type == "cuda" and vector.dtype == torch.float64 and vector.shape == (layout.length,)
    vector = vector.cpu()

    # the rule per buffer: its fed flag, its replica id and `_device_row` on the device, one buffer at a time
    rule = GroupReducer()
    want = torch.zeros(layout.length, dtype=torch.float64)
    want[0] = 1.0  # pending
    for b in buffers:
        at = layout.offsets[b.key]
        want[at] = 1.0
        want[at + 1] = replicas.get((b.key.layer, b.key.tensor), distributed.NO_REPLICA)
        row = rule._device_row(b, device)
        assert row.device.type == "cuda" and row.dtype == torch.float64
        want[at + _SLOT_HEADER : at + _SLOT_HEADER + len(b.columns)] = row.cpu()
    assert torch.equal(bits(vector), bits(want))
    assert mine == {b.key: want[layout.offsets[b.key] + 1].item() for b in buffers}
    assert finished == [11]  # (written once)

    # a slab row fed alone is the row of a lone statistics launch on its tensor, at the columns' positions
    for layer, x in alone.items():
        b = kinds[layer]
        full = lone_row(x).cpu()
        positions = b.row_positions(b.slab_keys)
        assert torch.equal(bits(_slot(layout, vector, b.key, len(b.columns))), bits(full[list(positions)])), layer
    # a vector's slot: the kernel's vector at the columns' positions (the count added where it has none)
    for layer in ("q0", "q1", "q2"):
        b = kinds[layer]
        v = b.vector_rows[0]
        got = _slot(layout, vector, b.key, len(b.columns))
        assert torch.equal(bits(got), bits(v.vector.cpu()[list(v.positions)])), layer
    b = kinds["no_count"]
    v = b.vector_rows[0]
    got = _slot(layout, vector, b.key, len(b.columns))
    assert got[v.positions.index(-1)].item() == 64 * 64
    assert all(got[i].item() == v.vector[p].item() for i, p in enumerate(v.positions) if p >= 0)

    # the vector for a gloo group (the CPU device): every CUDA row its own row, copied to the host; the same bits
    # (the one merge on the device, `twice`'s two rows, sums two operands: the same on either device)
    own_rows.clear()
    on_host, mine_on_host = reducer._vector(layout, buffers, True, replicas, CPU)
    assert on_host.device.type == "cpu"
    # (the host cast's vector, on the CPU, now goes in a batch)
    assert sorted(own_rows) == sorted(b.key.layer for b in buffers if b.key.layer not in ("host", "cpu_vector"))
    assert torch.equal(bits(on_host), bits(vector)) and mine_on_host == mine


@pytest.mark.gpu
def test_a_vector_of_batched_rows_only_writes_the_scratch_rows_itself(monkeypatch):
    """No buffer of its own row reads the slab first: the batched gather (`RowSlab.rows`) has the scratch rows
    written before it reads them, as the engine's multi-rank deferred step relies on (it starts the collectives
    right after the feeds, with the rows still in their scratch)."""
    from tedebug.backends import cupy_stats

    finished = []
    real_finish = cupy_stats.finish_rows
    monkeypatch.setattr(cupy_stats, "finish_rows", lambda *args: finished.append(args[-1]) or real_finish(*args))
    engine = StatsEngine(RecordingSink())
    g = torch.Generator().manual_seed(5)
    xs = {}
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float32)):
        x = (torch.randn(48, 40, generator=g) * 4.0**i).to(dtype).to(DEV)
        engine.feed(f"l{i}", "weight" if i == 3 else "activation", HP_REQUESTS[: 4 - i % 2], x, iteration=0)
        xs[f"l{i}"] = x
    buffers = engine._store.fed()
    layout = GroupLayout()
    layout.extend({b.key: b.columns for b in buffers})
    reducer = GroupReducer()
    monkeypatch.setattr(reducer, "_device_row", lambda b, d: pytest.fail(f"{b.key} took its own row"))
    assert finished == []
    vector, mine = reducer._vector(layout, buffers, False, {}, _nccl_device())
    assert finished == [4]
    vector = vector.cpu()
    want = torch.zeros(layout.length, dtype=torch.float64)
    for b in buffers:
        at = layout.offsets[b.key]
        want[at], want[at + 1] = 1.0, distributed.NO_REPLICA
        full = lone_row(xs[b.key.layer]).cpu()
        want[at + _SLOT_HEADER : at + _SLOT_HEADER + len(b.columns)] = full[list(b.row_positions(b.slab_keys))]
    assert torch.equal(bits(vector), bits(want))
    assert mine == {b.key: distributed.NO_REPLICA for b in buffers}


# ------------------------------------------------------------------------------------------------ combine on CUDA
#: every high-precision statistic's columns, the blockwise dynamic range's, and every FP8 statistic's of both
#: directions of two recipes (two kinds of m2 columns: the values' and the decode scales')
ALL_COLUMNS = columns_for(
    [StatRequest.parse_hp(name) for name in HP_KINDS]
    + [StatRequest.blockwise(32, 1, True)]
    + [
        StatRequest(f"{recipe}{kind}{'_columnwise' if columnwise else ''}", kind, recipe=recipe, columnwise=columnwise)
        for recipe in ("", "mxfp8_")
        for kind in QUANTIZED_KINDS
        for columnwise in (False, True)
    ]
)
COUNTS = ("numel", "nonzero_count", "nan_count", "inf_count", "underflows_num", "overflows_num", "scale_count")
#: values that make a merge's bits depend on the order of its operations: signed zeros, subnormals, the extremes,
#: cancellations, non-finite values
ADVERSARIAL = (
    0.0,
    -0.0,
    5e-324,
    -5e-324,
    1e-300,
    2.2250738585072014e-308,
    1e300,
    -1e300,
    1.7976931348623157e308,
    -1.7976931348623157e308,
    1.0 + 2.0**-52,
    -1.0,
    3.0,
    math.inf,
    -math.inf,
    math.nan,
)


def _batches(k: int) -> torch.Tensor:
    """[B, K, C] float64 rows of `ALL_COLUMNS` on the CPU: normal rows over 24 decades, then batches of adversarial
    values: counts of zero, rows of zeros, huge values that overflow or cancel, tiny ones, non-finite ones."""
    g = torch.Generator().manual_seed(1000 + k)
    c = len(ALL_COLUMNS)
    counts = [i for i, column in enumerate(ALL_COLUMNS) if column.name in COUNTS]
    rows = torch.randn(12, k, c, generator=g, dtype=torch.float64) * torch.logspace(-12, 12, c, dtype=torch.float64)
    rows[:, :, counts] = torch.randint(0, 1 << 20, (12, k, len(counts)), generator=g).double()
    rows[1] = 0.0  # nothing at all
    rows[2, :, counts] = 0.0  # no element on any rank (mean 0/0), the sums left as they are
    rows[3, 0, counts] = 0.0  # a rank without elements among others
    rows[4] *= 1e296  # sums of huge values: some overflow, depending on the order
    rows[5] *= 1e-310  # subnormal partials
    rows[6] = -rows[6].abs()  # negative values only
    rows[7, :, 1:] = rows[7, :1, 1:]  # equal rows (cancelling deviations from the mean)
    adversarial = torch.tensor(ADVERSARIAL, dtype=torch.float64)
    for b in range(8, 12):  # adversarial values at random places, counts among them
        where = torch.rand(k, c, generator=g) < 0.5
        picks = adversarial[torch.randint(0, len(ADVERSARIAL), (k, c), generator=g)]
        rows[b] = torch.where(where, picks, rows[b])
    rows[11, :, counts] = rows[11, :, counts].abs().floor()  # counts that are counts
    return rows


def _same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (the convention of the CPU test in tests/stats/test_stats_definitions.py)."""
    return got.shape == want.shape and bool(((got == want) | (got.isnan() & want.isnan())).all())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_combine_row_batches_is_combine_rows_of_each_batch_on_the_device(device, k):
    rows = _batches(k).to(device)
    got = combine_row_batches(ALL_COLUMNS, rows)
    assert got.device == rows.device
    for b in range(rows.shape[0]):
        want = combine_rows(ALL_COLUMNS, rows[b])
        assert want.device == rows.device
        assert _same_values(got[b].cpu(), want.cpu()), (b, [c for c, w, x in zip(ALL_COLUMNS, want, got[b]) if w != x])
    # the batches as the multi-rank merge passes them: a contiguous gather of some of them
    picked = rows[[0, 4, 8, 11]].contiguous()
    assert _same_values(combine_row_batches(ALL_COLUMNS, picked).cpu(), got[[0, 4, 8, 11]].cpu())
