"""Feature registration, loading of built-in packages and feature_dirs, and the per-session Registry."""

import os
import sys
import textwrap

import pytest

from tedebug.registry import (
    FeatureLoadError,
    FeatureMapper,
    Registry,
    api_method,
    build_registry,
    is_te_feature_dir,
    normalize_feature_dirs,
    register_feature,
)

FEATURE_DIRS = os.path.join(os.path.dirname(__file__), "feature_dirs")
ROUTING = os.path.join(FEATURE_DIRS, "routing")
BROKEN = os.path.join(FEATURE_DIRS, "broken")


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(textwrap.dedent(text))
    return str(path)


# ------------------------------------------------------------------------------------------------ decorators
def test_decorators_only_tag():
    @register_feature(namespace="base")
    class A(FeatureMapper):
        @api_method
        def log_tensor_stats(self, config, layer_name, **kw):
            return {}

    @register_feature
    class B(FeatureMapper):
        pass

    assert A._tedebug_namespace == "base" and B._tedebug_namespace == "transformer_engine"
    assert A.log_tensor_stats.is_api is True
    assert register_feature(namespace="my_framework")(type("C", (), {}))._tedebug_namespace == "my_framework"
    for bad in ("my-framework", "_private", "class", 3):
        with pytest.raises(ValueError, match="invalid namespace"):
            register_feature(namespace=bad)


def test_registry_is_per_instance():
    first = Registry()
    first.load_dirs(ROUTING)
    assert "GemmSwitch" in first.feature_names()["transformer_engine"]
    assert Registry().feature_names()["transformer_engine"] == set()


# ------------------------------------------------------------------------------------------------ feature dirs
def test_routing_dir_loads_recursively_with_sibling_imports():
    path_before = list(sys.path)
    registry = Registry()
    registry.load_dirs([ROUTING])
    assert sys.path == path_before  # the feature dirs were only on sys.path while their files ran
    names = registry.feature_names()["transformer_engine"]
    assert names == {
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
    }
    assert "_Modify" not in names  # untagged base class: not a feature
    assert registry.get("transformer_engine", "ScaleModify").hooks == ("modify_tensor", "modify_tensor_enabled")
    nested = registry.get("transformer_engine", "NestedFeature")
    assert nested.source.endswith(os.path.join("routing", "nested", "nested_feature.py"))
    assert registry.instance("transformer_engine", "NestedFeature").inspect_tensor_enabled(
        {}, "l", tensor_name="activation", iteration=3
    ) == (True, 10)
    assert registry.hook_providers("transformer_engine", "fp8_gemm_enabled") == ["GemmSwitch", "LayerSwitch"]


def test_instances_are_created_once_per_registry():
    a, b = build_registry(ROUTING), build_registry(ROUTING)
    assert a.instance("transformer_engine", "GemmSwitch") is a.instance("transformer_engine", "GemmSwitch")
    assert a.instance("transformer_engine", "GemmSwitch") is not b.instance("transformer_engine", "GemmSwitch")


def test_import_error_names_the_file():
    with pytest.raises(FeatureLoadError) as info:
        build_registry([ROUTING, BROKEN])
    assert os.path.join("broken", "bad_import.py") in str(info.value)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert "tedebug_module_that_does_not_exist" in str(info.value)


def test_missing_dir_error_names_it(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FeatureLoadError, match="feature directory not found: '" + missing.replace("\\", "\\\\")):
        build_registry(missing)


@pytest.mark.parametrize("value, expected", [(None, []), ("", []), ([], []), ("d", ["d"]), (["a", "b"], ["a", "b"])])
def test_normalize_feature_dirs(value, expected):
    assert normalize_feature_dirs(value) == expected


@pytest.mark.parametrize("value", [5, {"d": 1}, ["ok", 3], ["ok", ""]])
def test_normalize_feature_dirs_rejects(value):
    with pytest.raises(TypeError, match="feature_dirs"):
        normalize_feature_dirs(value)


def test_te_feature_dir_is_skipped(tmp_path):
    te_dir = tmp_path / "transformer_engine" / "debug" / "features"
    write(te_dir / "api.py", "import nvdlfw_inspect.registry\n")
    assert is_te_feature_dir(str(te_dir)) and not is_te_feature_dir(ROUTING)
    registry = Registry()
    registry.load_dirs([str(te_dir), ROUTING])
    assert registry.skipped_dirs == [str(te_dir)]
    assert "GemmSwitch" in registry.feature_names()["transformer_engine"]


