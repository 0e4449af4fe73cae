"""What every statistic is: per-feed partials, how partials combine, and the final formula of each statistic.

A statistic is never computed from a whole tensor at log time.  Each feed (one tensor seen by one microbatch on one
rank) produces a small row of *partials* — the numbers a one-pass GPU kernel produces (min, max, sum, M2, Σ|x|, Σx²,
amax, min / max non-zero |x|, counts) — and rows are merged with an exact combiner per partial: ``sum``, ``min``,
``max`` or ``m2`` (sum of squared deviations from the mean, merged with Chan et al.'s parallel formula).  The
logged value is a final formula over the merged row, evaluated on the host as a Python float.

A partial column is identified by ``Column(name, qualifier)``: the qualifier is ``()`` for high-precision partials,
``(block_size, dims, max_over_orientations)`` for the blockwise dynamic range, and ``(recipe, columnwise)`` for
partials of a quantized tensor.  Every row starts with ``Column("numel", ())``.

`StatRequest` names one requested statistic; `columns_for` gives the dependency closure of a set of requests and
`finalize` turns a merged row into the logged value (the formulas spelled out; a step evaluates them through
`row_evaluator`, the same formulas compiled per buffer layout, held to the same bits by the tests).  Numerical
choices (documented for users):

* ``std`` is the unbiased standard deviation (torch.std); across feeds and ranks the pooled value uses
  M2 = Σ M2_i + Σ n_i (m_i − m)², i.e. exactly the std of the concatenated data (TransformerEngine's combination
  is biased).  With fewer than two elements it is NaN, as torch.std.
* ``dynamic_range`` = log2(max non-zero |x|) − log2(min non-zero |x|) over everything fed; for a tensor with no
  non-zero element it is +inf (TransformerEngine's top = +inf, bottom = 0 rule), never an error.
* ``scale_inv_std`` is the population standard deviation of the stored decode scales (0 for a single scale).
* ``scale_inv_min`` ignores zero scales and is 0 when all scales are zero.
* ``mse`` of a ``_columnwise`` statistic uses the dequantization of the columnwise data (TransformerEngine
  dequantizes rowwise data even for ``mse_columnwise``).  The error is taken against the exact dequantized
  values (fp32, the values the GEMM consumes) and accumulated in float64; TransformerEngine rounds the
  dequantized tensor to the input dtype first (bf16 inputs give bf16-rounded errors).
* ``overflows%`` counts |x| > fp8_max · scale_inv with the threshold in fp32 and x upcast exactly to fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from tedebug.compiled_formulas import compiled

# ------------------------------------------------------------------------------------------------ statistic kinds
HP_KINDS = (
    "min",
    "max",
    "mean",
    "std",
    "l1_norm",
    "l2_norm",
    "cur_amax",
    "dynamic_range",
    "nan_count",
    "inf_count",
)
BLOCKWISE_KIND = "max_blockwise_dynamic_range"
QUANTIZED_KINDS = ("underflows%", "overflows%", "mse", "scale_inv_min", "scale_inv_max", "scale_inv_std")
KINDS = HP_KINDS + (BLOCKWISE_KIND,) + QUANTIZED_KINDS

#: statistics whose per-feed value needs the high-precision tensor (all but the scale statistics)
NEEDS_HP_TENSOR = frozenset(HP_KINDS + (BLOCKWISE_KIND, "underflows%", "overflows%", "mse"))

#: tensors for which TransformerEngine takes the blockwise dynamic range over both orientations
ORIENTATION_TENSORS = ("activation", "weight")

BLOCKWISE_DEFAULTS = {"block_size": 32, "dims": 1}


def blockwise_stat_name(block_size: int, dims: int, max_over_orientations: bool) -> str:
    """The logged name of a blockwise dynamic-range statistic (TransformerEngine's spelling)."""
    suffix = "_max_over_orientations" if max_over_orientations else ""
    return f"{BLOCKWISE_KIND}_block_size_{block_size}_dims_{dims}{suffix}"


@dataclass(frozen=True)
class StatRequest:
    """One requested statistic.

    `name` is the logged statistic string exactly as the config wrote it (``"underflows%"``,
    ``"mxfp8_scale_inv_min_columnwise"``, ``"nvfp4_mse"``, or the blockwise string); `kind` is one of `KINDS`;
    `recipe` is the key of the quantized tensor in `StatsEngine.feed(quantized=...)` (``""`` = the training
    recipe); `columnwise` selects the columnwise representation; `params` is
    ``(block_size, dims, max_over_orientations)`` for the blockwise dynamic range and ``()`` otherwise.
    """

    name: str
    kind: str
    recipe: str = ""
    columnwise: bool = False
    params: Tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StatRequest.name must be a non-empty string, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"StatRequest {self.name!r}: unknown kind {self.kind!r}; expected one of {KINDS}")
        if not isinstance(self.recipe, str):
            raise ValueError(f"StatRequest {self.name!r}: recipe must be a string, got {self.recipe!r}")
        if self.kind in QUANTIZED_KINDS:
            if self.params != ():
                raise ValueError(f"StatRequest {self.name!r}: quantized statistics take no params")
            return
        if self.recipe or self.columnwise:
            raise ValueError(
                f"StatRequest {self.name!r}: high-precision statistic {self.kind!r} takes no recipe / columnwise"
            )
        if self.kind == BLOCKWISE_KIND:
            _check_blockwise_params(self.name, self.params)
        elif self.params != ():
            raise ValueError(f"StatRequest {self.name!r}: statistic {self.kind!r} takes no params")

    @property
    def usage(self) -> str:
        """The quantized representation the statistic reads: ``"rowwise"`` or ``"columnwise"``."""
        return "columnwise" if self.columnwise else "rowwise"

    @property
    def needs_tensor(self) -> bool:
        """True when the per-feed value needs the high-precision tensor."""
        return self.kind in NEEDS_HP_TENSOR

    @classmethod
    def blockwise(cls, block_size: int, dims: int, max_over_orientations: bool) -> "StatRequest":
        """The blockwise dynamic-range request, named as TransformerEngine logs it."""
        params = (block_size, dims, bool(max_over_orientations))
        _check_blockwise_params(BLOCKWISE_KIND, params)
        return cls(blockwise_stat_name(*params), BLOCKWISE_KIND, params=params)

    @classmethod
    def parse_hp(cls, entry: Any, *, tensor_name: Optional[str] = None) -> "StatRequest":
        """Parse one high-precision ``stats`` entry of a LogTensorStats config.

        `entry` is a plain name (one of `HP_KINDS`), a `StatRequest` (returned unchanged), or the mapping form
        ``{max_blockwise_dynamic_range: {block_size: int > 0 (default 32), dims: 1 | 2 (default 1)}}``; for the
        mapping, ``max_over_orientations`` is True iff `tensor_name` is ``activation`` or ``weight``.
        """
        if isinstance(entry, StatRequest):
            return entry
        if isinstance(entry, str):
            if entry in HP_KINDS:
                return cls(entry, entry)
            if entry == BLOCKWISE_KIND:
                raise ValueError(
                    f"Statistic {entry!r} needs the mapping form {{{BLOCKWISE_KIND}: {{block_size: <int>, dims: 1|2}}}}"
                )
            raise ValueError(f"Statistic {entry} is not supported. Supported: {list(HP_KINDS) + [BLOCKWISE_KIND]}")
        if isinstance(entry, Mapping):
            return cls._parse_blockwise_mapping(entry, tensor_name)
        raise ValueError(f"a stats entry must be a string or a mapping, got {type(entry).__name__}: {entry!r}")

    @classmethod
    def _parse_blockwise_mapping(cls, entry: Mapping, tensor_name: Optional[str]) -> "StatRequest":
        if list(entry.keys()) != [BLOCKWISE_KIND]:
            raise ValueError(
                f"a mapping stats entry must have the single key {BLOCKWISE_KIND!r}, got keys {list(entry.keys())}"
            )
        options = entry[BLOCKWISE_KIND]
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ValueError(f"{BLOCKWISE_KIND}: expected a mapping with block_size / dims, got {options!r}")
        unknown = sorted(set(options) - set(BLOCKWISE_DEFAULTS))
        if unknown:
            raise ValueError(
                f"{BLOCKWISE_KIND}: unknown key(s) {unknown}; allowed keys are {sorted(BLOCKWISE_DEFAULTS)}"
            )
        merged = {**BLOCKWISE_DEFAULTS, **options}
        return cls.blockwise(merged["block_size"], merged["dims"], tensor_name in ORIENTATION_TENSORS)


