"""Feature scheduling (TransformerEngine's rules, except that a negative end_step means no end and bad values are
errors): hand-derived values and a brute-force oracle."""

import pathlib
import random

import pytest

from tedebug.config import Schedule, load_config, parse_feature_config

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
FEATURE_NAMES = {"transformer_engine": {"LogTensorStats", "LogFp8TensorStats"}, "base": {"LogTensorStats"}}


def brute_force(freq, intervals, i, horizon=400):
    """Independent oracle: scan iterations one by one (intervals inclusive, None = no end)."""

    def active(k):
        return k % freq == 0 and any(s <= k and (e is None or k <= e) for s, e in intervals)

    later = next((k for k in range(i + 1, horizon) if active(k)), None)
    return active(i), later


def test_divisible_by_3_or_5_from_log_config():
    config = load_config(CONFIGS / "log_config.yaml", feature_names=FEATURE_NAMES)
    features = config.layer_config("decoder.1.mlp.fc1")["transformer_engine"]
    schedules = [
        Schedule.from_config(
            parse_feature_config(cfg, tensor_name="activation", gemm_parsing=False, tensor_parsing=True)
        )
        for cfg in features.values()
    ]
    assert schedules == [Schedule(freq=3, start_step=1), Schedule(freq=5, start_step=1)]
    for i in range(1, 20):
        assert any(s.query(i)[0] for s in schedules) == (i % 3 == 0 or i % 5 == 0), i
    assert [s.query(0)[0] for s in schedules] == [False, False]  # start_step 1 excludes 0
    # next iterations (the combined value is the min of the non-None ones)
    assert [s.query(0) for s in schedules] == [(False, 3), (False, 5)]
    assert [s.query(3) for s in schedules] == [(True, 6), (False, 5)]
    assert [s.query(15) for s in schedules] == [(True, 18), (True, 20)]


def test_defaults_and_inclusive_end():
    assert Schedule().query(0) == (True, 1)
    assert Schedule(freq=2, start_step=2, end_step=6).query(2) == (True, 4)
    assert [i for i in range(12) if Schedule(freq=2, start_step=2, end_step=6).query(i)[0]] == [2, 4, 6]
    assert Schedule(freq=2, start_step=2, end_step=6).query(6) == (True, None)
    assert Schedule(freq=2, start_step=2, end_step=6).query(0) == (False, 2)
    assert Schedule(end_step=0).query(0) == (True, None)  # end_step 0 = only iteration 0


def test_freq_counts_absolute_iterations():
    assert [i for i in range(20) if Schedule(freq=3, start_step=1).query(i)[0]] == [3, 6, 9, 12, 15, 18]


def test_negative_end_step_means_no_end():
    for end in (-1, -5, None):
        schedule = Schedule(freq=4, start_step=2, end_step=end)
        assert schedule.query(2) == (False, 4)
        assert schedule.query(1000) == (True, 1004)


def test_start_end_list_overrides_start_and_end_and_is_sorted():
    schedule = Schedule(freq=2, start_step=100, end_step=200, start_end_list=[[10, 20], [0, 4]])
    assert schedule.intervals == ((0, 4), (10, 20))
    assert schedule.query(0) == (True, 2)
    assert schedule.query(3) == (False, 4)
    assert schedule.query(4) == (True, 10)
    assert schedule.query(5) == (False, 10)
    assert schedule.query(20) == (True, None)
    assert schedule.query(150) == (False, None)
    # empty list: start/end apply
    assert Schedule(start_step=3, end_step=3, start_end_list=[]).query(3) == (True, None)


def test_next_active_when_no_multiple_fits_an_interval():
    schedule = Schedule(freq=10, start_end_list=[[1, 5], [11, 19], [25, 30]])
    assert schedule.query(0) == (False, 30)  # 0 lies in no interval; 10 and 20 neither
    assert schedule.query(30) == (True, None)


def test_matches_brute_force_oracle():
    rng = random.Random(1234)
    for _ in range(300):
        freq = rng.randint(1, 7)
        if rng.random() < 0.5:
            pairs = []
            for _ in range(rng.randint(1, 4)):
                start = rng.randint(0, 60)
                pairs.append([start, start + rng.randint(0, 25)])
            schedule, intervals = Schedule(freq=freq, start_end_list=pairs), sorted(map(tuple, pairs))
        else:
            start = rng.choice([None, rng.randint(0, 60)])
            end = rng.choice([None, -1, (start or 0) + rng.randint(0, 80)])
            schedule = Schedule(freq=freq, start_step=start, end_step=end)
            intervals = [(start or 0, None if end is None or end < 0 else end)]
        for i in range(0, 160, 3):
            assert schedule.query(i) == brute_force(freq, intervals, i), (freq, intervals, i)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"freq": 0}, "freq must be an integer >= 1, got 0"),
        ({"freq": -2}, "freq must be an integer >= 1"),
        ({"freq": True}, "freq must be an integer >= 1"),
        ({"freq": 1.5}, "freq must be an integer >= 1"),
        ({"start_step": -1}, "start_step must be an integer >= 0"),
        ({"start_step": 7, "end_step": 3}, "start_step 7 must be <= end_step 3"),
        ({"end_step": "10"}, "end_step must be an integer"),
        ({"start_end_list": [[5, 3]]}, r"start_end_list\[0\] = \[5, 3\] must satisfy 0 <= start <= end"),
        ({"start_end_list": [[0, 2], [-1, 3]]}, r"start_end_list\[1\] = \[-1, 3\] must satisfy"),
        ({"start_end_list": [[0, -1]]}, r"start_end_list\[0\] = \[0, -1\] must satisfy"),
        ({"start_end_list": [[1, 2, 3]]}, r"start_end_list\[0\] must be a pair"),
        ({"start_end_list": [["1", 2]]}, r"start_end_list\[0\] must hold two integers"),
    ],
)
def test_invalid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Schedule(**kwargs)


def test_from_config_ignores_other_keys():
    schedule = Schedule.from_config({"tensor": "activation", "stats": ["max"], "freq": 5, "start_end_list": [[0, 9]]})
    assert schedule == Schedule(freq=5, start_end_list=[(0, 9)])
    assert schedule.query(5) == (True, None)
    assert repr(schedule) == "Schedule(freq=5, intervals=[(0, 9)])"
    nulls = {"freq": None, "start_step": None, "end_step": None, "start_end_list": None}
    assert Schedule.from_config(nulls) == Schedule() and Schedule().query(7) == (True, 8)
