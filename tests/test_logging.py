"""Main text log (files, formats, env vars, log-once) and the statistics text sink / MetricLogger fan-out."""

import logging
import os
import re

import pytest
import torch

from tedebug.logging import TextLog, file_mode_from_env, log_file_name, log_level_from_env
from tedebug.sinks import MetricLogger, Sink, check_sink
from tedebug.sinks.text import TextStatsSink, format_stat_message, stats_log_path

ASCTIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
TABS = " \t\t\t\t "


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in (
        "NVDLFW_INSPECT_LOG_LEVEL",
        "NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE",
        "NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP",
        "NVDLFW_INSPECT_LOG_TIMESTAMP",
    ):
        monkeypatch.delenv(var, raising=False)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


# ------------------------------------------------------------------------------------------------ env vars
def test_file_name_default_and_timestamp(monkeypatch):
    assert log_file_name(0) == "nvdlfw_inspect_globalrank-0.log"
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP", "1")
    monkeypatch.setenv("NVDLFW_INSPECT_LOG_TIMESTAMP", "20250131_051157")
    assert log_file_name(3) == "nvdlfw_inspect_20250131_051157_globalrank-3.log"
    monkeypatch.delenv("NVDLFW_INSPECT_LOG_TIMESTAMP")
    assert re.fullmatch(r"nvdlfw_inspect_\d{8}_\d{6}_globalrank-1\.log", log_file_name(1))


@pytest.mark.parametrize(
    "value, level",
    [(None, logging.INFO), ("DEBUG", logging.DEBUG), ("warning", logging.WARNING), ("bogus", logging.INFO)],
)
def test_level_from_env(monkeypatch, value, level):
    if value is not None:
        monkeypatch.setenv("NVDLFW_INSPECT_LOG_LEVEL", value)
    assert log_level_from_env() == level


def test_overwrite_env(monkeypatch):
    assert file_mode_from_env() == "w"
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "0")
    assert file_mode_from_env() == "a"


# ------------------------------------------------------------------------------------------------ main log
def test_main_log_layout_format_and_stderr(tmp_path, capsys):
    log = TextLog(str(tmp_path), 2)
    assert log.path == os.path.join(str(tmp_path), "nvdlfw_inspect_logs", "nvdlfw_inspect_globalrank-2.log")
    log.log("Reading config from x.yaml.")
    log.log("careful", logging.WARNING)
    log.log("hidden", logging.DEBUG)
    log.close()
    lines = read_lines(log.path)
    assert len(lines) == 2
    assert re.fullmatch(ASCTIME + r" - INFO - Reading config from x\.yaml\.", lines[0])
    assert re.fullmatch(ASCTIME + r" - WARNING - careful", lines[1])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch("NVDLFW INSPECT - " + ASCTIME + r" - WARNING - careful", err[0])


def test_main_log_debug_level_and_append(tmp_path, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "0")
    first = TextLog(str(tmp_path), 0)
    first.log("one", logging.DEBUG)
    first.close()
    second = TextLog(str(tmp_path), 0)
    second.log("two")
    second.close()
    assert [line.split(" - ", 2)[1:] for line in read_lines(first.path)] == [["DEBUG", "one"], ["INFO", "two"]]


def test_truncates_by_default(tmp_path):
    for message in ("first", "second"):
        log = TextLog(str(tmp_path), 0)
        log.log(message)
        log.close()
    lines = read_lines(log.path)
    assert len(lines) == 1 and lines[0].endswith(" - INFO - second")


def test_log_once_and_close_removes_handlers(tmp_path):
    log = TextLog(str(tmp_path), 0)
    assert log.log_once(("fc1", "msg", None), "m1") is True
    assert log.log_once(("fc1", "msg", None), "m1") is False
    assert log.log_once(("fc1", "msg", ["unhashable"]), "m2") is True
    assert log.log_once(("fc1", "msg", ["unhashable"]), "m2") is False
    assert len(log.logger.handlers) == 2 and log.logger.propagate is False
    log.close()
    assert log.logger.handlers == []
    assert [line.rsplit(" - ", 1)[1] for line in read_lines(log.path)] == ["m1", "m2"]


def test_sessions_use_distinct_loggers(tmp_path):
    a, b = TextLog(str(tmp_path / "a"), 0), TextLog(str(tmp_path / "b"), 0)
    assert a.logger is not b.logger and a.logger.name.startswith("tedebug.session.")
    a.close()
    b.close()


