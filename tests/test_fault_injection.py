"""Fault injection: hostile configs, processes killed mid-run, sinks that fail (ENOSPC), unwritable and shared log
directories, hostile layer names.  Each test asserts a promise of docs/reliability.md."""

import errno
import json
import logging
import os
import pathlib
import random
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import hostile_configs
from fault_trials import CHILD, kill_trial
from tedebug import debug_api
from tedebug.config import ConfigError, load_config
from tedebug.log_dir_lock import LogDirInUseError
from tedebug.registry import build_registry
from tedebug.sinks import BackgroundSinkError
from tedebug.sinks.jsonl import JsonlSink
from tedebug.sinks.record_file import RecordFile
from tedebug.sinks.tensorboard import TensorBoardSink

STATS = {
    "s": {
        "enabled": True,
        "layers": {"layer_types": ["fc1"]},
        "transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}},
    }
}


pytestmark = pytest.mark.usefixtures("no_debug_session")  # tests/conftest.py


def jsonl_records(log_dir):
    path = pathlib.Path(log_dir, "tedebug_statistics", "metrics_globalrank-0.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def main_log(log_dir):
    return pathlib.Path(log_dir, "nvdlfw_inspect_logs", "nvdlfw_inspect_globalrank-0.log").read_text()


def run_steps(layer, iterations, start=0):
    te = debug_api.transformer_engine
    for iteration in range(start, start + iterations):
        te.inspect_tensor(
            layer,
            tensor=torch.full((4, 4), float(iteration)),
            tensor_name="activation",
            iteration=iteration,
            tp_group=None,
        )
        debug_api.step()


# ------------------------------------------------------------------------------------------------ hostile configs
def test_every_hand_written_hostile_config_is_a_config_error_naming_the_file(tmp_path):
    registry = build_registry()
    cases = hostile_configs.hand_written(tmp_path / "hostile")
    assert len(cases) >= 100
    for label, source in cases:
        with pytest.raises(ConfigError) as info:
            load_config(
                source, feature_names=registry.feature_names(), feature_validators=registry.feature_validators()
            )
        first = str(info.value).splitlines()[0]
        where = "<dict>" if isinstance(source, dict) else str(source)
        assert first.startswith(where), (label, first)


def test_mutants_of_the_shipped_configs_load_or_are_config_errors(tmp_path):
    registry = build_registry()
    outcomes = {"loaded": 0, "rejected": 0}
    for label, path in hostile_configs.mutants(tmp_path, 150, seed=18):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                load_config(
                    path, feature_names=registry.feature_names(), feature_validators=registry.feature_validators()
                )
            outcomes["loaded"] += 1
        except ConfigError as err:
            assert str(err).startswith(path), label
            outcomes["rejected"] += 1
    assert outcomes["loaded"] + outcomes["rejected"] == 150 and outcomes["rejected"] > 0


def test_a_hostile_config_leaves_the_api_uninitialised_and_a_retry_works(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(hostile_configs._alias_bomb(12))
    with pytest.raises(ConfigError, match="more than 100000 YAML nodes"):
        debug_api.initialize(str(bomb), log_dir=str(tmp_path))
    assert not debug_api.is_enabled()
    debug_api.initialize(STATS, log_dir=str(tmp_path))
    assert debug_api.is_enabled()


def test_all_problems_of_a_file_in_one_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "a:\n  enabled: 'False'\n  layers:\n    layer_type: [fc1]\n  transformer_engine:\n"
        "    LogTensorStats:\n      enabled: True\n      tensors: [activation]\n"
        "      stats: [l2norm, underflows%, max]\n      freqq: 3\n"
    )
    registry = build_registry()
    with pytest.raises(ConfigError) as info:
        load_config(str(path), feature_names=registry.feature_names(), feature_validators=registry.feature_validators())
    found = [(issue.key_path, issue.line, issue.suggestion) for issue in info.value.issues]
    lts = ("a", "transformer_engine", "LogTensorStats")
    assert found == [
        (("a", "enabled"), 2, None),
        (("a", "layers", "layer_type"), 4, "layer_types"),
        (lts + ("freqq",), 10, None),
        (lts + ("stats", 0), 9, "l2_norm"),
        (lts + ("stats", 1), 9, None),
    ]
    assert "unknown key 'freqq'; did you mean 'freq'?" in info.value.issues[2].message
    assert info.value.issues[4].message.endswith("'underflows%' belongs to LogFp8TensorStats or LogNvfp4TensorStats")


def test_initialize_with_a_number_names_the_argument(tmp_path):
    with pytest.raises(TypeError, match=r"config_file must be a path \(str or PathLike\), a dict or '', got int: 123"):
        debug_api.initialize(123, log_dir=str(tmp_path))
    assert not debug_api.is_enabled()


# ------------------------------------------------------------------------------------------------ kill trials
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGINT", "exception"])
def test_killed_run_keeps_every_returned_iteration_and_only_whole_lines(tmp_path, how):
    after = random.Random(how).randint(1, 8)  # a different point per way of ending, the same in every run
    result = kill_trial(how, str(tmp_path), after=after)
    assert len(result.returned) >= after + 1
    assert result.bad_lines == [] and result.wrong_values == []
    if how == "SIGKILL":  # the README's promise: at most the last finished iteration is missing
        assert result.lost <= {max(result.returned)}
    else:
        assert result.lost == set()


@pytest.fixture
def answering_ctrl_c():
    """Python's own SIGINT handler for the test (a test run started as a background job of a non-interactive shell,
    `make test &`, inherits SIGINT ignored, and tedebug's guard only replaces the default handler)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("answering_ctrl_c")
def test_ctrl_c_inside_step_is_raised_after_the_step_completed(tmp_path):
    class InterruptingSink:
        def log_scalar(self, name, value, iteration):
            if iteration == 1:
                os.kill(os.getpid(), signal.SIGINT)  # lands inside debug_api.step()

    debug_api.initialize(STATS, log_dir=str(tmp_path), statistics_logger=InterruptingSink())
    run_steps("fc1", 1)
    with pytest.raises(KeyboardInterrupt):
        run_steps("fc1", 1, start=1)
    assert debug_api.get_iteration() == 2  # the step ran to its end
    debug_api.session().flush()
    assert [r["iteration"] for r in jsonl_records(tmp_path)] == [0, 1]
    debug_api.end_debug()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


# ------------------------------------------------------------------------------------------------ failing sinks
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that always says ENOSPC)")
@pytest.mark.parametrize("background", [True, False])
def test_a_full_disk_sink_is_reported_once_and_training_goes_on(tmp_path, background):
    debug_api.add_statistics_sink(JsonlSink("/dev/full"))
    debug_api.initialize(STATS, log_dir=str(tmp_path), background_logging=background)
    run_steps("fc1", 4)
    debug_api.end_debug()  # no exception from step() or end_debug()
    assert [r["iteration"] for r in jsonl_records(tmp_path)] == [0, 1, 2, 3]  # the other sinks went on
    warnings_ = [line for line in main_log(tmp_path).splitlines() if " - WARNING - " in line]
    assert len(warnings_) == 1
    iterations = "0" if background else "up to 0"  # the writer thread knows the batch; a caller-thread flush the last
    assert (
        f"statistics sink JsonlSink('/dev/full') failed while writing iteration(s) {iterations}: OSError: "
        f"[Errno 28] No space left on device (errno 28, ENOSPC); this sink is stopped"
    ) in warnings_[0]


def test_a_tensorboard_directory_that_cannot_be_made_fails_at_set_up(tmp_path):
    (tmp_path / "taken").write_text("a file where the event directory should go")
    with pytest.raises(NotADirectoryError):
        TensorBoardSink(log_dir=str(tmp_path / "taken" / "tb"))


def test_a_tensorboard_sink_failing_in_the_writer_process_is_reported_once(tmp_path):
    event_dir = tmp_path / "tb"
    debug_api.initialize(STATS, log_dir=str(tmp_path / "run"))
    sink = debug_api.add_statistics_sink(TensorBoardSink(log_dir=str(event_dir)))
    event_dir.rmdir()
    event_dir.write_text("the event directory replaced by a file after set-up")
    for start in range(3):
        run_steps("fc1", 1, start=start)
        sink.log_user_scalar("train/loss", 1.0, start)  # queued for the writer process: nothing raises here
    debug_api.end_debug()  # no exception from step() or end_debug()
    assert [r["iteration"] for r in jsonl_records(tmp_path / "run")] == [0, 1, 2]  # the other sinks went on
    warnings_ = [line for line in main_log(tmp_path / "run").splitlines() if " - WARNING - " in line]
    assert len(warnings_) == 1
    assert f"statistics sink TensorBoardSink({str(event_dir)!r}) failed while writing iteration(s) 0: " in warnings_[0]


@pytest.mark.parametrize("background", [True, False])
def test_training_goes_on_when_every_statistics_file_fails(tmp_path, monkeypatch, background):
    def disk_full(self, text):
        raise OSError(errno.ENOSPC, "No space left on device", self.path)

    monkeypatch.setattr(RecordFile, "write", disk_full)
    debug_api.initialize(STATS, log_dir=str(tmp_path), default_logging_enabled=True, background_logging=background)
    run_steps("fc1", 5)
    assert debug_api.get_iteration() == 5
    debug_api.end_debug()
    reports = [line for line in main_log(tmp_path).splitlines() if " - WARNING - " in line]
    assert sorted(("TextStatsSink" in line, "JsonlSink" in line, "ENOSPC" in line) for line in reports) == [
        (False, True, True),
        (True, False, True),
    ]  # one report per sink, whichever failed first


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_on_sink_error_raise_keeps_the_old_behaviour(tmp_path):
    debug_api.add_statistics_sink(JsonlSink("/dev/full"))
    debug_api.initialize(STATS, log_dir=str(tmp_path), on_sink_error="raise")
    with pytest.raises(BackgroundSinkError, match=r"JsonlSink\('/dev/full'\).*No space left on device"):
        run_steps("fc1", 3)
    with pytest.raises(BackgroundSinkError, match=r"JsonlSink\('/dev/full'\)"):  # the batch handed over meanwhile
        debug_api.end_debug()
    assert not debug_api.is_enabled()


def test_a_raising_caller_thread_sink_is_stopped_and_reported_with_its_errno(tmp_path):
    class FullDisk:
        calls = 0

        def log_scalar(self, name, value, iteration):
            FullDisk.calls += 1
            raise OSError(errno.ENOSPC, "No space left on device", "/mnt/full/stats.csv")

    debug_api.initialize(STATS, log_dir=str(tmp_path), statistics_logger=FullDisk())
    run_steps("fc1", 3)
    debug_api.end_debug()
    assert FullDisk.calls == 1
    assert [r["iteration"] for r in jsonl_records(tmp_path)] == [0, 1, 2]
    assert (
        main_log(tmp_path).count(
            "statistics sink FullDisk failed while writing iteration(s) 0: OSError: "
            "[Errno 28] No space left on device: '/mnt/full/stats.csv' (errno 28, "
            "ENOSPC)"
        )
        == 1
    )


def test_a_write_that_fails_part_way_leaves_only_whole_records(tmp_path, monkeypatch):
    import tedebug.sinks.record_file as record_file

    path = tmp_path / "r.jsonl"
    records = RecordFile(str(path))
    records.write('{"a": 1}\n')
    real_write = os.write
    calls = []

    def half_then_enospc(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_file.os, "write", half_then_enospc)
    with pytest.raises(OSError):
        records.write('{"b": 2}\n{"c": 3}\n')
    monkeypatch.setattr(record_file.os, "write", real_write)
    assert calls == [18, 9] and path.read_bytes() == b'{"a": 1}\n'
    records.write('{"d": 4}\n')
    records.close()
    assert path.read_bytes() == b'{"a": 1}\n{"d": 4}\n'


# ------------------------------------------------------------------------------------------------ log directories
def test_an_unwritable_log_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="tedebug cannot write to log_dir .*a_file/logs"):
        debug_api.initialize(STATS, log_dir=str(blocker / "logs"))
    assert not debug_api.is_enabled()
    if os.geteuid() != 0:  # permissions do not stop root
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o500)
        with pytest.raises(OSError, match="tedebug cannot write to log_dir"):
            debug_api.initialize(STATS, log_dir=str(read_only))


def test_a_second_live_run_on_a_log_dir_is_refused_and_a_killed_runs_lock_taken_over(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, str(CHILD), "hold", str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = main_log(tmp_path)
        with pytest.raises(
            LogDirInUseError, match=f"in use by another live tedebug session of rank 0 \\(pid {holder.pid} on host "
        ):
            debug_api.initialize(STATS, log_dir=str(tmp_path))
        assert main_log(tmp_path) == before  # nothing of the live run was truncated
        holder.kill()
        holder.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    debug_api.initialize(STATS, log_dir=str(tmp_path))  # the killed run's lock is stale: taken over
    run_steps("fc1", 1)
    debug_api.end_debug()
    debug_api.initialize(STATS, log_dir=str(tmp_path))  # and released by end_debug()


# ------------------------------------------------------------------------------------------------ hostile names
def test_control_characters_in_names_cannot_forge_log_lines(tmp_path):
    debug_api.initialize(STATS, log_dir=str(tmp_path), default_logging_enabled=True)
    run_steps("x.fc1\niteration=999999 forged\x00", 1)
    debug_api.end_debug()
    text = (tmp_path / "nvdlfw_inspect_statistics_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert text.count("\n") == 1
    assert "x.fc1\\niteration=999999 forged\\x00_activation_max \t\t\t\t iteration=000000" in text
    assert "LAYER=x.fc1\\niteration=999999 forged\\x00: " in main_log(tmp_path)
    assert jsonl_records(tmp_path)[0]["layer"] == "x.fc1\niteration=999999 forged\x00"  # JSON escapes itself


def test_loggers_of_ended_sessions_are_freed(tmp_path):
    def session_loggers():
        return [name for name in logging.Logger.manager.loggerDict if name.startswith("tedebug.session.")]

    before = session_loggers()
    for _ in range(5):
        debug_api.initialize(STATS, log_dir=str(tmp_path))
        debug_api.end_debug()
    assert session_loggers() == before


def test_a_block_size_that_does_not_fit_is_skipped_with_one_warning(tmp_path):
    config = {
        "s": {
            "enabled": True,
            "layers": {"layer_types": ["fc1"]},
            "transformer_engine": {
                "LogTensorStats": {
                    "enabled": True,
                    "tensors": ["activation"],
                    "stats": ["max", {"max_blockwise_dynamic_range": {"block_size": 3, "dims": 2}}],
                }
            },
        }
    }
    debug_api.initialize(config, log_dir=str(tmp_path))
    run_steps("a.fc1", 3)
    debug_api.end_debug()
    assert [(r["iteration"], r["stat"], r["value"]) for r in jsonl_records(tmp_path)] == [
        (0, "max", 0.0),
        (1, "max", 1.0),
        (2, "max", 2.0),
    ]
    assert (
        main_log(tmp_path).count(
            "WARNING - LAYER=a.fc1: Feature=LogTensorStats: skipping "
            "max_blockwise_dynamic_range_block_size_3_dims_2_max_over_orientations for tensor "
            "activation of shape [4, 4]: dims=2 needs both dims of the 2-D view 4x4 "
            "divisible by block_size 3"
        )
        == 1
    )


@pytest.mark.parametrize(
    "recipe_name",
    ["DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling"],
)
def test_linear_with_zero_in_features_under_autocast(recipe_name):
    import tedebug
    from tedebug import recipe
    from tedebug.nn import Linear

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "Initializing zero-element tensors is a no-op"
        layer = Linear(0, 8)
    x = torch.randn(32, 0, requires_grad=True)
    with tedebug.autocast(recipe=getattr(recipe, recipe_name)()):
        y = layer(x)
    assert torch.equal(y, layer.bias.detach().expand(32, 8))  # x·Wᵀ with K = 0 is 0
    y.sum().backward()
    assert x.grad.shape == (32, 0) and torch.equal(layer.bias.grad, torch.full((8,), 32.0))
