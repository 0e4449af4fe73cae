"""`tedebug validate` / `plan` with real layer names (--layers-from RUN_DIR, --model MODULE:FACTORY) and
`tedebug schema` on a closed pipe."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.cli import align, main
from tedebug.layer_coverage import LayerSourceError, layer_of_metric, layers_from_model, layers_from_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "tests", "models", "named_models.py")

CONFIG = textwrap.dedent("""\
    attention:
      enabled: True
      layers:
        layer_types: [qkv, proj]
      transformer_engine:
        DisableQuantizationGEMM:
          enabled: True
          gemms: [wgrad]
    last_mlp:
      enabled: True
      layers:
        layer_name_regex_pattern: 'blocks\\.1\\.mlp\\.fc1$'
      transformer_engine:
        LogTensorStats:
          enabled: True
          stats: [max]
          tensors: [activation]
          freq: 5
    typo:
      enabled: True
      layers:
        layer_types: [fc3]
      transformer_engine:
        LogTensorStats:
          enabled: True
          stats: [max]
          tensors: [weight]
""")
DEMO_LAYERS = [f"blocks.{i}.{kind}" for i in range(2) for kind in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    return str(path)


def _logged_run(log_dir, names, **initialize_kwargs):
    """Two logged steps of tiny tedebug layers named `names` (statistics of every layer)."""
    debug_api.initialize(
        {
            "all": {
                "enabled": True,
                "layers": {"layer_types": ["all"]},
                "transformer_engine": {
                    "LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}
                },
            }
        },
        log_dir=str(log_dir),
        **initialize_kwargs,
    )
    try:
        layers = [tedebug.nn.Linear(4, 4, name=name) for name in names]
        for _ in range(2):
            x = torch.ones(2, 4)
            for layer in layers:
                x = layer(x)
            debug_api.step()
    finally:
        debug_api.end_debug()


def test_layer_of_metric():
    assert layer_of_metric("blocks.0.mlp.fc1_activation_underflows%") == "blocks.0.mlp.fc1"
    assert (
        layer_of_metric("model.layers.3.mlp.down_proj_gradient_fp8_block_scaling_mse_columnwise")
        == "model.layers.3.mlp.down_proj"
    )
    assert layer_of_metric("a_weight_b_gradient_max") == "a_weight_b"  # the rightmost tensor part
    assert layer_of_metric("loss") is None


def test_layers_from_run_reads_jsonl_then_text_log(tmp_path):
    _logged_run(tmp_path / "run", DEMO_LAYERS)
    layers, source = layers_from_run(str(tmp_path / "run"))
    assert layers == DEMO_LAYERS and "JSONL record" in source
    os.remove(tmp_path / "run" / "tedebug_statistics" / "metrics_globalrank-0.jsonl")
    layers, source = layers_from_run(str(tmp_path / "run"))
    assert layers == DEMO_LAYERS and "statistics text log" in source
    with pytest.raises(LayerSourceError, match="no statistics found"):
        layers_from_run(str(tmp_path))
    with pytest.raises(LayerSourceError, match="no such run directory"):
        layers_from_run(str(tmp_path / "missing"))


def test_validate_layers_from_reports_selection(tmp_path, config, capsys):
    _logged_run(tmp_path / "run", DEMO_LAYERS)
    assert main(["validate", config, "--layers-from", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    report = out[out.index("layers: 8 layer(s)") :].splitlines()
    assert report[1:7] == [
        "section 'attention' (line 1) selects 4 of 8 layer(s):",
        "  blocks.0.attn.qkv",
        "  blocks.0.attn.proj",
        "  blocks.1.attn.qkv",
        "  blocks.1.attn.proj",
        "section 'last_mlp' (line 9) selects 1 of 8 layer(s):",
    ]
    assert report[7] == "  blocks.1.mlp.fc1"
    assert report[8].startswith("warning: section 'typo' (line 19) selects no layer (layer_types=['fc3']")
    assert report[9:13] == [
        "3 layer(s) no section selects (they train without debug features):",
        "  blocks.0.mlp.fc1",
        "  blocks.0.mlp.fc2",
        "  blocks.1.mlp.fc2",
    ]
    assert report[13].startswith("OK: 3 enabled section(s)")
    with pytest.raises(SystemExit) as exc:
        main(["validate", config, "--layers-from", str(tmp_path / "run"), "--strict"])
    assert exc.value.code == 1


def test_validate_model_and_overlapping_sections(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(
        textwrap.dedent("""\
        attention:
          enabled: True
          layers: {layer_types: [self_attn]}
          transformer_engine:
            DisableQuantizationLayer: {enabled: True}
        queries:
          enabled: True
          layers: {layer_types: [q_proj]}
          transformer_engine:
            DisableQuantizationLayer: {enabled: True}
    """)
    )
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(path), "--model", f"{MODELS}:hf_llama"])
    assert exc.value.code == 1
    out = capsys.readouterr().out
    assert "layers: 14 tedebug layer(s) of" in out and "after tedebug.convert_model" in out
    assert "section 'attention' (line 1) selects 8 of 14 layer(s):" in out
    assert (
        "error: layer 'model.layers.0.self_attn.q_proj' is selected by 2 sections ('attention', 'queries'); "
        "training raises at its first hook call"
    ) in out
    assert "error: layer 'model.layers.1.self_attn.q_proj' is selected by 2 sections" in out
    assert "OK:" not in out


def test_model_file_with_a_dataclass_and_a_sibling_import(tmp_path):
    (tmp_path / "sizes.py").write_text("WIDTH = 4\n")
    (tmp_path / "net.py").write_text(
        "import dataclasses\n"
        "import torch\n"
        "from sizes import WIDTH\n"
        "@dataclasses.dataclass\n"
        "class Cfg:\n"
        "    n: int = 3\n"
        "def build():\n"
        "    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(Cfg().n)])\n"
    )
    assert layers_from_model(f"{tmp_path / 'net.py'}:build")[0] == ["0", "1", "2"]


def test_a_factory_may_import_its_siblings_when_called(tmp_path):
    (tmp_path / "late_sizes.py").write_text("WIDTH = 5\n")
    (tmp_path / "late_net.py").write_text(
        "import torch\n"
        "def build():\n"
        "    from late_sizes import WIDTH\n"
        "    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH))\n"
    )
    assert layers_from_model(f"{tmp_path / 'late_net.py'}:build")[0] == ["0"]
    assert str(tmp_path) not in sys.path


def test_layers_from_model_sources(tmp_path, monkeypatch):
    path_at_start = list(sys.path)
    layers, source = layers_from_model(f"{MODELS}:megatron_gpt")
    assert sys.path == path_at_start  # the model file's directory was on sys.path while the model was built only
    assert layers == [
        f"decoder.layers.{i}.{kind}"
        for i in range(2)
        for kind in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    ] + ["output_layer"]
    layers, source = layers_from_model(f"{MODELS}:demo_gpt")  # already converted: lm_head stays plain
    assert layers == DEMO_LAYERS and "the factory's own conversion" in source
    monkeypatch.chdir(ROOT)  # a dotted module importable from the current directory
    path_before = list(sys.path)
    assert layers_from_model("tests.models.named_models:megatron_gpt")[0][-1] == "output_layer"
    assert sys.path == path_before  # the current directory was on sys.path for that import only
    for spec, message in (
        (f"{MODELS}", "expected MODULE:FACTORY"),
        (f"{MODELS}:nope", "has no attribute 'nope'"),
        ("no_such_module_xyz:f", "importing 'no_such_module_xyz' failed: ModuleNotFoundError"),
        (f"{MODELS}:N_LAYERS", "is a int, expected a function"),
        (str(tmp_path / "m.py") + ":f", "no such file"),
    ):
        with pytest.raises(LayerSourceError, match=message):
            layers_from_model(spec)


def test_plan_with_layers_from_shows_selected_layers_aligned(tmp_path, config, capsys):
    long_name = "model.language_model.encoder.layers.11.self_attention.query_key_value"
    _logged_run(tmp_path / "run", [long_name, "blocks.1.mlp.fc1", "blocks.0.mlp.fc2"])
    main(["plan", config, "--layers-from", str(tmp_path / "run"), "--iteration", "5"])
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[1] == "layers: 3 layer(s) logged in " + str(tmp_path / "run") + " (JSONL record); 1 selected by "
        "the config"
    )
    assert lines[2] == (
        "not shown: 2 layer(s) no section selects (every GEMM as the recipe, no inspection): "
        f"{long_name}, blocks.0.mlp.fc2"
    )
    header, rule, *rows = lines[3:]
    assert header.split()[:2] == ["layer", "tensor"] and set(rule) == {"-"}
    activation = next(r for r in rows if r.split()[1] == "activation")
    assert activation.split() == [
        "blocks.1.mlp.fc1",
        "activation",
        "fprop:",
        "Quantize",
        "wgrad:",
        "Quantize",
        "yes",
        "10",
    ]  # freq 5: next at 10
    # a long name widens its column: every row's tensor column starts at the same offset
    main(["plan", config, "--layers", long_name, "blocks.1.mlp.fc1"])
    lines = capsys.readouterr().out.splitlines()[1:]
    starts = {line.index(line.split()[1], len(line.split()[0])) for line in lines[2:]}
    assert starts == {len(long_name) + 2} and lines[0].index("tensor") == len(long_name) + 2


def test_align():
    assert align([("a", "bbb", "c")], ("xx", "y", "z")) == ["xx  y    z", "----------", "a   bbb  c"]


def test_schema_stats_and_closed_pipe(capsys):
    assert main(["schema", "--stats"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "transformer_engine.LogNvfp4TensorStats: underflows%, mse"
    assert lines[-1].startswith("transformer_engine.LogTensorStats: min, max, mean, std, l1_norm, l2_norm, cur_amax,")
    # a reader that is already gone: every write fails with EPIPE
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tedebug.cli", "schema"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == ""
