"""The background statistics writer: ordering, the one-step backlog bound, errors re-raised in the caller's thread,
drain at close and at interpreter exit (a crashing subprocess), synchronous mode writing the same files, and foreign
sinks staying in the caller's thread.  Synchronisation is by events and joins only (no sleeps)."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import types
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import tedebug.debug_api as debug_api
from tedebug.sinks import BackgroundSinkError, MetricLogger, Sink
from tedebug.sinks import text as text_module
from tedebug.sinks.jsonl import JsonlSink
from tedebug.sinks.tensorboard import TensorBoardSink
from tedebug.sinks.text import TextStatsSink

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRITER_THREAD = "tedebug-stats-writer"


pytestmark = [
    pytest.mark.filterwarnings("ignore:Could not find config file"),
    pytest.mark.usefixtures("no_debug_session"),
]  # tests/conftest.py


def rec(layer, stat, value, it, tensor="activation"):
    return (f"{layer}_{tensor}_{stat}", value, it, layer, tensor, stat)


class ThreadedRecorder(Sink):
    """A thread-safe sink recording every call with the name of the thread it ran on."""

    thread_safe = True

    def __init__(self):
        self.calls = []  # ("log", record, thread) / ("flush", thread) / ("close", thread)

    def log_scalar(self, name, value, iteration, *, layer=None, tensor=None, stat=None):
        self.calls.append(("log", (name, value, iteration, layer, tensor, stat), threading.current_thread().name))

    def flush(self):
        self.calls.append(("flush", threading.current_thread().name))

    def close(self):
        self.calls.append(("close", threading.current_thread().name))


class CallerSink(Sink):
    """A `Sink` that does not declare itself thread-safe."""

    def __init__(self):
        self.threads = []

    def log_scalar(self, name, value, iteration, *, layer=None, tensor=None, stat=None):
        self.threads.append(threading.current_thread().name)


class Plain:
    """nvdlfw-style logger: only (name, value, iteration)."""

    def __init__(self):
        self.calls = []

    def log_scalar(self, name, value, iteration):
        self.calls.append((name, value, iteration, threading.current_thread().name))


class Gated(ThreadedRecorder):
    """Blocks in `log_scalars` for batches containing `blocked_iteration` until `gate` is set; `entered` is set when
    it starts blocking."""

    def __init__(self, blocked_iteration):
        super().__init__()
        self.blocked_iteration = blocked_iteration
        self.gate, self.entered = threading.Event(), threading.Event()

    def log_scalars(self, records):
        if any(r[2] == self.blocked_iteration for r in records):
            self.entered.set()
            self.gate.wait()
        super().log_scalars(records)


class WaitSignal(threading.Event):
    """An Event that tells (through `waiting`) when a thread starts waiting on it."""

    def __init__(self, is_set):
        super().__init__()
        self.waiting = threading.Event()
        if is_set:
            self.set()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


def signal_waits(metrics):
    """Replace the writer's idle event so that the test learns when a caller blocks on the job in flight."""
    writer = metrics._writer
    writer._idle = WaitSignal(writer._idle.is_set())
    return writer._idle.waiting


def writer_threads():
    return [t for t in threading.enumerate() if t.name == WRITER_THREAD]


# ------------------------------------------------------------------------------------------------ ordering
def test_order_across_steps_and_threads():
    metrics = MetricLogger(background=True)
    threaded, caller, plain = ThreadedRecorder(), CallerSink(), Plain()
    for sink in (threaded, caller, plain):
        metrics.add_sink(sink)
    expected = []
    main = threading.current_thread().name
    for it in range(4):
        batch = [rec("L0", "max", 1.5 * it, it), rec("L1", "min", -it, it)]
        metrics.log_scalars(batch)
        assert plain.calls[-2:] == [(r[0], r[1], r[2], main) for r in batch]  # synchronous, before flush
        metrics.log_scalar(f"free_{it}", 0.25, it)  # single scalars keep their place between batches
        metrics.log_scalar(f"free_{it}_b", 0.5, it, layer="L2", tensor="t", stat="s")
        metrics.log_scalars([rec("L3", "std", 2.0, it)])
        expected += [
            batch[0],
            batch[1],
            (f"free_{it}", 0.25, it, None, None, None),
            (f"free_{it}_b", 0.5, it, "L2", "t", "s"),
            rec("L3", "std", 2.0, it),
        ]
        metrics.flush()
    metrics.drain()
    logged = [c[1] for c in threaded.calls if c[0] == "log"]
    assert logged == expected
    assert [c[0] for c in threaded.calls].count("flush") == 4  # one per step, each after its batch
    assert {c[-1] for c in threaded.calls} == {WRITER_THREAD}
    assert caller.threads == [main] * len(expected) and {c[3] for c in plain.calls} == {main}
    assert writer_threads() == []  # drain joined the thread
    metrics.close()
    assert threaded.calls[-1] == ("close", main)  # closed after the writer finished


