"""A buffer's emitters (`StatBuffer.emitters`: one finalizer per statistic) give, through a step's `ScalarBatch`,
every final value of a merged row with the same bits as `finalize` (the formulas on a column mapping), in record
order, for every statistic kind, on rows holding zeros of both signs, infinities and NaN.  (The quantized kinds'
finalizers resolve their columns' positions once, as the high-precision ones do, and share `finalize`'s formula
helpers, so for them this checks the positions and the wiring; for the blockwise kind a buffer's finalizer is
`finalize` itself.  The formulas are tested with the statistics definitions.)"""

from __future__ import annotations

import math
import random

from tedebug.sinks.batch import ScalarBatch
from tedebug.stats.definitions import HP_KINDS, QUANTIZED_KINDS, StatRequest, columns_for, finalize, finalizer


def _requests():
    hp = [StatRequest.parse_hp(kind) for kind in HP_KINDS]
    hp.append(StatRequest.blockwise(4, 1, False))
    quantized = [StatRequest(kind, kind, recipe="", columnwise=False) for kind in QUANTIZED_KINDS]
    quantized += [StatRequest(f"mxfp8_{kind}_columnwise", kind, recipe="mxfp8", columnwise=True) for kind in ("mse",)]
    return hp, quantized


def _key(value):
    """Bits of a float result, NaN as one marker (the formulas return Python floats)."""
    assert type(value) is float
    return "nan" if math.isnan(value) else (value, math.copysign(1.0, value))


def _rows(columns, rng):
    """Merged rows in `columns` order: signed values where a partial has a sign (min, max, sum), magnitudes
    elsewhere, with zeros of both signs, infinities and NaN among them."""
    signed = {"min", "max", "sum"}
    for i in range(300):
        row = []
        for column in columns:
            if column.name == "numel":
                row.append(float(rng.choice([0, 1, 2, 7, 4096])))
            elif i % 3 == 0:
                special = [0.0, -0.0, 1.0, 2.0, 1e-30, 3e38, math.inf, math.nan]
                row.append(rng.choice(special + ([-math.inf, -5.0] if column.name in signed else [])))
            elif column.name in signed:
                row.append(rng.uniform(-1e3, 1e3))
            else:
                row.append(abs(rng.gauss(0, 10)))
        yield row


def emitters(names, requests, columns):
    """A buffer's emitters, as `StatBuffer` builds them."""
    return tuple((name, r.name, finalizer(r, columns)) for name, r in zip(names, requests))


def test_batch_values_equal_finalize_bit_for_bit():
    rng = random.Random(14)
    for requests in _requests():
        columns = columns_for(requests)
        built = emitters([f"L_x_{r.name}" for r in requests], requests, columns)
        assert [(name, stat) for name, stat, _ in built] == [(f"L_x_{r.name}", r.name) for r in requests]
        rows = list(_rows(columns, rng))
        batch = ScalarBatch([(built, row, 7, "L", "x") for row in rows])
        values = batch.values
        oracle = [finalize(r, dict(zip(columns, row))) for row in rows for r in requests]
        assert list(map(_key, values)) == list(map(_key, oracle))


def test_batch_runs_each_finalizer_once_per_row():
    requests = [StatRequest.parse_hp(kind) for kind in ("min", "max", "mean", "std", "dynamic_range")]
    columns = columns_for(requests)
    calls = []

    def counted(built):
        """`built` whose finalizers count their calls."""

        def count(value_of):
            def wrapped(row):
                calls.append(1)
                return value_of(row)

            return wrapped

        return tuple((name, stat, count(value_of)) for name, stat, value_of in built)

    first = counted(emitters(["a_min", "a_max", "a_mean", "a_std", "a_dr"], requests, columns))
    second = counted(emitters(["b_min", "b_max", "b_mean", "b_std", "b_dr"], requests, columns))
    rng = random.Random(3)
    rows = [next(_rows(columns, rng)) for _ in range(2)]
    batch = ScalarBatch([(first, rows[0], 7, "a", "x"), (second, rows[1], 7, "b", "x")])
    values = batch.values
    assert len(calls) == 10 and len(values) == 10 and len(batch) == 10
    expected = [finalize(r, dict(zip(columns, row))) for row in rows for r in requests]
    assert list(map(_key, values)) == list(map(_key, expected))
    assert [record[0] for record in batch] == ["a_min", "a_max", "a_mean", "a_std", "a_dr"] + [
        "b_min",
        "b_max",
        "b_mean",
        "b_std",
        "b_dr",
    ]
    assert len(calls) == 10  # building the records reused the values: no finalizer ran again