def test_nvdlfw_feature_dir_is_skipped(tmp_path):
    nv_dir = tmp_path / "nvdlfw_inspect" / "debug_features"
    write(nv_dir / "log_tensor_stats.py", "raise RuntimeError('nvdlfw internals are not loaded')\n")
    registry = build_registry([str(nv_dir)])
    assert registry.skipped_dirs == [str(nv_dir)]
    assert registry.get("base", "LogTensorStats").cls.__module__.startswith("tedebug.compat.")


def test_same_dir_twice_loads_each_file_once():
    registry = Registry()
    registry.load_dirs([ROUTING, ROUTING, os.path.join(ROUTING, "nested")])
    assert "NestedFeature" in registry.feature_names()["transformer_engine"]


def test_duplicate_feature_name_names_both_files(tmp_path):
    body = """
        from tedebug.registry import FeatureMapper, register_feature

        @register_feature()
        class Twin(FeatureMapper):
            pass
    """
    first, second = write(tmp_path / "a" / "one.py", body), write(tmp_path / "b" / "two.py", body)
    with pytest.raises(FeatureLoadError) as info:
        build_registry([str(tmp_path / "a"), str(tmp_path / "b")])
    assert "'transformer_engine.Twin' is defined twice" in str(info.value)
    assert os.path.realpath(first) in str(info.value) and os.path.realpath(second) in str(info.value)


def test_feature_without_parser_is_rejected(tmp_path):
    write(
        tmp_path / "plain.py",
        """
        from tedebug.registry import api_method, register_feature

        @register_feature()
        class Plain:
            @api_method
            def inspect_tensor(self, config, layer_name, **kw):
                pass
    """,
    )
    with pytest.raises(FeatureLoadError, match="Plain.*parse_config_and_api.*FeatureMapper"):
        build_registry(str(tmp_path))


def test_builtin_package_loading(tmp_path, monkeypatch):
    write(tmp_path / "fake_builtin_pkg" / "__init__.py", "")
    write(
        tmp_path / "fake_builtin_pkg" / "one.py",
        """
        from tedebug.registry import FeatureMapper, api_method, register_feature

        @register_feature(namespace="base")
        class LogTensorStats(FeatureMapper):
            '''Generic stats.'''

            @api_method
            def log_tensor_stats(self, config, layer_name, **kw):
                return {}
    """,
    )
    write(tmp_path / "fake_builtin_pkg" / "two.py", "raise RuntimeError('boom in two')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry()
    with pytest.raises(FeatureLoadError, match=r"fake_builtin_pkg.two\.py.*boom in two"):
        registry.load_builtin("fake_builtin_pkg")
    assert registry.get("base", "LogTensorStats").doc == "Generic stats."
    for name in ("fake_builtin_pkg", "fake_builtin_pkg.one", "fake_builtin_pkg.two"):
        sys.modules.pop(name, None)


def test_feature_names_and_validators(tmp_path):
    write(
        tmp_path / "validated.py",
        """
        from tedebug.registry import FeatureMapper, register_feature

        @register_feature()
        class Validated(FeatureMapper):
            @classmethod
            def validate_feature_config(cls, cfg):
                if "bad" in cfg:
                    raise ValueError("bad: not allowed")
    """,
    )
    registry = build_registry(str(tmp_path))
    names = registry.feature_names()
    assert "Validated" in names["transformer_engine"]
    assert "LogTensorStats" in names["base"]  # nvdlfw-inspect's generic feature, built in (tedebug.compat)
    validators = registry.feature_validators()
    assert set(validators) >= {("transformer_engine", "Validated")}
    with pytest.raises(ValueError, match="bad: not allowed"):
        validators[("transformer_engine", "Validated")]({"enabled": True, "bad": 1})


def test_builtin_registry_builds():
    registry = build_registry()
    assert all(name.split(".")[0] in ("base", "transformer_engine") for name in registry.qualified_names())


def test_shared_feature_bases_are_not_features():
    """The feature package also holds the shared bases and helpers; only decorated classes are registered."""
    registry = build_registry()
    names = {info.name for info in registry.all_features()}
    assert {"LogTensorStats", "LogFp8TensorStats", "DumpTensors", "FakeQuant"} <= names
    assert not names & {
        "ValidatedFeature",
        "ScheduledInspectFeature",
        "FeatureMapper",
        "FeatureConfigError",
        "InspectPlan",
        "Fp8StatName",
    }
    sources = {os.path.basename(info.source) for info in registry.all_features()}
    assert not sources & {"base.py", "config_checks.py", "fp8_stat_names.py"}
