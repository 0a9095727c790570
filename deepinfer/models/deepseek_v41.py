"""DeepSeek-V4.1-Flash (model_type deepseek_v41). Math only.

A 40-layer causal encoder-decoder stack: CSA2 (four KV-source layers publish compressed KV
and index keys; reindex layers recompute the top-k, reuse layers attend with it; a
hierarchical candidate top-k), Engram n-gram memory at two layers, single-pass mHC
(a sub-layer's input is collapsed with the previous sub-layer's `pre`), sqrtsoftplus MoE
with a separate bias for image tokens. Parameter names follow the released checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from deepinfer.layers.attention import sparse_attention
from deepinfer.layers.csa2 import CSA2State, Engram, Indexer41, PoolCompressor
from deepinfer.layers.engram_hash import EngramHashParams, ngram_rows
from deepinfer.layers.forward_batch import ForwardBatch, ReplayPlan
from deepinfer.layers.kv_state import LayerCache
from deepinfer.layers.linear import Linear, QuantSpec
from deepinfer.layers.mhc import HyperConnection, collapse, collapse_norm, expand, register_hc_params
from deepinfer.layers.moe import MoE
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RopeCache, apply_rope, rope_inv_freq
from deepinfer.models.config_v41 import FULL, REINDEX, SWA, DeepseekV41Config
from deepinfer.models.deepseek_v4 import _fp32, quant_spec


@dataclass
class StepContext41:
    batch: ForwardBatch
    rope_main: RopeCache
    rope_compress: RopeCache
    inv_freq_compress: torch.Tensor
    engram_rows: torch.Tensor | None      # [T, n_engram_layers, hash_heads]
    image_mask: torch.Tensor | None = None

    def subset(self, rows: torch.Tensor, batch: ForwardBatch) -> "StepContext41":
        """The same step restricted to `rows` (bounded replay), planned by `batch`."""
        pick = lambda t: None if t is None else t[rows.to(t.device)]  # noqa: E731
        return StepContext41(batch, RopeCache(pick(self.rope_main.cos), pick(self.rope_main.sin)),
                             RopeCache(pick(self.rope_compress.cos), pick(self.rope_compress.sin)),
                             self.inv_freq_compress, pick(self.engram_rows), pick(self.image_mask))


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
        latent = self.compressor(x, plan, cache.carry.get("main"))
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
            x = self.engram(x, ctx.engram_rows[:, self.engram_index], mask)
        pre_a, post, comb = self.hc.weights(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        y, state = self.attn(collapse_norm(x, pre_prev, self.attn_norm), ctx, cache, state, replay)
        if replay is not None:
            rows = replay.rows
            x, pre_a, post, comb, ctx = x[rows], pre_a[rows], post[rows], comb[rows], ctx.subset(rows, replay.upper)
        x = expand(x, y, post, comb)
        pre_f, post, comb = self.hc.weights(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        y = self.ffn(collapse_norm(x, pre_a, self.ffn_norm), ctx.batch.input_ids, ctx.image_mask)
        return expand(x, y, post, comb), pre_f, state


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, dtype: torch.dtype = torch.float32, quantized: bool = False,
                 engram_device: str | None = None):
        """engram_device="cpu": the Engram tables stay on the host, memory-mapped from the shards."""
        super().__init__()
        self.config, self.dtype = cfg, dtype
        quant, expert_quant = quant_spec(cfg, quantized)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        host = engram_device == "cpu"
        self.layers = nn.ModuleList(Block41(cfg, i, dtype, quant, expert_quant, engram_host=host)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, torch.float32)
        from deepinfer.models.dspark_v41 import DSparkStage41  # it builds on Block41

        stages = cfg.num_nextn_predict_layers if cfg.has_dspark else 0
        # None: no draft layers
        self.mtp = nn.ModuleList(DSparkStage41(cfg, k, dtype, quant, expert_quant) for k in range(stages)) or None
        self.register_buffer("inv_freq_main", rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta), persistent=False)
        self.register_buffer("inv_freq_compress", rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta,
                                                                cfg.rope_scaling), persistent=False)
        if int(cfg.vision.get("num_hidden_layers", 0)) > 0:  # named as released: vision.*, aligner.*, image_*
            from deepinfer.models.vision_v41 import VISION_DEFAULTS, VisionAligner, VisionTransformer

            vc = {**VISION_DEFAULTS, **{k: v for k, v in cfg.vision.items() if k != "model_type"}}
            self.vision = VisionTransformer(vc, dtype)
            self.aligner = VisionAligner(int(vc["hidden_size"]), int(vc["downsample_ratio"]), cfg.hidden_size, dtype)
            for name in ("image_start", "image_newline", "image_end"):
                self.register_parameter(name, nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype),
                                                           requires_grad=False))
        # host-side: n-gram rows are hashed on the CPU from the step's token windows
        self.engram_token_map: torch.Tensor | None = None
        self.engram_params: EngramHashParams | None = None

    @property
    def replay_layer(self) -> int:
        """Bounded replay cuts at the last KV source: nothing above it keeps more than a window ring."""
        return max(self.config.kv_source_layer_ids, default=-1)

    @property
    def token_history(self) -> int:
        """Tokens each position needs from before it (Engram's n-gram window, itself included)."""
        return self.config.engram_max_ngram_size if self.config.engram_layer_ids else 0

    def set_engram_vocab(self, token_map: list[int]) -> None:
        """Install the tokenizer's compressed token map (checked against the config) and hash constants."""
        c = self.config
        if not c.engram_layer_ids:
            return
        n_comp = max(token_map) + 1
        if n_comp != c.engram_compressed_vocab_size:
            raise ValueError(f"engram_compressed_vocab_size: the tokenizer gives {n_comp} compressed ids, "
                             f"config.json says {c.engram_compressed_vocab_size}")
        self.engram_token_map = torch.tensor(token_map, dtype=torch.long)
        self.engram_params = EngramHashParams.build(
            c.engram_layer_ids, c.engram_num_embeddings, c.engram_max_ngram_size, c.engram_n_heads,
            c.engram_vocab_size, n_comp, pad_id=token_map[c.engram_pad_token_id])

    def step_context(self, batch: ForwardBatch) -> StepContext41:
        pos = batch.positions
        rows = None
        if self.config.engram_layer_ids:
            if self.engram_params is None:
                raise RuntimeError("Engram layers need the tokenizer's compressed token map (set_engram_vocab)")
            rows = ngram_rows(batch.token_windows, self.engram_params, token_map=self.engram_token_map,
                              mask=batch.window_mask)
        return StepContext41(batch, RopeCache.at(pos, self.inv_freq_main), RopeCache.at(pos, self.inv_freq_compress),
                             self.inv_freq_compress, rows, batch.image_mask)

    def image_embeddings(self, image) -> torch.Tensor:
        """The embeddings of one image's whole token span (see models/vision_v41.py)."""
        from deepinfer.models.vision_v41 import image_span_embeddings

        if not hasattr(self, "vision"):
            raise ValueError("this checkpoint has no vision encoder (vision_config.num_hidden_layers is 0)")
        return image_span_embeddings(self, image)

    def forward(self, batch: ForwardBatch, caches: list[LayerCache], draft_features: bool = False):
        """Runs the stack on a flat varlen batch; returns the final collapsed hidden [T, D] (before norm),
        and with `draft_features` also DSpark's target features [T, len(targets) * D]: the streams
        entering each dspark_target_layer_ids layer, averaged over the streams (zero for rows that
        bounded replay stopped below the cut)."""
        ctx = self.step_context(batch)
        targets = self.config.dspark_target_layer_ids if draft_features else ()
        feats = {}
        n = self.config.hc_mult
        e = self.embed(batch.input_ids)
        if batch.input_embeds is not None:
            rows, values = batch.input_embeds
            e = e.index_copy(0, rows, values.to(e.dtype))
        x = e.unsqueeze(1).repeat(1, n, 1)
        pre = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1  # the stream starts one-hot on copy 0
        state, replay = None, batch.replay
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if i in targets:
                feats[i] = x.float().mean(1)
            if replay is not None and i == self.replay_layer:
                x, pre, state = layer(x, pre, state, ctx, cache, replay)
                ctx = ctx.subset(replay.rows, replay.upper)
                state = replace(state, plan=replay.upper.plans[(state.plan.ratio, False)])
            else:
                x, pre, state = layer(x, pre, state, ctx, cache)
        h = collapse(x, pre)
        if targets:
            h = torch.cat([h.float()] + [feats[i] for i in targets], dim=-1)
        if replay is not None:
            out = h.new_zeros(batch.num_tokens, h.shape[-1])  # rows that stopped below the cut have no output
            out[replay.rows] = h
            h = out
        if not targets:
            return h
        d = self.config.hidden_size
        return h[:, :d].to(self.dtype), h[:, d:]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> fp32 logits (the head is kept in fp32)."""
        return self.head(self.norm(hidden).float()).float()