# ------------------------------------------------------------------------------------------------ stats lines
@pytest.mark.parametrize(
    "value, iteration, expected",
    [
        (1.4388, 20, "fc1_activation_max \t\t\t\t iteration=000020 \t\t\t\t value=1.4388"),
        (0.15625, 7, "fc1_activation_max \t\t\t\t iteration=000007 \t\t\t\t value=0.1562"),  # exact tie -> even
        (0.46875, 7, "fc1_activation_max \t\t\t\t iteration=000007 \t\t\t\t value=0.4688"),  # exact tie -> even
        (-2.5, 1234567, "fc1_activation_max \t\t\t\t iteration=1234567 \t\t\t\t value=-2.5000"),
        (torch.tensor(3.0), 0, "fc1_activation_max \t\t\t\t iteration=000000 \t\t\t\t value=3.0000"),
        (float("nan"), 5, "fc1_activation_max \t\t\t\t iteration=000005 \t\t\t\t value=nan"),
    ],
)
def test_stat_message_bytes(value, iteration, expected):
    assert format_stat_message("fc1_activation_max", value, iteration) == expected


def test_text_sink_file_through_metric_logger(tmp_path):
    path = stats_log_path(str(tmp_path), 0)
    assert path == os.path.join(str(tmp_path), "nvdlfw_inspect_statistics_logs", "nvdlfw_inspect_globalrank-0.log")
    metrics = MetricLogger()
    metrics.add_sink(TextStatsSink(path))
    metrics.log_scalar(
        "decoder.1.mlp.fc1_activation_l1_norm", 12.5, 3, layer="decoder.1.mlp.fc1", tensor="activation", stat="l1_norm"
    )
    metrics.log_scalar("decoder.1.mlp.fc1_activation_underflows%", 0.03125, 3)
    metrics.flush()
    lines = read_lines(path)  # visible after flush, before close
    metrics.close()
    assert len(lines) == 2
    assert re.fullmatch(
        ASCTIME
        + re.escape(
            " - INFO - decoder.1.mlp.fc1_activation_l1_norm" + TABS + "iteration=000003" + TABS + "value=12.5000"
        ),
        lines[0],
    )
    assert lines[1].endswith(
        " - INFO - decoder.1.mlp.fc1_activation_underflows%" + TABS + "iteration=000003" + TABS + "value=0.0312"
    )


# ------------------------------------------------------------------------------------------------ MetricLogger
class RecordingSink(Sink):
    def __init__(self):
        self.calls, self.flushes, self.closed = [], 0, False

    def log_scalar(self, name, value, iteration, *, layer=None, tensor=None, stat=None):
        self.calls.append((name, value, iteration, layer, tensor, stat))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


class PlainLogger:  # nvdlfw BaseLogger-style: only (name, value, iteration)
    def __init__(self):
        self.calls, self.flushes = [], 0

    def log_scalar(self, name, value, iteration):
        self.calls.append((name, value, iteration))

    def flush(self):
        self.flushes += 1


def test_metric_logger_fan_out_flush_close():
    structured, plain = RecordingSink(), PlainLogger()
    metrics = MetricLogger()
    metrics.add_sink(structured)
    metrics.add_logger(plain)  # nvdlfw spelling on an instance
    metrics.log_scalar("l_t_max", 2.0, 4, layer="l", tensor="t", stat="max")
    assert structured.calls == [("l_t_max", 2.0, 4, "l", "t", "max")]
    assert plain.calls == [("l_t_max", 2.0, 4)]
    metrics.flush()
    assert (structured.flushes, plain.flushes) == (1, 1)
    metrics.close()
    assert structured.closed and plain.flushes == 2 and metrics.sinks == []


def test_metric_logger_close_continues_after_a_failing_sink():
    class Failing(Sink):
        def log_scalar(self, *a, **k):
            pass

        def close(self):
            raise OSError("disk gone")

    last = RecordingSink()
    metrics = MetricLogger()
    metrics.add_sink(Failing())
    metrics.add_sink(last)
    with pytest.raises(OSError, match="disk gone"):
        metrics.close()
    assert last.closed


def test_check_sink_rejects_objects_without_log_scalar():
    with pytest.raises(TypeError, match="log_scalar"):
        check_sink(object())
    with pytest.raises(TypeError, match="log_scalar"):
        MetricLogger().add_sink("not a sink")
