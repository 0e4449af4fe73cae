"""``nvdlfw_inspect.utils``: distributed helpers and `append_parent_docstring`.

Every collective works on ``.detach()``-ed tensors (all-gathering a tensor that requires grad fails under gloo).
Without torch.distributed (or with one rank) the gathers return the input unchanged and no handle.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

__all__ = [
    "append_parent_docstring",
    "gather_along_first_dim",
    "gather_tensor_on_last_rank",
    "get_distributed_rank",
    "get_distributed_world_size",
]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def get_distributed_world_size(group: Any = None) -> int:
    return torch.distributed.get_world_size(group) if _distributed() else 1


def get_distributed_rank(group: Any = None) -> int:
    return torch.distributed.get_rank(group) if _distributed() else 0


def gather_along_first_dim(
    tensor: torch.Tensor, process_group: Any = None, async_op: bool = False
) -> Tuple[torch.Tensor, Any]:
    """All-gather `tensor` over `process_group` along dim 0: ``(gathered, work handle or None)``."""
    world = get_distributed_world_size(process_group)
    if world == 1:
        return tensor, None
    local = tensor.detach().contiguous()
    out = torch.empty((world * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
    handle = torch.distributed.all_gather_into_tensor(out, local, group=process_group, async_op=async_op)
    return out, handle


def gather_tensor_on_last_rank(
    tensor: torch.Tensor, process_group: Any = None, async_op: bool = False
) -> Tuple[Optional[torch.Tensor], Any]:
    """Gather `tensor` along dim 0 on the last rank of `process_group`: ``(gathered on that rank else None,
    handle)``."""
    world = get_distributed_world_size(process_group)
    if world == 1:
        return tensor, None
    local = tensor.detach().contiguous()
    last = world - 1
    dst = torch.distributed.get_global_rank(process_group, last) if process_group is not None else last
    is_dst = get_distributed_rank(process_group) == last
    parts = [torch.empty_like(local) for _ in range(world)] if is_dst else None
    handle = torch.distributed.gather(local, parts, dst=dst, group=process_group, async_op=async_op)
    if not is_dst:
        return None, handle
    if handle is not None:
        handle.wait()
        handle = None
    return torch.cat(parts, dim=0), handle


def append_parent_docstring(parent: type):
    """Class decorator: append `parent`'s docstring to the decorated class's docstring."""

    def decorate(cls: type) -> type:
        cls.__doc__ = "\n".join(part for part in (cls.__doc__ or "", parent.__doc__ or "") if part)
        return cls

    return decorate
