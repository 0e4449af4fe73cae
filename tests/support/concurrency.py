"""Helpers of the host-path tests: the aten operators a piece of code runs, and a body run by two threads at once."""

from __future__ import annotations

import threading
from typing import Callable, List

from torch.utils._python_dispatch import TorchDispatchMode


class AtenCounter(TorchDispatchMode):
    """Records the aten operators that run on tensors while it is active: `ops` holds their packet names
    (``"sum"``, ``"_to_copy"``), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def run_in_two_threads(work: Callable[[int], list], repeats: int) -> List[list]:
    """Run ``work(i)`` `repeats` times in each of two threads released together (i = 0, 1); the lists of what each
    thread's calls returned."""
    results: List[list] = [[], []]
    barrier = threading.Barrier(2)

    def body(i: int) -> None:
        barrier.wait()
        for _ in range(repeats):
            results[i].append(work(i))

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
