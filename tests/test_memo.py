"""`tedebug.memo.memoized`, the one per-session memo of the features, counted with call counters: a value is
computed once per session and distinct key content, a changed config gets a fresh value, a failure stores nothing;
and `schedule_of`, which parses a config's schedule through it."""

from __future__ import annotations

import pytest

from tedebug import debug_api
from tedebug.features.base import schedule_of
from tedebug.memo import memoized

from support.features import debug_session, section

CONFIG = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"]}})


class Counter:
    """A `compute` that counts its calls and returns a new object each time."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return object()


def test_same_content_shares_one_value_and_changed_content_gets_a_new_one(tmp_path):
    compute = Counter()
    with debug_session(CONFIG, tmp_path):
        config = {"a": 5, "b": ["x", "y"]}

        def value(cfg):
            return memoized("t", (cfg.get("a"), cfg.get("b")), compute)

        first = value(config)
        assert value(config) is first and value(dict(config, b=["x", "y"])) is first and compute.calls == 1
        config["a"] = 5.0  # an equal value of another type: another key
        assert value(config) is not first and compute.calls == 2
        config["a"] = True
        assert value(config) is not first and compute.calls == 3
        config["a"] = 5
        assert value(config) is first and compute.calls == 3
        config["b"][1] = "z"  # an item replaced in place
        replaced = value(config)
        assert replaced is not first and compute.calls == 4
        config["b"].append("w")  # the list grown in place
        assert value(config) is not replaced and compute.calls == 5
        config["b"] = ("x", "y")  # a tuple is not the list
        assert value(config) is not first and compute.calls == 6
        config["b"] = ["x", "y"]
        assert value(config) is first and compute.calls == 6
        nested = {"a": [[1, 2], {"k": [3]}], "b": None}
        assert value(nested) is value(nested) and compute.calls == 7
        nested["a"][1]["k"][0] = 4  # deep inside: still another key
        assert value(nested) is not None and compute.calls == 8


def test_no_session_or_an_unhashable_key_computes_every_time(tmp_path):
    compute = Counter()
    memoized("t", "k", compute)
    memoized("t", "k", compute)
    assert compute.calls == 2
    with debug_session(CONFIG, tmp_path):
        memoized("t", ["a", {1, 2}], compute)  # a set inside: not a key
        memoized("t", ["a", {1, 2}], compute)
        assert compute.calls == 4 and debug_api.session().memo("t") == {}


def test_values_die_with_their_session(tmp_path):
    compute = Counter()
    with debug_session(CONFIG, tmp_path / "a"):
        first = memoized("t", "k", compute)
        assert memoized("t", "k", compute) is first
        ended = debug_api.session()
    assert ended.memo("t") == {}
    with debug_session(CONFIG, tmp_path / "b"):
        assert memoized("t", "k", compute) is not first and compute.calls == 2


def test_a_failing_compute_stores_nothing(tmp_path):
    calls = []

    def fail():
        calls.append(1)
        raise ValueError("bad")

    with debug_session(CONFIG, tmp_path):
        for _ in range(2):
            with pytest.raises(ValueError, match="bad"):
                memoized("raising", "k", fail)
        assert len(calls) == 2 and debug_api.session().memo("raising") == {}


def test_schedule_of_is_parsed_once_per_content_and_follows_a_mutated_config(tmp_path):
    with debug_session(CONFIG, tmp_path):
        config = {"freq": 2, "start_end_list": [[0, 9]]}
        assert schedule_of(config).query(3) == (False, 4)
        config["start_end_list"][0][1] = 3
        assert schedule_of(config).query(2) == (True, None)
        plain = {"freq": 2, "start_step": 4}
        assert schedule_of(plain).query(4) == (True, 6)
        assert schedule_of(plain) is schedule_of(dict(plain))  # one entry for both objects
        plain["start_step"] = 6
        assert schedule_of(plain).query(4) == (False, 6)
        plain["freq"] = 2.0  # invalid, and not served from the entry of freq=2
        with pytest.raises(ValueError, match="freq"):
            schedule_of(plain)
