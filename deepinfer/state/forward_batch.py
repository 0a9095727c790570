"""ForwardBatch: the flat varlen batch of one model step and its gather/scatter plans.

Tokens of all requests are concatenated (request b owns flat tokens cu[b]..cu[b+1]-1 at
positions start_b..start_b+n_b-1). Every index the model needs to read or write the
decode-time state is planned here, on the host, once per step, so the forward has no
per-request loop and no host sync. Index -1 means "no such key" (masked).

Per-slot rings (window keys, compressor carries, the Engram token history) are addressed by
position: a ring of `size` rows per slot keeps position pos in row slot * size + pos % size, with
size = what the reads need (W window keys, S = 2m / m carry sources, K history tokens) plus
`ring_slack`. A step writes its positions >= end - size (the last `size`: distinct rows) and reads
positions >= pos - (need - 1). Slack lets a step's positions be taken back (speculative decoding:
a verify chunk [t, d1..dk] keeps only p..p+a): the rows its rejected positions p+a+1..p+k wrote
are those of positions p+a+1-size..p+k-size, which no later step reads as long as
ring_slack >= k - 1 (a later step at q > p+a reads positions >= q - need + 1 >= p+a+2-need, and
each rejected position is rewritten, by the step that recomputes it, before anything reads it).
Compressed entries and indexer keys need no slack: they are paged by entry index, and entry w is
first read by the token at its closing position (w+1)m-1, in the layer that has just written it
(compress plan `dst` is written before attention / the indexer reads `addr`); tokens before that
position do not see it (`visible` = (pos+1) // m). So an entry written at a rejected position is
rewritten by the step that recomputes that position before any read.
"""
from __future__ import annotations

import itertools

from dataclasses import dataclass, field

