"""CSA2's hierarchical candidates (DeepSeek-V4.1's candidate source layer): of each token's
visible entries, those in the `topk_blocks` blocks of `block` entries with the highest maximum
indexer score; the block holding the newest visible entry is always kept.

scores [T, W] fp32 (-inf where not visible, never NaN), visible [T]:
  per_block[t, b] = max over entries e of block b (e < W) of scores[t, e]
  per_block[t, (visible[t] - 1) // block] = +inf           (none when visible[t] = 0)
  kept: the first min(topk_blocks, nb) blocks of the stable descending sort of per_block (ties:
        lowest block first) whose per_block > -inf
  out[t, e] = e < visible[t] and block e // block is kept   (bool [T, W])
The reference is that sort. The kernel path gives the same booleans: each block's maximum becomes
index_topk's unique int64 key (blocks at -inf not candidates), whose order is the sort's order, so
the kept blocks are exactly the candidate blocks whose key is >= the topk_blocks-th largest key.
Launches: block keys; when topk_blocks < nb that key per row (torch.topk, no host sync); the
expansion to entries. Shapes depend only on the inputs' shapes (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels import index_topk as _topk

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCKS_PER_PROGRAM = 128
ENTRIES_PER_PROGRAM = 1024


def reference(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Plain torch (the sort), same contract."""
    T, W = scores.shape
    nb = -(-W // block)
    per_block = F.pad(scores, (0, nb * block - W), value=float("-inf")).view(T, nb, block).amax(-1)
    newest = (visible - 1).div(block, rounding_mode="floor")
    per_block = per_block.masked_fill(torch.arange(nb, device=scores.device) == newest[:, None], float("inf"))
    val, idx = torch.sort(per_block, dim=-1, descending=True, stable=True)
    val, idx = val[:, :min(topk_blocks, nb)], idx[:, :min(topk_blocks, nb)]
    keep = torch.zeros(T, nb, dtype=torch.bool, device=scores.device).scatter(-1, idx, val > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[:, :W] & (torch.arange(W, device=scores.device) < visible[:, None])


if triton is not None:
    @triton.jit
    def _block_keys_kernel(s_ptr, vis_ptr, key_ptr, W, NB, block, BB: tl.constexpr, BLK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1) * BB + tl.arange(0, BB)
        j = tl.arange(0, BLK)
        e = b[:, None] * block + j[None, :]
        s = tl.load(s_ptr + t * W + e, mask=(j[None, :] < block) & (e < W), other=float("-inf"))
        mx = tl.max(s, axis=1)
        vis = tl.load(vis_ptr + t)
        newest = tl.where(vis > 0, (vis - 1) // block, -1)
        mx = tl.where(b == newest, float("inf"), mx)
        tl.store(key_ptr + t * NB + b, _topk.packed_key(mx, b, mx > float("-inf")), mask=b < NB)

    @triton.jit
    def _expand_kernel(key_ptr, kth_ptr, vis_ptr, out_ptr, W, NB, block, BE: tl.constexpr, HAS_KTH: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        vis = tl.load(vis_ptr + t)
        seen = e < vis
        key = tl.load(key_ptr + t * NB + e // block, mask=seen, other=0)
        keep = seen & ((key >> 32) != -2147483648)
        if HAS_KTH:
            keep = keep & (key >= tl.load(kth_ptr + t))
        tl.store(out_ptr + t * W + e, keep, mask=e < W)


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """The kernel path on CUDA, the reference elsewhere (same booleans)."""
    if triton is None or not scores.is_cuda or scores.dtype != torch.float32 or scores.shape[0] == 0:
        return reference(scores, visible, topk_blocks, block)
    return _launch(scores, visible, topk_blocks, block)


def _launch(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """The launches without the device checks (also run under TRITON_INTERPRET=1)."""
    T, W = scores.shape
    nb = -(-W // block)
    out = torch.empty(T, W, dtype=torch.bool, device=scores.device)
    if T == 0 or W == 0:
        return out
    scores, visible = scores.contiguous(), visible.contiguous()
    keys = torch.empty(T, nb, dtype=torch.int64, device=scores.device)
    _block_keys_kernel[(T, triton.cdiv(nb, BLOCKS_PER_PROGRAM))](
        scores, visible, keys, W, nb, block, BB=BLOCKS_PER_PROGRAM, BLK=triton.next_power_of_2(block), num_warps=4)
    kth = torch.topk(keys, topk_blocks, dim=1, sorted=False).values.amin(1) if topk_blocks < nb else None
    _expand_kernel[(T, triton.cdiv(W, ENTRIES_PER_PROGRAM))](
        keys, keys if kth is None else kth, visible, out, W, nb, block, BE=ENTRIES_PER_PROGRAM,
        HAS_KTH=kth is not None, num_warps=4)
    return out
