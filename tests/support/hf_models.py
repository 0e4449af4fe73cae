"""Tiny transformers models built from configs (no downloads) for the tests: one decoder layer of width 32, two
query heads sharing one key/value head; transformers is imported by each builder (the tests that use them skip
without it)."""

from __future__ import annotations

import torch


def _transformers():
    import transformers

    return transformers


VOCAB = 64
#: what the tiny decoder configs share (one layer of width 32, two query heads sharing one key/value head)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def llama():
    cfg = _transformers().LlamaConfig(**DECODER, intermediate_size=64, max_position_embeddings=32)
    return _transformers().LlamaForCausalLM(cfg)


def gpt2():
    cfg = _transformers().GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _transformers().GPT2LMHeadModel(cfg)


def mixtral():
    cfg = _transformers().MixtralConfig(
        **DECODER, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32
    )
    return _transformers().MixtralForCausalLM(cfg)


def gpt_oss():
    """Experts stored transposed ([experts, in, out]), with biases and an interleaved gate/up layout."""
    cfg = _transformers().GptOssConfig(
        **DECODER,
        intermediate_size=32,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )
    model = _transformers().GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(std=0.1)  # zero-initialised: make the biases matter
    return model


def qwen3_moe():
    cfg = _transformers().Qwen3MoeConfig(
        **DECODER,
        intermediate_size=32,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    return _transformers().Qwen3MoeForCausalLM(cfg)


def phimoe():
    """Its router (`PhimoeTopKRouter`) subclasses torch.nn.Linear with a top-k forward of its own."""
    cfg = _transformers().PhimoeConfig(
        **DECODER, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32
    )
    return _transformers().PhimoeForCausalLM(cfg)
