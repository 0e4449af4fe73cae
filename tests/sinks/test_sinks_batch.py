"""`ScalarBatch` (tedebug.sinks.batch) and the batch paths of the text and JSONL sinks: a batch is the sequence of
records it stands for, and the files written from a batch are byte-identical to the files written from the same
records as a plain list (today's per-record path), for adversarial values and names, mixed iterations and layout
changes; the per-layout caches are reused while the layout holds and rebuilt when it changes."""

import json
import math
import random
import threading
import unicodedata

import pytest
import torch

from tedebug.sinks import MetricLogger, Sink
from tedebug.sinks.batch import Emitters, ScalarBatch
from tedebug.sinks.jsonl import JsonlSink
from tedebug.sinks.text import TextStatsSink
from tedebug.stats import StatsEngine

FIXED_ASCTIME = "2024-05-06 07:08:09,010"

SPECIAL_VALUES = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    float("nan"),
    -float("nan"),
    float("inf"),
    float("-inf"),
    1e300,
    -1e300,
    1.7976931348623157e308,
    5e-324,
    1e-310,
    2.2250738585072014e-308,
    5e-05,
    2.5e-05,
    0.00015,
    0.1 + 0.2,
    123456789.123456789,
    1e16,
    1e22,
    9.999999999999999e15,
    12345.67895,
    -0.00004999,
    0.49999999999999994,
    2**53 + 0.0,
]

ADVERSARIAL_NAMES = [
    "underflows%",
    "%s",
    "%%",
    "%(x)s",
    "%.4f",
    'quo"te',
    "back\\slash",
    "λ_unicode",
    "日本語",
    "emoji_😀",
    "tab\tname",
    "{brace}",
    "ctrl\x01",
    "\u2028sep",
    "",
]


class _FixedTime:
    """Stands for a text sink's `_AscTime`: the same stamp always (both sinks of a comparison share it)."""

    def now(self):
        return FIXED_ASCTIME


def emitters_of(layer, tensor, stats):
    """The emitters of a buffer whose row holds the values of `stats` in order."""
    return Emitters(tuple((f"{layer}_{tensor}_{stat}", stat) for stat in stats), lambda row: list(row[: len(stats)]))


def text_sink(path):
    sink = TextStatsSink(str(path))
    sink._asctime = _FixedTime()
    return sink


def written(tmp_path, tag, batches):
    """(text bytes, JSONL bytes) of `batches` logged (one `log_scalars` per batch, a flush after each) by a fresh
    text sink and a fresh JSONL sink."""
    text, jsonl = text_sink(tmp_path / f"{tag}.log"), JsonlSink(tmp_path / f"{tag}.jsonl")
    for batch in batches:
        for sink in (text, jsonl):
            sink.log_scalars(batch)
            sink.flush()
    text.close()
    jsonl.close()
    return (tmp_path / f"{tag}.log").read_bytes(), (tmp_path / f"{tag}.jsonl").read_bytes()


def assert_same_files(tmp_path, batches):
    """The files written from the ScalarBatches equal the files written from their records as plain lists."""
    fast = written(tmp_path, "batch", batches)
    plain = written(tmp_path, "plain", [list(b) for b in batches])
    assert fast[0] == plain[0]
    assert fast[1] == plain[1]
    return fast


def text_log_name(name):
    """Independent oracle of the text log's name escaping: names with a control character (Unicode category Cc) or a
    line / paragraph separator get backslash escapes; all others are written unchanged."""
    if not any(unicodedata.category(c) == "Cc" or c in "\u2028\u2029" for c in name):
        return name
    out = []
    for c in name:
        if c == "\\":
            out.append("\\\\")
        elif c in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c])
        elif unicodedata.category(c) == "Cc" or c in "\u2028\u2029":
            out.append("\\x%02x" % ord(c) if ord(c) < 256 else "\\u%04x" % ord(c))
        else:
            out.append(c)
    return "".join(out)


def expected_text(records):
    return "".join(
        f"{FIXED_ASCTIME} - INFO - {text_log_name(name)} \t\t\t\t iteration={it:06d} \t\t\t\t value={float(v):.4f}\n"
        for name, v, it, _, _, _ in records
    ).encode()


