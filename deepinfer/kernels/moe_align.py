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
shared_slot=True: each token gets one more slot, k, routed to the last expert E - 1 (the shared expert as a
group of the same GEMMs): the results above for idx' = [idx | E - 1] [T, k + 1], without building idx'.
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


def reference(idx: torch.Tensor, num_experts: int, shared_slot: bool = False) -> Aligned:
    """(order [M] int64, tok [M] int64, offs [E] int32, inv [M] int64) without a host sync
    (bincount would sync)."""
    if shared_slot:
        idx = torch.cat((idx, torch.full_like(idx[:, :1], num_experts - 1)), dim=1)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=idx.device)
    offs = torch.cumsum(counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)), 0, dtype=torch.int32)
    return order, order // idx.shape[1], offs, inverse_permutation(order)


if triton is not None:
    @triton.jit
    def _ids(f_ptr, j, M, E, K, SHARED: tl.constexpr):
        """Expert ids of pairs j (0 where j >= M); SHARED: slot K - 1 of each token is E - 1, the others are read
        from f [T, K - 1]."""
        if SHARED:
            last = j % K == K - 1
            f = tl.load(f_ptr + (j // K) * (K - 1) + j % K, mask=(j < M) & ~last, other=0)
            return tl.where(last & (j < M), E - 1, f)
        return tl.load(f_ptr + j, mask=j < M, other=0)

    @triton.jit
    def _align_kernel(f_ptr, order_ptr, tok_ptr, offs_ptr, inv_ptr, M, E, K, RANK_PROGRAMS, BLOCK: tl.constexpr,
                      SHARED: tl.constexpr = False):
        pid = tl.program_id(0)
        j0 = tl.arange(0, BLOCK)
        if pid < RANK_PROGRAMS:
            i = pid * BLOCK + tl.arange(0, BLOCK)
            i_ok = i < M
            fi = _ids(f_ptr, i, M, E, K, SHARED)
            rank = tl.zeros([BLOCK], tl.int32)
            for s in range(0, M, BLOCK):
                j = s + j0
                fj = _ids(f_ptr, j, M, E, K, SHARED)
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
                fj = _ids(f_ptr, j, M, E, K, SHARED)
                cnt += tl.sum(((fj[None, :] <= e[:, None]) & (j < M)[None, :]).to(tl.int32), axis=1)
            tl.store(offs_ptr + e, cnt, mask=e < E)


def supported(idx: torch.Tensor) -> bool:
    return triton is not None and idx.is_cuda and 0 < idx.numel() <= MAX_PAIRS


def moe_align(idx: torch.Tensor, num_experts: int, shared_slot: bool = False) -> Aligned:
    """One Triton launch on CUDA for up to MAX_PAIRS pairs; `reference` otherwise. Same results.
    shared_slot: idx [T, k] takes a slot k routed to expert num_experts - 1 (module docstring)."""
    if not supported(idx) or (shared_slot and idx.numel() + idx.shape[0] > MAX_PAIRS):
        return reference(idx, num_experts, shared_slot)
    return _launch(idx, num_experts, shared_slot=shared_slot)


def _launch(idx: torch.Tensor, num_experts: int, block: int = BLOCK, num_warps: int = 4,
            shared_slot: bool = False) -> Aligned:
    """The launch without the device / size checks (also runs under TRITON_INTERPRET=1)."""
    flat = idx.reshape(-1).contiguous()  # int64 ids read as they are (no cast launch)
    M = flat.numel() + (idx.shape[0] if shared_slot else 0)
    order = torch.empty(M, dtype=torch.int64, device=idx.device)
    tok = torch.empty(M, dtype=torch.int64, device=idx.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=idx.device)
    inv = torch.empty(M, dtype=torch.int64, device=idx.device)
    rank_programs = triton.cdiv(M, block)
    _align_kernel[(rank_programs + triton.cdiv(num_experts, block),)](
        flat, order, tok, offs, inv, M, num_experts, idx.shape[1] + shared_slot, rank_programs, BLOCK=block,
        SHARED=shared_slot, num_warps=num_warps)
    return order, tok, offs, inv