def _check_blockwise_params(name: str, params: Tuple[Any, ...]) -> None:
    if len(params) != 3:
        raise ValueError(f"{name}: params must be (block_size, dims, max_over_orientations), got {params!r}")
    block_size, dims, orient = params
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"{name}: block_size must be an int > 0, got {block_size!r}")
    if isinstance(dims, bool) or dims not in (1, 2):
        raise ValueError(f"{name}: dims must be 1 or 2, got {dims!r}")
    if not isinstance(orient, bool):
        raise ValueError(f"{name}: max_over_orientations must be a bool, got {orient!r}")


# ------------------------------------------------------------------------------------------------ partials
class Column(NamedTuple):
    """One partial of a row: its name and its qualifier (see the module docstring)."""

    name: str
    qualifier: Tuple[Any, ...] = ()


#: partial name -> (family, combiner).  The family is the backend function that produces it (tedebug.backends).
PARTIALS: Dict[str, Tuple[str, str]] = {
    "numel": ("meta", "sum"),
    "min": ("basic", "min"),
    "max": ("basic", "max"),
    "sum": ("basic", "sum"),
    "m2": ("basic", "m2"),
    "abs_sum": ("basic", "sum"),
    "sq_sum": ("basic", "sum"),
    "amax": ("basic", "max"),
    "nz_abs_min": ("basic", "min"),
    "nz_abs_max": ("basic", "max"),
    "nonzero_count": ("basic", "sum"),
    "nan_count": ("basic", "sum"),
    "inf_count": ("basic", "sum"),
    "block_dr": ("blockwise", "max"),
    "underflows_num": ("underflow", "sum"),
    "overflows_num": ("overflow", "sum"),
    "sq_err": ("mse", "sum"),
    "scale_count": ("scale_inv", "sum"),
    "scale_sum": ("scale_inv", "sum"),
    "scale_m2": ("scale_inv", "m2"),
    "scale_nz_min": ("scale_inv", "min"),
    "scale_max": ("scale_inv", "max"),
}
_PARTIAL_ORDER = {name: i for i, name in enumerate(PARTIALS)}