def expected_jsonl(records):
    lines = []
    for name, value, it, layer, tensor, stat in records:
        value = float(value)
        record = {
            "iteration": it,
            "name": name,
            "layer": layer,
            "tensor": tensor,
            "stat": stat,
            "value": value if math.isfinite(value) else None,
        }
        if not math.isfinite(value):
            record["nonfinite"] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        lines.append(json.dumps(record, allow_nan=False) + "\n")
    return "".join(lines).encode()


# ------------------------------------------------------------------------------------------------ the sequence
def test_scalar_batch_is_the_sequence_of_its_records():
    e1 = emitters_of("L1", "activation", ["min", "max"])
    e2 = Emitters((("L2_weight_count", "count"),), lambda row: [7])  # an int value: kept as it is in the records
    rows = [(e1, [-1.5, 2.5], 4, "L1", "activation"), (e2, [0.0], 4, "L2", "weight")]
    batch = ScalarBatch(rows)
    expected = [
        ("L1_activation_min", -1.5, 4, "L1", "activation", "min"),
        ("L1_activation_max", 2.5, 4, "L1", "activation", "max"),
        ("L2_weight_count", 7, 4, "L2", "weight", "count"),
    ]
    assert len(batch) == 3 and bool(batch)
    assert list(batch) == expected
    assert [batch[i] for i in range(3)] == expected
    assert batch[-1] == expected[-1] and batch[1:] == expected[1:]
    with pytest.raises(IndexError):
        batch[3]
    assert expected[1] in batch and batch.index(expected[2]) == 2
    assert list(reversed(batch)) == expected[::-1]
    assert type(batch[2][1]) is int
    assert batch.values == [-1.5, 2.5, 7.0] and all(type(v) is float for v in batch.values)
    assert batch.iteration == 4
    assert batch.name_parts() == [r[:1] + r[3:] for r in expected]
    assert batch.layout == (e1, "L1", "activation", e2, "L2", "weight")
    assert batch.records is batch.records  # built once


def test_scalar_batch_empty_mixed_iterations_and_subclass_values():
    import numpy as np

    assert len(ScalarBatch([])) == 0 and not ScalarBatch([]) and list(ScalarBatch([])) == []
    assert ScalarBatch([]).iteration is None
    e = emitters_of("L", "x", ["a"])
    mixed = ScalarBatch([(e, [1.0], 3, "L", "x"), (e, [2.0], 4, "L", "x")])
    assert mixed.iteration is None and [r[2] for r in mixed] == [3, 4]
    # a buffer without statistics contributes no record and no iteration
    assert ScalarBatch([(Emitters((), lambda row: []), [], 9, "L", "y"), (e, [1.0], 3, "L", "x")]).iteration == 3
    numpy_value = ScalarBatch([(e, [np.float64(0.1)], 1, "L", "x")])
    assert type(numpy_value.values[0]) is float and numpy_value.values == [0.1]
    assert type(numpy_value[0][1]) is np.float64  # records keep what the emitter returned


def test_scalar_batch_evaluates_each_formula_once():
    calls = []

    def value_of(row):
        calls.append(1)
        return [row[0]]

    batch = ScalarBatch([(Emitters((("n", "s"),), value_of), [2.0], 1, "L", "x")])
    batch.values, list(batch), batch.values, batch[0]
    assert len(calls) == 1

    def broken(row):
        raise ZeroDivisionError("formula")

    with pytest.raises(ZeroDivisionError):
        ScalarBatch([(Emitters((("n", "s"),), broken), [2.0], 1, "L", "x")]).evaluate()


def test_same_layout_compares_identity():
    e = emitters_of("L", "x", ["a", "b"])
    first = ScalarBatch([(e, [1.0, 2.0], 1, "L", "x")])
    assert ScalarBatch([(e, [3.0, 4.0], 2, "L", "x")]).same_layout(first.layout)
    assert not first.same_layout(None)
    assert not ScalarBatch([(emitters_of("L", "x", ["a", "b"]), [1.0, 2.0], 1, "L", "x")]).same_layout(first.layout)
    assert not ScalarBatch([(e, [1.0, 2.0], 1, "L", "x"), (e, [1.0, 2.0], 1, "L", "x")]).same_layout(first.layout)
    assert not ScalarBatch([]).same_layout(first.layout)


