"""mHC mixes: the streams' RMS-normalised projection onto `fn`, reading the streams once.

For a token with flattened streams f [K] (K = n * D, bf16/fp32) and fn [W, K] (fp32, W = (2 + n) * n):
  mix = (f @ fn^T) * rsqrt(sum(f^2) / K + eps)                (fp32)
i.e. rms_norm(f) @ fn^T with the norm applied after the projection (same value, other rounding).
The torch form reads the streams three times (fp32 copy, norm, GEMM) and runs an fp32 GEMM.
Kernel: tl.dot with tf32x3 (three tf32 products: ~fp32 accuracy on tensor cores; bf16 streams
are exact in tf32; fn split into bf16 parts with bf16 dots is not accurate enough against the fp32
reference: benchmarks/NOTES.md). Many tokens: one program per BT-row block over all of K. Few tokens:
K is cut into S splits (grid rows x S) whose partial sums [S, T, W] and [S, T] a second launch adds in
split order. S depends only on T and K; batch-invariant mode takes one from K alone.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BK = 64


def split_count(T: int, K: int, block_t: int = 32, target_programs: int = 1024) -> int:
    """K splits so that row blocks x splits keeps enough programs in flight for a memory-bound pass
    (~8 per SM on an H200); each split a whole number of BK blocks (>= 2), at most 128 splits (the
    cap the decode-size sweep picked: benchmarks/NOTES.md)."""
    kb = K // BK
    bound = max(1, min(kb // 2, 128, target_programs // max(1, -(-T // block_t))))
    s = 1 << (bound.bit_length() - 1)  # a power of two (the reduce kernel's tl.arange) dividing kb
    while kb % s:
        s //= 2
    return s


def reference(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch: x [T, K], fn [W, K] -> mix [T, W] (fp32)."""
    f = x.float()
    return (f @ fn.float().t()) * torch.rsqrt(f.square().mean(-1, keepdim=True) + eps)


if triton is not None:
    @triton.jit
    def _mix_kernel(x_ptr, fn_ptr, out_ptr, sq_ptr, T, stride_x, K, eps, K_SPLIT: tl.constexpr,
                    W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr,
                    PARTIAL: tl.constexpr, PREC: tl.constexpr):
        s = tl.program_id(1)
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        live = rows < T
        w_rows = tl.arange(0, WP)
        cols = tl.arange(0, BLOCK_K)
        x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        acc = tl.zeros([BT, WP], dtype=tl.float32)
        sq = tl.zeros([BT, BLOCK_K], dtype=tl.float32)
        k0 = s * K_SPLIT
        for kk in range(0, K_SPLIT, BLOCK_K):
            k = k0 + kk
            f = tl.load(x_base + k + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            w = tl.load(fn_ptr + w_rows[:, None] * K + k + cols[None, :], mask=(w_rows < W)[:, None], other=0.0)
            acc = tl.dot(f, tl.trans(w), acc, input_precision=PREC)
            sq += f * f
        ssq = tl.sum(sq, axis=1)
        omask = live[:, None] & (w_rows < W)[None, :]
        if PARTIAL:  # [S, T, W] partial projections and [S, T] partial sums of squares
            tl.store(out_ptr + (s * T + rows.to(tl.int64))[:, None] * W + w_rows[None, :], acc, mask=omask)
            tl.store(sq_ptr + s * T + rows, ssq, mask=live)
        else:
            r = tl.rsqrt(ssq / K + eps)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * W + w_rows[None, :], acc * r[:, None], mask=omask)

    @triton.jit
    def _reduce_kernel(part_ptr, sq_ptr, out_ptr, T, K, eps, S: tl.constexpr, W: tl.constexpr,
                       WP: tl.constexpr):
        t = tl.program_id(0)
        s = tl.arange(0, S)
        w = tl.arange(0, WP)
        p = tl.load(part_ptr + (s[:, None] * T + t) * W + w[None, :], mask=(w < W)[None, :], other=0.0)
        r = tl.rsqrt(tl.sum(tl.load(sq_ptr + s * T + t), axis=0) / K + eps)
        tl.store(out_ptr + t * W + w, tl.sum(p, axis=0) * r, mask=w < W)


def fixed_splits(K: int) -> int:
    """The batch-invariant split count: from K alone (32 at K = 16384), so a decode row still spreads
    its K over many programs."""
    return split_count(1, K, target_programs=32)


def mhc_mix(x: torch.Tensor, fn: torch.Tensor, eps: float, splits: int | None = None,
            fixed: bool = False) -> torch.Tensor:
    """x [T, K] (unit stride over K), fn [W, K] fp32 -> mix [T, W] fp32. Triton on CUDA; the torch
    reference elsewhere. `fixed`: one tiling for every T (16-row blocks, `fixed_splits(K)` K splits
    added in split order by a kernel whose reduction tree depends on the split count only), so a row's
    value does not depend on T (batch-invariant mode)."""
    if triton is None or not x.is_cuda or x.shape[0] == 0:
        return reference(x, fn, eps)
    return _launch(x, fn, eps, fixed_splits(x.shape[1]) if fixed else splits, 16 if fixed else None)


def _launch(x: torch.Tensor, fn: torch.Tensor, eps: float, splits: int | None = None,
            bt: int | None = None) -> torch.Tensor:
    T, K = x.shape
    W = fn.shape[0]
    bt = bt or (16 if T <= 16 else 32 if T < 4096 else 64)
    splits = splits or split_count(T, K, bt)
    if K % (splits * BK) or x.stride(-1) != 1 or splits & (splits - 1):
        raise ValueError(f"mhc_mix: K={K} must split into {splits} (a power of two) x {BK}-wide blocks, unit stride")
    fn = fn.float().contiguous()
    out = torch.empty(T, W, dtype=torch.float32, device=x.device)
    wp = max(16, triton.next_power_of_2(W))
    prec = "tf32x3" if x.is_cuda else "ieee"
    if splits == 1:
        _mix_kernel[(triton.cdiv(T, bt), 1)](x, fn, out, out, T, x.stride(0), K, eps, K_SPLIT=K, W=W, WP=wp, BT=bt,
                                             BLOCK_K=BK, PARTIAL=False, PREC=prec, num_warps=4)
        return out
    part = torch.empty(splits, T, W, dtype=torch.float32, device=x.device)
    sq = torch.empty(splits, T, dtype=torch.float32, device=x.device)
    _mix_kernel[(triton.cdiv(T, bt), splits)](x, fn, part, sq, T, x.stride(0), K, eps, K_SPLIT=K // splits, W=W,
                                              WP=wp, BT=bt, BLOCK_K=BK, PARTIAL=True, PREC=prec, num_warps=4)
    _reduce_kernel[(T,)](part, sq, out, T, K, eps, S=splits, W=W, WP=wp, num_warps=1)
    return out