#: an ``m2`` partial's (count partial, sum partial) of the same qualifier
M2_LINKS = {"m2": ("numel", "sum"), "scale_m2": ("scale_count", "scale_sum")}

NUMEL = Column("numel", ())
#: the unqualified column of every partial name (built once, for `finalize`)
_PLAIN_COLUMNS = {name: Column(name) for name in PARTIALS}
#: the non-finite counters kept whenever the basic family is computed (for the first-non-finite report)
NONFINITE_COLUMNS = (Column("nan_count", ()), Column("inf_count", ()))

_HP_PARTIALS = {
    "min": ("min",),
    "max": ("max",),
    "mean": ("sum",),
    "std": ("sum", "m2"),
    "l1_norm": ("abs_sum",),
    "l2_norm": ("sq_sum",),
    "cur_amax": ("amax",),
    "dynamic_range": ("nz_abs_min", "nz_abs_max"),
    "nan_count": ("nan_count",),
    "inf_count": ("inf_count",),
}
_QUANTIZED_PARTIALS = {
    "underflows%": ("underflows_num",),
    "overflows%": ("overflows_num",),
    "mse": ("sq_err",),
    "scale_inv_min": ("scale_nz_min",),
    "scale_inv_max": ("scale_max",),
    "scale_inv_std": ("scale_count", "scale_sum", "scale_m2"),
}


