"""Feature scheduling: `freq` / `start_step` / `end_step` / `start_end_list` -> (active now, next active iteration).

Semantics (TransformerEngine's, except that a negative `end_step` means "no end" and bad values are errors):
- intervals are `sorted(start_end_list)` when that list is non-empty, else one interval
  `[start_step or 0, end_step]`; both ends are inclusive;
- a missing or negative `end_step` means "no end" (TransformerEngine treats -1 as an empty range);
- iteration i is active iff `i % freq == 0` (absolute iteration numbers, not relative to the start) and i lies in
  some interval;
- the next active iteration after i is the first multiple of `freq` that is > i and inside an interval, or None.
Invalid values raise ValueError: `freq` < 1, negative `start_step`, `start_step` > `end_step`, and
`start_end_list` pairs that do not satisfy 0 <= start <= end.
"""

from __future__ import annotations

from typing import Optional, Sequence

SCHEDULE_KEYS = ("freq", "start_step", "end_step", "start_end_list")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_pair(pair, index: int) -> tuple:
    if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
        raise ValueError(f"start_end_list[{index}] must be a pair [start, end], got {pair!r}")
    start, end = pair
    if not (_is_int(start) and _is_int(end)):
        raise ValueError(f"start_end_list[{index}] must hold two integers, got {pair!r}")
    if not 0 <= start <= end:
        raise ValueError(f"start_end_list[{index}] = {list(pair)} must satisfy 0 <= start <= end")
    return (start, end)


def _ceil_to_multiple(value: int, freq: int) -> int:
    return -(-value // freq) * freq


class Schedule:
    """When a feature is active. `query(i)` is O(number of intervals)."""

    __slots__ = ("freq", "intervals")

    def __init__(self, freq=1, start_step=None, end_step=None, start_end_list=None):
        if not _is_int(freq) or freq < 1:
            raise ValueError(f"freq must be an integer >= 1, got {freq!r}")
        self.freq = freq
        if start_end_list:
            if isinstance(start_end_list, (str, bytes)) or not isinstance(start_end_list, Sequence):
                raise ValueError(f"start_end_list must be a list of [start, end] pairs, got {start_end_list!r}")
            self.intervals = tuple(sorted(_check_pair(p, i) for i, p in enumerate(start_end_list)))
        else:
            self.intervals = (self._single_interval(start_step, end_step),)

    @staticmethod
    def _single_interval(start_step, end_step) -> tuple:
        if start_step is None:
            start_step = 0
        if not _is_int(start_step) or start_step < 0:
            raise ValueError(f"start_step must be an integer >= 0 or null, got {start_step!r}")
        if end_step is not None and not _is_int(end_step):
            raise ValueError(f"end_step must be an integer or null (negative = no end), got {end_step!r}")
        if end_step is None or end_step < 0:
            return (start_step, None)
        if start_step > end_step:
            raise ValueError(f"start_step {start_step} must be <= end_step {end_step}")
        return (start_step, end_step)

    @classmethod
    def from_config(cls, cfg: dict) -> "Schedule":
        """The schedule described by the schedule keys of a (parsed) feature config; absent or null keys take
        the defaults."""
        freq = cfg.get("freq")
        return cls(
            freq=1 if freq is None else freq,
            start_step=cfg.get("start_step"),
            end_step=cfg.get("end_step"),
            start_end_list=cfg.get("start_end_list"),
        )

    def is_active(self, iteration: int) -> bool:
        if iteration % self.freq:
            return False
        for start, end in self.intervals:  # a plain loop: this runs for every logged tensor
            if start <= iteration and (end is None or iteration <= end):
                return True
        return False

    def next_active(self, iteration: int) -> Optional[int]:
        """The first active iteration strictly after `iteration`, or None when there is none."""
        for start, end in self.intervals:
            candidate = _ceil_to_multiple(max(iteration + 1, start), self.freq)
            if end is None or candidate <= end:
                return candidate
        return None

    def query(self, iteration: int) -> tuple:
        """`(active at iteration, next active iteration after it or None)`."""
        return self.is_active(iteration), self.next_active(iteration)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (self.freq, self.intervals) == (other.freq, other.intervals)

    def __hash__(self) -> int:
        return hash((self.freq, self.intervals))

    def __repr__(self) -> str:
        return f"Schedule(freq={self.freq}, intervals={list(self.intervals)})"
