"""`HostBatch`: the basic statistics of a step's small CPU tensors, computed together when the step reads them.

A feed of a CPU tensor whose buffer asks only for basic statistics (min, max, sums, counts) does not reduce the
tensor: `stage` copies its elements, converted to float64 (exact), into a row of a per-step staging matrix, one
matrix per (element count, dtype).  The copy is needed because the caller may change the tensor in place after the
feed (an optimizer updating a weight before `debug_api.step()`); the matrices are kept and reused from step to step
(grown by doubling), so a feed allocates nothing.  `resolve` (called by `StatsEngine.step`, or by the first read of a
staged buffer's row) reduces every matrix with one call per reduction (`torch_ref.basic_partial_rows`: each row gets
the very values `basic_partial_values` gives its tensor alone) and replays the feeds in feed order into their buffers
(`StatBuffer.accumulate_host`): every buffer ends with exactly the row the per-feed path gives it, microbatches
merged in the same order, a weight keeping its first feed.  The microbatches of buffers first fed in the batch are
merged for all of them at once, a feed position at a time (`combine_row_batches`: each buffer gets the bits of
merging its own rows one by one).

Not staged (the caller computes the row at once instead): tensors above `HOST_PASS_MAX_NUMEL` elements, dtypes
outside `BATCH_DTYPES`, feeds while torch.compile traces, and a feed that would take the staged elements of the step
above `STAGED_ELEMENTS_MAX` (the memory the staging may hold).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from tedebug.backends.torch_ref import BASIC_ROW_KEYS, BATCH_DTYPES, HOST_PASS_MAX_NUMEL
from tedebug.host_numpy import compiling, host_view
from tedebug.stats.definitions import combine_row_batches

#: dtypes numpy reads without a copy (bfloat16 has no numpy dtype: torch converts it into the staging row)
_NUMPY_DTYPES = frozenset((torch.float32, torch.float64, torch.float16))
#: the most elements staged in one step (float64: 32 MB, plus twice that of scratch while the step reduces them)
STAGED_ELEMENTS_MAX = 1 << 22
#: the most elements the staging matrices keep between steps before they are dropped (and grown again as needed)
_KEPT_ELEMENTS_MAX = 2 * STAGED_ELEMENTS_MAX


def _no_reduction(rows: np.ndarray, dtype: torch.dtype) -> List[tuple]:
    raise RuntimeError("a staging group was reduced before any tensor was staged in it")


class _Group:
    """The staging matrix of one (element count, dtype): row i holds the i-th staged tensor of the step."""

    __slots__ = ("numel", "numel_value", "dtype", "rows", "count", "rows_tensor", "partial_rows")

    def __init__(self, numel: int, dtype: torch.dtype, capacity: int) -> None:
        self.numel = numel
        self.numel_value = float(numel)  # the numel column of every row of the group
        self.dtype = dtype
        self.rows = np.empty((capacity, numel))
        self.rows_tensor = torch.from_numpy(self.rows)
        self.count = 0
        #: the batch reduction (the backend's `basic_partial_rows`): float64 rows and their tensors' dtype -> one
        #: `BASIC_KEYS` tuple per row
        self.partial_rows: Callable[[np.ndarray, torch.dtype], List[tuple]] = _no_reduction

    def grow(self) -> None:
        """Double the matrix, its staged rows kept (`HostBatch.stage` takes row `count` while `count < len(rows)`)."""
        grown = np.empty((2 * len(self.rows), self.numel))
        grown[: self.count] = self.rows[: self.count]
        self.rows, self.rows_tensor = grown, torch.from_numpy(grown)


class HostBatch:
    """The staged feeds of one step of a `StatsEngine` (see the module docstring)."""

    def __init__(self) -> None:
        self._groups: Dict[Tuple[int, torch.dtype], _Group] = {}
        #: (buffer, group, row) per staged feed, in feed order
        self._staged: List[Tuple[Any, _Group, int]] = []
        self._staged_elements = 0
        self._lock = threading.RLock()  # feeds from several threads; a resolve reading a row resolves once

    def __len__(self) -> int:
        return len(self._staged)

    def stage(
        self, buffer: Any, tensor: torch.Tensor, partial_rows: Callable[[np.ndarray, torch.dtype], List[tuple]]
    ) -> bool:
        """Copy a CPU `tensor` (non-empty) for `buffer`'s basic row, to be reduced at `resolve` by `partial_rows` (the
        backend's `basic_partial_rows`); False (nothing done) when the batch does not take it (see the module
        docstring)."""
        n = tensor.numel()
        dtype = tensor.dtype
        if n > HOST_PASS_MAX_NUMEL or dtype not in BATCH_DTYPES or compiling():
            return False
        with self._lock:
            if self._staged_elements + n > STAGED_ELEMENTS_MAX:
                return False
            group = self._groups.get((n, dtype))
            if group is None:
                group = self._groups[(n, dtype)] = _Group(n, dtype, 4)
            index = group.count
            if index == len(group.rows):
                group.grow()
            group.count = index + 1
            group.partial_rows = partial_rows
            try:
                if dtype in _NUMPY_DTYPES:  # the elements in row-major order, as `reshape(-1)` orders them (`ravel`
                    # views a contiguous array; a strided one is copied in C order first); no shape object is built;
                    # (a view read without an autograd record, which leaves a parameter's storage resizable)
                    group.rows[index] = host_view(tensor).ravel()
                else:
                    if tensor.requires_grad:
                        tensor = tensor.detach()  # read without an autograd record
                    group.rows_tensor[index].view(tensor.shape).copy_(tensor)
            except (RuntimeError, TypeError, ValueError):  # e.g. a tensor numpy cannot read: the per-tensor path
                group.count -= 1
                return False
            self._staged.append((buffer, group, index))
            self._staged_elements += n
            buffer.staged += 1
            buffer.host_batch = self
        return True

    def resolve(self) -> None:
        """Reduce every staged tensor and merge its row into its buffer, in feed order; the staging is then empty."""
        with self._lock:
            staged = self._staged
            if not staged:
                return
            self._staged = []
            for buffer, _, _ in staged:
                buffer.staged = 0  # replayed below as the feeds they stand for
            try:
                values: Dict[_Group, List[tuple]] = {}
                for group in {id(group): group for _, group, _ in staged}.values():
                    values[group] = group.partial_rows(group.rows[: group.count], group.dtype)
                rows_of: Dict[Any, List[List[float]]] = {}  # buffer -> its staged rows, in feed order
                for buffer, group, index in staged:
                    gather = buffer.basic_host_gather
                    if gather is None:
                        gather = buffer.basic_host_gather = buffer.host_gather(BASIC_ROW_KEYS)
                    rows_of.setdefault(buffer, []).append(gather((group.numel_value,) + values[group][index]))
                chains: Dict[Tuple[Any, ...], List[Tuple[Any, List[List[float]]]]] = {}
                for buffer, rows in rows_of.items():
                    if len(rows) > 1 and not buffer.fed and not buffer.is_weight:
                        chains.setdefault(buffer.columns, []).append((buffer, rows))  # microbatches: merged below
                        continue
                    for values_row in rows:
                        if not buffer.fed:  # the step's first row (`staged` was reset above): kept as it is
                            buffer._host_row = values_row
                        else:
                            buffer.accumulate_host(values_row)  # merged with this step's earlier rows
                for columns, members in chains.items():
                    _merge_in_feed_order(columns, members)
            finally:
                self._release()

    def discard(self) -> None:
        """Forget the staged feeds without reducing them (their buffers were cleared)."""
        with self._lock:
            for buffer, _, _ in self._staged:
                buffer.staged = 0
            self._staged = []
            self._release()

    def _release(self) -> None:
        """Make every staging row free again; drop the matrices when they hold more than `_KEPT_ELEMENTS_MAX`."""
        kept = 0
        for group in self._groups.values():
            group.count = 0
            kept += group.rows.size
        self._staged_elements = 0
        if kept > _KEPT_ELEMENTS_MAX:
            self._groups.clear()


def _merge_in_feed_order(columns: Tuple[Any, ...], members: List[Tuple[Any, List[List[float]]]]) -> None:
    """Give each buffer of `members` ((buffer, its rows in feed order), none fed before, all of `columns`) the row
    that merging its rows one feed at a time gives (`StatBuffer.accumulate`: the running row with the next, by
    `combine_rows`), for all of them at once: at the j-th feed, one `combine_row_batches` of the buffers that have
    one, which gives each the bits `combine_rows` gives it."""
    running = torch.tensor([rows[0] for _, rows in members], dtype=torch.float64)  # [buffers, columns]
    for j in range(1, max(len(rows) for _, rows in members)):
        at = [m for m, (_, rows) in enumerate(members) if len(rows) > j]
        following = torch.tensor([members[m][1][j] for m in at], dtype=torch.float64)
        index = torch.tensor(at)
        running[index] = combine_row_batches(columns, torch.stack((running[index], following), dim=1))
    for m, (buffer, _) in enumerate(members):
        buffer.row = running[m]


__all__ = ["HostBatch", "STAGED_ELEMENTS_MAX"]
