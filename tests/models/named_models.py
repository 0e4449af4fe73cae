"""Tiny models whose Linear layers are named like real ones, for `tedebug validate --model` and the shipped configs.

- `hf_llama()`: Hugging Face Llama/Mistral/Qwen naming (``model.layers.N.self_attn.{q,k,v,o}_proj``,
  ``model.layers.N.mlp.{gate,up,down}_proj``, ``lm_head``);
- `megatron_gpt()`: Megatron-core naming (``decoder.layers.N.self_attention.linear_qkv`` / ``linear_proj``,
  ``decoder.layers.N.mlp.linear_fc1`` / ``linear_fc2``, ``output_layer``);
- `demo_gpt()`: the demo's GPT, converted as the demo does (``blocks.N.attn.qkv`` / ``proj``, ``blocks.N.mlp.fc1`` /
  ``fc2``; ``lm_head`` stays a plain Linear).
"""

import os
import sys

from torch import nn

N_LAYERS = 2
WIDTH = 8


class _Namespace(nn.Module):
    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def _lin():
    return nn.Linear(WIDTH, WIDTH, bias=False)


def hf_llama() -> nn.Module:
    layers = nn.ModuleList(
        _Namespace(
            self_attn=_Namespace(q_proj=_lin(), k_proj=_lin(), v_proj=_lin(), o_proj=_lin()),
            mlp=_Namespace(gate_proj=_lin(), up_proj=_lin(), down_proj=_lin()),
        )
        for _ in range(N_LAYERS)
    )
    return _Namespace(model=_Namespace(layers=layers), lm_head=_lin())


def megatron_gpt() -> nn.Module:
    layers = nn.ModuleList(
        _Namespace(
            self_attention=_Namespace(linear_qkv=_lin(), linear_proj=_lin()),
            mlp=_Namespace(linear_fc1=_lin(), linear_fc2=_lin()),
        )
        for _ in range(N_LAYERS)
    )
    return _Namespace(decoder=_Namespace(layers=layers), output_layer=_lin())


def demo_gpt() -> nn.Module:
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    from gpt import GPT, GPTConfig, convert_to_tedebug

    return convert_to_tedebug(GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=N_LAYERS, n_embd=16)))
