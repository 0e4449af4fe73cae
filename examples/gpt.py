"""A small nanoGPT-style language model written with plain `torch.nn`, and its conversion to tedebug layers.

`GPT` is token + position embeddings, `n_layer` pre-LayerNorm transformer blocks (causal self-attention with a
fused `qkv` Linear and an output `proj` Linear; an MLP `fc1` -> GELU -> `fc2`), a final LayerNorm and an `lm_head`
Linear.  Nothing in it knows about tedebug: `convert_to_tedebug(model)` swaps the Linear layers inside the blocks
for `tedebug.nn.Linear` (their debug names are the module paths, e.g. ``blocks.0.attn.qkv``) and leaves `lm_head`
in high precision, as is usual for low-precision training (the vocabulary projection is small and sensitive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZED_LAYERS = ("qkv", "proj", "fc1", "fc2")  # the Linear layers of a block, by attribute name


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int  # longest input sequence
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.fc2 = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, ignore_index: int = -100
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits ``[B, T, vocab]`` and, when `targets` is given, the mean cross-entropy over the targets that
        are not `ignore_index`."""
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(f"GPT: sequence length {time} exceeds block_size {self.config.block_size}")
        positions = torch.arange(time, device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
        return logits, loss


def is_block_linear(fqn: str, module: nn.Module) -> bool:
    """`convert_model` filter: the Linear layers inside the transformer blocks (not `lm_head`)."""
    return fqn.startswith("blocks.") and fqn.rpartition(".")[2] in QUANTIZED_LAYERS


def convert_to_tedebug(model: GPT) -> GPT:
    """Swap the block Linear layers of `model` for `tedebug.nn.Linear` in place (lm_head stays `nn.Linear`)."""
    import tedebug

    return tedebug.convert_model(model, filter_fn=is_block_linear)
