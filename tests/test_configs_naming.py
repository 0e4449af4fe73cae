"""The shipped configs (configs/*.yaml) select the intended layers in models named like Hugging Face Llama,
Megatron-core GPT and the demo GPT (tests/models/named_models.py), checked with `tedebug.layer_coverage`."""

import glob
import os

import pytest

from tedebug.config import load_config
from tedebug.layer_coverage import coverage, layers_from_model
from tedebug.registry import build_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
MODELS = os.path.join(ROOT, "tests", "models", "named_models.py")
FACTORIES = ("hf_llama", "megatron_gpt", "demo_gpt")


@pytest.fixture(scope="module")
def layers():
    return {factory: layers_from_model(f"{MODELS}:{factory}")[0] for factory in FACTORIES}


def compiled(name):
    registry = build_registry()
    return load_config(
        os.path.join(ROOT, "configs", f"{name}.yaml"),
        feature_names=registry.feature_names(),
        feature_validators=registry.feature_validators(),
    )


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_section_selects_layers_of_every_naming(path, layers):
    registry = build_registry()
    config = load_config(path, feature_names=registry.feature_names(), feature_validators=registry.feature_validators())
    for factory in FACTORIES:
        result = coverage(config, layers[factory])
        assert result.empty_sections == [] and result.overlaps == {}, (factory, result)


def selection(name, model_layers):
    return {section: layers for section, layers in coverage(compiled(name), model_layers).by_section.items()}


def test_disable_gemm_selects_attention_and_block_1_mlp(layers):
    assert selection("disable_gemm", layers["hf_llama"]) == {
        "attention_wgrad_in_high_precision": [
            f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in ("q", "k", "v", "o")
        ],
        "block_1_mlp_in_high_precision": [f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up", "down")],
    }
    assert selection("disable_gemm", layers["megatron_gpt"]) == {
        "attention_wgrad_in_high_precision": [
            f"decoder.layers.{i}.self_attention.linear_{p}" for i in (0, 1) for p in ("qkv", "proj")
        ],
        "block_1_mlp_in_high_precision": ["decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc2"],
    }


def test_fake_quant_and_dump_select_the_named_projections(layers):
    assert selection("fake_quant_whatif", layers["hf_llama"]) == {
        "fc1_fake_quant": [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up")]
    }
    assert selection("fake_quant_whatif", layers["megatron_gpt"]) == {
        "fc1_fake_quant": ["decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc1"]
    }
    assert selection("dump_tensors", layers["hf_llama"]) == {
        "dump_first_block": ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"]
    }
    assert selection("dump_tensors", layers["megatron_gpt"]) == {
        "dump_first_block": ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc2"]
    }
    assert selection("dump_tensors", layers["demo_gpt"]) == {
        "dump_first_block": ["blocks.0.attn.qkv", "blocks.0.mlp.fc2"]
    }
