"""debug_api lifecycle, log_message, sinks, features listing, layer naming and the custom-feature example."""

import json
import logging
import os
import re

import pytest
import torch

import tedebug.debug_api as debug_api
from tedebug import active
from tedebug.config import ConfigError
from tedebug.logging import StderrHandler
from tedebug.registry import FeatureLoadError
from tedebug.sinks import MetricLogger, Sink

HERE = os.path.dirname(__file__)
FEATURE_DIRS = os.path.join(HERE, "feature_dirs")
ROUTING = os.path.join(FEATURE_DIRS, "routing")
DUMMY = os.path.join(FEATURE_DIRS, "dummy")
BROKEN = os.path.join(FEATURE_DIRS, "broken")
EXAMPLE = os.path.join(HERE, "..", "examples", "custom_feature")
ASCTIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
TABS = " \t\t\t\t "
DUMMY_CONFIG = {
    "all": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "transformer_engine": {"TestDummyFeature": {"enabled": True, "tensors": ["activation"]}},
    }
}


@pytest.fixture(autouse=True)
def ended(monkeypatch):
    for var in (
        "NVDLFW_INSPECT_LOG_LEVEL",
        "NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE",
        "NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP",
    ):
        monkeypatch.delenv(var, raising=False)
    debug_api.end_debug()
    debug_api._queued_sinks.clear()
    debug_api._queued_settings.clear()
    yield
    debug_api.end_debug()
    debug_api._queued_sinks.clear()
    debug_api._queued_settings.clear()


def init(tmp_path, config=DUMMY_CONFIG, **kwargs):
    kwargs.setdefault("feature_dirs", [DUMMY])
    debug_api.initialize(config, log_dir=str(tmp_path), **kwargs)


def main_log(tmp_path):
    with open(os.path.join(tmp_path, "nvdlfw_inspect_logs", "nvdlfw_inspect_globalrank-0.log"), encoding="utf-8") as f:
        return f.read().splitlines()


def stats_log(tmp_path):
    path = os.path.join(tmp_path, "nvdlfw_inspect_statistics_logs", "nvdlfw_inspect_globalrank-0.log")
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def session_loggers_with_handlers():
    """tedebug loggers that still hold one of tedebug's own handlers (file or stderr)."""
    return [
        name
        for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith(("tedebug.session.", "tedebug.stats."))
        and isinstance(logger, logging.Logger)
        and any(isinstance(h, (logging.FileHandler, StderrHandler)) for h in logger.handlers)
    ]


# ------------------------------------------------------------------------------------------------ lifecycle
def test_before_initialize():
    assert debug_api.DEBUG_MANAGER is None and not debug_api.is_enabled()
    debug_api.step()
    debug_api.end_debug()
    debug_api.initialize_training_step(5)
    for call in (
        lambda: debug_api.log_message("x"),
        debug_api.get_tensor_reduction_group,
        debug_api.session,
        debug_api.get_iteration,
        lambda: debug_api.set_tensor_reduction_group(None),
        lambda: debug_api.transformer_engine,
        lambda: debug_api.log_tensor_stats,
    ):
        with pytest.raises(RuntimeError, match="not initialized"):
            call()
    assert not hasattr(debug_api, "no_such_name")


def test_double_initialize_and_iteration(tmp_path):
    init(tmp_path, init_training_step=65)
    with pytest.raises(RuntimeError, match="already initialized"):
        init(tmp_path)
    assert debug_api.get_iteration() == 65 and debug_api.DEBUG_MANAGER._trainer_iteration_count == 65
    debug_api.step()
    assert debug_api.get_iteration() == 66
    debug_api.initialize_training_step(99)
    assert debug_api.session().iteration == 99
    assert not hasattr(debug_api, "no_such_name")
    debug_api.end_debug()
    assert debug_api.DEBUG_MANAGER is None


def test_unknown_initialize_kwarg(tmp_path):
    with pytest.raises(TypeError, match="logger"):
        debug_api.initialize("", log_dir=str(tmp_path), logger=object())
    assert debug_api.DEBUG_MANAGER is None


