"""Config loading: sources, YAML line tracking, every validation error (file, key path and line in the message),
feature validators, the summary and the JSON Schema."""

import json
import pathlib
import textwrap

import pytest

from tedebug.config import CompiledConfig, ConfigError, config_json_schema, load_config
from tedebug.config.loader import read_yaml

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
FEATURE_NAMES = {
    "transformer_engine": {
        "LogTensorStats",
        "LogFp8TensorStats",
        "FakeQuant",
        "PerTensorScaling",
        "DisableFP8GEMM",
        "DisableQuantizationGEMM",
        "DisableFP8Layer",
        "DisableQuantizationLayer",
        "DumpTensors",
        "LogNvfp4TensorStats",
    },
    "base": {"LogTensorStats"},
}

GOOD = """\
log_stats:
  enabled: True
  layers:
    layer_types: [fc1]
  transformer_engine:
    LogTensorStats:
      enabled: True
      tensors: [activation]
      stats: [max]
"""


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def line_of(path, needle, occurrence=1):
    """Independent oracle: the 1-based line of the n-th line containing `needle`."""
    hits = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if needle in line]
    return hits[occurrence - 1]


def load_error(source, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source, feature_names=FEATURE_NAMES, **kwargs)
    return info.value


def edit(old, new, text=GOOD):
    assert old in text
    return text.replace(old, new)


# ---- sources ------------------------------------------------------------------------------------------------


def test_yaml_file_as_str_and_path(tmp_path):
    path = write(tmp_path, GOOD)
    for source in (path, str(path)):
        config = load_config(source, feature_names=FEATURE_NAMES)
        assert isinstance(config, CompiledConfig) and not config.is_empty
        assert config.source_label == str(path)
        assert config.layer_config("model.fc1") == {
            "transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}}
        }
        assert config.sections["log_stats"].line == 1


@pytest.mark.parametrize("source", ["", "/nonexistent/tedebug/config.yaml", pathlib.Path("/nonexistent/x.yaml")])
def test_no_config_warns_and_selects_nothing(source):
    with pytest.warns(UserWarning, match="Could not find config file at .*Running without config"):
        config = load_config(source, feature_names=FEATURE_NAMES)
    assert config.is_empty and config.sections == {}
    assert config.layer_config("decoder.1.mlp.fc1") == {}


@pytest.mark.parametrize("source", [42, None, b"config.yaml", ["a.yaml"]])
def test_other_source_types_are_type_errors(source):
    with pytest.raises(TypeError, match="filepath \\(str or Path\\) or a dictionary, got"):
        load_config(source, feature_names=FEATURE_NAMES)


def test_empty_file_and_non_mapping_top_level(tmp_path):
    err = load_error(write(tmp_path, "# only a comment\n"))
    assert (
        str(err) == f"{tmp_path / 'config.yaml'}: the config file is empty (expected a mapping of section "
        "name -> section)"
    )
    err = load_error(write(tmp_path, "- a\n- b\n", "list.yaml"))
    assert err.file == str(tmp_path / "list.yaml") and "must be a mapping of section name -> section" in str(err)
    assert "got list" in str(err)
    err = load_error({})
    assert str(err) == "<dict>: the config has no sections (expected at least one enabled section)"


def test_directory_is_an_error(tmp_path):
    err = load_error(tmp_path)
    assert "is a directory" in str(err) and err.file == str(tmp_path)


def test_invalid_yaml_reports_the_line(tmp_path):
    path = write(tmp_path, "a:\n  enabled: True\n  layers: [unclosed\n")
    err = load_error(path)
    assert err.file == str(path) and err.line is not None and err.line >= 3
    assert str(err).startswith(f"{path}:{err.line}: invalid YAML")


def test_duplicate_keys_are_errors(tmp_path):
    path = write(tmp_path, GOOD + "  enabled: False\n")
    err = load_error(path)
    assert str(err) == (f"{path}:10: section 'log_stats' -> enabled: duplicate key 'enabled' (first given at line 2)")


