"""The statistics writer process (``background_logging="process"``, tedebug.sinks.process_writer): the files it
writes are the writer thread's, byte for byte (the text file's timestamps aside); what is handed over survives a
SIGKILL of the training process; a failing sink, the death of the writer process and a writer process that cannot
start are reported and never stop training; and the wire format carries batches and records exactly."""

import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from tedebug import bench, debug_api
from tedebug.sinks import MetricLogger
from tedebug.sinks import process_writer
from tedebug.sinks.base import BackgroundSinkError
from tedebug.sinks.batch import DeferredBatch, Emitters, ScalarBatch
from tedebug.sinks.jsonl import JsonlSink
from tedebug import compiled_formulas
from tedebug.sinks.process_wire import ChunkDecoder, ChunkEncoder, MessageReader, send
from tedebug.stats.definitions import NUMEL, StatRequest, columns_for, row_evaluator
from tedebug.sinks.tensorboard import TensorBoardSink
from tedebug.sinks.text import TextStatsSink

STATS = bench.debug_section("s", LogTensorStats={"stats": bench.LOG_STATS, "freq": 1, "tensors": bench.ALL_TENSORS})
_STAMP = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", re.MULTILINE)


def _train(log_dir, background_logging, steps=3, tensorboard=False):
    """A 2-block run logging 8 statistics of every tensor, plus one scalar of user code per step (a tensor value);
    with `tensorboard`, also a TensorBoard sink that owns its writer (returned), given a user scalar after each
    step and one after the last."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[bench._Block(32, 2, i) for i in range(2)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(1, 8, 32)
    debug_api.initialize(STATS, log_dir=str(log_dir), background_logging=background_logging)
    sink = debug_api.add_statistics_sink(TensorBoardSink(log_dir=str(log_dir / "tb"))) if tensorboard else None
    try:
        for step in range(steps):
            MetricLogger.log_scalar("user_loss", torch.tensor(0.5 + step), step)
            bench.train_step(model, x, optimizer, None)
            if sink is not None:
                sink.log_user_scalar("train/loss", 0.5 + step, step)
        if sink is not None:
            sink.log_user_scalar("train/final", 9.0, steps)
    finally:
        debug_api.end_debug()
    return sink


def _files(log_dir):
    text = (log_dir / "nvdlfw_inspect_statistics_logs" / "nvdlfw_inspect_globalrank-0.log").read_bytes()
    jsonl = (log_dir / "tedebug_statistics" / "metrics_globalrank-0.jsonl").read_bytes()
    return _STAMP.sub(b"", text), jsonl


def test_the_files_are_the_writer_threads(tmp_path, no_debug_session):
    _train(tmp_path / "thread", True)
    _train(tmp_path / "process", "process")
    thread_text, thread_jsonl = _files(tmp_path / "thread")
    process_text, process_jsonl = _files(tmp_path / "process")
    assert process_jsonl == thread_jsonl
    assert process_text == thread_text
    records = [json.loads(line) for line in process_jsonl.splitlines()]
    assert {r["iteration"] for r in records} == {0, 1, 2}
    assert [r["value"] for r in records if r["name"] == "user_loss"] == [0.5, 1.5, 2.5]


def _jsonl_iterations(path):
    """The iterations of the complete lines of `path`.  Read while the writer process appends, the file may end
    in part of a line: the kernel makes a write visible page by page, so a reader can see part of one os.write."""
    if not path.exists():
        return set()
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return {json.loads(line)["iteration"] for line in complete.splitlines()}


def test_after_step_n_iteration_n_minus_2_is_on_disk(tmp_path, no_debug_session):
    torch.manual_seed(0)
    model = torch.nn.Sequential(bench._Block(32, 2, 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(1, 8, 32)
    jsonl = tmp_path / "tedebug_statistics" / "metrics_globalrank-0.jsonl"
    debug_api.initialize(STATS, log_dir=str(tmp_path), background_logging="process")
    try:
        for step in range(5):
            bench.train_step(model, x, optimizer, None)
            assert set(range(step - 1)) <= _jsonl_iterations(jsonl)  # iterations 0 .. step-2 written
    finally:
        debug_api.end_debug()
    assert _jsonl_iterations(jsonl) == set(range(5))


_KILLED_RUN = """
import os, signal, sys, torch
from tedebug import bench, debug_api
torch.manual_seed(0)
model = torch.nn.Sequential(bench._Block(32, 2, 0))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(1, 8, 32)
debug_api.initialize(STATS, log_dir=sys.argv[1], background_logging="process")
for _ in range(6):
    bench.train_step(model, x, optimizer, None)
