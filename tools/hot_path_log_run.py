"""Write the logs of a small fixed training run, to check that a host-cost change logs exactly the same bytes:

    PYTHONPATH=/path/to/other/checkout .venv/bin/python tools/hot_path_log_run.py /tmp/before
    .venv/bin/python tools/hot_path_log_run.py /tmp/after
    cmp /tmp/before/tedebug_statistics/metrics_globalrank-0.jsonl \
        /tmp/after/tedebug_statistics/metrics_globalrank-0.jsonl
    diff <(cut -d' ' -f3- /tmp/before/nvdlfw_inspect_statistics_logs/*.log) \
         <(cut -d' ' -f3- /tmp/after/nvdlfw_inspect_statistics_logs/*.log)   # text lines, timestamps aside

The run: three tedebug GPT blocks with LogTensorStats (10 statistics) on all six tensors at freq 1, and two converted
torch blocks under Float8CurrentScaling with LogTensorStats (with a blockwise entry, freq 2) and LogFp8TensorStats;
six iterations, a NaN in the input at iteration 3, zeros of both signs at iteration 4.
"""

from __future__ import annotations

import sys
import warnings

import torch

STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range", "nan_count", "inf_count"]
ALL_TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]


def config() -> dict:
    blockwise = {"max_blockwise_dynamic_range": {"block_size": 4, "dims": 1}}
    return {
        "blocks": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": "blocks"},
            "transformer_engine": {
                "LogTensorStats": {"enabled": True, "stats": STATS, "tensors": ALL_TENSORS, "freq": 1}
            },
        },
        "converted": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": "^[0-9]"},
            "transformer_engine": {
                "LogTensorStats": {
                    "enabled": True,
                    "stats": STATS + [blockwise],
                    "tensors": ["activation", "weight", "gradient"],
                    "freq": 2,
                },
                "LogFp8TensorStats": {
                    "enabled": True,
                    "stats": ["underflows%", "mse", "scale_inv_min"],
                    "tensors": ["activation", "weight"],
                    "freq": 1,
                },
            },
        },
    }


def main(log_dir: str) -> int:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import tedebug
    from tedebug import debug_api
    from tedebug.bench import _Block, _TorchBlock
    from tedebug.recipe import Float8CurrentScaling

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(32, 2, i) for i in range(3)])
    converted = tedebug.convert_model(torch.nn.Sequential(*[_TorchBlock(32, 2) for _ in range(2)]))
    x = torch.randn(1, 8, 32)
    opt = torch.optim.SGD(list(model.parameters()) + list(converted.parameters()), lr=1e-1)
    debug_api.initialize(config(), log_dir=log_dir)
    try:
        for iteration in range(6):
            xi = x.clone()
            if iteration == 3:
                xi[0, 0, 0] = float("nan")
            if iteration == 4:
                xi[0, 1, :4] = 0.0
                xi[0, 1, 4] = -0.0
            model(xi).square().mean().backward()
            with tedebug.autocast(recipe=Float8CurrentScaling()):
                y = converted(x)
            y.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            debug_api.step()
    finally:
        debug_api.end_debug()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