@pytest.mark.parametrize("failure", ["feature_dir", "missing_dir", "config", "sink", "step"])
def test_failed_initialize_leaves_nothing_and_retry_works(tmp_path, failure):
    bad = {
        "feature_dir": dict(feature_dirs=[DUMMY, BROKEN]),
        "missing_dir": dict(feature_dirs=[str(tmp_path / "missing")]),
        "config": dict(config={"s": {"enabled": True, "layers": {"layer_type": ["fc1"]}}}),
        "sink": dict(statistics_logger=object()),
        "step": dict(init_training_step="3"),
    }[failure]
    expected = {
        "feature_dir": FeatureLoadError,
        "missing_dir": FeatureLoadError,
        "config": ConfigError,
        "sink": TypeError,
        "step": TypeError,
    }[failure]
    with pytest.raises(expected):
        init(tmp_path, **bad)
    assert debug_api.DEBUG_MANAGER is None
    assert session_loggers_with_handlers() == []
    init(tmp_path)
    assert debug_api.transformer_engine.inspect_tensor_enabled("fc1", tensor_name="activation", iteration=0) is True


def test_reinitialize_does_not_duplicate_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "0")  # append, so both sessions' lines stay
    for _ in range(2):
        init(tmp_path)
        debug_api.log_message("hello once", "fc1")
        debug_api.log_message("hello once", "fc1")
        debug_api.end_debug()
    assert session_loggers_with_handlers() == []
    assert sum(line.endswith(" - INFO - LAYER=fc1: hello once") for line in main_log(tmp_path)) == 2


def test_end_debug_resets_routing_state(tmp_path):
    init(tmp_path)
    debug_api.transformer_engine.inspect_tensor_enabled("fc1", tensor_name="activation", iteration=0)
    first = debug_api.session()
    debug_api.end_debug()
    assert first.closed and first.transformer_engine.cache_size == 0
    init(tmp_path)
    assert debug_api.session() is not first
    counter = debug_api.session().registry.instance("transformer_engine", "TestDummyFeature")
    assert counter.enabled_calls == 0  # a fresh feature instance per session


def test_init_messages(tmp_path):
    init(tmp_path)
    messages = [line.split(" - ", 2)[2] for line in main_log(tmp_path)]
    assert messages == [
        "Reading config from Python dictionary.",
        "Loaded configs for ['all'].",
        f"Default logging to file enabled at {tmp_path}",
    ]


# ------------------------------------------------------------------------------------------------ log_message
def test_log_message_once_per_key(tmp_path, capsys):
    init(tmp_path)
    for _ in range(3):
        debug_api.log_message("plan: Quantize", "model.fc1")
    debug_api.log_message("plan: Quantize", "model.fc2")
    debug_api.log_message("no layer")
    for it in range(2):
        debug_api.log_message("with extra", "model.fc1", extra_cachable_args=(it,))
        debug_api.log_message("with extra", "model.fc1", extra_cachable_args=(it,))
    debug_api.log_message("beware", level=logging.WARNING)
    debug_api.log_message("debug only", level=logging.DEBUG)
    lines = main_log(tmp_path)[3:]
    assert re.fullmatch(ASCTIME + r" - INFO - LAYER=model\.fc1: plan: Quantize", lines[0])
    assert [line.split(" - ", 2)[2] for line in lines] == [
        "LAYER=model.fc1: plan: Quantize",
        "LAYER=model.fc2: plan: Quantize",
        "no layer",
        "LAYER=model.fc1: with extra",
        "LAYER=model.fc1: with extra",
        "beware",
    ]
    assert re.fullmatch("NVDLFW INSPECT - " + ASCTIME + " - WARNING - beware", capsys.readouterr().err.strip())


# ------------------------------------------------------------------------------------------------ sinks
class Recorder(Sink):
    def __init__(self):
        self.calls, self.closed = [], False

    def log_scalar(self, name, value, iteration, *, layer=None, tensor=None, stat=None):
        self.calls.append((name, float(value), iteration, layer, tensor, stat))

    def close(self):
        self.closed = True


class PlainLogger:
    def __init__(self):
        self.calls = []

    def log_scalar(self, name, value, iteration):
        self.calls.append((name, float(value), iteration))


class FakeWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def add_custom_scalars(self, layout):
        pass

    def flush(self):
        pass