def test_flush_waits_for_the_previous_batch_and_keeps_one_in_flight():
    metrics = MetricLogger(background=True)
    gated, after = Gated(blocked_iteration=1), ThreadedRecorder()
    metrics.add_sink(gated)
    metrics.add_sink(after)
    metrics.log_scalars([rec("L", "max", 1.0, 1)])
    metrics.flush()  # hands over step 1; the writer blocks inside `gated`
    assert gated.entered.wait(10)
    metrics.log_scalars([rec("L", "max", 2.0, 2)])  # returns at once: only queued
    waiting = signal_waits(metrics)
    flusher = threading.Thread(target=metrics.flush)  # step 2's flush must wait for step 1's batch
    flusher.start()
    assert waiting.wait(10)
    assert flusher.is_alive()
    assert metrics._writer._jobs.qsize() == 0 and len(metrics._pending) == 1  # step 2 not handed over yet
    assert after.calls == []  # step 1 still in flight
    gated.gate.set()
    flusher.join()
    metrics.drain()
    assert [c[1][2] for c in after.calls if c[0] == "log"] == [1, 2]
    assert [c[0] for c in after.calls] == ["log", "flush", "log", "flush"]
    metrics.close()


# ------------------------------------------------------------------------------------------------ errors
class Failing(ThreadedRecorder):
    def __init__(self, path, fail_at):
        super().__init__()
        self.path, self.fail_at = path, fail_at

    def log_scalars(self, records):
        if any(r[2] == self.fail_at for r in records):
            raise OSError(f"disk full at {self.path}")
        super().log_scalars(records)


def _failing_and_good(path) -> tuple:
    """A background MetricLogger with a sink that fails at iteration 2 and a good one after it."""
    metrics = MetricLogger(background=True)
    failing, good = Failing(str(path), fail_at=2), ThreadedRecorder()
    metrics.add_sink(failing)
    metrics.add_sink(good)
    return metrics, failing, good


def test_writer_error_is_raised_in_the_caller_naming_the_sink(tmp_path):
    metrics, failing, good = _failing_and_good(tmp_path / "x.log")
    for it in (1, 2):
        metrics.log_scalars([rec("L", "max", float(it), it)])
        metrics.flush()  # step 2's batch fails on the writer thread
    metrics._writer.wait()
    with pytest.raises(BackgroundSinkError) as info:
        metrics.log_scalars([rec("L", "max", 3.0, 3)])  # queued before the error is raised
    error = info.value
    assert str(error).startswith(
        f"statistics sink Failing({str(tmp_path / 'x.log')!r}) failed in tedebug's "
        f"background writer while writing iteration(s) 2: OSError: disk full"
    )
    assert error.sink is failing and isinstance(error.__cause__, OSError)
    metrics.flush()  # reported once; step 3 (queued at the failing call) is handed over
    metrics.drain()
    assert [c[1][2] for c in good.calls if c[0] == "log"] == [1, 2, 3]  # the other sink got every batch
    assert [c[1][2] for c in failing.calls if c[0] == "log"] == [1, 3]
    metrics.close()


