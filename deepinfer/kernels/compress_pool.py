"""Compressor pooling: each closed entry's softmax-gated sum over its source slots, per channel.

For entry n with S source slots (slot j: this step's token src_new[n, j] >= 0, else the carry
row src_carry[n, j] >= 0, else absent) and per-token projections kv, score [*, width] (fp32):
  s[j, c] = score[src(j), col(j, c)]   (-inf for an absent slot)
  v[j, c] = kv[src(j), col(j, c)]
  pooled[n, c] = sum_j softmax_j(s[:, c])[j] * v[j, c]          (fp32, one rounding to out dtype)
Without overlap col(j, c) = c (width = dim); with overlap (CSA) the first S/2 slots read channel c
and the last S/2 slots channel dim + c (width = 2 * dim: each token projects the next window's
channels first). The torch form gathers both tensors, concatenates, transposes for the softmax,
multiplies and sums: a dozen launches and [N, S, dim] temporaries; this is one launch.
Grid: (entry, channel block); the slots are reduced in slot order, independent of N.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def reference(kv: torch.Tensor, score: torch.Tensor, carry_kv: torch.Tensor, carry_score: torch.Tensor,
              src_new: torch.Tensor, src_carry: torch.Tensor, dim: int, overlap: bool) -> torch.Tensor:
    """Plain torch: -> pooled [N, dim] fp32."""
    new, old = src_new, src_carry
    src_kv = torch.where((new >= 0)[..., None], kv[new.clamp(min=0)], carry_kv[old.clamp(min=0)])
    src_score = torch.where((new >= 0)[..., None], score[new.clamp(min=0)], carry_score[old.clamp(min=0)])
    src_score = src_score.masked_fill(((new < 0) & (old < 0))[..., None], float("-inf"))
    if overlap:
        m = new.shape[1] // 2
        src_kv = torch.cat((src_kv[:, :m, :dim], src_kv[:, m:, dim:]), dim=1)
        src_score = torch.cat((src_score[:, :m, :dim], src_score[:, m:, dim:]), dim=1)
    weights = torch.softmax(src_score.transpose(1, 2), dim=-1).transpose(1, 2)
    return (weights * src_kv).sum(dim=1)


if triton is not None:
    @triton.jit
    def _pool_kernel(kv_ptr, score_ptr, ckv_ptr, cscore_ptr, new_ptr, old_ptr, out_ptr, WIDTH, STRIDE_KV,
                     S: tl.constexpr, SP: tl.constexpr, DIM: tl.constexpr, OVERLAP: tl.constexpr,
                     BD: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BD + tl.arange(0, BD)
        j = tl.arange(0, SP)
        live = j < S
        new = tl.load(new_ptr + n * S + j, mask=live, other=-1).to(tl.int64)
        old = tl.load(old_ptr + n * S + j, mask=live, other=-1).to(tl.int64)
        if OVERLAP:
            col = tl.where(j < S // 2, 0, DIM)[:, None] + c[None, :]
        else:
            col = tl.zeros([SP], tl.int32)[:, None] + c[None, :]
        cm = (c < DIM)[None, :]
        is_new = (new >= 0)[:, None] & cm
        is_old = ((new < 0) & (old >= 0))[:, None] & cm
        s_new = tl.load(score_ptr + new[:, None] * WIDTH + col, mask=is_new, other=0.0)
        s_old = tl.load(cscore_ptr + old[:, None] * WIDTH + col, mask=is_old, other=0.0)
        v_new = tl.load(kv_ptr + new[:, None] * STRIDE_KV + col, mask=is_new, other=0.0)
        v_old = tl.load(ckv_ptr + old[:, None] * WIDTH + col, mask=is_old, other=0.0)
        s = tl.where(is_new, s_new, tl.where(is_old, s_old, float("-inf")))
        v = tl.where(is_new, v_new, v_old)
        m = tl.max(s, axis=0)
        p = tl.exp(s - m[None, :])
        p = tl.where(is_new | is_old, p, 0.0)
        out = tl.sum(p * v, axis=0) / tl.sum(p, axis=0)
        tl.store(out_ptr + n * DIM + c, out, mask=c < DIM)


def compress_pool(kv: torch.Tensor, score: torch.Tensor, carry_kv: torch.Tensor, carry_score: torch.Tensor,
                  src_new: torch.Tensor, src_carry: torch.Tensor, dim: int, overlap: bool) -> torch.Tensor:
    """Fused on CUDA (Triton), the torch reference elsewhere; same contract as `reference`.
    Every entry must have at least one present slot (a closed entry always has its own token)."""
    if triton is None or not kv.is_cuda or src_new.shape[0] == 0:
        return reference(kv, score, carry_kv, carry_score, src_new, src_carry, dim, overlap)
    return _launch(kv, score, carry_kv, carry_score, src_new, src_carry, dim, overlap)


def _launch(kv, score, carry_kv, carry_score, src_new, src_carry, dim, overlap):
    N, S = src_new.shape
    width = kv.shape[1]
    if score.shape[1] != width or carry_kv.shape[1] != width or width != (2 * dim if overlap else dim):
        raise ValueError(f"compress_pool: widths kv {width}, score {score.shape[1]}, carry {carry_kv.shape[1]} "
                         f"do not fit dim {dim} (overlap={overlap})")
    out = torch.empty(N, dim, dtype=torch.float32, device=kv.device)
    sp = triton.next_power_of_2(S)
    bd = min(triton.next_power_of_2(dim), max(16, 2048 // sp))  # an [SP, BD] tile of ~2k elements
    kv = kv if kv.stride(1) == 1 else kv.contiguous()  # rows may be strided (a column view of a stacked GEMM)
    _pool_kernel[(N, triton.cdiv(dim, bd))](kv, score.contiguous(), carry_kv.contiguous(),
                                            carry_score.contiguous(), src_new.contiguous(), src_carry.contiguous(),
                                            out, width, kv.stride(0), S=S, SP=sp, DIM=dim, OVERLAP=overlap, BD=bd,
                                            num_warps=4)
    return out
