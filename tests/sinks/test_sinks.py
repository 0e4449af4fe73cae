"""TensorBoard and JSONL sinks: event files read back with tensorboard's EventAccumulator (scalars and the
custom-scalars layout), JSONL lines parsed back, non-finite values, and the StatsEngine -> MetricLogger path."""

import glob
import json
import math
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from tedebug.sinks import MetricLogger
from tedebug.sinks.jsonl import JsonlSink
from tedebug.sinks.tensorboard import TensorBoardSink
from tedebug.stats import StatsEngine

from support.tensorboard_events import LAYOUT_TAG, layouts, load, scalars


def log(sink, layer, tensor, stat, value, it):
    sink.log_scalar(f"{layer}_{tensor}_{stat}", value, it, layer=layer, tensor=tensor, stat=stat)


def test_tensorboard_hierarchical_tags_and_layout(tmp_path):
    sink = TensorBoardSink(log_dir=str(tmp_path), summaries=False)  # summaries: test_tensorboard_summary.py
    for it in (1, 2):
        for layer in ("dec.1.fc1", "dec.2.fc1"):
            log(sink, layer, "activation", "max", it * 10 + len(layer), it)
            log(sink, layer, "gradient", "underflows%", 0.5 * it, it)
        sink.flush()  # step 1 writes the layout, step 2 has no new pair: no rewrite
    log(sink, "dec.1.fc1", "activation", "std", float("nan"), 3)
    log(sink, "dec.1.fc1", "activation", "cur_amax", float("inf"), 3)
    sink.log_scalar("free_form_name", 4.0, 3)  # no structured keywords: flat name, no chart
    sink.close()

    acc = load(str(tmp_path))
    got = scalars(acc)
    assert set(got) == {
        "dec.1.fc1/activation/max",
        "dec.2.fc1/activation/max",
        "dec.1.fc1/gradient/underflows%",
        "dec.2.fc1/gradient/underflows%",
        "dec.1.fc1/activation/std",
        "dec.1.fc1/activation/cur_amax",
        "free_form_name",
    }
    assert got["dec.2.fc1/activation/max"] == [(1, 19.0), (2, 29.0)]
    assert got["dec.1.fc1/gradient/underflows%"] == [(1, 0.5), (2, 1.0)]
    assert math.isnan(got["dec.1.fc1/activation/std"][0][1])
    assert got["dec.1.fc1/activation/cur_amax"] == [(3, math.inf)]

    written = layouts(acc)
    assert len(written) == 2  # first step and close (new pairs after the last flush)
    final = written[-1]
    charts = {cat.title: {c.title: list(c.multiline.tag) for c in cat.chart} for cat in final.category}
    assert charts == {
        "activation": {
            "activation/max": [r".*/activation/max$"],
            "activation/std": [r".*/activation/std$"],
            "activation/cur_amax": [r".*/activation/cur_amax$"],
        },
        "gradient": {"gradient/underflows%": [r".*/gradient/underflows%$"]},
    }
    # each chart's regex selects that statistic of every layer and nothing else
    for cat in charts.values():
        for title, (regex,) in cat.items():
            tensor, stat = title.split("/")
            matched = {t for t in got if re.match(regex, t)}
            assert matched == {t for t in got if t.endswith(f"/{tensor}/{stat}")}
            assert matched


def test_tensorboard_flat_style_with_external_writer(tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path))
    sink = TensorBoardSink(writer, tag_style="flat")
    log(sink, "Layer_1", "weight", "min", -1.25, 0)
    sink.flush()
    sink.close()
    writer.add_scalar("after_close", 1.0, 0)  # the sink does not close a writer it did not create
    writer.close()
    acc = load(str(tmp_path))
    assert scalars(acc) == {"Layer_1_weight_min": [(0, -1.25)], "after_close": [(0, 1.0)]}
    assert layouts(acc) == []


def test_tensorboard_constructor_errors(tmp_path):
    with pytest.raises(ValueError, match="exactly one of"):
        TensorBoardSink()
    with pytest.raises(ValueError, match="exactly one of"):
        TensorBoardSink(SummaryWriter(log_dir=str(tmp_path)), log_dir=str(tmp_path))
    with pytest.raises(ValueError, match="tag_style must be one of"):
        TensorBoardSink(log_dir=str(tmp_path), tag_style="nested")


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f.read().splitlines()]


