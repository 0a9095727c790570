"""MoE token-expert alignment for small batches: the (token, slot) pairs sorted by expert.

idx [T, k] expert ids (0 <= id < E), flattened to f [M], M = T * k:
  order[r] = i    where r = #{j : f[j] < f[i]} + #{j < i : f[j] == f[i]}   (a stable sort by expert)
  inv[i]   = r                                                            (order's inverse: where
                                                                           pair i sits once sorted)
  tok[r]   = i // k                                                       (the pair's token row)
  offs[e]  = #{j : f[j] <= e}                                            (int32: cumulative row ends,
                                                                          torch._grouped_mm's convention)
The torch form is argsort (a radix sort: several launches) plus zeros / ones / index_add /
cumsum / divide (and a scatter for inv); this is one launch. Ranks by counting are O(M^2)
compares, so the launcher takes M <= MAX_PAIRS (decode and small prefills) and the caller keeps
the torch path above. Integer results: identical to the reference, bit for bit.
Grid: cdiv(M, BLOCK) ranking programs, then cdiv(E, BLOCK) programs counting offsets.
"""
from __future__ import annotations

import torch

from deepinfer.kernels.moe_combine import inverse_permutation

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

MAX_PAIRS = 4096
BLOCK = 32  # with 4 warps: the fastest block at decode sizes in the sweep (benchmarks/NOTES.md)


Aligned = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (order, tok, offs, inv)


def reference(idx: torch.Tensor, num_experts: int) -> Aligned:
    """(order [M] int64, tok [M] int64, offs [E] int32, inv [M] int64) without a host sync
    (bincount would sync)."""
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=idx.device)
    offs = torch.cumsum(counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)), 0, dtype=torch.int32)
    return order, order // idx.shape[1], offs, inverse_permutation(order)


if triton is not None:
    @triton.jit
    def _align_kernel(f_ptr, order_ptr, tok_ptr, offs_ptr, inv_ptr, M, E, K, RANK_PROGRAMS, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        j0 = tl.arange(0, BLOCK)
        if pid < RANK_PROGRAMS:
            i = pid * BLOCK + tl.arange(0, BLOCK)
            i_ok = i < M
            fi = tl.load(f_ptr + i, mask=i_ok, other=0)
            rank = tl.zeros([BLOCK], tl.int32)
            for s in range(0, M, BLOCK):
                j = s + j0
                fj = tl.load(f_ptr + j, mask=j < M, other=0)
                before = (fj[None, :] < fi[:, None]) | ((fj[None, :] == fi[:, None]) & (j[None, :] < i[:, None]))
                rank += tl.sum((before & (j < M)[None, :]).to(tl.int32), axis=1)
            tl.store(order_ptr + rank, i.to(tl.int64), mask=i_ok)
            tl.store(tok_ptr + rank, (i // K).to(tl.int64), mask=i_ok)
            tl.store(inv_ptr + i, rank.to(tl.int64), mask=i_ok)
        else:
            e = (pid - RANK_PROGRAMS) * BLOCK + tl.arange(0, BLOCK)
            cnt = tl.zeros([BLOCK], tl.int32)
            for s in range(0, M, BLOCK):
                j = s + j0
                fj = tl.load(f_ptr + j, mask=j < M, other=0)
                cnt += tl.sum(((fj[None, :] <= e[:, None]) & (j < M)[None, :]).to(tl.int32), axis=1)
            tl.store(offs_ptr + e, cnt, mask=e < E)


def supported(idx: torch.Tensor) -> bool:
    return triton is not None and idx.is_cuda and 0 < idx.numel() <= MAX_PAIRS


def moe_align(idx: torch.Tensor, num_experts: int) -> Aligned:
    """One Triton launch on CUDA for up to MAX_PAIRS pairs; `reference` otherwise. Same results."""
    if not supported(idx):
        return reference(idx, num_experts)
    return _launch(idx, num_experts)


def _launch(idx: torch.Tensor, num_experts: int, block: int = BLOCK, num_warps: int = 4) -> Aligned:
    """The launch without the device / size checks (also runs under TRITON_INTERPRET=1)."""
    flat = idx.reshape(-1).contiguous()  # int64 ids read as they are (no cast launch)
    M = flat.numel()
    order = torch.empty(M, dtype=torch.int64, device=idx.device)
    tok = torch.empty(M, dtype=torch.int64, device=idx.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=idx.device)
    inv = torch.empty(M, dtype=torch.int64, device=idx.device)
    rank_programs = triton.cdiv(M, block)
    _align_kernel[(rank_programs + triton.cdiv(num_experts, block),)](
        flat, order, tok, offs, inv, M, num_experts, idx.shape[1], rank_programs, BLOCK=block, num_warps=num_warps)
    return order, tok, offs, inv
