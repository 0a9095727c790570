"""ForwardBatch: the flat varlen batch of one model step and its gather/scatter plans.

Tokens of all requests are concatenated (request b owns flat tokens cu[b]..cu[b+1]-1 at
positions start_b..start_b+n_b-1). Every index the model needs to read or write the
decode-time state is planned here, on the host, once per step, so the forward has no
per-request loop and no host sync. Index -1 means "no such key" (masked).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SeqChunk:
    """One request's share of a step: `token_ids` at positions start.. start+len-1.

    `block_tables[m]` lists the pool blocks holding the request's ratio-m entries: entry w
    lives at address block_tables[m][w // block_size] * block_size + w % block_size."""

    slot: int
    start: int
    token_ids: list[int]
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    prev_tokens: list[int] = field(default_factory=list)  # the tokens just before `start` (n-gram context)


@dataclass
class CompressPlan:
    """Entries of one compressor kind (ratio m, overlapped or not) that close this step."""

    ratio: int
    src_new: torch.Tensor    # [N, S] flat token index of each pooled source, or -1
    src_carry: torch.Tensor  # [N, S] carry row of each pooled source, or -1
    dst: torch.Tensor        # [N] entry address the new entry is stored at
    rope_pos: torch.Tensor   # [N] = m * w, the position entry w is rotated at
    carry_src: torch.Tensor  # [Nc] flat tokens whose projections stay in the carry
    carry_dst: torch.Tensor  # [Nc] their carry rows
    visible: torch.Tensor    # [T] entries visible to each token: (pos + 1) // m
    addr: torch.Tensor       # [B, max_visible] address of entry w of request b

    @property
    def max_visible(self) -> int:
        return self.addr.shape[1]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor   # [T]
    positions: torch.Tensor   # [T]
    token_req: torch.Tensor   # [T] request index b of each token
    logits_idx: torch.Tensor  # [B] flat index of each request's last token
    win_new: torch.Tensor     # [T, W] window key j of token t, if computed this step
    win_ring: torch.Tensor    # [T, W] its ring row, if it comes from the cache
    ring_src: torch.Tensor    # [Nw] tokens whose kv stays in the ring
    ring_dst: torch.Tensor    # [Nw] their ring rows
    plans: dict[tuple[int, bool], CompressPlan]
    # [T, K] (host) token k positions before each token (column 0 = itself), -1 before the sequence start
    token_windows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def _ring_rows(slot: torch.Tensor, pos: torch.Tensor, size: int) -> torch.Tensor:
    return slot * size + pos % size


def _gather_plan(tok, pos, start, slot, span: int, ring: int):
    """Sources pos-span+1 .. pos for each row: new this step, or in a ring of `ring` rows."""
    k = torch.arange(span)
    q = pos[:, None] - (span - 1) + k
    valid = q >= 0
    new = valid & (q >= start[:, None])
    new_idx = torch.where(new, tok[:, None] - (span - 1) + k, -1)
    ring_idx = torch.where(valid & ~new, _ring_rows(slot[:, None], q.clamp(min=0), ring), -1)
    return new_idx, ring_idx


def _keep_last(tok, pos, end, slot, size: int):
    keep = pos >= end - size
    return tok[keep], _ring_rows(slot[keep], pos[keep], size)


def _entry_addresses(chunks: list[SeqChunk], m: int, n_entries: int, block_size: int) -> torch.Tensor:
    """[B, n_entries] address of entry w of each request (its block table must cover it)."""
    w = torch.arange(n_entries)
    rows = []
    for c in chunks:
        table = c.block_tables.get(m, [])
        need = -(-((c.start + len(c.token_ids)) // m) // block_size)
        if len(table) < need:
            raise ValueError(f"slot {c.slot}: block table for ratio {m} has {len(table)} blocks, needs {need}")
        t = torch.tensor(table + [0] * max(0, -(-n_entries // block_size) - len(table)), dtype=torch.long)
        rows.append(t[w // block_size] * block_size + w % block_size)
    return torch.stack(rows) if rows else torch.zeros(0, n_entries, dtype=torch.long)


def _compress_plan(m: int, overlap: bool, chunks: list[SeqChunk], tok, pos, req, start, end, slot,
                   req_end, block_size: int) -> CompressPlan:
    span = 2 * m if overlap else m
    closing = (pos + 1) % m == 0
    w = pos[closing] // m
    src_new, src_carry = _gather_plan(tok[closing], pos[closing], start[closing], slot[closing], span, span)
    carry_src, carry_dst = _keep_last(tok, pos, end, slot, span)
    max_vis = int((req_end // m).max()) if req_end.numel() else 0
    addr = _entry_addresses(chunks, m, max_vis, block_size)
    return CompressPlan(m, src_new, src_carry, addr[req[closing], w], w * m,
                        carry_src, carry_dst, (pos + 1) // m, addr)


def _token_windows(chunks: list[SeqChunk], width: int) -> torch.Tensor:
    rows = []
    for c in chunks:
        prev = c.prev_tokens[max(0, len(c.prev_tokens) - (width - 1)):] if width > 1 else []
        if len(prev) < min(width - 1, c.start):
            raise ValueError(f"slot {c.slot}: {width - 1} tokens of context needed before position {c.start}")
        ext = torch.tensor(prev + c.token_ids, dtype=torch.long)
        idx = torch.arange(len(c.token_ids))[:, None] + len(prev) - torch.arange(width)
        rows.append(torch.where(idx >= 0, ext[idx.clamp(min=0)], -1))
    return torch.cat(rows)


def build_forward_batch(chunks: list[SeqChunk], window: int, compress_kinds: set[tuple[int, bool]],
                        block_size: int, device: torch.device | str, history: int = 0) -> ForwardBatch:
    """Plan one step. `compress_kinds` = {(ratio, overlapped)} used by the model's layers;
    compressed entries are paged in blocks of `block_size` entries (see SeqChunk); `history` > 0
    also gives each token the `history` - 1 tokens before it (SeqChunk.prev_tokens must hold them)."""
    lens = torch.tensor([len(c.token_ids) for c in chunks])
    if (lens <= 0).any():
        raise ValueError("every SeqChunk needs at least one token")
    req_slot = torch.tensor([c.slot for c in chunks])
    req_start = torch.tensor([c.start for c in chunks])
    req_end = req_start + lens
    req = torch.repeat_interleave(torch.arange(len(chunks)), lens)
    tok = torch.arange(int(lens.sum()))
    cu = torch.cumsum(lens, 0)
    pos = tok - (cu - lens)[req] + req_start[req]
    start, end, slot = req_start[req], req_end[req], req_slot[req]
    win_new, win_ring = _gather_plan(tok, pos, start, slot, window, window)
    ring_src, ring_dst = _keep_last(tok, pos, end, slot, window)
    plans = {(m, ov): _compress_plan(m, ov, chunks, tok, pos, req, start, end, slot, req_end, block_size)
             for m, ov in sorted(compress_kinds)}
    ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    for p in plans.values():
        for f in ("src_new", "src_carry", "dst", "rope_pos", "carry_src", "carry_dst", "visible", "addr"):
            setattr(p, f, to(getattr(p, f)))
    windows = _token_windows(chunks, history) if history else None
    return ForwardBatch(to(ids), to(pos), to(req), to(cu - 1), to(win_new), to(win_ring),
                        to(ring_src), to(ring_dst), plans, windows)
