"""The statistics files of a debug session as comparable text, and the short logged run whose files two code paths
that must log the same are compared by."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import torch


def log_file_lines(log_dir: Path) -> Dict[str, List[str]]:
    """Every ``.jsonl`` and ``.log`` file under `log_dir` (path relative to it -> its lines), with `log_dir` itself
    written as ``<log_dir>`` and the text logs' timestamps (each line's first two words) left out."""
    files = {}
    for path in sorted(log_dir.rglob("*")):
        if path.is_file() and path.suffix in (".jsonl", ".log"):
            lines = path.read_text().replace(str(log_dir), "<log_dir>").splitlines()
            if path.suffix == ".log":
                lines = [line.split(" ", 2)[-1] for line in lines]
            files[str(path.relative_to(log_dir))] = lines
    return files


def two_block_run_files(
    features: Dict[str, Any],
    log_dir: Path,
    *,
    device: str = "cpu",
    fp8: bool = False,
    background_logging: Any = "process",
) -> Dict[str, List[str]]:
    """`log_file_lines` of four training steps of two `tedebug.bench` blocks (seed 0) with `features` on every layer
    and a NaN in the input at iteration 2 (CPU: hidden 16, 4 tokens, float32; CUDA: hidden 128, 64 tokens, bf16, the
    FP8 kernels' fast shape); `fp8`: under Float8CurrentScaling."""
    import tedebug
    from tedebug import debug_api
    from tedebug.bench import _Block
    from tedebug.recipe import Float8CurrentScaling

    torch.manual_seed(0)
    hidden, tokens, dtype = (16, 4, torch.float32) if device == "cpu" else (128, 64, torch.bfloat16)
    model = torch.nn.Sequential(*[_Block(hidden, 2, i) for i in range(2)]).to(device, dtype)
    config = {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}
    x = torch.randn(1, tokens, hidden).to(device, dtype)
    debug_api.initialize(config, log_dir=str(log_dir), background_logging=background_logging)
    try:
        for iteration in range(4):
            xi = x.clone()
            if iteration == 2:
                xi[0, 0, 0] = float("nan")
            with tedebug.autocast(enabled=fp8, recipe=Float8CurrentScaling()):
                y = model(xi)
            y.square().mean().backward()
            debug_api.step()
    finally:
        debug_api.end_debug()
    return log_file_lines(log_dir)