def test_line_numbers_of_keys_and_items():
    data, lines = read_yaml("a:\n  b: [1,\n    2]\n  c:\n    - x: 1\n    - y: 2\n", "<t>")
    assert data == {"a": {"b": [1, 2], "c": [{"x": 1}, {"y": 2}]}}
    assert lines == {
        ("a",): 1,
        ("a", "b"): 2,
        ("a", "b", 0): 2,
        ("a", "b", 1): 3,
        ("a", "c"): 4,
        ("a", "c", 0): 5,
        ("a", "c", 0, "x"): 5,
        ("a", "c", 1): 6,
        ("a", "c", 1, "y"): 6,
    }


def test_anchors_and_merge_keys_load_like_safe_load():
    import yaml

    text = "base: &b {enabled: True, freq: 2}\nsec:\n  <<: *b\n  freq: 3\n"
    data, lines = read_yaml(text, "<t>")
    assert data == yaml.safe_load(text) == {"base": {"enabled": True, "freq": 2}, "sec": {"enabled": True, "freq": 3}}
    assert lines[("sec", "freq")] == 4


# ---- every validation error: file, key path and line --------------------------------------------------------


def test_missing_enabled(tmp_path):
    path = write(tmp_path, edit("  enabled: True\n  layers:", "  layers:"))
    err = load_error(path)
    assert str(err) == (
        f"{path}:1: section 'log_stats' -> enabled: Missing required config field `enabled` "
        "(expected enabled: True or False)"
    )
    assert err.key_path == ("log_stats", "enabled") and err.line == 1 and err.expected == "enabled: True or False"


def test_missing_layers(tmp_path):
    path = write(tmp_path, edit("  layers:\n    layer_types: [fc1]\n", ""))
    err = load_error(path)
    assert str(err) == (
        f"{path}:1: section 'log_stats' -> layers: missing required key (an enabled section must "
        "select layers) (expected a 'layers:' selector)"
    )


def test_no_selector(tmp_path):
    path = write(tmp_path, edit("  layers:\n    layer_types: [fc1]\n", "  layers: {}\n"))
    err = load_error(path)
    assert err.key_path == ("log_stats", "layers") and err.line == 3
    assert str(err).startswith(
        f"{path}:3: section 'log_stats' -> layers: Atleast one of 'layer_numbers', "
        "'layer_types', 'exact_layer_names' or 'layer_name_regex_pattern' must be provided"
    )


def test_layer_type_typo_suggests_layer_types(tmp_path):
    path = write(tmp_path, edit("layer_types:", "layer_type:"))
    err = load_error(path)
    assert (
        str(err) == f"{path}:4: section 'log_stats' -> layers -> layer_type: unknown key; did you mean 'layer_types'?"
    )
    assert err.suggestion == "layer_types"


def test_unknown_feature_suggests_registered_name(tmp_path):
    path = write(tmp_path, edit("    LogTensorStats:", "    LogTensorStat:"))
    err = load_error(path)
    assert str(err).startswith(
        f"{path}:6: section 'log_stats' -> transformer_engine -> LogTensorStat: Could not "
        "find feature 'LogTensorStat' in namespace 'transformer_engine'; did you mean "
        "'LogTensorStats'?"
    )
    assert err.suggestion == "LogTensorStats"


def test_unknown_section_key_suggests_namespace(tmp_path):
    path = write(tmp_path, edit("  transformer_engine:", "  transformer_engin:"))
    err = load_error(path)
    assert str(err).startswith(
        f"{path}:5: section 'log_stats' -> transformer_engin: Could not find feature "
        "'transformer_engin' in namespace 'base'; did you mean 'transformer_engine'?"
    )


def test_invalid_gemm(tmp_path):
    path = write(
        tmp_path, edit("      tensors: [activation]\n", "      gemms: [fprop, fprp]\n      tensors: [weight]\n")
    )
    err = load_error(path)
    assert str(err) == (
        f"{path}:8: section 'log_stats' -> transformer_engine -> LogTensorStats -> gemms[1]: "
        "invalid gemm name 'fprp'; did you mean 'fprop'? (expected one of fprop, dgrad, wgrad)"
    )


