"""DeepSeek-V4 (model_type deepseek_v4: V4-Flash, -Flash-0731, -Pro, -Base). Math only.

Module and parameter names follow DeepSeek's checkpoint (`layers.N.attn.wq_a`, `embed`,
`head`, ...), except routed experts, which are stacked per projection
(`layers.N.ffn.experts.w1` [E, F, D]). The residual is n = hc_mult streams [T, n, D].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from deepinfer.layers.attention import Compressor, Indexer, sparse_attention
from deepinfer.state.forward_batch import CompressPlan, ForwardBatch
from deepinfer.state.kv_state import CarryState, EntryStore, IndexKeyStore, LayerCache, resolve_kv_cache_dtype
from deepinfer.layers.linear import DENSE, Linear, QuantSpec, stacked_forward
from deepinfer.layers.mhc import HyperConnection, collapse_norm, expand, register_hc_params, head_collapse
from deepinfer.layers.moe import MoE
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RopeCache, apply_rope, norm_rope, rope_inv_freq
from deepinfer.models.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer.models.dspark_common import MARKOV_NAMES_V4, DSparkHost, add_dspark_heads, block_attention
from deepinfer.models.dspark_v4 import draft_from_cache
from deepinfer.models.interface import EXPERT_SPLIT, HEAD_SPLIT, DraftBlock, Drafting, TPSplit


@dataclass
class StepContext:
    """What every layer reads in one step: the batch plan and both rope tables at its positions."""

    batch: ForwardBatch
    rope_main: RopeCache
    rope_compress: RopeCache
    inv_freq_compress: torch.Tensor
    # values that depend on one compress plan only, built by the first layer of that kind that reads
    # them and shared by the rest (a context lives for one forward: never stale across CUDA-graph
    # warm-up and capture)
    memo: dict = field(default_factory=dict)
    # context parallelism (distributed/context_parallel.py): this rank's token rows -> the whole
    # step's rows in step order. `batch` then holds this rank's queries only, while its write plans
    # (ring_src/dst, the compress plans' sources, carry and dst) index the whole step. None: one process.
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def entry_rope(self, plan: CompressPlan) -> RopeCache:
        """cos/sin at the rotation positions of the entries of `plan`'s kind that close this step."""
        key = ("rope", id(plan))
        if key not in self.memo:
            self.memo[key] = RopeCache.at(plan.rope_pos, self.inv_freq_compress)
        return self.memo[key]

    def all_entries(self, plan: CompressPlan) -> torch.Tensor:
        """[T, max_visible] ids of every visible entry per token, -1 past its count (HCA reads all)."""
        key = ("all", id(plan))
        if key not in self.memo:
            w = torch.arange(plan.max_visible, device=plan.visible.device)
            self.memo[key] = torch.where(w < plan.visible[:, None], w, -1)
        return self.memo[key]


def quant_spec(cfg: DeepseekV4Config, quantized: bool) -> tuple[QuantSpec, QuantSpec]:
    """(FP8 dense-layer spec, routed-expert spec) for a model that keeps checkpoint formats."""
    if not quantized or cfg.quant.block_size is None:
        return DENSE, DENSE
    sdt = torch.float8_e8m0fnu if cfg.quant.scale_fmt == "ue8m0" else torch.float32
    fp8 = QuantSpec(cfg.quant.block_size, sdt)
    return fp8, QuantSpec(cfg.quant.block_size, sdt, fp4_experts=cfg.quant.expert_dtype == "fp4")


class Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, kind: str, ratio: int, dtype: torch.dtype, quant: QuantSpec):
        super().__init__()
        c = cfg
        self.kind, self.ratio = kind, ratio
        self.n_heads, self.head_dim, self.eps = c.num_attention_heads, c.head_dim, c.rms_norm_eps
        self.o_groups, self.o_rank = c.o_groups, c.o_lora_rank
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, dtype, quant)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, dtype, quant)
        self.wkv = Linear(c.hidden_size, c.head_dim, dtype, quant)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        group_in = c.num_attention_heads * c.head_dim // c.o_groups
        self.wo_a = Linear(group_in, c.o_groups * c.o_lora_rank, dtype, quant)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, dtype, quant)
        self.attn_sink = nn.Parameter(torch.zeros(c.num_attention_heads, dtype=torch.float32), requires_grad=False)
        if kind != SLIDING:
            self.compressor = Compressor(c.hidden_size, c.head_dim, ratio, kind == CSA, c.rms_norm_eps, dtype)
        if kind == CSA:
            self.indexer = Indexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                                   c.index_topk, ratio, c.rms_norm_eps, dtype, quant)

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: LayerCache) -> torch.Tensor:
        T, batch = x.shape[0], ctx.batch
        rope = ctx.rope_main if self.kind == SLIDING else ctx.rope_compress
        q_lat, kv_lat = stacked_forward(self, "_wq_a_wkv", (self.wq_a, self.wkv), x)  # same x: one GEMM on CUDA
        qr = self.q_norm(q_lat)
        index_q = None
        if self.kind == CSA:  # the indexer's query projection reads qr too: one GEMM on CUDA
            q_full, index_q = stacked_forward(self, "_wq_b_index", (self.wq_b, self.indexer.wq_b), qr)
        else:
            q_full = self.wq_b(qr)
        q = norm_rope(q_full.view(T, self.n_heads, self.head_dim), self.eps, rope)  # per-head norm + rope
        # FP8 ring: norm, rope and round trip in one launch at every step (so a token's kv never depends on the
        # step's mix), storing too where the step allows it early; other formats: the separate ops
        early = batch.ring_early and ctx.gather is None
        kv = cache.ring.norm_roundtrip(kv_lat, (self.kv_norm.weight, self.kv_norm.eps, rope.cos, rope.sin),
                                       batch.ring_dst if early else None)
        stored = early and kv is not None
        if kv is None:
            kv = cache.ring.roundtrip(apply_rope(self.kv_norm(kv_lat), rope, overwrite=True))
        if ctx.gather is not None:
            kv = ctx.gather(kv)  # every window key of the step: the queries read them by step row
        entry_ids = plan = None
        if self.kind != SLIDING:
            plan = batch.plans[(self.ratio, self.kind == CSA)]
            entries, dst = self.compressor(x, batch.positions, plan, cache.carry["main"], ctx.entry_rope(plan),
                                           ctx.gather, store=cache.entries)
            if entries is not None:  # not written by the compressor's store
                cache.entries.write(dst, entries)
        if self.kind == CSA:
            entry_ids = self.indexer(x, qr, batch, plan, cache.index_keys, cache.carry["indexer"],
                                     rope, ctx.entry_rope(plan), ctx.gather, index_q)
        elif self.kind == HCA:
            entry_ids = ctx.all_entries(plan)
        o = sparse_attention(q, kv, batch, cache.ring, entry_ids, plan, cache.entries,
                             self.attn_sink, self.head_dim ** -0.5)
        if not stored:
            cache.ring.write_from(batch.ring_dst, kv, batch.ring_src)
        o = apply_rope(o, rope, inverse=True, overwrite=True).view(T, self.o_groups, -1)
        return self.wo_b(self.wo_a.forward_grouped(o))