import numpy as np
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
    replay_from: int = 0  # SWA bounded replay: layers above the last KV source run on positions >= this
    image_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, length) near this chunk


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
class HistoryPlan:
    """Engram's n-gram windows from a per-slot device history: a ring of R = K + ring_slack rows per
    slot, position p of the slot's request in row p % R (image tokens stored as -1). `ext` = cat(this
    step's input ids with image tokens as -1, history.view(-1)); win_src [T, K] indexes `ext` (-1 =
    before the sequence start): column k of token t = the token k positions back. After the windows
    are read, history.view(-1)[hist_dst] = ids[hist_src] stores the step's tokens at positions >= end - R.
    Rows are addressed by position, so running a step twice (graph warm-up, then replay) stores the
    same values; token values never come from the host, so placeholder inputs work."""

    win_src: torch.Tensor
    hist_src: torch.Tensor
    hist_dst: torch.Tensor


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
    window_mask: torch.Tensor | None = None   # [T, K] (host) False where that token is an image token
    image_mask: torch.Tensor | None = None    # [T] True for image-span tokens (None: no image in the step)
    input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, [rows, D]) embedding overrides
    replay: "ReplayPlan | None" = None
    history: HistoryPlan | None = None
    req_lens: tuple[int, ...] = ()  # (host) tokens of each request this step, in token order
    # (host) the window kv may be written to the ring before attention reads it: no replay, and every request
    # has at most ring_slack + 1 tokens, so ring_src is every token in order and no row written holds a key
    # of any query's window (the newest overwritten is position end - 1 - W', below start - W + 1)
    ring_early: bool = False

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class ReplayPlan:
    """SWA bounded replay: only `rows` (each request's positions >= replay_from) go past the last KV
    source. `at_layer` is that layer's view (queries = rows, window keys from every row of the step);
    `upper` is the batch of the layers above, over the kept rows only, whose window keys exist only at
    kept positions (this step's or earlier steps')."""

    rows: torch.Tensor
    at_layer: ForwardBatch
    upper: ForwardBatch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor -> device without waiting for the GPU: a copy from pageable memory blocks the
    host until the stream drains (no overlap with the step running), so CUDA copies go through
    pinned memory."""
    if torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# The host side of planning works on numpy int64 / bool arrays: a numpy op on a few hundred
# elements costs ~1 us where a torch CPU op costs ~5-10 us, and a decode step is planned with
# ~150 of them while the GPU runs the step before (benchmarks/NOTES.md). Arrays become torch
# tensors (zero-copy) only where they leave this module.

def _ring_rows(slot, pos, size: int):
    return slot * size + pos % size


def _gather_plan(tok, pos, start, slot, span: int, ring: int, lo=None):
    """Sources pos-span+1 .. pos for each row: new this step, or in a ring of `ring` rows.
    Positions below `lo` (per row; default 0) do not exist. numpy arrays, or torch tensors on the
    device that reads the [T, span] result."""
    xp = torch if isinstance(pos, torch.Tensor) else np
    if xp is np and start is pos and lo is None:  # decode (each row its request's only token): a shorter path
        q = pos[:, None] + np.arange(1 - span, 1)
        ring_idx = _ring_rows(slot[:, None], q, ring)
        ring_idx[q < 0] = -1
        ring_idx[:, -1] = -1
        new_idx = np.full(q.shape, -1, dtype=np.int64)
        new_idx[:, -1] = tok
        return new_idx, ring_idx
    k = torch.arange(span, device=pos.device) if xp is torch else np.arange(span)
    q = pos[:, None] - (span - 1) + k
    valid = q >= (0 if lo is None else lo[:, None])
    new = valid & (q >= start[:, None])
    new_idx = xp.where(new, tok[:, None] - (span - 1) + k, -1)
    ring_idx = xp.where(valid & ~new, _ring_rows(slot[:, None], q.clip(min=0), ring), -1)
    return new_idx, ring_idx


def _keep_last(tok, pos, end, slot, size: int):
    keep = pos >= end - size
    return tok[keep], _ring_rows(slot[keep], pos[keep], size)


def _padded_tables(chunks: list[SeqChunk], m: int) -> tuple[np.ndarray, np.ndarray]:
    """([B, width] each request's ratio-m block table, zeros past its length; [B] the lengths)."""
    tables = [c.block_tables.get(m, ()) for c in chunks]
    counts = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    padded = np.zeros((len(chunks), int(counts.max()) if counts.size else 0), dtype=np.int64)
    if counts.any():  # row-major: the mask's True cells are the tables' blocks in order
        padded[np.arange(padded.shape[1]) < counts[:, None]] = np.fromiter(itertools.chain.from_iterable(tables),
                                                                            dtype=np.int64, count=int(counts.sum()))
    return padded, counts


def _entry_addresses(padded: np.ndarray, counts: np.ndarray, m: int, n_entries: int, block_size: int,
                     req_end: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """[B, n_entries] address of entry w of each request, from its zero-padded block table [B, width] (which
    must cover its entries up to req_end, the position after its chunk)."""
    need = -(-(req_end // m) // block_size)
    short = np.flatnonzero(counts < need)
    if short.size:
        b = int(short[0])
        raise ValueError(f"slot {slots[b]}: block table for ratio {m} has {counts[b]} blocks, needs {need[b]}")
    width = -(-n_entries // block_size)
    if padded.shape[1] < width:
        padded = np.pad(padded, ((0, 0), (0, width - padded.shape[1])))
    addr = padded[:, :width, None] * block_size + np.arange(block_size)
    return addr.reshape(len(padded), width * block_size)[:, :n_entries]


@dataclass(frozen=True)
class FixedShape:
    """Shapes that depend only on the batch size and these buckets (CUDA-graph capture of decode):
    every token gets a compressor row (tokens that close no entry write theirs to `scratch[m]`, an
    entry row no request owns), and entry tables are `visible[m]` wide (>= every request's count)."""

    scratch: dict[int, int]
    visible: dict[int, int]


def _compress_plan(m: int, overlap: bool, tables: tuple[np.ndarray, np.ndarray], tok, pos, req, start, end, slot,
                   req_end, req_slot, block_size: int, to, fixed: FixedShape | None = None,
                   slack: int = 0) -> CompressPlan:
    return CompressPlan(m, *map(to, _compress_arrays(m, overlap, tables, tok, pos, req, start, end, slot, req_end,
                                                     req_slot, block_size, fixed, slack)))


def _compress_arrays(m: int, overlap: bool, tables: tuple[np.ndarray, np.ndarray], tok, pos, req, start, end, slot,
                     req_end, req_slot, block_size: int, fixed: FixedShape | None, slack: int) -> tuple[np.ndarray, ...]:
    """CompressPlan's tensors (src_new .. addr, in field order) as numpy arrays; `tables`: the requests'
    zero-padded ratio-m block tables and their lengths (_padded_tables)."""
    span = 2 * m if overlap else m
    closing = (pos + 1) % m == 0
    # fixed shapes: every token has a row (the arrays passed as they are: _gather_plan tests `start is pos`)
    rows = slice(None) if fixed else closing
    picked = (tok, pos, start, slot) if fixed else (tok[rows], pos[rows], start[rows], slot[rows])
    w = picked[1] // m
    src_new, src_carry = _gather_plan(*picked, span, span + slack)
    carry_src, carry_dst = _keep_last(tok, pos, end, slot, span + slack)
    max_vis = int((req_end // m).max()) if req_end.size else 0
    if fixed:
        if max_vis > fixed.visible[m]:
            raise ValueError(f"FixedShape.visible[{m}]={fixed.visible[m]} < {max_vis} entries")
        max_vis = fixed.visible[m]
    addr = _entry_addresses(*tables, m, max_vis, block_size, req_end, req_slot)
    dst = addr[req[rows], np.minimum(w, max(max_vis - 1, 0))] if max_vis else w
    if fixed:
        dst = np.where(closing, dst, fixed.scratch[m])
    return src_new, src_carry, dst, w * m, carry_src, carry_dst, (pos + 1) // m, addr


def _in_spans(pos: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    inside = np.zeros(pos.shape, dtype=bool)
    for s0, n in spans:
        inside |= (pos >= s0) & (pos < s0 + n)
    return inside


def _image_masks(chunks: list[SeqChunk], pos: np.ndarray, req: np.ndarray, width: int):
    """(image_mask [T], window_mask [T, width] or None) from the chunks' image spans."""
    if not any(c.image_spans for c in chunks):
        return None, None
    image = np.concatenate([_in_spans(pos[req == b], c.image_spans) for b, c in enumerate(chunks)])
    if not width:
        return image, None
    back = pos[:, None] - np.arange(width)
    window = np.concatenate([~_in_spans(back[req == b], c.image_spans) for b, c in enumerate(chunks)])
    return image, torch.from_numpy(window)


def _token_windows(chunks: list[SeqChunk], width: int) -> torch.Tensor:
    rows = []
    for c in chunks:
        prev = c.prev_tokens[max(0, len(c.prev_tokens) - (width - 1)):] if width > 1 else []
        if len(prev) < min(width - 1, c.start):
            raise ValueError(f"slot {c.slot}: {width - 1} tokens of context needed before position {c.start}")
        ext = np.array(prev + c.token_ids, dtype=np.int64)
        idx = np.arange(len(c.token_ids))[:, None] + len(prev) - np.arange(width)
        rows.append(np.where(idx >= 0, ext[idx.clip(min=0)], -1))
    return torch.from_numpy(np.concatenate(rows))


def _history_plan(width: int, tok, pos, start, end, slot, slack: int = 0) -> tuple:
    """(win_src [T, K], hist_src [N], hist_dst [N]) of HistoryPlan, numpy. The history is a ring of
    R = K + slack rows per slot: position p lives in row slot * R + p % R, so the K positions a window
    spans have distinct rows. Positions below 0 have no token; positions below the chunk's start are read
    from the ring (the request's previous steps wrote them); the step writes its tokens at positions
    >= end - R."""
    T, size = tok.shape[0], width + slack
    back = pos[:, None] - np.arange(width)                        # [T, K] position of each column
    from_ring = T + _ring_rows(slot[:, None], back.clip(min=0), size)
    win_src = np.where(back < 0, -1, np.where(back >= start[:, None], tok[:, None] - np.arange(width), from_ring))
    hist_src, hist_dst = _keep_last(tok, pos, end, slot, size)
    return win_src, hist_src, hist_dst


def build_forward_batch(chunks: list[SeqChunk], window: int, compress_kinds: set[tuple[int, bool]],
                        block_size: int, device: torch.device | str, history: int = 0,
                        fixed: FixedShape | None = None, device_history: int = 0,
                        ring_slack: int = 0) -> ForwardBatch:
    """Plan one step. `compress_kinds` = {(ratio, overlapped)} used by the model's layers;
    compressed entries are paged in blocks of `block_size` entries (see SeqChunk); `history` > 0
    also gives each token the `history` - 1 tokens before it on the host (SeqChunk.prev_tokens must
    hold them); `device_history` > 0 plans the same windows from a per-slot device history instead
    (HistoryPlan: no host token values needed). `ring_slack`: the extra rows per slot of every ring
    of the cache the step runs on (V4Cache.ring_slack; see the module docstring)."""
    if not isinstance(ring_slack, int) or ring_slack < 0:
        raise ValueError(f"ring_slack must be an int >= 0, got {ring_slack!r}")
    lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    if (lens <= 0).any():
        raise ValueError("every SeqChunk needs at least one token")
    req_slot = np.array([c.slot for c in chunks], dtype=np.int64)
    req_start = np.array([c.start for c in chunks], dtype=np.int64)
    req_end = req_start + lens
    req = np.repeat(np.arange(len(chunks)), lens)
    tok = np.arange(int(lens.sum()))
    cu = np.cumsum(lens)
    pos = tok - (cu - lens)[req] + req_start[req]
    start, end, slot = req_start[req], req_end[req], req_slot[req]
    to = lambda a: to_device(torch.from_numpy(np.ascontiguousarray(a)), device)  # noqa: E731
    on_host = torch.device(device).type == "cpu"
    d_pos = to(pos)
    ring = window + ring_slack  # window ring rows per slot
    if on_host:
        win_new, win_ring = map(to, _gather_plan(tok, pos, start, slot, window, ring))
    else:  # the [T, window] tables are expanded where they are read: only [T] vectors cross to a GPU
        win_new, win_ring = _gather_plan(to(tok), d_pos, to(start), to(slot), window, ring)
    ring_src, ring_dst = _keep_last(tok, pos, end, slot, ring)
    tables = {m: _padded_tables(chunks, m) for m in {m for m, _ in compress_kinds}}
    plans = {(m, ov): _compress_plan(m, ov, tables[m], tok, pos, req, start, end, slot, req_end, req_slot, block_size,
                                     to, fixed, ring_slack)
             for m, ov in sorted(compress_kinds)}
    ids = np.array([t for c in chunks for t in c.token_ids], dtype=np.int64)
    windows = _token_windows(chunks, history) if history else None
    image_mask, window_mask = _image_masks(chunks, pos, req, history)
    batch = ForwardBatch(to(ids), d_pos, to(req), to(cu - 1), win_new, win_ring,
                         to(ring_src), to(ring_dst), plans, windows, window_mask,
                         None if image_mask is None else to(image_mask), req_lens=tuple(lens.tolist()))
    if device_history:
        batch.history = HistoryPlan(*map(to, _history_plan(device_history, tok, pos, start, end, slot, ring_slack)))
    replay_from = np.array([c.replay_from for c in chunks], dtype=np.int64)[req]
    keep = pos >= replay_from
    # replay applies if rows are dropped, or a kept row's window reaches below its request's replay_from
    # (replay_from 0: nothing lies below it, whatever the window)
    if not keep.all() or ((replay_from > 0) & (pos - window + 1 < replay_from)).any():
        batch.replay = _replay_plan(batch, keep, pos, start, end, slot, replay_from, window, to, ring)
    batch.ring_early = batch.replay is None and int(lens.max()) <= ring_slack + 1
    return batch


def _replay_plan(full: ForwardBatch, keep, pos, start, end, slot, lo, window: int, to, ring: int) -> ReplayPlan:
    """`ring`: window ring rows per slot (window + ring_slack)."""
    rows = np.flatnonzero(keep)
    dev_rows = to(rows)
    sub = lambda t: t[dev_rows]  # noqa: E731

    def plans():  # only visibility and addresses are read above the last KV source
        empty = {kind: p.dst[:0] for kind, p in full.plans.items()}
        return {kind: CompressPlan(p.ratio, p.src_new[:0], p.src_carry[:0], empty[kind], empty[kind], empty[kind],
                                   empty[kind], sub(p.visible), p.addr) for kind, p in full.plans.items()}

    at_layer = ForwardBatch(sub(full.input_ids), sub(full.positions), sub(full.token_req), full.logits_idx,
                            sub(full.win_new), sub(full.win_ring), full.ring_src, full.ring_dst, plans())
    k_tok = np.arange(len(rows))
    k_pos, k_slot, k_lo = pos[rows], slot[rows], lo[rows]
    win_new, win_ring = _gather_plan(k_tok, k_pos, np.maximum(start[rows], k_lo), k_slot, window, ring, k_lo)
    ring_src, ring_dst = _keep_last(k_tok, k_pos, end[rows], k_slot, ring)
    upper = ForwardBatch(sub(full.input_ids), sub(full.positions), sub(full.token_req), full.logits_idx,
                         to(win_new), to(win_ring), to(ring_src), to(ring_dst), plans())
    return ReplayPlan(dev_rows, at_layer, upper)


def single_token_batch(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, window: int,
                       ring: int) -> ForwardBatch:
    """A window-only step of one token a row, planned on the device from device tensors [G] (positions known
    only there: a chained draft's): window keys from the ring (`ring` rows a slot) up to each token, which
    is new, and each token's key stored at its own position's ring row. No compressor plans: for layers that
    keep a window only (V4's MTP layer)."""
    tok = torch.arange(tokens.shape[0], device=tokens.device)
    win_new, win_ring = _gather_plan(tok, positions, positions, slots, window, ring)
    return ForwardBatch(tokens, positions, tok, tok, win_new, win_ring, tok, _ring_rows(slots, positions, ring), {},
                        req_lens=(1,) * tokens.shape[0], ring_early=True)
