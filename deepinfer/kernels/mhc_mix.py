"""mHC mixes as split-K partial sums: the streams' projection onto `fn` and their sum of squares.

For a token with flattened streams f [K] (K = n * D) and fn [W, K] (fp32, W = (2 + n) * n):
  part[s, t, :] = sum_{k in split s} f[k] * fn[:, k]        (fp32)
  sq[s, t]      = sum_{k in split s} f[k]^2                  (fp32)
The consumer (mhc_coeffs) sums the S splits in split order and forms
  mix = sum_s part[s] * rsqrt(sum_s sq[s] / K + eps)
i.e. rms_norm(f) @ fn^T with the norm applied after the projection (same value, other rounding).
The torch form reads the streams three times (fp32 copy, norm, GEMM); this reads them once, and
the K splits keep every SM busy at decode sizes. Grid: (row blocks of BT tokens, S splits).
The split count depends only on T and K; batch-invariant callers pass a fixed one.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BK = 64


def split_count(T: int, K: int, block_t: int = 32, target_programs: int = 264) -> int:
    """K splits so that row blocks x splits fills the GPU; each split a whole number of BK blocks."""
    kb = K // BK
    s = max(1, min(kb // 4, target_programs // max(1, -(-T // block_t))))
    while kb % s:
        s -= 1
    return s


def reference(x: torch.Tensor, fn: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: x [T, K], fn [W, K] -> part [S, T, W], sq [S, T] (fp32), S = splits."""
    f = x.float().view(x.shape[0], splits, -1).transpose(0, 1)               # [S, T, K/S]
    w = fn.float().view(fn.shape[0], splits, -1).transpose(0, 1)             # [S, W, K/S]
    return torch.bmm(f, w.transpose(1, 2)), f.square().sum(-1)


if triton is not None:
    @triton.jit
    def _mix_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, T, stride_x, K, K_SPLIT: tl.constexpr,
                    W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr):
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
            w = tl.load(fn_ptr + w_rows[:, None] * K + k + cols[None, :],
                        mask=(w_rows < W)[:, None], other=0.0)
            acc = tl.dot(f, tl.trans(w), acc, input_precision="ieee")
            sq += f * f
        out = part_ptr + (s * T + rows.to(tl.int64))[:, None] * W + w_rows[None, :]
        tl.store(out, acc, mask=live[:, None] & (w_rows < W)[None, :])
        tl.store(sq_ptr + s * T + rows, tl.sum(sq, axis=1), mask=live)


def mix_partials(x: torch.Tensor, fn: torch.Tensor, splits: int | None = None):
    """x [T, K] (bf16 / fp32, unit stride over K), fn [W, K] fp32 -> (part [S, T, W], sq [S, T]).
    Triton on CUDA; the torch reference elsewhere."""
    T, K = x.shape
    splits = splits or (split_count(T, K) if triton is not None and x.is_cuda else 1)
    if triton is None or not x.is_cuda:
        return reference(x, fn, splits)
    return _launch(x, fn, splits)


def _launch(x: torch.Tensor, fn: torch.Tensor, splits: int):
    T, K = x.shape
    W = fn.shape[0]
    if K % (splits * BK) or x.stride(-1) != 1:
        raise ValueError(f"mix_partials: K={K} must split into {splits} x {BK}-wide blocks, unit stride")
    part = torch.empty(splits, T, W, dtype=torch.float32, device=x.device)
    sq = torch.empty(splits, T, dtype=torch.float32, device=x.device)
    bt = 16 if T <= 16 else 32
    _mix_kernel[(triton.cdiv(T, bt), splits)](x, fn.float().contiguous(), part, sq, T, x.stride(0), K, K // splits,
                                             W=W, WP=max(16, triton.next_power_of_2(W)), BT=bt, BLOCK_K=BK,
                                             num_warps=4)
    return part, sq