def test_writer_error_at_flush_and_close_still_closes_every_sink(tmp_path):
    metrics = MetricLogger(background=True)
    failing, good = Failing("f", fail_at=5), ThreadedRecorder()
    metrics.add_sink(failing)
    metrics.add_sink(good)
    metrics.log_scalars([rec("L", "max", 1.0, 5)])
    metrics.flush()
    with pytest.raises(BackgroundSinkError, match=r"Failing\('f'\) failed .* iteration\(s\) 5"):
        metrics.flush()  # waits for the batch in flight, then re-raises its error
    metrics.log_scalars([rec("L", "max", 1.0, 5)])
    with pytest.raises(BackgroundSinkError, match="iteration"):
        metrics.close()  # the drain at close surfaces the error ...
    assert failing.calls[-1][0] == "close" and good.calls[-1][0] == "close"  # ... after closing every sink
    assert metrics.sinks == [] and writer_threads() == []


def test_close_drains_the_batch_in_flight(tmp_path):
    metrics = MetricLogger(background=True)
    gated, jsonl = Gated(blocked_iteration=0), JsonlSink(str(tmp_path / "m.jsonl"))
    metrics.add_sink(gated)
    metrics.add_sink(jsonl)
    metrics.log_scalars([rec("L", "max", 0.5, 0)])
    metrics.flush()
    assert gated.entered.wait(10)
    assert (tmp_path / "m.jsonl").read_text() == ""  # the writer holds the batch
    waiting = signal_waits(metrics)
    releaser = threading.Thread(target=lambda: (waiting.wait(), gated.gate.set()))
    releaser.start()
    metrics.close()  # blocks until the batch is written, then closes
    releaser.join()
    assert [json.loads(line)["value"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [0.5]
    assert writer_threads() == []


# ------------------------------------------------------------------------------------------------ exit drain
CRASH_SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, threading
    import torch
    from tedebug import debug_api

    def report():  # registered before tedebug's handler, so it runs after it: is everything on disk by then?
        with open(os.path.join(sys.argv[1], "tedebug_statistics", "metrics_globalrank-0.jsonl")) as f:
            iterations = [json.loads(line)["iteration"] for line in f]
        writers = [t.name for t in threading.enumerate() if t.name == "tedebug-stats-writer"]
        print("AT EXIT", json.dumps({"iterations": iterations, "writer_threads": writers}))

    atexit.register(report)
    writers = {"thread": True, "process": "process"}
    debug_api.initialize("", log_dir=sys.argv[1], background_logging=writers[sys.argv[2]])
    session = debug_api.session()
    for it in range(3):
        session.stats.feed("L", "activation", ["max"], torch.tensor([1.0, 2.0]) + it, iteration=it)
        debug_api.step()
    with open(os.path.join(sys.argv[1], "tedebug_statistics", "metrics_globalrank-0.jsonl")) as f:
        print("AFTER STEP 2", json.dumps([json.loads(line)["iteration"] for line in f]))
    raise RuntimeError("crash in iteration 3")
""")


@pytest.mark.parametrize("writer, on_disk", [("thread", [0, 1]), ("process", [0])])
def test_crash_after_step_leaves_the_stepped_iterations_on_disk(tmp_path, writer, on_disk):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(tmp_path), writer], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "RuntimeError: crash in iteration 3" in done.stderr, done.stderr
    after_step = json.loads(done.stdout.split("AFTER STEP 2 ", 1)[1].splitlines()[0])
    # when step() returned for iteration 2: iteration 1 on disk (the writer thread), or iteration 0 on disk and
    # iteration 1 in the writer process
    assert after_step[: len(on_disk)] == on_disk
    at_exit = json.loads(done.stdout.split("AT EXIT ", 1)[1])
    assert at_exit == {"iterations": [0, 1, 2], "writer_threads": []}  # drained and joined by tedebug's handler
    with open(tmp_path / "tedebug_statistics" / "metrics_globalrank-0.jsonl", encoding="utf-8") as f:
        assert [(r["iteration"], r["value"]) for r in map(json.loads, f)] == [(0, 2.0), (1, 3.0), (2, 4.0)]
    with open(tmp_path / "nvdlfw_inspect_statistics_logs" / "nvdlfw_inspect_globalrank-0.log", encoding="utf-8") as f:
        assert [line.split(" - INFO - ")[1] for line in f.read().splitlines()] == [
            f"L_activation_max \t\t\t\t iteration={it:06d} \t\t\t\t value={it + 2.0:.4f}" for it in range(3)
        ]


# ------------------------------------------------------------------------------------------------ sync == background
FIXED_TIME = 1_700_000_000.25  # the text lines' timestamps are pinned so the files compare byte for byte


def run_session(log_dir, background):
    """Steps of a session with every tedebug sink (text, JSONL, flat TB via tb_writer, hierarchical TB); returns
    whether the last step's statistics were on disk when step() returned."""
    writer = SummaryWriter(log_dir=os.path.join(log_dir, "tb_flat"))
    debug_api.add_statistics_sink(TensorBoardSink(log_dir=os.path.join(log_dir, "tb_hier")))
    debug_api.initialize(
        "", log_dir=log_dir, tb_writer=writer, default_logging_enabled=True, background_logging=background
    )
    session = debug_api.session()
    assert session.metric_logger.background is background
    in_flight = []
    x = torch.tensor([[1.0, -2.0, 0.0], [0.5, 4.0, 3.0e-5]])
    for it in range(3):
        session.stats.feed(
            "enc.0.fc1", "activation", ["min", "max", "mean", "std", "l1_norm"], x * (it + 1), iteration=it
        )
        session.stats.feed("enc.0.fc1", "weight", ["max", "cur_amax"], x.flip(0) - it, iteration=it)
        session.stats.feed("enc.1.fc2", "gradient", ["max", "std"], torch.tensor([float("nan"), 1.0]), iteration=it)
        session.metric_logger.log_scalar(f"custom_{it}", 2.0**130, it)  # no structured keywords; float32 inf in TB
        debug_api.step()
        in_flight.append(session.stats.has_in_flight)
    assert in_flight == [background] * 3  # background: the deferred read-back (records held back to keep the order)
    jsonl = os.path.join(log_dir, "tedebug_statistics", "metrics_globalrank-0.jsonl")
    with open(jsonl, encoding="utf-8") as f:
        on_disk_at_step = any(json.loads(line)["iteration"] == 2 for line in f)
    debug_api.end_debug()
    writer.close()
    return on_disk_at_step


def tb_events(log_dir):
    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, {
        tag: [e.tensor_proto.SerializeToString() for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]
    }


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def test_background_and_synchronous_sessions_write_the_same_files(tmp_path, monkeypatch):
    fake_time = types.SimpleNamespace(time=lambda: FIXED_TIME, strftime=time.strftime, localtime=time.localtime)
    monkeypatch.setattr(text_module, "time", fake_time)
    sync_dir, bg_dir = str(tmp_path / "sync"), str(tmp_path / "bg")
    assert run_session(sync_dir, background=False) is True  # synchronous: written inside step()
    run_session(bg_dir, background=True)
    assert writer_threads() == []
    for rel in (
        os.path.join("nvdlfw_inspect_statistics_logs", "nvdlfw_inspect_globalrank-0.log"),
        os.path.join("tedebug_statistics", "metrics_globalrank-0.jsonl"),
    ):
        sync_bytes = read_bytes(os.path.join(sync_dir, rel))
        assert sync_bytes and sync_bytes == read_bytes(os.path.join(bg_dir, rel)), rel
    text_lines = (
        read_bytes(os.path.join(sync_dir, "nvdlfw_inspect_statistics_logs", "nvdlfw_inspect_globalrank-0.log"))
        .decode()
        .splitlines()
    )
    assert len(text_lines) == 3 * 10
    assert text_lines[0].endswith(
        " - INFO - custom_0 \t\t\t\t iteration=000000 \t\t\t\t value=1361129467683753853853498429727072845824.0000"
    )  # 2**130
    assert text_lines[1] == (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(FIXED_TIME)) + ",250 - INFO - "
        "enc.0.fc1_activation_min \t\t\t\t iteration=000000 \t\t\t\t value=-2.0000"
    )
    for sub in ("tb_flat", "tb_hier"):
        sync_scalars, sync_tensors = tb_events(os.path.join(sync_dir, sub))
        bg_scalars, bg_tensors = tb_events(os.path.join(bg_dir, sub))
        summaries = [tag for tag in sync_scalars if tag.startswith("summary/")]
        assert len(summaries) == (0 if sub == "tb_flat" else 9 * 3)  # hierarchical: max, p90, median per stat
        assert len(sync_scalars) - len(summaries) == 9 + 3  # 9 statistics x 3 steps, custom_0..2 once each
        assert all(len(v) == (1 if tag.startswith("custom_") else 3) for tag, v in sync_scalars.items())
        assert repr(sync_scalars) == repr(bg_scalars)  # repr: NaN compares equal to NaN
        assert sync_tensors == bg_tensors  # the custom-scalars layouts
    flat, _ = tb_events(os.path.join(sync_dir, "tb_flat"))
    assert flat["enc.0.fc1_activation_max"] == [(0, 4.0), (1, 8.0), (2, 12.0)]
    assert flat["custom_1"] == [(1, float("inf"))]


def test_background_logging_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="background_logging must be True, False or .process."):
        debug_api.initialize("", log_dir=str(tmp_path), background_logging="yes")
    assert debug_api.DEBUG_MANAGER is None


