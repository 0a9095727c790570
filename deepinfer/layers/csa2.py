"""DeepSeek-V4.1 CSA2: the compressor and the lightning indexer whose keys layers share.

On CUDA (bf16 activations) the indexer runs fused kernels: scores against the keys read at their
cache addresses in the store's own format (bf16, or MXFP4 decoded in registers: no [T, V, D]
gather), the candidate source's block selection (kernels/candidate_blocks.py) and the top-k, with
the reindex layers' candidate mask applied inside it (kernels/index_topk.py); the ratio-2
compressor pools in one launch (kernels/compress_pool.py). The plain torch below is the reference
those kernels are tested against (ids and candidates equal; scores and pooled values up to fp32
summation order). No host syncs: every shape comes from the plan's tensor shapes and the host
list of per-request token counts (fixed for a captured decode graph).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.kernels import candidate_blocks as _cand
from deepinfer.kernels import compress_pool as _pool
from deepinfer.kernels import index_scores as _scores
from deepinfer.kernels import index_topk as _topk
from deepinfer.kernels.copy_rows import copy_rows
from deepinfer.layers.attention import SHARED_KEYS_MIN_TOKENS, _chunks
from deepinfer.state.forward_batch import CompressPlan, ForwardBatch, to_device
from deepinfer.state.kv_state import CarryState, LayerCache
from deepinfer.layers import invariant
from deepinfer.layers.linear import DENSE, Linear, QuantSpec, dense_linear, stacked_forward
from deepinfer.layers.norm import RMSNorm


@dataclass
class CSA2State:
    """What a Full layer publishes for the layers below the next Full layer, within one step."""

    source: LayerCache                     # holds the compressed entries and index keys
    plan: CompressPlan                     # their addresses and per-token visibility
    topk: torch.Tensor | None = None       # [T, k] entry ids of the latest index source, -1 = none
    candidates: torch.Tensor | None = None  # [T, max_visible] entries allowed by the candidate source


def _kernels(t: torch.Tensor) -> bool:
    """Run the Triton kernels for tensors like t: on CUDA, and on the CPU under TRITON_INTERPRET=1
    (the tests that check this layer's kernel path against its torch path)."""
    return _scores.triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


class PoolCompressor(nn.Module):
    """Ratio 1: one entry per token, norm(wkv x). Ratio r > 1: entry g pools tokens g*r .. g*r+r-1
    with a per-channel softmax over the group (fp32 projections, no positional bias).
    Kernel path (ratio > 1): the two projections as one GEMM, the pooling as one launch reducing
    the group's slots in slot order (batch-invariant); it computes sum(p v) / sum(p) where the
    reference computes sum((p / sum(p)) v), so pooled values agree to fp32 rounding (~1e-6
    relative) before the rounding to the activation dtype."""

    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(dim, head_dim, torch.float32)
        if ratio > 1:
            self.wgate = Linear(dim, head_dim, torch.float32)
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, plan: CompressPlan, carry: CarryState | None, gather=None) -> torch.Tensor:
        """-> unrotated normalised latents [N, head_dim] of the entries closing this step (plan order).
        `gather` (context parallelism): x holds some rows of the step, the plan indexes all of them;
        ratio 1 gathers the rows' latents, ratio > 1 their projections before pooling."""
        if self.ratio == 1:
            latent = self.norm(dense_linear(x, self.wkv.dense_weight(x.dtype)))
            return latent if gather is None else gather(latent)
        new, old = plan.src_new, plan.src_carry
        if _kernels(x) and new.shape[0]:
            kv, score = stacked_forward(self, "_wkv_wgate", (self.wkv, self.wgate), x, fp32=True)  # one GEMM on CUDA
            if gather is not None:
                kv, score = gather(torch.cat((kv, score), dim=-1)).split(kv.shape[-1], dim=-1)
            pooled = _pool._launch(kv, score, carry.kv, carry.score, new, old, kv.shape[1], False)
        else:
            kv = self.wkv.forward_fp32(x)
            score = self.wgate.forward_fp32(x)
            if gather is not None:
                kv, score = gather(torch.cat((kv, score), dim=-1)).split(kv.shape[-1], dim=-1)
            src_kv = torch.where((new >= 0)[..., None], kv[new.clamp(min=0)], carry.kv[old.clamp(min=0)])
            src_score = torch.where((new >= 0)[..., None], score[new.clamp(min=0)], carry.score[old.clamp(min=0)])
            weights = src_score.transpose(1, 2).softmax(dim=-1).transpose(1, 2)  # row-local over the group
            pooled = (weights * src_kv).sum(dim=1)
        copy_rows(((carry.kv, kv), (carry.score, score)), plan.carry_dst, plan.carry_src)  # one launch on CUDA
        return self.norm(pooled.to(x.dtype))


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """scores [T, W] (-inf where not visible) -> bool [T, W]: visible entries in the `topk_blocks`
    blocks of `block` entries with the highest max score (ties: lowest block first); the block
    holding the newest visible entry always. See kernels/candidate_blocks.py."""
    if _kernels(scores):
        return _cand._launch(scores, visible, topk_blocks, block)
    return _cand.reference(scores, visible, topk_blocks, block)


