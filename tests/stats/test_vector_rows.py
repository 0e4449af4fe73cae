"""A feed whose every partial is in the statistics vector a quantize kernel wrote for that very tensor keeps the
vector as its row (`StatBuffer.add_vector_row`): the feed runs no tensor op, and the step emits exactly what the
torch reference computes from the tensor (one feed, microbatches, a weight's first feed, a vector row merged with a
recomputed row, a vector without a numel entry).

The vectors here are built from the torch reference's own partials (the oracle), so the tests check the engine's
bookkeeping - which vector index lands in which column, how rows merge - not a quantize kernel."""

from __future__ import annotations

import math

import torch

from tedebug.backends import dispatch
from tedebug.backends.fused_stats import FP8_STATS_WITH_SCALE, ROWWISE_STATS, fused_vector
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer
from tedebug.stats import StatRequest, StatsEngine

from support.concurrency import AtenCounter
from support.features import RecordingSink
from support.kernel_inputs import with_reference_vector

#: the issue's LogFp8TensorStats setting, on the training recipe's rowwise operand
REQUESTS = tuple(
    StatRequest(name, name, recipe="") for name in ("underflows%", "mse", "scale_inv_min", "scale_inv_max")
)


def _bits(value):
    return ("nan",) if math.isnan(value) else (value, math.copysign(1.0, value))


def _inputs(seed, shapes=((16, 32), (8, 32), (24, 32))):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        x = torch.randn(*shape, generator=g) * (10.0 ** (i - 1))
        x[0, :5] = torch.tensor([0.0, -0.0, 1e-12, -3e-10, 2e-9])  # exact zeros and values that underflow
        out.append(x)
    return out


def _quantized(x, table=FP8_STATS_WITH_SCALE):
    """x quantized with FP8 current scaling, carrying a statistics vector laid out as `table` whose values are the
    torch reference's partials of that quantization."""
    return with_reference_vector(x, table)


def _emitted(feeds, *, reference, is_weight=False, steps=1, modify_after_quantize=()):
    """{(name, step): value bits} emitted for `feeds` (a list of (layer, x, q) per step); `reference`: the torch
    reference computes every partial (the vectors are ignored)."""
    log = RecordingSink()
    engine = StatsEngine(log)
    tensor = "weight" if is_weight else "activation"
    with dispatch.use_backend("torch" if reference else "auto"):
        for step in range(steps):
            for layer, x, q in feeds:
                engine.feed(layer, tensor, REQUESTS, x, iteration=step, quantized={"": q}, is_weight=is_weight)
            engine.step(step)
    return {(name, iteration): _bits(value) for name, value, iteration in log.rows}


def test_vector_rows_emit_what_the_reference_computes():
    feeds = [(f"layer{i}", x, _quantized(x)) for i, x in enumerate(_inputs(1))]
    expected = _emitted(feeds, reference=True, steps=2)
    assert len(expected) == 2 * len(feeds) * len(REQUESTS)
    assert any(bits[0] > 0 for (name, _), bits in expected.items() if name.endswith("underflows%"))
    assert _emitted(feeds, reference=False, steps=2) == expected


def test_microbatches_and_a_weights_first_feed():
    xs = _inputs(2)
    feeds = [("layer", x, _quantized(x)) for x in xs]  # three feeds of one buffer in one step
    assert _emitted(feeds, reference=False) == _emitted(feeds, reference=True)
    # a weight keeps its first feed: the same values as feeding only the first tensor
    first = _emitted(feeds[:1], reference=True, is_weight=True)
    assert _emitted(feeds, reference=False, is_weight=True) == first
    assert _emitted(feeds, reference=True, is_weight=True) == first


def test_a_vector_row_merges_with_a_recomputed_row():
    """The second microbatch's vector is stale (its tensor changed in place after quantization), so its row is
    computed from the tensor; the step merges it with the first feed's vector row."""
    a, b = _inputs(3)[:2]
    qa = _quantized(a)
    b_before = b.clone()
    qb = _quantized(b)
    b.mul_(1.0)  # same values, new version: the vector no longer counts as b's
    expected = _emitted(
        [("layer", a, qa), ("layer", b_before, Float8CurrentScalingQuantizer("E4M3").quantize(b_before))],
        reference=True,
    )
    assert _emitted([("layer", a, qa), ("layer", b, qb)], reference=False) == expected


def test_a_vector_without_numel_takes_the_feeds_numel():
    """ROWWISE_STATS (the block-scaled kernels' layout) has underflows and the squared error only."""
    requests = tuple(r for r in REQUESTS if r.name in ("underflows%", "mse"))
    xs = _inputs(4)
    out = {}
    for reference in (True, False):
        log = RecordingSink()
        engine = StatsEngine(log)
        quantized = [_quantized(x, ROWWISE_STATS) for x in xs]
        counter = AtenCounter()
        with dispatch.use_backend("torch" if reference else "auto"):
            engine.feed("warm", "activation", requests, xs[0], iteration=0, quantized={"": quantized[0]})
            with counter:
                for i, (x, q) in enumerate(zip(xs, quantized)):
                    engine.feed(f"l{i}", "activation", requests, x, iteration=0, quantized={"": q})
            engine.step(0)
        if not reference:  # the vectors were the rows: no partial computed at the feeds
            assert counter.ops == []
        out[reference] = {(name, it): _bits(v) for name, v, it in log.rows if name.startswith("l")}
    assert len(out[True]) == 2 * len(xs) and out[False] == out[True]


def test_the_feed_runs_no_tensor_op():
    x = _inputs(5)[0]
    q = _quantized(x)
    engine = StatsEngine(RecordingSink())
    engine.feed("warm", "activation", REQUESTS, x, iteration=0, quantized={"": q})  # parses the requests
    counter = AtenCounter()
    with counter:
        engine.feed("layer", "activation", REQUESTS, x, iteration=0, quantized={"": q})
    assert counter.ops == []
    # without a vector the same feed computes its partials with tensor ops
    plain = Float8CurrentScalingQuantizer("E4M3").quantize(x)
    plain.__dict__.pop("_fused_error_stats", None)
    with counter:
        engine.feed("other", "activation", REQUESTS, x, iteration=0, quantized={"": plain})
    assert counter.ops != []


def test_a_vector_missing_a_partial_is_not_used():
    """A vector laid out as ROWWISE_STATS lacks the scale_inv partials: the whole row is computed instead (the
    vector's values, overwritten with wrong ones, are not read), the same values as the torch reference."""
    x = _inputs(6)[0]
    q = _quantized(x, ROWWISE_STATS)
    fused_vector(q, x, "rowwise").vector.fill_(-1.0)  # wrong values: they must not be read
    got = _emitted([("layer", x, q)], reference=False)
    assert len(got) == len(REQUESTS)
    assert got == _emitted([("layer", x, _quantized(x, ROWWISE_STATS))], reference=True)
