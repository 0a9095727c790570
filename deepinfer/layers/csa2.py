"""DeepSeek-V4.1 CSA2: the compressor and the lightning indexer whose keys layers share."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels.copy_rows import copy_rows
from deepinfer.layers.attention import _chunks
from deepinfer.state.forward_batch import CompressPlan, ForwardBatch
from deepinfer.state.kv_state import CarryState, LayerCache
from deepinfer.layers import invariant
from deepinfer.layers.linear import DENSE, Linear, QuantSpec, dense_linear
from deepinfer.layers.norm import RMSNorm


@dataclass
class CSA2State:
    """What a Full layer publishes for the layers below the next Full layer, within one step."""

    source: LayerCache                     # holds the compressed entries and index keys
    plan: CompressPlan                     # their addresses and per-token visibility
    topk: torch.Tensor | None = None       # [T, k] entry ids of the latest index source, -1 = none
    candidates: torch.Tensor | None = None  # [T, max_visible] entries allowed by the candidate source


class PoolCompressor(nn.Module):
    """Ratio 1: one entry per token, norm(wkv x). Ratio r > 1: entry g pools tokens g*r .. g*r+r-1
    with a per-channel softmax over the group (fp32 projections, no positional bias)."""

    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(dim, head_dim, torch.float32)
        if ratio > 1:
            self.wgate = Linear(dim, head_dim, torch.float32)
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, plan: CompressPlan, carry: CarryState | None) -> torch.Tensor:
        """-> unrotated normalised latents [N, head_dim] of the entries closing this step (plan order)."""
        if self.ratio == 1:
            return self.norm(dense_linear(x, self.wkv.dense_weight(x.dtype)))
        kv = self.wkv.forward_fp32(x)
        score = self.wgate.forward_fp32(x)
        new, old = plan.src_new, plan.src_carry
        src_kv = torch.where((new >= 0)[..., None], kv[new.clamp(min=0)], carry.kv[old.clamp(min=0)])
        src_score = torch.where((new >= 0)[..., None], score[new.clamp(min=0)], carry.score[old.clamp(min=0)])
        copy_rows(((carry.kv, kv), (carry.score, score)), plan.carry_dst, plan.carry_src)  # one launch on CUDA
        weights = src_score.transpose(1, 2).softmax(dim=-1).transpose(1, 2)  # row-local over the group
        return self.norm((weights * src_kv).sum(dim=1).to(x.dtype))


def _stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, equal scores in ascending index order (lowest index first)."""
    val, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return val[..., :k], idx[..., :k]


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """scores [T, W] (-inf where not visible) -> bool [T, W]: entries in the `topk_blocks` blocks of
    `block` entries with the highest max score; the block holding the newest visible entry always."""
    T, W = scores.shape
    nb = -(-W // block)
    per_block = F.pad(scores, (0, nb * block - W), value=float("-inf")).view(T, nb, block).amax(-1)
    newest = (visible - 1).div(block, rounding_mode="floor")
    per_block = per_block.masked_fill(torch.arange(nb, device=scores.device) == newest[:, None], float("inf"))
    val, idx = _stable_topk(per_block, min(topk_blocks, nb))
    keep = torch.zeros(T, nb, dtype=torch.bool, device=scores.device).scatter(-1, idx, val > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[:, :W]


class Indexer41(nn.Module):
    """Lightning indexer over the latest Full layer's keys: s(t, g) = sum_h w_h relu(q_h . k_g)."""

    def __init__(self, dim: int, q_lora_rank: int, head_dim: int, n_heads: int, index_dim: int, topk: int,
                 owns_keys: bool, eps: float, dtype: torch.dtype, quant: QuantSpec = DENSE):
        super().__init__()
        self.n_heads, self.index_dim, self.topk = n_heads, index_dim, topk
        self.wq_b = Linear(q_lora_rank, n_heads * index_dim, dtype, quant)
        self.weights_proj = Linear(dim, n_heads, dtype)
        if owns_keys:
            self.wk = Linear(head_dim, index_dim, dtype)
            self.k_norm = RMSNorm(index_dim, eps)

    def keys(self, latent: torch.Tensor) -> torch.Tensor:
        return self.k_norm(self.wk(latent))

    def forward(self, x: torch.Tensor, q: torch.Tensor, batch: ForwardBatch, state: CSA2State,
                candidate_source: tuple[int, int] | None, use_candidates: bool):
        """q [T, Hi, Di] rotated (and quantised like the keys). Returns (top-k ids [T, k], candidates)."""
        plan, keys = state.plan, state.source.index_keys
        w = self.weights_proj(x).float() * (self.index_dim ** -0.5 * self.n_heads ** -0.5)
        nv = plan.max_visible
        k = min(self.topk, nv)
        out = torch.full((x.shape[0], k), -1, dtype=torch.long, device=x.device)
        cands = torch.zeros(x.shape[0], nv, dtype=torch.bool, device=x.device) if candidate_source else None
        for sl in _chunks(x.shape[0], nv * self.index_dim):
            kk = keys.read(plan.addr[batch.token_req[sl]], torch.float32)          # [Tc, nv, Di]
            qs, ws = q[sl].float(), w[sl, :, None]
            s = invariant.by_key_blocks(lambda kb: invariant.reduce_sum(invariant.qk(qs, kb).relu() * ws, 1), kk)
            visible = torch.arange(nv, device=x.device) < plan.visible[sl, None]
            s = s.masked_fill(~visible, float("-inf"))
            if candidate_source:
                cands[sl] = candidate_blocks(s, plan.visible[sl], *candidate_source) & visible
            elif use_candidates:
                s = s.masked_fill(~state.candidates[sl], float("-inf"))
            val, idx = _stable_topk(s, k)
            out[sl] = torch.where(val > float("-inf"), idx, -1)
        return out, cands
