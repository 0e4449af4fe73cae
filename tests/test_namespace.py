"""Hook routing of the transformer_engine namespace (defaults, routing answers, combination, kwargs, outputs) and
the section-level base namespace."""

import os
import warnings

import pytest
import torch

import tedebug.debug_api as debug_api
from tedebug.namespace import HOOKS, combine_enabled

FEATURE_DIRS = os.path.join(os.path.dirname(__file__), "feature_dirs")
ROUTING = os.path.join(FEATURE_DIRS, "routing")
DUMMY = os.path.join(FEATURE_DIRS, "dummy")
BASE_NS = os.path.join(FEATURE_DIRS, "base_ns")


@pytest.fixture(autouse=True)
def ended():
    debug_api.end_debug()
    yield
    debug_api.end_debug()


def start(
    tmp_path,
    te_features=None,
    *,
    feature_dirs=(ROUTING, DUMMY),
    regex=".*fc1",
    section_level=None,
    init_training_step=0,
):
    section = {"enabled": True, "layers": {"layer_name_regex_pattern": regex}}
    if te_features:
        section["transformer_engine"] = te_features
    if section_level:
        section.update(section_level)
    config = {"section": section} if (te_features or section_level) else ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "running without config"
        debug_api.initialize(
            config, feature_dirs=list(feature_dirs), log_dir=str(tmp_path), init_training_step=init_training_step
        )
    return debug_api.transformer_engine


def feature(name):
    return debug_api.session().registry.instance("transformer_engine", name)


# ------------------------------------------------------------------------------------------------ defaults
def test_defaults_with_empty_config(tmp_path):
    te = start(tmp_path)
    assert te.fp8_gemm_enabled("fc1", gemm="fprop", iteration=0) == (True, None)
    assert te.modify_tensor_enabled("fc1", gemm="fprop", tensor_name="activation", iteration=0) == (False, None)
    assert te.inspect_tensor_enabled("fc1", tensor_name="weight", iteration=0) == (False, None)
    assert te.inspect_tensor_postquantize_enabled("fc1", tensor_name="weight", gemm="fprop", iteration=0) == (
        False,
        None,
    )
    x = torch.ones(2, 2)
    assert (
        te.inspect_tensor(
            "fc1",
            tensor=x,
            tensor_name="activation",
            iteration=0,
            tp_group=None,
            tp_size=1,
            rowwise_quantized_tensor=None,
            columnwise_quantized_tensor=None,
            quantizer=None,
        )
        is None
    )
    assert (
        te.inspect_tensor_postquantize(
            "fc1", tensor=x, tensor_name="activation", iteration=0, tp_group=None, rowwise=True
        )
        is None
    )
    with pytest.raises(NotImplementedError, match="modify_tensor.*'fc1'.*activation.*fprop"):
        te.modify_tensor("fc1", gemm="fprop", tensor_name="activation", tensor=x, default_quantizer=None, iteration=0)


def test_hook_table_matches_spec():
    assert set(HOOKS) == {
        "fp8_gemm_enabled",
        "modify_tensor_enabled",
        "modify_tensor",
        "inspect_tensor_enabled",
        "inspect_tensor",
        "inspect_tensor_postquantize_enabled",
        "inspect_tensor_postquantize",
    }
    multi = {name for name, spec in HOOKS.items() if spec.multi}
    assert multi == {
        "fp8_gemm_enabled",
        "inspect_tensor_enabled",
        "inspect_tensor",
        "inspect_tensor_postquantize_enabled",
        "inspect_tensor_postquantize",
    }
    assert HOOKS["modify_tensor"].required == ("tensor_name", "gemm")
    assert HOOKS["fp8_gemm_enabled"].required == ("gemm",)
    assert HOOKS["inspect_tensor"].required == ("tensor_name",)


