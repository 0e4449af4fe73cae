"""`tools/ab_trees.py`: two trees' workers asked for rounds in alternating order, the figures they print computed from
their timings, a worker refusing a tree it did not import, and a real run of two workers on the CPU."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]


def _trees(tmp_path):
    trees = []
    for name in ("a", "b"):
        (tmp_path / name / "tedebug").mkdir(parents=True)
        trees.append(str(tmp_path / name))
    return trees


def test_rounds_alternate_and_the_figures_are_the_workers_timings(tmp_path, monkeypatch, capsys):
    tool = load_tool("ab_trees")
    trees = _trees(tmp_path)
    asked = []
    # (baseline ms, logged ms) per round of each tree; 2 layers -> 48 logged tensors per step
    timings = {trees[0]: iter([(10.0, 14.8), (11.0, 16.76), (12.0, 16.8)]), trees[1]: iter([(10.0, 12.4)] * 3)}
    workers = {tree: SimpleNamespace(tree=tree, stdin=None, wait=lambda timeout: 0) for tree in trees}
    monkeypatch.setattr(tool, "start_worker", lambda tree, args: workers[str(tree)])
    monkeypatch.setattr(tool, "one_round", lambda worker: asked.append(worker.tree) or next(timings[worker.tree]))
    assert tool.main(trees + ["--rounds", "3", "--layers", "2", "--device", "cpu"]) == 0
    a, b = trees
    assert asked == [a, b, b, a, a, b]  # who goes first alternates
    out = capsys.readouterr().out
    # per logged tensor: (logged - baseline) * 1000 / 48 -> A 100, 120, 100 us; B 50 us each round
    assert "round 2: A 11.00 -> 16.76 ms, 120.0 us/tensor   B 10.00 -> 12.40 ms, 50.0 us/tensor" in out
    assert f"A ({a}): baseline 11.00 ms, logged 16.76 ms, per logged tensor 100.0 us (rounds 100.0-120.0)" in out
    assert f"B ({b}): baseline 10.00 ms, logged 12.40 ms, per logged tensor 50.0 us (rounds 50.0-50.0)" in out
    assert "per-round ratio A / B: median 2.00 (rounds 2.00-2.40)" in out


def test_a_directory_without_the_package_is_refused(tmp_path):
    tool = load_tool("ab_trees")
    with pytest.raises(SystemExit, match="without tedebug/"):
        tool.export_tree(str(tmp_path), tmp_path)


def test_a_name_that_is_no_revision_is_refused(tmp_path, monkeypatch):
    tool = load_tool("ab_trees")
    monkeypatch.chdir(ROOT)  # inside this repository
    with pytest.raises(SystemExit, match="neither a directory nor a git revision"):
        tool.export_tree("no-such-revision-0123", tmp_path)
    monkeypatch.chdir(tmp_path)  # outside any repository
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    with pytest.raises(SystemExit, match="no git repository here"):
        tool.export_tree("HEAD", tmp_path)


def test_a_worker_refuses_a_tree_it_did_not_import(tmp_path):
    """A tree whose tedebug/ is no package (no __init__.py): the worker's import finds no module of that tree."""
    tool = load_tool("ab_trees")
    (tmp_path / "tedebug").mkdir()
    args = tool.argparse.Namespace(device="cpu", layers=1, hidden=8, heads=2, batch=1, seq=4, steps=1)
    with pytest.raises(SystemExit, match="did not start: error: tedebug was imported from None"):
        tool.start_worker(tmp_path, args)


def test_two_workers_on_the_cpu(capsys):
    tool = load_tool("ab_trees")
    argv = [str(ROOT), str(ROOT), "--device", "cpu", "--rounds", "2", "--steps", "2"]
    assert tool.main(argv + ["--layers", "1", "--hidden", "16", "--seq", "4"]) == 0
    out = capsys.readouterr().out
    rounds = re.findall(r"([AB]) ([\d.]+) -> ([\d.]+) ms, (-?[\d.]+) us/tensor", out)
    assert len(rounds) == 4
    for _, baseline, logged, per in rounds:  # 24 logged tensors per step of one block
        assert float(per) == pytest.approx(
            (float(logged) - float(baseline)) * 1e3 / 24, abs=0.45
        )  # (the ms are printed to 2 decimals)
    assert "24 logged tensors per step, 2 rounds of 2 steps, cpu" in out
