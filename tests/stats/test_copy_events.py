"""`wait_for_copies`: the deferred read-back blocks on a copy's event only while that copy is still pending.

Counting calls on stand-in events (any machine), and on a CUDA device the CUDA calls themselves, seen by the
profiler: a landed copy costs a ``cudaEventQuery`` and no ``cudaEventSynchronize``; a copy queued behind a long
kernel is waited for (the synchronize is made, and the host sees the copied values afterwards).  The tests marked
``gpu`` need CUDA and CuPy (skipped otherwise, tests/conftest.py)."""

import pytest
import torch

from tedebug.stats.copy_events import wait_for_copies


class _Event:
    """A stand-in ``torch.cuda.Event`` that counts its calls."""

    def __init__(self, done):
        self.done = done
        self.queries = 0
        self.waits = 0

    def query(self):
        self.queries += 1
        return self.done

    def synchronize(self):
        self.waits += 1
        self.done = True


def test_a_completed_event_is_asked_and_not_waited_on():
    events = [_Event(True), _Event(True)]
    wait_for_copies(events)
    assert [(e.queries, e.waits) for e in events] == [(1, 0), (1, 0)]


def test_only_the_pending_events_are_waited_on():
    events = [_Event(True), _Event(False), _Event(True), _Event(False)]
    wait_for_copies(iter(events))  # any iterable: the distributed exchange passes a tuple
    assert [(e.queries, e.waits) for e in events] == [(1, 0), (1, 1), (1, 0), (1, 1)]
    assert all(e.done for e in events)


def _cuda_calls(action):
    """The names of the CUDA runtime calls `action()` makes, as the profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        action()
    return [e.name for e in prof.events() if e.name.startswith("cuda")]


def _copy_with_event(before_copy=None):
    device_values = torch.arange(4096, dtype=torch.float64, device="cuda")
    host = torch.empty(device_values.shape, dtype=torch.float64, pin_memory=True)
    if before_copy is not None:
        before_copy()
    host.copy_(device_values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


@pytest.mark.gpu
def test_a_landed_copy_makes_no_waiting_cuda_call():
    host, event = _copy_with_event()
    torch.cuda.synchronize()
    calls = _cuda_calls(lambda: wait_for_copies([event]))
    assert "cudaEventSynchronize" not in calls and "cudaEventQuery" in calls
    assert torch.equal(host, torch.arange(4096, dtype=torch.float64))


@pytest.mark.gpu
def test_a_pending_copy_is_waited_for():
    host, event = _copy_with_event(before_copy=lambda: torch.cuda._sleep(200_000_000))  # ~0.1 s of GPU time first
    calls = _cuda_calls(lambda: wait_for_copies([event]))
    assert "cudaEventSynchronize" in calls
    assert event.query()
    assert torch.equal(host, torch.arange(4096, dtype=torch.float64))
