"""torch.compile helpers of the tests: a backward under compiled autograd."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def compiled_backward() -> Iterator[None]:
    """Run the block's backward passes under torch._dynamo's compiled autograd (the "eager" backend: Dynamo's
    tracing without Inductor's code generation); Dynamo's caches are reset afterwards."""
    from torch._dynamo import compiled_autograd as module

    try:
        with module._enable(torch.compile(backend="eager")):
            yield
    finally:
        torch._dynamo.reset()
