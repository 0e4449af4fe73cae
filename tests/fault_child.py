"""Child process of the fault-injection tests and of tools/measure_reliability.py: a training-like loop on tedebug.

    python fault_child.py loop LOG_DIR [RAISE_AT]   log every iteration, print "<it>" after each step() returned
    python fault_child.py hold LOG_DIR              initialize, print "ready", wait for stdin to close

In `loop` the statistic ``layer_activation_max`` of iteration `it` is exactly ``it + 0.5`` (an oracle for the
parent); besides the text and JSONL files a `TensorBoardSink` writes them to ``LOG_DIR/tensorboard``.  With
RAISE_AT the loop raises an uncaught RuntimeError right after printing that iteration.
"""

import os
import signal
import sys
import time

import torch

from tedebug import debug_api
from tedebug.sinks.tensorboard import TensorBoardSink

CONFIG = {
    "s": {
        "enabled": True,
        "layers": {"layer_types": ["layer"]},
        "transformer_engine": {
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max", "min", "mean"]}
        },
    }
}
PAUSE_S = 0.002


def loop(log_dir: str, raise_at: int) -> None:
    debug_api.initialize(CONFIG, log_dir=log_dir, default_logging_enabled=True)
    debug_api.add_statistics_sink(TensorBoardSink(log_dir=os.path.join(log_dir, "tensorboard")))
    te = debug_api.transformer_engine
    base = torch.linspace(-1.0, 0.5, 64)
    for iteration in range(100_000):
        te.inspect_tensor(
            "layer", tensor=base + iteration, tensor_name="activation", iteration=iteration, tp_group=None
        )
        debug_api.step()
        print(iteration, flush=True)
        if iteration == raise_at:
            raise RuntimeError(f"uncaught error after iteration {iteration}")
        time.sleep(PAUSE_S)


def hold(log_dir: str) -> None:
    debug_api.initialize(CONFIG, log_dir=log_dir)
    print("ready", flush=True)
    sys.stdin.read()
    debug_api.end_debug()


if __name__ == "__main__":
    # a training process answers Ctrl-C; a parent started as a background job of a non-interactive shell (`make
    # test &`) passes SIGINT on ignored, and Python then installs no handler: take the default one back
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.argv[1] == "loop":
        loop(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else -1)
    else:
        hold(sys.argv[2])