# ------------------------------------------------------------------------------------------------ routing answers
def test_gemm_switch_listed_false_unlisted_true_and_cached(tmp_path):
    te = start(tmp_path, {"GemmSwitch": {"enabled": True, "gemms": ["dgrad", "wgrad"]}})
    switch = feature("GemmSwitch")
    for iteration in range(50):
        assert te.fp8_gemm_enabled("model.fc1", gemm="fprop", iteration=iteration) == (True, None)
        assert te.fp8_gemm_enabled("model.fc1", gemm="dgrad", iteration=iteration) == (False, iteration + 1)
        assert te.fp8_gemm_enabled("model.fc1", gemm="wgrad", iteration=iteration) == (False, iteration + 1)
        assert te.fp8_gemm_enabled("model.fc2", gemm="dgrad", iteration=iteration) == (True, None)
    assert switch.parse_calls == 3  # one routing decision per (layer, hook, gemm) of fc1; fc2 has no block
    assert switch.calls == 100  # the feature method itself runs on every routed call
    assert debug_api.session().transformer_engine.cache_size == 4  # never grows with the iteration


def test_layer_level_switch(tmp_path):
    te = start(tmp_path, {"LayerSwitch": {"enabled": True}})
    for gemm in ("fprop", "dgrad", "wgrad"):
        assert te.fp8_gemm_enabled("fc1", gemm=gemm, iteration=4) == (False, 5)
    assert te.fp8_gemm_enabled("fc2", gemm="fprop", iteration=4) == (True, None)


def test_disabled_feature_is_not_routed(tmp_path):
    te = start(tmp_path, {"LayerSwitch": {"enabled": False}})
    assert te.fp8_gemm_enabled("fc1", gemm="fprop", iteration=0) == (True, None)


def test_modify_routing_per_gemm_and_tensor(tmp_path):
    te = start(
        tmp_path,
        {
            "ScaleModify": {
                "enabled": True,
                "factor": 2.0,
                "gemms_struct": [
                    {"gemm": "fprop", "tensors": ["activation"]},
                    {"gemm": "wgrad", "tensors_struct": [{"tensor": "gradient", "factor": 0.5}]},
                ],
            }
        },
    )
    enabled = {
        (g, t): te.modify_tensor_enabled("fc1", gemm=g, tensor_name=t, iteration=9)
        for g in ("fprop", "dgrad", "wgrad")
        for t in ("activation", "weight", "gradient")
    }
    on = {k for k, v in enabled.items() if v[0]}
    assert on == {("fprop", "activation"), ("wgrad", "gradient")}
    assert enabled[("fprop", "activation")] == (True, 10)
    assert enabled[("fprop", "weight")] == (False, None)
    x = torch.tensor([1.0, -3.0, 0.25])
    y = te.modify_tensor("fc1", gemm="fprop", tensor_name="activation", tensor=x, default_quantizer=None, iteration=9)
    assert torch.equal(y, torch.tensor([2.0, -6.0, 0.5]))
    z = te.modify_tensor("fc1", gemm="wgrad", tensor_name="gradient", tensor=x, default_quantizer=None, iteration=9)
    assert torch.equal(z, torch.tensor([0.5, -1.5, 0.125]))
    assert [seen[3] for seen in feature("ScaleModify").seen] == [
        {"factor": 2.0, "gemm": "fprop", "tensor": "activation"},
        {"factor": 0.5, "gemm": "wgrad", "tensor": "gradient"},
    ]


def test_modify_with_out_returning_none_is_accepted(tmp_path):
    te = start(tmp_path, {"ScaleModify": {"enabled": True, "factor": 3.0, "gemms": ["fprop"], "tensors": ["weight"]}})
    out = torch.zeros(2)
    result = te.modify_tensor(
        "fc1",
        gemm="fprop",
        tensor_name="weight",
        tensor=torch.tensor([1.0, 2.0]),
        default_quantizer=None,
        iteration=0,
        out=out,
    )
    assert result is None and torch.equal(out, torch.tensor([3.0, 6.0]))
    half = te.modify_tensor(
        "fc1",
        gemm="fprop",
        tensor_name="weight",
        tensor=torch.tensor([1.0, 2.0]),
        default_quantizer=None,
        iteration=0,
        dtype=torch.float16,
    )
    assert half.dtype == torch.float16 and torch.equal(half, torch.tensor([3.0, 6.0], dtype=torch.float16))


