"""A buffer's emitters (`StatBuffer.emitters`: its names and one function generated from `FORMULAS` giving every
final value of a merged row, `row_evaluator`) give, through a step's `ScalarBatch`, the same bits as `finalize` (the
formulas spelled out on a column mapping), in record order, for every statistic kind, on rows holding zeros of both
signs, infinities and NaN.  (The formulas themselves are tested with the statistics definitions.)"""

from __future__ import annotations

import math
import random

import pytest

from tedebug.sinks.batch import Emitters, ScalarBatch
from tedebug.stats.definitions import HP_KINDS, QUANTIZED_KINDS, StatRequest, columns_for, finalize, row_evaluator


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
    return Emitters(tuple((name, r.name) for name, r in zip(names, requests)), row_evaluator(requests, columns))


def test_batch_values_equal_finalize_bit_for_bit():
    rng = random.Random(14)
    for requests in _requests():
        columns = columns_for(requests)
        built = emitters([f"L_x_{r.name}" for r in requests], requests, columns)
        assert built.names == tuple((f"L_x_{r.name}", r.name) for r in requests)
        rows = list(_rows(columns, rng))
        batch = ScalarBatch([(built, row, 7, "L", "x") for row in rows])
        values = batch.values
        oracle = [finalize(r, dict(zip(columns, row))) for row in rows for r in requests]
        assert list(map(_key, values)) == list(map(_key, oracle))


def test_batch_evaluates_each_row_once():
    requests = [StatRequest.parse_hp(kind) for kind in ("min", "max", "mean", "std", "dynamic_range")]
    columns = columns_for(requests)
    calls = []

    def counted(built):
        """`built` whose row function counts its calls."""

        def values_of(row):
            calls.append(1)
            return built.values_of(row)

        return built._replace(values_of=values_of)

    first = counted(emitters(["a_min", "a_max", "a_mean", "a_std", "a_dr"], requests, columns))
    second = counted(emitters(["b_min", "b_max", "b_mean", "b_std", "b_dr"], requests, columns))
    rng = random.Random(3)
    rows = [next(_rows(columns, rng)) for _ in range(2)]
    batch = ScalarBatch([(first, rows[0], 7, "a", "x"), (second, rows[1], 7, "b", "x")])
    values = batch.values
    assert len(calls) == 2 and len(values) == 10 and len(batch) == 10
    expected = [finalize(r, dict(zip(columns, row))) for row in rows for r in requests]
    assert list(map(_key, values)) == list(map(_key, expected))
    assert [record[0] for record in batch] == ["a_min", "a_max", "a_mean", "a_std", "a_dr"] + [
        "b_min",
        "b_max",
        "b_mean",
        "b_std",
        "b_dr",
    ]
    assert len(calls) == 2  # building the records reused the values: no row was evaluated again


def test_one_function_per_layout():
    """Buffers of one column layout and statistics share one generated function; another layout gets its own."""
    hp, quantized = _requests()
    columns = columns_for(hp)
    assert row_evaluator(hp, columns) is row_evaluator(list(hp), columns)
    assert row_evaluator(hp[:3], columns) is not row_evaluator(hp, columns)
    assert row_evaluator(quantized, columns_for(quantized)) is not row_evaluator(hp, columns)


def test_a_wrong_number_of_values_is_an_error():
    broken = Emitters((("a", "min"), ("b", "max")), lambda row: [row[0]])
    with pytest.raises(ValueError, match="1 values for the 2 statistics"):
        ScalarBatch([(broken, [1.0], 1, "L", "x")]).evaluate()
