"""Sum of split-K partials in split order: out = (((p[0] + p[1]) + p[2]) + ...) cast to out's dtype.

p [S, M, N] fp32 (contiguous), out [M, N]. The order is fixed (s = 0, 1, ...), so the result is
deterministic and, when S depends only on (N, K), batch-invariant. One program per BLOCK elements.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCK = 1024


def reference(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    acc = partials[0].clone()
    for s in range(1, partials.shape[0]):
        acc += partials[s]
    return acc.to(out_dtype)


if triton is not None:
    @triton.jit
    def _split_sum_kernel(part_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < MN
        acc = tl.load(part_ptr + i, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def split_sum_into(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """partials [S, M, N] fp32 -> out [M, N] (contiguous, written in place and returned)."""
    S, M, N = partials.shape
    if triton is None or (not partials.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"):
        return out.copy_(reference(partials, out.dtype))
    return _launch(partials, out)


def _launch(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The launch without the device check."""
    S, M, N = partials.shape
    if M * N:
        _split_sum_kernel[(triton.cdiv(M * N, BLOCK),)](partials, out, M * N, SPLITS=S, BLOCK=BLOCK, num_warps=4)
    return out