def test_thread_safety_declarations(tmp_path):
    class NotSummaryWriter:
        def add_scalar(self, tag, value, step):
            pass

        def flush(self):
            pass

    assert TextStatsSink(str(tmp_path / "t.log")).thread_safe and JsonlSink(str(tmp_path / "j.jsonl")).thread_safe
    assert TensorBoardSink(log_dir=str(tmp_path / "a")).thread_safe
    assert TensorBoardSink(SummaryWriter(str(tmp_path / "b"))).thread_safe
    assert not TensorBoardSink(NotSummaryWriter()).thread_safe  # a foreign writer stays in the caller's thread
    assert not Sink.thread_safe
    metrics = MetricLogger(background=True)
    thread_safe, foreign = ThreadedRecorder(), TensorBoardSink(NotSummaryWriter())
    metrics.add_sink(thread_safe)
    metrics.add_sink(foreign)
    assert metrics._writer_sinks == [thread_safe] and metrics._caller_sinks == [foreign]
    sync = MetricLogger()
    sync.add_sink(thread_safe)
    assert sync._writer is None and sync._caller_sinks == [thread_safe]
    metrics.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_gets_its_own_writer_while_the_parent_has_a_batch_in_flight():
    metrics = MetricLogger(background=True)
    gated = Gated(blocked_iteration=0)
    metrics.add_sink(gated)
    metrics.log_scalars([rec("L", "max", 1.0, 0)])
    metrics.flush()
    assert gated.entered.wait(10)  # the parent's writer holds iteration 0
    pid = os.fork()
    if pid == 0:  # child: its own writer thread writes its own batch; the parent's job is not waited for
        code = 3
        try:
            metrics.log_scalars([rec("L", "max", 2.0, 1)])
            metrics.drain()
            if [c[1][2] for c in gated.calls if c[0] == "log"] == [1] and gated.calls[-1] == ("flush", WRITER_THREAD):
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    gated.gate.set()
    metrics.close()
    assert [c[1][2] for c in gated.calls if c[0] == "log"] == [0]  # the parent wrote only its own batch


