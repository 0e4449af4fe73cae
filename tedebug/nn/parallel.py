"""Tensor and sequence parallelism of the `tedebug.nn` layers (Megatron / TransformerEngine conventions).

This module owns everything a layer needs to run split over a tensor-parallel (TP) group:

- `TensorParallel`: the checked constructor arguments ``tp_group``, ``tp_size``, ``parallel_mode`` (``"column"``,
  ``"row"`` or None) and ``sequence_parallel``, plus this rank's index in the group;
- the communication steps as autograd functions, all built on torch.distributed collectives (NCCL on CUDA tensors,
  gloo on CPU tensors; no host synchronisation): `copy_to_tp` (identity forward, all-reduce backward),
  `reduce_from_tp` (all-reduce forward), `gather_from_sp` (all-gather along the sequence dimension 0 forward,
  reduce-scatter backward), `reduce_scatter_to_sp` (the converse) and `scatter_to_sp` (take this rank's part of the
  sequence; all-gather backward);
- `column_input` / `row_output`: the steps around a column- or row-parallel GEMM;
- `shard` / `shard_stacked` / `shard_fc1`: the part of a full (TP=1) parameter that a rank holds;
- `reduce_current_scaling_amax`: FP8 current scaling of a TP-sharded GEMM operand with the amax all-reduced (MAX)
  over the TP group, so every rank quantizes with the scale a TP=1 run would use.

Conventions (as in TE): activations are ``[seq, batch, hidden]``; rank r of a column-parallel layer holds weight rows
``r*out/tp:(r+1)*out/tp`` and that slice of the bias, and returns that slice of the output; a row-parallel layer
takes that slice of the input's last dimension, holds weight columns ``r*in/tp:(r+1)*in/tp`` and adds its full bias
once, after the reduction.  With sequence parallelism a column-parallel layer receives ``[seq/tp, ...]`` and
gathers it (in high precision, then quantizes) and a row-parallel layer reduce-scatters its output to
``[seq/tp, ...]``.  Gradients of parameters used on a sequence shard only (normalization weights, the bias of a
row-parallel layer) are partial sums over the TP group under sequence parallelism; such parameters carry
``param.sequence_parallel = True`` (Megatron's marker) and the training loop all-reduces their gradients.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from tedebug import active as active_session
from tedebug.nn.base import linear_gemm
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

__all__ = [
    "PARALLEL_MODES",
    "TensorParallel",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "shard_stacked",
    "column_input",
    "row_output",
    "replicate_input",
    "local_slice",
    "configure",
    "parallel_linear",
    "shard",
    "shard_fc1",
    "mark_sequence_parallel",
    "reduce_current_scaling_amax",
    "TPCurrentScalingQuantizer",
]

PARALLEL_MODES = ("column", "row", None)


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel layout of one layer (`resolve` checks the constructor arguments)."""

    group: Any = None
    size: int = 1
    rank: int = 0
    mode: Optional[str] = None
    sequence_parallel: bool = False

    def __deepcopy__(self, memo: dict) -> "TensorParallel":
        return self  # immutable, and its group is a communicator that a copy of the layer shares

    @functools.cached_property
    def active(self) -> bool:
        """True when the layer is split over more than one rank in a column or row mode (computed once: read by
        every forward)."""
        return self.size > 1 and self.mode is not None

    @classmethod
    def resolve(
        cls,
        layer: str,
        *,
        tp_group: Any = None,
        tp_size: Optional[int] = None,
        parallel_mode: Optional[str] = None,
        sequence_parallel: bool = False,
    ) -> "TensorParallel":
        """Check TE's constructor arguments: with a `tp_group` the size is the group's (`tp_size` may be left at 1 or
        give that size); without one `tp_size` must be 1 (a split layer needs a group to communicate over)."""
        if parallel_mode not in PARALLEL_MODES:
            close = difflib.get_close_matches(str(parallel_mode), ["column", "row"], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{layer}: parallel_mode must be 'column', 'row' or None, got {parallel_mode!r}{hint}")
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"{layer}: sequence_parallel must be a bool, got {sequence_parallel!r}")
        if tp_group is not None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"{layer}: tp_group given but torch.distributed is not initialised")
            group_size = dist.get_world_size(tp_group)
            if tp_size is not None and int(tp_size) not in (1, group_size):  # TE: the group's size wins over 1
                raise ValueError(f"{layer}: tp_size={tp_size} but tp_group has {group_size} ranks")
            size, rank = group_size, dist.get_rank(tp_group)
            if rank < 0:
                raise ValueError(f"{layer}: this process (global rank {dist.get_rank()}) is not in tp_group")
        else:
            size = 1 if tp_size is None else int(tp_size)
            if size != 1:
                raise ValueError(f"{layer}: tp_size={tp_size} needs a tp_group (the process group to split over)")
            rank = 0
        if sequence_parallel and parallel_mode is None and size > 1:
            raise ValueError(f"{layer}: sequence_parallel needs parallel_mode 'column' or 'row'")
        return cls(group=tp_group, size=size, rank=rank, mode=parallel_mode, sequence_parallel=sequence_parallel)

    def split(self, features: int, what: str, layer: str) -> int:
        """`features` / tp_size (an error when it does not divide)."""
        if features % self.size:
            raise ValueError(f"{layer}: {what}={features} is not divisible by tp_size={self.size}")
        return features // self.size

    def describe(self) -> str:
        if not self.active:
            return ""
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f", parallel_mode={self.mode!r}, tp_size={self.size}{sp}"