def test_gradients_suggests_gradient(tmp_path):
    path = write(tmp_path, edit("tensors: [activation]", "tensors:\n        - activation\n        - gradients"))
    err = load_error(path)
    assert err.key_path == ("log_stats", "transformer_engine", "LogTensorStats", "tensors", 1)
    assert err.line == line_of(path, "- gradients") == 10
    assert str(err).startswith(
        f"{path}:10: section 'log_stats' -> transformer_engine -> LogTensorStats -> "
        "tensors[1]: invalid tensor name 'gradients'; did you mean 'gradient'?"
    )


def test_enabled_inside_gemms_struct(tmp_path):
    path = write(
        tmp_path,
        edit(
            "      tensors: [activation]\n",
            "      gemms_struct:\n        - gemm: fprop\n          enabled: True\n          tensors: [activation]\n",
        ),
    )
    err = load_error(path)
    assert err.key_path == ("log_stats", "transformer_engine", "LogTensorStats", "gemms_struct", 0, "enabled")
    assert err.line == 10
    assert str(err).startswith(
        f"{path}:10: section 'log_stats' -> transformer_engine -> LogTensorStats -> "
        "gemms_struct[0] -> enabled: 'enabled' is not allowed inside a gemms_struct entry"
    )


def test_all_sections_disabled(tmp_path):
    path = write(tmp_path, edit("  enabled: True\n  layers:", "  enabled: False\n  layers:"))
    err = load_error(path)
    assert str(err) == (
        f"{path}: Could not load config from input: every section is disabled "
        "(expected at least one section with 'enabled: True')"
    )


def test_bad_regex(tmp_path):
    path = write(tmp_path, edit("layer_types: [fc1]", "layer_name_regex_pattern: '.*(fc1'"))
    err = load_error(path)
    assert err.key_path == ("log_stats", "layers", "layer_name_regex_pattern") and err.line == 4
    assert str(err).startswith(
        f"{path}:4: section 'log_stats' -> layers -> layer_name_regex_pattern: invalid "
        "regular expression '.*(fc1': missing ), unterminated subpattern"
    )


def test_start_after_end(tmp_path):
    path = write(tmp_path, edit("      stats: [max]\n", "      stats: [max]\n      start_end_list: [[0, 4], [9, 3]]\n"))
    err = load_error(path)
    assert str(err) == (
        f"{path}:10: section 'log_stats' -> transformer_engine -> LogTensorStats -> "
        "start_end_list[1]: start_end_list entry [9, 3] is invalid: need 0 <= start <= end "
        "(expected [start, end] with 0 <= start <= end)"
    )
    path = write(tmp_path, edit("      stats: [max]\n", "      stats: [max]\n      start_step: 8\n      end_step: 2\n"))
    err = load_error(path)
    assert err.key_path == ("log_stats", "transformer_engine", "LogTensorStats") and err.line == 6
    assert "start_step 8 is after end_step 2" in str(err)


def test_freq_zero(tmp_path):
    path = write(tmp_path, edit("      stats: [max]\n", "      stats: [max]\n      freq: 0\n"))
    err = load_error(path)
    assert str(err) == (
        f"{path}:10: section 'log_stats' -> transformer_engine -> LogTensorStats -> freq: "
        "freq must be an integer >= 1, got 0"
    )


def test_feature_without_enabled(tmp_path):
    path = write(tmp_path, edit("      enabled: True\n", ""))
    err = load_error(path)
    assert str(err).startswith(
        f"{path}:6: section 'log_stats' -> transformer_engine -> LogTensorStats -> "
        "enabled: Missing required config field `enabled`"
    )


