"""DeepSeek-V4.1 blocks: CSA2 compressor and indexer (shared across layers), Engram memory."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels.copy_rows import copy_rows
from deepinfer.layers.attention import _chunks
from deepinfer.layers.forward_batch import CompressPlan, ForwardBatch
from deepinfer.layers.kv_state import CarryState, LayerCache
from deepinfer.layers import invariant
from deepinfer.layers.linear import DENSE, Linear, QuantSpec, dense_linear
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.quant import dequant_fp8_blocks


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


class EngramTable(nn.Module):
    """The hashed n-gram table: FP8 rows with one E8M0 scale per 32 columns as stored, or dense.
    With `host_resident` it is created on the meta device for the loader to bind to the shards'
    bytes, memory-mapped on the host: only looked-up rows are read and moved to the compute device."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, quantized: bool, host_resident: bool = False):
        super().__init__()
        dev = "meta" if host_resident else None
        if quantized:
            self.register_buffer("weight", torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device=dev))
            self.register_buffer("scale", torch.empty(rows, dim // 32, dtype=torch.float8_e8m0fnu, device=dev))
        else:
            self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype, device=dev), requires_grad=False)
            self.scale = None

    def lookup(self, rows: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """rows [...] (any device) -> [..., dim] on `device`."""
        rows = rows.to(self.weight.device)
        w = self.weight[rows]
        if self.scale is not None:
            w = dequant_fp8_blocks(w.flatten(0, -2), self.scale[rows].flatten(0, -2), (1, 32), dtype).view(w.shape)
        return w.to(device=device, dtype=dtype, non_blocking=True)


class Engram(nn.Module):
    """Gated injection of hashed n-gram memory into every residual stream (before the block)."""

    def __init__(self, dim: int, n_streams: int, rows: int, head_dim: int, hash_heads: int, eps: float,
                 dtype: torch.dtype, quant: QuantSpec = DENSE, fp8_table: bool = False, host_resident: bool = False):
        super().__init__()
        self.dim, self.n, self.eps = dim, n_streams, eps
        self.embed = EngramTable(rows, head_dim, dtype, fp8_table, host_resident)
        self.wkv = Linear(hash_heads * head_dim, dim * (n_streams + 1), dtype, quant)
        self.q_weight = nn.Parameter(torch.ones(n_streams, dim, dtype=dtype), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(n_streams, dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        """x [T, n, D], rows [T, hash_heads] table rows; token_mask False = image/pad (gate 0)."""
        emb = self.embed.lookup(rows, x.dtype, x.device).flatten(1)
        key, value = self.wkv(emb).split((self.n * self.dim, self.dim), dim=-1)
        key, h = key.float().unflatten(-1, (self.n, self.dim)), x.float()
        w = self.q_weight.float() * self.k_weight.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * w * key).sum(-1) * rstd * self.dim ** -0.5
        gate = invariant.pointwise(torch.sigmoid, torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask[:, None], 0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(x.dtype)

