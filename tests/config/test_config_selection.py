"""Layer selection (TransformerEngine's selector keys; exact_layer_names selects only the listed names and a bare int
is a valid layer_numbers): LayerSelector directly, then sections resolved through load_config."""

import pathlib

import pytest

from tedebug.config import ConfigError, LayerSelector, load_config
from tedebug.config.selection import layer_number, parse_layer_numbers

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


def select(names, **spec):
    selector = LayerSelector(**spec)
    return [name for name in names if selector.matches(name)]


NAMES = [
    "decoder.1.self_attention.qkv",
    "decoder.1.mlp.fc1",
    "decoder.2.mlp.fc2",
    "decoder.3.self_attention.proj",
    "decoder.4.mlp.fc1",
    "decoder.11.mlp.fc2",
]


# ---- the cases of nvdlfw's test_layer_selection ------------------------------------------------------------


def test_layer_numbers_list():
    assert select(NAMES, layer_numbers=[1, 2, 3]) == NAMES[:4]


def test_layer_numbers_and_types():
    assert select(NAMES, layer_numbers=[1, 2, 3], layer_types=["mlp", "qkv"]) == [
        "decoder.1.self_attention.qkv",
        "decoder.1.mlp.fc1",
        "decoder.2.mlp.fc2",
    ]


def test_all_numbers_and_all_types():
    assert select(NAMES, layer_numbers=["all"], layer_types=["all"]) == NAMES
    assert select(NAMES, layer_numbers="ALL") == NAMES


def test_regex_is_unanchored_search():
    # '1\.' also matches the '1.' at the end of 'decoder.11.'
    assert select(NAMES, layer_name_regex_pattern=r"1\.") == [
        "decoder.1.self_attention.qkv",
        "decoder.1.mlp.fc1",
        "decoder.11.mlp.fc2",
    ]
    assert select(["x.fc12", "x.fc1"], layer_name_regex_pattern=r".*(fc1)") == ["x.fc12", "x.fc1"]


def test_regex_takes_priority_over_types_and_numbers():
    assert select(NAMES, layer_name_regex_pattern="proj", layer_types=["mlp"], layer_numbers=[1]) == [
        "decoder.3.self_attention.proj"
    ]


# ---- the other selector keys -------------------------------------------------------------------------------


def test_types_are_case_sensitive_substrings_or():
    assert select(NAMES, layer_types=["fc2", "qkv"]) == [
        "decoder.1.self_attention.qkv",
        "decoder.2.mlp.fc2",
        "decoder.11.mlp.fc2",
    ]
    assert select(["a.fc12", "a.FC1"], layer_types=["fc1"]) == ["a.fc12"]
    assert select(["a.b*c", "a.bxc"], layer_types=["b*c"]) == ["a.b*c"]  # escaped, not a regex


def test_types_and_numbers_are_anded():
    assert select(NAMES, layer_types=["fc1"], layer_numbers=[4]) == ["decoder.4.mlp.fc1"]
    assert select(NAMES, layer_types=["fc1"], layer_numbers=[2]) == []


def test_bare_int_layer_number():
    assert select(NAMES, layer_numbers=3) == ["decoder.3.self_attention.proj"]


def test_inclusive_ranges_mixed_with_ints():
    assert select(NAMES, layer_numbers=["2-4"]) == NAMES[2:5]
    assert select(NAMES, layer_numbers=[1, "3-3", "10-11"]) == [
        "decoder.1.self_attention.qkv",
        "decoder.1.mlp.fc1",
        "decoder.3.self_attention.proj",
        "decoder.11.mlp.fc2",
    ]
    assert parse_layer_numbers(["2-4", 7]) == frozenset({2, 3, 4, 7})
    assert parse_layer_numbers([1, "all"]) is None


def test_fc_digits_are_not_layer_numbers():
    assert layer_number("decoder.7.mlp.fc1") == 7
    assert layer_number("decoder.7.mlp.fc2") == 7
    assert layer_number("layers.12.fc1") == 12
    assert layer_number("model.fc1") is None
    # the digit-run regex (?<!fc)\d+ leaves the trailing '2' of 'fc12' (reference behaviour)
    assert layer_number("model.fc12") == 2


def test_names_without_exactly_one_number_are_not_selected():
    names = ["model.fc1", "embedding", "decoder.1.expert.2", "decoder.1.mlp.fc1"]
    assert select(names, layer_numbers=[1, 2]) == ["decoder.1.mlp.fc1"]
    assert select(names, layer_numbers=[1], layer_types=["fc1"]) == ["decoder.1.mlp.fc1"]
    # "all" does not filter by number, so it also selects names without a number
    assert select(names, layer_numbers="all", layer_types=["fc1"]) == ["model.fc1", "decoder.1.mlp.fc1"]