def test_two_modify_features_on_one_tensor_is_an_error(tmp_path):
    te = start(
        tmp_path,
        {
            "ScaleModify": {"enabled": True, "factor": 2.0, "gemms": ["fprop"], "tensors": ["activation"]},
            "OffsetModify": {
                "enabled": True,
                "offset": 1.0,
                "gemms": ["fprop", "dgrad"],
                "tensors": ["activation", "gradient"],
            },
        },
    )
    with pytest.raises(ValueError) as info:
        te.modify_tensor_enabled("fc1", gemm="fprop", tensor_name="activation", iteration=0)
    message = str(info.value)
    for part in (
        "Only 1 operation permitted per API call",
        "ScaleModify",
        "OffsetModify",
        "'fc1'",
        "'modify_tensor_enabled'",
        "'gemm': 'fprop'",
        "'tensor_name': 'activation'",
    ):
        assert part in message
    assert te.modify_tensor_enabled("fc1", gemm="dgrad", tensor_name="gradient", iteration=0) == (True, 1)
    y = te.modify_tensor(
        "fc1", gemm="dgrad", tensor_name="gradient", tensor=torch.tensor([1.0]), default_quantizer=None, iteration=0
    )
    assert torch.equal(y, torch.tensor([2.0]))


# ------------------------------------------------------------------------------------------------ combination
def test_combine_enabled_rules():
    assert combine_enabled([(False, 8), (True, 12)]) == (True, 8)
    assert combine_enabled([(False, None), (False, 8)]) == (False, 8)
    assert combine_enabled([(False, None), (False, None)]) == (False, None)
    assert combine_enabled([False, (False, 8)]) == (False, None)
    assert combine_enabled([True, (False, 8)]) == (True, None)
    assert combine_enabled([False, (True, 3)]) == (True, None)


def test_multi_feature_inspect_enabled(tmp_path):
    te = start(
        tmp_path,
        {
            "TupleInspect": {"enabled": True, "tensors": ["activation", "weight"], "freq": 4},
            "NestedFeature": {"enabled": True, "tensors": ["activation"]},
            "TestDummyFeature": {"enabled": True, "tensors": ["weight"], "inspect_only_once": True},
            "BoolInspect": {"enabled": True, "tensors": ["gradient"], "answer": False},
        },
    )
    # tuples only: (False, 8) + (True, 12) -> (True, 8)
    assert te.inspect_tensor_enabled("fc1", tensor_name="activation", iteration=5) == (True, 8)
    # tuples only: (False, 8) + (False, None) -> (False, 8)
    assert te.inspect_tensor_enabled("fc1", tensor_name="weight", iteration=5) == (False, 8)
    assert te.inspect_tensor_enabled("fc1", tensor_name="weight", iteration=8) == (True, 12)
    # a single bare bool passes through unchanged
    assert te.inspect_tensor_enabled("fc1", tensor_name="gradient", iteration=5) is False


def test_multi_feature_with_bare_bool(tmp_path):
    te = start(
        tmp_path,
        {
            "TupleInspect": {"enabled": True, "tensors": ["activation"], "freq": 4},
            "TestDummyFeature": {"enabled": True, "tensors": ["activation"]},
        },
    )
    assert te.inspect_tensor_enabled("fc1", tensor_name="activation", iteration=5) == (True, None)
    assert feature("TestDummyFeature").enabled_calls == 1
    x = torch.zeros(1)
    assert te.inspect_tensor("fc1", tensor=x, tensor_name="activation", iteration=5, tp_group=None) is None
    assert feature("TestDummyFeature").inspect_calls == 1
    assert feature("TupleInspect").received == [("fc1", "activation", 5, ["tensor", "tp_group"])]


def test_iteration_defaults_to_session_iteration(tmp_path):
    te = start(
        tmp_path, {"TupleInspect": {"enabled": True, "tensors": ["activation"], "freq": 4}}, init_training_step=4
    )
    assert te.inspect_tensor_enabled("fc1", tensor_name="activation") == (True, 8)
    debug_api.step()
    assert te.inspect_tensor_enabled("fc1", tensor_name="activation") == (False, 8)


