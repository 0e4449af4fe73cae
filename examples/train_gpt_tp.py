"""Tensor- (and data-) parallel training of a small GPT with tedebug layers, under a debug config.

    torchrun --nproc-per-node 2 examples/train_gpt_tp.py --tp 2 [--sequence-parallel] [--steps N]
    torchrun --nproc-per-node 4 examples/train_gpt_tp.py --tp 2            # DP=2 x TP=2
    python examples/train_gpt_tp.py                                         # one process: TP=1

The model is Megatron-style, built from `tedebug.nn` layers with TransformerEngine's TP arguments: per block a
`LayerNormLinear` q/k/v projection (column-parallel: each rank computes n_head / tp heads), a `Linear` output
projection (row-parallel) and a `LayerNormMLP` with ``set_parallel_mode=True``; embeddings, the final LayerNorm and
the vocabulary projection are replicated.  Activations are ``[seq, batch, hidden]``.  Every rank initialises the
full (TP=1) parameters from one seed and keeps its shards (`tedebug.nn.parallel.shard_stacked`), so any TP size
trains the same model.  Sequences are padded to a multiple of 8 (padding is ignored by the loss).  With
``--sequence-parallel`` (TP sizes dividing 8) the residual stream is split along the sequence; the logits and the
loss are computed on each rank's part of the sequence.  Ranks are grouped as ``rank = dp_rank * tp + tp_rank``;
gradients are averaged over the data-parallel group (and those of ``sequence_parallel`` parameters first summed over
the TP group).  The backend is NCCL on GPUs (one per process), gloo on CPU.

Debugging: `debug_api.initialize` before the model is built, ``debug_api.step()`` after every iteration.  Statistics
are reduced over the world (the default reduction group): every rank logs the values of the whole global batch and
of the full weights (weights over their TP group), each into its own files under ``<log-dir>``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tedebug  # noqa: E402
from tedebug import debug_api  # noqa: E402
from tedebug.nn import LayerNormLinear, LayerNormMLP, Linear  # noqa: E402
from tedebug.nn import parallel  # noqa: E402
from tedebug.recipe import Float8CurrentScaling  # noqa: E402

from data import IGNORE_INDEX, VOCAB, make_sorting_dataset  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Tensor-parallel GPT training with tedebug (run under torchrun).")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size)")
    p.add_argument("--sequence-parallel", action="store_true", help="split the residual stream along the sequence")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument(
        "--recipe",
        choices=["current", "none"],
        default="current",
        help="FP8 current scaling (default) or high precision",
    )
    p.add_argument(
        "--config", default=os.path.join(REPO_ROOT, "configs", "demo.yaml"), help="debug config ('' for none)"
    )
    p.add_argument("--log-dir", default="runs/gpt_tp")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (split over the data-parallel ranks)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


class Block(torch.nn.Module):
    def __init__(self, index: int, n_embd: int, n_head: int, tp_group, sp: bool, device) -> None:
        super().__init__()
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        if n_head % tp:
            raise ValueError(f"n_head ({n_head}) must be divisible by the TP size ({tp})")
        self.local_heads = n_head // tp
        kw = dict(tp_group=tp_group, sequence_parallel=sp and tp_group is not None, device=device)
        self.qkv = LayerNormLinear(n_embd, 3 * n_embd, name=f"blocks.{index}.attn.qkv", parallel_mode="column", **kw)
        self.proj = Linear(n_embd, n_embd, name=f"blocks.{index}.attn.proj", parallel_mode="row", **kw)
        self.mlp = LayerNormMLP(n_embd, 4 * n_embd, name=f"blocks.{index}.mlp", set_parallel_mode=True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [T, B, 3 * local width] (the whole sequence, also under sequence parallelism)
        time, batch, _ = qkv.shape
        q, k, v = (t.reshape(time, batch, self.local_heads, -1).permute(1, 2, 0, 3) for t in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.permute(2, 0, 1, 3).reshape(time, batch, -1))
        return x + self.mlp(x)


class ParallelGPT(torch.nn.Module):
    def __init__(self, vocab: int, block_size: int, args: argparse.Namespace, tp_group, device) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.sp = bool(args.sequence_parallel and tp_group is not None)
        self.wte = torch.nn.Embedding(vocab, args.n_embd, device=device)
        self.wpe = torch.nn.Embedding(block_size, args.n_embd, device=device)
        self.blocks = torch.nn.ModuleList(
            Block(i, args.n_embd, args.n_head, tp_group, self.sp, device) for i in range(args.n_layer)
        )
        self.ln_f = torch.nn.LayerNorm(args.n_embd, device=device)
        self.lm_head = torch.nn.Linear(args.n_embd, vocab, bias=False, device=device)
        if self.sp:
            parallel.mark_sequence_parallel(*self.ln_f.parameters(), self.lm_head.weight)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the targets of the whole (local data-parallel) batch; idx, targets ``[B, T]``."""
        # pad the sequence to a multiple of 8 (ignored targets; causal attention leaves earlier positions unchanged):
        # it splits evenly under sequence parallelism and keeps token counts divisible by 32 (MXFP8 what-if stats)
        pad = -idx.shape[1] % 8
        idx, targets = F.pad(idx, (0, pad)), F.pad(targets, (0, pad), value=IGNORE_INDEX)
        time = idx.shape[1]
        x = (self.wte(idx) + self.wpe(torch.arange(time, device=idx.device))).transpose(0, 1)  # [T, B, C]
        targets = targets.transpose(0, 1)
        count = (targets != IGNORE_INDEX).sum().clamp(min=1)
        if self.sp:
            x = parallel.scatter_to_sp(x, self.tp_group)
            targets = targets.chunk(dist.get_world_size(self.tp_group), dim=0)[dist.get_rank(self.tp_group)]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return loss / count  # sequence parallel: this rank's part of the loss (the parts add up)


