"""`tedebug validate` and `tedebug schema`, run in-process through `tedebug.cli.main`."""

import json
import os
import textwrap

import pytest

from tedebug.cli import SUBCOMMANDS, build_parser, main
from tedebug.config import config_json_schema
from tedebug.registry import build_registry

TESTS = os.path.dirname(os.path.dirname(__file__))
ROUTING = os.path.join(TESTS, "feature_dirs", "routing")
BROKEN = os.path.join(TESTS, "feature_dirs", "broken")
EXAMPLE = os.path.join(TESTS, "..", "examples", "custom_feature")

GOOD = """\
fc1_section:
  enabled: True
  layers:
    layer_name_regex_pattern: .*fc1
  transformer_engine:
    GemmSwitch:
      enabled: True
      gemms: [dgrad, wgrad]
off_section:
  enabled: False
"""

BAD = """\
s:
  enabled: True
  layers:
    layer_type: [fc1]
  transformer_engine:
    GemSwitch:
      enabled: True
      gemms: [dgrad]
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


def test_validate_good_config(tmp_path, capsys):
    path = write(tmp_path, "good.yaml", GOOD)
    assert main(["validate", path, "--feature-dirs", ROUTING]) == 0
    out = capsys.readouterr().out
    assert f"config: {path}\nsection 'fc1_section' (line 1)\n  layers: layer_name_regex_pattern='.*fc1'\n" in out
    assert "    GemmSwitch: enabled; gemms=['dgrad', 'wgrad']\n" in out
    assert "disabled sections: off_section\n" in out
    assert "OK: 1 enabled section(s)" in out and "transformer_engine.GemmSwitch" in out


def test_validate_bad_config(tmp_path, capsys):
    path = write(tmp_path, "bad.yaml", BAD)
    with pytest.raises(SystemExit) as info:
        main(["validate", path, "--feature-dirs", ROUTING])
    assert info.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{path}:4: section 's' -> layers -> layer_type: unknown key; did you mean 'layer_types'?" in captured.err
    assert (
        f"{path}:6: section 's' -> transformer_engine -> GemSwitch: Could not find feature 'GemSwitch'" in captured.err
    )
    assert "did you mean 'GemmSwitch'?" in captured.err


def test_validate_missing_file_and_broken_feature_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["validate", str(tmp_path / "missing.yaml")])
    assert info.value.code == 1 and "config file not found" in capsys.readouterr().err
    path = write(tmp_path, "good.yaml", GOOD)
    with pytest.raises(SystemExit):
        main(["validate", path, "--feature-dirs", ROUTING, BROKEN])
    assert os.path.join("broken", "bad_import.py") in capsys.readouterr().err


def test_validate_custom_feature_example(capsys):
    assert main(["validate", os.path.join(EXAMPLE, "config.yaml"), "--feature-dirs", EXAMPLE]) == 0
    assert (
        "PercentageGreaterThanThreshold: enabled; tensors=['activation', 'weight'], threshold=0.8, freq=2"
        in capsys.readouterr().out
    )


def test_schema(capsys):
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    statistics = printed.pop("x-tedebug-statistics")
    assert printed == config_json_schema(build_registry().feature_names())
    assert statistics["transformer_engine.LogNvfp4TensorStats"] == ["underflows%", "mse"]
    assert "fp8_block_scaling_mse_columnwise" in statistics["transformer_engine.LogFp8TensorStats"]
    assert main(["schema", "--feature-dirs", ROUTING]) == 0
    with_routing = json.loads(capsys.readouterr().out)
    te_block = with_routing["$defs"]["SectionModel"]["properties"]["transformer_engine"]
    assert "GemmSwitch" in te_block["properties"]


def test_subcommand_registry_and_usage_errors(capsys):
    assert [add.__name__ for add in SUBCOMMANDS][:3] == ["_add_validate", "_add_plan", "_add_schema"]
    assert {"validate", "plan", "schema"} <= set(build_parser()._subparsers._group_actions[0].choices)
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2  # argparse: a subcommand is required
