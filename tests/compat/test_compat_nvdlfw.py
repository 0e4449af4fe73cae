"""nvdlfw-inspect compatibility: scripts with one import changed, nvdlfw-style feature files and custom namespaces
loaded unchanged, nvdlfw's generic section-level LogTensorStats, and the import aliases."""

import os
import sys
import types
import warnings

import pytest
import torch

import tedebug
import tedebug.compat.nvdlfw_inspect.api as nv_api
from tedebug import debug_api
from tedebug.compat.aliases import compat_imports
from tedebug.compat.nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI, outputs_equal
from tedebug.compat.nvdlfw_inspect.config_manager import ConfigManager
from tedebug.compat.nvdlfw_inspect.debug_features.log_tensor_stats import LogTensorStats as GenericLogTensorStats
from tedebug.compat.nvdlfw_inspect.logging import BaseLogger, get_logger, wrap_tensorboard_writer
from tedebug.compat.nvdlfw_inspect.utils import append_parent_docstring, gather_along_first_dim
from tedebug.config import ConfigError
from tedebug.recipe import Float8CurrentScaling
from tedebug.registry import FeatureLoadError, build_registry

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACE_DIR = os.path.join(TESTS, "feature_dirs", "nvdlfw_namespace")
TE_STYLE_DIR = os.path.join(TESTS, "feature_dirs", "te_style")
TABS = " \t\t\t\t "


@pytest.fixture(autouse=True)
def ended():
    debug_api.end_debug()
    yield
    debug_api.end_debug()


class ListLogger(BaseLogger):
    def __init__(self):
        self.records = []

    def log_scalar(self, name, value, iteration, **kwargs):
        self.records.append((name, float(value), iteration))


def quant_section(features, layer_types=("fc1",)):
    return {"quant": {"enabled": True, "layers": {"layer_types": list(layer_types)}, "quant_ns": features}}


FAKE_QUANT = {
    "enabled": True,
    "gemms": ["fprop"],
    "tensors": ["activation"],
    "scale": 0.5,
    "zero_point": 0,
    "quant_min": -8,
    "quant_max": 7,
}


# ------------------------------------------------------------------------------------------------ custom namespace
def test_custom_namespace_routes_like_nvdlfw(tmp_path):
    debug_api.initialize(
        quant_section({"PerTensorFakeQuant": FAKE_QUANT}), feature_dirs=NAMESPACE_DIR, log_dir=str(tmp_path)
    )
    ns = debug_api.quant_ns
    calls = sys.modules[type(ns.api).__module__].CALLS
    x = torch.tensor([0.26, -1.3, 9.0, -9.0, 0.74])
    expected = torch.fake_quantize_per_tensor_affine(x, 0.5, 0, -8, 7)
    assert torch.equal(expected, torch.tensor([0.5, -1.5, 3.5, -4.0, 0.5]))
    for _ in range(3):
        out = ns.process_tensor("model.fc1", tensor=x, gemm="fprop", tensor_name="activation")
        assert torch.equal(out["tensor"], expected)
    assert calls["routing_condition"] == 1  # cached per (layer, api, tensor_name, gemm)
    # not listed (gemm / tensor) or not selected (layer): the namespace's default implementation keeps the tensor
    for layer, gemm, tensor_name in (
        ("model.fc1", "wgrad", "activation"),
        ("model.fc1", "fprop", "weight"),
        ("model.fc2", "fprop", "activation"),
    ):
        assert ns.process_tensor(layer, tensor=x, gemm=gemm, tensor_name=tensor_name)["tensor"] is x
    # an API neither a feature nor the default implementation serves returns {} (attribute fallback routing)
    assert ns.some_other_api("model.fc1", tensor=x, gemm="fprop", tensor_name="activation") == {}
    with pytest.raises(AssertionError, match="process_tensor needs gemm"):
        ns.process_tensor("model.fc1", tensor=x, tensor_name="activation")
    debug_api.step()
    debug_api.step()
    assert calls["step"] == 2 and debug_api.DEBUG_MANAGER._trainer_iteration_count == 2
    debug_api.end_debug()
    assert calls["end_debug"] == 1


