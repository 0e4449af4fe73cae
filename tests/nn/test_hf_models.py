"""Real transformers models built from tiny configs on CPU (no downloads): Llama (nn.Linear), GPT-2 (Conv1D),
Mixtral (grouped 3-D experts), BERT (tied decoder); conversion coverage, state_dict keys, the unconverted-module
warning, statistics of every converted GEMM, and HF gradient checkpointing (reentrant and not) against the plain run."""

import warnings

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.nn.base import BaseLayer
from tedebug.nn.hf import Conv1DLinear
from tedebug.recipe import Float8CurrentScaling

from support.features import RecordingSink, section
from support.hf_models import VOCAB, gpt2, gpt_oss, llama, mixtral, qwen3_moe

transformers = pytest.importorskip("transformers")  # in the test extra; skipped only in a bare environment


def build(factory):
    torch.manual_seed(0)
    return factory()


def tokens(seed=1):
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def converted(model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tedebug.convert_model(model, **kw)
    messages = [str(w.message) for w in caught if "convert_model" in str(w.message)]
    layers = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, BaseLayer)}
    return layers, messages


@pytest.mark.parametrize("factory", [llama, gpt2, mixtral, gpt_oss, qwen3_moe])
def test_conversion_keeps_outputs_and_state_dict_keys(factory):
    model = build(factory).eval()
    ids = tokens()
    keys = {k: v.shape for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(ids).logits
    layers, messages = converted(model)
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # outside autocast: high precision
    assert "lm_head" not in layers and not isinstance(model.lm_head, BaseLayer)
    if factory is gpt2:
        assert set(layers.values()) == {"Conv1DLinear"} and len(layers) == 4
        assert model.transformer.h[0].attn.c_attn.weight.shape == (32, 96)  # [in, out] kept
        assert messages == []
    if factory is llama:
        assert len(layers) == 7 and set(layers.values()) == {"Linear"} and messages == []
    if factory in (mixtral, gpt_oss, qwen3_moe):
        router = {mixtral: "MixtralTopKRouter", gpt_oss: "GptOssTopKRouter", qwen3_moe: "Qwen3MoeTopKRouter"}[factory]
        assert layers["model.layers.0.mlp.experts"] == "Tedebug" + router.replace("TopKRouter", "Experts")
        assert messages == [
            "tedebug.convert_model: these modules hold weights but are not converted, so their GEMMs "
            f"run in high precision and are not debugged: {router} x1 (128 weight parameters)"
        ]


def test_conv1d_linear_gradients_equal_transformers_conv1d():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(24, 16)
    torch.nn.init.normal_(conv.bias)
    x = torch.randn(3, 5, 16, requires_grad=True)
    conv(x).square().sum().backward()
    ref = (x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad.clone())
    x.grad = conv.weight.grad = conv.bias.grad = None
    layer = Conv1DLinear.from_conv1d(conv, "c", None)
    layer(x).square().sum().backward()
    for got, want in zip((x.grad, layer.weight.grad, layer.bias.grad), ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "recipe", ["DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "Float8BlockScaling"]
)
def test_conv1d_linear_equals_a_linear_with_the_transposed_weight_under_every_recipe(recipe):
    from tedebug import recipe as recipes
    from tedebug.nn import Linear

    torch.manual_seed(0)
    layer = Conv1DLinear(64, 32)
    ref = Linear(32, 64)
    ref.weight.data.copy_(layer.weight.data.t())
    ref.bias.data.copy_(layer.bias.data)
    x = torch.randn(2, 16, 32)
    with tedebug.autocast(recipe=getattr(recipes, recipe)()):
        assert torch.equal(layer(x), ref(x))


def test_tied_decoder_and_lm_head_switch():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = transformers.BertForMaskedLM(cfg)
    layers, _ = converted(model)
    assert "cls.predictions.decoder" not in layers and "cls.predictions.transform.dense" in layers
    layers, _ = converted(build(llama), convert_lm_head=True)
    assert layers["lm_head"] == "Linear"


def run(factory, tmp_path, *, checkpointing=None, steps=2, config=None):
    model = build(factory)
    tedebug.convert_model(model, recipe=Float8CurrentScaling())
    model.train()
    if checkpointing == "deprecated_default":
        model.gradient_checkpointing_enable()  # the pre-v5.x spelling (deprecated, same machinery)
    elif checkpointing is not None:
        kwargs = {"use_reentrant": checkpointing}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = RecordingSink()
    losses = []
    debug_api.initialize(
        config
        or section(
            {
                "LogTensorStats": {
                    "enabled": True,
                    "stats": ["l1_norm", "max"],
                    "tensors": ["activation", "weight", "gradient"],
                }
            }
        ),
        statistics_logger=sink,
        log_dir=str(tmp_path / str(checkpointing)),
    )
    try:
        for step in range(steps):
            ids = tokens(step)
            with tedebug.autocast():
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            debug_api.step()
    finally:
        debug_api.end_debug()
    return torch.stack(losses), sink.values()


@pytest.mark.filterwarnings("ignore:tedebug.convert_model")
@pytest.mark.parametrize(
    "factory, use_reentrant",
    [(llama, True), (llama, False), (llama, "deprecated_default"), (gpt2, True), (mixtral, False)],
    ids=[
        "llama-reentrant",
        "llama-non_reentrant",
        "llama-deprecated_default",
        "gpt2-reentrant",
        "mixtral-non_reentrant",
    ],
)
def test_hf_gradient_checkpointing_equals_the_plain_run(tmp_path, factory, use_reentrant):
    ref_losses, ref_stats = run(factory, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, stats = run(factory, tmp_path, checkpointing=use_reentrant)
    assert torch.equal(losses, ref_losses)
    assert stats == ref_stats
    if factory is llama:
        assert len(ref_stats) == 2 * 7 * 3 * 2  # steps x GEMMs x tensors x stats: every GEMM logged once


@pytest.mark.filterwarnings("ignore:tedebug.convert_model")
@pytest.mark.parametrize("factory", [llama, gpt2, mixtral], ids=["llama", "gpt2", "mixtral"])
def test_hf_checkpointing_in_high_precision_without_a_session(factory):
    """transformers' default checkpointing (non-reentrant) of a converted model in a bf16-style run: no recipe, no
    session.  Before, the recompute ran tedebug's autograd function where the forward had run torch's linear, and
    torch's checkpoint refused it (CheckpointError: recomputed values have different metadata)."""

    def losses(checkpointing: bool):
        model = build(factory)
        tedebug.convert_model(model)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        for step in range(2):
            ids = tokens(step)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach())
        return torch.stack(out)

    plain = losses(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (transformers' note on use_cache)
        assert torch.equal(losses(True), plain)


@pytest.mark.filterwarnings("ignore:tedebug.convert_model")
def test_moe_experts_log_each_expert_gemm(tmp_path):
    """Each expert's GEMMs are logged as `<experts>.<parameter>.gemm_<e>`; the activation of gate_up_proj.gemm_e is
    exactly the rows of the experts' input routed to expert e."""
    config = section(
        {"LogTensorStats": {"enabled": True, "stats": ["l1_norm"], "tensors": ["activation"]}},
        layer_name_regex_pattern="experts",
    )
    model = build(mixtral)
    tedebug.convert_model(model, recipe=Float8CurrentScaling())
    seen = []
    model.model.layers[0].mlp.experts.register_forward_pre_hook(
        lambda module, args: seen.append((args[0].detach().clone(), args[1].clone()))
    )
    sink = RecordingSink()
    debug_api.initialize(config, statistics_logger=sink, log_dir=str(tmp_path))
    try:
        ids = tokens()
        with tedebug.autocast():
            model(ids, labels=ids).loss.backward()
        debug_api.step()
    finally:
        debug_api.end_debug()
    stats = sink.values()
    ((hidden, top_k_index),) = seen
    prefix = "model.layers.0.mlp.experts"
    expected = {}
    for e in range(4):
        rows = hidden[(top_k_index == e).any(dim=-1)]
        if rows.shape[0]:
            expected[(f"{prefix}.gate_up_proj.gemm_{e}_activation_l1_norm", 0)] = rows.double().abs().sum().item()
    got = {k: v for k, v in stats.items() if ".gate_up_proj." in k[0]}
    assert got.keys() == expected.keys() and len(got) >= 2
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9)
    assert {k[0].replace("gate_up_proj", "down_proj") for k in got} == {k[0] for k in stats if ".down_proj." in k[0]}


def test_hf_whatif_example_runs_a_moe_model_in_high_precision(tmp_path, capsys):
    import os
    import runpy

    script = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "hf_whatif.py"
    )
    example = runpy.run_path(script)
    result = example["main"](["--model", "mixtral", "--steps", "1", "--log-dir", str(tmp_path)])
    layers = {layer for layer, _, _ in result["mxfp8_mse"] + result["nvfp4_mse"]}
    assert result["mxfp8_mse"] and result["nvfp4_mse"]
    assert all(value > 0 for _, _, value in result["mxfp8_mse"] + result["nvfp4_mse"])
    assert any(".experts." in layer for layer in layers) or len(layers) >= 1
    assert "Worst layers by mxfp8_mse:" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:tedebug.convert_model")
def test_vit_with_the_shipped_quantization_error_config_skips_what_mxfp8_cannot_take(tmp_path):
    """ViT's 10-row activations cannot be MXFP8-quantized: the what-if statistics of those tensors are skipped with
    one warning per layer and tensor, everything else is logged and training goes on."""
    import os

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=8,
        patch_size=4,
        num_labels=3,
    )
    vit = transformers.ViTForImageClassification(cfg)
    tedebug.convert_model(vit)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sink = RecordingSink()
    debug_api.initialize(
        os.path.join(repo, "configs", "quantization_error.yaml"), statistics_logger=sink, log_dir=str(tmp_path)
    )
    try:
        with tedebug.autocast(recipe=Float8CurrentScaling()):
            out = vit(pixel_values=torch.randn(2, 3, 8, 8), labels=torch.tensor([0, 1]))
        out.loss.backward()
        debug_api.step()
    finally:
        debug_api.end_debug()
    names = {name for name, _ in sink.values()}
    layer = next(n for n, m in vit.named_modules() if n.endswith("attention.q_proj"))
    assert f"{layer}_activation_mse" in names and f"{layer}_activation_underflows%" in names
    assert f"{layer}_activation_mxfp8_mse" not in names
    assert f"{layer}_activation_fp8_block_scaling_mse" in names  # block scaling pads: it takes the shape
    log = open(os.path.join(str(tmp_path), "nvdlfw_inspect_logs", "nvdlfw_inspect_globalrank-0.log")).read()
    line = (
        f"LAYER={layer}: Feature=LogFp8TensorStats: skipping ['mxfp8_underflows%', 'mxfp8_mse'] of tensor "
        f"activation: the what-if mxfp8 quantization of shape (10, 32) failed"
    )
    assert log.count(line) == 1


def test_save_pretrained_keeps_the_delayed_scaling_state(tmp_path):
    """transformers' save_pretrained writes safetensors, which hold tensors only: after delayed-scaling steps it
    saves the layers' state (before, it raised on the state's dict), and a converted model that loads the file
    continues exactly as the saved one."""
    from safetensors.torch import load_file

    from tedebug.recipe import DelayedScaling

    recipe = DelayedScaling(amax_history_len=4)

    def step(model):
        with tedebug.autocast(enabled=True, recipe=recipe):
            logits = model(tokens()).logits
        logits.float().pow(2).mean().backward()
        return logits.detach()

    model = build(llama)
    tedebug.convert_model(model)
    for _ in range(2):
        step(model)
    model.save_pretrained(tmp_path)
    resumed = build(llama)
    tedebug.convert_model(resumed)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert any(".tedebug_fp8_state." in key for key in saved)
    resumed.load_state_dict(saved, strict=False)  # (save_pretrained leaves out the tied lm_head weight)
    assert torch.equal(step(resumed), step(model))


def test_a_router_that_subclasses_linear_is_left_as_it_is():
    """PhiMoE's router is a torch.nn.Linear subclass whose forward picks the top experts.  Before, convert_model
    converted it like a Linear, and the model's forward then failed (the router returned logits only); now it is
    left as it is and named, the experts and projections are converted, and the logits are the model's."""
    from support.hf_models import phimoe

    model = build(phimoe).eval()
    with torch.no_grad():
        expected = model(tokens()).logits
    layers, messages = converted(model)
    assert any("PhimoeTopKRouter: torch.nn.Linear layers with a forward or parts" in m for m in messages)
    assert "model.layers.0.self_attn.q_proj" in layers and any(".experts" in name for name in layers)
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, expected)
