"""The tedebug demo (`make demo`): train a small GPT in low precision with a debug config, then summarise.

Steps: start a debug session (`debug_api.initialize`, before the model is built) with a TensorBoard sink next to
the default stats text log and the JSONL record; build the GPT of examples/gpt.py and convert its block Linear
layers to tedebug layers; train on the generated sorting task of examples/data.py inside
``tedebug.autocast(recipe=...)`` (``--recipe bf16``: ``torch.autocast`` to bfloat16, no quantization, the
high-precision twin for ``tedebug compare``) with AdamW, logging the loss to TensorBoard next to the statistics
and calling ``debug_api.step()`` after each iteration (a tqdm progress bar shows it); close the session; report the
validation loss and sorting accuracy, a few sorted samples, the worst layers by underflow% and MSE
(examples/summary.py), the ``tedebug report`` command and how to open TensorBoard (`tensorboard_hint`).  Runs on
CPU in about a minute; uses CUDA when present.

    python examples/train_gpt.py [--steps N] [--config configs/demo.yaml] [--recipe current] [--log-dir runs/demo]
                                 [--n-layer 2]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
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
    "bf16": None,  # no quantization: torch.autocast to bfloat16 (the high-precision twin of a low-precision run)
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
    parser.add_argument(
        "--config",
        default=None,
        help="debug config (default configs/demo.yaml; configs/demo_nvfp4.yaml for --recipe nvfp4)",
    )
    parser.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default="current",
        help="low-precision recipe (default current = FP8 per-tensor current scaling; bf16 = no "
        "quantization, torch.autocast to bfloat16)",
    )
    parser.add_argument("--log-dir", default="runs/demo", help="where logs go (default runs/demo)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:1 ...")
    parser.add_argument(
        "--n-layer",
        type=int,
        default=2,
        help="transformer blocks (default 2; e.g. 32 gives 128 tedebug layers, to try the tools on a deep model)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.n_layer < 1:
        parser.error(f"--n-layer must be >= 1, got {args.n_layer}")
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


def progress_bar(total: int, stream=None):
    """A tqdm bar (step, loss, s/it).  In a terminal it redraws in place; in a log (stdout not a terminal, e.g. CI)
    it is redrawn only every tenth of the run, so the log gets about ten updates instead of one per step."""
    from tqdm import tqdm

    stream = stream if stream is not None else sys.stdout
    interactive = hasattr(stream, "isatty") and stream.isatty()
    return tqdm(
        total=total,
        file=stream,
        unit="step",
        ascii=not interactive,
        dynamic_ncols=interactive,
        mininterval=0.1 if interactive else 0.0,
        miniters=None if interactive else max(1, total // 10),
        bar_format="{l_bar}{bar:30}| step {n_fmt}/{total_fmt}{postfix} [{elapsed}<{remaining}, {rate_inv_fmt}]",
    )


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
def validation_loss(
    model: GPT, data: SortingDataset, device: torch.device, recipe=None, *, low_precision: bool = False
) -> float:
    """Mean loss over the validation answers, in high precision or (`low_precision`) in the training precision
    (`precision(recipe, device)`)."""
    model.eval()
    with precision(recipe, device) if low_precision else tedebug.autocast(enabled=False):
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
    samples = [
        f"{decode(p[:-1])} -> {decode(a)}  {'ok' if c else 'wrong (expected ' + decode(e) + ')'}"
        for p, a, e, c in zip(prompts[:n_samples], answers[:n_samples], expected[:n_samples], correct[:n_samples])
    ]
    return correct.float().mean().item(), samples


def shown_path(path: str) -> str:
    """`path` relative to the working directory when it lies below it, else as given."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def make_recipe(name: str):
    """The tedebug recipe of `--recipe`, or None for bf16 (no quantization)."""
    factory = RECIPES[name]
    return None if factory is None else factory()


def precision(recipe, device: torch.device):
    """The forward's precision context: tedebug.autocast with `recipe`, or torch.autocast to bfloat16 for None."""
    if recipe is None:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return tedebug.autocast(recipe=recipe)


def start_debugging(config: str, log_dir: str) -> TensorBoardSink:
    """Initialise tedebug (stats text log + JSONL by default) and add a TensorBoard sink (returned; its writer's
    directory is ``<log_dir>/tensorboard``)."""
    debug_api.initialize(config, log_dir=log_dir)
    sink = TensorBoardSink(log_dir=os.path.join(log_dir, TENSORBOARD_SUBDIR))
    debug_api.add_statistics_sink(sink)
    return sink


