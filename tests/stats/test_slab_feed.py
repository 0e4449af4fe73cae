"""`StatsEngine.slab_feeder`: the usual GPU feed (one slab row) in a few steps, on the CPU with the stand-in kernel
backend of `tests/support/slab_backend.py` (its launches write each row at its slab address, as the kernels do).

- a feeder takes a feed only where `feed` would send the tensor to the slab again, and a refusal changes nothing;
- a feeder whose route was replaced, or whose engine was reset, refuses every call;
- a weight buffer keeps its first feed of the step;
- through LogTensorStats on a model, every feed after a buffer's first takes it, and the files are those of a run
  in which `feed` takes every call.
"""

from pathlib import Path

import pytest
import torch

from tedebug.backends import torch_ref
from tedebug.backends.fused_stats import attach_high_precision
from tedebug.stats import StatRequest, StatsEngine
from tedebug.stats import engine as engine_module
from support.features import RecordingSink
from support.log_files import two_block_run_files
from support.slab_backend import slab_backend

STATS = tuple(StatRequest.parse_hp(name) for name in ("min", "max", "l1_norm"))
KEY = ("L", "activation", ())
SlabFeeder = engine_module.SlabFeeder


@pytest.fixture
def backend(monkeypatch):
    """The stand-in backend, answered by `backend_for` for every tensor; its `calls` list every row written."""
    calls = []
    stand_in = slab_backend(calls=calls)
    stand_in.calls = calls
    monkeypatch.setattr(engine_module, "backend_for", lambda x: stand_in)
    return stand_in


def _state(engine):
    """What a feed may change: the touched buffers, the rows taken from the slabs and each buffer's slab rows."""
    return (
        list(engine._store.touched),
        {device: slab.used for device, slab in engine._slabs.items()},
        {tuple(b.key): list(b.slab_rows) for b in engine._store},
    )


def test_it_takes_only_the_feeds_feed_would_send_to_the_slab(backend, monkeypatch):
    engine = StatsEngine(RecordingSink())
    x = torch.tensor([[1.5, -3.0], [0.25, 2.0]])
    assert engine.slab_feeder(KEY, STATS) is None  # no buffer yet: `feed` makes it
    assert not engine.has_slab_routes
    engine.feed("L", "activation", STATS, x, iteration=0)
    assert engine._store.get(KEY).slab_route.backend is backend and engine.has_slab_routes
    assert engine.slab_feeder(KEY, tuple(list(STATS))) is None  # an equal stats object, not the one it was fed
    assert engine.slab_feeder(KEY, None) is None
    feeder = engine.slab_feeder(KEY, STATS)
    refused = [torch.empty(0), torch.arange(4), [1.0, 2.0], None]  # (not floating-point: `feed` raises for it)
    fused = torch.tensor([[7.0, 8.0]])
    attach_high_precision(fused, torch.zeros(len(torch_ref.BASIC_ROW_KEYS), dtype=torch.float64))
    refused.append(fused)  # a quantize pass computed its row: `feed` keeps that row
    before = _state(engine)
    for tensor in refused:
        assert not feeder.feed(tensor, 0, None, False, False)
    buffer = engine._store.get(KEY)
    route = buffer.slab_route
    buffer.slab_route = route._replace(host_values=True)  # (a CUDA feed's route, of a backend with host values)
    host_values = engine.slab_feeder(KEY, STATS)
    assert not host_values.feed(x, 0, None, False, False)  # a CPU tensor: `feed` takes its values
    assert not feeder.feed(x, 0, None, False, False)  # the route it was made with is not the buffer's now
    buffer.slab_route = route
    buffer.stats_source = tuple(list(STATS))
    assert not feeder.feed(x, 0, None, False, False)  # the buffer was fed another stats object since
    buffer.stats_source = STATS
    other = slab_backend()
    monkeypatch.setattr(engine_module, "backend_for", lambda t: other)
    assert not feeder.feed(x, 0, None, False, False)  # another backend now
    assert _state(engine) == before  # a refusal changes nothing
    monkeypatch.setattr(engine_module, "backend_for", lambda t: backend)
    y = x * 4
    assert feeder.feed(y, 0, "group", False, False)
    assert buffer.reduction_group == "group" and buffer.iteration == 0 and len(buffer.slab_rows) == 2
    assert backend.calls[-1] is y
    log = engine.metric_logger
    engine.step(0)
    values = {name: value for name, value, _ in log.rows}
    both = torch.cat([x.flatten(), y.flatten()]).double()
    assert values == {
        "L_activation_min": both.min().item(),
        "L_activation_max": both.max().item(),
        "L_activation_l1_norm": both.abs().sum().item(),
    }


def test_a_feeder_of_a_reset_engine_refuses_every_call(backend):
    engine = StatsEngine(RecordingSink())
    x = torch.ones(2, 2)
    engine.feed("L", "activation", STATS, x, iteration=0)
    feeder = engine.slab_feeder(KEY, STATS)
    engine.step(0)
    engine.reset()
    assert not feeder.feed(x, 1, None, False, False)
    assert list(engine._store) == [] and engine._store.touched == {}


