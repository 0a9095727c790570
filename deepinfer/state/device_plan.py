"""A fixed-shape step of q tokens per request planned on the device, from device tensors: what a CUDA graph can
run without the host knowing the step's positions (a speculative step launched before the accepted counts of
the step in flight are read back: its starts are computed on the device).

Row b is request b: tokens b*q .. b*q + q - 1 at positions starts[b] .. starts[b] + q - 1 of slot slots[b], its
ratio-m entries paged by tables[m][b] (block ids, zero-padded to the width the FixedShape's visible entries
need). Invariant (tests/state/test_device_plan.py): the ForwardBatch equals build_forward_batch's of the same
chunks with the same FixedShape, tensor for tensor. Every shape depends only on (B, q, the FixedShape), and no
op reads a value back to the host, so the planning itself is captured with the step.

Fixed shapes keep every row in every plan: q <= ring_slack + 1 means a step's q positions never wrap a ring
(window + slack rows, compressor carries of span + slack rows, the history of K + slack rows), so every token
is kept in every ring (`_keep_last` keeps all), and tokens that close no entry write theirs to the scratch row.
"""
from __future__ import annotations

import torch

from deepinfer.state.forward_batch import (CompressPlan, FixedShape, ForwardBatch, HistoryPlan, _gather_plan,
                                           _ring_rows)


def table_width(visible: int, block_size: int) -> int:
    """Blocks of a request's table the planner reads for `visible` entries."""
    return -(-visible // block_size)


def plan_on_device(tokens: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, tables: dict[int, torch.Tensor],
                   q: int, window: int, compress_kinds: set[tuple[int, bool]], block_size: int, fixed: FixedShape,
                   device_history: int = 0, ring_slack: int = 0) -> ForwardBatch:
    """The step's ForwardBatch (tensors on tokens' device). tokens [B * q], starts [B], slots [B] int64;
    tables[m] [B, table_width(fixed.visible[m], block_size)] int64 block ids."""
    if q > ring_slack + 1:
        raise ValueError(f"plan_on_device: {q} tokens a request exceed the ring slack + 1 ({ring_slack + 1})")
    dev = tokens.device
    B = starts.shape[0]
    tok = torch.arange(B * q, device=dev)
    req = tok // q
    pos = starts[req] + tok % q
    start, slot = starts[req], slots[req]
    ring = window + ring_slack
    win_new, win_ring = _gather_plan(tok, pos, start, slot, window, ring)
    plans = {}
    for m, ov in sorted(compress_kinds):
        span = 2 * m if ov else m
        w = pos // m
        src_new, src_carry = _gather_plan(tok, pos, start, slot, span, span + ring_slack)
        vis = fixed.visible[m]
        e = torch.arange(vis, device=dev)
        addr = tables[m][:, e // block_size] * block_size + e % block_size  # [B, vis]
        dst = addr[req, w.clamp(max=max(vis - 1, 0))]
        dst = torch.where((pos + 1) % m == 0, dst, torch.full_like(dst, fixed.scratch[m]))
        plans[m, ov] = CompressPlan(m, src_new, src_carry, dst, w * m, tok, _ring_rows(slot, pos, span + ring_slack),
                                    (pos + 1) // m, addr)
    batch = ForwardBatch(tokens, pos, req, torch.arange(B, device=dev) * q + q - 1, win_new, win_ring, tok,
                         _ring_rows(slot, pos, ring), plans, req_lens=(q,) * B, ring_early=True)
    if device_history:
        size = device_history + ring_slack
        back = pos[:, None] - torch.arange(device_history, device=dev)
        from_ring = B * q + _ring_rows(slot[:, None], back.clamp(min=0), size)
        own = tok[:, None] - torch.arange(device_history, device=dev)
        win_src = torch.where(back < 0, -1, torch.where(back >= start[:, None], own, from_ring))
        batch.history = HistoryPlan(win_src, tok, _ring_rows(slot, pos, size))
    return batch