from tedebug import active
print(active.DEBUG_MANAGER.metric_logger._process._process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_what_was_handed_over_survives_a_sigkill_of_the_training_process(tmp_path):
    script = "STATS = " + repr(STATS) + "\n" + textwrap.dedent(_KILLED_RUN)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    writer_pid = int(run.stdout.split()[-1])
    deadline = time.monotonic() + 60
    while _alive(writer_pid) and time.monotonic() < deadline:  # it notices its parent is gone, writes, ends
        time.sleep(0.1)
    assert not _alive(writer_pid)
    # the sixth step() handed iteration 4 over (its own, 5, was still on its way back from the device)
    assert _jsonl_iterations(tmp_path / "tedebug_statistics" / "metrics_globalrank-0.jsonl") == set(range(5))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (its parent, this test's child, is gone: it is reaped by init) counts as ended
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _batch(iteration, values):
    emitters = Emitters((("l_t_a", "a"), ("l_t_b", "b")), lambda row: list(row))
    return ScalarBatch([(emitters, values, iteration, "l", "t")])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a file whose writes fail with ENOSPC)")
def test_a_failing_sink_is_reported_once_and_the_others_go_on(tmp_path):
    reports = []
    logger = MetricLogger(background=True, on_sink_error="warn", report=reports.append, writer_process=True)
    full = logger.add_sink(JsonlSink("/dev/full", append=True))
    logger.add_sink(TextStatsSink(str(tmp_path / "s.log")))
    for iteration in range(4):
        logger.log_scalars(_batch(iteration, [1.0 + iteration, 2.0]))
        logger.flush()
    assert full in logger._stopped and full not in logger._process_sinks  # (known at the next job's hand-over)
    logger.close()
    assert len(reports) == 1, reports
    assert "JsonlSink('/dev/full')" in reports[0] and "errno 28, ENOSPC" in reports[0]
    assert "iteration(s) 0" in reports[0]
    lines = (tmp_path / "s.log").read_text().splitlines()
    assert [line.split("value=")[1] for line in lines if "l_t_a" in line] == ["1.0000", "2.0000", "3.0000", "4.0000"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failing_sink_raises_with_on_sink_error_raise(tmp_path):
    logger = MetricLogger(background=True, on_sink_error="raise", writer_process=True)
    logger.add_sink(JsonlSink("/dev/full", append=True))
    logger.log_scalars(_batch(0, [1.0, 2.0]))
    logger.flush()
    with pytest.raises(BackgroundSinkError, match="No space left on device") as info:
        logger.wait_written()
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == 28
    logger.close()


def test_the_death_of_the_writer_process_is_reported_and_training_goes_on(tmp_path):
    reports = []
    logger = MetricLogger(background=True, on_sink_error="warn", report=reports.append, writer_process=True)
    logger.add_sink(JsonlSink(str(tmp_path / "s.jsonl")))
    logger.log_scalars(_batch(0, [1.0, 2.0]))
    logger.flush()
    logger.wait_written()
    os.kill(logger._process._process.pid, signal.SIGKILL)
    for iteration in (1, 2, 3):
        logger.log_scalars(_batch(iteration, [1.0, 2.0]))
        logger.flush()
    logger.close()
    assert len(reports) == 1, reports
    assert "writer process ended" in reports[0] and "iteration(s) 1" in reports[0]
    assert _jsonl_iterations(tmp_path / "s.jsonl") == {0}


def test_a_writer_process_that_cannot_start_leaves_the_files_to_the_training_process(tmp_path, monkeypatch):
    monkeypatch.setattr(process_writer.sys, "executable", str(tmp_path / "no-such-python"))
    reports = []
    logger = MetricLogger(background=True, on_sink_error="warn", report=reports.append, writer_process=True)
    logger.add_sink(JsonlSink(str(tmp_path / "s.jsonl")))
    logger.add_sink(TextStatsSink(str(tmp_path / "s.log")))
    for iteration in range(3):
        logger.log_scalars(_batch(iteration, [1.0, 2.0]))
        logger.flush()
    logger.close()
    assert len(reports) == 1 and "cannot write JsonlSink" in reports[0] and "no-such-python" in reports[0]
    assert logger._process is None
    assert _jsonl_iterations(tmp_path / "s.jsonl") == {0, 1, 2}
    assert len((tmp_path / "s.log").read_text().splitlines()) == 6


def test_a_value_that_is_no_number_fails_the_sinks_as_in_the_writer_thread(tmp_path):
    reports = {}
    for writer_process in (False, True):
        got = reports[writer_process] = []
        logger = MetricLogger(background=True, on_sink_error="warn", report=got.append, writer_process=writer_process)
        logger.add_sink(JsonlSink(str(tmp_path / f"{writer_process}.jsonl")))
        logger.log_scalar("x", "not a number", 0)
        logger.flush()
        logger.log_scalars(_batch(1, [1.0, 2.0]))
        logger.flush()
        logger.close()
    assert len(reports[True]) == len(reports[False]) == 1
    assert "ValueError: could not convert string to float: 'not a number'" in reports[True][0]
    assert reports[True][0].replace("True.jsonl", "False.jsonl") == reports[False][0]  # the same report


def test_a_batch_that_cannot_travel_is_reported_and_the_next_ones_are_written(tmp_path):
    reports = []
    logger = MetricLogger(background=True, on_sink_error="warn", report=reports.append, writer_process=True)
    logger.add_sink(JsonlSink(str(tmp_path / "s.jsonl")))
    logger.log_scalars(_batch(0, [1.0, 2.0]))
    logger.log_scalars([(lambda: None, 1.0, 0, None, None, None)])  # a name that cannot be pickled
    logger.flush()
    logger.log_scalars(_batch(1, [3.0, 4.0]))  # the layout of the batch lost with it: sent again
    logger.flush()
    logger.close()
    assert len(reports) == 1 and "could not be given the statistics of iteration(s) 0" in reports[0]
    records = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["value"]) for r in records] == [(1, 3.0), (1, 4.0)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_that_writes_starts_a_writer_process_of_its_own(tmp_path):
    logger = MetricLogger(background=True, on_sink_error="raise", writer_process=True)
    logger.add_sink(JsonlSink(str(tmp_path / "s.jsonl")))
    logger.log_scalars(_batch(0, [1.0, 2.0]))
    logger.flush()
    logger.wait_written()
    parents_writer = logger._process._process.pid
    pid = os.fork()
    if pid == 0:  # child: its batch goes to a writer process it starts; the parent's is left alone
        code = 3
        try:
            logger.log_scalars(_batch(1, [3.0, 4.0]))
            logger.flush()
            logger.wait_written()
            if logger._process._process.pid != parents_writer:
                code = 0
            logger.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    logger.log_scalars(_batch(2, [5.0, 6.0]))  # the parent's writer process still takes the parent's batches
    logger.flush()
    assert logger._process._process.pid == parents_writer
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert sorted((r["iteration"], r["value"]) for r in records) == [
        (0, 1.0),
        (0, 2.0),
        (1, 3.0),
        (1, 4.0),
        (2, 5.0),
        (2, 6.0),
    ]


# ------------------------------------------------------------------------------------------------ wire
def test_messages_are_read_whole_whatever_the_pieces_they_arrive_in():
    read, write = os.pipe()
    messages = [("job", 1, [0, 1], [("records", [("n", 1.5, 2, None, None, None)])]), ("exit",), ("x" * 70000,)]

    def sender():  # (the last message is larger than a pipe's buffer: the write waits for the reads)
        for message in messages:
            send(write, message)
        os.close(write)

    thread = threading.Thread(target=sender)
    thread.start()
    data = b""
    while chunk := os.read(read, 1 << 20):
        data += chunk
    thread.join()
    os.close(read)
    reader = MessageReader()
    received = []
    for start in range(0, len(data), 7):  # 7-byte pieces: headers and payloads cut anywhere
        reader.feed(data[start : start + 7])
        received += reader.messages()
    assert received == messages and not reader.partial
    reader.feed(data[:20])  # a message cut short stays partial, never returned
    assert reader.messages() == [] and reader.partial


def test_batches_and_records_decode_to_the_same_records():
    encoder, decoder = ChunkEncoder(), ChunkDecoder()
    a = Emitters((("l_act_min", "min"), ("l_act_max", "max")), lambda row: [row[0], row[1]])
    b = Emitters((("m_w_mse", "mse"),), lambda row: [row[2] * 2])
    layouts = [
        ScalarBatch([(a, [1.0, -0.0, 3.0], 4, "l", "act"), (b, [0.0, 0.0, float("nan")], 4, "m", "w")]),
        ScalarBatch([(a, [5e-324, 1e308, 0.0], 5, "l", "act"), (b, [0.0, 0.0, -float("inf")], 5, "m", "w")]),
        ScalarBatch([(b, [0.0, 0.0, 0.1 + 0.2], 6, "m", "w"), (a, [2.0, 3.0, 0.0], 7, "l", "act")]),  # new layout
        [("user", torch.tensor(2.5), 7, None, None, None)],
    ]
    decoded = []
    for chunk in layouts:
        decoded += [c for c in map(decoder.decode, encoder.encode(chunk)) if c is not None]
    assert len(decoded) == 4
    for original, copy in zip(layouts, decoded):
        for got, want in zip(copy, original, strict=True):
            assert got[0] == want[0] and got[2:] == want[2:]
            assert repr(float(got[1])) == repr(float(want[1]))  # the same float, NaN and -0.0 included
    # the second batch reuses the first one's layout: the same objects, for the sinks' caches
    assert decoded[1].same_layout(decoded[0].layout) and not decoded[2].same_layout(decoded[1].layout)
    assert decoded[2].iteration is None  # mixed iterations travel per row


def test_merged_rows_travel_and_the_writer_process_runs_their_formulas():
    """Emitters of compiled formulas (`row_evaluator`): the rows travel as they are and the decoded batch evaluates
    them there, to the same bits; a batch of such emitters whose rows are not floats travels as its values."""
    requests = [StatRequest.parse_hp(name) for name in ("min", "mean", "std", "dynamic_range")]
    columns = list(columns_for(requests))
    emitters = Emitters(tuple((f"l_act_{r.name}", r.name) for r in requests), row_evaluator(requests, columns))
    rng = random.Random(5)
    rows = [[rng.uniform(0.0, 3.0) for _ in columns] for _ in range(3)]  # (m2 >= 0: the std's square root)
    for row in rows:
        row[columns.index(NUMEL)] = float(rng.randint(2, 9))
    batch = ScalarBatch([(emitters, row, 3, f"l{i}", "act") for i, row in enumerate(rows)])
    encoded = ChunkEncoder().encode(batch)
    assert encoded[0][0] == "layout" and all(row[3] for row in encoded[0][2])  # the formulas' source travels
    assert encoded[1][5] == [len(columns)] * 3  # the merged rows, not the values
    decoder = ChunkDecoder()
    decoded = [c for c in map(decoder.decode, encoded) if c is not None][0]
    assert [repr(v) for v in decoded.values] == [repr(v) for v in batch.values]
    assert decoded[0][0] == "l_act_min" and decoded.iteration == 3
    odd = ScalarBatch([(emitters, [str(v) for v in row], 3, "l", "act") for row in rows[:1]])  # not floats
    assert ChunkEncoder().encode(odd)[1][5] is None  # final values, evaluated in the training process


def test_a_packed_batch_is_the_batch_of_its_rows_and_travels_as_the_same_bytes():
    """`ScalarBatch.from_packed` (a one-row step's float64 array, `tedebug.stats.readback`): the same records,
    columns and layout as the batch of the same rows as lists, and its encoded message is the same, byte for byte
    (the array's bytes are the bytes of the floats); the rows are made into lists only when a reader asks."""
    requests = [StatRequest.parse_hp(name) for name in ("min", "max", "mean", "std")]
    columns = list(columns_for(requests))
    emitters = Emitters(tuple((f"l_act_{r.name}", r.name) for r in requests), row_evaluator(requests, columns))
    rng = random.Random(7)
    array = np.array(
        [[float(rng.randint(1, 9)) if c == NUMEL else rng.uniform(0.0, 3.0) for c in columns] for _ in range(4)]
    )
    array[1, 0] = -0.0
    array[2, 1] = 5e-324
    parts = [(emitters, f"l{i}", "act") for i in range(4)]
    key = tuple(part for row in parts for part in row)
    packed = ScalarBatch.from_packed(parts, array, 6, key, 6)
    plain = ScalarBatch([(e, row, 6, layer, tensor) for (e, layer, tensor), row in zip(parts, array.tolist())])
    assert packed.packed_rows() is array and plain.packed_rows() is None
    assert packed.row_parts() == plain.row_parts() and packed.row_iterations() == plain.row_iterations()
    assert len(packed) == len(plain) == 16 and packed._rows is None  # (no list made for any of these)
    assert packed.layout == plain.layout and packed.same_layout(key) and packed.iteration == plain.iteration == 6
    assert pickle.dumps(ChunkEncoder().encode(packed)) == pickle.dumps(ChunkEncoder().encode(plain))
    assert [repr(v) for v in packed.values] == [repr(v) for v in plain.values]
    assert list(packed) == list(plain) and packed.merged_rows() == plain.merged_rows()
    deferred = DeferredBatch((), key, 6, packed=(parts, array, 6))
    assert [repr(v) for v in deferred().values] == [repr(v) for v in plain.values]


def test_a_batch_whose_formulas_raise_there_is_reported_and_the_next_ones_are_written(tmp_path):
    reports = []
    logger = MetricLogger(background=True, on_sink_error="warn", report=reports.append, writer_process=True)
    logger.add_sink(JsonlSink(str(tmp_path / "s.jsonl")))
    ratio = Emitters(
        (("l_t_ratio", "ratio"),), compiled_formulas.compiled("def values_of(row):\n    return [row[0] / row[1]]\n")
    )
    for iteration, divisor in ((0, 0.0), (1, 4.0)):
        logger.log_scalars(ScalarBatch([(ratio, [1.0, divisor], iteration, "l", "t")]))
        logger.flush()
    logger.close()
    assert len(reports) == 1 and "could not build a batch of statistics of iteration(s) 0" in reports[0]
    assert "ZeroDivisionError" in reports[0]
    records = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["value"]) for r in records] == [(1, 0.25)]


