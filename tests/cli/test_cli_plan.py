"""`tedebug plan`: the plans it prints are the ones DebugQuantizer computes for the named layers."""

import textwrap

import pytest

from tedebug.cli import main

CONFIG = textwrap.dedent("""\
    fc1_rules:
      enabled: True
      layers:
        layer_types: [fc1]
      transformer_engine:
        DisableQuantizationGEMM:
          enabled: True
          gemms: [wgrad]
        LogTensorStats:
          enabled: True
          stats: [max]
          tensors: [activation]
          freq: 5
""")


def _rows(out):
    return {tuple(line.split()[:2]): line for line in out.splitlines() if line.startswith("mlp.")}


def test_plan_shows_disabled_gemm_inspection_and_next_iteration(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    main(["plan", str(path), "--layers", "mlp.fc1", "mlp.fc2", "--iteration", "3"])
    rows = _rows(capsys.readouterr().out)
    act = rows[("mlp.fc1", "activation")].split()
    # activation: fprop quantized, wgrad disabled -> high precision; inspection off at 3, next at 4 (wgrad
    # disabling answers iteration + 1), LogTensorStats would fire at 5.
    assert act[2:4] == ["fprop:", "Quantize"]
    assert act[4:7] == ["wgrad:", "High", "Precision"]
    assert act[7:] == ["no", "4"]
    weight = rows[("mlp.fc1", "weight")].split()
    assert weight[2:6] == ["fprop:", "Quantize", "dgrad:", "Quantize"] and weight[6:] == ["no", "never"]
    # fc2 is not selected: everything quantized, never in debug mode.
    for tensor in ("weight", "activation", "gradient"):
        assert rows[("mlp.fc2", tensor)].split()[-2:] == ["no", "never"]


def test_plan_at_a_logging_iteration(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    main(["plan", str(path), "--layers", "mlp.fc1", "--iteration", "5"])
    act = _rows(capsys.readouterr().out)[("mlp.fc1", "activation")].split()
    assert act[-2:] == ["yes", "6"]


def test_plan_reports_config_errors(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(CONFIG.replace("layer_types", "layer_type"))
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(path), "--layers", "mlp.fc1"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "layer_type" in err and "did you mean 'layer_types'" in err