# ------------------------------------------------------------------------------------------------ kwargs
def test_required_kwargs(tmp_path):
    te = start(tmp_path)
    with pytest.raises(TypeError, match="fp8_gemm_enabled.*'gemm'"):
        te.fp8_gemm_enabled("fc1", iteration=0)
    with pytest.raises(TypeError, match="inspect_tensor_enabled.*'tensor_name'"):
        te.inspect_tensor_enabled("fc1", iteration=0)
    with pytest.raises(TypeError, match="modify_tensor_enabled.*'gemm'"):
        te.modify_tensor_enabled("fc1", tensor_name="activation", iteration=0)
    with pytest.raises(TypeError):
        te.fp8_gemm_enabled(gemm="fprop")  # layer_name is a required positional argument


def test_unknown_kwargs_and_values(tmp_path):
    te = start(tmp_path)
    with pytest.raises(TypeError, match="unexpected keyword argument 'iteraton'; did you mean 'iteration'"):
        te.inspect_tensor_enabled("fc1", tensor_name="activation", iteraton=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor'; did you mean 'tensor_name'"):
        te.inspect_tensor_enabled("fc1", tensor_name="activation", tensor=None)
    with pytest.raises(ValueError, match="unknown gemm 'fprob'; did you mean 'fprop'"):
        te.fp8_gemm_enabled("fc1", gemm="fprob", iteration=0)
    with pytest.raises(ValueError, match="unknown tensor_name 'activations'; did you mean 'activation'"):
        te.inspect_tensor_enabled("fc1", tensor_name="activations", iteration=0)
    with pytest.raises(AttributeError, match="no hook 'fp8_gemm'; did you mean 'fp8_gemm_enabled'"):
        te.fp8_gemm("fc1", gemm="fprop")


def test_legacy_inspect_signature_gets_filtered_kwargs(tmp_path):
    te = start(tmp_path, {"LegacyInspect": {"enabled": True, "tensors": ["weight"]}})
    te.inspect_tensor(
        "fc1",
        tensor=torch.ones(1),
        tensor_name="weight",
        iteration=3,
        tp_group="tp",
        tp_size=2,
        rowwise_quantized_tensor=None,
        columnwise_quantized_tensor=None,
        quantizer=None,
    )
    assert feature("LegacyInspect").received == [("weight", 3, "tp")]


def test_postquantize_hooks_warn(tmp_path):
    te = start(tmp_path, {"PostquantizeInspect": {"enabled": True, "tensors": ["weight"]}})
    with pytest.warns(DeprecationWarning, match="inspect_tensor_postquantize_enabled is deprecated"):
        assert te.inspect_tensor_postquantize_enabled("fc1", tensor_name="weight", gemm="fprop", iteration=1) == (
            True,
            2,
        )
    with pytest.warns(DeprecationWarning, match="inspect_tensor_postquantize is deprecated"):
        te.inspect_tensor_postquantize(
            "fc1", tensor=torch.ones(1), tensor_name="weight", iteration=1, tp_group=None, tp_size=4, rowwise=False
        )
    assert feature("PostquantizeInspect").received == [("weight", False)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default path (no feature) does not warn
        assert te.inspect_tensor_postquantize_enabled("fc2", tensor_name="weight", gemm="fprop", iteration=1) == (
            False,
            None,
        )


def test_output_checks(tmp_path):
    te = start(tmp_path, {"WrongOutput": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"]}})
    with pytest.raises(TypeError, match="'WrongOutput'.*'modify_tensor_enabled'.*bool or a \\(bool"):
        te.modify_tensor_enabled("fc1", gemm="fprop", tensor_name="activation", iteration=0)
    with pytest.raises(TypeError, match="'WrongOutput'.*must return a torch.Tensor or a QuantizedTensor, got str"):
        te.modify_tensor("fc1", gemm="fprop", tensor_name="activation", tensor=torch.ones(1), iteration=0)
    with pytest.raises(TypeError, match="inspect hooks must return None, got int"):
        te.inspect_tensor("fc1", tensor=torch.ones(1), tensor_name="activation", iteration=0)


# ------------------------------------------------------------------------------------------------ base namespace
def test_section_level_log_tensor_stats_is_the_builtin_generic_feature(tmp_path):
    start(
        tmp_path,
        section_level={"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["min", "L2_Norm"]}},
    )
    x = torch.tensor([[3.0, -4.0], [0.0, 12.0]])
    stats = debug_api.log_tensor_stats("fc1", tensor=x, tensor_name="activation")
    assert {k: v.item() for k, v in stats.items()} == {"min": -4.0, "l2_norm": 13.0}  # sqrt(9 + 16 + 0 + 144)
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in stats.values())
    # TE never calls it: the transformer_engine hooks are unaffected
    assert debug_api.transformer_engine.inspect_tensor_enabled("fc1", tensor_name="activation", iteration=0) == (
        False,
        None,
    )


def test_section_level_log_tensor_stats_without_te_block_warns_how_to_log_te_layers(tmp_path):
    config = {
        "section": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*fc1"},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["min"]},
        }
    }
    with pytest.warns(UserWarning, match="generic feature .* only through debug_api.log_tensor_stats"):
        debug_api.initialize(config, feature_dirs=[str(ROUTING)], log_dir=str(tmp_path))
    assert debug_api.is_enabled()


def test_a_feature_file_replaces_the_generic_log_tensor_stats(tmp_path):
    start(
        tmp_path,
        feature_dirs=(BASE_NS,),
        section_level={
            "LogTensorStats": {"enabled": True, "tensors_struct": [{"tensor": "activation", "stats": ["min", "max"]}]}
        },
    )
    x = torch.tensor([[3.0, -1.5], [0.5, 8.0]])
    stats = debug_api.log_tensor_stats("fc1", tensor=x, tensor_name="activation")
    assert {k: v.item() for k, v in stats.items()} == {"min": -1.5, "max": 8.0}
    assert debug_api.log_tensor_stats("fc1", tensor=x, tensor_name="weight") == {}
    assert debug_api.base.log_tensor_stats("fc2", tensor=x, tensor_name="activation") == {}
    with pytest.raises(TypeError, match="tensor_name"):
        debug_api.log_tensor_stats("fc1", tensor=x)
    registry = debug_api.session().registry
    assert registry.get("base", "LogTensorStats").source == os.path.join(BASE_NS, "generic_stats.py")
    builtin = os.path.join("tedebug", "compat", "nvdlfw_inspect", "debug_features", "log_tensor_stats.py")
    assert len(registry.replaced) == 1 and registry.replaced[0].startswith("base.LogTensorStats: ")
    assert registry.replaced[0].endswith(f"{builtin} -> {os.path.join(BASE_NS, 'generic_stats.py')}")


# ------------------------------------------------------------------------------------------------ routes for compilers
def test_routes_route_a_key_once_with_the_checks_of_a_call(tmp_path):
    """`routes` gives the features serving a key (routing it now, with a call's name checks); a later call of the
    hook uses the same decision; an override set on or deleted from the instance empties `compiled`."""
    te = start(tmp_path, {"DisableFP8GEMM": {"enabled": True, "gemms": ["wgrad"]}})
    routes = te.routes("fp8_gemm_enabled", "fc1", "wgrad")
    assert [r.feature for r in routes] == ["DisableFP8GEMM"]
    assert te.routes("fp8_gemm_enabled", "fc1", "wgrad") is routes
    assert te.routes("fp8_gemm_enabled", "fc1", "fprop") == ()
    assert te.fp8_gemm_enabled("fc1", gemm="wgrad", iteration=3) == (False, 4)
    assert te.routes("fp8_gemm_enabled", "fc1", "wgrad") is routes
    with pytest.raises(ValueError, match="unknown gemm 'fprob'; did you mean 'fprop'"):
        te.routes("fp8_gemm_enabled", "fc1", "fprob")
    with pytest.raises(TypeError, match="needs the keyword argument 'tensor_name'"):
        te.routes("inspect_tensor_enabled", "fc1")
    te.compiled["x"] = 1
    assert not te.overridden("inspect_tensor")
    te.inspect_tensor = lambda layer_name, **kwargs: None
    assert te.overridden("inspect_tensor") and te.compiled == {}
    te.compiled["x"] = 1
    del te.inspect_tensor
    assert not te.overridden("inspect_tensor") and te.compiled == {}
    te.compiled["x"] = 1
    te.unrelated = 1  # not a hook: compiled tables stay
    assert te.compiled == {"x": 1}
    debug_api.end_debug()
    assert te.compiled == {}
