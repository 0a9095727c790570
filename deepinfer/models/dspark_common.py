"""What DeepSeek's two DSpark drafts share (V4.1's `dspark_v41.py`, V4-Flash-0731's `dspark_v4.py`).

A block of `dspark_block_size` rows [token_p, noise x (block-1)] at positions p .. p+block-1 runs through the
stages; each stage's attention reads its context KV (projected target features at p-W .. p-1, masked where
invalid), the whole block (bidirectional) and its sink, one KV head shared by every query head. After the
last stage, base logits come from the target head on the last stage's norm; a rank-r Markov head adds a bias
from the previous token (the anchor for row 0, then each row's own pick) and the confidence head scores each
row from a hidden and the Markov embedding. Math only.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers.linear import Linear, QuantSpec
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RopeCache
from deepinfer.models.interface import DraftBlock

# Markov-head parameter names by release: V4.1 `markov_head.{embed,head}`; V4-Flash-0731
# `markov_head.{markov_w1,markov_w2}` (the names vLLM 0.34.0's V4 DSpark loader maps one to one)
MARKOV_NAMES_V41 = ("embed", "head")
MARKOV_NAMES_V4 = ("markov_w1", "markov_w2")


class MarkovHead(nn.Module):
    """Rank-r bigram bias: lookup(token) [.., r] (an embedding), bias(e) [.., V] (a linear, no bias)."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype, names: tuple[str, str]):
        super().__init__()
        self._names = names
        setattr(self, names[0], nn.Embedding(vocab, rank, dtype=dtype))
        setattr(self, names[1], Linear(rank, vocab, dtype))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._names[0])(ids)

    def bias(self, emb: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._names[1])(emb)


def add_dspark_heads(stage_module: nn.Module, cfg, stage: int, dtype: torch.dtype, quant: QuantSpec,
                     markov_names: tuple[str, str] = MARKOV_NAMES_V41) -> None:
    """DSpark's stage-owned parts: the target-feature projection (first stage); the norm, Markov
    head and confidence head (last stage)."""
    d = cfg.hidden_size
    if stage == 0:
        stage_module.main_proj = Linear(len(cfg.dspark_target_layer_ids) * d, d, dtype, quant)
        stage_module.main_norm = RMSNorm(d, cfg.rms_norm_eps)
    if stage == cfg.num_nextn_predict_layers - 1:
        rank = cfg.dspark_markov_rank
        stage_module.norm = RMSNorm(d, cfg.rms_norm_eps)
        stage_module.markov_head = MarkovHead(cfg.vocab_size, rank, dtype, markov_names)
        stage_module.confidence_head = nn.Module()
        stage_module.confidence_head.proj = Linear(d + rank, 1, torch.float32)


