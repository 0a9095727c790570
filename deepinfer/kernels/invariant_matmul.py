"""Batch-invariant GEMM: out = x @ w^T with one fixed tiling whatever the shapes.

For x [M, K] and w [N, K] (both bf16, or both fp32), out[m, n] = sum_k x[m, k] * w[n, k] is
accumulated in fp32 over K tiles of BLOCK_K in ascending order, each tile one tl.dot of a
BLOCK_M x BLOCK_N output block. The tiling (and so every element's reduction order) is the same
for every M, N and row position: a row's result never depends on the other rows of the call, the
property batch-invariant inference needs (cuBLAS picks kernels and split-K by shape). bf16 inputs
multiply on tensor cores (products exact in fp32); fp32 inputs use IEEE fp32 products.
Split-K by (N, K) only: with few output columns (cdiv(N, BLOCK_N) tiles leave most SMs idle at
decode) K is cut into S contiguous ranges, each accumulated as above into fp32 partials, and the
partials are added in split order (kernels/split_sum.py). S never depends on M, so an element's
reduction order stays the same for every M and row position.
Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), S).
"""
from __future__ import annotations

import torch

from deepinfer.kernels.split_sum import split_sum_into

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
TARGET_PROGRAMS = 256  # ~2 per SM on an H200 (132 SMs) for one M tile


def splits(N: int, K: int) -> int:
    """K splits from (N, K) alone: a power of two <= 8 bringing one M tile's programs to about
    TARGET_PROGRAMS, each split a whole number (>= 4) of BLOCK_K tiles. The cap bounds the fp32
    partial traffic at prefill sizes (S x M x N x 4 bytes), where the split buys nothing."""
    n_tiles = -(-N // BLOCK_N)
    k_tiles = K // BLOCK_K if K % BLOCK_K == 0 else 1
    s = 1
    while s < 8 and n_tiles * s * 2 <= TARGET_PROGRAMS and k_tiles % (2 * s) == 0 and k_tiles // (2 * s) >= 4:
        s *= 2
    return s


def reference(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch (no invariance guarantee): x [M, K] @ w [N, K]^T in fp32 -> out_dtype."""
    return (x.float() @ w.float().t()).to(out_dtype or x.dtype)


if triton is not None:
    @triton.jit
    def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, s_xm, s_wn, s_om, K: tl.constexpr, PREC: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr = 1):
        K_PART: tl.constexpr = K // SPLITS
        if SPLITS == 1:
            k_lo = 0
        else:
            k_lo = tl.program_id(2) * K_PART
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        rmask, cmask = rows < M, cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * s_xm
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * s_wn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_PART, BK):
            kmask = (k0 + ks) < K
            a = tl.load(x_rows + (k0 + ks)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_rows + (k0 + ks)[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        out = out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :]
        if SPLITS > 1:  # fp32 partials [SPLITS, M, N]
            out += tl.program_id(2).to(tl.int64) * M * N
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] in out_dtype (default x.dtype). Triton on CUDA (the
    invariant path); the torch reference elsewhere."""
    if triton is None or not x.is_cuda:
        return reference(x.reshape(-1, x.shape[-1]), w, out_dtype).view(*x.shape[:-1], w.shape[0])
    return _launch(x, w, out_dtype)


def _launch(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
            n_splits: int | None = None) -> torch.Tensor:
    K, N = x.shape[-1], w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"invariant matmul: x [..., {K}] and w {tuple(w.shape)} disagree on K")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"invariant matmul: x and w must both be bf16 or both fp32, got {x.dtype}, {w.dtype}")
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    S = n_splits or splits(N, K)
    if S > 1 and K % (S * BLOCK_K):
        raise ValueError(f"invariant matmul: {S} splits of K={K} need whole {BLOCK_K}-wide tiles")
    if M and N:
        prec = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16 operands
        dst = out if S == 1 else torch.empty(S, M, N, dtype=torch.float32, device=x.device)
        _matmul_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), S)](
            x2, w, dst, M, N, x2.stride(0), w.stride(0), N, K=K, PREC=prec,
            BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, SPLITS=S, num_warps=4, num_stages=3)
        if S > 1:
            split_sum_into(dst, out)
    return out.view(*x.shape[:-1], N)
