"""Row argmax: x [R, V] fp32 / bf16 / fp16 -> int64 [R], the same indices as torch's `x.argmax(-1)`.

torch's order, reproduced exactly: NaN is greater than every number (a row holding NaN gives its first
NaN), ties go to the lowest index (-0.0 and +0.0 tie), a row of -inf gives 0. The answer is a property
of the row alone, so it does not depend on the split, the batch or the launch: deterministic and
batch-invariant.

Two launches, shapes fixed by (R, V) only (no host sync: capturable in a CUDA graph):
  1. grid (R, S): program (r, s) reduces slice s of row r -- SLICE = BPS * BLOCK_V consecutive
     columns, BLOCK_V per step -- to (value, first index) per lane, then across lanes;
  2. grid (R,): program r combines row r's S partials; slice s covers lower columns than slice s + 1,
     so the lowest index among equal partials is the first in slice order.
  With S = 1, stage 1 writes the row's index itself and stage 2 is not launched.

Split (`plan`): a row is cut into slices of whole BLOCK_V blocks so that the grid has about
TARGET_PROGRAMS programs (a few per SM of an H200's 132, enough loads in flight to cover HBM latency)
and never more slices per row than it has blocks or than MAX_SLICES (stage 2 reads a row's partials
in one tile). Small R: one block per program (V = 129280, BLOCK_V 4096: 32 slices a row); large R:
fewer, longer slices, down to one program per row once R >= TARGET_PROGRAMS. BLOCK_V = 4096 with 8
warps is 16 fp32 per thread a step (four 16-byte loads).

Any strides (row stride != V, column stride != 1) are read as they are. CPU tensors, dtypes other
than fp32 / bf16 / fp16, or no Triton: `reference`.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCK_V = 4096
NUM_WARPS = 8
TARGET_PROGRAMS = 512
MAX_SLICES = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SENTINEL = 2 ** 31 - 1  # "no index yet": above every column (V < 2^31 - 1)


def reference(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(-1)


def plan(R: int, V: int, block_v: int = BLOCK_V, programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(slices per row S, blocks per slice BPS) for an [R, V] input and a target grid of `programs`:
    S * BPS * block_v >= V and every slice holds at least one column."""
    blocks = -(-V // block_v)
    want = max(1, min(-(-programs // max(R, 1)), blocks, MAX_SLICES))
    bps = -(-blocks // want)
    return -(-blocks // bps), bps


if triton is not None:
    @triton.jit
    def _first_max(v, i):
        """(value, index) of a 1-D tile's winner in torch's order; lanes with index _SENTINEL are empty.
        NaN wins (value NaN, its lowest index); else the largest value, its lowest index."""
        empty = i == 2147483647
        is_nan = (v != v) & ~empty
        nan_i = tl.min(tl.where(is_nan, i, 2147483647), axis=0)
        vv = tl.where(is_nan | empty, float("-inf"), v)
        m = tl.max(vv, axis=0)
        first = tl.min(tl.where((vv == m) & ~empty, i, 2147483647), axis=0)
        has_nan = nan_i != 2147483647
        return tl.where(has_nan, float("nan"), m), tl.where(has_nan, nan_i, first)

    @triton.jit
    def _slice_argmax_kernel(x_ptr, val_ptr, idx_ptr, V, s_row, s_col, BPS, S, BLOCK_V: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        lanes = tl.arange(0, BLOCK_V)
        best_v = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK_V], 2147483647, tl.int32)
        row = x_ptr + r * s_row
        for b in range(0, BPS):
            cols = (s * BPS + b) * BLOCK_V + lanes
            ok = cols < V
            v = tl.load(row + cols.to(tl.int64) * s_col, mask=ok, other=float("-inf")).to(tl.float32)
            # a lane's later column replaces its best only if strictly greater (NaN above all numbers)
            new_nan = v != v
            old_nan = best_v != best_v
            take = ok & ((best_i == 2147483647) | (new_nan & ~old_nan) | (~old_nan & (v > best_v)))
            best_v = tl.where(take, v, best_v)
            best_i = tl.where(take, cols, best_i)
        val, idx = _first_max(best_v, best_i)
        tl.store(idx_ptr + r * S + s, idx.to(idx_ptr.dtype.element_ty))
        tl.store(val_ptr + r * S + s, val)

    @triton.jit
    def _combine_kernel(val_ptr, idx_ptr, out_ptr, S, BLOCK_S: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK_S)
        ok = k < S
        v = tl.load(val_ptr + r * S + k, mask=ok, other=float("-inf"))
        i = tl.load(idx_ptr + r * S + k, mask=ok, other=2147483647)
        _, idx = _first_max(v, i)
        tl.store(out_ptr + r, idx.to(tl.int64))


def _check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [R, V], got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[1] == 0:
        raise ValueError("x has V = 0 columns: argmax of an empty row is undefined")
    if x.shape[1] >= _SENTINEL:
        raise ValueError(f"x has V = {x.shape[1]} columns, above the kernel's int32 index range")


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> int64 [R]: torch.argmax(x, -1) exactly. Triton on CUDA for fp32 / bf16 / fp16;
    `reference` otherwise."""
    _check(x)
    if triton is None or not x.is_cuda or x.dtype not in DTYPES:
        return reference(x)
    return _launch(x)


def _launch(x: torch.Tensor, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS,
            programs: int = TARGET_PROGRAMS) -> torch.Tensor:
    """The launches without the device check (also runs under TRITON_INTERPRET=1); the split is
    plan(R, V, block_v, programs)."""
    R, V = x.shape
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    S, bps = plan(R, V, block_v, programs)
    if S == 1:  # one slice a row: stage 1's index is the answer
        val = torch.empty(R, dtype=torch.float32, device=x.device)
        _slice_argmax_kernel[(R, 1)](x, val, out, V, x.stride(0), x.stride(1), bps, 1, BLOCK_V=block_v,
                                     num_warps=num_warps)
        return out
    val = torch.empty(R, S, dtype=torch.float32, device=x.device)
    idx = torch.empty(R, S, dtype=torch.int32, device=x.device)
    _slice_argmax_kernel[(R, S)](x, val, idx, V, x.stride(0), x.stride(1), bps, S, BLOCK_V=block_v,
                                 num_warps=num_warps)
    _combine_kernel[(R,)](val, idx, out, S, BLOCK_S=triton.next_power_of_2(S), num_warps=1)
    return out