# ------------------------------------------------------------------------------------------------ the files
def test_batch_files_exact_bytes(tmp_path):
    """The batch path's bytes, spelled out (so this file fails if both paths change the same way)."""
    e = emitters_of("blk.0", "activation", ["underflows%", "std", "max"])
    batch = ScalarBatch([(e, [12.5, float("nan"), -0.0], 42, "blk.0", "activation")])
    text, jsonl = assert_same_files(tmp_path, [batch])
    assert (
        text
        == (
            f"{FIXED_ASCTIME} - INFO - blk.0_activation_underflows% \t\t\t\t iteration=000042 \t\t\t\t value=12.5000\n"
            f"{FIXED_ASCTIME} - INFO - blk.0_activation_std \t\t\t\t iteration=000042 \t\t\t\t value=nan\n"
            f"{FIXED_ASCTIME} - INFO - blk.0_activation_max \t\t\t\t iteration=000042 \t\t\t\t value=-0.0000\n"
        ).encode()
    )
    assert jsonl == (
        b'{"iteration": 42, "name": "blk.0_activation_underflows%", "layer": "blk.0", "tensor": "activation", '
        b'"stat": "underflows%", "value": 12.5}\n'
        b'{"iteration": 42, "name": "blk.0_activation_std", "layer": "blk.0", "tensor": "activation", '
        b'"stat": "std", "value": null, "nonfinite": "nan"}\n'
        b'{"iteration": 42, "name": "blk.0_activation_max", "layer": "blk.0", "tensor": "activation", '
        b'"stat": "max", "value": -0.0}\n'
    )


def test_special_values_and_names(tmp_path):
    stats = [f"s{i}" for i in range(len(SPECIAL_VALUES))]
    rows = [(emitters_of("L", "t", stats), list(SPECIAL_VALUES), 7, "L", "t")]
    for i, name in enumerate(ADVERSARIAL_NAMES):
        layer, tensor = f"lay{name}", f"ten{name}"
        rows.append((emitters_of(layer, tensor, [name, f"{name}2"]), SPECIAL_VALUES[i : i + 2], 7, layer, tensor))
    batch = ScalarBatch(rows)
    text, jsonl = assert_same_files(tmp_path, [batch])
    assert text == expected_text(batch)
    assert jsonl == expected_jsonl(batch)
    for value in SPECIAL_VALUES:  # the text path's value text is the per-record path's
        assert format(value, ".4f") == f"{value:.4f}" == "%.4f" % value


def test_batch_paths_are_taken_and_fall_back(tmp_path):
    """One-iteration batches of str names take the batch paths; mixed iterations and non-str name parts fall back
    (and still write the same bytes)."""
    e = emitters_of("L", "x", ["a"])
    text, jsonl = text_sink(tmp_path / "a.log"), JsonlSink(tmp_path / "a.jsonl")
    one = ScalarBatch([(e, [1.0], 1, "L", "x")])
    for sink in (text, jsonl):
        sink.log_scalars(one)
        assert sink._batch_layout is one.layout and sink._batch_names is not None
    mixed = ScalarBatch([(e, [1.0], 1, "L", "x"), (e, [2.0], 2, "L", "x")])
    for sink in (text, jsonl):
        sink.log_scalars(mixed)
        assert sink._batch_layout is one.layout  # not looked at
    none_layer = ScalarBatch([(e, [3.0], 3, None, "x")])  # JSON null layer: not a plain str
    jsonl.log_scalars(none_layer)
    assert jsonl._batch_layout is none_layer.layout and jsonl._batch_names is None
    text.close()
    jsonl.close()
    assert_same_files(tmp_path, [one, mixed, none_layer])