def test_jsonl_records_nonfinite_and_flush(tmp_path):
    path = tmp_path / "deep" / "dir" / "stats.jsonl"
    sink = JsonlSink(str(path))
    log(sink, "L", "activation", "max", 2.5, 7)
    log(sink, "L", "activation", "std", float("nan"), 7)
    log(sink, "L", "activation", "cur_amax", float("inf"), 7)
    log(sink, "L", "activation", "min", -float("inf"), 7)
    sink.log_scalar("custom", 1, 8)
    assert path.read_text() == ""  # buffered until flush
    sink.flush()
    records = read_jsonl(path)
    assert records == [
        {"iteration": 7, "name": "L_activation_max", "layer": "L", "tensor": "activation", "stat": "max", "value": 2.5},
        {
            "iteration": 7,
            "name": "L_activation_std",
            "layer": "L",
            "tensor": "activation",
            "stat": "std",
            "value": None,
            "nonfinite": "nan",
        },
        {
            "iteration": 7,
            "name": "L_activation_cur_amax",
            "layer": "L",
            "tensor": "activation",
            "stat": "cur_amax",
            "value": None,
            "nonfinite": "inf",
        },
        {
            "iteration": 7,
            "name": "L_activation_min",
            "layer": "L",
            "tensor": "activation",
            "stat": "min",
            "value": None,
            "nonfinite": "-inf",
        },
        {"iteration": 8, "name": "custom", "layer": None, "tensor": None, "stat": None, "value": 1.0},
    ]
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()  # strict JSON
    log(sink, "L", "gradient", "mean", 0.125, 9)
    sink.close()
    sink.close()  # idempotent
    assert read_jsonl(path)[-1]["value"] == 0.125
    again = JsonlSink(str(path), append=True)
    log(again, "L", "gradient", "mean", 1.0, 10)
    again.close()
    assert len(read_jsonl(path)) == 7
    JsonlSink(str(path)).close()  # default: truncate
    assert read_jsonl(path) == []


def test_engine_to_sinks_end_to_end(tmp_path):
    logger = MetricLogger()
    logger.add_sink(TensorBoardSink(log_dir=str(tmp_path / "tb")))
    logger.add_sink(JsonlSink(str(tmp_path / "stats.jsonl")))
    engine = StatsEngine(logger)
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    engine.feed("enc.0", "activation", ["max", "mean"], x, iteration=5)
    engine.step(5)  # the engine flushes the logger once per step
    assert [r["name"] for r in read_jsonl(tmp_path / "stats.jsonl")] == [
        "enc.0_activation_max",
        "enc.0_activation_mean",
    ]
    logger.close()
    acc = load(glob.glob(str(tmp_path / "tb"))[0])
    one_layer = {
        f"summary/activation/{stat}/{kind}": [(5, value)]
        for stat, value in (("max", 4.0), ("mean", 0.875))
        for kind in ("max", "p90", "median")
    }  # one layer: its value is every summary
    assert scalars(acc) == {"enc.0/activation/max": [(5, 4.0)], "enc.0/activation/mean": [(5, 0.875)], **one_layer}
    assert len(layouts(acc)) == 1


