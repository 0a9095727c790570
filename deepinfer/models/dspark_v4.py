"""DSpark draft of DeepSeek-V4-Flash-0731 (`mtp.0..2`, deepseek_v4.DSparkStage): a parallel drafter of
`dspark_block_size` tokens (dspark_common.py holds what it shares with V4.1's).

The target features are the residual streams leaving each of `dspark_target_layer_ids`, averaged over the
streams. Each stage is a V4 block: mHC weights from each sub-layer's own input, the trunk's per-head query norm.
The last stage's hc_head collapses the block's streams into the hidden that the norm, the target head, the
Markov head and the confidence head (beside the Markov embedding, before the norm) read. Where V4.1 differs:
it reads the streams entering its target layers, passes each sub-layer's mix to the next, has no per-head query
norm and collapses with the last mix. Math only.
"""
from __future__ import annotations

import functools

import torch

from deepinfer.layers.mhc import head_collapse
from deepinfer.layers.rotary import RopeCache
from deepinfer.models.dspark_common import block_inputs, draft_heads, feature_context, read_context, stages_of
from deepinfer.models.interface import DraftBlock
from deepinfer.state.kv_state import EntryStore


@torch.inference_mode()
def draft_block(model, features: torch.Tensor, feature_pos: torch.Tensor, feature_valid: torch.Tensor,
                anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, window_format: str = "float32") -> DraftBlock:
    """Draft one block per request from target features [B, C, len(targets) * D] at feature_pos [B, C] (the
    window before the anchor; feature_valid masks padding); anchor_tokens / anchor_pos [B]: the newest accepted
    token and its position. The draft's KV is rounded through `window_format` (the window rings' format)."""
    cfg = model.config
    kv_fmt = _format(cfg.head_dim, cfg.qk_rope_head_dim, window_format)
    keys = feature_context(model, features, feature_pos, kv_fmt)
    return _draft(model, keys, feature_valid, anchor_tokens, anchor_pos, kv_fmt)


@torch.inference_mode()
def draft_from_cache(model, rings, ctx_rows: torch.Tensor, ctx_valid: torch.Tensor, anchor_tokens: torch.Tensor,
                     anchor_pos: torch.Tensor, pick=None) -> DraftBlock:
    """draft_block with the context KV read from the stages' rings (dspark_common.write_draft_context) at
    ctx_rows [B, C] (masked where ctx_valid is False). `pick`: see dspark_common.draft_heads."""
    return _draft(model, read_context(model, rings, ctx_rows), ctx_valid, anchor_tokens, anchor_pos, rings[0], pick)


@functools.lru_cache(maxsize=None)
def _format(dim: int, rope_dim: int, fmt: str) -> EntryStore:
    """An empty store of the window rings' format (for its round trip only)."""
    return EntryStore(0, dim, rope_dim, fmt, "meta")


def _draft(model, stage_keys: list[torch.Tensor], ctx_valid: torch.Tensor, anchor_tokens: torch.Tensor,
           anchor_pos: torch.Tensor, kv_fmt, pick=None) -> DraftBlock:
    """The block from each stage's context keys [B, C, head_dim] (as stored): the stages over
    [anchor, noise x (block-1)], the last stage's hc_head, then the heads."""
    cfg, stages = model.config, stages_of(model)
    ids, pos, x = block_inputs(cfg, model.embed, anchor_tokens, anchor_pos)
    B, blk = ids.shape
    rope = RopeCache.at(pos.flatten(), model.inv_freq_main)
    x, ids = x.flatten(0, 1), ids.flatten()
    for stage, keys in zip(stages, stage_keys):
        x = stage.draft_forward(x, ids, keys, ctx_valid, rope, kv_fmt)
    last = stages[-1]
    hidden = head_collapse(x, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps)
    return draft_heads(lambda h: model.head(h).float(), last, hidden.view(B, blk, -1), anchor_tokens, pick=pick)