def test_bad_layer_numbers_and_types_in_dict_source():
    err = load_error({"s": {"enabled": True, "layers": {"layer_numbers": [1, "3-1", 2.5, True], "layer_types": [3]}}})
    assert str(err).splitlines() == [
        "<dict>: section 's' -> layers -> layer_types[0]: entry must be a string, got 3",
        "<dict>: section 's' -> layers -> layer_numbers[1]: invalid layer_numbers range '3-1': start 3 > end 1",
        "<dict>: section 's' -> layers -> layer_numbers[2]: invalid layer_numbers entry 2.5 (expected an int >= 0, "
        "a range 'a-b' or 'all')",
        "<dict>: section 's' -> layers -> layer_numbers[3]: invalid layer_numbers entry True (expected an int >= 0, "
        "a range 'a-b' or 'all')",
    ]


def test_all_problems_are_reported_together(tmp_path):
    text = GOOD.replace("layer_types:", "layer_type:").replace("    LogTensorStats:", "    LogTensorStat:")
    path = write(tmp_path, text + "other:\n  layers: {layer_types: [x]}\n")
    err = load_error(path)
    assert [(issue.key_path, issue.line) for issue in err.issues] == [
        (("log_stats", "layers", "layer_type"), 4),
        (("log_stats", "transformer_engine", "LogTensorStat"), 6),
        (("other", "enabled"), 10),
    ]
    assert len(str(err).splitlines()) == 3


def test_disabled_sections_are_validated_too(tmp_path):
    path = write(tmp_path, GOOD + "spare:\n  enabled: False\n  layers: {bogus: 1}\n  NotAFeature: {x: 1}\n")
    err = load_error(path)
    assert [(issue.key_path, issue.line) for issue in err.issues] == [
        (("spare", "layers", "bogus"), 12),
        (("spare", "NotAFeature"), 13),
    ]
    config = load_config(write(tmp_path, GOOD + "spare:\n  enabled: False\n", "ok.yaml"), feature_names=FEATURE_NAMES)
    assert list(config.sections) == ["log_stats"] and config.disabled_sections == ("spare",)
    err = load_error(write(tmp_path, GOOD + "spare: [1, 2]\n", "bad.yaml"))
    assert (
        str(err) == f"{tmp_path / 'bad.yaml'}:10: section 'spare': a section must be a mapping, got list "
        "(expected a mapping with 'enabled', 'layers' and features)"
    )


@pytest.mark.parametrize("value", ["'False'", "'0'", "[False]", "0", "1", "'true'", "null"])
def test_enabled_must_be_a_yaml_boolean(tmp_path, value):
    for old, key_path, line in (
        ("log_stats:\n  enabled: True", ("log_stats", "enabled"), 2),
        ("      enabled: True", ("log_stats", "transformer_engine", "LogTensorStats", "enabled"), 7),
    ):
        path = write(tmp_path, edit(old, old.replace("True", value)))
        err = load_error(path)
        assert [(issue.key_path, issue.line) for issue in err.issues] == [(key_path, line)]
        assert "enabled must be a YAML boolean" in str(err)
        assert err.expected == "a YAML boolean: True, False, true or false (unquoted)"


@pytest.mark.parametrize("value", ["true", "false", "True", "False"])
def test_yaml_booleans_are_accepted(tmp_path, value):
    path = write(tmp_path, edit("      enabled: True", f"      enabled: {value}"))
    config = load_config(path, feature_names=FEATURE_NAMES)
    assert config.layer_config("x.fc1")["transformer_engine"]["LogTensorStats"]["enabled"] is (value.lower() == "true")


def test_base_feature_at_section_level():
    config = load_config(
        {
            "s": {
                "enabled": True,
                "layers": {"layer_numbers": "all"},
                "LogTensorStats": {"enabled": True, "tensors": "activation", "stats": ["min"]},
            }
        },
        feature_names=FEATURE_NAMES,
    )
    assert config.layer_config("layers.0.fc1") == {
        "base": {"LogTensorStats": {"enabled": True, "tensors": "activation", "stats": ["min"]}}
    }