def test_a_session_of_cpu_tensors_records_no_route():
    engine = StatsEngine(
        RecordingSink()
    )  # the real backends: CPU tensors get host values or host rows, never a slab row
    for iteration in range(2):
        engine.feed("L", "activation", STATS, torch.ones(3, 2) * iteration, iteration=iteration)
        engine.step(iteration)
    assert not engine.has_slab_routes and engine._store.get(KEY).slab_route is None
    assert engine.slab_feeder(KEY, STATS) is None


def test_a_weight_keeps_its_first_feed_of_the_step(backend):
    engine = StatsEngine(RecordingSink())
    key = ("L", "weight", ())
    w = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    for iteration in (0, 1):
        if iteration == 0:
            engine.feed("L", "weight", STATS, w, iteration=0, skip_reduction=True, is_weight=True)
            feeder = engine.slab_feeder(key, STATS)
        else:
            assert feeder.feed(w, 1, None, True, True)
        assert feeder.feed(w * 10, iteration, None, True, True)  # taken, not written
        assert len(engine._store.get(key).slab_rows) == 1
        assert backend.calls[-1] is w
        engine.step(iteration)
    assert [(name, value) for name, value, _ in engine.metric_logger.rows] == 2 * [
        ("L_weight_min", -2.0),
        ("L_weight_max", 3.0),
        ("L_weight_l1_norm", 6.5),
    ]


def _files(tmp_path: Path, monkeypatch, name: str, fast: bool, finished=None):
    """The statistics files of four steps of two tedebug blocks with LogTensorStats on every tensor (a NaN in the
    input at iteration 2), the stand-in backend writing the rows (with a `finished` list: its scratch launches, the
    rows written at each step's read-back, the list getting how many each time); `fast` False: `feed` takes every
    call (the engine gives no feeder).  Also the number of calls `feed` and the feeders took."""
    counts = {"feed": 0, "slab": 0}
    real_feed, real_slab = StatsEngine.feed, SlabFeeder.feed

    def feed(self, *args, **kwargs):
        counts["feed"] += 1
        return real_feed(self, *args, **kwargs)

    def feeder_feed(self, *args):
        taken = real_slab(self, *args)
        counts["slab"] += taken
        return taken

    monkeypatch.setattr(
        engine_module, "backend_for", lambda x, b=slab_backend(scratch=finished is not None, finished=finished): b
    )
    monkeypatch.setattr(StatsEngine, "feed", feed)
    monkeypatch.setattr(SlabFeeder, "feed", feeder_feed)
    if not fast:
        monkeypatch.setattr(StatsEngine, "slab_feeder", lambda self, key, stats: None)
    stats = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
    tensors = ["activation", "weight", "output", "gradient", "dgrad", "wgrad"]
    features = {"LogTensorStats": {"enabled": True, "stats": stats, "tensors": tensors, "freq": 1}}
    try:
        files = two_block_run_files(features, tmp_path / name)
    finally:
        monkeypatch.undo()
    return files, counts


def test_a_logged_model_feeds_each_buffer_once_the_general_way_and_logs_the_same(tmp_path, monkeypatch):
    fast, fast_counts = _files(tmp_path, monkeypatch, "fast", True)
    general, general_counts = _files(tmp_path, monkeypatch, "general", False)
    assert fast == general
    buffers = 2 * 4 * 6  # two blocks of four GEMMs, six tensors each, every one fed once per step
    assert fast_counts == {"feed": buffers, "slab": 3 * buffers}  # the general feed only at the first step
    assert general_counts == {"feed": 4 * buffers, "slab": 0}
    jsonl = [lines for name, lines in general.items() if name.endswith(".jsonl")]
    assert len(jsonl) == 1 and len(jsonl[0]) == 4 * buffers * 8
    assert sum("First non-finite values" in line for lines in general.values() for line in lines) == 1


def test_a_logged_model_whose_rows_wait_in_scratch_logs_the_same(tmp_path, monkeypatch):
    finished = []
    scratch, counts = _files(tmp_path, monkeypatch, "scratch", True, finished)
    general, _ = _files(tmp_path, monkeypatch, "general", False)
    assert scratch == general
    assert finished == [2 * 4 * 6] * 4  # every step's rows written from their scratch at its read-back
    assert counts == {"feed": 2 * 4 * 6, "slab": 3 * 2 * 4 * 6}  # the few-step feed takes the scratch route too


def test_a_feeders_feed_takes_the_sessions_reduction_group_of_the_moment(backend, tmp_path, monkeypatch):
    """LogTensorStats' feeds through a layer's feeder ask the reduction arguments at every feed: a reduction group set
    between two steps (`set_tensor_reduction_group`) is the next feed's, on the feeder's path as on the general one."""
    from tedebug import active, debug_api
    from tedebug.nn import Linear
    from support.features import debug_session

    config = {
        "all": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}},
        }
    }
    layer = Linear(4, 2, name="lin")
    taken = []
    real = SlabFeeder.feed
    monkeypatch.setattr(SlabFeeder, "feed", lambda self, *args: taken.append(real(self, *args)) or taken[-1])
    group = object()
    groups = []
    with debug_session(config, tmp_path, RecordingSink()):
        for step in range(3):
            if step == 2:
                debug_api.set_tensor_reduction_group(group)
            layer(torch.ones(1, 4))
            (buffer,) = active.session().stats._store
            groups.append(buffer.reduction_group)
            debug_api.step()
    assert taken == [True, True]  # the first step's feed is the general one, the next two the feeder's
    assert groups == [None, None, group]