def test_sinks_before_and_after_initialize(tmp_path):
    early, late, plain = Recorder(), Recorder(), PlainLogger()
    debug_api.add_statistics_sink(early)
    init(tmp_path)
    debug_api.add_statistics_sink(late)
    MetricLogger.add_logger(plain)  # nvdlfw class-level spelling
    debug_api.session().metric_logger.log_scalar(
        "fc1_activation_max", 2.5, 0, layer="fc1", tensor="activation", stat="max"
    )
    MetricLogger.log_scalar("fc1_activation_min", -1.0, 0)  # nvdlfw class-level spelling (custom features)
    assert (
        early.calls
        == late.calls
        == [
            ("fc1_activation_max", 2.5, 0, "fc1", "activation", "max"),
            ("fc1_activation_min", -1.0, 0, None, None, None),
        ]
    )
    assert plain.calls == [("fc1_activation_max", 2.5, 0), ("fc1_activation_min", -1.0, 0)]
    debug_api.end_debug()
    assert early.closed and late.closed and debug_api._queued_sinks == []


def test_class_level_add_logger_before_initialize_queues_for_the_next_session(tmp_path):
    queued = PlainLogger()
    MetricLogger.add_logger(queued)  # no session: waits in tedebug.active's queue, as debug_api.add_statistics_sink
    assert active.QUEUED_SINKS == [queued] and debug_api._queued_sinks is active.QUEUED_SINKS
    with pytest.raises(TypeError, match="log_scalar"):
        MetricLogger.add_logger(object())
    init(tmp_path)
    assert active.QUEUED_SINKS == [] and queued in debug_api.session().metric_logger.sinks
    MetricLogger.log_scalar("fc1_activation_min", -1.0, 3)
    assert queued.calls == [("fc1_activation_min", -1.0, 3)]


def test_debug_api_re_exports_the_active_session():
    """`debug_api.DEBUG_MANAGER` is `tedebug.active.DEBUG_MANAGER` (read and write); the session functions are
    tedebug.active's, with the same errors before initialize."""
    assert debug_api.DEBUG_MANAGER is None and active.DEBUG_MANAGER is None
    for name in ("session", "is_enabled", "get_iteration", "log_message"):
        assert getattr(debug_api, name) is getattr(active, name)
    marker = object()
    debug_api.DEBUG_MANAGER = marker
    try:
        assert active.DEBUG_MANAGER is marker and debug_api.session() is marker and debug_api.is_enabled()
    finally:
        debug_api.DEBUG_MANAGER = None
    assert active.DEBUG_MANAGER is None and "DEBUG_MANAGER" not in vars(debug_api)


def test_initialize_and_end_debug_set_the_active_session(tmp_path):
    init(tmp_path)
    current = active.DEBUG_MANAGER
    assert current is not None and debug_api.DEBUG_MANAGER is current and active.session() is current
    debug_api.initialize_training_step(7)
    assert active.get_iteration() == 7
    debug_api.end_debug()
    assert active.DEBUG_MANAGER is None and current.closed
    with pytest.raises(RuntimeError, match="not initialized"):
        active.session()