# ------------------------------------------------------------------------------------------------ collectives
def all_gather_tensor(out: torch.Tensor, x: torch.Tensor, *, group, async_op: bool = False):
    """`x` of every rank of `group`, concatenated along dim 0 into `out` (torch's ``all_gather_single``, called
    ``all_gather_into_tensor`` before torch 2.13)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, x: torch.Tensor, *, group):
    """The sum over `group` of `x`, this rank's part of dim 0 into `out` (``reduce_scatter_single``, formerly
    ``reduce_scatter_tensor``)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, op=dist.ReduceOp.SUM, group=group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_tensor(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence parallelism: dimension 0 ({x.shape[0]}) is not divisible by tp_size={size}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, x, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if x.shape[0] % size:
            raise ValueError(f"sequence parallelism: dimension 0 ({x.shape[0]}) is not divisible by tp_size={size}")
        return x.chunk(size, dim=0)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; the gradient is all-reduced (summed) over `group` (input of a column-parallel GEMM)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) over `group`; the gradient passes unchanged (output of a row-parallel GEMM)."""
    return _ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dimension 0 (the sequence); the gradient is reduce-scattered back."""
    return _GatherFromSP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's part of dimension 0 of a tensor every rank holds whole (e.g. the embeddings entering a
    sequence-parallel region); the gradient is all-gathered back."""
    return _ScatterToSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter (sum) along dimension 0; the gradient is all-gathered back."""
    return _ReduceScatterToSP.apply(x, group)