def family_of(column: Column) -> str:
    """The backend family producing `column` (``meta`` for numel)."""
    return PARTIALS[column.name][0]


def combiner_of(column: Column) -> str:
    """``sum``, ``min``, ``max`` or ``m2``."""
    return PARTIALS[column.name][1]


def _qualifier(request: StatRequest) -> Tuple[Any, ...]:
    """The qualifier of the partial columns `request` reads (see `Column`)."""
    if request.kind in QUANTIZED_KINDS:
        return (request.recipe, bool(request.columnwise))
    return tuple(request.params) if request.kind == BLOCKWISE_KIND else ()


def request_columns(request: StatRequest) -> Tuple[Column, ...]:
    """The partial columns one statistic depends on (numel excluded: every row has it)."""
    qualifier = _qualifier(request)
    if request.kind == BLOCKWISE_KIND:
        return (Column("block_dr", qualifier),)
    partials = _HP_PARTIALS[request.kind] if request.kind in _HP_PARTIALS else _QUANTIZED_PARTIALS[request.kind]
    return tuple(Column(p, qualifier) for p in partials)


def _column_sort_key(column: Column) -> Tuple[int, str]:
    return _PARTIAL_ORDER[column.name], repr(column.qualifier)


def columns_for(requests: Iterable[StatRequest]) -> Tuple[Column, ...]:
    """The dependency closure of `requests`, in a canonical order (identical on every rank).

    Always contains numel; contains nan_count and inf_count whenever any basic partial is needed.
    """
    cols = {NUMEL}
    for request in requests:
        cols.update(request_columns(request))
    if any(family_of(c) == "basic" for c in cols):
        cols.update(NONFINITE_COLUMNS)
    return tuple(sorted(cols, key=_column_sort_key))


# ------------------------------------------------------------------------------------------------ combining
def combine_rows(columns: Sequence[Column], rows: torch.Tensor) -> torch.Tensor:
    """Merge a [K, C] float64 matrix of partial rows (columns in `columns` order) into one row [C].

    Works on any device with torch ops only (no host sync).  ``m2`` uses the exact pooled formula
    M2 = Σ M2_i + Σ n_i (m_i − m)² with m_i = s_i / n_i and m = Σ s_i / Σ n_i (Chan et al.).
    """
    if rows.dim() != 2 or rows.shape[1] != len(columns):
        raise ValueError(f"combine_rows: expected a [K, {len(columns)}] matrix, got shape {tuple(rows.shape)}")
    index = {c: i for i, c in enumerate(columns)}
    out = []
    for i, column in enumerate(columns):
        kind = combiner_of(column)
        col = rows[:, i]
        if kind == "sum":
            out.append(col.sum())
        elif kind == "min":
            out.append(col.amin())
        elif kind == "max":
            out.append(col.amax())
        else:
            count_name, sum_name = M2_LINKS[column.name]
            n = rows[:, index[Column(count_name, column.qualifier if count_name != "numel" else ())]]
            s = rows[:, index[Column(sum_name, column.qualifier)]]
            out.append(_pooled_m2(col, n, s))
    return torch.stack(out)


