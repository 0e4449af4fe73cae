"""The example configs (configs/*.yaml) and the demo (examples/: data, GPT model, training script, summary)."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import math
import os
import re
import runpy
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
CONFIGS = os.path.join(REPO, "configs")
sys.path.insert(0, EXAMPLES)

import data  # noqa: E402
import gpt  # noqa: E402
import summary  # noqa: E402
import train_gpt  # noqa: E402

import tedebug  # noqa: E402
from tedebug import debug_api  # noqa: E402
from tedebug.cli import main as cli_main  # noqa: E402
from tedebug.config import load_config  # noqa: E402
from tedebug.registry import build_registry  # noqa: E402

DEMO_LAYERS = [f"blocks.{b}.{part}" for b in (0, 1) for part in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
GEMM_INPUTS = ("activation", "weight", "gradient")
EXAMPLE_CONFIGS = ("stats_all_layers", "quantization_error", "disable_gemm", "fake_quant_whatif", "dump_tensors")
STATS_LINE = re.compile(
    r"^\S+ \S+ - INFO - (?P<name>\S+) \t\t\t\t iteration=(?P<it>\d{6}) \t\t\t\t "
    r"value=(?P<value>\S+)$"
)


def config_path(name: str) -> str:
    return os.path.join(CONFIGS, f"{name}.yaml")


def compiled(name: str):
    registry = build_registry()
    return load_config(
        config_path(name), feature_names=registry.feature_names(), feature_validators=registry.feature_validators()
    )


def selected(name: str) -> dict:
    """demo layer -> sorted feature names that config `name` gives it (transformer_engine namespace)."""
    config = compiled(name)
    return {layer: sorted(config.layer_config(layer).get("transformer_engine", {})) for layer in DEMO_LAYERS}


# --------------------------------------------------------------------------------------------- configs
def test_every_promised_config_exists():
    present = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(CONFIGS, "*.yaml"))}
    assert set(EXAMPLE_CONFIGS) | {"demo", "demo_nvfp4"} <= present


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS, "*.yaml"))), ids=os.path.basename)
def test_config_passes_tedebug_validate(path, capsys):
    assert cli_main(["validate", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"config: {path}\n")
    assert "\nOK: " in out


def test_validate_rejects_a_broken_copy_of_a_config(tmp_path, capsys):
    """The validation above can fail: a typo in a statistic name of demo.yaml is reported."""
    with open(config_path("demo")) as handle:
        text = handle.read()
    broken = tmp_path / "broken.yaml"
    broken.write_text(text.replace("stats: [underflows%, mse, mxfp8_mse]", "stats: [underflow%, mse, mxfp8_mse]"))
    with pytest.raises(SystemExit) as exc:
        cli_main(["validate", str(broken)])
    assert exc.value.code == 1
    assert "underflow%" in capsys.readouterr().err


def test_demo_configs_select_every_demo_layer():
    assert selected("demo") == {layer: ["LogFp8TensorStats", "LogTensorStats"] for layer in DEMO_LAYERS}
    assert selected("demo_nvfp4") == {
        layer: ["LogFp8TensorStats", "LogNvfp4TensorStats", "LogTensorStats"] for layer in DEMO_LAYERS
    }
    assert selected("stats_all_layers") == {layer: ["LogTensorStats"] for layer in DEMO_LAYERS}
    assert selected("quantization_error") == {layer: ["LogFp8TensorStats"] for layer in DEMO_LAYERS}


def test_example_configs_select_the_documented_layers():
    assert selected("disable_gemm") == {
        "blocks.0.attn.qkv": ["DisableQuantizationGEMM"],
        "blocks.0.attn.proj": ["DisableQuantizationGEMM"],
        "blocks.0.mlp.fc1": [],
        "blocks.0.mlp.fc2": [],
        "blocks.1.attn.qkv": ["DisableQuantizationGEMM"],
        "blocks.1.attn.proj": ["DisableQuantizationGEMM"],
        "blocks.1.mlp.fc1": ["DisableQuantizationLayer"],
        "blocks.1.mlp.fc2": ["DisableQuantizationLayer"],
    }
    assert selected("fake_quant_whatif") == {
        layer: (["FakeQuant", "LogTensorStats"] if layer.endswith("fc1") else []) for layer in DEMO_LAYERS
    }
    assert selected("dump_tensors") == {
        layer: (["DumpTensors"] if layer in ("blocks.0.attn.qkv", "blocks.0.mlp.fc2") else []) for layer in DEMO_LAYERS
    }


def one_training_iteration(config: str, log_dir: str, recipe=None) -> gpt.GPT:
    """Iteration 0 of the demo model (seed 0) under `config` (no evaluation), then end the session; returns the
    model with its gradients."""
    debug_api.initialize(config, log_dir=log_dir)
    try:
        torch.manual_seed(0)
        dataset = data.make_sorting_dataset(n_train=64, n_val=1)
        model = gpt.convert_to_tedebug(gpt.GPT(gpt.GPTConfig(len(data.VOCAB), dataset.seq_len)))
        x, y = next(dataset.batches(64, seed=0))
        with tedebug.autocast(recipe=recipe or tedebug.recipe.Float8CurrentScaling()):
            _, loss = model(x, y)
        loss.backward()
        debug_api.step()
    finally:
        debug_api.end_debug()
    return model


def jsonl_rows(log_dir: str):
    return summary.read_rows(log_dir)


def test_stats_and_quantization_error_configs_log_every_layer_and_tensor(tmp_path):
    one_training_iteration(config_path("stats_all_layers"), str(tmp_path / "stats"))
    rows = jsonl_rows(str(tmp_path / "stats"))
    expected_stats = {"min", "max", "mean", "std", "l1_norm", "cur_amax", "dynamic_range", "nan_count"}
    assert {(r.layer, r.tensor, r.stat) for r in rows} == {
        (layer, tensor, stat) for layer in DEMO_LAYERS for tensor in GEMM_INPUTS for stat in expected_stats
    }
    assert {r.iteration for r in rows} == {0}

    one_training_iteration(config_path("quantization_error"), str(tmp_path / "qerr"))
    rows = jsonl_rows(str(tmp_path / "qerr"))
    expected_stats = {
        "underflows%",
        "mse",
        "scale_inv_min",
        "scale_inv_max",
        "mxfp8_underflows%",
        "mxfp8_mse",
        "fp8_block_scaling_mse",
    }
    assert {(r.layer, r.tensor, r.stat) for r in rows} == {
        (layer, tensor, stat) for layer in DEMO_LAYERS for tensor in GEMM_INPUTS for stat in expected_stats
    }


def test_dump_tensors_config_writes_the_selected_tensors(tmp_path):
    one_training_iteration(config_path("dump_tensors"), str(tmp_path))
    folder = tmp_path / "tensor_dumps" / "rank_0" / "iter_000000"
    assert sorted(os.listdir(folder)) == sorted(
        f"{layer}_{tensor}.pt" for layer in ("blocks_0_attn_qkv", "blocks_0_mlp_fc2") for tensor in GEMM_INPUTS
    )
    dumped = torch.load(folder / "blocks_0_attn_qkv_weight.pt", weights_only=False)
    assert set(dumped) == {"high_precision", "quantized"}
    assert dumped["high_precision"].shape == (192, 64)


@pytest.mark.filterwarnings("ignore:Could not find config file")
@pytest.mark.parametrize("name", ["disable_gemm", "fake_quant_whatif"])
def test_manipulation_configs_change_the_gradients(name, tmp_path):
    """Each manipulation changes some weight gradient relative to plain FP8 training (same weights, same batch)."""

    def weight_grads(config):
        model = one_training_iteration(config, str(tmp_path / (name if config else "plain")))
        return {layer: model.get_submodule(layer).weight.grad for layer in DEMO_LAYERS}

    plain = weight_grads("")
    changed = weight_grads(config_path(name))
    differs = {layer for layer in DEMO_LAYERS if not torch.equal(plain[layer], changed[layer])}
    expected_direct = {
        "disable_gemm": {
            layer_name for layer_name in DEMO_LAYERS if "attn" in layer_name or layer_name.startswith("blocks.1.mlp")
        },
        "fake_quant_whatif": {"blocks.0.mlp.fc1", "blocks.1.mlp.fc1"},
    }[name]
    assert expected_direct <= differs


# --------------------------------------------------------------------------------------------- data
def test_sorting_example_and_targets_by_hand():
    digits = data.encode("3191")
    sequence = data.sorting_example(digits)
    assert data.decode(sequence) == "3191=1139."
    x, y = data.inputs_and_targets(sequence[None], n_digits=4)
    assert data.decode(x[0]) == "3191=1139"
    ignore = data.IGNORE_INDEX
    assert y[0].tolist() == [ignore] * 4 + [data.STOI[c] for c in "1139."]


def test_encode_rejects_unknown_characters():
    with pytest.raises(ValueError, match=r"'x' at position 2"):
        data.encode("12x")


def test_dataset_is_deterministic_sorted_and_splits_are_disjoint():
    first = data.make_sorting_dataset(n_train=300, n_val=50, n_digits=3, seed=7)
    second = data.make_sorting_dataset(n_train=300, n_val=50, n_digits=3, seed=7)
    assert torch.equal(first.train_x, second.train_x) and torch.equal(first.val_y, second.val_y)
    assert first.seq_len == 2 * 3 + 1
    train = {data.decode(row[:3]) for row in first.train_x}
    val = {data.decode(row[:3]) for row in first.val_x}
    assert len(train) == 300 and len(val) == 50 and not train & val
    for x, y in zip(first.val_x, first.val_y):
        text = data.decode(x) + data.decode(y[-1:])
        assert text == "".join(text[:3]) + "=" + "".join(sorted(text[:3])) + "."


def test_dataset_refuses_more_strings_than_exist():
    with pytest.raises(ValueError, match="only 100 distinct strings"):
        data.make_sorting_dataset(n_train=90, n_val=20, n_digits=2)


def test_batches_cover_an_epoch_without_repeats():
    dataset = data.make_sorting_dataset(n_train=40, n_val=5, n_digits=3, seed=1)
    stream = dataset.batches(8, seed=3)
    epoch = torch.cat([next(stream)[0] for _ in range(5)])
    assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, dataset.train_x.tolist()))


# --------------------------------------------------------------------------------------------- model
def test_convert_swaps_the_block_linears_and_keeps_lm_head():
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=12, block_size=17))
    reference = gpt.GPT(gpt.GPTConfig(vocab_size=12, block_size=17))
    reference.load_state_dict(model.state_dict())
    gpt.convert_to_tedebug(model)
    converted = sorted(name for name, m in model.named_modules() if isinstance(m, tedebug.nn.Linear))
    assert converted == sorted(DEMO_LAYERS)
    assert type(model.lm_head) is torch.nn.Linear
    assert [model.get_submodule(n).name for n in converted] == converted
    # outside autocast the converted model computes exactly what the torch.nn model computes
    idx = torch.randint(0, 12, (3, 17), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 12, (3, 17), generator=torch.Generator().manual_seed(2))
    logits, loss = model(idx, targets)
    ref_logits, ref_loss = reference(idx, targets)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    assert torch.equal(loss, torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()))


def test_gpt_is_causal_and_checks_lengths():
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=12, block_size=8))
    idx = torch.randint(0, 12, (2, 8))
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 12
    assert torch.equal(model(idx)[0][:, :5], model(changed)[0][:, :5])
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        gpt.GPTConfig(vocab_size=12, block_size=8, n_embd=30, n_head=4)


# --------------------------------------------------------------------------------------------- summary
def write_jsonl(log_dir, records):
    folder = os.path.join(log_dir, "tedebug_statistics")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics_globalrank-0.jsonl"), "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def rec(iteration, layer, tensor, stat, value, nonfinite=None):
    record = {
        "iteration": iteration,
        "name": f"{layer}_{tensor}_{stat}",
        "layer": layer,
        "tensor": tensor,
        "stat": stat,
        "value": value,
    }
    if nonfinite:
        record["nonfinite"] = nonfinite
    return record


def test_summary_ranks_the_last_logged_iteration(tmp_path):
    write_jsonl(
        tmp_path,
        [
            rec(0, "a", "activation", "underflows%", 99.0),  # older iteration: ignored
            rec(10, "a", "activation", "underflows%", 1.5),
            rec(10, "b", "gradient", "underflows%", 7.25),
            rec(10, "c", "weight", "underflows%", None, "nan"),  # non-finite ranks first
            rec(10, "d", "weight", "underflows%", 0.0),
            rec(10, "a", "activation", "mse", 2e-6),
            rec(20, "a", "activation", "mse", 3e-6),
            rec(20, "b", "activation", "mse", 1e-6),
            {"iteration": 20, "name": "loss", "layer": None, "tensor": None, "stat": None, "value": 1.0},
        ],
    )
    rows = summary.read_rows(str(tmp_path))
    assert len(rows) == 8
    top = summary.worst(rows, "underflows%", k=3)
    assert [(r.iteration, r.layer, r.tensor) for r in top] == [
        (10, "c", "weight"),
        (10, "b", "gradient"),
        (10, "a", "activation"),
    ]
    assert math.isnan(top[0].value) and top[1].value == 7.25
    assert [(r.layer, r.value) for r in summary.worst(rows, "mse")] == [("a", 3e-6), ("b", 1e-6)]
    assert summary.worst(rows, "overflows%") == []
    text = summary.summarize(str(tmp_path), k=2)
    assert text.splitlines()[:5] == [
        "Worst layers by underflow% (nonzero values that quantize to zero), iteration 10:",
        "  layer  tensor    underflows%",
        "  ----------------------------",
        "  c      weight            nan",
        "  b      gradient       7.2500",
    ]
    assert "Worst layers by MSE (quantized vs high precision), iteration 20:" in text
    assert "  a      activation  3.000e-06" in text


def test_summary_uses_nvfp4_names_and_reports_non_finite_counts(tmp_path):
    write_jsonl(
        tmp_path,
        [
            rec(0, "x", "gradient", "nvfp4_underflows%", 12.0),
            rec(0, "x", "gradient", "nan_count", 0.0),
            rec(10, "x", "gradient", "nan_count", 3.0),
            rec(20, "x", "gradient", "nan_count", 5.0),
        ],
    )
    text = summary.summarize(str(tmp_path))
    assert "  x      gradient            12.0000" in text
    assert "Worst layers by MSE (quantized vs high precision): not logged" in text
    assert text.endswith(
        "Non-finite values (nan_count / inf_count):\n  x gradient: nan_count=3.0000 first at iteration 10"
    )


def test_summary_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="tedebug_statistics"):
        summary.summarize(str(tmp_path))
    write_jsonl(tmp_path, [])
    with open(os.path.join(tmp_path, "tedebug_statistics", "metrics_globalrank-0.jsonl"), "a") as handle:
        handle.write("{not json\n")
    with pytest.raises(ValueError, match=r"metrics_globalrank-0.jsonl:1: not a tedebug statistics record"):
        summary.read_rows(str(tmp_path))
    with pytest.raises(ValueError, match="k must be >= 1"):
        summary.worst([], "mse", k=0)


# --------------------------------------------------------------------------------------------- training script
def test_learning_rate_schedule_and_progress_bar():
    assert train_gpt.learning_rate(1, 100, 1.0, warmup=10) == pytest.approx(0.1)
    assert train_gpt.learning_rate(10, 100, 1.0, warmup=10) == pytest.approx(1.0)
    assert train_gpt.learning_rate(55, 100, 1.0, warmup=10) == pytest.approx(0.55)  # half-way: 0.1 + 0.9 / 2
    assert train_gpt.learning_rate(100, 100, 1.0, warmup=10) == pytest.approx(0.1)
    stream = io.StringIO()  # not a terminal: redrawn every tenth of the run, not every step
    bar = train_gpt.progress_bar(40, stream=stream)
    for step in range(1, 41):
        bar.set_postfix_str(f"loss {1.23456 / step:.4f}", refresh=False)
        bar.update(1)
    bar.close()
    text = stream.getvalue()
    assert 10 <= text.count("\r") <= 12 and text.endswith("\n") and text.count("\n") == 1
    assert re.search(r"100%\|#{30}\| step 40/40, loss 0\.0309 \[", text)
    assert "step 4/40, loss 0.3086 [" in text  # the first tenth


def test_parse_args_defaults_and_errors():
    args = train_gpt.parse_args([])
    assert (args.steps, args.recipe, args.log_dir, args.device) == (400, "current", "runs/demo", "auto")
    assert args.config == os.path.join(REPO, "configs", "demo.yaml")
    assert train_gpt.parse_args(["--recipe", "nvfp4"]).config == os.path.join(REPO, "configs", "demo_nvfp4.yaml")
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--recipe", "fp16"])


def run_demo(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train_gpt.main(argv)
    return result, out.getvalue()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("demo"))
    result, out = run_demo(["--steps", "12", "--log-dir", log_dir, "--device", "cpu"])
    return log_dir, result, out


def read_text_stats(log_dir):
    """{(name, iteration): value} from the stats text log (an independent sink from the JSONL record)."""
    [path] = glob.glob(os.path.join(log_dir, "nvdlfw_inspect_statistics_logs", "*.log"))
    values = {}
    with open(path) as handle:
        for line in handle:
            match = STATS_LINE.match(line.rstrip("\n"))
            assert match, f"unexpected stats line: {line!r}"
            values[(match["name"], int(match["it"]))] = match["value"]
    return values


def test_demo_writes_text_log_jsonl_and_tensorboard(demo_run):
    log_dir, result, out = demo_run
    stats = read_text_stats(log_dir)
    names = {
        f"{layer}_{tensor}_{stat}"
        for layer in DEMO_LAYERS
        for tensor in GEMM_INPUTS
        for stat in ("max", "std", "cur_amax", "dynamic_range", "nan_count", "underflows%", "mse", "mxfp8_mse")
    }
    assert set(stats) == {(name, it) for name in names for it in (0, 10)}
    rows = summary.read_rows(log_dir)
    assert {(f"{r.layer}_{r.tensor}_{r.stat}", r.iteration) for r in rows} == set(stats)
    for r in rows:  # the two sinks agree (the text log rounds to 4 decimals)
        assert f"{r.value:.4f}" == stats[(f"{r.layer}_{r.tensor}_{r.stat}", r.iteration)]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard_dir = os.path.join(log_dir, "tensorboard")
    assert glob.glob(os.path.join(tensorboard_dir, "events.out.tfevents.*"))
    events = EventAccumulator(tensorboard_dir, size_guidance={"scalars": 0})
    events.Reload()
    scalars = events.Scalars("blocks.1.mlp.fc2/gradient/underflows%")
    assert [s.step for s in scalars] == [0, 10]
    by_iteration = {
        r.iteration: r.value
        for r in rows
        if (r.layer, r.tensor, r.stat) == ("blocks.1.mlp.fc2", "gradient", "underflows%")
    }
    assert [s.value for s in scalars] == [pytest.approx(by_iteration[0]), pytest.approx(by_iteration[10])]
    losses = events.Scalars("train/loss")  # the script's own scalar, at the iteration of the statistics
    assert [s.step for s in losses] == list(range(12))
    assert [s.value for s in losses] == [pytest.approx(loss, rel=1e-6) for loss in result.losses]
    for iteration in (0, 10):  # cross-layer summary: the max over the 8 layers, as logged in the JSONL record
        values = [r.value for r in rows if (r.tensor, r.stat, r.iteration) == ("gradient", "underflows%", iteration)]
        assert len(values) == 8
        [summary_max] = [s.value for s in events.Scalars("summary/gradient/underflows%/max") if s.step == iteration]
        assert summary_max == pytest.approx(max(values), rel=1e-6)
    assert train_gpt.tensorboard_hint(tensorboard_dir) in out
    assert f"--logdir {tensorboard_dir} --samples_per_plugin scalars=100000\n" in out
    assert "http://localhost:6006/?smoothing=0&tagFilter=summary/.*/max#timeseries" in out


def test_demo_summary_matches_the_text_log(demo_run):
    log_dir, result, out = demo_run
    assert result.summary in out
    stats = read_text_stats(log_dir)
    for title, stat in (("Worst layers by underflow%", "underflows%"), ("Worst layers by MSE", "mse")):
        lines = out.split(f"{title} (")[1].split("\n\n")[0].splitlines()
        assert lines[0].endswith("iteration 10:")
        table = [line.split() for line in lines[3:]]
        assert len(table) == 5
        ranked = sorted(
            (
                (float(stats[(f"{layer}_{tensor}_{stat}", 10)]), layer, tensor)
                for layer in DEMO_LAYERS
                for tensor in GEMM_INPUTS
            ),
            reverse=True,
        )
        assert {(layer, tensor) for layer, tensor, _ in table} <= {(layer, t) for _, layer, t in ranked}
        printed = [float(value) for _, _, value in table]
        assert printed == sorted(printed, reverse=True)
        assert printed[0] == pytest.approx(ranked[0][0], abs=5e-5, rel=1e-3)
        for layer, tensor, value in table:
            assert float(value) == pytest.approx(float(stats[(f"{layer}_{tensor}_{stat}", 10)]), abs=5e-5, rel=1e-3)
    assert "Non-finite values (nan_count / inf_count): none" in out


def test_demo_loss_decreases(demo_run):
    _, result, out = demo_run
    assert len(result.losses) == 12
    assert result.losses[0] > math.log(10)  # an untrained model is worse than guessing a digit
    assert result.losses[-1] < result.losses[0] - 0.5
    assert result.val_loss < math.log(10) and result.val_loss_quantized < math.log(10)
    assert f"step 12/12, loss {result.losses[-1]:.4f}" in out


@pytest.mark.parametrize(
    "recipe,stat",
    [("mxfp8", "underflows%"), ("nvfp4", "nvfp4_underflows%"), ("block", "underflows%"), ("delayed", "underflows%")],
)
def test_demo_runs_with_every_recipe(recipe, stat, tmp_path):
    result, out = run_demo(["--steps", "1", "--log-dir", str(tmp_path), "--device", "cpu", "--recipe", recipe])
    rows = summary.worst(summary.read_rows(str(tmp_path)), stat, k=100)
    assert {(r.layer, r.tensor) for r in rows} == {(layer, tensor) for layer in DEMO_LAYERS for tensor in GEMM_INPUTS}
    assert f"  {stat}\n" in result.summary.split("\n\n")[0]


def test_demo_script_entry_point(tmp_path, monkeypatch, capsys):
    """`python examples/train_gpt.py ...` (what `make demo` runs), executed as __main__ in this process."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train_gpt.py", "--steps", "1", "--log-dir", "runs/demo", "--device", "cpu"])
    runpy.run_path(os.path.join(EXAMPLES, "train_gpt.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith(
        "Training a 2-layer GPT (103k parameters) to sort 8 digits on cpu, recipe current "
        "(Float8CurrentScaling), 1 steps\n"
    )
    assert "--logdir runs/demo/tensorboard --samples_per_plugin scalars=100000\n" in out
    assert "tedebug report runs/demo -o runs/demo/report.html\n" in out
    assert os.path.isfile(tmp_path / "runs" / "demo" / "tedebug_statistics" / "metrics_globalrank-0.jsonl")