def test_deferred_records_are_built_once_on_the_writer_thread():
    """`log_deferred(build)`: in background mode with only writer sinks, `build` runs once, on the writer thread,
    and every writer sink gets its records in order; with a sink called in the caller's thread it runs at once."""
    built = []

    def build(records):
        def run():
            built.append(threading.current_thread().name)
            return records

        return run

    a, b = ThreadedRecorder(), ThreadedRecorder()
    logger = MetricLogger(background=True)
    logger.add_sink(a)
    logger.add_sink(b)
    first, second = [rec("L", "max", 1.0, 0)], [rec("L", "min", -2.0, 1), rec("M", "max", 3.0, 1)]
    logger.log_deferred(build(first))
    assert built == []  # nothing built in the caller's thread
    logger.flush()
    logger.log_deferred(build(second))
    logger.flush()
    logger.drain()
    assert built == [WRITER_THREAD, WRITER_THREAD]
    for sink in (a, b):
        assert [c[1] for c in sink.calls if c[0] == "log"] == first + second
        assert all(c[-1] == WRITER_THREAD for c in sink.calls)
    logger.close()

    built.clear()
    caller = MetricLogger(background=True)
    foreign = types.SimpleNamespace(rows=[], log_scalar=lambda n, v, i: foreign.rows.append((n, v, i)))
    caller.add_sink(foreign)
    caller.log_deferred(build(first))
    assert built == [threading.current_thread().name] and foreign.rows == [("L_activation_max", 1.0, 0)]
    caller.close()