@pytest.mark.parametrize("background, steps", [(False, 1), (True, 2), ("process", 3)])
def test_stats_file_jsonl_and_flush_at_step(tmp_path, background, steps):
    """Synchronous logging: a step's statistics are on disk when step() returns.  The writer thread: when the next
    step() returns.  The writer process (the default): it has them when the next step() returns, and has written
    them when the one after returns."""
    init(tmp_path, background_logging=background)
    debug_api.session().metric_logger.log_scalar(
        "fc1_activation_underflows%", 0.15625, 7, layer="fc1", tensor="activation", stat="underflows%"
    )
    for _ in range(steps):
        debug_api.step()
    lines = stats_log(tmp_path)  # read before end_debug
    assert len(lines) == 1 and re.fullmatch(
        ASCTIME + re.escape(" - INFO - fc1_activation_underflows%" + TABS + "iteration=000007" + TABS + "value=0.1562"),
        lines[0],
    )
    with open(os.path.join(tmp_path, "tedebug_statistics", "metrics_globalrank-0.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert records == [
        {
            "iteration": 7,
            "name": "fc1_activation_underflows%",
            "layer": "fc1",
            "tensor": "activation",
            "stat": "underflows%",
            "value": 0.15625,
        }
    ]


def test_sink_selection(tmp_path):
    stats_dir = os.path.join(tmp_path, "nvdlfw_inspect_statistics_logs")
    custom, writer = Recorder(), FakeWriter()
    init(tmp_path, statistics_logger=custom, tb_writer=writer)
    debug_api.session().metric_logger.log_scalar("x_activation_max", 1.0, 3)
    assert custom.calls == [("x_activation_max", 1.0, 3, None, None, None)]
    assert writer.scalars == [("x_activation_max", 1.0, 3)]
    assert not os.path.exists(stats_dir)  # a sink was given: no default stats file
    assert os.path.exists(os.path.join(tmp_path, "tedebug_statistics", "metrics_globalrank-0.jsonl"))
    debug_api.end_debug()
    init(tmp_path, tb_writer=FakeWriter(), default_logging_enabled=True)
    assert os.path.isdir(stats_dir)


def test_reduction_group_and_weight_tp_setting(tmp_path):
    debug_api.set_weight_tensor_tp_group_reduce(False)  # before initialize: kept for the next session
    init(tmp_path)
    assert debug_api.session().weight_tensor_tp_group_reduce is False
    assert debug_api.get_tensor_reduction_group() is None
    debug_api.set_tensor_reduction_group("group")
    assert debug_api.get_tensor_reduction_group() == "group"
    debug_api.set_weight_tensor_tp_group_reduce(True)
    assert debug_api.session().weight_tensor_tp_group_reduce is True
    with pytest.raises(TypeError):
        debug_api.set_weight_tensor_tp_group_reduce(1)


def test_atexit_flush_registered_once(tmp_path):
    init(tmp_path)
    debug_api.end_debug()
    init(tmp_path)
    assert debug_api._atexit_registered is True
    debug_api._flush_at_exit()
    debug_api.end_debug()
    debug_api._flush_at_exit()  # no session: nothing to do


# ------------------------------------------------------------------------------------------------ features
def test_list_and_explain_features(tmp_path, capsys):
    builtin = debug_api.list_features()  # works before initialize (built-in features)
    assert capsys.readouterr().out.strip() == str(builtin)
    init(tmp_path, feature_dirs=[ROUTING, DUMMY])
    names = debug_api.list_features()
    assert set(names) - set(builtin) == {
        f"transformer_engine.{n}"
        for n in (
            "GemmSwitch",
            "LayerSwitch",
            "ScaleModify",
            "OffsetModify",
            "WrongOutput",
            "TupleInspect",
            "BoolInspect",
            "LegacyInspect",
            "PostquantizeInspect",
            "NestedFeature",
            "TestDummyFeature",
        )
    }
    assert names == sorted(names)
    capsys.readouterr()
    text = debug_api.explain_features("GemmSwitch")
    assert text == (
        "-----\nfeature: transformer_engine.GemmSwitch\n"
        "Turns the quantized GEMM off for the listed gemms (like DisableQuantizationGEMM).\n*****"
    )
    assert capsys.readouterr().out == text + "\n"
    both = debug_api.explain_features(["transformer_engine.LayerSwitch", "Nope"])
    assert both.startswith("-----\nfeature: transformer_engine.LayerSwitch\n")
    assert "Feature 'Nope' is not supported." in both
    assert debug_api.explain_features("all").count("-----\nfeature: ") == len(names)
    assert "list_features()" in debug_api.explain_features()


# ------------------------------------------------------------------------------------------------ layer names
class Block(torch.nn.Module):
    def __init__(self, layer_number=None):
        super().__init__()
        if layer_number is not None:
            self.layer_number = layer_number
        self.fc1 = torch.nn.Linear(2, 2)


class Net(torch.nn.Module):
    def __init__(self, numbers):
        super().__init__()
        self.embed = torch.nn.Embedding(3, 2)
        self.layers = torch.nn.ModuleList([Block(n) for n in numbers])
        self.head = torch.nn.Sequential(torch.nn.Linear(2, 2))


def test_infer_and_assign_layer_names():
    net = Net([None, None])
    net.layers[0].name = "preset"  # overwritten
    names = debug_api.infer_and_assign_layer_names(net)
    assert names == [
        "model",
        "model.embed",
        "model.0",
        "model.0.fc1",
        "model.1",
        "model.1.fc1",
        "model.head",
        "model.head.0",
    ]
    assert net.layers[0].name == "model.0" and net.layers[1].fc1.name == "model.1.fc1"
    assert not hasattr(net.layers, "name")  # a ModuleList gets no name


def test_layer_number_and_lists_of_models(tmp_path):
    chunks = [Net([1, 2]), Net([3, 4])]
    names = debug_api.infer_and_assign_layer_names(chunks)
    assert chunks[0].layers[1].fc1.name == "model0.2.fc1" and chunks[1].layers[0].fc1.name == "model1.3.fc1"
    assert len(names) == len(set(names))

    class Wrapper:  # DDP-like object exposing .module
        def __init__(self, module):
            self.module = module

    single = Net([7])
    init(tmp_path)
    debug_api.infer_and_assign_layer_names([Wrapper(single)])
    assert single.layers[0].fc1.name == "model.7.fc1"
    assert any(line.endswith(" - INFO - Assigned layer name: model.7.fc1") for line in main_log(tmp_path))
    with pytest.raises(TypeError, match=r"model\[1\] is a str"):
        debug_api.infer_and_assign_layer_names([single, "not a module"])


# ------------------------------------------------------------------------------------------------ end to end
def test_dummy_feature_counts_calls(tmp_path):
    init(tmp_path)
    te = debug_api.transformer_engine
    for it in range(20):
        assert te.inspect_tensor_enabled("any.layer", tensor_name="activation", iteration=it) is True
        assert te.inspect_tensor_enabled("any.layer", tensor_name="weight", iteration=it) == (False, None)
        debug_api.step()
    assert debug_api.session().registry.instance("transformer_engine", "TestDummyFeature").enabled_calls == 20


def readme_feature_dir(tmp_path):
    """The feature of the example README's code block (written on the shared bases), as a feature directory."""
    with open(os.path.join(EXAMPLE, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = text.split("```python\nfrom tedebug import active\n", 1)[1].split("```", 1)[0]
    directory = tmp_path / "readme_feature"
    directory.mkdir()
    (directory / "feature.py").write_text(
        "import torch\n\nfrom tedebug import active\n" + block + '\nSTAT = "percentage_greater_than_threshold"\n',
        encoding="utf-8",
    )
    return str(directory)


@pytest.mark.parametrize("source", ["example file", "README on the shared bases"])
def test_custom_feature_example_logs_its_statistic(tmp_path, source):
    feature_dirs = EXAMPLE if source == "example file" else readme_feature_dir(tmp_path)
    debug_api.initialize(os.path.join(EXAMPLE, "config.yaml"), feature_dirs=feature_dirs, log_dir=str(tmp_path))
    te = debug_api.transformer_engine
    x = torch.tensor([[0.1, 0.9, -2.0, 0.8], [1.5, 0.79, 0.81, 3.0]])  # 4 of 8 elements > 0.8
    w = torch.tensor([0.85, 0.2, 0.3])  # 1 of 3
    for it in range(3):
        if te.inspect_tensor_enabled("model.0.fc1", tensor_name="activation", iteration=it)[0]:
            te.inspect_tensor("model.0.fc1", tensor=x, tensor_name="activation", iteration=it, tp_group=None)
            te.inspect_tensor("model.0.fc1", tensor=w, tensor_name="weight", iteration=it, tp_group=None)
        te.inspect_tensor("model.0.fc2", tensor=x, tensor_name="activation", iteration=it, tp_group=None)
        debug_api.step()
    debug_api.session().flush()  # the background writer may still hold the last step
    messages = [line.split(" - INFO - ", 1)[1] for line in stats_log(tmp_path)]
    name = "model.0.fc1_{}_percentage_greater_than_threshold"
    assert messages == [
        name.format("activation") + TABS + "iteration=000000" + TABS + "value=50.0000",
        name.format("weight") + TABS + "iteration=000000" + TABS + "value=33.3333",
        name.format("activation") + TABS + "iteration=000002" + TABS + "value=50.0000",
        name.format("weight") + TABS + "iteration=000002" + TABS + "value=33.3333",
    ]


def test_custom_feature_example_validates_threshold(tmp_path):
    config = {
        "s": {
            "enabled": True,
            "layers": {"layer_types": ["fc1"]},
            "transformer_engine": {
                "PercentageGreaterThanThreshold": {"enabled": True, "tensors": ["activation"], "threshold": "high"}
            },
        }
    }
    with pytest.raises(ConfigError, match="threshold must be a number, got 'high'"):
        debug_api.initialize(config, feature_dirs=EXAMPLE, log_dir=str(tmp_path))
    assert debug_api.DEBUG_MANAGER is None


def test_readme_feature_on_the_shared_bases_checks_its_config_at_load(tmp_path):
    feature_dirs = readme_feature_dir(tmp_path)
    block = {"enabled": True, "tensors": ["activation"], "threshold": 0.5}
    for bad, match in (
        ({"treshold": 0.5}, "unknown key 'treshold'; did you mean 'threshold'"),
        ({"threshold": "high"}, "threshold must be a number, got 'high'"),
        ({"freq": 0}, "freq"),
    ):
        config = {
            "s": {
                "enabled": True,
                "layers": {"layer_types": ["fc1"]},
                "transformer_engine": {"PercentageGreaterThanThreshold": {**block, **bad}},
            }
        }
        with pytest.raises(ConfigError, match=match):
            debug_api.initialize(config, feature_dirs=feature_dirs, log_dir=str(tmp_path))
        assert debug_api.DEBUG_MANAGER is None


@pytest.mark.parametrize("background_logging, on_disk_at", [(True, 1), ("process", 2)])
def test_step_emits_stats_of_the_finished_iteration(tmp_path, background_logging, on_disk_at):
    config = {
        "s": {
            "enabled": True,
            "layers": {"layer_types": ["fc1"]},
            "transformer_engine": {
                "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max", "min"], "freq": 2}
            },
        }
    }
    debug_api.initialize(config, log_dir=str(tmp_path), background_logging=background_logging)
    te = debug_api.transformer_engine
    x = torch.tensor([1.0, 2.5, -3.0])
    for it in range(3):
        if te.inspect_tensor_enabled("fc1", tensor_name="activation", iteration=it)[0]:
            te.inspect_tensor(
                "fc1",
                tensor=x,
                tensor_name="activation",
                iteration=it,
                tp_group=None,
                tp_size=1,
                rowwise_quantized_tensor=None,
                columnwise_quantized_tensor=None,
                quantizer=None,
            )
        debug_api.step()
        # emitted by the step after the one that finished iteration 0: on disk when that step returns (the writer
        # thread), or when the step after it returns (the writer process has written the batch it was handed)
        if it == on_disk_at:
            assert len(stats_log(tmp_path)) == 2
    debug_api.session().flush()
    messages = [line.split(" - INFO - ", 1)[1] for line in stats_log(tmp_path)]
    assert messages == [
        f"fc1_activation_{stat}{TABS}iteration={it:06d}{TABS}value={value}"
        for it in (0, 2)
        for stat, value in (("max", "2.5000"), ("min", "-3.0000"))
    ]


def test_tb_writer_gets_transformer_engine_flat_tags(tmp_path):
    """A writer passed as initialize(tb_writer=...) receives TE's flat tags, so existing dashboards keep working;
    the hierarchical tags and custom-scalars layout come with a TensorBoardSink added explicitly."""
    from tedebug.sinks.tensorboard import TensorBoardSink

    flat_writer, tree_writer = FakeWriter(), FakeWriter()
    init(tmp_path, tb_writer=flat_writer)
    debug_api.add_statistics_sink(TensorBoardSink(writer=tree_writer))
    debug_api.session().metric_logger.log_scalar(
        "fc1_activation_max", 2.0, 5, layer="fc1", tensor="activation", stat="max"
    )
    assert flat_writer.scalars == [("fc1_activation_max", 2.0, 5)]
    assert tree_writer.scalars == [("fc1/activation/max", 2.0, 5)]
