"""Two source trees of tedebug alternated round by round on one host: LogTensorStats' host time per logged tensor.

    python tools/ab_trees.py TREE_A TREE_B [--rounds 12] [--steps 10] [--device cuda]
                                            [--layers 12 --hidden 256 --heads 2 --batch 1 --seq 128]

A tree is a git revision (exported with ``git archive`` into a temporary directory) or a directory holding
``tedebug/`` (``.`` is the working tree).  The default size is the host-bound one of issue 14 (12 blocks, hidden 256,
1 x 128 tokens, bf16 on CUDA; float32 on the CPU).

Why: the lent GPU hosts differ by up to three times in speed, and one host drifts by tens of percent within minutes
(docs/performance.md, sections 17, 25 and 27), so two benchmark runs a few minutes apart do not compare, and two
trees cannot share one process.  Here each tree runs in its own worker process, started once (its own imports,
kernels compiled once), and the driver asks the workers for one round at a time, alternating which goes first, so
that both trees see the same minutes of the host.  A worker's round: `--steps` training steps of `tedebug.bench`'s
block stack without debug_api, then as many with LogTensorStats (min, max, mean, std, l1_norm, l2_norm, cur_amax,
dynamic_range on the six tensors of every GEMM, freq 1; a new session per round), each timed after 3 untimed steps
and a full garbage collection (CUDA: by events around the steps; CPU: by the wall clock).  Its figure is the
difference of the two over the tensors logged per step (6 per GEMM, 4 GEMMs per block).

Printed: each round's baseline, logged step and per-tensor figure for both trees, then per tree the medians and
range, and the median of the per-round ratios A / B (a ratio of figures taken in the same minutes).  The workers use
only what every tree since the issue has (`tedebug.bench._Block`, `debug_api.initialize`, ``step``, ``end_debug``,
``is_enabled``), and each checks that it imported its own tree (a ``git archive`` gets the links
``tedebug/features`` and ``tedebug/kernels`` that an editable install stands for; without them an editable install
of another tree would answer those two packages).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]
READY = "ready"


# ------------------------------------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> int:
    """One tree's rounds: a line on stdin asks for one; prints ``<baseline ms> <logged ms>``."""
    import warnings

    import torch

    warnings.simplefilter("ignore")
    import tedebug
    import tedebug.features
    from tedebug import bench, debug_api

    tree = Path(args.tree).resolve()
    for module in (tedebug, tedebug.features):
        where = Path(module.__file__).resolve() if getattr(module, "__file__", None) else None
        if where is None or tree not in where.parents:
            print(f"error: {module.__name__} was imported from {where}, not from the tree {tree}", flush=True)
            return 1
    try:  # (trees since ddcc159) the compiled linear built or loaded now, so that every timed round takes it
        from tedebug.nn import compiled_linear
    except ImportError:
        pass
    else:
        compiled_linear.prepare()
    on_gpu = args.device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks = [bench._Block(args.hidden, args.heads, i) for i in range(args.layers)]
    model = torch.nn.Sequential(*blocks).to(args.device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.seq, args.hidden, device=args.device, dtype=dtype)
    config = {
        "ab_trees": {
            "enabled": True,
            "layers": {"layer_types": ["all"]},
            "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": STATS, "tensors": TENSORS, "freq": 1}},
        }
    }

    def one() -> None:
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if debug_api.is_enabled():
            debug_api.step()

    def timed() -> float:
        for _ in range(3):
            one()
        gc.collect()
        if not on_gpu:
            start = time.perf_counter()
            for _ in range(args.steps):
                one()
            return (time.perf_counter() - start) * 1e3 / args.steps
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(args.steps):
            one()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / args.steps

    print(READY, flush=True)
    for _ in sys.stdin:
        baseline = timed()
        with tempfile.TemporaryDirectory() as log_dir:
            debug_api.initialize(config, log_dir=log_dir)
            try:
                logged = timed()
            finally:
                debug_api.end_debug()
        print(f"{baseline:.6f} {logged:.6f}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ driver
def export_tree(spec: str, scratch: Path) -> Path:
    """The directory of tree `spec`: itself when it is a directory, else the git revision exported under `scratch`
    (with the package links an editable install stands for)."""
    if Path(spec).is_dir():
        path = Path(spec).resolve()
        if not (path / "tedebug").is_dir():
            raise SystemExit(f"ab_trees: {spec!r} is a directory without tedebug/")
        return path
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if root.returncode != 0:
        raise SystemExit(f"ab_trees: {spec!r} is not a directory, and there is no git repository here to find it in")
    target = scratch / spec.replace("/", "_")
    target.mkdir()
    archive = subprocess.run(["git", "archive", spec], cwd=root.stdout.strip(), capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"ab_trees: {spec!r} is neither a directory nor a git revision: {archive.stderr.decode()}")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    for package in ("features", "kernels"):
        if (target / package).is_dir() and not (target / "tedebug" / package).exists():
            (target / "tedebug" / package).symlink_to(Path("..") / package)
    return target


def start_worker(tree: Path, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree)]
    for name in ("device", "layers", "hidden", "heads", "batch", "seq", "steps"):
        command += [f"--{name}", str(getattr(args, name))]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline().strip()  # type: ignore[union-attr]
    if line != READY:
        process.kill()
        raise SystemExit(f"ab_trees: the worker of {tree} did not start: {line or 'no output'}")
    return process


def one_round(process: subprocess.Popen) -> Tuple[float, float]:
    process.stdin.write("round\n")  # type: ignore[union-attr]
    process.stdin.flush()  # type: ignore[union-attr]
    line = process.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise SystemExit("ab_trees: a worker ended during a round")
    baseline, logged = map(float, line.split())
    return baseline, logged


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", help="two git revisions or directories ('.': the working tree)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if len(args.trees) != 2:
        parser.error("give two trees")
    tensors = 6 * 4 * args.layers
    scratch = Path(tempfile.mkdtemp(prefix="tedebug-ab-trees-"))
    processes: List[subprocess.Popen] = []
    try:
        trees = [export_tree(spec, scratch) for spec in args.trees]
        processes = [start_worker(tree, args) for tree in trees]
        names = [f"A ({args.trees[0]})", f"B ({args.trees[1]})"]
        results: List[List[Tuple[float, float, float]]] = [[], []]
        for r in range(args.rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                baseline, logged = one_round(processes[i])
                results[i].append((baseline, logged, (logged - baseline) * 1e3 / tensors))
            print(
                f"round {r + 1}: "
                + "   ".join(
                    f"{name[0]} {res[-1][0]:.2f} -> {res[-1][1]:.2f} ms, {res[-1][2]:.1f} us/tensor"
                    for name, res in zip(names, results)
                ),
                flush=True,
            )
        print(f"{tensors} logged tensors per step, {args.rounds} rounds of {args.steps} steps, {args.device}")
        for name, res in zip(names, results):
            per = [r[2] for r in res]
            print(
                f"{name}: baseline {statistics.median(r[0] for r in res):.2f} ms, logged "
                f"{statistics.median(r[1] for r in res):.2f} ms, per logged tensor {statistics.median(per):.1f} us "
                f"(rounds {min(per):.1f}-{max(per):.1f})"
            )
        ratios = [a[2] / b[2] for a, b in zip(*results) if b[2] > 0]
        if ratios:
            print(
                f"per-round ratio A / B: median {statistics.median(ratios):.2f} "
                f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
            )
    finally:
        for process in processes:
            if process.stdin is not None:
                process.stdin.close()
            process.wait(timeout=120)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