def test_several_iterations_in_one_batch(tmp_path):
    e1, e2 = emitters_of("A", "x", ["min", "max"]), emitters_of("B", "y", ["std"])
    batch = ScalarBatch(
        [(e1, [1.0, 2.0], 5, "A", "x"), (e2, [float("inf")], 6, "B", "y"), (e1, [3.0, 4.5], 5, "A", "x")]
    )
    text, jsonl = assert_same_files(tmp_path, [batch])
    assert text == expected_text(batch) and jsonl == expected_jsonl(batch)


def random_batches(seed, steps=6):
    """Steps of a random session: buffers that persist (same emitters objects) with random values, a buffer added
    or removed now and then, a buffer whose requests change (new emitters), an occasional mixed-iteration batch."""
    rng = random.Random(seed)
    names = ["min", "max", "mean", "std", "l1_norm", "underflows%", 'q"uote', "b\\s", "λ"]

    def value():
        r = rng.random()
        if r < 0.15:
            return rng.choice(SPECIAL_VALUES)
        if r < 0.2:
            return float(rng.randint(-5, 5))
        return rng.uniform(-1, 1) * 10.0 ** rng.randint(-12, 12)

    def buffer(i):
        layer, tensor = f"layers.{i}.{rng.choice(['fc1', 'q%v', 'ünï'])}", rng.choice(["activation", "wgrad"])
        return [emitters_of(layer, tensor, rng.sample(names, rng.randint(1, len(names)))), layer, tensor]

    buffers = [buffer(i) for i in range(rng.randint(1, 12))]
    batches = []
    for step in range(steps):
        change = rng.random()
        if change < 0.2:
            buffers.insert(rng.randint(0, len(buffers)), buffer(100 + step))
        elif change < 0.4 and len(buffers) > 1:
            del buffers[rng.randrange(len(buffers))]
        elif change < 0.5:
            b = rng.choice(buffers)
            b[0] = emitters_of(b[1], b[2], rng.sample(names, rng.randint(1, len(names))))
        mixed = rng.random() < 0.15
        batches.append(
            ScalarBatch(
                [
                    (e, [value() for _ in e.names], step + (mixed and i % 2), layer, tensor)
                    for i, (e, layer, tensor) in enumerate(buffers)
                ]
            )
        )
    return batches


@pytest.mark.parametrize("seed", range(40))
def test_random_batches_same_bytes(tmp_path, seed):
    batches = random_batches(seed)
    text, jsonl = assert_same_files(tmp_path, batches)
    records = [r for b in batches for r in b]
    assert text == expected_text(records)
    assert jsonl == expected_jsonl(records)


def test_layout_cache_reused_and_rebuilt(tmp_path):
    e_a, e_b = emitters_of("A", "x", ["min", "max"]), emitters_of("B", "x", ["std"])
    text, jsonl = text_sink(tmp_path / "c.log"), JsonlSink(tmp_path / "c.jsonl")
    sinks = (text, jsonl)
    steps = [
        ScalarBatch([(e_a, [1.0, 2.0], 1, "A", "x"), (e_b, [3.0], 1, "B", "x")]),
        ScalarBatch([(e_a, [1.5, 2.5], 2, "A", "x"), (e_b, [3.5], 2, "B", "x")]),  # same objects: reused
        ScalarBatch([(e_a, [1.0, 2.0], 3, "A", "x")]),  # a buffer removed
        ScalarBatch(
            [
                (e_a, [1.0, 2.0], 4, "A", "x"),
                (e_b, [0.5], 4, "B", "x"),
                (emitters_of("C", "y", ["%x"]), [9.0], 4, "C", "y"),
            ]
        ),  # added back, and one more
        ScalarBatch([(emitters_of("A", "x", ["max", "min"]), [7.0, 8.0], 5, "A", "x")]),  # the same layer, new stats
    ]
    cached = []
    for batch in steps:
        for sink in sinks:
            sink.log_scalars(batch)
            sink.flush()
        cached.append([sink._batch_names for sink in sinks])
        assert all(sink._batch_layout is batch.layout or batch.same_layout(sink._batch_layout) for sink in sinks)
    assert all(a is b for a, b in zip(cached[0], cached[1]))
    for before, after in zip(cached[1:], cached[2:]):
        assert all(a is not b for a, b in zip(before, after))
    assert cached[2][0] == ["A_x_min", "A_x_max"] and cached[4][0] == ["A_x_max", "A_x_min"]
    text.close()
    jsonl.close()
    records = [r for b in steps for r in b]
    assert (tmp_path / "c.log").read_bytes() == expected_text(records)
    assert (tmp_path / "c.jsonl").read_bytes() == expected_jsonl(records)