def test_custom_namespace_single_feature_rule_and_output_check(tmp_path):
    debug_api.initialize(
        quant_section(
            {
                "PerTensorFakeQuant": FAKE_QUANT,
                "Negate": {"enabled": True, "gemms": ["fprop", "dgrad"], "tensors": ["activation", "gradient"]},
            }
        ),
        feature_dirs=NAMESPACE_DIR,
        log_dir=str(tmp_path),
    )
    x = torch.tensor([1.0, -2.0])
    with pytest.raises(
        ValueError,
        match=r"Only 1 operation permitted per API call. Found 2 features "
        r"\['PerTensorFakeQuant', 'Negate'\]",
    ):
        debug_api.quant_ns.process_tensor("fc1", tensor=x, gemm="fprop", tensor_name="activation")
    assert torch.equal(
        debug_api.quant_ns.process_tensor("fc1", tensor=x, gemm="dgrad", tensor_name="gradient")["tensor"], -x
    )
    debug_api.end_debug()
    debug_api.initialize(
        quant_section({"BadOutput": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"]}}),
        feature_dirs=NAMESPACE_DIR,
        log_dir=str(tmp_path),
    )
    with pytest.raises(AssertionError, match="must return a dict with 'tensor'"):
        debug_api.quant_ns.process_tensor("fc1", tensor=x, gemm="fprop", tensor_name="weight")


def test_custom_namespace_config_errors(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"Could not find feature 'NegateX' in namespace 'quant_ns'.*did you mean "
        r"'Negate'",
    ):
        debug_api.initialize(
            quant_section({"NegateX": {"enabled": True}}), feature_dirs=NAMESPACE_DIR, log_dir=str(tmp_path)
        )
    # without the feature dir the namespace is unknown: the key is taken for a base feature, as in nvdlfw
    with pytest.raises(ConfigError, match="Could not find feature 'quant_ns' in namespace 'base'"):
        debug_api.initialize(quant_section({"Negate": {"enabled": True}}), log_dir=str(tmp_path))
    assert debug_api.DEBUG_MANAGER is None


def test_features_without_namespace_api_and_ignored_builtin_apis(tmp_path):
    (tmp_path / "orphan.py").write_text(
        "from nvdlfw_inspect.registry import Registry, api_method\n"
        "@Registry.register_feature(namespace='nowhere')\n"
        "class Lost:\n"
        "    @api_method\n"
        "    def process(self, config, layer_name, **kw):\n"
        "        return {}\n"
    )
    with pytest.raises(
        FeatureLoadError,
        match=r"Found features \['Lost'\] for namespace 'nowhere' but API was not "
        r"found",
    ):
        build_registry(str(tmp_path))
    (tmp_path / "orphan.py").unlink()
    (tmp_path / "te_api.py").write_text(
        "from nvdlfw_inspect.base import BaseNamespaceAPI\n"
        "from nvdlfw_inspect.registry import Registry\n"
        "@Registry.register_namespace_api(namespace='transformer_engine')\n"
        "class TransformerEngineAPI(BaseNamespaceAPI):\n"
        "    pass\n"
    )
    registry = build_registry(str(tmp_path))
    assert registry.ignored_apis == [f"transformer_engine ({tmp_path / 'te_api.py'})"]
    assert registry.custom_namespaces == []


# ------------------------------------------------------------------------------------------------ TE-style scripts
def test_te_script_with_one_import_changed(tmp_path):
    """A script written for TE's debug tools: only ``import nvdlfw_inspect.api as debug_api`` changed (and the
    layers are tedebug's).  TE's feature dir is passed as TE's docs say, plus a TE-style custom feature."""
    te_features = tmp_path / "site-packages" / "transformer_engine" / "debug" / "features"
    te_features.mkdir(parents=True)
    config = tmp_path / "config.yaml"
    config.write_text("""\
fc1_section:
  enabled: True
  layers:
    layer_name_regex_pattern: .*fc1
  LogTensorStats:                 # nvdlfw's generic section-level statistics, logged by the script itself
    enabled: True
    tensors: [activation]
    stats: [max, MEAN]
    freq: 2
    start_step: 2
    end_step: 6
  transformer_engine:
    PercentageAbove:
      enabled: True
      tensors: [activation]
      threshold: 0.5
      freq: 3
""")
    sink = ListLogger()
    with pytest.warns(UserWarning, match=r"ignoring keyword argument\(s\) \['logger'\].*statistics_logger="):
        nv_api.initialize(
            config_file=str(config),
            feature_dirs=[str(te_features), TE_STYLE_DIR],
            log_dir=str(tmp_path / "logs"),
            statistics_logger=sink,
            logger=sink,
            default_logging_enabled=True,
        )
    assert nv_api.DEBUG_MANAGER is debug_api.DEBUG_MANAGER is not None
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc1", tedebug.nn.Linear(4, 4))
    nv_api.infer_and_assign_layer_names(model)
    assert model.fc1.name == "model.fc1"
    x = torch.tensor([[0.25, 1.0, -2.0, 0.75], [1.5, 0.25, 0.25, 2.0]])  # 4 of 8 elements > 0.5; sum 4
    for _ in range(8):
        with tedebug.autocast(recipe=Float8CurrentScaling()):
            model(x).sum().backward()
        nv_api.log_tensor_stats("model.fc1", tensor=x, tensor_name="activation")
        nv_api.step()
    nv_api.end_debug()
    assert nv_api.DEBUG_MANAGER is None
    ours = [r for r in sink.records if r[0].endswith("percentage_above")]
    assert ours == [("model.fc1_activation_percentage_above", 50.0, it) for it in (0, 3, 6)]
    generic = [r for r in sink.records if r[0].startswith("model.fc1_activation_m")]
    # nvdlfw's verified schedule: freq 2, start 2, end 6 logs at 2, 4, 6; max 2.0, mean 4/8 = 0.5
    assert generic == [
        (name, value, it)
        for it in (2, 4, 6)
        for name, value in (("model.fc1_activation_max", 2.0), ("model.fc1_activation_mean", 0.5))
    ]
    stats_file = tmp_path / "logs" / "nvdlfw_inspect_statistics_logs" / "nvdlfw_inspect_globalrank-0.log"
    lines = [line.split(" - INFO - ", 1)[1] for line in stats_file.read_text().splitlines()]
    assert "model.fc1_activation_percentage_above" + TABS + "iteration=000003" + TABS + "value=50.0000" in lines
    assert "model.fc1_activation_mean" + TABS + "iteration=000004" + TABS + "value=0.5000" in lines
    main_log = (tmp_path / "logs" / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert "LAYER=model.fc1: percentage_above of activation logged" in main_log
    assert f"Skipping feature directory {te_features}" in main_log


def test_generic_log_tensor_stats_config_errors(tmp_path):
    def section(**cfg):
        return {"s": {"enabled": True, "layers": {"layer_types": ["fc1"]}, "LogTensorStats": {"enabled": True, **cfg}}}

    with pytest.raises(ConfigError, match=r"LogTensorStats -> stats\[1\].*statistic 'cur_amax' is not supported"):
        debug_api.initialize(section(tensors=["activation"], stats=["min", "cur_amax"]), log_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"LogTensorStats -> tensors_struct\[0\] -> stats\[0\]"):
        debug_api.initialize(
            section(tensors_struct=[{"tensor": "weight", "stats": ["l3_norm"]}]), log_dir=str(tmp_path)
        )
    with pytest.raises(ConfigError, match="unknown key 'threshold'"):
        debug_api.initialize(section(tensors=["activation"], stats=["min"], threshold=1), log_dir=str(tmp_path))
    assert GenericLogTensorStats._get_supported_stats_list(None) == {"min", "max", "mean", "std", "l1_norm", "l2_norm"}


def test_generic_log_tensor_stats_values_and_inactive_calls(tmp_path):
    debug_api.initialize(
        {
            "s": {
                "enabled": True,
                "layers": {"layer_types": ["fc1"]},
                "LogTensorStats": {
                    "enabled": True,
                    "tensors_struct": [{"tensor": "weight", "stats": ["std", "l1_norm"], "freq": 3}],
                },
            }
        },
        log_dir=str(tmp_path),
    )
    w = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.bfloat16)
    stats = debug_api.log_tensor_stats("fc1", tensor=w, tensor_name="weight", iteration=3)
    assert stats["l1_norm"].item() == 12.0 and stats["l1_norm"].dtype == torch.float32
    assert stats["std"].item() == pytest.approx(2.160246899469287, abs=0.01)  # sqrt(14/3), bf16 precision
    assert debug_api.log_tensor_stats("fc1", tensor=w, tensor_name="weight", iteration=4) == {}  # not scheduled
    assert debug_api.log_tensor_stats("fc1", tensor=[1.0], tensor_name="weight", iteration=3) == {}  # not a tensor
    assert debug_api.log_tensor_stats("fc2", tensor=w, tensor_name="weight", iteration=3) == {}  # not selected


# ------------------------------------------------------------------------------------------------ modules
def test_import_aliases_are_scoped_to_feature_files():
    real = types.ModuleType("nvdlfw_inspect")  # stands for an installed nvdlfw-inspect
    sys.modules["nvdlfw_inspect"] = real
    try:
        with compat_imports():
            import nvdlfw_inspect.api as inside  # noqa: F401 - resolved through the aliases
            from transformer_engine.debug.features.api import TEConfigAPIMapper

            assert inside is nv_api and sys.modules["nvdlfw_inspect"] is not real
            assert TEConfigAPIMapper.__module__ == "tedebug.compat.te_features_api"
        assert sys.modules["nvdlfw_inspect"] is real
        assert "nvdlfw_inspect.api" not in sys.modules
        assert "transformer_engine.debug.features.api" not in sys.modules
    finally:
        del sys.modules["nvdlfw_inspect"]


def test_base_classes_and_helpers(tmp_path):
    class Mapper(BaseConfigAPIMapper):
        def parse_config_and_api(self, config, **kwargs):
            return False, None

    cfg = {"enabled": True, "stats": ["a"], "tensors_struct": [{"tensor": "weight", "stats": ["b"], "freq": 2}]}
    assert Mapper()._process_tensor_config(cfg, "weight") == {
        "enabled": True,
        "stats": ["b"],
        "freq": 2,
        "tensor": "weight",
    }
    assert Mapper()._process_tensor_config(cfg, "activation") is None
    with pytest.raises(ValueError, match="tensors"):
        Mapper()._process_tensor_config({"enabled": True}, "weight")
    with pytest.raises(TypeError):
        BaseNamespaceAPI()  # abstract hooks

    class Api(BaseNamespaceAPI):
        input_assertions_hook = routing_condition = output_assertions_hook = lambda *a, **k: None
        is_multiple_feature_invocation_allowed = lambda self, api: True  # noqa: E731

    api = Api()
    t = torch.ones(2)
    assert api.handle_multi_feature_output("x", [{"t": t}, {"t": torch.ones(2)}], ["A", "B"]) == {"t": t}
    with pytest.raises(AssertionError, match="Different Outputs"):
        api.handle_multi_feature_output("x", [{"t": t}, {"t": torch.zeros(2)}], ["A", "B"])
    assert outputs_equal((True, 3), (True, 3)) and not outputs_equal((True, 3), [True, 3])
    assert gather_along_first_dim(t)[0] is t

    class Parent:
        """Parent doc."""

    @append_parent_docstring(parent=Parent)
    class Child(Parent):
        """Child doc."""

    assert Child.__doc__ == "Child doc.\nParent doc."

    class Writer:
        def __init__(self):
            self.calls = []

        def add_scalar(self, tag, value, step):
            self.calls.append((tag, value, step))

    writer = Writer()
    wrap_tensorboard_writer(writer).log_scalar("a_b_c", 1.5, 7)
    assert writer.calls == [("a_b_c", 1.5, 7)]
    with pytest.raises(RuntimeError, match="not initialized"):
        get_logger()
    debug_api.initialize(
        {
            "s": {
                "enabled": True,
                "layers": {"layer_types": ["fc1"]},
                "transformer_engine": {"DisableQuantizationLayer": {"enabled": True}},
            }
        },
        log_dir=str(tmp_path),
    )
    assert get_logger().root_log_dir == str(tmp_path)
    assert ConfigManager.get_config_for_layer("x.fc1") == {
        "transformer_engine": {"DisableQuantizationLayer": {"enabled": True}}
    }
    assert ConfigManager.get_config_for_layer("x.fc2") == {}
    ConfigManager.reset()
    assert debug_api.session().config._cache == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "base.LogTensorStats" in nv_api.list_features()


def test_te_style_subclass_of_the_generic_feature(tmp_path, capsys):
    """TE's statistics features subclass nvdlfw's generic LogTensorStats and extend its statistics; such a subclass
    is not held to the generic feature's parameters and lists its own statistics in `tedebug schema --stats`."""
    (tmp_path / "spread.py").write_text(
        "from nvdlfw_inspect.debug_features.log_tensor_stats import LogTensorStats as Generic\n"
        "from nvdlfw_inspect.registry import Registry, api_method\n"
        "@Registry.register_feature(namespace='transformer_engine')\n"
        "class SpreadStats(Generic):\n"
        "    def _get_supported_stats_list(self):\n"
        "        return Generic._get_supported_stats_list(None) | {'spread'}\n"
        "    @api_method\n"
        "    def inspect_tensor(self, config, layer_name, tensor_name, tensor=None, iteration=0, **kw):\n"
        "        return None\n"
    )
    debug_api.initialize(
        {
            "s": {
                "enabled": True,
                "layers": {"layer_types": ["fc1"]},
                "transformer_engine": {
                    "SpreadStats": {"enabled": True, "tensors": ["activation"], "stats": ["spread"], "margin": 2}
                },
            }
        },
        feature_dirs=str(tmp_path),
        log_dir=str(tmp_path / "logs"),
    )
    te = debug_api.transformer_engine
    assert te.inspect_tensor("m.fc1", tensor_name="activation", tensor=torch.ones(2), iteration=0) is None
    debug_api.end_debug()
    from tedebug.cli import main

    assert main(["schema", "--stats", "--feature-dirs", str(tmp_path)]) == 0
    assert (
        "transformer_engine.SpreadStats: l1_norm, l2_norm, max, mean, min, spread, std"
        in capsys.readouterr().out.splitlines()
    )
