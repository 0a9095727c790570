"""The DeepSeek-V4.1 block: Engram (some layers), CSA2 attention in its layer's role (full /
reindex / reuse / window), MoE, joined by single-pass mHC. Built by the trunk's layers
(models/deepseek_v41.py) and, window-only, by the DSpark draft stages (models/dspark_v41.py).
Math only; parameter names follow the released checkpoint.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from deepinfer.layers.attention import sparse_attention
from deepinfer.layers.csa2 import CSA2State, Indexer41, PoolCompressor
from deepinfer.layers.engram import Engram
from deepinfer.state.forward_batch import ForwardBatch, ReplayPlan
from deepinfer.state.kv_state import LayerCache
from deepinfer.layers.linear import Linear, QuantSpec
from deepinfer.layers.mhc import HyperConnection, collapse_norm, expand, register_hc_params
from deepinfer.layers.moe import MoE
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RopeCache, apply_rope
from deepinfer.models.config_v41 import FULL, REINDEX, SWA, DeepseekV41Config
from deepinfer.models.deepseek_v4 import _fp32


@dataclass
class StepContext41:
    batch: ForwardBatch
    rope_main: RopeCache
    rope_compress: RopeCache
    inv_freq_compress: torch.Tensor
    # per Engram layer: [T, hash_heads] table rows, StagedRows (host table) or EngramQuery (device table)
    engram_rows: list | None
    image_mask: torch.Tensor | None = None
    # context parallelism (distributed/context_parallel.py): this rank's token rows -> the whole
    # step's rows in step order; `batch` then holds this rank's queries only, its write plans (ring
    # rows, compressor sources, carry, entry addresses) the whole step. None: one process (identity).
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def subset(self, rows: torch.Tensor, batch: ForwardBatch) -> "StepContext41":
        """The same step restricted to `rows` (bounded replay), planned by `batch`. Under context parallelism
        a step's kept rows are none (a context-parallel step ends below replay_from): nothing to gather."""
        pick = lambda t: None if t is None else t[rows.to(t.device)]  # noqa: E731
        return StepContext41(batch, RopeCache(pick(self.rope_main.cos), pick(self.rope_main.sin)),
                             RopeCache(pick(self.rope_compress.cos), pick(self.rope_compress.sin)),
                             self.inv_freq_compress,
                             None if self.engram_rows is None else [pick(r) for r in self.engram_rows],
                             pick(self.image_mask), self.gather if rows.numel() else None)