def test_exact_layer_names_select_only_the_listed_names():
    names = ["decoder.1.mlp.fc1", "decoder.1.mlp.fc2", "decoder.1.mlp.fc1.extra"]
    assert select(names, exact_layer_names=["decoder.1.mlp.fc1"]) == ["decoder.1.mlp.fc1"]
    # other keys are ignored when exact names are given
    assert select(names, exact_layer_names=["decoder.1.mlp.fc2"], layer_name_regex_pattern="fc1") == [
        "decoder.1.mlp.fc2"
    ]


def test_selector_needs_a_key():
    with pytest.raises(ValueError, match="Atleast one|at least one"):
        LayerSelector()


def test_describe():
    assert LayerSelector(layer_types=["mlp"], layer_numbers=["1-2"]).describe() == (
        "layer_types=['mlp'] AND layer_numbers=[1, 2]"
    )


# ---- sections through load_config --------------------------------------------------------------------------

MULTI_DICT = {
    "attention_stats": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*(qkv|proj)"},
        "LogTensorStats": {"enabled": True, "stats": ["mean"], "tensors": ["activation", "weight"]},
    },
    "mlp_stats": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*mlp.*"},
        "LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["gradient"]},
    },
    "fc2_stats": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*fc2"},
        "LogTensorStats": {"enabled": True, "stats": ["min"], "tensors": ["output"]},
    },
}


@pytest.mark.parametrize(
    "source", [CONFIGS / "multiple_configs.yaml", str(CONFIGS / "multiple_configs.yaml"), MULTI_DICT]
)
def test_multiple_sections(source):
    config = load_config(source, feature_names=FEATURE_NAMES)
    assert list(config.sections) == ["attention_stats", "mlp_stats", "fc2_stats"]
    qkv = config.layer_config("decoder.1.self_attention.qkv")
    assert qkv == {
        "base": {"LogTensorStats": {"enabled": True, "stats": ["mean"], "tensors": ["activation", "weight"]}}
    }
    assert config.layer_config("decoder.1.mlp.fc1")["base"]["LogTensorStats"]["tensors"] == ["gradient"]
    assert config.layer_config("decoder.1.embedding") == {}
    assert config.selected_section("decoder.1.mlp.fc1") == "mlp_stats"
    assert config.selected_section("decoder.1.embedding") is None
    for _ in range(2):  # errors are not cached: every lookup raises
        with pytest.raises(ConfigError) as info:
            config.layer_config("decoder.1.mlp.fc2")
        message = str(info.value)
        assert "'mlp_stats'" in message and "'fc2_stats'" in message and "decoder.1.mlp.fc2" in message
        assert "Found multiple debug configs targeting the same layer(s)" in message
    assert config.source_label == ("<dict>" if isinstance(source, dict) else str(source))


def test_overlap_error_names_file_and_line():
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "multiple_configs.yaml", feature_names=FEATURE_NAMES).layer_config("x.mlp.fc2")
    lines = (CONFIGS / "multiple_configs.yaml").read_text().splitlines()
    assert info.value.line == lines.index("fc2_stats:") + 1
    assert str(info.value).startswith(f"{CONFIGS / 'multiple_configs.yaml'}:{info.value.line}: ")


def test_layer_config_is_cached_and_independent_of_the_source():
    source = {
        "s": {
            "enabled": True,
            "layers": {"layer_types": ["fc1"]},
            "transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": ["activation"]}},
        }
    }
    config = load_config(source, feature_names=FEATURE_NAMES)
    first = config.layer_config("a.fc1")
    assert config.layer_config("a.fc1") is first
    source["s"]["transformer_engine"]["LogTensorStats"]["tensors"].append("weight")
    assert first["transformer_engine"]["LogTensorStats"]["tensors"] == ["activation"]


def test_disabled_sections_do_not_select():
    config = load_config(CONFIGS / "stats_collection_test_config.yaml", feature_names=FEATURE_NAMES)
    assert list(config.sections) == ["stat_collection_test_1", "stat_collection_test_2", "stat_collection_test_4"]
    assert config.disabled_sections == ("stat_collection_test_3",)
    assert config.layer_config("decoder.2.mlp.fc1") == {}
    assert set(config.layer_config("decoder.3.mlp.fc1")) == {"base", "transformer_engine"}
    assert config.selected_section("decoder.7.mlp.fc2") == "stat_collection_test_2"
    assert config.selected_section("decoder.5.mlp.fc2") == "stat_collection_test_4"
