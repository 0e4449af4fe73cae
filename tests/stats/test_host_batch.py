"""The step's batch of CPU basic statistics (`tedebug.stats.host_batch`, `torch_ref.basic_partial_rows`) gives every
buffer exactly the row the per-tensor host pass (`torch_ref.basic_partial_values`) gives it, bit for bit (the sign of
a zero, NaN and infinities included), and a staged feed computes nothing (counted calls and operators).

The oracle is the per-tensor pass: `basic_partial_values` of each tensor alone, and a `StatsEngine` whose staging is
switched off (every feed reduced at once, as before the batch)."""

from __future__ import annotations

import math
import struct
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from tedebug.backends import torch_ref
from tedebug.stats import StatsEngine
from tedebug.stats import host_batch
from tedebug.stats.readback import OneRowStepInFlight, RowsInFlight

from support.concurrency import AtenCounter

STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range", "nan_count", "inf_count")
NAN, INF = float("nan"), float("inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _bits(values) -> List[object]:
    """Exact keys of floats: the IEEE bits (so -0.0 != 0.0), every NaN one marker."""
    return ["nan" if math.isnan(v) else struct.pack("<d", v) for v in values]


def _subnormal(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).smallest_normal / 4


def _adversarial(seed: int = 1400) -> List[torch.Tensor]:
    """Tensors of several element counts and every batch dtype: zeros of both signs (alone, mixed, as the only
    values), NaN and infinities (with and without zeros), subnormals, float64 values whose squares or sum overflow,
    a single element, non-contiguous views, tensors that require grad."""
    g = torch.Generator().manual_seed(seed)
    cases: List[torch.Tensor] = []
    for dtype in DTYPES:
        tiny = _subnormal(dtype)
        cases += [
            torch.tensor([0.0, -0.0, 1.0, NAN], dtype=dtype),
            torch.tensor([0.0, -0.0, -1.0, INF], dtype=dtype),
            torch.tensor([-INF, INF, 3.0, 0.0], dtype=dtype),
            torch.tensor([NAN, NAN, -0.0, 2.0], dtype=dtype),
            torch.tensor([-0.0, 0.0] * 9, dtype=dtype),
            torch.tensor([0.0, -0.0] * 9, dtype=dtype),
            -torch.zeros(18, dtype=dtype),
            torch.zeros(18, dtype=dtype),
            torch.tensor([tiny, -tiny, 0.0, tiny * 2], dtype=dtype),
            torch.tensor([tiny] * 18, dtype=dtype),
            torch.tensor([2.5], dtype=dtype),
            torch.tensor([-0.0], dtype=dtype),
            torch.tensor([0.0], dtype=dtype),
            torch.tensor([NAN], dtype=dtype),
        ]
        for n in (4, 18, 256, 1000):
            x = torch.randn(n, generator=g).to(dtype)
            mask = torch.rand(n, generator=g)
            x[mask < 0.15] = 0.0
            x[mask > 0.9] = -0.0
            cases.append(x)
            cases.append((torch.randn(n, generator=g) * 3 + 1).to(dtype))  # no zero: the smallest magnitude path
            cases.append(torch.relu(torch.randn(n, generator=g)).to(dtype))  # min is +0
            cases.append(-torch.relu(torch.randn(n, generator=g)).to(dtype))  # max is a zero
            cases.append(torch.randn(n, 2, generator=g).to(dtype).t()[0])  # non-contiguous (strided) view
            cases.append(torch.randn(2, n, generator=g).to(dtype).t())  # non-contiguous, row-major order differs
            cases.append(torch.randn(n + 1, generator=g).to(dtype)[1:])  # a storage offset
            cases.append(torch.randn(n, generator=g).to(dtype).requires_grad_())
    cases += [
        torch.tensor([1e308, 1e308, -1e308, 0.0], dtype=torch.float64),  # finite values, a float64 sum that overflows
        torch.tensor([1e300, -1e300, 2.0, 0.0], dtype=torch.float64),  # squares overflow, the sum is finite
        (torch.randn(18, generator=g) * 1e200).double(),
        torch.tensor([5e-324, -5e-324, 0.0, 1e-310], dtype=torch.float64),
        torch.tensor([65504.0, -65504.0, 6e-8], dtype=torch.float16),
    ]
    # long rows: one [k, n] matrix larger than torch's grain size (rows of one reduction split between threads)
    for n in (8192, torch_ref.HOST_PASS_MAX_NUMEL):
        for _ in range(5):
            x = torch.randn(n, generator=g)
            x[torch.rand(n, generator=g) < 0.1] = -0.0
            cases.append(x)
    return cases


def _flat64(x: torch.Tensor) -> np.ndarray:
    return x.detach().reshape(-1).to(torch.float64).numpy()


def test_batched_rows_equal_the_lone_pass_bit_for_bit():
    """`basic_partial_rows` of the tensors of one (element count, dtype) stacked as rows: every row is
    `basic_partial_values` of its tensor alone."""
    groups: Dict[Tuple[int, torch.dtype], List[torch.Tensor]] = {}
    for x in _adversarial():
        groups.setdefault((x.numel(), x.dtype), []).append(x)
    assert max(len(members) for members in groups.values()) >= 8
    checked = 0
    for (n, dtype), members in groups.items():
        matrix = np.stack([_flat64(x) for x in members])
        before = matrix.copy()
        rows = torch_ref.basic_partial_rows(matrix, dtype)
        assert len(rows) == len(members)
        for x, row in zip(members, rows):
            assert _bits(row) == _bits(torch_ref.basic_partial_values(x)), (x, row)
            checked += 1
        assert np.array_equal(matrix, before, equal_nan=True)  # the staged rows are only read
    assert checked == len(_adversarial())


@pytest.mark.parametrize("count, n, block", [(41, 64, None), (300, 256, None), (300, 256, 1000)])
def test_batched_rows_of_a_group_alone_and_among_others(monkeypatch, count, n, block):
    """One tensor gives the same row whether its group holds it alone or with many others (300 x 256: the rows are
    summed in several torch calls, each below the grain size; and reduced in blocks of 3 rows)."""
    if block is not None:
        monkeypatch.setattr(torch_ref, "_BATCH_BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(1401)
    members = [torch.randn(n, generator=g) * (i + 1) for i in range(count)]
    members[7][3] = -0.0
    members[count - 1][:] = 0.0
    members[count - 2][5] = NAN
    together = torch_ref.basic_partial_rows(np.stack([_flat64(x) for x in members]), torch.float32)
    for x, row in zip(members, together):
        alone = torch_ref.basic_partial_rows(_flat64(x)[None, :].copy(), torch.float32)[0]
        assert _bits(row) == _bits(alone) == _bits(torch_ref.basic_partial_values(x))


# ------------------------------------------------------------------------------------------------ engine
class _Capture:
    def __init__(self):
        self.records = []

    def log_scalar(self, name, value, iteration, **kw):
        self.records.append((name, value, iteration))


def _engine(staged: bool) -> StatsEngine:
    engine = StatsEngine(_Capture())
    if not staged:  # the oracle: every feed reduced when it comes, by the per-tensor host pass
        engine._host_batch.stage = lambda buffer, tensor, rows_of: False  # type: ignore[method-assign]
    return engine


def _run(staged: bool, script) -> Tuple[list, list]:
    """Run `script(engine, feed, step)` on a fresh engine; (the rows each step read back, emitted records) as bits.

    The rows are recorded as `StatsEngine.step` itself reads them (`RowsInFlight.host_rows` and
    `OneRowStepInFlight.values`, wrapped), so the staged feeds are resolved by the step, as in training, and not by
    a read of the test's own."""
    engine = _engine(staged)
    rows: list = []
    real_host_rows, real_values = RowsInFlight.host_rows, OneRowStepInFlight.values

    def recording_host_rows(self):
        host = real_host_rows(self)
        rows.append([(tuple(entry.key), _bits(host[entry.key])) for entry in self.entries])
        return host

    def recording_values(self):
        values = real_values(self)
        rows.append([(tuple(b.key), _bits(row)) for b, row in zip(self.layout.buffers, values)])
        return values

    def feed(layer, x, iteration, tensor="activation", is_weight=False):
        engine.feed(layer, tensor, STATS, x, iteration=iteration, is_weight=is_weight)

    def step(iteration):
        engine.step(iteration)

    RowsInFlight.host_rows = recording_host_rows  # type: ignore[method-assign]
    OneRowStepInFlight.values = recording_values  # type: ignore[method-assign]
    try:
        script(engine, feed, step)
    finally:
        RowsInFlight.host_rows = real_host_rows  # type: ignore[method-assign]
        OneRowStepInFlight.values = real_values  # type: ignore[method-assign]
    records = [(name, _bits([value]), iteration) for name, value, iteration in engine.metric_logger.records]
    return rows, records


def _same_as_per_tensor(script) -> Tuple[list, list]:
    staged = _run(True, script)
    reference = _run(False, script)
    assert staged == reference
    assert staged[0] and staged[1], "the script read back or emitted nothing"
    return staged


def test_engine_rows_equal_the_per_tensor_path_on_adversarial_steps():
    """Every adversarial tensor in one step (mixed element counts and dtypes), as one buffer each and also all fed
    as micro-batches of one buffer per dtype (merged in feed order), for three iterations."""
    cases = _adversarial(1402)

    def script(engine, feed, step):
        for iteration in range(3):
            for i, x in enumerate(cases):
                feed(f"t{i}", x, iteration)
                feed(f"mb_{x.dtype}", x, iteration)
            step(iteration)

    rows, _ = _same_as_per_tensor(script)
    assert len(rows) == 3 and len(rows[0]) == len(cases) + len(DTYPES)


def test_microbatches_of_different_counts_merge_in_feed_order():
    """Buffers fed 1 to 5 micro-batches in a step (merged together, a feed position at a time) and a weight fed three
    times (its first feed counts) read back the per-tensor path's rows, bit for bit, over two iterations."""
    g = torch.Generator().manual_seed(1405)
    xs = [torch.randn(8, 24, generator=g) * (1.0 + 10.0 * i) + i for i in range(5)]

    def script(engine, feed, step):
        for iteration in range(2):
            for position in range(5):
                for layer in range(6):
                    if position < 1 + layer % 5:
                        feed(f"L{layer}", xs[(position + layer) % 5] * (iteration + 1), iteration)
                if position < 3:
                    feed("L0", xs[position], iteration, tensor="weight", is_weight=True)
            step(iteration)

    rows, _ = _same_as_per_tensor(script)
    assert len(rows) == 2 and len(rows[0]) == 7


def test_tensors_changed_after_the_feed_keep_their_fed_values():
    """A weight the optimizer changes in place after its feed (and fed again: a weight keeps its first feed of the
    step) and an activation changed after its feed: the step reads the values they had when fed."""
    g = torch.Generator().manual_seed(1403)
    weight = torch.randn(16, 16, generator=g)
    activation = torch.randn(8, 16, generator=g)
    fed_values = (weight.clone(), activation.clone())

    def script(engine, feed, step):
        w, a = weight.clone(), activation.clone()
        for iteration in range(2):
            feed("L", w, iteration, tensor="weight", is_weight=True)
            feed("L", a, iteration)
            w.mul_(-3.0).add_(1.0)  # the optimizer's step
            feed("L", w, iteration, tensor="weight", is_weight=True)  # ignored: the first feed counts
            a.zero_()
            step(iteration)

    rows, records = _same_as_per_tensor(script)
    values = {(name, iteration): bits for name, bits, iteration in records}
    assert values[("L_weight_max", 0)] == _bits([fed_values[0].max().item()])
    assert values[("L_activation_min", 0)] == _bits([fed_values[1].min().item()])
    assert values[("L_weight_max", 1)] == _bits([(fed_values[0] * -3.0 + 1.0).max().item()])


def test_freq_schedules_and_mixed_paths_in_one_buffer():
    """Feeds on every other iteration (a freq 2 schedule), a buffer fed a staged tensor, then one above
    `HOST_PASS_MAX_NUMEL` (reduced at once), then a staged one again, all merged in feed order."""
    g = torch.Generator().manual_seed(1404)
    small = [torch.randn(8, 32, generator=g) - i for i in range(3)]
    large = torch.randn(torch_ref.HOST_PASS_MAX_NUMEL + 8, generator=g)
    large[5] = -0.0

    def script(engine, feed, step):
        for iteration in range(6):
            if iteration % 2 == 0:
                feed("L", small[0], iteration)
                feed("L", large, iteration)
                feed("L", small[1].to(torch.bfloat16), iteration)
                feed("M", small[2], iteration)
            step(iteration)

    rows, _ = _same_as_per_tensor(script)
    assert [len(r) for r in rows] == [2, 2, 2]  # L and M at iterations 0, 2, 4; the idle steps read nothing back


def test_a_full_staging_falls_back_to_the_per_tensor_pass(monkeypatch):
    """Feeds beyond `STAGED_ELEMENTS_MAX` staged elements in one step, and feeds while torch.compile traces, are
    reduced at once (the per-tensor pass), with the same rows."""
    monkeypatch.setattr(host_batch, "STAGED_ELEMENTS_MAX", 600)
    g = torch.Generator().manual_seed(1405)
    tensors = [torch.randn(256, generator=g) * (i + 1) for i in range(5)]

    def script(engine, feed, step):
        for i, x in enumerate(tensors):
            feed(f"t{i}", x, 0)
            feed("all", x, 0)
        step(0)

    lone = _counting(monkeypatch, "basic_partial_values")
    _same_as_per_tensor(script)
    # staged run: t0 and all(t0) staged (512 elements); t1 and all(t1) do not fit and are reduced at once (2 calls),
    # all(t1) after resolving the batch (its buffer's staged feed merges first), which empties the staging; t2 and
    # all(t2) staged; t3 and all(t3) reduced at once (2 calls); t4 and all(t4) staged.  The oracle run: 10 calls.
    assert lone.calls == 4 + 10
    monkeypatch.setattr(host_batch, "compiling", lambda: True)
    lone.calls = 0
    _same_as_per_tensor(script)
    assert lone.calls == 10 + 10


# ------------------------------------------------------------------------------------------------ call counts
class _Calls:
    def __init__(self):
        self.calls = 0
        self.rows = 0


def _counting(monkeypatch, name: str) -> _Calls:
    counter = _Calls()
    real = getattr(torch_ref, name)

    def counting(*args, **kwargs):
        counter.calls += 1
        if name == "basic_partial_rows":
            counter.rows += args[0].shape[0]
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_ref, name, counting)
    return counter


def test_a_staged_feed_runs_no_reduction(monkeypatch):
    """Feeds of small CPU tensors (float32, bfloat16, float64, one that requires grad, a non-contiguous one) run no
    reduction and no per-tensor pass: no statistics function is called and no computing aten operator runs but the
    copy a bfloat16 tensor needs (numpy copies the others); the step reduces them with one batch call per (element
    count, dtype)."""
    g = torch.Generator().manual_seed(1406)
    tensors = [
        torch.randn(8, 32, generator=g),
        torch.randn(8, 32, generator=g).to(torch.bfloat16),
        torch.randn(8, 32, generator=g).double(),
        torch.randn(8, 32, generator=g).requires_grad_(),
        torch.randn(32, 8, generator=g).t(),
        torch.randn(4, 4, generator=g),
    ]
    engine = StatsEngine(_Capture())
    for i, x in enumerate(tensors):  # a first step: buffers and staging matrices exist from here on
        engine.feed(f"t{i}", "activation", STATS, x, iteration=0)
    engine.step(0)
    counters = {name: _counting(monkeypatch, name) for name in _STATISTICS_FUNCTIONS}
    with AtenCounter() as counter:
        for i, x in enumerate(tensors):
            engine.feed(f"t{i}", "activation", STATS, x, iteration=1)
    assert {name: c.calls for name, c in counters.items()} == dict.fromkeys(_STATISTICS_FUNCTIONS, 0)
    computing = [op for op in counter.ops if op not in ("view", "detach", "alias", "t", "select", "slice")]
    assert computing == ["copy_"], counter.ops  # the bfloat16 tensor into its float64 staging row
    engine.step(1)
    assert counters["basic_partial_rows"].calls == 4  # [256] float32 / bfloat16 / float64, [16] float32
    assert counters["basic_partial_rows"].rows == len(tensors)
    assert counters["basic_partial_values"].calls == counters["basic_partials"].calls == 0
    assert len(engine.metric_logger.records) == 2 * len(tensors) * len(STATS)


_STATISTICS_FUNCTIONS = (
    "basic_partial_rows",
    "basic_partial_values",
    "_small_basic_partial_values",
    "basic_partials",
    "basic_partials_row",
)


# ------------------------------------------------------------------------------------------------ training run
def _training_run(tmp_path, staged: bool, monkeypatch) -> Dict[Tuple[str, int], object]:
    """A converted two-layer model trained 5 iterations with SGD (weights updated in place before each
    `debug_api.step()`), a zero of each sign in the input, LogTensorStats on all six tensors at freq 2: the emitted
    values as bits."""
    import tedebug
    from tedebug import debug_api

    from support.features import RecordingSink, debug_session

    with monkeypatch.context() as patch:
        if not staged:
            patch.setattr(host_batch.HostBatch, "stage", lambda self, buffer, tensor, rows_of: False)
        torch.manual_seed(3)
        model = tedebug.convert_model(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
        x[0, :3], x[1, :2] = -0.0, 0.0
        sink = RecordingSink()
        tensors = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]
        config = {
            "every_other": {
                "enabled": True,
                "layers": {"layer_name_regex_pattern": ".*"},
                "transformer_engine": {
                    "LogTensorStats": {"enabled": True, "stats": list(STATS), "tensors": tensors, "freq": 2}
                },
            },
        }
        with debug_session(config, tmp_path / ("staged" if staged else "lone"), sink=sink):
            for _ in range(5):
                optimizer.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()  # the weights change in place after their feed, before the step
                debug_api.step()
    return {key: _bits([value])[0] for key, value in sink.values().items()}


def test_a_training_run_logs_the_per_tensor_values(tmp_path, monkeypatch):
    """The same run with the staging and with every feed reduced at once emits the same bits, weights included."""
    staged = _training_run(tmp_path, True, monkeypatch)
    assert staged == _training_run(tmp_path, False, monkeypatch)
    assert len(staged) == 3 * (2 * 6 - 1) * len(STATS)  # iterations 0, 2, 4; the first layer has no dgrad
    assert {iteration for _, iteration in staged} == {0, 2, 4}
