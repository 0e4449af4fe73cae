"""Reduction of statistic partials across ranks (torch.distributed).

Only partial rows travel, never tensors.  Per reduction group and step exactly one collective runs:
``all_gather_object`` of this rank's ``{buffer key: (columns, row values[, replica id])}``.  Because every rank sends a
(possibly empty) dict, ranks with different buffer sets never deadlock; each rank then merges, in rank order, the
rows of the ranks that fed each of *its* buffers, so all ranks of a group that fed a buffer compute identical
values.  Groups are visited in an order that depends only on their member ranks, identical on every rank.
This is the synchronous reduction; `tedebug.stats.distributed` reduces without waiting (deferred read-back).
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from tedebug.stats.definitions import Column, combine_rows

#: what one rank contributes for one buffer: its columns and the float values of its row
HostRow = Tuple[Tuple[Column, ...], List[float]]
_Key = TypeVar("_Key", bound=Hashable)


def distributed_ready() -> bool:
    """True when torch.distributed is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def needs_communication() -> bool:
    """True when torch.distributed is initialised with more than one rank (a single rank reduces locally)."""
    return distributed_ready() and dist.get_world_size() > 1


def group_order_key(group: Any) -> Tuple[Tuple[int, ...], str]:
    """A rank-independent sort key of a reduction group (None = the default / world group)."""
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size())), ""
    return tuple(dist.get_process_group_ranks(group)), str(getattr(group, "group_name", ""))


def ordered_groups(groups: Sequence[Any]) -> List[Any]:
    """Distinct groups sorted by `group_order_key` (None and the WORLD object count as one group)."""
    unique: Dict[Tuple[Tuple[int, ...], str], Any] = {}
    for group in groups:
        unique.setdefault(group_order_key(group), group)
    return [unique[k] for k in sorted(unique)]


def gather_rows(local: Dict[_Key, tuple], group: Any) -> Dict[_Key, List[HostRow]]:
    """ONE ``all_gather_object`` over `group`; for each key of `local`, the rows of every rank that has it.

    An entry may carry a third element, a replica id (`tedebug.stats.distributed.replica_id`; -1 for none): of
    the rows with one replica id >= 0 (copies of one tensor on the ranks of a TP group) only the first is kept."""
    world = dist.get_world_size(group)
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    return {
        key: keep_first_replicas(
            [((g[key][0], g[key][1]), g[key][2] if len(g[key]) > 2 else -1.0) for g in gathered if key in g]
        )
        for key in local
    }


def keep_first_replicas(rows: Sequence[Tuple[Any, float]]) -> List[Any]:
    """`rows` as (row, replica id) in rank order, without the later rows of a replica already seen (ids < 0 are
    no replica: always kept)."""
    seen = set()
    out = []
    for row, replica in rows:
        if replica >= 0:
            if replica in seen:
                continue
            seen.add(replica)
        out.append(row)
    return out


def merge_host_rows(key: Hashable, rows: Sequence[HostRow]) -> Dict[Column, float]:
    """Merge the rows of several ranks (same columns required) into {column: value} on the host, in float64."""
    columns = rows[0][0]
    for other_columns, _ in rows[1:]:
        if tuple(other_columns) != tuple(columns):
            raise ValueError(
                f"statistics buffer {key!r}: ranks requested different statistics (partials {list(columns)} vs "
                f"{list(other_columns)}); every rank must log the same stats for a buffer"
            )
    matrix = torch.tensor([values for _, values in rows], dtype=torch.float64)
    merged = combine_rows(columns, matrix) if len(rows) > 1 else matrix[0]
    return dict(zip(columns, merged.tolist()))