def test_a_failing_deferred_build_is_reraised_in_the_caller():
    logger = MetricLogger(background=True)
    sink = ThreadedRecorder()
    logger.add_sink(sink)

    def broken():
        raise ZeroDivisionError("no values")

    logger.log_deferred(broken)
    logger.flush()
    with pytest.raises(BackgroundSinkError, match="could not build a batch of statistics: ZeroDivisionError") as info:
        logger.drain()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert [c for c in sink.calls if c[0] == "log"] == []
    logger.close()


# ------------------------------------------------------------------------------------------------ deferred read-back
class StatsRecorder(Sink):
    """A caller-thread sink keeping (name, value, iteration)."""

    def __init__(self):
        self.calls = []

    def log_scalar(self, name, value, iteration, *, layer=None, tensor=None, stat=None):
        self.calls.append((name, value, iteration))


def jsonl_iterations(log_dir):
    with open(os.path.join(log_dir, "tedebug_statistics", "metrics_globalrank-0.jsonl"), encoding="utf-8") as f:
        return [(r["name"], r["iteration"], r["value"]) for r in map(json.loads, f)]


def test_a_caller_thread_sink_gets_each_iteration_at_its_own_step(tmp_path):
    """Deferred read-back holds a step's statistics until the next step, so it is used only while every sink runs
    on the writer thread: with a caller-thread sink the statistics of iteration N reach it during step N (as in
    TransformerEngine).  Adding such a sink mid-run catches up: the iteration in flight is emitted first, in order."""
    debug_api.initialize("", log_dir=str(tmp_path))
    session = debug_api.session()
    x = torch.tensor([1.0, -3.0])
    for it in range(2):
        session.stats.feed("L", "activation", ["max"], x + it, iteration=it)
        debug_api.step()
        assert session.stats.has_in_flight
    late = StatsRecorder()
    debug_api.add_statistics_sink(late)
    assert not session.metric_logger.defers_builds
    session.stats.feed("L", "activation", ["max"], x + 2, iteration=2)
    debug_api.step()
    assert not session.stats.has_in_flight
    assert late.calls == [("L_activation_max", 2.0, 1), ("L_activation_max", 3.0, 2)]  # 1 caught up, then 2
    debug_api.end_debug()
    assert jsonl_iterations(str(tmp_path)) == [
        ("L_activation_max", 0, 1.0),
        ("L_activation_max", 1, 2.0),
        ("L_activation_max", 2, 3.0),
    ]

    early = StatsRecorder()
    debug_api.initialize("", log_dir=str(tmp_path / "again"), statistics_logger=early)
    session = debug_api.session()
    session.stats.feed("L", "activation", ["max"], x, iteration=0)
    debug_api.step()
    assert early.calls == [("L_activation_max", 1.0, 0)] and not session.stats.has_in_flight


def test_the_iteration_in_flight_is_written_by_flush_and_end_debug(tmp_path):
    debug_api.initialize("", log_dir=str(tmp_path))
    session = debug_api.session()
    session.stats.feed("L", "gradient", ["min"], torch.tensor([4.0, 0.5]), iteration=0)
    debug_api.step()
    assert jsonl_iterations(str(tmp_path)) == []
    session.flush()
    assert jsonl_iterations(str(tmp_path)) == [("L_gradient_min", 0, 0.5)] and not session.stats.has_in_flight
    session.stats.feed("L", "gradient", ["min"], torch.tensor([4.0, -0.5]), iteration=1)
    debug_api.step()
    debug_api.end_debug()
    assert jsonl_iterations(str(tmp_path)) == [("L_gradient_min", 0, 0.5), ("L_gradient_min", 1, -0.5)]