def summary_events(log_dir):
    """(step, [tags]) of every event holding a scalar summary, in file order (the layout event left out)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    (path,) = glob.glob(f"{log_dir}/events.out.tfevents.*")
    return [
        (e.step, [v.tag for v in e.summary.value])
        for e in EventFileLoader(path).Load()
        if e.summary.value and e.summary.value[0].tag != LAYOUT_TAG
    ]


@pytest.mark.parametrize("tag_style", ["flat", "hierarchical"])
def test_tensorboard_batch_is_one_event_per_iteration_run_with_add_scalar_values(tmp_path, tag_style):
    """`log_scalars` on a SummaryWriter writes one event per run of equal iterations; the decoded (tag, step, value)
    series equal those of one `add_scalar` per record (float32 rounding, overflow to inf, NaN, tensors)."""
    values = [0.1, float("nan"), 2.0**130, 5e-324, -float("inf"), torch.tensor(0.75, dtype=torch.float64), 3]
    records = [
        (f"L{i % 2}_activation_s{i}", v, it, f"L{i % 2}", "activation", f"s{i}")
        for i, (v, it) in enumerate(zip(values, [3, 3, 4, 3, 3, 5, 5]))
    ]
    records.append(("free_form", 1.5, 5, None, None, None))
    batched = TensorBoardSink(SummaryWriter(str(tmp_path / "batched")), tag_style=tag_style, summaries=False)
    single = TensorBoardSink(SummaryWriter(str(tmp_path / "single")), tag_style=tag_style, summaries=False)
    batched.log_scalars(records)
    for name, value, it, layer, tensor, stat in records:
        single.log_scalar(name, value, it, layer=layer, tensor=tensor, stat=stat)
    for sink in (batched, single):
        sink.flush()
        sink.writer.close()
    got, want = scalars(load(str(tmp_path / "batched"))), scalars(load(str(tmp_path / "single")))
    assert repr(got) == repr(want)  # repr: NaN equals NaN
    tag = (lambda i: f"L{i % 2}_activation_s{i}") if tag_style == "flat" else (lambda i: f"L{i % 2}/activation/s{i}")
    assert got[tag(0)] == [(3, 0.10000000149011612)] and got[tag(2)] == [(4, math.inf)] and got[tag(3)] == [(3, 0.0)]
    assert got[tag(5)] == [(5, 0.75)] and math.isnan(got[tag(1)][0][1]) and got["free_form"] == [(5, 1.5)]
    assert summary_events(str(tmp_path / "batched")) == [
        (3, [tag(0), tag(1)]),
        (4, [tag(2)]),
        (3, [tag(3), tag(4)]),
        (5, [tag(5), tag(6), "free_form"]),
    ]
    assert batched.layout() == single.layout()


def test_text_batch_lines_equal_format_stat_message(tmp_path, monkeypatch):
    """The batch path caches the text around the value per iteration; its lines are `format_stat_message`'s bytes
    for every value and iteration kind (equal iterations of different types share a cache entry: same text)."""
    import time
    import types

    from tedebug.sinks import text as text_module
    from tedebug.sinks.text import TextStatsSink, format_stat_message

    monkeypatch.setattr(
        text_module,
        "time",
        types.SimpleNamespace(time=lambda: 1_000_000_000.5, strftime=time.strftime, localtime=time.localtime),
    )
    values = [1.4388, 0.15625, -2.5, float("nan"), -float("inf"), 2.0**70, torch.tensor(3.0), 7, True]
    iterations = [20, 20, 1234567, 1, True, 1.0, 0, torch.tensor(5), 20]
    records = [(f"n{i}", v, it, "l", "t", f"s{i}") for i, (v, it) in enumerate(zip(values, iterations))]
    sink = TextStatsSink(str(tmp_path / "s.log"))
    sink.log_scalars(records)
    sink.close()
    prefix = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_000_000_000)) + ",500 - INFO - "
    lines = (tmp_path / "s.log").read_text(encoding="utf-8").splitlines()
    assert lines == [prefix + format_stat_message(*r[:3]) for r in records]
    assert lines[4].endswith("n4 \t\t\t\t iteration=000001 \t\t\t\t value=-inf")
    assert lines[5].endswith("n5 \t\t\t\t iteration=000001 \t\t\t\t value=1180591620717411303424.0000")  # 2**70


# ------------------------------------------------------------------------------------------------ event checksums
def test_fast_event_checksum_equals_tensorboards_and_files_stay_readable(tmp_path):
    """`tb_crc.masked_crc32c` (C CRC-32C) gives TensorBoard's pure-Python masked CRC for every input; a sink
    installs it in the record writer, and the event file it writes reads back (the reader verifies every
    checksum) with the values written."""
    pytest.importorskip("google_crc32c")
    import os as _os

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference
    from tensorboard.summary.writer import record_writer

    from tedebug.sinks import tb_crc

    gen = torch.Generator().manual_seed(5)
    samples = [b"", b"\x00", b"123456789", _os.urandom(1)] + [
        bytes(torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).tolist()) for n in (3, 64, 1000, 4099)
    ]
    for data in samples:
        assert tb_crc.masked_crc32c(data) == reference(data), data[:16]
    assert reference(b"123456789") == tb_crc.masked_crc32c(b"123456789")
    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"))
    assert record_writer.masked_crc32c is tb_crc.masked_crc32c  # google_crc32c's C code on this machine
    sink.log_scalars(
        [
            ("L_activation_max", 2.5, 3, "L", "activation", "max"),
            ("L_activation_min", -1.0, 3, "L", "activation", "min"),
        ]
    )
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("L/activation/max")] == [(3, 2.5)]
    assert [(e.step, e.value) for e in acc.Scalars("L/activation/min")] == [(3, -1.0)]


def test_tensorboard_summary_wire_bytes_equal_the_message_objects(tmp_path):
    """The batched Summary is parsed from hand-encoded wire bytes; it serialises to exactly the bytes of the same
    Summary built from `Summary.Value` objects (long tags with multi-byte length varints, non-ASCII tags, float32
    rounding, overflow to inf, NaN, -0.0, a double below the float32 range)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    sink = TensorBoardSink(SummaryWriter(str(tmp_path / "w")))
    tags = ["a", "L/activation/max", "x" * 127, "y" * 128, "z" * 300, "blöck/ü/σ", "q" * 20000]
    values = [0.1, 2.0**130, float("nan"), -0.0, 5e-324, -float("inf"), 3.0]
    got = sink._summary(tags, values)
    want = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in zip(tags, values)])
    assert got.SerializeToString() == want.SerializeToString()
    assert [v.tag for v in got.value] == tags and got.value[1].simple_value == math.inf
    sink.writer.close()