def column_input(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The input of a column-parallel GEMM: gathered over the sequence (SP) or replicated with an all-reduced
    gradient.  Unchanged for any other layout."""
    if not tp.active or tp.mode != "column":
        return x
    return gather_from_sp(x, tp.group) if tp.sequence_parallel else copy_to_tp(x, tp.group)


def row_output(y: torch.Tensor, bias: Optional[torch.Tensor], tp: TensorParallel) -> torch.Tensor:
    """The output of a row-parallel GEMM (computed without bias): summed over the group (SP: reduce-scattered
    along the sequence), then the full bias added once."""
    if tp.active and tp.mode == "row":
        y = reduce_scatter_to_sp(y, tp.group) if tp.sequence_parallel else reduce_from_tp(y, tp.group)
    return y if bias is None else y + bias.to(y.dtype)


def replicate_input(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A layer input that every rank of the group needs whole: gathered over the sequence (SP) or used as it is
    with its gradient all-reduced.  Unchanged when the layer is not split."""
    if not tp.active:
        return x
    return gather_from_sp(x, tp.group) if tp.sequence_parallel else copy_to_tp(x, tp.group)


def local_slice(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of the last dimension (the input of a row-parallel GEMM taken from a whole tensor)."""
    if not tp.active:
        return x
    width = tp.split(x.shape[-1], "input width", "row-parallel layer")
    return x[..., tp.rank * width : (tp.rank + 1) * width]


def configure(state, tp: TensorParallel) -> None:
    """Tell a `tedebug.nn.base.GemmState` of a split layer its TP group (for the debug quantizers: weight
    statistics are reduced over it) and reduce the FP8 current-scaling amax of its sharded operands over the group.
    A layer that is not split (no `parallel_mode`) holds whole weights: nothing to reduce."""
    if tp.active:
        state.tp_group = tp.group
        state.tp_size = tp.size
        state.customize_quantizers = functools.partial(reduce_current_scaling_amax, tp=tp)


def parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state,
    layer_name: str,
    recipe,
    tp: TensorParallel,
    *,
    input_whole: bool = False,
) -> torch.Tensor:
    """One linear GEMM of a (possibly) split layer: column-parallel gathers / replicates its input and adds its
    bias slice in the GEMM; row-parallel reduces its output and then adds the full bias.  `input_whole`: a
    row-parallel layer receives the whole input (after its normalization) and takes its slice itself."""
    if not tp.active:
        return linear_gemm(x, weight, bias, state, layer_name, recipe)
    note_replicas(layer_name, tp)
    if tp.mode == "column":
        return linear_gemm(column_input(x, tp), weight, bias, state, layer_name, recipe)
    if input_whole:
        x = local_slice(replicate_input(x, tp), tp)
    return row_output(linear_gemm(x, weight, None, state, layer_name, recipe), bias, tp)


#: the debug tensors a split GEMM holds whole on every rank of its TP group (input of a column-parallel GEMM,
#: output gradient of a row-parallel one); the others are shards, or partial sums (row output, column dgrad)
REPLICATED_TENSORS: Dict[str, tuple] = {"column": ("activation",), "row": ("gradient",)}


def note_replicas(layer_name: str, tp: TensorParallel) -> None:
    """Tell the active debug session's statistics which of this GEMM's tensors are TP replicas, so that a
    reduction over ranks of one TP group counts them once (nothing when debugging is off)."""
    session = active_session.DEBUG_MANAGER
    if session is not None:
        session.stats.note_tp_replicas(layer_name, REPLICATED_TENSORS[tp.mode], tp.group)


# ------------------------------------------------------------------------------------------------ parameters
def shard(full: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    """Rank `tp.rank`'s contiguous slice of `full` along `dim` (a copy)."""
    if full.shape[dim] % tp.size:
        raise ValueError(f"shard: dimension {dim} ({full.shape[dim]}) is not divisible by tp_size={tp.size}")
    return full.chunk(tp.size, dim=dim)[tp.rank].clone()


def shard_stacked(full: torch.Tensor, tp: TensorParallel, parts: int) -> torch.Tensor:
    """Rank `tp.rank`'s rows of a column-parallel weight or bias that stacks `parts` blocks along dim 0 (a fused
    q/k/v projection: 3; a gated fc1: 2): this rank's slice of every block, stacked in the same order."""
    return torch.cat([shard(block, tp, 0) for block in full.chunk(parts, dim=0)], dim=0)


def shard_fc1(full: torch.Tensor, tp: TensorParallel, gated: bool) -> torch.Tensor:
    """Rank `tp.rank`'s slice of a LayerNormMLP fc1 weight or bias (rows).  A gated activation's fc1 stacks two
    halves [gate; value]; each rank holds the matching slice of both, so its local halves pair up."""
    return shard_stacked(full, tp, 2 if gated else 1)


def mark_sequence_parallel(*params: Optional[torch.nn.Parameter]) -> None:
    """Megatron's marker: these parameters' gradients are partial sums over the TP group (sequence parallel)."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


# ------------------------------------------------------------------------------------------------ FP8 amax
#: the roles whose GEMM operand is split over the TP group, per parallel mode (inputs gathered by SP are whole)
SHARDED_ROLES: Dict[str, tuple] = {"column": ("weight", "grad_output"), "row": ("input", "weight")}


class TPCurrentScalingQuantizer(Float8CurrentScalingQuantizer):
    """FP8 current scaling whose amax is all-reduced (MAX) over `amax_group` before the scale is computed."""

    def __init__(self, fp8_format: str = "E4M3", *, amax_group: Any = None, **kwargs) -> None:
        super().__init__(fp8_format, **kwargs)
        self.amax_group = amax_group

    @classmethod
    def like(cls, q: Float8CurrentScalingQuantizer, amax_group: Any) -> "TPCurrentScalingQuantizer":
        return cls(
            q.fp8_format,
            amax_group=amax_group,
            amax_epsilon=q.amax_epsilon,
            force_pow_2_scales=q.force_pow_2_scales,
            rowwise=q.rowwise_usage,
            columnwise=q.columnwise_usage,
        )

    def reduce_amax(self, amax: torch.Tensor) -> None:
        """In place: this shard's amax becomes the maximum over `amax_group` (every rank's shard); the quantizer's
        `_quantize` (the kernels on CUDA, the torch path elsewhere) computes the scale from it."""
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.amax_group)


def reduce_current_scaling_amax(quantizers: Dict[str, Optional[object]], tp: TensorParallel) -> None:
    """In place: the FP8 current-scaling quantizers of the TP-sharded operands (`SHARDED_ROLES`) are replaced by
    `TPCurrentScalingQuantizer`s, so that every rank quantizes with the scale of the full tensor (other recipes
    and roles are left as they are)."""
    if not tp.active:
        return
    for role in SHARDED_ROLES[tp.mode]:
        q = quantizers.get(role)
        if type(q) is Float8CurrentScalingQuantizer:
            quantizers[role] = TPCurrentScalingQuantizer.like(q, tp.group)
