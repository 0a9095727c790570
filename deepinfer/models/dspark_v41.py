"""DSpark draft of DeepSeek-V4.1 (`mtp.0..2`): a parallel drafter of `dspark_block_size` tokens.

Each stage is a window-only block (single-pass mHC, MoE with the draft's expert count). Inputs
are [token_p, noise x (block-1)] at positions p .. p+block-1; every stage attends, per head, to
the context KV it derives from the target features main_x = main_norm(main_proj(features)) at
positions p-W .. p-1, plus the whole draft block (bidirectional), plus its sink. After the last
stage the collapsed hidden gives base logits through the target head; a rank-r Markov head adds
a bias from the previous token, and the confidence head scores each position from the
*pre-norm* hidden and the Markov embedding (the released reference; NeMo-trained drafts use
the normalised hidden instead).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from deepinfer.state.kv_state import FormatStore
from deepinfer.layers.linear import QuantSpec
from deepinfer.layers.mhc import collapse, expand
from deepinfer.layers.rotary import RopeCache, apply_rope
from deepinfer.models.block_v41 import Block41
from deepinfer.models.config_v41 import DeepseekV41Config
from deepinfer.models.dspark_common import (add_dspark_heads, block_attention, block_inputs, draft_heads,
                                            feature_context, read_context, stages_of)
from deepinfer.models.interface import DraftBlock


class DSparkStage41(Block41):
    """One stage (`mtp.K`): a window-only block with its own MoE size; stage 0 owns the
    feature projection, the last stage the norm, Markov and confidence heads."""

    def __init__(self, cfg: DeepseekV41Config, stage: int, dtype: torch.dtype, quant: QuantSpec,
                 expert_quant: QuantSpec):
        swa_cfg = replace(cfg, compress_ratios=(0,) * cfg.num_hidden_layers, kv_source_layer_ids=(),
                          index_source_layer_ids=(), candidate_source_layer_id=-1, engram_layer_ids=(),
                          engram_num_embeddings=())
        super().__init__(swa_cfg, 0, dtype, quant, expert_quant, cfg.dspark_n_routed_experts,
                         cfg.dspark_num_experts_per_tok)
        add_dspark_heads(self, cfg, stage, dtype, quant)

    def context_keys(self, ctx_h: torch.Tensor, rope: RopeCache) -> torch.Tensor:
        """This stage's context KV [N, head_dim] of projected target features ctx_h [N, D] (rotated at
        their positions; not yet rounded through the window format)."""
        a = self.attn
        return apply_rope(a.kv_norm(a.wkv(ctx_h)), rope)

    def _attend(self, u: torch.Tensor, ctx_keys: torch.Tensor, ctx_valid: torch.Tensor, rope: RopeCache,
                kv_fmt: FormatStore) -> torch.Tensor:
        """u [B, S, D] draft rows, ctx_keys [B, C, head_dim] this stage's context KV as stored -> [B, S, D]."""
        a, (B, S, _) = self.attn, u.shape
        q = apply_rope(a.wq_b(a.q_norm(a.wq_a(u))).flatten(0, 1).view(B * S, a.n_heads, a.head_dim), rope)
        own = kv_fmt.roundtrip(apply_rope(a.kv_norm(a.wkv(u)).flatten(0, 1), rope)).view(B, S, a.head_dim)
        o = block_attention(q.view(B, S, a.n_heads, -1), ctx_keys.to(u.dtype), ctx_valid, own, a.attn_sink,
                            a.head_dim ** -0.5)
        o = apply_rope(o.to(u.dtype).flatten(0, 1), rope, inverse=True).view(B * S, a.o_groups, -1)
        return a.wo_b(a.wo_a.forward_grouped(o)).view(B, S, -1)

    def draft_forward(self, x, pre, ctx_keys, ctx_valid, rope, kv_fmt, ids):
        """x [B, S, n, D], pre [B, S, n] -> (x, pre) after this stage (ctx_keys: see _attend)."""
        flat = lambda t: t.flatten(0, 1)  # noqa: E731
        B, S = x.shape[:2]
        xs = flat(x)
        pre_a, post, comb = self.hc.weights(xs, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        u = self.attn_norm(collapse(xs, flat(pre))).view(B, S, -1)
        xs = expand(xs, flat(self._attend(u, ctx_keys, ctx_valid, rope, kv_fmt)), post, comb)
        pre_f, post, comb = self.hc.weights(xs, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        xs = expand(xs, self.ffn(self.ffn_norm(collapse(xs, pre_a)), flat(ids)), post, comb)
        return xs.view(x.shape), pre_f.view(B, S, -1)


@torch.inference_mode()
def draft_block(model, features: torch.Tensor, feature_pos: torch.Tensor, feature_valid: torch.Tensor,
                anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, window_format: str = "float32") -> DraftBlock:
    """Draft one block per request. features [B, C, len(targets)*D] are the target features at
    positions feature_pos [B, C] (the window before the anchor; feature_valid masks padding);
    anchor_tokens / anchor_pos [B]: the newest accepted token and its position. The draft's KV is
    rounded through `window_format`, the storage format of the cache's window rings."""
    kv_fmt = _format(model.config.head_dim, window_format)
    keys = feature_context(model, features, feature_pos, kv_fmt)
    return _draft(model, keys, feature_valid, anchor_tokens, anchor_pos, kv_fmt)


@torch.inference_mode()
def draft_from_cache(model, rings, ctx_rows: torch.Tensor, ctx_valid: torch.Tensor, anchor_tokens: torch.Tensor,
                     anchor_pos: torch.Tensor, pick=None) -> DraftBlock:
    """draft_block with the context KV read from the stages' rings (write_draft_context) at ctx_rows
    [B, C] (masked where ctx_valid is False) instead of projected from features: no recompute per call.
    `pick`: see _draft."""
    return _draft(model, read_context(model, rings, ctx_rows), ctx_valid, anchor_tokens, anchor_pos,
                  _format(model.config.head_dim, getattr(rings[0], "fmt", "float32")), pick)


@functools.lru_cache(maxsize=None)
def _format(dim: int, fmt: str) -> FormatStore:
    """An empty store of the rings' format (its round trip only; built once: quantised formats size their
    tensors by encoding on the meta device, ~7 ms of host time)."""
    return FormatStore(0, dim, fmt, "meta")


def _draft(model, stage_keys: list[torch.Tensor], ctx_valid: torch.Tensor, anchor_tokens: torch.Tensor,
           anchor_pos: torch.Tensor, kv_fmt: FormatStore, pick=None) -> DraftBlock:
    """The block from each stage's context keys [B, C, head_dim] (as stored): the stages over
    [anchor, noise x (block-1)], then the heads (dspark_common.draft_heads; `pick`: see there)."""
    cfg, stages = model.config, stages_of(model)
    ids, pos, x = block_inputs(cfg, model.embed, anchor_tokens, anchor_pos)
    B, blk, n = x.shape[:3]
    rope = RopeCache.at(pos.flatten(), model.inv_freq_main)
    pre = torch.zeros(B, blk, n, dtype=torch.float32, device=x.device)
    pre[..., 0] = 1
    for stage, keys in zip(stages, stage_keys):
        x, pre = stage.draft_forward(x, pre, keys, ctx_valid, rope, kv_fmt, ids)
    hidden = collapse(x.flatten(0, 1), pre.flatten(0, 1)).view(B, blk, -1)
    return draft_heads(lambda h: model.head(h.float()).float(), stages[-1], hidden, anchor_tokens,
                       cfg.dspark_confidence_input == "normalized", pick)