def test_feature_outside_its_namespace_is_an_error_with_the_fix():
    names = {"transformer_engine": FEATURE_NAMES["transformer_engine"], "base": set()}
    with pytest.raises(ConfigError) as info:
        load_config(
            {
                "s": {
                    "enabled": True,
                    "layers": {"layer_types": ["fc1"]},
                    "FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"]},
                }
            },
            feature_names=names,
        )
    assert info.value.key_path == ("s", "FakeQuant")
    assert str(info.value) == (
        "<dict>: section 's' -> FakeQuant: 'FakeQuant' is a feature of namespace 'transformer_engine' and must be "
        "placed inside its namespace block, not directly in the section (there it would be ignored); write\n"
        "    s:\n      transformer_engine:\n        FakeQuant:\n          ... (expected 'transformer_engine:' -> "
        "'FakeQuant:')"
    )


@pytest.mark.parametrize(
    "features, key_path, message",
    [
        (
            {"transformer_engine": {"FakeQuant": None}},
            ("s", "transformer_engine", "FakeQuant"),
            "the feature block 'FakeQuant' is empty",
        ),
        (
            {"transformer_engine": {"DumpTensors": {}}},
            ("s", "transformer_engine", "DumpTensors"),
            "the feature block 'DumpTensors' is empty",
        ),
        (
            {"transformer_engine": None},
            ("s", "transformer_engine"),
            "the namespace block 'transformer_engine' is empty",
        ),
        ({}, ("s",), "the section configures no feature, so it does nothing"),
        (
            {"transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": [], "stats": ["min"]}}},
            ("s", "transformer_engine", "LogTensorStats", "tensors"),
            "must not be empty",
        ),
        (
            {"transformer_engine": {"FakeQuant": {"enabled": True, "gemms": [], "tensors": ["weight"]}}},
            ("s", "transformer_engine", "FakeQuant", "gemms"),
            "must not be empty",
        ),
    ],
)
def test_blocks_that_would_do_nothing_are_errors(features, key_path, message):
    err = load_error({"s": {"enabled": True, "layers": {"layer_types": ["fc1"]}, **features}})
    assert [(issue.key_path, issue.message) for issue in err.issues] == [(key_path, message)]


def test_layer_types_string_is_an_error_with_the_fix():
    err = load_error(
        {
            "s": {
                "enabled": True,
                "layers": {"layer_types": "fc1"},
                "transformer_engine": {
                    "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["min"]}
                },
            }
        }
    )
    assert str(err) == (
        "<dict>: section 's' -> layers -> layer_types: layer_types must be a list, got the string "
        "'fc1' (expected a list such as [fc1])"
    )


# ---- feature validators ---------------------------------------------------------------------------------------


def fake_quant_validator(cfg):
    allowed = {"enabled", "gemms", "gemms_struct", "tensors", "tensors_struct", "quant_format"}
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise ValueError(f"FakeQuant: unexpected key {unknown[0]!r}")
    if cfg.get("quant_format") not in ("FP8E4M3", "FP8E5M2"):
        err = ValueError(f"FakeQuant: unsupported quant_format {cfg.get('quant_format')!r}")
        err.key_path = ("quant_format",)
        raise err
    cfg["mutated"] = True  # must not leak into the compiled config


FQ = """\
fq:
  enabled: True
  layers: {layer_types: [fc1]}
  transformer_engine:
    FakeQuant:
      enabled: True
      gemms: [fprop]
      tensors: [activation]
      quant_format: FP8E4M3
"""


def test_feature_validator_errors_are_located(tmp_path):
    validators = {("transformer_engine", "FakeQuant"): fake_quant_validator}
    config = load_config(write(tmp_path, FQ), feature_names=FEATURE_NAMES, feature_validators=validators)
    assert config.layer_config("a.fc1")["transformer_engine"]["FakeQuant"] == {
        "enabled": True,
        "gemms": ["fprop"],
        "tensors": ["activation"],
        "quant_format": "FP8E4M3",
    }

    path = write(tmp_path, FQ.replace("FP8E4M3", "FP8E3M4"))
    err = load_error(path, feature_validators=validators)
    assert str(err) == (
        f"{path}:9: section 'fq' -> transformer_engine -> FakeQuant -> quant_format: FakeQuant: "
        "unsupported quant_format 'FP8E3M4'"
    )
    path = write(tmp_path, FQ + "      margin: 1\n")
    err = load_error(path, feature_validators=validators)
    assert str(err) == f"{path}:5: section 'fq' -> transformer_engine -> FakeQuant: FakeQuant: unexpected key 'margin'"


