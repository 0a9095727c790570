"""Row copies between tensor pairs that share one index plan, in one launch.

For one or two pairs (dst_p, src_p), each [rows, width_p] with unit column stride, and index
vectors dst_idx, src_idx [R]:
  dst_p[dst_idx[i], :] = src_p[src_idx[i], :]        for every i < R and both pairs
dst_idx must not repeat (each destination row is written once). The torch form is a gather and an
index_put per pair (4 launches for a compressor's carry kv and score, 2 for a window ring write);
this is one.
Grid: (R, cdiv(max width, BLOCK)).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCK = 512


def reference(pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...], dst_idx: torch.Tensor,
              src_idx: torch.Tensor) -> None:
    for dst, src in pairs:
        dst[dst_idx] = src[src_idx]


if triton is not None:
    @triton.jit
    def _copy_rows_kernel(d0, s0, d1, s1, dst_idx, src_idx, W0, W1, sd0, ss0, sd1, ss1, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        rd = tl.load(dst_idx + i).to(tl.int64)
        rs = tl.load(src_idx + i).to(tl.int64)
        m0 = cols < W0
        tl.store(d0 + rd * sd0 + cols, tl.load(s0 + rs * ss0 + cols, mask=m0), mask=m0)
        m1 = cols < W1
        tl.store(d1 + rd * sd1 + cols, tl.load(s1 + rs * ss1 + cols, mask=m1), mask=m1)


def copy_rows(pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...], dst_idx: torch.Tensor,
              src_idx: torch.Tensor) -> None:
    """One Triton launch on CUDA for one or two pairs of 2-D tensors; `reference` otherwise."""
    if (triton is None or len(pairs) not in (1, 2) or not dst_idx.is_cuda
            or any(t.dim() != 2 or t.stride(1) != 1 for p in pairs for t in p)
            or any(d.dtype != s.dtype or d.shape[1] != s.shape[1] for d, s in pairs)):
        return reference(pairs, dst_idx, src_idx)
    _launch(pairs, dst_idx, src_idx)


def _launch(pairs, dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
    """The launch without the device checks (also runs under TRITON_INTERPRET=1)."""
    (d0, s0), (d1, s1) = pairs[0], pairs[-1]
    R = dst_idx.numel()
    if R == 0:
        return
    w1 = d1.shape[1] if len(pairs) == 2 else 0  # one pair: the second is masked off entirely
    width = max(d0.shape[1], w1)
    _copy_rows_kernel[(R, triton.cdiv(width, BLOCK))](
        d0, s0, d1, s1, dst_idx.contiguous(), src_idx.contiguous(), d0.shape[1], w1, d0.stride(0),
        s0.stride(0), d1.stride(0), s1.stride(0), BLOCK=BLOCK, num_warps=4)