class Attention41(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, layer: int, dtype: torch.dtype, quant: QuantSpec):
        super().__init__()
        c = cfg
        self.role, self.ratio = cfg.role(layer), cfg.compress_ratios[layer]
        self.n_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.o_groups, self.o_rank = c.o_groups, c.o_lora_rank
        self.candidate_source = ((c.candidate_topk_blocks, c.candidate_block_size)
                                 if layer == c.candidate_source_layer_id else None)
        self.uses_candidates = 0 <= c.candidate_source_layer_id < layer
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, dtype, quant)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, dtype, quant)
        self.wkv = Linear(c.hidden_size, c.head_dim, dtype, quant)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = Linear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, dtype, quant)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, dtype, quant)
        self.attn_sink = _fp32(c.num_attention_heads)
        if self.role == FULL:
            self.compressor = PoolCompressor(c.hidden_size, c.head_dim, self.ratio, c.rms_norm_eps, dtype)
        if self.role in (FULL, REINDEX):
            self.indexer = Indexer41(c.hidden_size, c.q_lora_rank, c.head_dim, c.index_n_heads, c.index_head_dim,
                                     c.index_topk, self.role == FULL, c.rms_norm_eps, dtype, quant)

    def _publish(self, x: torch.Tensor, ctx: StepContext41, cache: LayerCache) -> CSA2State:
        """Full layer: compress, store rotated entries and index keys, start a fresh CSA2 state."""
        plan = ctx.batch.plans[(self.ratio, False)]
        latent = self.compressor(x, plan, cache.carry.get("main"), ctx.gather)  # every entry of the step
        rope = RopeCache.at(plan.rope_pos, ctx.inv_freq_compress)
        cache.entries.write(plan.dst, apply_rope(latent, rope))
        cache.index_keys.write(plan.dst, apply_rope(self.indexer.keys(latent), rope, overwrite=True))
        return CSA2State(cache, plan)

    def forward(self, x: torch.Tensor, ctx: StepContext41, cache: LayerCache, state: CSA2State | None,
                replay: ReplayPlan | None = None) -> tuple[torch.Tensor, CSA2State | None]:
        """With `replay`, the window kv and the published compressed state cover every row, the
        rest (queries, indexer, attention, output) only replay.rows; returns those rows."""
        rope = ctx.rope_main if self.role == SWA else ctx.rope_compress
        kv = cache.ring.roundtrip(apply_rope(self.kv_norm(self.wkv(x)), rope, overwrite=True))
        if ctx.gather is not None:
            kv = ctx.gather(kv)  # every window key of the step: the queries read them by step row
        if self.role == FULL:
            state = self._publish(x, ctx, cache)
        if replay is not None:
            ctx = ctx.subset(replay.rows, replay.at_layer)
            x, rope = x[replay.rows], ctx.rope_main if self.role == SWA else ctx.rope_compress
            if state is not None:
                state = replace(state, plan=replay.at_layer.plans[(state.plan.ratio, False)])
        T, batch = x.shape[0], ctx.batch
        qr = self.q_norm(self.wq_a(x))
        q = apply_rope(self.wq_b(qr).view(T, self.n_heads, self.head_dim), rope, overwrite=True)  # no per-head norm
        if self.role in (FULL, REINDEX):
            qi = apply_rope(self.indexer.wq_b(qr).view(T, self.indexer.n_heads, self.indexer.index_dim), rope,
                            overwrite=True)
            qi = state.source.index_keys.roundtrip(qi)
            topk, cands = self.indexer(x, qi, batch, state, self.candidate_source, self.uses_candidates)
            state = replace(state, topk=topk, candidates=cands if cands is not None else state.candidates)
        if self.role == SWA:
            o = sparse_attention(q, kv, batch, cache.ring, None, None, None, self.attn_sink, self.head_dim ** -0.5)
        else:
            o = sparse_attention(q, kv, batch, cache.ring, state.topk, state.plan, state.source.entries,
                                 self.attn_sink, self.head_dim ** -0.5)
        cache.ring.write_from(batch.ring_dst, kv, batch.ring_src)
        o = apply_rope(o, rope, inverse=True, overwrite=True)
        o = o.view(T, self.o_groups, self.n_heads * self.head_dim // self.o_groups)
        return self.wo_b(self.wo_a.forward_grouped(o)), state


class Block41(nn.Module):
    """Engram (some layers), then mHC(attention), mHC(MoE) with the single-pass pre hand-off."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, dtype: torch.dtype, quant: QuantSpec,
                 expert_quant: QuantSpec, num_experts: int | None = None, topk: int | None = None,
                 engram_host: bool = False):
        super().__init__()
        c, n = cfg, cfg.hc_mult
        register_hc_params(self, n, c.hidden_size)
        self.hc = HyperConnection(n, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, project_first=True)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention41(c, layer, dtype, quant)
        self.ffn = MoE(c.hidden_size, c.moe_intermediate_size, num_experts or c.n_routed_experts,
                       topk or c.num_experts_per_tok, c.n_shared_experts, c.vocab_size, False,
                       c.routed_scaling_factor, c.swiglu_limit, dtype, expert_quant, quant, vision_bias=True)
        self.engram_index = c.engram_layer_ids.index(layer) if layer in c.engram_layer_ids else None
        if self.engram_index is not None:
            # the table stays in its checkpoint format (FP8 rows) whatever `quantized` says: ~200 GB in FP8
            table_quant = QuantSpec(c.quant.block_size) if c.quant.block_size else quant
            self.engram = Engram(c.hidden_size, n, c.engram_num_embeddings[self.engram_index], c.engram_head_dim,
                                 (c.engram_max_ngram_size - 1) * c.engram_n_heads, c.rms_norm_eps, dtype, quant,
                                 table_quant.quantized, engram_host)

    def forward(self, x: torch.Tensor, pre_prev: torch.Tensor, state: CSA2State | None, ctx: StepContext41,
                cache: LayerCache, replay: ReplayPlan | None = None):
        """-> (streams, pre for the next sub-layer, CSA2 state); only replay.rows' rows with `replay`."""
        if self.engram_index is not None:
            mask = None if ctx.image_mask is None else ~ctx.image_mask
            x = self.engram(x, ctx.engram_rows[self.engram_index], mask)
        pre_a, post, comb = self.hc.weights(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        y, state = self.attn(collapse_norm(x, pre_prev, self.attn_norm), ctx, cache, state, replay)
        if replay is not None:
            rows = replay.rows
            x, pre_a, post, comb, ctx = x[rows], pre_a[rows], post[rows], comb[rows], ctx.subset(rows, replay.upper)
        x = expand(x, y, post, comb)
        pre_f, post, comb = self.hc.weights(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        y = self.ffn(collapse_norm(x, pre_a, self.ffn_norm), ctx.batch.input_ids, ctx.image_mask)
        return expand(x, y, post, comb), pre_f, state
