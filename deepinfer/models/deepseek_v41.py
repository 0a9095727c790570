"""DeepSeek-V4.1-Flash (model_type deepseek_v41). Math only.

A 40-layer causal encoder-decoder stack: CSA2 (four KV-source layers publish compressed KV
and index keys; reindex layers recompute the top-k, reuse layers attend with it; a
hierarchical candidate top-k), Engram n-gram memory at two layers, single-pass mHC
(a sub-layer's input is collapsed with the previous sub-layer's `pre`), sqrtsoftplus MoE
with a separate bias for image tokens. Parameter names follow the released checkpoint.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from deepinfer.kernels.engram_lookup import EngramQuery
from deepinfer.layers.engram_hash import EngramHashParams, hash_constants, history_windows, ngram_rows
from deepinfer.state.forward_batch import ForwardBatch, to_device
from deepinfer.state.kv_state import CarryState, FormatStore, LayerCache, resolve_kv_cache_dtype
from deepinfer.layers.linear import Linear
from deepinfer.layers.mhc import collapse
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RopeCache, rope_inv_freq
from deepinfer.models.block_v41 import Attention41, Block41, StepContext41
from deepinfer.models.config_v41 import FULL, DeepseekV41Config
from deepinfer.models.deepseek_v4 import quant_spec, tp_plan_of
from deepinfer.models.dspark_common import DSparkHost
from deepinfer.models.dspark_v41 import DSparkStage41, draft_from_cache
from deepinfer.models.interface import Drafting, TPSplit
from deepinfer.models.vision_v41 import VISION_DEFAULTS, VisionAligner, VisionTransformer, image_span_embeddings


# kv_cache_dtype -> (window, compressed entries, index keys); "fp8" (= "auto") is the reference's formats
KV_FORMATS = {
    "fp8": ("fp8", "nvfp4", "mxfp4"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
    "float32": ("float32", "float32", "float32"),
}


class DeepseekV41ForCausalLM(DSparkHost, nn.Module):
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
        stages = cfg.num_nextn_predict_layers if cfg.has_dspark else 0
        # None: no draft layers
        self.mtp = nn.ModuleList(DSparkStage41(cfg, k, dtype, quant, expert_quant) for k in range(stages)) or None
        self.register_buffer("inv_freq_main", rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta), persistent=False)
        self.register_buffer("inv_freq_compress", rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta,
                                                                cfg.rope_scaling), persistent=False)
        if int(cfg.vision.get("num_hidden_layers", 0)) > 0:  # named as released: vision.*, aligner.*, image_*
            vc = {**VISION_DEFAULTS, **{k: v for k, v in cfg.vision.items() if k != "model_type"}}
            self.vision = VisionTransformer(vc, dtype)
            self.aligner = VisionAligner(int(vc["hidden_size"]), int(vc["downsample_ratio"]), cfg.hidden_size, dtype)
            for name in ("image_start", "image_newline", "image_end"):
                self.register_parameter(name, nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype),
                                                           requires_grad=False))
        # raw -> compressed token ids (a buffer: it follows the model to its device) and hash constants
        self.register_buffer("engram_token_map", None, persistent=False)
        self.engram_params: EngramHashParams | None = None
        self.engram_host = host

    dspark_draft = staticmethod(draft_from_cache)  # V4.1's stages (dspark_v41.py)

    @staticmethod
    def compressed_kinds(cfg: DeepseekV41Config) -> list[tuple[int, bool]]:
        """(ratio, overlapped) of every layer that owns compressed entries: the Full (KV source) layers."""
        return [(m, False) for i, m in enumerate(cfg.compress_ratios) if cfg.role(i) == FULL]

    @staticmethod
    def cache_layout(cfg: DeepseekV41Config, num_slots: int, num_blocks: dict[int, int], block_size: int,
                     kv_cache_dtype: str, device, ring_slack: int = 0) -> tuple[list[LayerCache], list[LayerCache]]:
        """(trunk layers' caches, DSpark stages' caches): every layer a window ring; Full layers the
        compressed entries and index keys the layers below the next Full layer read, and for ratio > 1
        the open group's fp32 projections. Every per-slot ring (window: W, carry: m) has ring_slack rows
        more per slot."""
        win_fmt, entry_fmt, key_fmt = KV_FORMATS[resolve_kv_cache_dtype(kv_cache_dtype)]
        W = cfg.sliding_window + ring_slack
        ring = lambda: FormatStore(num_slots * W, cfg.head_dim, win_fmt, device)  # noqa: E731
        layers = []
        for i, m in enumerate(cfg.compress_ratios):
            cache = LayerCache(ring(), ratio=m)
            if cfg.role(i) == FULL:
                rows = num_blocks[m] * block_size
                cache.entries = FormatStore(rows, cfg.head_dim, entry_fmt, device)
                cache.index_keys = FormatStore(rows, cfg.index_head_dim, key_fmt, device)
                if m > 1:
                    cache.carry["main"] = CarryState.empty(num_slots * (m + ring_slack), cfg.head_dim, device)
            layers.append(cache)
        return layers, [LayerCache(ring()) for _ in range(cfg.num_nextn_predict_layers if cfg.has_dspark else 0)]

    @property
    def replay_layer(self) -> int:
        """Bounded replay cuts at the last KV source: nothing above it keeps more than a window ring."""
        return max(self.config.kv_source_layer_ids, default=-1)

    @property
    def token_history(self) -> int:
        """Tokens each position needs from before it (Engram's n-gram window, itself included)."""
        return self.config.engram_max_ngram_size if self.config.engram_layer_ids else 0

    @property
    def host_inputs(self) -> bool:
        """Per-step inputs come from token values on the host: Engram tables left on the host hash
        on the host (the rows are gathered there). Otherwise windows come from the device history."""
        return bool(self.token_history) and self.engram_host

    @property
    def supports_graphs(self) -> bool:
        return not self.host_inputs

    supports_context_parallel = True  # StepContext41.gather (Engram tables on the device only: host_inputs)

    @property
    def needs_engram_vocab(self) -> bool:
        return bool(self.config.engram_layer_ids)

    @property
    def drafting(self) -> Drafting:
        """DSpark's stages `mtp.*` (run as the "dspark" proposer), or none."""
        stages = 0 if self.mtp is None else len(self.mtp)
        if not stages:
            return Drafting(proposers=frozenset({"dspark"}))
        return Drafting("dspark", stages, self.config.dspark_block_size, frozenset({"dspark"}))

    def tp_plan(self) -> dict[str, TPSplit]:
        return tp_plan_of(self, Attention41)

    def set_engram_vocab(self, token_map: list[int]) -> None:
        """Install the tokenizer's compressed token map (checked against the config) and hash constants."""
        c = self.config
        if not c.engram_layer_ids:
            return
        n_comp = max(token_map) + 1
        if n_comp != c.engram_compressed_vocab_size:
            raise ValueError(f"engram_compressed_vocab_size: the tokenizer gives {n_comp} compressed ids, "
                             f"config.json says {c.engram_compressed_vocab_size}")
        self.engram_token_map_host = torch.tensor(token_map, dtype=torch.long)  # host hashing (host tables)
        self.engram_token_map = self.engram_token_map_host.to(self.embed.weight.device)
        self.engram_params = EngramHashParams.build(
            c.engram_layer_ids, c.engram_num_embeddings, c.engram_max_ngram_size, c.engram_n_heads,
            c.engram_vocab_size, n_comp, pad_id=token_map[c.engram_pad_token_id])

    def step_context(self, batch: ForwardBatch, token_history: torch.Tensor | None = None) -> StepContext41:
        pos = batch.positions
        rows = None
        if self.config.engram_layer_ids:
            if self.engram_params is None:
                raise RuntimeError("Engram layers need the tokenizer's compressed token map (set_engram_vocab)")
            if batch.history is not None:
                if token_history is None:
                    raise ValueError("a batch planned with a device history needs the cache's token_history")
                windows, mask = history_windows(batch.input_ids, batch.image_mask, token_history, batch.history), None
            else:
                windows, mask = batch.token_windows, batch.window_mask
            if self.engram_host:  # hashed and gathered on the host now, copied while the layers below run
                token_map = self.engram_token_map_host if windows.device.type == "cpu" else self.engram_token_map
                rows = ngram_rows(windows, self.engram_params, token_map=token_map, mask=mask).unbind(1)
                tables = [self.layers[i].engram.embed for i in self.config.engram_layer_ids]
                rows = [t.stage(r, pos.device) for t, r in zip(tables, rows)]
            else:  # hashed and gathered at each Engram layer, one kernel (kernels/engram_lookup.py)
                if mask is not None:  # an unusable token blocks its window as -1 does
                    windows = windows.masked_fill(~mask.to(windows.device), -1)
                dev, p = self.engram_token_map.device, self.engram_params
                windows = to_device(windows, dev)
                mult, primes, offsets = hash_constants(p, dev)
                rows = [EngramQuery(windows, self.engram_token_map, mult[e], primes[e], offsets[e], p.pad_id)
                        for e in range(len(p.layer_ids))]
        return StepContext41(batch, RopeCache.at(pos, self.inv_freq_main), RopeCache.at(pos, self.inv_freq_compress),
                             self.inv_freq_compress, rows, batch.image_mask)

    @property
    def supports_images(self) -> bool:
        return hasattr(self, "vision")  # built when vision_config has layers

    def image_embeddings(self, image) -> torch.Tensor:
        """The embeddings of one image's whole token span (see models/vision_v41.py)."""
        if not hasattr(self, "vision"):
            raise ValueError("this checkpoint has no vision encoder (vision_config.num_hidden_layers is 0)")
        return image_span_embeddings(self, image)

    def forward(self, batch: ForwardBatch, caches: list[LayerCache], draft_features: bool = False,
                token_history: torch.Tensor | None = None, gather=None):
        """Runs the stack on a flat varlen batch; returns the final collapsed hidden [T, D] (before norm),
        and with `draft_features` also DSpark's target features [T, len(targets) * D]: the streams
        entering each dspark_target_layer_ids layer, averaged over the streams (zero for rows that
        bounded replay stopped below the cut). `gather`: context parallelism, see StepContext41.gather."""
        ctx = self.step_context(batch, token_history)
        ctx.gather = gather
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