def load_full_parameters(model: ParallelGPT, reference: dict, tp: parallel.TensorParallel) -> None:
    """Copy this rank's shards of the full (TP=1) parameters `reference` into `model`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = reference[name]
            if name.endswith("qkv.weight") or name.endswith("qkv.bias"):
                full = parallel.shard_stacked(full, tp, 3)
            elif name.endswith("mlp.fc1_weight") or name.endswith("mlp.fc1_bias"):
                full = parallel.shard_stacked(full, tp, 1)
            elif name.endswith("proj.weight") or name.endswith("mlp.fc2_weight"):
                full = parallel.shard(full, tp, 1)
            p.copy_(full)


def setup():
    """(rank, world, device): torch.distributed from torchrun's environment (NCCL on GPUs, else gloo), or the
    process group the caller initialised."""
    if dist.is_available() and dist.is_initialized():
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        return dist.get_rank(), dist.get_world_size(), device
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return rank, world, torch.device("cuda", local)
    dist.init_process_group("gloo")
    return rank, world, torch.device("cpu")


def groups(rank: int, world: int, tp: int):
    """(tp_group, dp_group) of this rank; every rank creates every group (torch.distributed requires it)."""
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the world size {world}")
    if world == 1:
        return None, None
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(world // tp)]
    dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    return (tp_groups[rank // tp] if tp > 1 else None), (dp_groups[rank % tp] if world // tp > 1 else None)


def train(args: argparse.Namespace) -> List[float]:
    """Train and return the global mean loss of every iteration (the same on every rank)."""
    rank, world, device = setup()
    tp = args.tp or world
    tp_group, dp_group = groups(rank, world, tp)
    dp_size, dp_rank = world // tp, rank // tp
    if args.batch_size % dp_size:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by the data-parallel size {dp_size}")
    if args.config:
        debug_api.initialize(args.config, log_dir=args.log_dir)
    data = make_sorting_dataset(seed=args.seed)
    torch.manual_seed(args.seed)
    block_size = -(-data.seq_len // 8) * 8  # the padded sequence (see ParallelGPT.forward)
    reference = ParallelGPT(len(VOCAB), block_size, args, None, "cpu").state_dict()
    model = ParallelGPT(len(VOCAB), block_size, args, tp_group, device)
    layout = parallel.TensorParallel.resolve("example", tp_group=tp_group, parallel_mode="column")
    load_full_parameters(model, reference, layout)
    recipe = Float8CurrentScaling() if args.recipe == "current" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batches = data.batches(args.batch_size, seed=args.seed)
    losses = []
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        x, y = x.chunk(dp_size)[dp_rank].to(device), y.chunk(dp_size)[dp_rank].to(device)
        with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        reduce_gradients(model, tp_group, dp_group, dp_size)
        optimizer.step()
        if args.config:
            debug_api.step()
        losses.append(global_loss(loss, tp_group if model.sp else None, dp_group, dp_size))
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {float(losses[-1]):.4f}", flush=True)  # the only host reads in the loop
    if args.config:
        debug_api.end_debug()
    return [float(value) for value in losses]


def reduce_gradients(model: ParallelGPT, tp_group, dp_group, dp_size: int) -> None:
    for p in model.parameters():
        if p.grad is None:
            continue
        if tp_group is not None and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=tp_group)
        if dp_group is not None:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(dp_size)


def global_loss(loss: torch.Tensor, sp_group, dp_group, dp_size: int) -> torch.Tensor:
    """The loss of the global batch, on the device (reported only: read on the host every 10 steps)."""
    value = loss.detach().clone()
    if sp_group is not None:
        dist.all_reduce(value, group=sp_group)
    if dp_group is not None:
        dist.all_reduce(value, group=dp_group)
        value /= dp_size
    return value


def main(argv: Optional[Sequence[str]] = None) -> List[float]:
    args = parse_args(argv)
    try:
        losses = train(args)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if math.isfinite(losses[-1]) and int(os.environ.get("RANK", 0)) == 0:
        print(f"final loss {losses[-1]:.4f}; statistics under {args.log_dir}", flush=True)
    return losses


if __name__ == "__main__":
    main()