def test_flush_and_wait_writes_in_the_caller_thread_after_the_batch_in_flight(tmp_path):
    """`flush_and_wait` (what `debug_api.step()` calls): the batch in flight on the writer thread is written first,
    then the queued one in the caller's thread, in order; a sink error is raised as the writer's errors are (naming
    the sink), the failed sink is skipped afterwards under "warn", and an interrupt in a sink is not kept."""
    metrics = MetricLogger(background=True)
    sink = Gated(blocked_iteration=1)
    metrics.add_sink(sink)
    metrics.log_scalars([rec("L", "max", 1.0, 1)])
    metrics.flush()  # batch 1 in flight on the writer thread, held at the gate
    assert sink.entered.wait(10)
    metrics.log_scalars([rec("L", "max", 2.0, 2)])
    waiting = signal_waits(metrics)
    waiter = threading.Thread(target=metrics.flush_and_wait)
    waiter.start()
    assert waiting.wait(10) and waiter.is_alive()  # it waits for batch 1 before writing batch 2
    assert [c for c in sink.calls if c[0] == "log"] == []
    sink.gate.set()
    waiter.join()
    logged = [(c[1][2], c[2]) for c in sink.calls if c[0] == "log"]
    assert logged == [(1, WRITER_THREAD), (2, waiter.name)]
    metrics.close()

    raising, failing, good = _failing_and_good(tmp_path / "y.log")
    for it in (1, 2):
        raising.log_scalars([rec("L", "max", float(it), it)])
        if it == 1:
            raising.flush_and_wait()
    with pytest.raises(BackgroundSinkError, match=r"Failing\(.*y\.log'\) failed .* iteration\(s\) 2: OSError"):
        raising.flush_and_wait()
    assert [c[1][2] for c in good.calls if c[0] == "log"] == [1, 2]  # the other sink got every batch
    assert all(c[-1] == threading.current_thread().name for c in good.calls)
    raising.close()

    warned = []
    warn = MetricLogger(background=True, on_sink_error="warn", report=warned.append)
    failing = Failing("z", fail_at=1)
    warn.add_sink(failing)
    for it in (1, 2):
        warn.log_scalars([rec("L", "max", float(it), it)])
        warn.flush_and_wait()
    assert len(warned) == 1 and [c for c in failing.calls if c[0] == "log"] == []  # stopped after the failure
    warn.close()

    class Interrupting(ThreadedRecorder):
        def log_scalars(self, records):
            raise KeyboardInterrupt

    interrupted = MetricLogger(background=True, on_sink_error="warn", report=warned.append)
    interrupted.add_sink(Interrupting())
    interrupted.log_scalars([rec("L", "max", 1.0, 1)])
    with pytest.raises(KeyboardInterrupt):
        interrupted.flush_and_wait()
    interrupted.close()


def test_a_background_session_writes_at_step_in_the_training_thread(tmp_path):
    """`debug_api.step()` writes iteration N-1 itself (it waits for it anyway), so a thread-safe sink of a
    background session is called in the training thread and the files are those of a synchronous session."""
    sink = ThreadedRecorder()
    debug_api.add_statistics_sink(sink)
    debug_api.initialize("", log_dir=str(tmp_path))
    session = debug_api.session()
    assert session.metric_logger.background
    for it in range(3):
        session.stats.feed("L", "activation", ["max"], torch.tensor([1.0, float(it)]), iteration=it)
        debug_api.step()
    at_steps = list(sink.calls)  # iterations 0 and 1, written during steps 1 and 2
    debug_api.end_debug()
    assert [c[1][2] for c in at_steps if c[0] == "log"] == [0, 1]
    assert {c[-1] for c in at_steps} == {threading.current_thread().name}
    assert [c[1][2] for c in sink.calls if c[0] == "log"] == [0, 1, 2]  # the last one at end_debug