def tensorboard_hint(tensorboard_dir: str, tag_filter: str = "summary/.*/max") -> str:
    """How to open TensorBoard on the run: the venv's ``tensorboard`` keeping up to 100000 points per scalar (its
    default keeps 1000, sampled at random, which can drop a spike; ``scalars=0`` keeps none in TensorBoard 2.21), a
    URL with smoothing 0 and a tag filter on the cross-layer summaries, and the two settings that hide the worst
    layer by default."""
    venv_tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    command = shown_path(venv_tensorboard) if os.path.isfile(venv_tensorboard) else "tensorboard"
    return "\n".join(
        [
            f"Open TensorBoard: {command} --logdir {tensorboard_dir} --samples_per_plugin scalars=100000",
            f"  then browse http://localhost:6006/?smoothing=0&tagFilter={tag_filter}#timeseries",
            "  (summary/<tensor>/<stat>/max: the worst layer of each statistic; also p90 and median over layers; the "
            "TEXT tab names the layer of the max)",
            "  Change two settings, or the worst layer's line is cut off: TIME SERIES > Settings (right of the tag "
            "filter): untick 'Ignore outliers in chart scaling';",
            "  CUSTOM SCALARS (charts of at most 16 layers): untick 'Ignore outliers in chart scaling' and set "
            "Smoothing to 0.",
        ]
    )


def learning_rate(step: int, total: int, peak: float, warmup: int = 20) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to a tenth of `peak` at step `total` (1-based)."""
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(
    model: GPT,
    data: SortingDataset,
    args: argparse.Namespace,
    device: torch.device,
    recipe,
    tensorboard: Optional[TensorBoardSink] = None,
) -> List[float]:
    """The training loop; returns the loss of every iteration (also logged to `tensorboard` as ``train/loss``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batches = data.batches(args.batch_size, seed=args.seed)
    progress = progress_bar(args.steps)
    losses = []
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in next(batches))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        with precision(recipe, device):
            _, loss = model(x, y, ignore_index=IGNORE_INDEX)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if tensorboard is not None:  # the loss next to the statistics of the same iteration
            tensorboard.log_user_scalar("train/loss", losses[-1], debug_api.get_iteration())
        debug_api.step()  # ends the iteration: its statistics are reduced and written
        if not math.isfinite(losses[-1]):
            progress.close()
            raise FloatingPointError(
                f"training loss became {losses[-1]} at step {step}; see the statistics (nan_count) in the logs"
            )
        progress.set_postfix_str(f"loss {losses[-1]:.4f}", refresh=False)
        progress.update(1)
    progress.close()
    return losses


def main(argv: Optional[Sequence[str]] = None) -> DemoResult:
    args = parse_args(argv)
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    recipe = make_recipe(args.recipe)

    tensorboard = start_debugging(args.config, args.log_dir)  # before the model is built, as with TE
    tensorboard_dir = os.path.join(args.log_dir, TENSORBOARD_SUBDIR)
    try:
        data = make_sorting_dataset(seed=args.seed + 1234)
        config = GPTConfig(vocab_size=len(VOCAB), block_size=data.seq_len, n_layer=args.n_layer)
        model = convert_to_tedebug(GPT(config)).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"Training a {model.config.n_layer}-layer GPT ({n_params / 1e3:.0f}k parameters) to sort "
            f"{data.n_digits} digits on {device}, recipe {args.recipe} "
            f"({type(recipe).__name__ if recipe is not None else 'torch.autocast to bfloat16'}), "
            f"{args.steps} steps"
        )
        print(f"Debug config: {shown_path(args.config)}; logs: {args.log_dir}")
        losses = train(model, data, args, device, recipe, tensorboard)
    finally:
        debug_api.end_debug()  # flushes and closes the stats log, JSONL record and TensorBoard files

    val_loss = validation_loss(model, data, device)
    val_loss_quantized = validation_loss(model, data, device, recipe, low_precision=True)
    accuracy, samples = sorting_accuracy(model, data, device)
    print(
        f"\nValidation loss: {val_loss:.4f} in high precision, {val_loss_quantized:.4f} with {args.recipe} "
        f"(chance: {math.log(10):.4f}); sorted exactly: {100 * accuracy:.1f}% of {data.val_x.shape[0]}"
    )
    for line in samples:
        print(f"  {line}")
    summary = summarize(args.log_dir)
    print(f"\n{summary}\n")
    print(
        f"Statistics: text log under {os.path.join(args.log_dir, 'nvdlfw_inspect_statistics_logs')}, JSONL under "
        f"{os.path.join(args.log_dir, 'tedebug_statistics')}"
    )
    print(
        f"Report: {shown_path(os.path.dirname(sys.executable))}/tedebug report {args.log_dir} "
        f"-o {os.path.join(args.log_dir, 'report.html')}"
    )
    print(tensorboard_hint(tensorboard_dir))
    return DemoResult(losses, val_loss, val_loss_quantized, accuracy, args.log_dir, summary, samples)


if __name__ == "__main__":
    main()
