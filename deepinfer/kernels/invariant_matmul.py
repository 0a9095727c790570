"""Batch-invariant GEMM: out = x @ w^T with one fixed tiling whatever the shapes.

For x [M, K] and w [N, K] (both bf16, or both fp32), out[m, n] = sum_k x[m, k] * w[n, k] is
accumulated in fp32 over K tiles of BLOCK_K in ascending order, each tile one tl.dot of a
BLOCK_M x BLOCK_N output block. The tiling (and so every element's reduction order) is the same
for every M, N and row position: a row's result never depends on the other rows of the call, the
property batch-invariant inference needs (cuBLAS picks kernels and split-K by shape). bf16 inputs
multiply on tensor cores (products exact in fp32); fp32 inputs use IEEE fp32 products.
Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


def reference(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch (no invariance guarantee): x [M, K] @ w [N, K]^T in fp32 -> out_dtype."""
    return (x.float() @ w.float().t()).to(out_dtype or x.dtype)


if triton is not None:
    @triton.jit
    def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, s_xm, s_wn, s_om, K: tl.constexpr, PREC: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        rmask, cmask = rows < M, cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * s_xm
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * s_wn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kmask = (k0 + ks) < K
            a = tl.load(x_rows + (k0 + ks)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_rows + (k0 + ks)[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        out = out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] in out_dtype (default x.dtype). Triton on CUDA (the
    invariant path); the torch reference elsewhere."""
    if triton is None or not x.is_cuda:
        return reference(x.reshape(-1, x.shape[-1]), w, out_dtype).view(*x.shape[:-1], w.shape[0])
    return _launch(x, w, out_dtype)


def _launch(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
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
    if M and N:
        prec = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16 operands
        _matmul_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))](
            x2, w, out, M, N, x2.stride(0), w.stride(0), out.stride(0), K=K, PREC=prec,
            BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=4, num_stages=3)
    return out.view(*x.shape[:-1], N)
