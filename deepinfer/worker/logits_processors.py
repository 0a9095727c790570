"""vLLM's per-request logits processing, batched on the logits' device: allowed_token_ids, bad_words, min_tokens,
logit_bias, then the repetition, frequency and presence penalties (SamplingParams documents each), in that order,
before temperature and the filters (worker/sampler.py).

History. The penalties, min_tokens and bad words of several tokens read the tokens before the sampled one. For a
request that needs them (SamplingParams.needs_history) the runner keeps, per engine slot and on the device: each
output token's count [S, V], which tokens the prompt holds [S, V], the outputs emitted [S] and the last W outputs
(a ring by output index). Two sources fill them, never both for one position:
* a chunk's input tokens, up to the request's first sampled step in the slot (its prompt, or prompt and earlier
  outputs when it recomputes after a preemption): `observe`, from the host's token ids;
* the tokens the slot then emits, as the device holds them (a step launched ahead never waits for them):
  `record` / `record_verified`.
A request's first chunk in a slot starts at position 0 and clears its rows; an n > 1 sibling forked from its
leader's prompt takes the leader's prompt presence and starts its outputs from its own first token.

Speculative verification: the verify row after j drafts sees the request's history plus those j drafts, as
the target would have after emitting them; its output count is the slot's plus j.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.outputs import PLACEHOLDER, SchedulerOutput
from deepinfer.kernels.penalties import apply_penalties, penalized
from deepinfer.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from deepinfer.state.forward_batch import to_device

RING = 64  # outputs kept per slot for bad words (>= MAX_BAD_WORD_TOKENS - 1 and >= a verify group's rows)


@dataclass
class RowPlan:
    """The rows of one sampling call: per row its parameters, slot, drafts verified before it, and where its
    request's drafts begin in the call's draft tensor (-1: none)."""

    params: list[SamplingParams]
    slots: list[int]
    depths: list[int]
    draft_starts: list[int]

    @classmethod
    def sampled(cls, params: list[SamplingParams], slots: list[int]) -> "RowPlan":
        return cls(params, slots, [0] * len(params), [-1] * len(params))


class LogitsProcessors:
    def __init__(self, num_slots: int, vocab: int, device: torch.device, eos_token_id: int | None):
        self.num_slots, self.vocab, self.device, self.eos = num_slots, vocab, device, eos_token_id
        self.counts: torch.Tensor | None = None  # [S, V] int32 output token counts (allocated on first use)
        self.prompt: torch.Tensor | None = None  # [S, V] uint8 tokens of the prompt (1)
        self.out_len: torch.Tensor | None = None  # [S] int64 outputs so far
        self.ring: torch.Tensor | None = None    # [S, RING + 1] int64 output i at column i % RING; RING: scratch
        self.owner: list[str | None] = [None] * num_slots
        self.counted = [0] * num_slots    # positions whose tokens came from chunk inputs
        self.emitting = [False] * num_slots  # the slot has sampled: its outputs come from record*
        self.forked: set[int] = set()     # slots holding a fork's copy, not yet claimed by the sibling's chunk
        self._static: tuple | None = None  # (plan, built tensors) of the last apply
        self._record_idx: tuple | None = None  # (rows, slots, their device index) of the last record

    # ---- history ----

    def _alloc(self) -> None:
        if self.counts is None:
            s, v, d = self.num_slots, self.vocab, self.device
            self.counts = torch.zeros((s, v), dtype=torch.int32, device=d)
            self.prompt = torch.zeros((s, v), dtype=torch.uint8, device=d)
            self.out_len = torch.zeros(s, dtype=torch.long, device=d)
            self.ring = torch.zeros((s, RING + 1), dtype=torch.long, device=d)

    def observe(self, so: SchedulerOutput) -> None:
        """Before the step's forward: its forks, and the input tokens of requests that keep a history."""
        tracked = [c for c in so.chunks if c.params is not None and c.params.needs_history]
        if so.forks and self.counts is not None:
            for f in so.forks:
                if self.owner[f.src_slot] is not None:
                    self._clear(f.dst_slot)
                    self.prompt[f.dst_slot] = self.prompt[f.src_slot]
                    self.forked.add(f.dst_slot)
        if not tracked:
            return
        self._alloc()
        prompt_s, prompt_t, out_s, out_t, out_i, lens = [], [], [], [], [], []
        for c in tracked:
            s = c.slot
            if c.start == 0:
                self._clear(s)
                self.owner[s] = c.request_id
            elif self.owner[s] != c.request_id:
                if s not in self.forked or c.start != c.prompt_len:
                    raise RuntimeError(f"request {c.request_id}: its tokens before position {c.start} were never "
                                       f"seen by this worker (penalties / min_tokens / bad words need them)")
                self.forked.discard(s)
                self.owner[s], self.counted[s], self.emitting[s] = c.request_id, c.start, False
            if not self.emitting[s]:
                end = c.start + len(c.token_ids) - c.num_draft
                lo = max(self.counted[s], c.start)
                toks = np.asarray(c.token_ids[lo - c.start:end - c.start], dtype=np.int64)
                if (toks == PLACEHOLDER).any():
                    raise RuntimeError(f"request {c.request_id}: a placeholder input before its first sampled step")
                split = min(max(c.prompt_len - lo, 0), len(toks))
                prompt_s.append(np.full(split, s)), prompt_t.append(toks[:split])
                out_s.append(np.full(len(toks) - split, s)), out_t.append(toks[split:])
                out_i.append(np.arange(max(lo, c.prompt_len), end) - c.prompt_len)
                self.counted[s] = end
                lens.append((s, max(0, end - c.prompt_len)))
            if c.num_samples:
                self.emitting[s] = True
        if lens:
            self._write_inputs(prompt_s, prompt_t, out_s, out_t, out_i, lens)

    def _clear(self, s: int) -> None:
        self.counts[s].zero_()
        self.prompt[s].zero_()
        self.out_len[s] = 0
        self.owner[s], self.counted[s], self.emitting[s] = None, 0, False
        self.forked.discard(s)

    def _write_inputs(self, prompt_s, prompt_t, out_s, out_t, out_i, lens) -> None:
        parts = [np.concatenate(x) if x else np.zeros(0, np.int64) for x in (prompt_s, prompt_t, out_s, out_t, out_i)]
        # the ring keeps each slot's newest outputs: of entries landing on one (slot, column), the last (a
        # recompute past RING outputs, or two chunks of one slot) — unique writes, as a device scatter's order is not
        # defined for repeated indices; likewise one output length per slot, its largest
        cols = parts[2] * (RING + 1) + parts[4] % RING
        last = len(cols) - 1 - np.unique(cols[::-1], return_index=True)[1]
        ring = [parts[2][last], parts[3][last], parts[4][last] % RING]
        length = dict(sorted(lens, key=lambda x: x[1]))
        flat = parts[:4] + ring + [np.fromiter(length, np.int64), np.fromiter(length.values(), np.int64)]
        n = [len(p) for p in flat]
        dev = to_device(torch.from_numpy(np.concatenate(flat).astype(np.int64)), self.device)
        ps, pt, os_, ot, rs, rt, rc, ls_t, lv_t = torch.split(dev, n)
        self.prompt[ps, pt] = 1
        self.counts.index_put_((os_, ot), torch.ones_like(ot, dtype=torch.int32), accumulate=True)
        self.ring[rs, rc] = rt
        self.out_len[ls_t] = lv_t

    def record(self, tokens: torch.Tensor, rows: list[int], slots: list[int]) -> None:
        """After sampling: tokens[rows[i]] (device) is the next output of the request in slots[i]."""
        if not rows:
            return
        cached = self._record_idx
        if cached is None or cached[0] != rows or cached[1] != slots:  # (decode's steady state: the same rows)
            cached = self._record_idx = (rows, slots, to_device(torch.tensor([rows, slots], dtype=torch.long),
                                                                self.device))
        idx = cached[2]
        t, s = tokens[idx[0]], idx[1]
        self.counts.index_put_((s, t), torch.ones_like(t, dtype=torch.int32), accumulate=True)
        self.ring[s, self.out_len[s] % RING] = t
        self.out_len[s] += 1

    def record_verified(self, tokens: torch.Tensor, groups: list[tuple[int, int, int]]) -> None:
        """After verification: for each (first row, rows, slot), tokens[first row ..] (device; -1 after the
        accepted drafts and the target's token) are the request's next outputs."""
        if not groups:
            return
        if max(n for _, n, _ in groups) > RING:
            raise ValueError(f"a verify group of more than {RING} rows (the history ring)")
        rows = [r0 + j for r0, n, _ in groups for j in range(n)]
        js = [j for _, n, _ in groups for j in range(n)]
        slots = [s for _, n, s in groups for _ in range(n)]
        idx = to_device(torch.tensor([rows, js, slots], dtype=torch.long), self.device)
        t, j, s = tokens[idx[0]], idx[1], idx[2]
        valid = t >= 0
        self.counts.index_put_((s, t.clamp(min=0)), valid.to(torch.int32), accumulate=True)
        self.ring[s, torch.where(valid, (self.out_len[s] + j) % RING, RING)] = t
        self.out_len.index_put_((s,), valid.long(), accumulate=True)

    # ---- applying ----

    def apply(self, logits: torch.Tensor, plan: RowPlan, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """logits [R, V] fp32 (one row per plan row) -> a processed copy; `drafts`: the call's draft tokens (device),
        which plan.draft_starts index."""
        st = self._built(plan)
        out = logits.clone()
        if st.allowed_rows is not None:
            keep = torch.zeros((len(st.allowed_rows), out.shape[1]), dtype=torch.bool, device=out.device)
            keep[st.allowed_pairs[0], st.allowed_pairs[1]] = True
            out[st.allowed_rows] = out[st.allowed_rows].masked_fill(~keep, float("-inf"))
        if st.banned is not None:
            out[st.banned[0], st.banned[1]] = float("-inf")
        if st.hist is not None:
            self._apply_history(out, st, drafts)
        if st.bias is not None:
            out.index_put_((st.bias[0], st.bias[1]), st.bias_values, accumulate=True)
        if st.pen is not None:
            self._penalize(out, st, drafts)
        return out

    def _apply_history(self, out: torch.Tensor, st: "_Built", drafts: torch.Tensor | None) -> None:
        """min_tokens and bad words of several tokens (both read the outputs before each row). A (row, token) may
        be named twice (two words ending alike): -inf or 0 is added, so the order of duplicates does not matter."""
        hrows, hslots, hdepth = st.hist
        n_out = self.out_len[hslots] + hdepth  # outputs before each history row
        if st.min_pairs is not None:
            h, tok, need = st.min_pairs
            out.index_put_((hrows[h], tok), torch.where(n_out[h] < need, float("-inf"), 0.0), accumulate=True)
        if st.words is not None:
            h, prefix, plen, last = st.words
            w = MAX_BAD_WORD_TOKENS - 1
            a = torch.arange(w, device=out.device)
            ring_tail = self.ring[hslots[:, None], (self.out_len[hslots][:, None] - w + a) % RING]  # last w outputs
            ext = torch.cat([ring_tail, self._draft_pad(st, drafts)], dim=1)
            tail = ext.gather(1, hdepth[:, None] + a)  # the w tokens before each row, its drafts included
            match = ((tail[h] == prefix) | (prefix < 0)).all(-1) & (n_out[h] >= plen)
            out.index_put_((hrows[h], last), torch.where(match, float("-inf"), 0.0), accumulate=True)

    def _draft_pad(self, st: "_Built", drafts: torch.Tensor | None) -> torch.Tensor:
        """[H, K] each history row's request's drafts (K = the most drafts before any row; 0 past them)."""
        idx, ok = st.draft_idx
        if drafts is None or idx.shape[1] == 0:
            return idx.new_zeros((idx.shape[0], idx.shape[1]))
        return torch.where(ok, drafts[idx.clamp(min=0)], 0)

    def _penalize(self, out: torch.Tensor, st: "_Built", drafts: torch.Tensor | None) -> None:
        """The penalties over the slots' counts (kernels/penalties.py, one launch on CUDA); a verify row after
        drafts then has the entries of those draft tokens recomputed with the drafts counted."""
        prow, pslot, rep, freq, pres = st.pen
        fix = None
        if st.pen_drafts is not None and drafts is not None:
            pi, di = st.pen_drafts
            tok, r = drafts[di], prow[pi]
            # a token drafted twice before a row counts twice: every pair of it gets the same total (and value)
            extra = ((pi[:, None] == pi[None, :]) & (tok[:, None] == tok[None, :])).sum(1)
            fix = (r, tok, out[r, tok], self.counts[pslot[pi], tok] + extra, pi)
        apply_penalties(out, prow, pslot, self.counts, self.prompt, rep, freq, pres)
        if fix is not None:
            r, tok, x0, c, pi = fix
            out[r, tok] = penalized(x0, c.float(), torch.ones_like(x0, dtype=torch.bool), rep[pi], freq[pi], pres[pi])

    # ---- the plan's index tensors, built once per distinct plan ----

    def _built(self, plan: RowPlan) -> "_Built":
        cached = self._static
        if cached is not None and _same_plan(cached[0], plan):
            return cached[1]
        st = _build(plan, self.eos, self.device)
        if st.hist is not None or st.pen is not None:
            self._alloc()
        self._static = (plan, st)
        return st


@dataclass
class _Built:
    allowed_rows: torch.Tensor | None = None
    allowed_pairs: torch.Tensor | None = None
    banned: torch.Tensor | None = None        # [2, N] (row, token) of one-token bad words
    bias: torch.Tensor | None = None          # [2, N] (row, token)
    bias_values: torch.Tensor | None = None
    hist: tuple | None = None                 # (rows, slots, depths) [H] of rows that read the history
    min_pairs: tuple | None = None            # (history index, token, min_tokens) [N]
    words: tuple | None = None                # (history index [N], prefix [N, W] right-aligned, -1 pad, len, last)
    draft_idx: tuple | None = None            # ([H, K] index into the drafts, [H, K] valid)
    pen: tuple | None = None                  # (rows, slots, rep, freq, pres) [P]
    pen_drafts: tuple | None = None           # (penalty row, draft index) [N]: drafts before each verify row


def _same_plan(a: RowPlan, b: RowPlan) -> bool:
    return (len(a.params) == len(b.params) and all(map(lambda x, y: x is y, a.params, b.params))
            and a.slots == b.slots and a.depths == b.depths and a.draft_starts == b.draft_starts)


def _build(plan: RowPlan, eos: int | None, device) -> _Built:
    st = _Built()
    dev = lambda x, dt=torch.long: to_device(torch.tensor(x, dtype=dt), device)  # noqa: E731
    allowed = [(r, t) for r, p in enumerate(plan.params) for t in p.allowed_token_ids or ()]
    if allowed:
        rows = sorted({r for r, _ in allowed})
        at = {r: i for i, r in enumerate(rows)}
        st.allowed_rows = dev(rows)
        st.allowed_pairs = dev([[at[r] for r, _ in allowed], [t for _, t in allowed]])
    banned = [(r, w[0]) for r, p in enumerate(plan.params) for w in p.bad_words_token_ids or () if len(w) == 1]
    if banned:
        st.banned = dev(list(zip(*banned)))
    bias = [(r, t, b) for r, p in enumerate(plan.params) for t, b in (p.logit_bias or {}).items()]
    if bias:
        st.bias = dev([[r for r, _, _ in bias], [t for _, t, _ in bias]])
        st.bias_values = dev([b for _, _, b in bias], torch.float32)
    hist = [r for r, p in enumerate(plan.params) if p.needs_history]
    if not hist:
        return st
    st.hist = tuple(dev([[r for r in hist], [plan.slots[r] for r in hist], [plan.depths[r] for r in hist]]))
    mins = [(h, t, plan.params[r].min_tokens) for h, r in enumerate(hist) if plan.params[r].min_tokens
            for t in _stop_ids(plan.params[r], eos)]
    if mins:
        st.min_pairs = tuple(dev(list(zip(*mins))))
    w = MAX_BAD_WORD_TOKENS - 1
    words = [(h, ws) for h, r in enumerate(hist) for ws in plan.params[r].bad_words_token_ids or () if len(ws) > 1]
    if words:
        prefix = [[-1] * (w - len(ws) + 1) + ws[:-1] for _, ws in words]
        st.words = (dev([h for h, _ in words]), dev(prefix), dev([len(ws) - 1 for _, ws in words]),
                    dev([ws[-1] for _, ws in words]))
        k = max(plan.depths[r] for r in hist)
        idx = dev([[plan.draft_starts[r] + i if i < plan.depths[r] else -1 for i in range(k)] for r in hist])
        idx = idx.view(len(hist), k)
        st.draft_idx = (idx, idx >= 0)
    pen = [r for r in hist if plan.params[r].penalized]
    if pen:
        ps = [plan.params[r] for r in pen]
        st.pen = (dev(pen), dev([plan.slots[r] for r in pen]),
                  dev([p.repetition_penalty for p in ps], torch.float32),
                  dev([p.frequency_penalty for p in ps], torch.float32),
                  dev([p.presence_penalty for p in ps], torch.float32))
        pd = [(i, plan.draft_starts[r] + d) for i, r in enumerate(pen) for d in range(plan.depths[r])]
        if pd:
            st.pen_drafts = tuple(dev(list(zip(*pd))))
    return st


def _stop_ids(p: SamplingParams, eos: int | None) -> list[int]:
    """What min_tokens holds back: EOS (unless ignore_eos) and stop_token_ids."""
    return list(dict.fromkeys(([] if p.ignore_eos or eos is None else [eos]) + p.stop_token_ids))
