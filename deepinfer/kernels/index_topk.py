"""The indexer's top-k for short rows: ids of the k best visible scores, ties to the lowest id.

s [T, N] fp32 scores, visible [T] (entries >= visible[t] are not candidates), k <= N:
  a candidate i of row t (i < visible[t], s[t, i] > -inf) has
  rank_i = #{j candidate : s_j > s_i} + #{j candidate, j < i : s_j == s_i}
  out[t, rank_i] = i when rank_i < k; out[t, r] = -1 for r >= the number of candidates.
This is the stable descending sort's first k ids (the reference), computed by counting: O(N^2)
compares per row, so the launcher takes N <= MAX_N and T * N^2 <= MAX_WORK (decode), and the
caller keeps torch.sort above. One launch instead of arange / masked_fill / sort (a multi-kernel
radix sort) / slice / where. Integer results: identical to the reference.
Grid: one program per row; positions written by the scatter (< #candidates) and by the -1 fill
(>= #candidates) never overlap, so no ordering between the two stores is needed.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

MAX_N = 1024
MAX_WORK = 1 << 26
BLOCK = 64


def reference(s: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    s = s.masked_fill(torch.arange(s.shape[1], device=s.device) >= visible[:, None], float("-inf"))
    val, idx = torch.sort(s, dim=-1, descending=True, stable=True)
    return torch.where(val[:, :k] > float("-inf"), idx[:, :k], -1)


if triton is not None:
    @triton.jit
    def _topk_kernel(s_ptr, vis_ptr, out_ptr, N, K, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        vis = tl.load(vis_ptr + t)
        a = tl.arange(0, BLOCK)
        n_cand = tl.zeros([BLOCK], tl.int32)
        for i0 in range(0, N, BLOCK):
            i = i0 + a
            si = tl.load(s_ptr + t * N + i, mask=i < N, other=float("-inf"))
            ci = (i < vis) & (si > float("-inf"))
            n_cand += ci.to(tl.int32)
            rank = tl.zeros([BLOCK], tl.int32)
            for j0 in range(0, N, BLOCK):
                j = j0 + a
                sj = tl.load(s_ptr + t * N + j, mask=j < N, other=float("-inf"))
                cj = (j < vis) & (sj > float("-inf"))
                ahead = (sj[None, :] > si[:, None]) | ((sj[None, :] == si[:, None]) & (j[None, :] < i[:, None]))
                rank += tl.sum((ahead & cj[None, :]).to(tl.int32), axis=1)
            tl.store(out_ptr + t * K + rank, i.to(tl.int64), mask=ci & (rank < K))
        total = tl.sum(n_cand, axis=0)
        for r0 in range(0, K, BLOCK):
            r = r0 + a
            tl.store(out_ptr + t * K + r, tl.full([BLOCK], -1, tl.int64), mask=(r < K) & (r >= total))


def supported(s: torch.Tensor) -> bool:
    T, N = s.shape
    return triton is not None and s.is_cuda and s.dtype == torch.float32 and 0 < N <= MAX_N and T * N * N <= MAX_WORK


def index_topk(s: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """[T, N] scores -> [T, k] int64 ids (-1 = none). One Triton launch for short rows on CUDA."""
    if not supported(s) or s.shape[0] == 0:
        return reference(s, visible, k)
    return _launch(s, visible, k)


def _launch(s: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The launch without the device / size checks (also runs under TRITON_INTERPRET=1)."""
    T, N = s.shape
    out = torch.empty(T, k, dtype=torch.int64, device=s.device)
    _topk_kernel[(T,)](s.contiguous(), visible.contiguous(), out, N, k, BLOCK=BLOCK, num_warps=4)
    return out
