"""One-row steps (`tedebug.stats.readback.StepLayout`, `StatsEngine._one_row_step`): a step whose every fed buffer
holds exactly one row (a row of the step's slab, a quantize kernel's statistics vector or a CPU tensor's host row)
is read back and emitted through a layout kept from step to step.  It must emit exactly what the general read-back
(`RowsInFlight`) emits, fall back to it for any other step, and make a new layout only when the buffers, their rows'
kinds or places, or their statistics change."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Tuple

import pytest
import torch

from tedebug.sinks.batch import DeferredBatch, Emitters, ScalarBatch
from tedebug.stats import StatsEngine
from tedebug.stats import engine as engine_module

from support.features import RecordingSink
from support.log_files import two_block_run_files
from support.slab_backend import slab_backend

BASIC = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range")
COUNTS = ("min", "nan_count", "inf_count", "l2_norm")  # another column layout, with the non-finite counts


def _feeds(iteration: int):
    """The feeds of one iteration: (layer, tensor, stats, x, is_weight), each iteration in its own pattern."""
    g = torch.Generator().manual_seed(100 + iteration)
    scale = iteration + 1.0
    feeds = [
        ("l0", "activation", BASIC, torch.randn(8, 4, generator=g) * scale, False),
        ("l0", "weight", BASIC, torch.randn(4, 4, generator=g) - scale, True),
        ("l0", "output", COUNTS, torch.randn(8, 4, generator=g) * scale, False),
        ("l1", "gradient", COUNTS, torch.randn(3, 5, generator=g) + scale, False),
    ]
    if iteration in (2, 3):  # fed in the other order: each buffer gets another slab row than the one it was made with
        feeds.reverse()
    if iteration == 4:  # a second microbatch of one buffer: two slab rows, so the general read-back
        feeds.insert(1, ("l0", "activation", BASIC, torch.randn(5, 4, generator=g), False))
    if iteration == 5:  # one buffer not fed
        feeds = feeds[:3]
    if iteration == 6:  # a weight fed twice keeps its first feed (no second slab row)
        feeds.append(("l0", "weight", BASIC, torch.randn(4, 4, generator=g), True))
    if iteration == 7:  # non-finite values, reported once with their own iteration
        feeds[2][3][1, 1] = float("nan")
        feeds[3][3][0, 0] = float("inf")
    return feeds


#: the iterations read back as one-row steps (slab rows here), and those that make a new layout (the others keep the
#: last one)
SLAB_STEPS = [0, 1, 2, 3, 5, 6, 7]
NEW_LAYOUTS = [0, 2, 5, 6]


def _engine(monkeypatch, backend, defer: bool, one_row: bool):
    """A statistics engine whose rows the stand-in `backend` writes (patched in as `backend_for`), its sink and the
    list of its messages; `one_row` False reads every step back the general way."""
    monkeypatch.setattr(engine_module, "backend_for", lambda x: backend)
    if not one_row:
        monkeypatch.setattr(engine_module.StatsEngine, "_one_row_step", lambda self, fed, repeated=None: None)
    sink, messages = RecordingSink(), []
    engine = StatsEngine(sink, defer_read_back=defer, log_message=lambda text, **kw: messages.append((text, kw)))
    return engine, sink, messages


def _run(monkeypatch, defer: bool, one_row: bool, finished=None):
    """Eight iterations through an engine whose rows are written into its slab (the stand-in backend; with a
    `finished` list, its launches leave the rows in scratch, written at the step's end, and the list gets the rows
    each such write wrote): the records, the messages and the iterations at which one-row steps and new layouts were
    made."""
    made = {"steps": [], "layouts": []}
    current = {"iteration": None}
    real_step, real_layout = engine_module.OneRowStepInFlight, engine_module.StepLayout

    class CountingStep(real_step):
        def __init__(self, layout, fed, slab, iteration):
            made["steps"].append(iteration)
            super().__init__(layout, fed, slab, iteration)

    class CountingLayout(real_layout):
        def __init__(self, fed):
            made["layouts"].append(current["iteration"])
            super().__init__(fed)

    monkeypatch.setattr(engine_module, "OneRowStepInFlight", CountingStep)
    monkeypatch.setattr(engine_module, "StepLayout", CountingLayout)
    backend = slab_backend(scratch=finished is not None, finished=finished)
    engine, sink, messages = _engine(monkeypatch, backend, defer, one_row)
    for iteration in range(8):
        current["iteration"] = iteration
        for layer, tensor, stats, x, is_weight in _feeds(iteration):
            engine.feed(layer, tensor, stats, x, iteration=iteration, is_weight=is_weight)
        engine.step(iteration)
    engine.finish_pending()
    monkeypatch.undo()
    return sink.rows, messages, made


@pytest.mark.parametrize("defer", [False, True], ids=["synchronous", "deferred"])
def test_one_row_steps_of_slab_rows_emit_what_the_general_read_back_emits(monkeypatch, defer):
    rows, messages, made = _run(monkeypatch, defer, one_row=True)
    general_rows, general_messages, general_made = _run(monkeypatch, defer, one_row=False)
    assert general_made == {"steps": [], "layouts": []}
    assert made["steps"] == SLAB_STEPS
    assert made["layouts"] == NEW_LAYOUTS
    assert repr(rows) == repr(general_rows)  # the same floats in the same order (repr: NaN equals NaN)
    assert messages == general_messages
    assert len(messages) == 1 and "layer=l0 tensor=output" in messages[0][0] and "iteration=7" in messages[0][0]
    emitted = {(name, iteration) for name, _, iteration in rows}
    assert ("l1_gradient_min", 5) not in emitted and ("l1_gradient_min", 6) in emitted
    # an independent look at two rows read through a permuted layout (iteration 3) and a new one (iteration 6)
    values = {(name, iteration): value for name, value, iteration in rows}
    for iteration in (3, 6):
        feeds = {(layer, tensor): x for layer, tensor, _, x, _ in _feeds(iteration)}
        x = feeds[("l0", "activation")].double()
        assert values[("l0_activation_mean", iteration)] == pytest.approx(x.mean().item(), rel=1e-12)
        y = feeds[("l1", "gradient")].double()
        assert values[("l1_gradient_l2_norm", iteration)] == pytest.approx(math.sqrt((y * y).sum().item()), rel=1e-12)
    first, second = [x for _, tensor, _, x, _ in _feeds(6) if tensor == "weight"]
    assert values[("l0_weight_max", 6)] == first.max().item() != second.max().item()  # a weight keeps its first feed


@pytest.mark.parametrize("defer", [False, True], ids=["synchronous", "deferred"])
@pytest.mark.parametrize("one_row", [True, False], ids=["one-row", "general"])
def test_rows_left_in_scratch_until_the_step_emit_what_rows_written_at_once_emit(monkeypatch, defer, one_row):
    finished = []
    rows, messages, made = _run(monkeypatch, defer, one_row, finished)
    at_once_rows, at_once_messages, at_once_made = _run(monkeypatch, defer, one_row)
    assert repr(rows) == repr(at_once_rows) and messages == at_once_messages and made == at_once_made
    assert len(finished) == 8 and all(count > 0 for count in finished)  # one call per step wrote its rows


COUNTS_LATER = ("max", "nan_count", "inf_count")  # the gradient's statistics from iteration 7 on (new emitters)
#: (layer, tensor, statistics, is a weight) of the four buffers, in the order the first iteration feeds them
_BUFFERS = [
    ("l0", "activation", BASIC, False),
    ("l0", "weight", BASIC, True),
    ("l0", "output", COUNTS, False),
    ("l1", "gradient", COUNTS, False),
]
#: what each iteration does differently, and whether it is read back as a repetition of the step before
#: (`StatsEngine._repeated_step`): 0 feeds through `feed` (the buffers are new), the others through each buffer's
#: `SlabFeeder` unless said otherwise
_STEP_CASES = {
    0: ("in creation order, through feed", False),
    1: ("the same order", True),
    2: ("the reverse order: other rows than the layout's", False),
    3: ("the reverse order again", True),
    4: ("a second microbatch of the activation, fed last: two rows in one buffer", False),
    5: ("the step before was no one-row step: nothing to repeat", False),
    6: ("the weight fed twice (it keeps its first feed)", True),
    7: ("the gradient through feed with other statistics (new emitters)", False),
    8: ("the gradient's new statistics through its feeder", True),
    9: ("the output fed at the iteration before", False),
    10: ("the output not fed", False),
    11: ("the output not fed again", True),
}


def _repeated_run(monkeypatch, defer: bool, one_row: bool):
    """Twelve iterations fed as `_STEP_CASES` says (the stand-in backend writes the slab rows): the records, the
    messages and the iterations `_repeated_step` found to repeat the step before."""
    repeated = []
    real_repeated = engine_module.StatsEngine._repeated_step

    def spy(self):
        found = real_repeated(self)
        if found is not None:
            repeated.append(current)
        return found

    monkeypatch.setattr(engine_module.StatsEngine, "_repeated_step", spy)
    engine, sink, messages = _engine(monkeypatch, slab_backend(scratch=True), defer, one_row)
    for current in range(12):
        g = torch.Generator().manual_seed(300 + current)
        buffers = list(_BUFFERS) if current < 2 else list(reversed(_BUFFERS))
        if current >= 7:
            buffers = [(ly, t, COUNTS_LATER if t == "gradient" else st, w) for ly, t, st, w in buffers]
        feeds = [(ly, t, st, torch.randn(6, 4, generator=g) * (current + 1), w, current) for ly, t, st, w in buffers]
        if current == 4:
            feeds.append(("l0", "activation", BASIC, torch.randn(3, 4, generator=g), False, current))
        if current == 6:
            feeds.append(("l0", "weight", BASIC, torch.randn(6, 4, generator=g), True, current))
        if current == 9:
            feeds = [f if f[1] != "output" else f[:5] + (current - 1,) for f in feeds]
        if current >= 10:
            feeds = [f for f in feeds if f[1] != "output"]
        for layer, tensor, stats, x, is_weight, iteration in feeds:
            feeder = engine.slab_feeder((layer, tensor, ()), stats)
            through_feed = current == 0 or (current == 7 and tensor == "gradient")
            if through_feed or feeder is None or not feeder.feed(x, iteration, None, False, is_weight):
                assert through_feed, (current, tensor)  # (every other feed is a feeder's)
                engine.feed(layer, tensor, stats, x, iteration=iteration, is_weight=is_weight)
        engine.step(current)
    engine.finish_pending()
    monkeypatch.undo()
    return sink.rows, messages, repeated


@pytest.mark.parametrize("defer", [False, True], ids=["synchronous", "deferred"])
def test_a_step_fed_as_the_one_before_repeats_it_and_emits_what_the_general_read_back_emits(monkeypatch, defer):
    """A step whose feeds were all `SlabFeeder`s', touching the buffers in the order of the last one-row step of slab
    rows, one row each, at one iteration, is read back through that step's layout without the per-buffer checks;
    every other step is checked as before.  The records are those of the general read-back."""
    rows, messages, repeated = _repeated_run(monkeypatch, defer, one_row=True)
    general_rows, general_messages, general_repeated = _repeated_run(monkeypatch, defer, one_row=False)
    assert repeated == [i for i, (_, repeats) in _STEP_CASES.items() if repeats]
    assert general_repeated == []
    assert repr(rows) == repr(general_rows) and messages == general_messages
    emitted = {(name, iteration) for name, _, iteration in rows}
    assert ("l0_output_min", 8) in emitted and ("l0_output_min", 10) not in emitted
    assert ("l1_gradient_max", 7) in emitted and ("l1_gradient_min", 7) not in emitted


def _emitters(names):
    return Emitters(tuple((n, n) for n in names), lambda row: list(row))


def test_a_batch_takes_the_layout_and_iteration_its_caller_keeps():
    rows = [(_emitters(["a_x_min"]), [1.0], 4, "a", "x"), (_emitters(["b_y_max"]), [2.0], 4, "b", "y")]
    key = tuple(part for emitters, _, _, layer, tensor in rows for part in (emitters, layer, tensor))
    batch = DeferredBatch(rows, key, 4).batch()
    assert batch.layout is key and batch.iteration == 4
    assert batch.same_layout(key) and batch.same_layout(ScalarBatch(rows).layout)
    assert not batch.same_layout(ScalarBatch(rows[:1]).layout)
    assert DeferredBatch(rows)().iteration == 4 and list(DeferredBatch(rows, key, 4)()) == list(ScalarBatch(rows))


#: the session runs: LogTensorStats on CPU tensors (host rows) and through the slab (stand-in backend);
#: LogFp8TensorStats under FP8 current scaling, whose rows are the quantize kernels' statistics vectors; both
_LOG_TENSOR_STATS = {
    "LogTensorStats": {
        "enabled": True,
        "stats": list(BASIC) + ["nan_count", "inf_count"],
        "tensors": ["activation", "weight", "gradient", "output", "wgrad", "dgrad"],
        "freq": 1,
    }
}
_LOG_FP8_TENSOR_STATS = {
    "LogFp8TensorStats": {
        "enabled": True,
        "stats": ["underflows%", "mse", "scale_inv_min", "scale_inv_max"],
        "tensors": ["activation", "weight", "gradient"],
        "freq": 1,
    }
}
RUNS = {  # (features, FP8, rows through the slab (the stand-in backend), lines: iterations, blocks, GEMMs, ...)
    "host": (_LOG_TENSOR_STATS, False, False, 4 * 2 * 4 * 6 * 10),  # (CPU tensors' host rows)
    "slab": (_LOG_TENSOR_STATS, False, True, 4 * 2 * 4 * 6 * 10),
    "vector": (_LOG_FP8_TENSOR_STATS, True, True, 4 * 2 * 4 * 3 * 4),
    "both": ({**_LOG_TENSOR_STATS, **_LOG_FP8_TENSOR_STATS}, True, True, 4 * 2 * 4 * (6 * 10 + 3 * 4)),
}


def _session_files(
    tmp_path: Path, monkeypatch, one_row: bool, writer, run: str, device: str = "cpu"
) -> Tuple[dict, dict]:
    """The statistics files of a short run of two tedebug blocks with the features of `RUNS[run]`, a NaN in the
    input at iteration 2 (`writer`: `background_logging`; `one_row`: False reads every step back the general way;
    on a CUDA `device` the kernels write the rows, no stand-in), and the one-row steps and layouts the run made
    (``{"steps": ..., "layouts": ...}``)."""
    features, fp8, slab, _ = RUNS[run]
    if slab and device == "cpu":
        monkeypatch.setattr(engine_module, "backend_for", lambda x, b=slab_backend(): b)
    made = {"steps": 0, "layouts": 0}
    real_step, real_layout = engine_module.OneRowStepInFlight, engine_module.StepLayout

    class CountingStep(real_step):
        def __init__(self, *args):
            made["steps"] += 1
            super().__init__(*args)

    class CountingLayout(real_layout):
        def __init__(self, fed):
            made["layouts"] += 1
            super().__init__(fed)

    monkeypatch.setattr(engine_module, "OneRowStepInFlight", CountingStep)
    monkeypatch.setattr(engine_module, "StepLayout", CountingLayout)
    if not one_row:
        monkeypatch.setattr(engine_module.StatsEngine, "_one_row_step", lambda self, fed, repeated=None: None)
    log_dir = tmp_path / f"{run}-{one_row}-{writer}"
    try:
        files = two_block_run_files(features, log_dir, device=device, fp8=fp8, background_logging=writer)
    finally:
        monkeypatch.undo()
    return files, made


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("writer", ["process", True, False], ids=["process", "thread", "synchronous"])
def test_a_run_logs_the_same_lines_with_one_row_steps(tmp_path, monkeypatch, writer, run):
    with_one_row_steps, made_one_row = _session_files(tmp_path, monkeypatch, True, writer, run)
    general, made_general = _session_files(tmp_path, monkeypatch, False, writer, run)
    assert with_one_row_steps == general
    assert made_one_row == {"steps": 4, "layouts": 1}  # every step read back as one
    assert made_general == {"steps": 0, "layouts": 0}
    jsonl = [lines for name, lines in general.items() if name.endswith(".jsonl")]
    assert len(jsonl) == 1 and len(jsonl[0]) == RUNS[run][3]
    if run != "vector":
        assert sum("First non-finite values" in line for lines in general.values() for line in lines) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("run", ["slab", "vector", "both"])
def test_a_gpu_run_logs_the_same_lines_with_one_row_steps(tmp_path, monkeypatch, run):
    """The same on a GPU, whose kernels write the slab rows and the statistics vectors (deferred read-back through
    the writer process: pinned copies, stacks and events)."""
    with_one_row_steps, made_one_row = _session_files(tmp_path, monkeypatch, True, "process", run, "cuda")
    general, _ = _session_files(tmp_path, monkeypatch, False, "process", run, "cuda")
    assert with_one_row_steps == general
    jsonl = [lines for name, lines in general.items() if name.endswith(".jsonl")]
    assert len(jsonl) == 1 and len(jsonl[0]) == RUNS[run][3]
    assert made_one_row == {"steps": 4, "layouts": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("run", ["slab", "both"])
def test_a_gpu_run_logs_the_same_lines_with_rows_left_in_scratch(tmp_path, monkeypatch, run):
    """On a GPU the statistics launches leave their partials in the rows' scratch and one launch per step writes the
    rows (`cupy_stats.finish_rows`); without the scratch launches each launch writes its row: the same files."""
    from tedebug.backends import cupy_stats

    finishes = []
    real_finish = cupy_stats.finish_rows

    def finish_rows(*args):
        finishes.append(args[-1])
        real_finish(*args)

    monkeypatch.setattr(cupy_stats, "finish_rows", finish_rows)
    scratch, _ = _session_files(tmp_path / "scratch", monkeypatch, True, "process", run, "cuda")
    assert len(finishes) == 4 and all(count > 0 for count in finishes)  # one per step: one chunk of rows
    monkeypatch.delattr(cupy_stats, "basic_stats_scratch_into")
    at_once, _ = _session_files(tmp_path / "at-once", monkeypatch, True, "process", run, "cuda")
    assert len(finishes) == 4
    assert scratch == at_once
