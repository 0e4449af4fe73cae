"""examples/train_gpt_tp.py on 2 ranks (gloo unless TEDEBUG_TEST_DIST_BACKEND=nccl): a TP=2 run trains the same
model as a TP=1 run (same losses up to fp32 summation order), also with sequence parallelism, and a debug session
under FP8 current scaling (configs/demo.yaml; its MXFP8 what-if needs token counts and weight shards divisible by
32) writes each statistic once per rank, with equal values on both ranks."""

import json
import os
import sys
import tempfile

import pytest

import dist_harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))

import train_gpt_tp  # noqa: E402

SMALL = ["--steps", "3", "--n-layer", "1", "--n-embd", "32", "--batch-size", "8", "--recipe", "none", "--config", ""]


def _worker(rank, world, log_dir):
    runs = {
        "tp2": train_gpt_tp.train(train_gpt_tp.parse_args(SMALL + ["--tp", "2"])),
        "tp2_sp": train_gpt_tp.train(train_gpt_tp.parse_args(SMALL + ["--tp", "2", "--sequence-parallel"])),
    }
    args = train_gpt_tp.parse_args(
        ["--steps", "2", "--n-layer", "1", "--n-embd", "64", "--batch-size", "32", "--tp", "2", "--log-dir", log_dir]
    )
    train_gpt_tp.train(args)
    with open(os.path.join(log_dir, "tedebug_statistics", f"metrics_globalrank-{rank}.jsonl")) as f:
        runs["records"] = [json.loads(line) for line in f if line.strip()]
    return runs


@pytest.fixture(scope="module")
def runs():
    return dist_harness.spawn(_worker, 2, tempfile.mkdtemp(prefix="tedebug-tp-example-"))


@pytest.mark.distributed
def test_tp2_trains_the_tp1_model(runs):
    tp1 = train_gpt_tp.train(train_gpt_tp.parse_args(SMALL))
    assert len(tp1) == 3 and tp1[-1] < tp1[0]
    for run in runs:
        assert run["tp2"] == pytest.approx(tp1, rel=1e-4)
        assert run["tp2_sp"] == pytest.approx(tp1, rel=1e-4)


@pytest.mark.distributed
def test_debug_statistics_once_per_rank_and_equal_across_ranks(runs):
    per_rank = [{(r["name"], r["iteration"]): r["value"] for r in run["records"]} for run in runs]
    for run, logged in zip(runs, per_rank):
        assert len(logged) == len(run["records"])  # nothing written twice
        assert {it for _, it in logged} == {0}  # configs/demo.yaml: freq 10, two steps
        assert any(name.startswith("blocks.0.mlp.fc2_gradient") for name, _ in logged)
    assert per_rank[0].keys() == per_rank[1].keys()
    for key, value in per_rank[0].items():
        assert per_rank[1][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