def block_inputs(cfg, embed: nn.Module, anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, blk], positions [B, blk], streams [B, blk, n, D]): the anchor then noise tokens, each row's
    embedding copied into every stream."""
    blk, B = cfg.dspark_block_size, anchor_tokens.shape[0]
    ids = torch.full((B, blk), cfg.dspark_noise_token_id, dtype=torch.long, device=anchor_tokens.device)
    ids[:, 0] = anchor_tokens
    pos = anchor_pos[:, None] + torch.arange(blk, device=anchor_pos.device)
    return ids, pos, embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)


def block_attention(q: torch.Tensor, ctx_keys: torch.Tensor, ctx_valid: torch.Tensor, own: torch.Tensor,
                    sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, S, H, hd] (rotated), ctx_keys [B, C, hd] (as stored), own [B, S, hd] the block's keys (rotated, rounded
    through the window format) -> [B, S, H, hd] in fp32: softmax over the valid context, every block row and the
    per-head sink; keys are their own values."""
    B, S = own.shape[:2]
    keys = torch.cat((ctx_keys.float(), own.float()), 1)
    valid = torch.cat((ctx_valid, torch.ones(B, S, dtype=torch.bool, device=own.device)), dim=1)
    logits = torch.einsum("bshd,bkd->bhsk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    sinks = sink.float().view(1, -1, 1, 1).expand(B, -1, S, 1)
    probs = torch.softmax(torch.cat((logits, sinks), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhsk,bkd->bshd", probs, keys)


def draft_heads(logits_of, last: nn.Module, hidden: torch.Tensor, anchor_tokens: torch.Tensor,
                normalized_confidence: bool = False, pick=None) -> DraftBlock:
    """hidden [B, blk, D] (the block's collapsed output, before the last stage's norm) -> the block; base logits
    are logits_of(the last stage's norm of hidden) (the target's head, fp32 out). The confidence
    head reads the Markov embedding beside `hidden` (the released references), or beside its norm with
    `normalized_confidence` (NeMo-trained drafts). Row i's token is pick(its logits [B, V]) (None: the argmax); row
    i + 1's Markov bias reads it."""
    normed = last.norm(hidden)
    base = logits_of(normed)
    conf_in = normed if normalized_confidence else hidden
    prev, toks, logits, conf = anchor_tokens, [], [], []
    for i in range(hidden.shape[1]):
        emb = last.markov_head.lookup(prev)
        li = base[:, i] + last.markov_head.bias(emb).float()
        score = last.confidence_head.proj(torch.cat((conf_in[:, i].float(), emb.float()), -1))[:, 0]
        conf.append(torch.sigmoid(score))
        prev = li.argmax(-1) if pick is None else pick(li)
        toks.append(prev)
        logits.append(li)
    return DraftBlock(torch.stack(toks, 1), torch.stack(logits, 1), torch.stack(conf, 1))


def stages_of(model) -> nn.ModuleList:
    if model.mtp is None:
        raise RuntimeError("this model has no DSpark draft stages (num_nextn_predict_layers is 0)")
    return model.mtp


def project_features(model, features: torch.Tensor) -> torch.Tensor:
    """Target features [..., len(targets) * D] -> the draft's context input main_norm(main_proj(.)) [..., D]."""
    first = stages_of(model)[0]
    return first.main_norm(first.main_proj(features.to(model.dtype)))


def context_keys(model, features: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """Each stage's context KV [N, head_dim] of target features [N, len(targets) * D] at `positions` [N] (rotated
    there; not yet rounded through the window format)."""
    ctx_h = project_features(model, features)
    rope = RopeCache.at(positions, model.inv_freq_main)
    return [st.context_keys(ctx_h, rope) for st in stages_of(model)]


def feature_context(model, features: torch.Tensor, feature_pos: torch.Tensor, kv_fmt) -> list[torch.Tensor]:
    """Each stage's context KV [B, C, head_dim] of target features [B, C, len(targets) * D] at feature_pos [B, C],
    rounded through the window format `kv_fmt` as the rings would store it (draft_block's context)."""
    B, C = feature_pos.shape
    return [kv_fmt.roundtrip(k).view(B, C, -1) for k in context_keys(model, features.flatten(0, 1),
                                                                       feature_pos.flatten())]


def write_draft_context(model, features: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, rings) -> None:
    """Store each stage's context KV of target features at `positions` into its window ring (`rings`: the cache's
    draft-stage stores) at `rows` [N]: the state read_context reads."""
    for keys, ring in zip(context_keys(model, features, positions), rings):
        ring.write(rows, keys)


def read_context(model, rings, ctx_rows: torch.Tensor) -> list[torch.Tensor]:
    """Each stage's context KV [B, C, head_dim] as stored at ctx_rows [B, C] (rows < 0 read row 0: mask them)."""
    B, C = ctx_rows.shape
    flat = ctx_rows.clamp(min=0).flatten()
    return [ring.read(flat, model.dtype).view(B, C, -1) for ring in rings]


class DSparkHost:
    """SelfDrafting (models/interface.py) for a model class whose release drafts with `dspark_draft` (a
    staticmethod: that release's draft_from_cache(model, rings, ctx_rows, ctx_valid, anchor_tokens, anchor_pos,
    pick)); the context store is the same for every release."""

    def store_draft_context(self, features: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                            rings: list) -> None:
        write_draft_context(self, features, positions, rows, rings)

    def draft_from_cache(self, rings: list, ctx_rows: torch.Tensor, ctx_valid: torch.Tensor,
                         anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, pick=None) -> DraftBlock:
        return self.dspark_draft(self, rings, ctx_rows, ctx_valid, anchor_tokens, anchor_pos, pick)
