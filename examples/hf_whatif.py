"""Train a tiny Hugging Face `transformers` model (random init from a config, nothing downloaded) in high precision
with activation checkpointing, and log what MXFP8 / NVFP4 / FP8 block scaling would do to its tensors.

    .venv/bin/python examples/hf_whatif.py --model llama --steps 20
    .venv/bin/python examples/hf_whatif.py --model mixtral --recipe mxfp8   # quantized training instead

`tedebug.convert_model` converts nn.Linear, GPT-2's Conv1D and the MoE experts (lm_head stays in high precision);
`activation_checkpointing_enable()` (`gradient_checkpointing_enable()`) works as is.  Prints the worst layers by
what-if MSE at the last logged step.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch

import tedebug
from tedebug import debug_api
from tedebug.recipe import Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 128
RECIPES = {"none": None, "current": Float8CurrentScaling(), "mxfp8": MXFP8BlockScaling(), "nvfp4": NVFP4BlockScaling()}


def tiny_model(kind: str) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=VOCAB, max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                **common,
            )
        )
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
            )
        )
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                hidden_size=64,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                **common,
            )
        )
    raise ValueError(f"unknown model {kind!r}")


def worst(log_dir: str, stat: str, top: int = 5):
    """(layer, tensor, value) of the `top` largest values of `stat` at the last iteration it was logged."""
    path = os.path.join(log_dir, "tedebug_statistics", "metrics_globalrank-0.jsonl")
    rows = [json.loads(line) for line in open(path)]
    rows = [r for r in rows if r["stat"] == stat]
    if not rows:
        return []
    last = max(r["iteration"] for r in rows)
    rows = sorted((r for r in rows if r["iteration"] == last), key=lambda r: -r["value"])
    return [(r["layer"], r["tensor"], r["value"]) for r in rows[:top]]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama", "gpt2", "mixtral"), default="llama")
    parser.add_argument("--recipe", choices=tuple(RECIPES), default="none", help="none: high precision")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default=os.path.join(HERE, "..", "configs", "what_if_bf16.yaml"))
    parser.add_argument("--log-dir", default="runs/hf_whatif")
    parser.add_argument("--no-checkpointing", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = tiny_model(args.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the list of modules left in high precision (e.g. MoE routers)
        tedebug.convert_model(model)
    model.train()
    if not args.no_checkpointing:
        model.activation_checkpointing_enable()  # transformers < 5.x: gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    debug_api.initialize(args.config, log_dir=args.log_dir)
    losses = []
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(args.steps):
            ids = torch.randint(0, VOCAB, (4, 32), generator=g)
            with tedebug.autocast(enabled=RECIPES[args.recipe] is not None, recipe=RECIPES[args.recipe]):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            debug_api.step()
    finally:
        debug_api.end_debug()
    print(f"{args.model}, recipe {args.recipe}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")
    result = {"losses": losses}
    for stat in ("mxfp8_mse", "nvfp4_mse"):
        rows = worst(args.log_dir, stat)
        result[stat] = rows
        print(f"Worst layers by {stat}:")
        for layer, tensor, value in rows:
            print(f"  {layer:45s} {tensor:10s} {value:.3e}")
    return result


if __name__ == "__main__":
    main()