def combine_row_batches(columns: Sequence[Column], rows: torch.Tensor) -> torch.Tensor:
    """`combine_rows` of many buffers at once: a [B, K, C] float64 tensor (B buffers of the same `columns`, K rows
    each) into [B, C], bit for bit `combine_rows` of each ``rows[b]`` (the reductions run along dim 1 as they run
    along dim 0 there; tests/stats/test_stats_definitions.py holds the two equal)."""
    if rows.dim() != 3 or rows.shape[2] != len(columns):
        raise ValueError(
            f"combine_row_batches: expected a [B, K, {len(columns)}] tensor, got shape {tuple(rows.shape)}"
        )
    index = {c: i for i, c in enumerate(columns)}
    out = []
    for i, column in enumerate(columns):
        kind = combiner_of(column)
        col = rows[:, :, i]
        if kind == "sum":
            out.append(col.sum(dim=1))
        elif kind == "min":
            out.append(col.amin(dim=1))
        elif kind == "max":
            out.append(col.amax(dim=1))
        else:
            count_name, sum_name = M2_LINKS[column.name]
            n = rows[:, :, index[Column(count_name, column.qualifier if count_name != "numel" else ())]]
            s = rows[:, :, index[Column(sum_name, column.qualifier)]]
            out.append(_pooled_m2(col, n, s, dim=1))
    return torch.stack(out, dim=1)