def test_background_logging_rejects_strings_other_than_process(tmp_path, no_debug_session):
    with pytest.raises(TypeError, match="background_logging must be True, False or 'process'"):
        debug_api.initialize("", log_dir=str(tmp_path), background_logging="processes")


def _tensorboard(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    scalars = {t: [(e.step, e.value) for e in accumulator.Scalars(t)] for t in tags["scalars"]}
    tensors = {
        t: [(e.step, e.tensor_proto.SerializeToString()) for e in accumulator.Tensors(t)] for t in tags["tensors"]
    }
    return scalars, tensors


def test_a_tensorboard_sink_of_its_own_is_written_there(tmp_path, no_debug_session):
    _train(tmp_path / "thread", True, tensorboard=True)
    in_process = _train(tmp_path / "process", "process", tensorboard=True)
    assert in_process.writer._file is None  # the object in the training process opened no event file
    (in_process_file,) = (tmp_path / "process" / "tb").glob("*tfevents*")  # one run, one writer
    (in_thread_file,) = (tmp_path / "thread" / "tb").glob("*tfevents*")
    pid = str(os.getpid())
    # (events.out.tfevents.<time>.<host>.<pid>.<n>: the host may hold dots)
    assert in_process_file.name.split(".")[-2] != pid and in_thread_file.name.split(".")[-2] == pid  # who wrote it
    scalars, tensors = _tensorboard(tmp_path / "process" / "tb")
    assert (scalars, tensors) == _tensorboard(tmp_path / "thread" / "tb")
    assert scalars["train/loss"] == [(0, 0.5), (1, 1.5), (2, 2.5)]
    assert scalars["train/final"] == [(3, 9.0)]  # logged after the last step: handed over at the end
    assert len([t for t in scalars if t.endswith("/activation/max")]) == 8  # 2 blocks x 4 GEMMs
    assert "custom_scalars__config__" in tensors


def test_a_tensorboard_sink_of_a_given_writer_stays(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    assert TensorBoardSink(writer).writer_process_spec() is None  # the training script's writer: not moved
    writer.close()
    assert TensorBoardSink(log_dir=str(tmp_path / "own")).writer_process_spec() == (
        "tedebug.sinks.tensorboard",
        "TensorBoardSink",
        {"log_dir": str(tmp_path / "own"), "tag_style": "hierarchical", "summaries": True},
    )


def test_a_tensorboard_sink_given_to_a_later_session_writes_there(tmp_path, no_debug_session):
    """A sink the writer process wrote for one session, given to a later session with the writer thread: that
    session's statistics and layout reach its event file (the sink does not stay "written elsewhere")."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(bench._Block(32, 2, 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(1, 8, 32)
    for background_logging in ("process", True):
        debug_api.initialize(
            STATS, log_dir=str(tmp_path / str(background_logging)), background_logging=background_logging
        )
        debug_api.add_statistics_sink(sink)
        bench.train_step(model, x, optimizer, None)
        debug_api.end_debug()
    files = sorted((tmp_path / "tb").glob("*tfevents*"), key=lambda path: path.stat().st_mtime)
    assert len(files) == 2  # the writer process's, then this process's
    for path in files:
        tags = {v.tag for event in EventFileLoader(str(path)).Load() for v in event.summary.value}
        assert "custom_scalars__config__" in tags and any(tag.endswith("/activation/max") for tag in tags)
