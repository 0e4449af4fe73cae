"""The hot-path caches of an active debug iteration: they live in the session (or its stats engine / sinks), never
outlive it, never change an answer (schedules still answer per iteration, mutated configs are re-parsed, a stats
buffer still refuses other stats within a step), and the fast encoders write exactly what the plain ones wrote."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch

from tedebug import debug_api
from tedebug.features.base import schedule_of
from tedebug.memo import exact_key, memoized
from tedebug.sinks.base import MetricLogger, Sink
from tedebug.sinks.jsonl import JsonlSink, make_record
from tedebug.sinks.text import TextStatsSink
from tedebug.stats import StatRequest, StatsEngine

from support.features import RecordingSink, debug_session, section
from support.slab_backend import slab_backend

TABS = " \t\t\t\t "
ASCTIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def stats_config(**schedule):
    return section(
        {"LogTensorStats": {"enabled": True, "stats": ["min", "max"], "tensors": ["activation"], **schedule}}
    )


# ------------------------------------------------------------------------------------------------ exact_key
def test_exact_key_separates_types_and_keeps_order():
    assert exact_key(1) != exact_key(1.0) and exact_key(1) != exact_key(True) and exact_key(1.0) != exact_key(True)
    assert exact_key([1, 2]) != exact_key((1, 2))
    assert exact_key([1, 2]) != exact_key([2, 1])
    assert exact_key([[1, 2]]) != exact_key([[1, True]])
    assert exact_key({"a": 1, "b": 2}) != exact_key({"b": 2, "a": 1})
    assert exact_key(["min", {"max_blockwise_dynamic_range": {"block_size": 4}}]) == exact_key(
        ["min", {"max_blockwise_dynamic_range": {"block_size": 4}}]
    )
    assert exact_key(None) is None and exact_key("x") == "x"
    with pytest.raises(TypeError):
        exact_key([object(), {1, 2}])


def test_memoized_needs_a_session_and_is_per_session(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    assert memoized("t", ("k",), compute) == 1 and memoized("t", ("k",), compute) == 2  # no session: no memo
    with debug_session(stats_config(), tmp_path / "a"):
        first = debug_api.session()
        assert memoized("t", ("k",), compute) == 3 and memoized("t", ("k",), compute) == 3
        assert memoized("t", ("k", 1.0), compute) == 4  # another key (1.0 is not 1)
        assert memoized("t", ["unhashable", {1}], compute) == 5 and memoized("t", ["unhashable", {1}], compute) == 6
    assert first.memo("t") == {}  # dropped at end_debug
    with debug_session(stats_config(), tmp_path / "b"):
        assert debug_api.session() is not first and debug_api.session().memo("t") == {}
        assert memoized("t", ("k",), compute) == 7  # the new session recomputes


# ------------------------------------------------------------------------------------------------ schedules
def hand_schedule(iteration, freq, start, end):
    """Oracle: (active, next active) for one [start, end] interval, counted by brute force."""

    def active(i):
        return i % freq == 0 and start <= i and (end is None or i <= end)

    nxt = next((i for i in range(iteration + 1, iteration + 10 * freq + 1) if active(i)), None)
    return active(iteration), nxt


def test_schedule_of_still_answers_per_iteration(tmp_path):
    with debug_session(stats_config(freq=3, start_step=2, end_step=13), tmp_path) as te:
        answers = [te.inspect_tensor_enabled("fc1", tensor_name="activation", iteration=i) for i in range(16)]
        assert answers == [hand_schedule(i, 3, 2, 13) for i in range(16)]
        assert answers[3] == (True, 6) and answers[12] == (True, None) and answers[0] == (False, 3)
        assert len(debug_api.session().memo("schedule")) == 1  # parsed once for all 16 calls


def test_schedule_of_follows_a_mutated_config(tmp_path):
    config = {"freq": 2}
    with debug_session(stats_config(), tmp_path):
        assert schedule_of(config).query(3) == (False, 4)
        config["freq"] = 5
        assert schedule_of(config).query(3) == (False, 5)
        config["freq"] = 5.0  # an invalid value is not served from the entry of freq=5
        with pytest.raises(ValueError, match="freq"):
            schedule_of(config)


# ------------------------------------------------------------------------------------------------ stats engine
class Capture:
    def __init__(self):
        self.records = []

    def log_scalar(self, name, value, iteration, **kw):
        self.records.append((name, value, iteration))


def test_engine_request_cache_and_identity_fast_path_keep_the_checks():
    log = Capture()
    engine = StatsEngine(log)
    x = torch.tensor([1.0, -2.0, 4.0])
    requests = (StatRequest("min", "min"), StatRequest("max", "max"))
    engine.feed("L", "activation", requests, x, iteration=0)
    engine.feed("L", "activation", requests, 2 * x, iteration=0)  # same tuple object: parsed once
    with pytest.raises(ValueError, match="one buffer must get the same stats every feed"):
        engine.feed("L", "activation", (StatRequest("mean", "mean"),), x, iteration=0)
    engine.step(0)
    assert log.records == [("L_activation_min", -4.0, 0), ("L_activation_max", 8.0, 0)]
    stats = ["min"]
    engine.feed("L", "gradient", stats, x, iteration=1)
    engine.step(1)
    stats[0] = "max"  # a mutated list is parsed again
    engine.feed("L", "gradient", stats, x, iteration=2)
    engine.step(2)
    assert log.records[2:] == [("L_gradient_min", -2.0, 1), ("L_gradient_max", 4.0, 2)]
    assert engine._request_cache
    engine.reset()
    assert not engine._request_cache


def test_two_sessions_do_not_share_caches(tmp_path):
    x = torch.arange(1.0, 5.0)
    sink_a, sink_b = RecordingSink(), RecordingSink()
    with debug_session(stats_config(), tmp_path / "a", sink_a) as te:
        te.inspect_tensor_enabled("fc1", tensor_name="activation")
        te.inspect_tensor("fc1", tensor=x, tensor_name="activation", iteration=0)
        first = debug_api.session()
        assert first.memo("schedule") and first.memo("LogTensorStats.plan") and first.stats._request_cache == {}
        debug_api.step()
    config = section({"LogTensorStats": {"enabled": True, "stats": ["mean", "cur_amax"], "tensors": ["activation"]}})
    with debug_session(config, tmp_path / "b", sink_b) as te:
        assert debug_api.session().memo("LogTensorStats.plan") == {}
        te.inspect_tensor_enabled("fc1", tensor_name="activation")
        te.inspect_tensor("fc1", tensor=-x, tensor_name="activation", iteration=0)
        debug_api.step()
    assert sink_a.values() == {("fc1_activation_min", 0): 1.0, ("fc1_activation_max", 0): 4.0}
    assert sink_b.values() == {("fc1_activation_mean", 0): -2.5, ("fc1_activation_cur_amax", 0): 4.0}


def test_plan_lines_and_feature_messages_are_written_once(tmp_path):
    layer = torch.nn.Linear(4, 4)
    import tedebug

    model = tedebug.convert_model(torch.nn.Sequential(layer))
    x = torch.randn(3, 4)
    with debug_session(stats_config(), tmp_path):
        for _ in range(3):
            model(x).sum().backward()
            debug_api.step()
        path = debug_api.session().text_log.path
        assert debug_api.session().log_message("unhashable extra", "L", logging.INFO, [1]) is True
        assert debug_api.session().log_message("unhashable extra", "L", logging.INFO, [1]) is False
        assert debug_api.session().log_message("plain", None) is True
        assert debug_api.session().log_message("plain", None) is False
    text = open(path, encoding="utf-8").read()
    plan_lines = re.findall(r"Tensor: activation, gemm (\w+) - (.+)", text)
    assert plan_lines == [("fprop", "High Precision"), ("wgrad", "High Precision")]
    assert text.count("API=look_at_tensor_before_process: activation") == 1
    assert text.count("unhashable extra") == 1 and text.count("plain") == 1


# ------------------------------------------------------------------------------------------------ sinks
JSON_VALUES = [
    0.1,
    -0.0,
    0.0,
    1e300,
    5e-324,
    2.5,
    3,
    True,
    float("nan"),
    float("inf"),
    -float("inf"),
    torch.tensor(0.75, dtype=torch.float64),
]


def test_jsonl_fast_lines_equal_json_dumps(tmp_path):
    path = tmp_path / "s.jsonl"
    sink = JsonlSink(str(path))
    expected = []
    for names in (("L_activation_max", "L", "activation", "max"), ('odd "name"\n\u00e9', None, "t", None)):
        for iteration, value in enumerate(JSON_VALUES * 2):  # the second round uses the cached name part
            sink.log_scalar(names[0], value, iteration, layer=names[1], tensor=names[2], stat=names[3])
            expected.append(
                json.dumps(
                    make_record(names[0], value, iteration, layer=names[1], tensor=names[2], stat=names[3]),
                    allow_nan=False,
                )
            )
    sink.log_scalars([("b", 1.5, 4, "x", "y", "z"), ("b", float("nan"), 5, "x", "y", "z")])
    expected += [
        '{"iteration": 4, "name": "b", "layer": "x", "tensor": "y", "stat": "z", "value": 1.5}',
        '{"iteration": 5, "name": "b", "layer": "x", "tensor": "y", "stat": "z", "value": null, "nonfinite": "nan"}',
    ]
    sink.close()
    assert path.read_text(encoding="utf-8").splitlines() == expected


class Ordered(Sink):
    def __init__(self):
        self.calls = []

    def log_scalar(self, name, value, iteration, *, layer=None, tensor=None, stat=None):
        self.calls.append((name, value, iteration, layer, tensor, stat))


class Plain:
    def __init__(self):
        self.calls = []

    def log_scalar(self, name, value, iteration):
        self.calls.append((name, value, iteration))


def test_text_sink_batches_and_levels(tmp_path):
    path = tmp_path / "stats.log"
    text, ordered, plain = TextStatsSink(str(path)), Ordered(), Plain()
    metrics = MetricLogger()
    for sink in (text, ordered, plain):
        metrics.add_sink(sink)
    records = [
        ("L_activation_min", -1.25, 3, "L", "activation", "min"),
        ("L_activation_std", math.nan, 3, "L", "activation", "std"),
    ]
    metrics.log_scalars(records)
    metrics.log_scalars([])
    text.log_scalar("dropped", 1.0, 3, level=logging.DEBUG)
    text.log_scalar("L_gradient_max", 2.0, 12, level=logging.WARNING)
    metrics.flush()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    assert re.fullmatch(
        ASCTIME + re.escape(" - INFO - L_activation_min" + TABS + "iteration=000003" + TABS + "value=-1.2500"), lines[0]
    )
    assert lines[1].endswith(" - INFO - L_activation_std" + TABS + "iteration=000003" + TABS + "value=nan")
    assert re.fullmatch(
        ASCTIME + re.escape(" - WARNING - L_gradient_max" + TABS + "iteration=000012" + TABS + "value=2.0000"), lines[2]
    )
    assert ordered.calls == records
    assert plain.calls == [r[:3] for r in records]
    metrics.close()
    text.log_scalar("after close", 1.0, 1)  # dropped, as a logger without handlers did
    assert len(path.read_text(encoding="utf-8").splitlines()) == 3


# ------------------------------------------------------------------------------------------------ row finalizers
def _same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))


@pytest.mark.parametrize(
    "data",
    [
        [1.0, -2.0, 0.0, 4.0],  # hand-checked below
        [3.5],  # numel 1: std is NaN
        [0.0, 0.0, 0.0],  # no non-zero element: dynamic_range is +inf
        [1e-30, -7.25, 1e30, 0.5],
    ],
)
def test_buffer_finalizers_equal_finalize(data):
    """A buffer's generated row function gives exactly `finalize`'s values (the emission fast path)."""
    from tedebug.backends import torch_ref
    from tedebug.stats.buffers import BufferKey, StatBuffer
    from tedebug.stats.definitions import HP_KINDS, NUMEL, Column, finalize

    requests = tuple(StatRequest.parse_hp(kind) for kind in HP_KINDS) + (StatRequest.blockwise(2, 1, False),)
    buffer = StatBuffer(BufferKey("l", "activation", ()), requests, is_weight=False)
    x = torch.tensor(data, dtype=torch.float32)
    partials = {Column(k): float(v) for k, v in torch_ref.basic_partials(x).items()}
    partials[NUMEL] = float(x.numel())
    partials[Column("block_dr", (2, 1, False))] = 1.25
    row = [partials[c] for c in buffer.columns]
    values = dict(zip(buffer.columns, row))
    evaluated = buffer.emitters.values_of(row)
    for (name, stat), value, request in zip(buffer.emitters.names, evaluated, requests, strict=True):
        assert (name, stat) == (f"l_activation_{request.name}", request.name)
        assert _same_float(value, finalize(request, values)), request.name
    got = {stat: value for (_, stat), value in zip(buffer.emitters.names, evaluated)}
    if data == [1.0, -2.0, 0.0, 4.0]:  # mean 3/4, Σ(x-m)² = 0.0625+7.5625+0.5625+10.5625 = 18.75
        assert (got["min"], got["max"], got["mean"], got["l1_norm"], got["cur_amax"]) == (-2.0, 4.0, 0.75, 7.0, 4.0)
        assert got["std"] == math.sqrt(18.75 / 3) and got["l2_norm"] == math.sqrt(21.0)
        assert got["dynamic_range"] == 2.0 and got["max_blockwise_dynamic_range_block_size_2_dims_1"] == 1.25
    if len(data) == 1:
        assert math.isnan(got["std"])
    if not any(data):
        assert got["dynamic_range"] == math.inf


@pytest.mark.parametrize(
    "stats", [("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"), ("max", "nan_count")]
)
def test_feed_gathers_the_row_from_a_backend_vector(monkeypatch, stats):
    """A backend offering `basic_partials_row` (the CuPy kernel's output vector) gives the same rows, bit for bit,
    as the per-partial path; the gather follows the backend's own key order (shuffled here)."""
    import types
    from tedebug.backends import torch_ref
    from tedebug.stats import engine as engine_module
    from tedebug.stats.readback import RowsInFlight

    keys = tuple(reversed(torch_ref.BASIC_KEYS))  # every basic partial, in an order other than the engine's
    calls = []

    def basic_partials_row(x):
        calls.append(x)
        partials = torch_ref.basic_partials(x)
        return torch.stack([partials[k] for k in keys])

    vector_backend = types.SimpleNamespace(
        BASIC_KEYS=keys, basic_partials_row=basic_partials_row, basic_partials=torch_ref.basic_partials
    )
    feeds = [
        torch.tensor([1.0, -2.0, 0.0, 4.0]),
        torch.tensor([float("nan"), 3.0, float("-inf")]),
        torch.tensor([[0.5, 0.0], [-0.25, 8.0]], dtype=torch.bfloat16),
    ]
    rows = {}
    for name, backend in (("reference", None), ("vector", vector_backend)):
        if backend is not None:
            monkeypatch.setattr(engine_module, "backend_for", lambda x, b=backend: b)
        engine = StatsEngine(RecordingSink())
        for i, x in enumerate(feeds):
            engine.feed(f"l{i}", "activation", stats, x, iteration=0)
        fed = engine._store.fed()
        host = RowsInFlight(fed).host_rows()  # each buffer's row as the step reads it back
        rows[name] = [host[b.key] for b in fed]
    assert len(calls) == len(feeds)
    assert len(rows["vector"]) == len(feeds) and all(
        len(r) == len(rows["reference"][i]) for i, r in enumerate(rows["vector"])
    )
    for ref_row, vec_row in zip(rows["reference"], rows["vector"]):
        assert all(_same_float(a, b) for a, b in zip(ref_row, vec_row)), (ref_row, vec_row)
    assert rows["reference"][0][0] == 4.0 and rows["reference"][2][0] == 4.0  # numel column


def test_slab_rows_equal_the_reference_rows_with_microbatches_and_weights(monkeypatch):
    """A backend writing whole rows into the step's slab (`basic_stats_into`) emits exactly what the reference path
    emits: several feeds of one buffer merged, a weight keeping its first feed, key order of the backend followed
    (shuffled here), more rows than one slab chunk, and the slab reused by the next step."""
    from tedebug.backends import torch_ref
    from tedebug.stats import engine as engine_module
    from tedebug.stats import slab as slab_module

    monkeypatch.setattr(slab_module, "CHUNK_ROWS", 3)
    keys = tuple(reversed(torch_ref.BASIC_KEYS))  # every basic partial, in an order other than the engine's
    stats = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range", "nan_count")
    gen = torch.Generator().manual_seed(3)
    feeds = [
        ("l0", "activation", torch.randn(64, generator=gen) * 3 + 1, False),
        ("l0", "activation", torch.randn(40, generator=gen), False),  # second microbatch: merged
        ("l0", "weight", torch.randn(16, generator=gen), True),
        ("l0", "weight", torch.randn(16, generator=gen) + 5, True),  # a weight keeps its first feed
        ("l1", "gradient", torch.tensor([float("nan"), 3.0, float("-inf"), 0.0]), False),
        ("l2", "output", torch.tensor([[0.5, 0.0], [-0.25, 8.0]], dtype=torch.bfloat16), False),
        ("l3", "dgrad", torch.tensor([0.0, 0.0]), False),
    ]
    results = {}
    calls = []
    steps = 3
    for name, backend, defer in (
        ("reference", None, False),
        ("slab", slab_backend(keys, calls), False),
        ("deferred", slab_backend(keys, calls), True),
    ):
        if backend is not None:
            monkeypatch.setattr(engine_module, "backend_for", lambda x, b=backend: b)
        sink = RecordingSink()
        engine = StatsEngine(sink, defer_read_back=defer)
        for step in range(steps):
            for layer, tensor, x, is_weight in feeds:
                engine.feed(layer, tensor, stats, x * (step + 1), iteration=step, is_weight=is_weight)
            engine.step(step)
            # deferred: a step's rows stay in their slab (not overwritten by the next step's) until the next step
            assert len(sink.rows) == (step + (not defer)) * 5 * len(stats)
        engine.finish_pending()
        results[name] = sink.rows
    assert len(engine._slabs) == len(engine._spare_slabs) == 1  # two alternating sets, not one per step
    assert len(calls) == 2 * steps * (len(feeds) - 1)  # the second weight feed is never computed
    assert len(results["slab"]) == len(results["reference"]) == steps * 5 * len(stats)
    assert repr(results["deferred"]) == repr(results["slab"])  # repr: NaN equals NaN
    for ref, got in zip(results["reference"], results["slab"]):
        assert ref[0] == got[0] and ref[2] == got[2]
        assert _same_float(ref[1], got[1]) or abs(ref[1] - got[1]) <= 1e-12 * abs(ref[1]), (ref, got)
    merged_mean = [r for r in results["slab"] if r[0] == "l0_activation_mean"][0][1]
    first, second = feeds[0][2].double(), feeds[1][2].double()
    assert abs(merged_mean - torch.cat([first, second]).mean().item()) < 1e-12


def test_jsonl_batched_lines_equal_json_dumps_on_every_round(tmp_path):
    """`log_scalars`' cached-names path (all-str names, finite values) writes exactly `json.dumps`' line; look-alike
    keys of other types (layer 1 vs "1", None) never reuse a str entry."""
    path = tmp_path / "b.jsonl"
    sink = JsonlSink(str(path))
    names = [
        ("L_activation_max", "L", "activation", "max"),
        ("1_t_s", "1", "t", "s"),
        ("1_t_s", 1, "t", "s"),
        ('q"\u00e9', None, "t", "s"),
        ("1_t_s", "1", "t", "s"),
    ]
    values = [1.5, -0.0, 1e-310, float("inf"), torch.tensor(2.25, dtype=torch.float64), 7, float("nan")]
    expected = []
    for round_ in range(3):
        records = [
            (n, v, round_ * 10 + i, layer, tensor, stat)
            for i, (v, (n, layer, tensor, stat)) in enumerate(zip(values * 2, names * 3))
        ]
        sink.log_scalars(records)
        expected += [
            json.dumps(make_record(n, v, it, layer=layer, tensor=tensor, stat=stat), allow_nan=False)
            for n, v, it, layer, tensor, stat in records
        ]
    sink.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines == expected
    assert '"layer": 1,' in lines[2] and '"layer": "1",' in lines[1]


# ------------------------------------------------------------------------------------------------ compiled answers
def _plans(qs):
    return {
        role: (
            q.inspect_tensor_enabled,
            q.rowwise_tensor_plan,
            q.columnwise_tensor_plan,
            q.rowwise_postquantize_enabled,
            q.columnwise_postquantize_enabled,
            q.get_next_debug_iter(),
        )
        for role, q in qs.items()
    }


def test_unserved_and_schedule_only_hooks_never_reach_a_hook_call(tmp_path, monkeypatch):
    """Hooks no feature serves for a routing key, and LogTensorStats' schedule-only inspect_tensor_enabled, are
    answered by the compiled plans: no hook call through the namespace at any construction; a hook overridden on the
    instance is called every time."""
    from tedebug.debug_quantization import DebugQuantizer
    from tedebug.namespace import TransformerEngineNamespace
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

    calls = []
    real_call = TransformerEngineNamespace._call

    def counting_call(self, hook, layer_name, kwargs):
        calls.append((hook, kwargs.get("gemm"), kwargs.get("tensor_name")))
        return real_call(self, hook, layer_name, kwargs)

    monkeypatch.setattr(TransformerEngineNamespace, "_call", counting_call)
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freq": 2}})
    with debug_session(config, tmp_path) as api:

        def build():
            return {
                t: DebugQuantizer(
                    "L", t, Float8CurrentScalingQuantizer() if t in ("activation", "weight") else None, None
                )
                for t in ("activation", "weight", "output")
            }

        first = _plans(build())
        debug_api.step()
        second = _plans(build())
        assert calls == []
        assert first["activation"] == (True, "Quantize", "Quantize", False, False, 2)  # freq 2: iteration 0
        assert second["activation"] == (False, "Quantize", "Quantize", False, False, 2)
        assert first["weight"] == second["weight"] == (False, "Quantize", "Quantize", False, False, None)
        assert first["output"] == (False, "High Precision", None, False, False, None)

        patched = []
        real_fp8 = api.fp8_gemm_enabled

        def fp8_gemm_enabled(layer_name, **kwargs):
            patched.append(kwargs["gemm"])
            return real_fp8(layer_name, **kwargs)

        api.fp8_gemm_enabled = fp8_gemm_enabled  # an instance-level override is always called
        build()
        build()
        assert patched == ["fprop", "wgrad", "fprop", "dgrad"] * 2


def test_scheduled_answers_equal_the_features_answers_and_note_the_next_iteration(tmp_path, monkeypatch):
    """The plans' answers for hooks served by schedule-only features equal, iteration after iteration, what calling
    the features through the namespace gives (several features combined), and record the same next iterations in
    the stats engine in the same order; a feature with its own `inspect_tensor_enabled` is called every time."""
    from tedebug.debug_quantization import DebugQuantizer

    config = section(
        {
            "LogTensorStats": {
                "enabled": True,
                "stats": ["max"],
                "tensors": ["activation", "weight"],
                "freq": 3,
                "start_step": 2,
            },
            "LogFp8TensorStats": {
                "enabled": True,
                "stats": ["underflows%"],
                "tensors": ["activation"],
                "start_end_list": [[4, 5], [9, 9]],
            },
            "DumpTensors": {"enabled": True, "tensors": ["weight"], "freq": 4, "high_precision_tensor": True},
        }
    )
    with debug_session(config, tmp_path) as api:
        notes = []
        real_note = api._session.stats.note_next_iteration
        monkeypatch.setattr(
            api._session.stats,
            "note_next_iteration",
            lambda layer, nxt: (notes.append((layer, nxt)), real_note(layer, nxt)),
        )
        for it in range(12):
            for tensor in ("activation", "weight", "output"):
                notes.clear()
                called = api.inspect_tensor_enabled("L", tensor_name=tensor, iteration=it)
                called_notes = list(notes)
                notes.clear()
                q = DebugQuantizer("L", tensor, None, None)
                assert (q.inspect_tensor_enabled, q.get_next_debug_iter()) == called, (tensor, it)
                assert notes == called_notes, (tensor, it)
            debug_api.step()