def _pooled_m2(m2: torch.Tensor, n: torch.Tensor, s: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    if dim is not None:  # batches along dim 0
        total_n = n.sum(dim=dim, keepdim=True)
        mean = s.sum(dim=dim, keepdim=True) / total_n
        safe_n = torch.where(n > 0, n, torch.ones_like(n))
        between = torch.where(n > 0, n * (s / safe_n - mean) ** 2, torch.zeros_like(n))
        return m2.sum(dim=dim) + between.sum(dim=dim)
    total_n = n.sum()
    mean = s.sum() / total_n
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    between = torch.where(n > 0, n * (s / safe_n - mean) ** 2, torch.zeros_like(n))
    return m2.sum() + between.sum()


# ------------------------------------------------------------------------------------------------ final values
def _log2(v: float) -> float:
    if v == 0.0:
        return -math.inf
    return math.log2(v)


def _div(a: float, b: float) -> float:
    return a / b if b != 0 else math.nan


def finalize(request: StatRequest, values: Mapping[Column, float]) -> float:
    """The logged value of `request` from a merged row (`values` maps every column of the row to a float)."""
    kind = request.kind
    if kind in _HP_PARTIALS or kind == BLOCKWISE_KIND:
        get = lambda name: float(values[_PLAIN_COLUMNS[name]])  # noqa: E731
    else:
        qualifier = (request.recipe, bool(request.columnwise))
        get = lambda name: float(values[Column(name, qualifier)])  # noqa: E731
    numel = float(values[NUMEL])
    if kind in ("min", "max", "nan_count", "inf_count"):
        return get(kind)
    if kind == "mean":
        return _div(get("sum"), numel)
    if kind == "std":
        return _std(get("m2"), numel)
    if kind == "l1_norm":
        return get("abs_sum")
    if kind == "l2_norm":
        return math.sqrt(get("sq_sum"))
    if kind == "cur_amax":
        return get("amax")
    if kind == "dynamic_range":
        return _dynamic_range(get("nz_abs_max"), get("nz_abs_min"))
    if kind == BLOCKWISE_KIND:
        return float(values[Column("block_dr", tuple(request.params))])
    return _finalize_quantized(kind, get, numel)


def _std(m2: float, numel: float) -> float:
    return math.sqrt(m2 / (numel - 1)) if numel > 1 else math.nan


#: statistic kind -> its final formula over a merged row, as a Python expression in which ``{partial}`` stands for the
#: float value of that partial in the statistic's qualifier (``{numel}``: the row's element count) and ``_nan``,
#: ``_inf``, ``_sqrt``, ``_log2`` for math's.  `row_evaluator` compiles the formulas of a buffer's statistics into one
#: function; `finalize` spells the same formulas out, and the tests hold the two to the same bits.
FORMULAS: Dict[str, str] = {
    "min": "{min}",
    "max": "{max}",
    "mean": "({sum} / {numel} if {numel} != 0 else _nan)",
    "std": "(_sqrt({m2} / ({numel} - 1)) if {numel} > 1 else _nan)",
    "l1_norm": "{abs_sum}",
    "l2_norm": "_sqrt({sq_sum})",
    "cur_amax": "{amax}",
    # +inf when no element is non-zero; log2(0) = -inf
    "dynamic_range": (
        "(_inf if {nz_abs_max} == 0.0"
        " else _log2({nz_abs_max}) - (_log2({nz_abs_min}) if {nz_abs_min} != 0.0 else -_inf))"
    ),
    "nan_count": "{nan_count}",
    "inf_count": "{inf_count}",
    BLOCKWISE_KIND: "{block_dr}",
    "underflows%": "100.0 * ({underflows_num} / {numel} if {numel} != 0 else _nan)",
    "overflows%": "100.0 * ({overflows_num} / {numel} if {numel} != 0 else _nan)",
    "mse": "({sq_err} / {numel} if {numel} != 0 else _nan)",
    "scale_inv_min": "(0.0 if {scale_nz_min} == _inf else {scale_nz_min})",
    "scale_inv_max": "{scale_max}",
    "scale_inv_std": "(_sqrt({scale_m2} / {scale_count}) if {scale_count} > 0 else _nan)",
}


def row_evaluator(
    requests: Sequence[StatRequest], columns: Sequence[Column]
) -> Callable[[Sequence[float]], List[float]]:
    """One function giving the final value of every request, in order, from a merged row in `columns` order.

    It is the `FORMULAS` of the requests with the column positions resolved now, generated as one Python function
    (each column read and converted to float once), so a step evaluates a buffer with one call instead of one per
    statistic.  Only `FORMULAS` and column positions go into the generated source, never a name from a config.  It
    is compiled by `tedebug.compiled_formulas.compiled` (which a statistics writer process also uses, on the same
    source: the formulas' helper names and file name live there)."""
    position = {column: i for i, column in enumerate(columns)}
    used: Dict[int, None] = {}

    def local(name: str, qualifier: Tuple[Any, ...]) -> str:
        index = position[NUMEL if name == "numel" else Column(name, qualifier)]
        used[index] = None
        return f"v{index}"

    expressions = []
    for request in requests:
        qualifier = _qualifier(request)
        formula = FORMULAS[request.kind]
        names = [name for name in PARTIALS if "{" + name + "}" in formula]
        expressions.append(formula.format(**{name: local(name, qualifier) for name in names}))
    reads = "".join(f"    v{i} = float(row[{i}])\n" for i in sorted(used))
    return compiled(f"def values_of(row):\n{reads}    return [{', '.join(expressions)}]\n")


def _dynamic_range(nz_max: float, nz_min: float) -> float:
    if nz_max == 0.0:  # no non-zero element anywhere: TransformerEngine's top = +inf, bottom = 0
        return math.inf
    return _log2(nz_max) - _log2(nz_min)


def _finalize_quantized(kind: str, get, numel: float) -> float:
    if kind == "underflows%":
        return 100.0 * _div(get("underflows_num"), numel)
    if kind == "overflows%":
        return 100.0 * _div(get("overflows_num"), numel)
    if kind == "mse":
        return _div(get("sq_err"), numel)
    if kind == "scale_inv_min":
        return _scale_inv_min(get("scale_nz_min"))
    if kind == "scale_inv_max":
        return get("scale_max")
    return _scale_inv_std(get("scale_m2"), get("scale_count"))


def _scale_inv_min(low: float) -> float:
    """The smallest non-zero stored scale_inv; 0 when there is none (+inf: no non-zero scale)."""
    return 0.0 if math.isinf(low) and low > 0 else low


def _scale_inv_std(m2: float, count: float) -> float:
    """The population std of every stored scale_inv (NaN for none)."""
    return math.sqrt(m2 / count) if count > 0 else math.nan