def test_mixing_batches_and_plain_records(tmp_path):
    """Plain records, single scalars and batches interleave in the order they were logged."""
    e = emitters_of("L", "x", ["a", "b"])
    text, jsonl = text_sink(tmp_path / "m.log"), JsonlSink(tmp_path / "m.jsonl")
    plain = [("free", 0.25, 1, None, None, None)]
    batch = ScalarBatch([(e, [1.0, float("-inf")], 1, "L", "x")])
    for sink in (text, jsonl):
        sink.log_scalars(plain)
        sink.log_scalars(batch)
        sink.log_scalar("single", 2.0, 1)
        sink.log_scalars(batch)
        sink.close()
    records = plain + list(batch) + [("single", 2.0, 1, None, None, None)] + list(batch)
    assert (tmp_path / "m.log").read_bytes() == expected_text(records)
    assert (tmp_path / "m.jsonl").read_bytes() == expected_jsonl(records)


# ------------------------------------------------------------------------------------------------ the logger
class _Recorder(Sink):
    """A writer-thread sink that keeps the chunks it receives (as they are)."""

    thread_safe = True

    def __init__(self):
        self.chunks = []
        self.threads = set()

    def log_scalars(self, records):
        self.chunks.append(records)
        self.threads.add(threading.get_ident())


def test_metric_logger_queues_a_batch_without_copying():
    recorder = _Recorder()
    logger = MetricLogger(background=True)
    logger.add_sink(recorder)
    batch = ScalarBatch([(emitters_of("L", "x", ["a"]), [1.0], 1, "L", "x")])
    plain = [("n", 1.0, 1, "L", "x", "a")]
    logger.log_scalars(batch)
    logger.log_scalars(plain)
    assert logger._pending[0] is batch and logger._pending[1] is not plain and logger._pending[1] == plain
    logger.drain()
    assert recorder.chunks[0] is batch and batch._records is None  # handed over as it is, never materialised
    assert recorder.chunks[1] == plain
    assert recorder.threads and threading.get_ident() not in recorder.threads
    logger.close()


def test_engine_emits_a_scalar_batch(tmp_path):
    """StatsEngine -> MetricLogger (background, file sinks): the writer thread builds a ScalarBatch and the files
    hold exactly its records."""
    logger = MetricLogger(background=True)
    logger.add_sink(text_sink(tmp_path / "e.log"))
    jsonl = logger.add_sink(JsonlSink(tmp_path / "e.jsonl"))
    engine = StatsEngine(logger, flush_at_step=True)
    seen = []
    original = jsonl.log_scalars
    jsonl.log_scalars = lambda records: (seen.append(records), original(records))[1]
    x = torch.tensor([[1.0, -2.0], [0.0, 4.0]])
    for it in (3, 4):
        engine.feed("blk.0", "activation", ["min", "max", "std", "dynamic_range"], x * it, iteration=it)
        engine.feed("blk.1", "weight", ["l1_norm"], torch.zeros(3), iteration=it)
        engine.step(it)
    logger.close()
    assert all(type(batch) is ScalarBatch and batch.iteration == it for batch, it in zip(seen, (3, 4)))
    assert seen[0].same_layout(seen[1].layout)  # the same buffers: the cached line pieces were reused
    records = [r for batch in seen for r in batch]
    assert [r[0] for r in records[:5]] == [
        "blk.0_activation_min",
        "blk.0_activation_max",
        "blk.0_activation_std",
        "blk.0_activation_dynamic_range",
        "blk.1_weight_l1_norm",
    ]
    assert (tmp_path / "e.log").read_bytes() == expected_text(records)
    assert (tmp_path / "e.jsonl").read_bytes() == expected_jsonl(records)
