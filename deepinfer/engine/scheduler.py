"""Token-budget continuous batching with chunked prefill and recompute preemption.

Each step: running requests first (in admission order: one decode token, or the next
prefill chunk), then waiting requests while the token budget, max_num_seqs and the cache
allow. When a running request cannot grow, the most recently admitted running request is
preempted: its slot and blocks are freed and it re-enters the queue front with its outputs
kept, to be recomputed. A request is never dropped.

Speculative decoding (a `proposer`): a decoding request's chunk carries draft tokens after its pending
token, as many as the token budget, max_tokens and max_model_len leave room for; the runner verifies
them and the request keeps its accepted drafts plus one target token. Its computed-token count then
covers the pending token and the accepted drafts only: the rejected positions are recomputed later
(the cache's rings have room for them: worker/kv_cache.py ring_slack).
"""
from __future__ import annotations

from collections import Counter

from collections import deque
from dataclasses import dataclass

import numpy as np

from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import (CONTEXT_TOKENS, PLACEHOLDER, DecodeRows, ForkOp, ModelOutput, ScheduledChunk,
                                     SchedulerOutput)
from deepinfer.engine.request import Request, Status
from deepinfer.spec.ngram import ModelDrafts, NgramProposer, SpecStats
from deepinfer.spec.schedule import SPSTable, StepTimes, allocate, uniform_length


@dataclass(frozen=True)
class VarlenPolicy:
    """Confidence-scheduled verification (DEEPINFER_ENABLE_MTP_VARLEN): the steps-per-second table and
    the draft confidences' per-position temperatures (None: as the draft gives them). With `times` (steps
    replayed as CUDA graphs) one length for the whole step (spec/schedule.py uniform_length) instead."""

    sps: SPSTable | None
    temperatures: tuple[float, ...] | None = None
    times: StepTimes | None = None

    def confidences(self, conf: np.ndarray) -> np.ndarray:
        if not self.temperatures:
            return conf
        c = np.clip(conf, 1e-7, 1 - 1e-7)
        t = np.ones(conf.shape[1])
        n = min(len(self.temperatures), conf.shape[1])
        t[:n] = self.temperatures[:n]
        return 1 / (1 + np.exp(-(np.log(c) - np.log1p(-c)) / t))


