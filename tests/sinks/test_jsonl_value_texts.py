"""`tedebug.sinks.jsonl.value_texts`: the value text of every JSONL line of a batch is exactly what ``json.dumps``
writes for the record, whether the column goes through orjson (the `fast` extra, installed by the test extra) or
through ``repr`` one value at a time; the oracle is ``json.dumps`` of the record's value."""

import json
import math
import random
import struct

import pytest

try:  # in the test extra (CI); the GPU host's bare environment lacks it, and the repr path is tested there too
    import orjson
except ImportError:
    orjson = None

from tedebug.sinks import jsonl
from tedebug.sinks.jsonl import JsonlSink, value_texts
from tedebug.sinks.batch import Emitters, ScalarBatch

#: the places where Python's repr and orjson could disagree: the switch to exponents on both sides, subnormals,
#: the extremes, signed zeros, non-finite values
BOUNDARIES = [
    0.0,
    -0.0,
    1e-4,
    -1e-4,
    9.999999999999999e-05,
    1.0000000000000002e-4,
    1e-5,
    1.5e-9,
    1e-16,
    5e-324,
    -5e-324,
    2.2250738585072014e-308,
    1e16,
    9.999999999999998e15,
    1.0000000000000002e16,
    1e22,
    1.7976931348623157e308,
    -1.7976931348623157e308,
    float("nan"),
    -float("nan"),
    float("inf"),
    float("-inf"),
    0.1 + 0.2,
    2.0**53,
    123456.789,
]


def oracle(value: float) -> str:
    """What follows ``"value": `` in ``json.dumps`` of the record `make_record` builds for `value`."""
    if math.isnan(value):
        return 'null, "nonfinite": "nan"'
    if math.isinf(value):
        return 'null, "nonfinite": "inf"' if value > 0 else 'null, "nonfinite": "-inf"'
    return json.dumps({"value": value}, allow_nan=False)[len('{"value": ') : -1]


def sample(seed: int, n: int = 4000) -> list:
    rng = random.Random(seed)
    values = list(BOUNDARIES)
    while len(values) < n:
        r = rng.random()
        if r < 0.3:  # any bit pattern (all exponents, NaN payloads, infinities)
            values.append(struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0])
        elif r < 0.6:  # statistics-like values at every scale
            values.append(rng.gauss(0, 1) * 10.0 ** rng.randint(-14, 20))
        elif r < 0.8:  # float32 values widened (what the CPU statistics of fp32 tensors give)
            values.append(struct.unpack("<f", struct.pack("<f", rng.gauss(0, 3)))[0])
        else:  # counts
            values.append(float(rng.randint(0, 10**6)))
    rng.shuffle(values)
    return values


needs_orjson = pytest.mark.skipif(orjson is None, reason="orjson (the fast / test extra) is not installed")


class _CountingOrjson:
    """Stands for the orjson module and counts the column calls (so a test knows which path ran)."""

    def __init__(self) -> None:
        self.calls = 0

    def dumps(self, values):
        self.calls += 1
        return orjson.dumps(values)


@needs_orjson
@pytest.mark.parametrize("seed", range(3))
def test_column_path_equals_json_dumps(monkeypatch, seed):
    counting = _CountingOrjson()
    monkeypatch.setattr(jsonl, "_orjson", counting)
    values = sample(seed)
    assert value_texts(values) == [oracle(v) for v in values]
    assert counting.calls == 1


@pytest.mark.parametrize("seed", range(2))
def test_repr_path_equals_json_dumps(monkeypatch, seed):
    monkeypatch.setattr(jsonl, "_orjson", None)  # orjson not installed
    values = sample(seed, n=1500)
    assert value_texts(values) == [oracle(v) for v in values]


@needs_orjson
def test_short_columns_skip_orjson(monkeypatch):
    counting = _CountingOrjson()
    monkeypatch.setattr(jsonl, "_orjson", counting)
    values = BOUNDARIES[: jsonl._COLUMN_MIN - 1]
    assert value_texts(values) == [oracle(v) for v in values]
    assert counting.calls == 0


@needs_orjson
def test_batch_files_equal_with_and_without_orjson(tmp_path, monkeypatch):
    """A JsonlSink writes the same bytes for a batch either way, and they are `json.dumps` of each record."""
    values = sample(7, n=64)
    emitters = Emitters(tuple((f"L_activation_s{i}", f"s{i}") for i in range(len(values))), list)
    batch = ScalarBatch([(emitters, values, 3, "L", "activation")])
    written = []
    counting = _CountingOrjson()
    for orjson_module in (counting, None):
        monkeypatch.setattr(jsonl, "_orjson", orjson_module)
        path = tmp_path / f"{orjson_module is None}.jsonl"
        sink = JsonlSink(path)
        sink.log_scalars(batch)
        sink.close()
        written.append(path.read_bytes())
    assert counting.calls == 1  # the first file did take the orjson column path
    assert written[0] == written[1]
    lines = written[0].decode().splitlines()
    for line, (name, value, iteration, layer, tensor, stat) in zip(lines, batch, strict=True):
        record = {"iteration": iteration, "name": name, "layer": layer, "tensor": tensor, "stat": stat}
        head = json.dumps(record)[:-1]
        assert line == f'{head}, "value": {oracle(value)}}}'