def test_feature_validator_runs_for_disabled_features_with_parameters(tmp_path):
    calls = []
    validators = {("transformer_engine", "FakeQuant"): calls.append}
    load_config(
        write(tmp_path, FQ.replace("      enabled: True\n      gemms", "      enabled: False\n      gemms")),
        feature_names=FEATURE_NAMES,
        feature_validators=validators,
    )
    assert len(calls) == 1 and calls[0]["enabled"] is False
    bare = FQ.split("      gemms")[0].replace("enabled: True\n", "enabled: False\n", 2)
    bare = bare.replace("fq:\n  enabled: False", "fq:\n  enabled: True", 1)
    load_config(
        write(tmp_path, bare + "    LogTensorStats: {enabled: True, tensors: [weight], stats: [min]}\n"),
        feature_names=FEATURE_NAMES,
        feature_validators=validators,
    )
    assert len(calls) == 1  # a bare `enabled: False` block has nothing to check


# ---- summary and JSON Schema ------------------------------------------------------------------------------------


def test_summary():
    config = load_config(CONFIGS / "tensor_manipulation_transformer_engine.yaml", feature_names=FEATURE_NAMES)
    text = config.summary()
    assert text.splitlines()[:5] == [
        f"config: {CONFIGS / 'tensor_manipulation_transformer_engine.yaml'}",
        "section 'manipulate_fc1' (line 2)",
        "  layers: layer_name_regex_pattern='.*(fc1)'",
        "  transformer_engine:",
        "    DisableFP8GEMM: enabled; gemms=['fprop']",
    ]
    assert "section 'manipulate_fc2' (line 23)" in text
    with pytest.warns(UserWarning):
        assert "no enabled section" in load_config("", feature_names=FEATURE_NAMES).summary()


def test_json_schema():
    schema = config_json_schema(FEATURE_NAMES)
    json.dumps(schema)  # serialisable
    defs = schema["$defs"]
    assert schema["type"] == "object"
    assert schema["additionalProperties"] == {"$ref": "#/$defs/SectionModel"}
    assert set(defs["LayersModel"]["properties"]) == {
        "layer_name_regex_pattern",
        "layer_types",
        "layer_numbers",
        "exact_layer_names",
    }
    assert defs["LayersModel"]["additionalProperties"] is False
    assert defs["GemmEntry"]["properties"]["gemm"] == {"enum": ["fprop", "dgrad", "wgrad"], "title": "Gemm"}
    assert "enabled" not in defs["GemmEntry"]["properties"]
    assert defs["FeatureBlock"]["required"] == ["enabled"]
    assert defs["FeatureBlock"]["properties"]["freq"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    te = defs["SectionModel"]["properties"]["transformer_engine"]
    assert sorted(te["properties"]) == sorted(FEATURE_NAMES["transformer_engine"])
    assert "transformer_engine" in config_json_schema()["$defs"]["SectionModel"]["properties"]


@pytest.mark.parametrize(
    "stale, suggestion",
    [("DisableFp8Gemm", "DisableFP8GEMM"), ("FakeQuantFp8", "FakeQuant"), ("logtensorstats", "LogTensorStats")],
)
def test_stale_upstream_feature_names_get_suggestions(stale, suggestion):
    err = load_error(
        {
            "s": {
                "enabled": True,
                "layers": {"layer_types": ["fc1"]},
                "transformer_engine": {stale: {"enabled": True, "gemms": ["fprop"]}},
            }
        }
    )
    assert err.key_path == ("s", "transformer_engine", stale) and err.suggestion == suggestion
    expected = f"Could not find feature '{stale}' in namespace 'transformer_engine'; did you mean '{suggestion}'?"
    assert expected in str(err)
