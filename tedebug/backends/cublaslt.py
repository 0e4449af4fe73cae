"""bf16 GEMMs with a device-memory alpha and a bias epilogue, through cuBLASLt called with ctypes.

Why this module exists: an emulated NVFP4 GEMM needs ``bf16(alpha · (A @ B) + bias)`` where alpha (the product of
the two operands' global scales) lives in device memory - reading it on the host would synchronise every GEMM.
cuBLAS's ``gemmEx`` reads alpha from device memory but adds a bias only as a full C matrix, so the bias had to be
broadcast to the whole [M, N] output first: one extra write and one extra read of the output per GEMM (about 5 ms
per step of the `tedebug bench --e2e` model under NVFP4).  cuBLASLt's BIAS epilogue adds the bias vector inside
the GEMM instead; with ``CUBLASLT_POINTER_MODE_DEVICE`` it reads alpha and beta from device memory.

Numerics: the products are accumulated in fp32 (``CUBLAS_COMPUTE_32F``); split-K partial sums may only be reduced
in the compute type (the preference's reduction-scheme mask excludes the in-place and output-type schemes, both of
which add partial results in bf16); alpha scales the fp32 sum, the bias (bf16, exact in fp32) is added in fp32 and
the result is rounded to bf16 once.  That is the contract of `tedebug.nn.gemm`'s tensor-core path.

`gemm_bias_device_alpha(op_b, op_a, alpha, bias)` returns None when cuBLASLt cannot be loaded, when no algorithm
fits the call, or for layouts other than row- or column-major 2-D views; the caller then takes its other path.
Per-shape state (matmul descriptor, matrix layouts, the chosen algorithm) is built once and cached: a call costs
two ctypes calls (the bias pointer and the matmul).  The library is the one torch already loaded (same soname).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Dict, Optional, Tuple

import torch

from tedebug.backends.launch import raw_stream

# cuBLAS / cuBLASLt enums (library_types.h, cublas_api.h, cublasLt.h)
_R_16BF = 14
_COMPUTE_32F = 68
_R_32F = 0
OP_N, OP_T = 0, 1
_DESC_POINTER_MODE = 2
_DESC_TRANSA = 3
_DESC_TRANSB = 4
_DESC_EPILOGUE = 7
_DESC_BIAS_POINTER = 8
_DESC_BIAS_DATA_TYPE = 26
_POINTER_MODE_DEVICE = 1
_EPILOGUE_BIAS = 4
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_REDUCTION_SCHEME_MASK = 3
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D
_REDUCTION_SCHEME_COMPUTE_TYPE = 2  # split-K partial sums reduced in fp32 only (no in-place / output-type scheme)

#: workspace per device for the chosen algorithms (cuBLAS recommends 32 MiB on Hopper)
WORKSPACE_BYTES = 32 << 20
_SONAMES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11", "libcublasLt.so")


class _HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class _Plan:
    """What one (shape, layout, alignment) key needs at call time."""

    __slots__ = ("desc", "layouts", "algo")

    def __init__(self, desc: ctypes.c_void_p, layouts: Tuple[ctypes.c_void_p, ...], algo: _HeuristicResult):
        self.desc, self.layouts, self.algo = desc, layouts, algo


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_load_failed = False
_handles: Dict[int, ctypes.c_void_p] = {}
_workspaces: Dict[Tuple[int, int], torch.Tensor] = {}  # (device, raw stream) -> workspace
_plans: Dict[tuple, Optional[_Plan]] = {}


def _library() -> Optional[ctypes.CDLL]:
    global _lib, _load_failed
    if _lib is not None or _load_failed:
        return _lib
    for name in _SONAMES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [
            ctypes.POINTER(vp),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int64,
        ]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int, vp, vp]
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
        _lib = lib
        return lib
    _load_failed = True
    return None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


def _set(setter, obj, attribute: int, value) -> None:
    _check(setter(obj, attribute, ctypes.byref(value), ctypes.sizeof(value)), f"attribute {attribute}")


def _handle(lib, index: int) -> ctypes.c_void_p:
    handle = _handles.get(index)
    if handle is None:
        handle = ctypes.c_void_p()
        with torch.cuda.device(index):
            _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _handles[index] = handle
    return handle


def _workspace(index: int, stream: int) -> torch.Tensor:
    """The workspace of GEMMs on `stream` of device `index`: one per stream, so that GEMMs running concurrently on
    two streams never share scratch memory (calls on one stream run in order)."""
    key = (index, stream)
    space = _workspaces.get(key)
    if space is None:
        space = _workspaces[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
    return space


def _alignment(ptr: int) -> int:
    """The largest power of two up to 256 that divides `ptr` (what the heuristic may assume of a pointer)."""
    align = 256
    while ptr % align:
        align //= 2
    return align


def as_cublas(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """(transpose flag, leading dimension) of a 2-D bf16 [r, c] view read as cuBLAS's column-major Tᵀ (row-major
    storage: no transpose) or T (column-major storage: transpose); None for other strides."""
    if t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1]):
        return OP_N, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0]):
        return OP_T, t.stride(1)
    return None


def _build(lib, handle, key: tuple, bias_ptr: int) -> Optional[_Plan]:
    m, n, k, (op_a, ld_a), (op_b, ld_b), aligns, _ = key
    vp = ctypes.c_void_p
    desc = vp()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
    setter = lib.cublasLtMatmulDescSetAttribute
    _set(setter, desc, _DESC_POINTER_MODE, ctypes.c_int32(_POINTER_MODE_DEVICE))
    _set(setter, desc, _DESC_TRANSA, ctypes.c_int32(op_a))
    _set(setter, desc, _DESC_TRANSB, ctypes.c_int32(op_b))
    _set(setter, desc, _DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_BIAS))
    _set(setter, desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int32(_R_16BF))
    _set(setter, desc, _DESC_BIAS_POINTER, vp(bias_ptr))

    def layout(rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        out = vp()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(out), _R_16BF, rows, cols, ld), "layout")
        return out

    # column-major: D = outᵀ [N, M] = op(A) [N, K] · op(B) [K, M]; A = op_a's storage, B = op_b's storage
    lay_a = layout(n, k, ld_a) if op_a == OP_N else layout(k, n, ld_a)
    lay_b = layout(k, m, ld_b) if op_b == OP_N else layout(m, k, ld_b)
    lay_d = layout(n, m, n)
    pref = vp()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    try:
        pset = lib.cublasLtMatmulPreferenceSetAttribute
        _set(pset, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES))
        _set(pset, pref, _PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(_REDUCTION_SCHEME_COMPUTE_TYPE))
        for attribute, align in zip(_PREF_MIN_ALIGNMENT, aligns):
            _set(pset, pref, attribute, ctypes.c_uint32(align))
        result = _HeuristicResult()
        count = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc,
            lay_a,
            lay_b,
            lay_d,
            lay_d,
            pref,
            1,
            ctypes.byref(result),
            ctypes.byref(count),
        )
    finally:
        lib.cublasLtMatmulPreferenceDestroy(pref)
    if status != 0 or count.value == 0 or result.state != 0 or result.workspace_size > WORKSPACE_BYTES:
        return None
    return _Plan(desc, (lay_a, lay_b, lay_d), result)


def gemm_bias_device_alpha(
    op_b: torch.Tensor, op_a: torch.Tensor, alpha: torch.Tensor, beta_zero: torch.Tensor, bias: torch.Tensor
) -> Optional[torch.Tensor]:
    """bf16 ``alpha · (op_b @ op_a) + bias`` of bf16 op_b [M, K], op_a [K, N], a 0-d fp32 device `alpha` and a
    contiguous bf16 `bias` [N] (`beta_zero`: a 0-d fp32 device zero, cuBLASLt reads beta too); None when this
    path does not take the call (see the module docstring)."""
    lib = _library()
    if lib is None:
        return None
    m, k = op_b.shape
    n = op_a.shape[1]
    lay_a, lay_b = as_cublas(op_a), as_cublas(op_b)
    if lay_a is None or lay_b is None or min(m, n, k) == 0 or bias.shape != (n,) or not bias.is_contiguous():
        return None
    out = torch.empty((m, n), dtype=torch.bfloat16, device=op_b.device)
    ptrs = (op_a.data_ptr(), op_b.data_ptr(), out.data_ptr(), out.data_ptr())
    aligns = tuple(_alignment(p) for p in ptrs)
    index = op_b.device.index if op_b.device.index is not None else torch.cuda.current_device()
    key = (m, n, k, lay_a, lay_b, aligns, (index, _alignment(bias.data_ptr())))
    plan = _plans.get(key, False)
    with _lock:
        handle = _handle(lib, index)
        if plan is False:
            plan = _plans[key] = _build(lib, handle, key, bias.data_ptr())
        if plan is None:
            return None
        bias_ptr = ctypes.c_void_p(bias.data_ptr())
        _check(
            lib.cublasLtMatmulDescSetAttribute(
                plan.desc, _DESC_BIAS_POINTER, ctypes.byref(bias_ptr), ctypes.sizeof(bias_ptr)
            ),
            "bias pointer",
        )
        stream = raw_stream(index)
        space = _workspace(index, stream)
        lay_a_, lay_b_, lay_d = plan.layouts
        _check(
            lib.cublasLtMatmul(
                handle,
                plan.desc,
                alpha.data_ptr(),
                op_a.data_ptr(),
                lay_a_,
                op_b.data_ptr(),
                lay_b_,
                beta_zero.data_ptr(),
                out.data_ptr(),
                lay_d,
                out.data_ptr(),
                lay_d,
                ctypes.byref(plan.algo.algo),
                space.data_ptr(),
                WORKSPACE_BYTES,
                stream,
            ),
            "cublasLtMatmul",
        )
    return out