class Block(nn.Module):
    """One decoder layer: mHC(attention) then mHC(MoE)."""

    def __init__(self, cfg: DeepseekV4Config, layer_id: int, kind: str, ratio: int, dtype: torch.dtype,
                 quant: QuantSpec, expert_quant: QuantSpec, num_experts: int | None = None,
                 topk: int | None = None):
        super().__init__()
        c, n = cfg, cfg.hc_mult
        register_hc_params(self, n, c.hidden_size)
        self.hc = HyperConnection(n, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c, kind, ratio, dtype, quant)
        self.ffn = MoE(c.hidden_size, c.moe_intermediate_size, num_experts or c.n_routed_experts,
                       topk or c.num_experts_per_tok, c.n_shared_experts, c.vocab_size, c.is_hash_layer(layer_id),
                       c.routed_scaling_factor, c.swiglu_limit, dtype, expert_quant, quant)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: StepContext, cache: LayerCache):
        pre, post, comb = self.hc.weights(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        x = expand(x, self.attn(collapse_norm(x, pre, self.attn_norm), ctx, cache), post, comb)
        pre, post, comb = self.hc.weights(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        return expand(x, self.ffn(collapse_norm(x, pre, self.ffn_norm), input_ids), post, comb)


class MTPBlock(Block):
    """Multi-token prediction (`mtp.0`): token t+1's embedding + the trunk's streams at t -> logits t+2."""

    def __init__(self, cfg: DeepseekV4Config, layer_id: int, dtype: torch.dtype, quant: QuantSpec,
                 expert_quant: QuantSpec):
        super().__init__(cfg, layer_id, SLIDING, 0, dtype, quant, expert_quant)
        d, n = cfg.hidden_size, cfg.hc_mult
        self.e_proj = Linear(d, d, dtype, quant)
        self.h_proj = Linear(d, d, dtype, quant)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _fp32(n, n * d), _fp32(n), _fp32(1)

    def draft(self, streams: torch.Tensor, next_emb: torch.Tensor, next_ids: torch.Tensor,
              ctx: StepContext, cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, n, D]: trunk residual before hc_head at t; next_emb [T, D] -> (hidden [T, D], the
        layer's output streams [T, n, D])."""
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(next_emb)).unsqueeze(1)
        x = self.forward(x, next_ids, ctx, cache)
        c = self.hc.hc_eps, self.hc.norm_eps
        return self.norm(head_collapse(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, *c)), x


class DSparkStage(Block):
    """One stage (`mtp.K`) of V4-Flash-0731's DSpark draft: a sliding-window V4 block (the trunk's mHC at each
    sub-layer, its weightless per-head query norm, no hash routing) whose attention reads the context KV of the
    target features and the draft block instead of a ring (dspark_v4.py drafts with it); the last stage also
    owns the hc_head that collapses the block's streams. As vLLM 0.34.0 serves 0731 (models/deepseek_v4/nvidia/
    dspark.py), where the spec could only name the tensors."""

    def __init__(self, cfg: DeepseekV4Config, stage: int, dtype: torch.dtype, quant: QuantSpec,
                 expert_quant: QuantSpec):
        super().__init__(cfg, cfg.num_hidden_layers + stage, SLIDING, 0, dtype, quant, expert_quant,
                         cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)
        add_dspark_heads(self, cfg, stage, dtype, quant, MARKOV_NAMES_V4)
        if stage == cfg.num_nextn_predict_layers - 1:
            n, d = cfg.hc_mult, cfg.hidden_size
            self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _fp32(n, n * d), _fp32(n), _fp32(1)

    def context_keys(self, ctx_h: torch.Tensor, rope: RopeCache) -> torch.Tensor:
        """This stage's context KV [N, head_dim] of projected target features ctx_h [N, D] (rotated at their
        positions; not yet rounded through the window format)."""
        a = self.attn
        return apply_rope(a.kv_norm(a.wkv(ctx_h)), rope)

    def _attend(self, u: torch.Tensor, ctx_keys: torch.Tensor, ctx_valid: torch.Tensor, rope: RopeCache,
                kv_fmt) -> torch.Tensor:
        """u [B*S, D] the normed draft rows, ctx_keys [B, C, head_dim] this stage's context KV as stored -> [B*S, D]."""
        a, (B, _, hd) = self.attn, ctx_keys.shape
        N = u.shape[0]
        q = norm_rope(a.wq_b(a.q_norm(a.wq_a(u))).view(N, a.n_heads, hd), a.eps, rope)
        own = kv_fmt.roundtrip(apply_rope(a.kv_norm(a.wkv(u)), rope)).view(B, N // B, hd)
        o = block_attention(q.view(B, N // B, a.n_heads, hd), ctx_keys.to(u.dtype), ctx_valid, own, a.attn_sink,
                            hd ** -0.5)
        o = apply_rope(o.to(u.dtype).flatten(0, 1), rope, inverse=True).view(N, a.o_groups, -1)
        return a.wo_b(a.wo_a.forward_grouped(o))

    def draft_forward(self, x: torch.Tensor, ids: torch.Tensor, ctx_keys: torch.Tensor, ctx_valid: torch.Tensor,
                      rope: RopeCache, kv_fmt) -> torch.Tensor:
        """x [B*S, n, D] the block's streams (request-major), ids [B*S] -> the streams after this stage."""
        pre, post, comb = self.hc.weights(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        x = expand(x, self._attend(collapse_norm(x, pre, self.attn_norm), ctx_keys, ctx_valid, rope, kv_fmt),
                   post, comb)
        pre, post, comb = self.hc.weights(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        return expand(x, self.ffn(collapse_norm(x, pre, self.ffn_norm), ids), post, comb)


def tp_plan_of(model: nn.Module, attention: type[nn.Module]) -> dict[str, TPSplit]:
    """Every `attention` module head-split with its wo_b all-reduced (not the module's output: V4.1's
    DSpark stages call the projections directly), every MoE expert-split with its output all-reduced;
    trunk and draft layers alike, in named_modules() order."""
    plan = {}
    for name, mod in model.named_modules():
        if isinstance(mod, attention):
            plan[name] = TPSplit(HEAD_SPLIT, f"{name}.wo_b")
        elif isinstance(mod, MoE):
            plan[name] = TPSplit(EXPERT_SPLIT, name)
    return plan


# kv_cache_dtype -> (entry/window format, indexer-key format); "fp8" (= "auto") is the QAT format
KV_FORMATS = {
    "fp8": ("fp8", "fp4"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "float32": ("float32", "float32"),
}


class DeepseekV4ForCausalLM(DSparkHost, nn.Module):
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype = torch.float32, quantized: bool = False):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        quant, expert_quant = quant_spec(cfg, quantized)
        d, n = cfg.hidden_size, cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, d, dtype=dtype)
        self.layers = nn.ModuleList(
            Block(cfg, i, kind, ratio, dtype, quant, expert_quant)
            for i, (kind, ratio) in enumerate(zip(cfg.layer_kinds, cfg.compress_ratios)))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = Linear(d, cfg.vocab_size, dtype)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _fp32(n, n * d), _fp32(n), _fp32(1)
        if cfg.has_dspark:
            stages = [DSparkStage(cfg, k, dtype, quant, expert_quant) for k in range(cfg.num_nextn_predict_layers)]
        else:
            stages = [MTPBlock(cfg, cfg.num_hidden_layers + k, dtype, quant, expert_quant)
                      for k in range(cfg.num_nextn_predict_layers)]
        self.mtp = nn.ModuleList(stages) if stages else None  # None: no draft layers
        yarn = cfg.rope_scaling
        self.register_buffer("inv_freq_main", rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta), persistent=False)
        self.register_buffer("inv_freq_compress", rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, yarn),
                             persistent=False)

    dspark_draft = staticmethod(draft_from_cache)  # -0731's stages (dspark_v4.py)
    replay_layer = -1        # no bounded replay cut (models/interface.py)
    token_history = 0
    host_inputs = False
    supports_graphs = True
    supports_context_parallel = True  # StepContext.gather
    supports_images = False
    needs_engram_vocab = False

    def set_engram_vocab(self, token_map: list[int]) -> None:
        """V4 reads no compressed token map."""

    @property
    def drafting(self) -> Drafting:
        """`mtp.*`: an MTP layer (runs as the "mtp" proposer) or -0731's DSpark stages ("dspark")."""
        c, stages, both = self.config, 0 if self.mtp is None else len(self.mtp), frozenset({"mtp", "dspark"})
        if not stages:
            return Drafting(proposers=both)
        if c.has_dspark:
            return Drafting("dspark", stages, c.dspark_block_size, both)
        return Drafting("mtp", stages, 1, both)

    def tp_plan(self) -> dict[str, TPSplit]:
        return tp_plan_of(self, Attention)

    @staticmethod
    def compressed_kinds(cfg: DeepseekV4Config) -> list[tuple[int, bool]]:
        """(ratio, overlapped) of every layer that owns compressed entries (CSA overlaps, HCA does not)."""
        return [(m, k == CSA) for k, m in zip(cfg.layer_kinds, cfg.compress_ratios) if k != SLIDING]

    @staticmethod
    def cache_layout(cfg: DeepseekV4Config, num_slots: int, num_blocks: dict[int, int], block_size: int,
                     kv_cache_dtype: str, device, ring_slack: int = 0) -> tuple[list[LayerCache], list[LayerCache]]:
        """(trunk layers' caches, draft layers' caches): every layer a window ring; CSA / HCA layers their
        compressed entries (paged per ratio) and compressor carry; CSA also indexer keys and carry. Every
        per-slot ring (window: W, carry: S = 2m / m) has ring_slack rows more per slot."""
        entry_fmt, key_fmt = KV_FORMATS[resolve_kv_cache_dtype(kv_cache_dtype)]
        W, r = cfg.sliding_window + ring_slack, cfg.qk_rope_head_dim
        ring = lambda: EntryStore(num_slots * W, cfg.head_dim, r, entry_fmt, device)  # noqa: E731
        layers = []
        for kind, m in zip(cfg.layer_kinds, cfg.compress_ratios):
            cache = LayerCache(ring(), ratio=m)
            if kind != SLIDING:
                overlap, rows = kind == CSA, num_blocks[m] * block_size
                carry_rows = num_slots * ((2 * m if overlap else m) + ring_slack)
                cache.entries = EntryStore(rows, cfg.head_dim, r, entry_fmt, device)
                cache.carry["main"] = CarryState.empty(carry_rows, (2 if overlap else 1) * cfg.head_dim, device)
            if kind == CSA:  # the indexer's compressor overlaps too: the same 2m + slack rows
                cache.index_keys = IndexKeyStore(num_blocks[m] * block_size, cfg.index_head_dim, key_fmt, device)
                cache.carry["indexer"] = CarryState.empty(carry_rows, 2 * cfg.index_head_dim, device)
            layers.append(cache)
        return layers, [LayerCache(ring()) for _ in range(cfg.num_nextn_predict_layers)]

    def image_embeddings(self, image) -> torch.Tensor:
        raise ValueError("DeepSeek-V4 has no vision encoder: prompts with images need a V4.1 checkpoint")

    def step_context(self, batch: ForwardBatch) -> StepContext:
        pos = batch.positions
        return StepContext(batch, RopeCache.at(pos, self.inv_freq_main), RopeCache.at(pos, self.inv_freq_compress),
                           self.inv_freq_compress)

    def forward(self, batch: ForwardBatch, caches: list[LayerCache], token_history: torch.Tensor | None = None,
                gather=None, draft_features: bool = False):
        """Runs the trunk on a flat varlen batch; returns the residual streams [T, n, D] before hc_head, and with
        `draft_features` also -0731 DSpark's target features [T, len(targets) * D]: the streams leaving each
        dspark_target_layer_ids layer, averaged over the streams. (`token_history`: part of the common
        interface; V4 reads no input history. `gather`: context parallelism, see StepContext.gather.)"""
        targets = self.config.dspark_target_layer_ids if draft_features else ()
        if draft_features and not targets:
            raise ValueError("draft_features: this checkpoint's draft layers read no target features "
                             "(no dspark_target_layer_ids)")
        ctx = self.step_context(batch)
        ctx.gather = gather
        x = self.embed(batch.input_ids).unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        feats = {}
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x = layer(x, batch.input_ids, ctx, cache)
            if i in targets:
                feats[i] = x.float().mean(1)
        if not targets:
            return x
        return x, torch.cat([feats[i] for i in targets], dim=-1)

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [N, n, D] -> fp32 logits [N, vocab]."""
        c = self.config
        h = head_collapse(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps)
        return self.head(self.norm(h)).float()

    def mtp_logits(self, streams: torch.Tensor, next_ids: torch.Tensor, ctx: StepContext,
                   cache: LayerCache) -> torch.Tensor:
        """MTP draft logits for position t+2 from the trunk streams at t and token t+1."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP draft layer (num_nextn_predict_layers is 0)")
        hidden, _ = self.mtp[0].draft(streams, self.embed(next_ids), next_ids, ctx, cache)
        return self.head(hidden).float()

    def mtp_draft(self, batch: ForwardBatch, streams: torch.Tensor, next_ids: torch.Tensor,
                  anchor_rows: torch.Tensor, cache: LayerCache) -> tuple[DraftBlock, torch.Tensor]:
        """The MTP layer over every row of `batch` (models/interface.py MTPDrafting): row t reads the trunk
        streams [T, n, D] at t and next_ids[t] (the token at t + 1) and writes its window key at the batch's
        ring rows, as the trunk's layers do. One draft per anchor row [G]: the argmax of the MTP logits there
        (for position t + 2), confidence = that token's softmax probability; and the layer's output streams
        at the anchor rows (what mtp_chain continues from)."""
        hidden, x = self._mtp().draft(streams, self.embed(next_ids), next_ids, self.step_context(batch), cache)
        logits = self.head(hidden[anchor_rows]).float()
        prob, tokens = logits.softmax(-1).max(-1)
        return DraftBlock(tokens[:, None], logits[:, None], prob[:, None]), x[anchor_rows]

    def mtp_chain(self, streams: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch,
                  cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """models/interface.py MTPDrafting.mtp_chain: the MTP layer once more, on its own output streams."""
        hidden, x = self._mtp().draft(streams, self.embed(next_ids), next_ids, self.step_context(batch), cache)
        return self.head(hidden).float(), x

    def _mtp(self) -> MTPBlock:
        if self.mtp is None or self.config.has_dspark:
            raise RuntimeError("this model has no MTP draft layer (num_nextn_predict_layers is 0 or its draft "
                               "layers are DSpark stages)")
        return self.mtp[0]


def _fp32(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)