def _admissible(req: Request) -> bool:
    """A request may start unless its grammar is still compiling or failed to compile (EngineCore aborts
    those with the grammar's error before the next schedule)."""
    return req.grammar is None or (req.grammar.ready() and req.grammar.error is None)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 proposer: NgramProposer | ModelDrafts | None = None):
        self.kv = kv
        self.max_num_seqs, self.budget, self.max_model_len = max_num_seqs, max_num_batched_tokens, max_model_len
        self.waiting: deque[Request] = deque()
        # the waiting requests with a grammar (structured outputs): what the per-step grammar checks scan,
        # instead of the whole queue
        self.waiting_grammars: set[Request] = set()
        self.running: list[Request] = []
        self.pending_forks: list[ForkOp] = []
        self.num_preemptions = 0
        self.proposer = proposer
        self.spec_stats = SpecStats()
        self.varlen: VarlenPolicy | None = None  # model drafts only: per-step lengths from their confidences
        self._lengths: dict[str, int] = {}
        self._propose = True  # whether this step's drafter drafts the next block (SchedulerOutput.propose)
        # the graphs' policy: how often it chose each verify length (-1: no confidences known yet, drafts as made)
        self.policy_lengths: Counter[int] = Counter()
        # a list: every verified block of model drafts is logged as (confidences, drafted, accepted)
        # (eval/calibrate_dspark.py fits the confidence temperatures from it)
        self.spec_log: list[tuple[list[float], int, int]] | None = None
        self._verifying: dict[str, list[float]] = {}  # request id -> the confidences of the drafts it verifies

    def add(self, req: Request) -> None:
        self._enqueue(req)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(req)
        if req.grammar is not None:
            self.waiting_grammars.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_confidence = [], []
        req.status = Status.WAITING
        self._enqueue(req, front=True)
        self.num_preemptions += 1

    def _chunk(self, req: Request, n: int, drafts: list[int] = ()) -> ScheduledChunk:
        start = req.num_computed_tokens
        at_end = start + n == req.num_tokens
        samples = (1 + len(req.siblings)) if at_end else 0
        ids = req.all_token_ids
        lo = start - CONTEXT_TOKENS
        images = [(s0, img) for s0, img in req.images if s0 < start + n and s0 + img.num_tokens > lo]
        # prompt_logprobs: rows start .. start + n - 1 predict positions start + 1 .. start + n; the prompt's last
        # position predicts an output token (a recompute after preemption computes them again). A chunk with drafts
        # has one pending token, at or past the prompt's last position: its prompt_rows are 0
        prompt_rows = 0 if req.prompt_logprobs is None else \
            max(0, min(start + n, len(req.prompt_token_ids) - 1) - start)
        return ScheduledChunk(req.request_id, req.slot, start, ids[start:start + n] + list(drafts),
                              {m: list(t) for m, t in req.block_tables.items()}, samples, req.params,
                              ids[max(0, lo):start], req.num_tokens, images, req.sample_index, len(drafts),
                              -1 if at_end else ids[start + n], req.grammar, prompt_rows, len(req.prompt_token_ids))

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request (one pending token): at most what the step's token budget
        (after the pending token), max_tokens and max_model_len leave room for, so verification can
        never emit past them."""
        if self.proposer is None or req.num_pending != 1 or req.siblings:
            return []
        room = min(budget - 1, self._room(req))
        if room <= 0:
            return []
        if isinstance(self.proposer, ModelDrafts):  # drafted by the model in the step that emitted the pending token
            n = min(room, self._lengths.get(req.request_id, self.proposer.num_speculative_tokens))
            drafts = self._grammar_prefix(req, req.spec_token_ids[:n])
            if self.spec_log is not None:
                self._verifying[req.request_id] = req.spec_confidence[:len(drafts)]
            return drafts
        return self._grammar_prefix(req, self.proposer.propose(req.all_token_ids, room))

    @staticmethod
    def _grammar_prefix(req: Request, drafts: list[int]) -> list[int]:
        """Structured outputs: the leading drafts the request's grammar accepts (its state already holds
        the pending token, accepted when it was emitted); the verify masks then keep every emitted token
        inside the grammar."""
        if req.grammar is None or not drafts:
            return drafts
        return drafts[:req.grammar.valid_prefix(drafts)]

    def _room(self, req: Request) -> int:
        """Draft tokens a decoding request can verify before max_tokens or max_model_len (a step emits its
        accepted drafts plus one token)."""
        return min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - 1

    def _varlen_lengths(self) -> dict[str, int]:
        """Each decoding request's verify length this step: DSpark's Alg. 1 (spec/schedule.py allocate) over
        the drafts' confidences, every request limited to its drafts, max_tokens and max_model_len. The
        lengths count the decoding requests' verify tokens only (a prefill chunk in the same step is not
        in B)."""
        if self.varlen.times is not None:
            return self._uniform_lengths()
        reqs = [r for r in self.running if r.status is Status.RUNNING and r.num_pending == 1 and r.spec_token_ids
                and not r.siblings]
        if not reqs:
            return {}
        k = self.proposer.num_speculative_tokens
        conf = np.zeros((len(reqs), k))
        limit = np.zeros(len(reqs), dtype=np.int64)
        for i, r in enumerate(reqs):
            c = r.spec_confidence[:k]
            conf[i, :len(c)] = c
            limit[i] = max(0, min(len(r.spec_token_ids), len(c), k, self._room(r)))
        lengths = allocate(self.varlen.confidences(conf), self.varlen.sps, max_len=limit)
        return {r.request_id: int(n) for r, n in zip(reqs, lengths)}

    def _uniform_lengths(self) -> dict[str, int]:
        """One verify length l for every decoding request (spec/schedule.py uniform_length over the measured step
        times), each at most its drafts and room, and whether the step drafts the next block (l > 0). Confidences
        two steps old: a request's own, else the mean of the others' (a greedy request without them reads its fresh
        ones: greedy verification is exact whatever the lengths); none known yet: every request its drafts."""
        self._propose = True
        reqs = [r for r in self.running if r.status is Status.RUNNING and r.num_pending == 1 and not r.siblings]
        k = self.proposer.num_speculative_tokens
        rows = [(r.stale_confidence or (r.spec_confidence if r.params.greedy else []))[:k] for r in reqs]
        known = [np.pad(np.asarray(c, dtype=np.float64), (0, k - len(c))) for c in rows if c]
        if not known:
            self.policy_lengths[-1] += 1
            return {}
        mean = np.mean(known, axis=0)
        conf = np.stack([np.pad(np.asarray(c, dtype=np.float64), (0, k - len(c))) if c else mean for c in rows])
        # the limits leave out the drafts each request holds now: a step after one that drafted nothing still
        # finds the length speculation would take, and turns drafting back on
        limit = np.array([max(0, min(k, self._room(r))) for r in reqs], dtype=np.int64)
        length = uniform_length(self.varlen.confidences(conf), self.varlen.times, max_len=limit)
        self._propose = length > 0
        self.policy_lengths[length] += 1
        return {r.request_id: length for r in reqs}

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(forks=self.pending_forks)
        self.pending_forks = []
        budget = self.budget
        self._lengths = self._varlen_lengths() if self.varlen is not None else {}
        out.propose = self._propose
        preempted = False
        for req in list(self.running):
            if req.status is not Status.RUNNING or budget == 0:
                continue
            n = min(req.num_pending, budget)
            drafts = self._drafts(req, budget)
            while not self.kv.allocate(req, req.num_computed_tokens + n + len(drafts)):
                if drafts:  # speculation never preempts another request: verify without drafts
                    drafts = []
                    continue
                preempted = True
                self._preempt(self.running[-1])
                if req.status is not Status.RUNNING:
                    break
            if req.status is Status.RUNNING:
                out.chunks.append(self._chunk(req, n, drafts))
                budget -= n + len(drafts)
        if any(not _admissible(r) for r in self.waiting_grammars):
            for req in [r for r in self.waiting if not _admissible(r)]:
                self.waiting.remove(req)  # compiling: queued behind the rest until its grammar is ready
                self.waiting.append(req)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            if not _admissible(req):
                break  # (only requests still compiling, or whose compile failed, are left)
            n = min(req.num_pending, budget)
            if not self.kv.allocate(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.waiting_grammars.discard(req)
            req.status = Status.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, n))
            budget -= n
        if out.chunks:
            out.decode = self._decode_rows(out.chunks)
        return out

    def schedule_ahead(self, inflight: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling: the next step, planned while `inflight` (not yet updated) runs. Every
        request of `inflight` that samples one token and cannot finish by length there gets one
        decode token, a PLACEHOLDER for the token it is sampling now. Returns None (the caller runs
        the next step synchronously) where looking ahead would change scheduling decisions:
        n > 1 forks, partial prefill chunks, requests waiting that could be admitted, a cache
        that cannot grow every such request without preempting. With a proposer, while `inflight` drafts, the
        next step is a verify step scheduled ahead where _verify_ahead allows one (else None); while the graphs'
        verify-length policy has speculation off, a decode step as above. A request that finishes in
        `inflight` by a stop token computes one wasted token here; `update` drops it."""
        if self.pending_forks or not inflight.chunks or (self.waiting and len(self.running) < self.max_num_seqs):
            return None
        if not self._ahead_with_proposer(inflight):
            return self._verify_ahead(inflight)
        by_id = {r.request_id: r for r in self.running}
        if any(c.num_samples != 1 or c.request_id not in by_id for c in inflight.chunks):
            return None
        out = SchedulerOutput()
        chunks, allocate, max_len = out.chunks, self.kv.allocate, self.max_model_len
        # a pure-decode `inflight`: which of its requests cross a block boundary (the others' allocate is a no-op)
        crossing = None if inflight.decode is None else self.kv.crossing(inflight.decode.slots,
                                                                         inflight.decode.positions + 2)
        slots, starts = [], []
        for b, c in enumerate(inflight.chunks):
            req = by_id[c.request_id]
            n_out = len(req.output_token_ids)
            if n_out + 1 >= req.params.max_tokens or len(req.prompt_token_ids) + n_out + 1 >= max_len:
                continue  # it finishes by length in `inflight`
            # (the step before `inflight` is updated: its computed tokens are `inflight`'s start, which the chunk
            # holds only as the earliest one where `inflight` was a verify step scheduled ahead)
            start = req.num_computed_tokens + len(c.token_ids)
            if (crossing is None or crossing[b]) and not allocate(req, start + 1):
                return None
            # the tables' lists are shared, not copied: blocks are only ever appended to them, and entries
            # past this chunk's are never read by its plan
            chunks.append(ScheduledChunk(req.request_id, req.slot, start, [PLACEHOLDER], dict(req.block_tables), 1,
                                         req.params, [], start + 1, sample_index=req.sample_index,
                                         grammar=req.grammar, prompt_len=len(req.prompt_token_ids)))
            slots.append(req.slot)
            starts.append(start)
        if not chunks:
            return None
        if self.proposer is not None:  # the policy again: where drafts pay now, drafting resumes in a step
            self._uniform_lengths()    # scheduled once this one's tokens are known
            if self._propose:
                return None
            out.propose = False
        n = len(chunks)
        out.decode = self._rows(np.full(n, PLACEHOLDER, dtype=np.int64), np.array(slots, dtype=np.int64),
                                np.array(starts, dtype=np.int64))
        return out

    def _verify_ahead(self, inflight: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling with DSpark: the next verify step, planned while `inflight` (which drafts) runs. Each
        of its requests verifies the drafts `inflight` proposes after the token it emits last, at a start the host
        does not know: the chunk's `start` is the earliest one (no draft accepted in `inflight`); the runner adds
        the accepted count and takes the tokens on the device (SchedulerOutput.verify_ahead). Every request
        verifies k drafts, or with the graphs' verify-length policy one length l (l = 0: the pending token alone,
        drafting nothing). The cache grows to the latest end. None (a synchronous step) where the drafts or the
        emitted tokens matter on the host first: a grammar, seeded sampling, n > 1, prompt logprobs, per-request
        lengths (Alg. 1), or a request that could reach max_model_len; a request that finishes by length in
        `inflight` for sure is left out, one that finishes there otherwise computes a wasted step (`update` drops
        it), and tokens past max_tokens are dropped as they are appended."""
        k = self.proposer.num_speculative_tokens if isinstance(self.proposer, ModelDrafts) else 0
        if not k or self.proposer.method != "dspark" or not inflight.propose:
            return None
        length, propose = k, True
        if self.varlen is not None:  # the graphs' policy: one length a step, from confidences two steps old
            if self.varlen.times is None:
                return None  # (per-request lengths, Alg. 1: eager steps)
            length = max(self._uniform_lengths().values(), default=k)  # (none known yet: every request k)
            propose = self._propose
        by_id = {r.request_id: r for r in self.running}
        out = SchedulerOutput(verify_ahead=True, propose=propose)
        for c in inflight.chunks:
            req = by_id.get(c.request_id)
            if req is None or c.num_samples != 1 or len(c.token_ids) != 1 + c.num_draft or req.grammar is not None \
                    or req.params.seq_seed is not None or req.prompt_logprobs is not None or req.siblings:
                return None
            n_out = len(req.output_token_ids)
            if n_out + 1 >= req.params.max_tokens:
                continue  # it finishes by length in `inflight`
            start = req.num_computed_tokens + 1  # (updated up to the step before `inflight`, whose start it is)
            latest = start + c.num_draft + length + 1  # past the last position the step may compute
            if latest + 1 >= self.max_model_len or not self.kv.allocate(req, latest):
                return None
            out.chunks.append(ScheduledChunk(req.request_id, req.slot, start, [PLACEHOLDER] * (length + 1),
                                             dict(req.block_tables), 1, req.params, [], start + 1,
                                             sample_index=req.sample_index, num_draft=length,
                                             prompt_len=len(req.prompt_token_ids)))
        if not out.chunks or len(out.chunks) * (length + 1) > self.budget:
            return None
        return out

    def _ahead_with_proposer(self, inflight: SchedulerOutput) -> bool:
        """Without a proposer, always; with one, only while the graphs' verify-length policy has turned
        speculation off: `inflight` verifies no drafts and drafts none, so the next step has none either."""
        return self.proposer is None or (self.varlen is not None and self.varlen.times is not None and
                                         not inflight.propose and not any(c.num_draft for c in inflight.chunks))

    def _decode_rows(self, chunks: list[ScheduledChunk]) -> DecodeRows | None:
        """The step's DecodeRows when every chunk is one token sampled once (else None): the chunks' tables
        are the cache manager's rows for their slots, copied here (the step may run after they grow)."""
        if not all(len(c.token_ids) == 1 and c.num_samples == 1 and not c.num_draft for c in chunks):
            return None
        n = len(chunks)
        return self._rows(np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=n),
                          np.fromiter((c.slot for c in chunks), dtype=np.int64, count=n),
                          np.fromiter((c.start for c in chunks), dtype=np.int64, count=n))

    def _rows(self, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> DecodeRows:
        """DecodeRows with the cache manager's table rows of these slots (cut to the longest: a step travels to
        every rank of a parallel engine)."""
        return DecodeRows(tokens, slots, positions, *self.kv.table_rows(slots))

    def update(self, so: SchedulerOutput, mo: ModelOutput) -> list[Request]:
        """Advance counters, append sampled tokens, finish on token-level stops. Returns the
        requests that received tokens (stop strings are checked by the caller on those).
        A chunk whose request finished while it ran (scheduled ahead) is dropped."""
        by_id = {r.request_id: r for r in self.running}
        touched = []
        for c in so.chunks:
            req = by_id.get(c.request_id)
            if req is None:
                continue
            req.num_computed_tokens += len(c.token_ids) - c.num_draft
            if c.request_id in mo.prompt_logprobs and req.prompt_logprobs is not None:
                first, lps = mo.prompt_logprobs[c.request_id]
                req.prompt_logprobs[first:first + len(lps)] = lps
                if req.prompt_logprob_ranks is not None and c.request_id in mo.prompt_ranks:
                    req.prompt_logprob_ranks[first:first + len(lps)] = mo.prompt_ranks[c.request_id]
            if c.num_samples == 0:
                continue
            toks = mo.sampled[c.request_id]
            lps = mo.logprobs.get(c.request_id) or [None] * len(toks)
            if mo.drafts or req.spec_token_ids:  # (steady decode without a proposer: nothing to reset)
                req.spec_token_ids = mo.drafts.get(c.request_id, [])
            if mo.draft_confidence or req.spec_confidence:
                if req.spec_confidence:
                    req.stale_confidence = req.spec_confidence
                req.spec_confidence = mo.draft_confidence.get(c.request_id, [])
            if c.num_draft:  # accepted drafts, then the target's token: appended until the request stops
                accepted = len(toks) - 1
                req.num_computed_tokens += accepted
                # a step scheduled ahead verified k drafts whatever the request's room: its counters take the
                # drafts a synchronous step would have verified (cut to the room; draft j is accepted only with
                # the ones before it, so the accepted count is cut the same way)
                drafted = c.num_draft if c.token_ids[0] != PLACEHOLDER else min(c.num_draft, max(self._room(req), 0))
                self.spec_stats.record(drafted, min(accepted, drafted))
                if self.spec_log is not None and c.request_id in self._verifying:
                    self.spec_log.append((self._verifying.pop(c.request_id), c.num_draft, accepted))
                for tok, lp in zip(toks, lps):
                    self._append(req, tok, lp)
                    if req.finished:
                        break
                touched.append(req)
                continue
            if req.siblings:
                for sib, tok, lp in zip(req.siblings, toks[1:], lps[1:]):
                    if req.grammar is not None:  # the leader's state before its own token
                        sib.grammar = req.grammar.fork()
                    self._start_sibling(req, sib, tok, lp)
                    touched.append(sib)
                req.siblings = []
            self._append(req, toks[0], lps[0])
            touched.append(req)
        return touched

    def _append(self, req: Request, tok: int, lp: dict[int, float] | None) -> None:
        req.output_token_ids.append(tok)
        if lp is not None:
            req.logprobs.append(lp)
        p = req.params
        if req.grammar is not None and not req.grammar.accept(tok):  # the logits were masked: a defect
            req.error = f"structured output: the grammar rejected token {tok}"
            self.finish(req, "abort")
        elif req.grammar is not None and req.grammar.terminated:  # the grammar is complete
            self.finish(req, "stop")
        elif ((not p.ignore_eos and tok == req.eos_token_id) or tok in p.stop_token_ids) and \
                len(req.output_token_ids) > p.min_tokens:  # (the runner masks them before min_tokens outputs)
            self.finish(req, "stop")
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            self.finish(req, "length")

    def _start_sibling(self, leader: Request, sib: Request, tok: int, lp) -> None:
        """Sibling of an n > 1 request: reuse the leader's prompt state if the cache has room,
        else recompute it from the queue like a preempted request."""
        sib.status = Status.WAITING
        if self.kv.allocate(sib, leader.num_computed_tokens):
            self.pending_forks.append(ForkOp(leader.slot, sib.slot, {m: list(t) for m, t in
                                                                      leader.block_tables.items()},
                                             {m: list(t) for m, t in sib.block_tables.items()}))
            sib.num_computed_tokens = leader.num_computed_tokens
            sib.status = Status.RUNNING
            self.running.append(sib)
        else:
            self._enqueue(sib, front=True)
        self._append(sib, tok, lp)

    def abort(self, req: Request, error: str) -> None:
        """Finish `req` and its siblings still waiting on its prefill with reason "abort", freeing
        what they hold; a fork into one of their slots not applied yet is dropped."""
        for r in [req] + req.siblings:
            if r.finished:
                continue
            if r.slot is not None:
                self.pending_forks = [f for f in self.pending_forks if f.dst_slot != r.slot]
            r.error = error
            self.finish(r, "abort")
        req.siblings = []

    def finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.waiting_grammars.discard(req)
        self.kv.free(req)