def select_topk(s: torch.Tensor, visible: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[Tc, nv] scores -> [Tc, k] ids of the k best visible (and allowed) entries, -1 where fewer
    exist; equal scores keep ascending entry order. See kernels/index_topk.py."""
    if _kernels(s) and s.shape[0] and k:
        fits = s.shape[1] <= _topk.MAX_N and s.shape[0] * s.shape[1] ** 2 <= _topk.MAX_WORK
        return (_topk._launch if fits else _topk._launch_long)(s, visible, k, allowed)
    return _topk.reference(s, visible, k, allowed)


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
        plan = state.plan
        w = self.weights_proj(x).float() * (self.index_dim ** -0.5 * self.n_heads ** -0.5)
        nv = plan.max_visible
        k = min(self.topk, nv)
        out = torch.full((x.shape[0], k), -1, dtype=torch.long, device=x.device)
        cands = torch.zeros(x.shape[0], nv, dtype=torch.bool, device=x.device) if candidate_source else None
        for rows, s in self._scores(q, w, batch, state):
            visible = plan.visible[rows]
            if candidate_source:
                cands[rows] = candidate_blocks(s, visible, *candidate_source)
            allowed = state.candidates[rows] if use_candidates and not candidate_source else None
            out[rows] = select_topk(s, visible, k, allowed)
        return out, cands

    def _scores(self, q: torch.Tensor, w: torch.Tensor, batch: ForwardBatch, state: CSA2State):
        """Yields (rows, scores [len(rows), nv], -inf where not visible) covering every token once;
        rows a slice or an index tensor."""
        plan, keys = state.plan, state.source.index_keys
        nv, T = plan.max_visible, q.shape[0]
        if not (_kernels(q) and _scores.supported_store(q, keys.fmt)):
            for sl in _chunks(T, nv * self.index_dim):
                kk = keys.read(plan.addr[batch.token_req[sl]], torch.float32)          # [Tc, nv, Di]
                qs, ws = q[sl].float(), w[sl, :, None]
                s = invariant.by_key_blocks(lambda kb: invariant.reduce_sum(invariant.qk(qs, kb).relu() * ws, 1), kk)
                yield sl, s.masked_fill(torch.arange(nv, device=q.device) >= plan.visible[sl, None], float("-inf"))
            return
        store = tuple(keys.tensors())
        scale = store[1] if keys.fmt == "mxfp4" else None
        lens = batch.req_lens
        # Long requests outside invariant mode: one key tile serves a tile of the request's tokens.
        # Everything else, and every token in invariant mode, through the per-token kernel: one
        # program per token with a fixed tiling, so a token's scores do not depend on the batch,
        # on its request's chunking, or on nv (entries past `visible` are never read).
        shared = [not invariant.enabled() and n >= SHARED_KEYS_MIN_TOKENS for n in lens]
        starts = [0, *itertools.accumulate(lens)]
        for r, n in enumerate(lens):
            if shared[r]:
                for sl in _chunks(n, nv):
                    sl = slice(starts[r] + sl.start, starts[r] + sl.stop)
                    yield sl, _scores._launch(q[sl], store[0], w[sl], plan.visible[sl], scale=scale, rows=plan.addr[r],
                                              fmt=keys.fmt)
        if lens and all(shared):
            return
        rows = None if not any(shared) else to_device(
            torch.cat([torch.arange(starts[r], starts[r] + n) for r, n in enumerate(lens) if not shared[r]]), q.device)
        count = T if rows is None else rows.numel()
        for sl in _chunks(count, nv):
            idx = sl if rows is None else rows[sl]
            yield idx, _scores._launch_per_token(q[idx], store[0], plan.addr, batch.token_req[idx], w[idx],
                                                 plan.visible[idx], scale=scale, fmt=keys.fmt)
