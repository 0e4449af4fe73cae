"""The tedebug demo (`make demo`): train a small GPT in low precision with a debug config, then summarise.

Steps: start a debug session (`debug_api.initialize`, before the model is built) with a TensorBoard sink next to
the default stats text log and the JSONL record; build the GPT of examples/gpt.py and convert its block Linear
layers to tedebug layers; train on the generated sorting task of examples/data.py inside
``tedebug.autocast(recipe=...)`` with AdamW, calling ``debug_api.step()`` after each iteration; close the session;
report the validation loss and sorting accuracy, a few sorted samples, the worst layers by underflow% and MSE
(examples/summary.py) and how to open TensorBoard.  Runs on CPU in about a minute; uses CUDA when present.

    python examples/train_gpt.py [--steps N] [--config configs/demo.yaml] [--recipe current] [--log-dir runs/demo]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules, also when imported

import tedebug  # noqa: E402
from tedebug import debug_api  # noqa: E402
from tedebug.recipe import (  # noqa: E402
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from tedebug.sinks.tensorboard import TensorBoardSink  # noqa: E402

from data import IGNORE_INDEX, VOCAB, SortingDataset, decode, make_sorting_dataset  # noqa: E402
from gpt import GPT, GPTConfig, convert_to_tedebug  # noqa: E402
from summary import summarize  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {
    "current": Float8CurrentScaling,
    "delayed": DelayedScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
    "block": Float8BlockScaling,
}
DEFAULT_CONFIGS = {"nvfp4": "configs/demo_nvfp4.yaml"}  # every other recipe: configs/demo.yaml
TENSORBOARD_SUBDIR = "tensorboard"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a small GPT in low precision with a tedebug debug config.")
    parser.add_argument("--steps", type=int, default=400, help="training iterations (default 400)")
    parser.add_argument("--config", default=None,
                        help="debug config (default configs/demo.yaml; configs/demo_nvfp4.yaml for --recipe nvfp4)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="current",
                        help="low-precision recipe (default current = FP8 per-tensor current scaling)")
    parser.add_argument("--log-dir", default="runs/demo", help="where logs go (default runs/demo)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:1 ...")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.config is None:
        args.config = os.path.join(REPO_ROOT, DEFAULT_CONFIGS.get(args.recipe, "configs/demo.yaml"))
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (use --device cpu or auto)")
    return device


class ProgressBar:
    """A one-line progress bar redrawn with a carriage return: step, loss, seconds per iteration."""

    def __init__(self, total: int, width: int = 30, stream=None) -> None:
        self.total = total
        self.width = width
        self.stream = stream if stream is not None else sys.stdout
        self.start = time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        seconds_per_it = (time.perf_counter() - self.start) / step
        filled = self.width * step // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] step {step:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  "
                          f"{seconds_per_it:.3f} s/it")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


@dataclass
class DemoResult:
    """What a demo run returns (for tests and notebooks)."""

    losses: List[float]
    val_loss: float
    val_loss_quantized: float
    val_accuracy: float
    log_dir: str
    summary: str
    samples: List[str] = field(default_factory=list)


@torch.no_grad()
def validation_loss(model: GPT, data: SortingDataset, device: torch.device, recipe=None) -> float:
    """Mean loss over the validation answers, in high precision or (with `recipe`) quantized."""
    model.eval()
    with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
        _, loss = model(data.val_x.to(device), data.val_y.to(device), ignore_index=IGNORE_INDEX)
    model.train()
    return loss.item()


@torch.no_grad()
def sort_greedily(model: GPT, prompts: torch.Tensor, n_digits: int) -> torch.Tensor:
    """Complete ``<digits>=`` prompts with the model's most likely characters (``n_digits`` + 1 of them)."""
    model.eval()
    sequence = prompts
    for _ in range(n_digits + 1):
        logits, _ = model(sequence)
        sequence = torch.cat([sequence, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    model.train()
    return sequence


def sorting_accuracy(model: GPT, data: SortingDataset, device: torch.device, n_samples: int = 4):
    """(fraction of validation strings sorted exactly, a few "prompt -> answer" lines)."""
    prompt_len = data.n_digits + 1
    prompts = data.val_x[:, :prompt_len].to(device)
    expected = torch.cat([data.val_x[:, prompt_len:], data.val_y[:, -1:]], dim=1).to(device)
    answers = sort_greedily(model, prompts, data.n_digits)[:, prompt_len:]
    correct = (answers == expected).all(dim=1)
    samples = [f"{decode(p[:-1])} -> {decode(a)}  {'ok' if c else 'wrong (expected ' + decode(e) + ')'}"
               for p, a, e, c in zip(prompts[:n_samples], answers[:n_samples], expected[:n_samples],
                                     correct[:n_samples])]
    return correct.float().mean().item(), samples


def shown_path(path: str) -> str:
    """`path` relative to the working directory when it lies below it, else as given."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def start_debugging(config: str, log_dir: str) -> str:
    """Initialise tedebug (stats text log + JSONL by default) and add a TensorBoard sink; returns its directory."""
    debug_api.initialize(config, log_dir=log_dir)
    tensorboard_dir = os.path.join(log_dir, TENSORBOARD_SUBDIR)
    debug_api.add_statistics_sink(TensorBoardSink(log_dir=tensorboard_dir))
    return tensorboard_dir


def learning_rate(step: int, total: int, peak: float, warmup: int = 20) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to a tenth of `peak` at step `total` (1-based)."""
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(model: GPT, data: SortingDataset, args: argparse.Namespace, device: torch.device, recipe) -> List[float]:
    """The training loop; returns the loss of every iteration."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batches = data.batches(args.batch_size, seed=args.seed)
    progress = ProgressBar(args.steps)
    losses = []
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in next(batches))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        with tedebug.autocast(recipe=recipe):
            _, loss = model(x, y, ignore_index=IGNORE_INDEX)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        debug_api.step()  # ends the iteration: its statistics are reduced and written
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            progress.close()
            raise FloatingPointError(f"training loss became {losses[-1]} at step {step}; see the statistics "
                                     f"(nan_count) in the logs")
        progress.update(step, losses[-1])
    progress.close()
    return losses


def main(argv: Optional[Sequence[str]] = None) -> DemoResult:
    args = parse_args(argv)
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    recipe = RECIPES[args.recipe]()

    tensorboard_dir = start_debugging(args.config, args.log_dir)  # before the model is built, as with TE
    try:
        data = make_sorting_dataset(seed=args.seed + 1234)
        model = convert_to_tedebug(GPT(GPTConfig(vocab_size=len(VOCAB), block_size=data.seq_len))).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"Training a {model.config.n_layer}-layer GPT ({n_params / 1e3:.0f}k parameters) to sort "
              f"{data.n_digits} digits on {device}, recipe {args.recipe} ({type(recipe).__name__}), "
              f"{args.steps} steps")
        print(f"Debug config: {shown_path(args.config)}; logs: {args.log_dir}")
        losses = train(model, data, args, device, recipe)
    finally:
        debug_api.end_debug()  # flushes and closes the stats log, JSONL record and TensorBoard files

    val_loss = validation_loss(model, data, device)
    val_loss_quantized = validation_loss(model, data, device, recipe)
    accuracy, samples = sorting_accuracy(model, data, device)
    print(f"\nValidation loss: {val_loss:.4f} in high precision, {val_loss_quantized:.4f} with {args.recipe} "
          f"(chance: {math.log(10):.4f}); sorted exactly: {100 * accuracy:.1f}% of {data.val_x.shape[0]}")
    for line in samples:
        print(f"  {line}")
    summary = summarize(args.log_dir)
    print(f"\n{summary}\n")
    print(f"Statistics: text log under {os.path.join(args.log_dir, 'nvdlfw_inspect_statistics_logs')}, JSONL under "
          f"{os.path.join(args.log_dir, 'tedebug_statistics')}")
    print(f"Open TensorBoard: tensorboard --logdir {tensorboard_dir}")
    return DemoResult(losses, val_loss, val_loss_quantized, accuracy, args.log_dir, summary, samples)


if __name__ == "__main__":
    main()
