"""ModelRunner: owns the model and the cache tensors; SchedulerOutput in, ModelOutput out.

`launch` enqueues a step's GPU work (forward, sampling, the copy of the sampled tokens to pinned
host memory) and returns at once; `collect` waits for that copy. Between the two the engine may
plan and launch the next step, whose decode inputs can be PLACEHOLDER: "the token this request
samples in the step before", filled on the device from that step's sampled tokens.
"""
from __future__ import annotations

import itertools
import operator
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.outputs import PLACEHOLDER, ModelOutput, ScheduledChunk, SchedulerOutput
from deepinfer.kernels.token_bitmask import apply_token_bitmask
from deepinfer.layers import invariant
from deepinfer.models.interface import CausalLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.verify import verify
from deepinfer.state.device_plan import plan_on_device, table_width
from deepinfer.state.forward_batch import FixedShape, SeqChunk, build_forward_batch, to_device
from deepinfer.worker.cuda_graph import fixed_step_logits, visible_widths
from deepinfer.worker.draft_graphs import DraftGraphs
from deepinfer.worker.drafter import Anchors, DraftSampler, DSparkDrafter, MTPDrafter
from deepinfer.worker.kv_cache import V4Cache
from deepinfer.worker.logits_processors import LogitsProcessors, RowPlan
from deepinfer.worker.sampler import SamplingBatch, sample, token_ranks, top_logprobs


@dataclass
class StepHandle:
    """A launched step: rows of `tokens` per request (first row, count), and what collect reads."""

    rows: dict[str, tuple[int, int]]
    tokens: torch.Tensor | None = None        # [R] on the device
    host_tokens: torch.Tensor | None = None   # [R] pinned copy, valid once `done` has run
    done: torch.cuda.Event | None = None
    # (chosen, top values, top ids) on the device, computed at launch in stream order: the logits
    # may live in a CUDA graph's output buffer, which the next replay overwrites before collect
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    params: list | None = None
    max_logprobs: int = -1
    # a verify step (worker/verify.py): tokens hold each verify group's emitted tokens at offsets[g] ..;
    # groups[request id] its groups (a verify chunk: one; an n > 1 fork: n of one row); the host copy
    # holds the tokens, then each group's accepted count, then the drafts and their confidences
    offsets: list[int] | None = None
    groups: dict[str, list[int]] | None = None
    drafts: dict[str, int] | None = None  # request id -> its row of the next step's drafts (a drafter's)
    draft_width: int = 0
    # (SchedulerOutput, logits, rows) of a step launched ahead whose structured-output masks wait for the
    # step before it (ModelRunner.complete samples it)
    deferred: tuple | None = None
    # prompt_logprobs of the step's chunks with prompt_rows, computed at launch (see _prompt_logprobs)
    prompt: "PromptLogprobs | None" = None
    # a drafting step: per anchor (`drafts`' rows) the token it emitted last and its drafts [G, 1 + k], and its
    # accepted count [G], on the device: the inputs of a verify step scheduled ahead of this one's read-back
    next_inputs: torch.Tensor | None = None
    next_shift: torch.Tensor | None = None


@dataclass
class PromptLogprobs:
    """The step's prompt rows: spans[i] = (request id, first position, rows, top-k) in row order; targets the
    prompt token each row predicts; top = (their logprobs [N], top-k values [N, k], top-k ids [N, k]) and ranks [N]
    (each prompt token's rank in the whole vocabulary) on the device."""

    spans: list[tuple[str, int, int, int]]
    targets: list[int]
    top: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ranks: torch.Tensor


GREEDY = SamplingParams(temperature=0)  # the drafter's parameters for a row it does not sample
# images whose embeddings are kept between the chunks of a prompt (most recent first out)
IMAGE_CACHE_SIZE = 32
# prompt_logprobs: rows whose full-vocabulary logits are materialised at once (1024 x 129280 fp32: 0.5 GB)
PROMPT_LOGPROBS_ROWS = 1024


# the most step graphs captured at start-up (shortest contexts first); the rest at their first step
START_GRAPHS = 384


def _no_step_before(request_id: str) -> ValueError:
    return ValueError(f"request {request_id}: placeholder input without a step before it")


class ModelRunner:
    def __init__(self, model: CausalLM, cache: V4Cache, device: torch.device | str, seed: int | None = None,
                 replay_keep: int | None = None, cuda_graphs: bool = True, batch_invariant: bool = False,
                 drafter: DSparkDrafter | MTPDrafter | None = None):
        """`replay_keep`: SWA bounded replay keeps each request's last `replay_keep` rows above the
        model's replay layer (None = exact prefill, or a model without one). `cuda_graphs`: replay
        decode and verify steps as CUDA graphs where the model allows it (see _graphs_for and _graph_width).
        `drafter`: the model's own draft layers (worker/drafter.py) propose the next step's tokens after every
        step's verification."""
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.batch_invariant = batch_invariant
        if not isinstance(model, CausalLM):
            raise TypeError(f"{type(model).__name__} does not implement models/interface.py CausalLM")
        self.replay_keep = replay_keep if model.replay_layer >= 0 else None
        self.drafter = drafter
        # graphs take decode and verify steps; a drafter runs in them when it stores its context from the step's
        # features (DSpark); V4's MTP layer, which runs over the step's host-planned rows, keeps steps eager
        graphed = drafter is None or isinstance(drafter, DSparkDrafter)
        self.graphs = _graphs_for(model, cache, self.device, drafter) if cuda_graphs and graphed else None
        if self.graphs is not None and drafter is not None:
            drafter.graphs = DraftGraphs(drafter.draft, cache.scratch_slot, self.device)
        self.eager_steps: Counter[str] = Counter()  # speculative steps the graphs could not take, by reason
        self.ahead_steps = 0  # verify steps scheduled ahead (_verify_ahead)
        # (request id, span start) -> the span's embeddings, kept until the span's last token is computed
        self.image_cache: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
        self._masks: torch.Tensor | None = None  # structured outputs: host token masks (see _constrain)
        self._masks_sent: torch.cuda.Event | None = None
        self._sb_cache: tuple | None = None  # (vocab, params, SamplingBatch) of the last sampled step
        # penalties, logit bias, min_tokens, bad words, allowed tokens (and the token history some of them read)
        self.procs = LogitsProcessors(cache.num_slots, model.config.vocab_size, self.device,
                                      getattr(model.config, "eos_token_id", None))
        # (q [G, k, V], request id -> its row) of the drafts the last step drew from the drafter's distribution
        self._draft_q: tuple[torch.Tensor, dict[str, int]] | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed if seed is not None else torch.seed())

    def capture_speculative(self, max_batch: int, k: int, max_position: int, limit: int = START_GRAPHS) -> int:
        """Captures the graphs of speculative steps before any request runs (decode graphs.capture_steps at every
        q = 1 .. k + 1 the graphs take, then the drafter's block per anchor bucket). -> the graphs captured."""
        if self.graphs is None:
            return 0
        widths = [q for q in range(1, k + 2) if q <= self.cache.ring_slack + 1]
        # DSpark at fixed length launches verify steps ahead, planned on the device (_verify_ahead)
        planned = [k + 1] if isinstance(self.drafter, DSparkDrafter) and k + 1 in widths else []
        # (in the runner's numerics mode, as its steps: a graph replays the kernels it was captured with)
        with torch.inference_mode(), invariant.mode(self.batch_invariant):
            n = self.graphs.capture_steps(max_batch, widths, max_position + k, limit, planned)
            drafts = getattr(self.drafter, "graphs", None)
            return n + (drafts.capture_buckets(max_batch) if drafts is not None else 0)

    @property
    def supports_placeholders(self) -> bool:
        """Placeholder inputs need every token-dependent input on the device (no host n-gram hashing)."""
        return not self.model.host_inputs

    def _history(self) -> tuple[int, int]:
        """(host window width, device history width) for build_forward_batch."""
        n = self.model.token_history
        return (n, 0) if self.model.host_inputs else (0, n)

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        return self.collect(self.launch(so))

    def _fill(self, so: SchedulerOutput, prev: StepHandle | None):
        """(flat token rows, device values) replacing this step's PLACEHOLDER inputs, or None."""
        if so.decode is not None:  # one token a chunk: the placeholder rows are the array's
            return self._fill_rows(so, prev)
        dst, src, off = [], [], 0
        for c in so.chunks:
            ids = c.token_ids
            if PLACEHOLDER in ids:  # (a C-level scan: most chunks have none)
                for j, t in enumerate(ids):
                    if t == PLACEHOLDER:
                        if prev is None or c.request_id not in prev.rows:
                            raise _no_step_before(c.request_id)
                        dst.append(off + j)
                        src.append(prev.rows[c.request_id][0])
            off += len(ids)
        if not dst:
            return None
        self._check_placeholders()
        to = lambda xs: to_device(torch.tensor(xs, dtype=torch.long), self.device)  # noqa: E731
        return to(dst), prev.tokens[to(src)]

    def _check_placeholders(self) -> None:
        if not self.supports_placeholders:
            raise ValueError("this model hashes input tokens on the host: placeholder inputs are not supported")

    def _fill_rows(self, so: SchedulerOutput, prev: StepHandle | None):
        """_fill for a step with DecodeRows: row b's input is chunk b's only token."""
        dst = np.flatnonzero(so.decode.tokens == PLACEHOLDER)
        if not dst.size:
            return None
        rows = {} if prev is None else prev.rows
        chunks = so.chunks
        try:
            src = [rows[chunks[b].request_id][0] for b in dst.tolist()]
        except KeyError as e:
            raise _no_step_before(e.args[0]) from None
        self._check_placeholders()
        both = to_device(torch.from_numpy(np.stack((dst, np.asarray(src, dtype=np.int64)))), self.device)
        return both[0], prev.tokens[both[1]]

    def replay_from(self, c) -> int:
        """The first position of chunk `c`'s request that goes past the last KV source (SWA bounded replay;
        0: every row does). A chunk with prompt rows is prefilled exactly: each of its rows needs every layer."""
        keep = self.replay_keep
        return 0 if keep is None or c.prompt_rows else max(0, c.num_tokens - keep)

    def launch(self, so: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        with invariant.mode(self.batch_invariant):
            return self._launch(so, prev)

    @torch.inference_mode()
    def _launch(self, so: SchedulerOutput, prev: StepHandle | None) -> StepHandle:
        for f in so.forks:
            self.cache.copy_state(f.src_slot, f.dst_slot, f.src_blocks, f.dst_blocks)
        self.procs.observe(so)
        if so.verify_ahead:
            return self._verify_ahead(so, prev)
        fill = self._fill(so, prev)
        speculative = self._verifies(so)
        if not speculative and self.graphs is not None and self.graphs.fits(len(so.chunks)) and \
                all(len(c.token_ids) == 1 and not c.images and not c.prompt_rows for c in so.chunks):
            if so.decode is not None:  # planned from the scheduler's arrays
                logits = self.graphs.run_rows(so.decode, fill)
            else:
                logits = self.graphs.run([SeqChunk(c.slot, c.start, c.token_ids, c.block_tables) for c in so.chunks], fill)
            return self._sample_or_defer(so, logits, list(range(len(so.chunks))), prev)
        if speculative:
            q = self._graph_width(so, fill)
            if q:
                logits = self.graphs.run([SeqChunk(c.slot, c.start, c.token_ids + [0] * (q - len(c.token_ids)),
                                                   self._cover(c, q)) for c in so.chunks], fill)
                starts = [i * q for i in range(len(so.chunks))]
                return self._verify(so, range(len(so.chunks)), logits.__getitem__, starts)
        chunks = [SeqChunk(c.slot, c.start, c.token_ids, c.block_tables, c.prev_tokens, self.replay_from(c),
                           [(s0, img.num_tokens) for s0, img in c.images]) for c in so.chunks]
        host_w, dev_w = self._history()
        batch = build_forward_batch(chunks, self.model.config.sliding_window, self.cache.compress_kinds,
                                    self.cache.block_size, self.device, host_w, device_history=dev_w,
                                    ring_slack=self.cache.ring_slack)
        batch.input_embeds = self._image_embeds(so)
        if fill is not None:
            batch.input_ids[fill[0]] = fill[1]
            if batch.replay is not None:  # its sub-batches hold copies of the kept rows' ids
                for sub in (batch.replay.at_layer, batch.replay.upper):
                    sub.input_ids = batch.input_ids[batch.replay.rows]
        features = None
        if self.drafter is not None and self.drafter.needs_features:
            streams, features = self.model(batch, self.cache.layers, draft_features=True,
                                           token_history=self.cache.token_history)
        else:
            streams = self.model(batch, self.cache.layers, token_history=self.cache.token_history)
        if self.drafter is not None:
            self.drafter.observe(so.chunks, batch, streams, features)
        h = self._sample_streams(so, batch, streams, prev)
        # verification and the drafter (observe, propose) read the streams and never write them: the prompt rows
        # read here are speculation-off's (tests/worker/test_prompt_logprobs_spec.py: bit-identical, invariant mode)
        if any(c.prompt_rows for c in so.chunks):
            h.prompt = self._prompt_logprobs(so, streams)
        return h

    def _verify_ahead(self, so: SchedulerOutput, prev: StepHandle) -> StepHandle:
        """A verify step launched before `prev` (the step in flight, which drafts) is read back (engine/scheduler.py
        _verify_ahead): request b's tokens are the token `prev` emits last and the drafts it proposes after it, its
        start the chunk's plus `prev`'s accepted count, both taken on the device; the step is planned there
        (state/device_plan.py), on a graph where the runner has them."""
        chunks, dev = so.chunks, self.device
        B, q = len(chunks), len(chunks[0].token_ids)
        self.ahead_steps += 1
        if prev is None or prev.next_inputs is None or prev.next_inputs.shape[1] < q:
            raise RuntimeError("a verify step scheduled ahead needs the step before it to have drafted its tokens")
        idx = to_device(torch.tensor([prev.drafts[c.request_id] for c in chunks]), dev)
        tokens = prev.next_inputs[idx, :q]  # (the token emitted last and the first q - 1 drafts)
        shift = prev.next_shift[idx]
        starts = to_device(torch.tensor([c.start for c in chunks]), dev) + shift
        # the furthest position: every draft of `prev` accepted (at most q - 1), then this step's q tokens
        furthest = max(c.start for c in chunks) + 2 * (q - 1)
        visible = self.graphs.visible(furthest) if self.graphs is not None else \
            visible_widths(furthest, self.cache.scratch_addr)
        tables = self._planned_tables(chunks, visible)
        if self.graphs is not None and self.graphs.fits(B):
            logits = self.graphs.run_planned(tokens, starts, [c.slot for c in chunks], tables, visible)
        else:
            t = {m: to_device(torch.from_numpy(v), dev) for m, v in tables.items()}
            batch = plan_on_device(tokens.reshape(-1), starts, to_device(torch.tensor([c.slot for c in chunks]), dev),
                                   t, q, self.model.config.sliding_window, self.cache.compress_kinds,
                                   self.cache.block_size, FixedShape(self.cache.scratch_addr, visible),
                                   self.model.token_history, self.cache.ring_slack)
            drafter = self.drafter if isinstance(self.drafter, DSparkDrafter) else None
            logits = fixed_step_logits(self.model, self.cache, drafter, batch)
        return self._verify(so, range(B), logits.__getitem__, [i * q for i in range(B)],
                            ahead=(tokens[:, 1:].reshape(-1), shift))

    def _planned_tables(self, chunks: list[ScheduledChunk], visible: dict[int, int]) -> dict[int, np.ndarray]:
        """Each ratio's [B, table_width] block tables of the chunks, the scratch block past each one's end (the
        entries a step may close past its blocks are written there and never read)."""
        bs, out = self.cache.block_size, {}
        for m, a in self.cache.scratch_addr.items():
            w = table_width(visible[m], bs)
            t = out[m] = np.full((len(chunks), w), a // bs, dtype=np.int64)
            for b, c in enumerate(chunks):
                blocks = c.block_tables.get(m, ())[:w]
                t[b, :len(blocks)] = blocks
        return out

    def _verifies(self, so: SchedulerOutput) -> bool:
        """Whether the step goes through verification: it holds drafts, or its drafter proposes the next ones.
        A step that does neither samples as without speculation (a drafter's observe still runs: in the graphs,
        or before sampling)."""
        if self.drafter is not None and (so.propose or not self.drafter.optional):
            return True
        # (a step with DecodeRows holds no drafts: the decode hot path skips the scan)
        return so.decode is None and any(c.num_draft for c in so.chunks)

    def _sample_streams(self, so: SchedulerOutput, batch, streams: torch.Tensor,
                        prev: StepHandle | None) -> StepHandle:
        """Samples (or verifies) the chunks that ask for it from the forward's final states [T, ...]."""
        rows = [i for i, c in enumerate(so.chunks) if c.num_samples]
        if not rows:
            if self.drafter is not None:  # (the MTP layer still runs over the step's rows)
                empty = torch.zeros(0, dtype=torch.long, device=self.device)
                self.drafter.propose(Anchors(empty, empty, empty, empty))
            return StepHandle({})
        if self._verifies(so):
            starts = list(itertools.accumulate((len(c.token_ids) for c in so.chunks), initial=0))
            return self._verify(so, rows, lambda idx: self.model.compute_logits(streams[idx]), starts)
        last = batch.logits_idx[torch.tensor(rows, device=self.device)]
        return self._sample_or_defer(so, self.model.compute_logits(streams[last]), rows, prev)

    def _prompt_logprobs(self, so: SchedulerOutput, streams: torch.Tensor) -> PromptLogprobs:
        """Raw-model logprobs (as the sampler's logits, before temperature, penalties or grammar masks) of the
        prompt tokens each chunk's prompt rows predict: row j of a chunk predicts its position start + j + 1,
        the chunk's next token for its last row. The head runs on PROMPT_LOGPROBS_ROWS rows at a time, apart
        from the sampled rows' (their logits, and every other request's, are computed as without this)."""
        rows, targets, spans, off = [], [], [], 0
        for c in so.chunks:
            if c.prompt_rows:
                rows += range(off, off + c.prompt_rows)
                targets += (c.token_ids + [c.next_token])[1:c.prompt_rows + 1]
                spans.append((c.request_id, c.start + 1, c.prompt_rows, c.params.prompt_logprobs))
            off += len(c.token_ids)
        k = max(s[3] for s in spans)
        idx = to_device(torch.tensor(rows, dtype=torch.long), self.device)
        tgt = to_device(torch.tensor(targets, dtype=torch.long), self.device)
        parts = []
        for i in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            j = slice(i, i + PROMPT_LOGPROBS_ROWS)
            logits, t = self.model.compute_logits(streams[idx[j]]), tgt[j]
            parts.append((*top_logprobs(logits, t, k), token_ranks(logits, t)))
        *top, ranks = (torch.cat(t) for t in zip(*parts))
        return PromptLogprobs(spans, targets, tuple(top), ranks)

    def _sample_or_defer(self, so: SchedulerOutput, logits: torch.Tensor, rows: list[int],
                         prev: StepHandle | None) -> StepHandle:
        """A step launched ahead (`prev` in flight) with structured-output rows cannot sample yet: their
        masks need the tokens `prev` is sampling. Its forward is enqueued; `complete` samples once the
        engine has collected `prev` and advanced the grammars."""
        if prev is not None and any(c.grammar is not None for c in so.chunks if c.num_samples):
            return StepHandle({}, deferred=(so, logits, rows))
        return self._sample(so, logits, rows)

    def complete(self, h: StepHandle) -> None:
        """Samples a deferred step (see _sample_or_defer) into `h`; a no-op for any other step."""
        if h.deferred is None:
            return
        (so, logits, rows), h.deferred = h.deferred, None
        with torch.inference_mode(), invariant.mode(self.batch_invariant):
            done = self._sample(so, logits, rows)
        for f in ("rows", "tokens", "host_tokens", "done", "logprobs", "params", "max_logprobs"):
            setattr(h, f, getattr(done, f))

    def _sample(self, so: SchedulerOutput, logits: torch.Tensor, rows: list[int]) -> StepHandle:
        """logits [len(rows), V] of the chunks `rows` (in order); samples where chunks ask for it,
        and starts the copy of the tokens to the host (no sync here)."""
        keep = [k for k, i in enumerate(rows) if so.chunks[i].num_samples]
        sampled = [so.chunks[rows[k]] for k in keep]
        if not sampled:
            return StepHandle({})
        if len(keep) < len(rows):
            logits = logits[to_device(torch.tensor(keep), self.device)]
        # a request forking into n siblings draws n tokens from its one last-position distribution
        # (rows repeated by a host-built index: repeat_interleave with device counts would sync)
        if any(c.num_samples > 1 for c in sampled):
            rep = [k for k, c in enumerate(sampled) for _ in range(c.num_samples)]
            logits = logits[to_device(torch.tensor(rep), self.device)]
        params = [c.params for c in sampled for _ in range(c.num_samples)]
        if any(c.grammar is not None for c in sampled):  # an n > 1 fork's rows share its one state
            logits = self._constrain(logits, [(k, c.num_samples, c.grammar, ()) for k, c in
                                              zip(itertools.accumulate([0] + [c.num_samples for c in sampled]), sampled)
                                              if c.grammar is not None])
        # seeded rows draw from a generator keyed by (seq_seed, position sampled, sample index)
        seeds = [None if c.params.seq_seed is None else (c.params.seq_seed, c.start + len(c.token_ids), c.sample_index + j)
                 for c in sampled for j in range(c.num_samples)]
        sb = self._sampling_batch(params, logits.shape[-1], seeds)
        processed = logits
        if any(p.processes_logits for p in params):
            processed = self.procs.apply(logits, RowPlan.sampled(params, [c.slot for c in sampled
                                                                          for _ in range(c.num_samples)]))
        tokens = sample(processed, sb, self.generator)
        row_of, i = {}, 0
        for c in sampled:
            row_of[c.request_id] = (i, c.num_samples)
            i += c.num_samples
        # a fork's leader keeps the first of its rows (its siblings start from theirs: LogitsProcessors.observe)
        tracked = [(row_of[c.request_id][0], c.slot) for c in sampled if c.params.needs_history]
        if tracked:
            self.procs.record(tokens, *map(list, zip(*tracked)))
        h = StepHandle(row_of, tokens, params=params, max_logprobs=sb.max_logprobs,
                       logprobs=top_logprobs(logits, tokens, sb.max_logprobs) if sb.max_logprobs >= 0 else None)
        return _copy_to_host(h, tokens)

    def _sampling_batch(self, params: list, vocab: int, seeds: list) -> SamplingBatch:
        """SamplingBatch.build, reused while steps sample the very same SamplingParams objects in the same order
        and no row is seeded (decode's steady state). The cache holds the params list, so no id in its key can be
        reused by another object while it is cached; its device tensors are only ever read."""
        if any(k is not None for k in seeds):
            return SamplingBatch.build(params, vocab, self.device, seeds)
        cached = self._sb_cache
        if cached is not None and cached[0] == vocab and len(cached[1]) == len(params) and \
                all(map(operator.is_, cached[1], params)):
            return cached[2]
        sb = SamplingBatch.build(params, vocab, self.device, seeds)
        self._sb_cache = (vocab, params, sb)
        return sb

    def _graph_width(self, so: SchedulerOutput, fill) -> int:
        """q, the tokens per request of the graph that takes this speculative step (each chunk padded to q with
        token 0 past its drafts), or 0: the step runs eagerly (counted in `eager_steps` by reason). Graphs take
        steps whose chunks are all one pending token and its drafts, sampled once; a padded chunk's extra
        positions are computed and never read (as rejected drafts: within the ring slack, q - 1 <= the drafter's
        k; entries past its block tables go to the scratch block, `_cover`). Placeholder inputs index the
        unpadded rows: only at q = 1."""
        chunks = so.chunks
        if self.graphs is None or not chunks:
            return 0
        if not self.graphs.fits(len(chunks)):
            return self._eager("batch past the largest graph")
        if not all(c.num_samples == 1 and len(c.token_ids) == 1 + c.num_draft and not c.images
                   and not c.prompt_rows for c in chunks):
            return self._eager("prefill, n > 1 or prompt logprobs")
        q = max(len(c.token_ids) for c in chunks)
        if q > self.cache.ring_slack + 1:
            return self._eager("drafts past the ring slack")
        if fill is not None and q > 1:
            return self._eager("placeholder inputs")
        return q

    def _eager(self, reason: str) -> int:
        self.eager_steps[reason] += 1
        return 0

    def _cover(self, c: ScheduledChunk, q: int) -> dict[int, list[int]]:
        """c's block tables, extended with the cache's scratch block where they end before the entries its
        padding to q tokens closes (those entries are written and never read)."""
        bs, end, tables = self.cache.block_size, c.start + q, c.block_tables
        for m, _ in self.cache.compress_kinds:
            have = tables.get(m, [])
            need = -(-(end // m) // bs)
            if len(have) < need:
                tables = {**tables, m: list(have) + [self.cache.scratch_addr[m] // bs] * (need - len(have))}
        return tables

    def _verify(self, so: SchedulerOutput, rows, logits_at, starts: list[int],
                ahead: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepHandle:
        """A step with draft tokens: the logits of every verified position, one worker/verify.py call over
        all sampled chunks (a chunk without drafts is a group of one row, which verify samples exactly as
        `sample` would; an n > 1 fork is n such groups of its last row), the copy to the host started.
        `logits_at(flat rows on the device)` gives those rows' logits; chunk i's tokens are the flat rows
        starts[i] .. starts[i] + len(token_ids) - 1. `ahead` = (the drafts [rows * k], each chunk's shift [rows]) on
        the device, of a verify step scheduled ahead (its token ids are placeholders, its starts the earliest)."""
        flat, offsets, drafts, params, seeds, groups = [], [0], [], [], [], {}
        ends = [starts[i] + len(c.token_ids) for i, c in enumerate(so.chunks)]
        for i in rows:
            c = so.chunks[i]
            k, last = c.num_draft, ends[i] - 1
            pos = c.start + len(c.token_ids) - k  # the position the first verified row samples
            for j in range(1 if k else c.num_samples):
                groups.setdefault(c.request_id, []).append(len(offsets) - 1)
                flat += range(last - k, last + 1)
                offsets.append(offsets[-1] + k + 1)
                if ahead is None:
                    drafts += c.token_ids[len(c.token_ids) - k:]
                params.append(c.params)
                seeds.append(None if c.params.seq_seed is None else (c.params.seq_seed, pos, c.sample_index + j))
        logits = logits_at(to_device(torch.tensor(flat), self.device))
        draft_t = to_device(torch.tensor(drafts, dtype=torch.long), self.device) if ahead is None else ahead[0]
        constrained = [(offsets[g], offsets[g + 1] - offsets[g], so.chunks[i].grammar,
                        so.chunks[i].token_ids[len(so.chunks[i].token_ids) - so.chunks[i].num_draft:])
                       for i in rows if so.chunks[i].grammar is not None for g in groups[so.chunks[i].request_id]]
        if constrained:  # a verify row's mask follows the drafts before it (the scheduler kept them in the grammar)
            logits = self._constrain(logits, constrained)
        processed = logits  # (on a copy: the logprobs are the model's, as in _sample)
        if any(p.processes_logits for p in params):
            processed = self.procs.apply(logits, self._verify_plan(so, rows, groups, offsets), draft_t)
        # a seeded request verifies by matching the target's own draw at each position (its tokens are
        # speculation-off's); the others take rejection sampling against q: one-hot for deterministic drafts
        # (prompt lookup, greedy DSpark / MTP), DSpark's own distribution for the drafts it drew (_draft_sampler)
        out = verify(processed, offsets, draft_t, params, draft_probs=self._draft_probs(so, rows, draft_t), seeds=seeds,
                     generator=self.generator, match_seeded=True)
        row_params = [p for g, p in enumerate(params) for _ in range(offsets[g + 1] - offsets[g])]
        max_lp = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
        h = StepHandle({}, out.tokens, params=row_params, max_logprobs=max_lp, offsets=offsets, groups=groups,
                       logprobs=top_logprobs(logits, out.tokens.clamp(min=0), max_lp) if max_lp >= 0 else None)
        tracked = [(offsets[gs[0]], offsets[gs[0] + 1] - offsets[gs[0]], c.slot) for c in (so.chunks[i] for i in rows)
                   if c.params.needs_history for gs in (groups[c.request_id],)]
        if tracked:  # (a fork's leader keeps its first group, as in _sample)
            self.procs.record_verified(out.tokens, tracked)
        values = [out.tokens, out.num_accepted]
        if self.drafter is not None and (so.propose or not self.drafter.optional):
            values.append(self._draft(so, rows, ends, out, h, None if ahead is None else ahead[1]))
        # a request verified with no drafts, sampled once, can be the source of a placeholder in the step after
        h.rows = {rid: (h.offsets[gs[0]], 1) for rid, gs in groups.items() if len(gs) == 1 and
                  h.offsets[gs[0] + 1] - h.offsets[gs[0]] == 1}
        return _copy_to_host(h, torch.cat(values))

    @staticmethod
    def _verify_plan(so: SchedulerOutput, rows, groups: dict[str, list[int]], offsets: list[int]) -> RowPlan:
        """_verify's logits rows for LogitsProcessors: group g's row j follows j drafts, which start at
        offsets[g] - g in the step's flattened drafts."""
        plan = RowPlan([], [], [], [])
        for i in rows:
            c = so.chunks[i]
            for g in groups[c.request_id]:
                n = offsets[g + 1] - offsets[g]
                plan.params += [c.params] * n
                plan.slots += [c.slot] * n
                plan.depths += range(n)
                plan.draft_starts += [offsets[g] - g] * n
        return plan

    def _constrain(self, logits: torch.Tensor, groups: list[tuple[int, int, object, list[int]]]) -> torch.Tensor:
        """Structured outputs: logits [R, V] with -inf where a grammar forbids the token. `groups`: (first row,
        rows, grammar, drafts): row j of a group takes the grammar's mask after drafts[:j] (no drafts: every
        row the grammar's next-token mask). The masks are filled on the host (while the device runs the
        forward), sent in one copy, applied in one launch; other rows allow everything."""
        host = self._mask_rows(logits.shape[0], -(-logits.shape[-1] // 32), logits.is_cuda)
        first: dict[int, tuple[int, object]] = {}  # grammar -> (its row, it): an n > 1 fork's groups share one
        for r0, _, grammar, drafts in groups:
            if not drafts:
                first.setdefault(id(grammar), (r0, grammar))
        if first:  # next-token masks: one call, filled on the backend's threads
            rows, grammars = zip(*first.values())
            grammars[0].backend.fill_bitmasks(list(grammars), host, list(rows))
        for r0, n, grammar, drafts in groups:
            if drafts:
                grammar.fill_bitmasks_along(list(drafts), host[r0:r0 + n])
            else:
                host[r0:r0 + n] = host[first[id(grammar)][0]]
        masks = host.to(self.device, non_blocking=True)
        if logits.is_cuda:
            self._masks_sent = torch.cuda.Event()
            self._masks_sent.record()
        apply_token_bitmask(logits, masks)
        return logits

    def _mask_rows(self, rows: int, words: int, pinned: bool) -> torch.Tensor:
        """[rows, words] of the host mask buffer (kept between steps: pinned allocations are slow), all
        ones; waits for the copy of the previous step's masks out of it first."""
        buf = self._masks
        if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
            buf = self._masks = torch.empty((max(rows, 64), words), dtype=torch.int32, pin_memory=pinned)
        elif self._masks_sent is not None:
            self._masks_sent.synchronize()
        self._masks_sent = None
        return buf[:rows].fill_(-1)

    def _draft(self, so: SchedulerOutput, rows: list[int], ends: list[int], out, h: StepHandle,
               shift: torch.Tensor | None = None) -> torch.Tensor:
        """The next step's drafts [G * k] of the requests this step sampled one token for, from their
        anchors on the device (the last emitted token, its position and the row that computed it): no host sync.
        `ends`: one past each chunk's last flat row; `shift`: each chunk's start past its host one (a step scheduled
        ahead). Keeps on `h` the inputs of a verify step scheduled after it: each anchor's token and drafts, and
        its accepted count (next_inputs, next_shift)."""
        sel = [i for i in rows if so.chunks[i].num_samples == 1]
        anchors = [(so.chunks[i], h.groups[so.chunks[i].request_id][0], ends[i] - 1 - so.chunks[i].num_draft)
                   for i in sel]
        h.drafts = {c.request_id: j for j, (c, _, _) in enumerate(anchors)}
        h.draft_width = self.drafter.num_tokens
        host = torch.tensor([[h.offsets[g], c.start + len(c.token_ids) - c.num_draft, c.slot, r, g]
                             for c, g, r in anchors], dtype=torch.long).view(-1, 5)
        first, pos, slots, row, group = to_device(host, self.device).unbind(1)
        acc = out.num_accepted[group]
        if shift is not None:  # (a step scheduled ahead: every chunk samples once, so anchors are its chunks)
            pos = pos + shift
        sampler = self._draft_sampler([c for c, _, _ in anchors])
        last = out.tokens[first + acc]
        block = self.drafter.propose(Anchors(last, pos + acc, slots, row + acc, sampler))
        if block is None:
            return out.tokens[:0]
        k = self.drafter.num_tokens
        h.next_inputs, h.next_shift = torch.cat((last[:, None], block.tokens[:, :k]), 1), acc
        self._draft_q = None if block.probs is None else (block.probs[:, :k], h.drafts)
        # the confidences ride in the same int64 copy as the tokens: their fp32 bits
        conf_bits = block.confidence[:, :k].float().contiguous().view(torch.int32).long()
        return torch.cat((block.tokens[:, :k].flatten(), conf_bits.flatten()))

    def _draft_sampler(self, chunks: list) -> DraftSampler | None:
        """The drafter's sampler for these anchors' requests, or None when every draft is greedy. Drafts are drawn
        from q for requests at temperature > 0 that are unseeded (a seeded one verifies by matching the target's
        own draw, for which a greedy draft serves as well) and have no grammar (a grammar cuts drafts by their own
        tokens, which keeps verification exact for deterministic drafts only)."""
        drawn = [not c.params.greedy and c.params.seq_seed is None and c.grammar is None for c in chunks]
        if not any(drawn):
            return None
        params = [c.params if d else GREEDY for c, d in zip(chunks, drawn)]
        return DraftSampler(SamplingBatch.build(params, self.model.config.vocab_size, self.device), self.generator)

    def _draft_probs(self, so: SchedulerOutput, rows, drafts: torch.Tensor) -> torch.Tensor | None:
        """The distribution each draft row of this step was drawn from [draft rows, V], in verify's order: the
        rows the previous step's DraftSampler drew (their q), one-hot at the token for the rest; None when no
        draft of this step was drawn."""
        held, self._draft_q = self._draft_q, None
        if held is None or not drafts.numel():
            return None
        probs, where = held
        width, sel = probs.shape[1], []
        for i in rows:
            c = so.chunks[i]
            j = where.get(c.request_id)
            if c.num_draft:  # (a step's drafts are a prefix of the block its request was given)
                sel += [j * width + t for t in range(c.num_draft)] if j is not None and c.num_draft <= width \
                    else [-1] * c.num_draft
        idx = to_device(torch.tensor(sel, dtype=torch.long), self.device)
        q = probs.reshape(-1, probs.shape[-1])[idx.clamp(min=0)]
        if min(sel) < 0:
            one_hot = torch.zeros_like(q).scatter_(1, drafts[:, None], 1.0)
            q = torch.where((idx < 0)[:, None], one_hot, q)
        return q

    def _collect_verified(self, h: StepHandle) -> ModelOutput:
        out = ModelOutput({})
        values = h.host_tokens.tolist()
        T, G = h.offsets[-1], len(h.offsets) - 1
        token_list, accepted, drafted = values[:T], values[T:T + G], values[T + G:]
        if h.drafts:
            w, n = h.draft_width, len(h.drafts) * h.draft_width
            conf = np.asarray(drafted[n:], dtype=np.int64).astype(np.int32).view(np.float32).tolist()
            for rid, j in h.drafts.items():
                out.drafts[rid] = drafted[j * w:(j + 1) * w]
                out.draft_confidence[rid] = conf[j * w:(j + 1) * w]
        lp = self._logprobs(h.logprobs, [max(t, 0) for t in token_list], [p.logprobs for p in h.params]) \
            if h.logprobs is not None else None
        for rid, gs in h.groups.items():
            take = [r for g in gs for r in range(h.offsets[g], h.offsets[g] + accepted[g] + 1)]
            out.sampled[rid] = [token_list[r] for r in take]
            if lp is not None and h.params[take[0]].logprobs is not None:
                out.logprobs[rid] = [lp[r] for r in take]
        return out

    @torch.inference_mode()
    def collect(self, h: StepHandle) -> ModelOutput:
        """Waits for the step's sampled tokens; the one host sync of a step."""
        out = self._collect(h)
        if h.prompt is not None:
            p, r = h.prompt, 0
            lps = self._logprobs(p.top, p.targets, [k for _, _, n, k in p.spans for _ in range(n)])
            ranks = p.ranks.tolist()
            for rid, first, n, _ in p.spans:
                out.prompt_logprobs[rid] = (first, lps[r:r + n])
                out.prompt_ranks[rid] = ranks[r:r + n]
                r += n
        return out

    def _collect(self, h: StepHandle) -> ModelOutput:
        out = ModelOutput({})
        if h.tokens is None:
            return out
        if h.done is not None:
            h.done.synchronize()
        if h.offsets is not None:
            return self._collect_verified(h)
        token_list = h.host_tokens.tolist()
        lp = None
        if h.logprobs is not None:
            lp = self._logprobs(h.logprobs, token_list, [p.logprobs for p in h.params])
        for rid, (i, n) in h.rows.items():
            out.sampled[rid] = token_list[i:i + n]
            c_params = h.params[i]
            if lp is not None and c_params.logprobs is not None:
                out.logprobs[rid] = lp[i:i + n]
        return out

    def _image_embeds(self, so: SchedulerOutput):
        """(flat rows, embeddings) for the image-span tokens computed this step, or None.
        The vision tower runs once per image of a request: a span split across chunks reuses the
        embeddings until its last token is computed (or IMAGE_CACHE_SIZE newer images push it out)."""
        rows, values, off = [], [], 0
        for c in so.chunks:
            for s0, img in c.images:
                lo, hi = max(s0, c.start), min(s0 + img.num_tokens, c.start + len(c.token_ids))
                if lo < hi:
                    key = (c.request_id, s0)
                    span = self.image_cache.pop(key, None)
                    if span is None:
                        span = self.model.image_embeddings(img)
                    if hi < s0 + img.num_tokens:  # more of the span comes in a later chunk
                        self.image_cache[key] = span
                        while len(self.image_cache) > IMAGE_CACHE_SIZE:
                            self.image_cache.popitem(last=False)
                    rows.append(torch.arange(lo, hi) - c.start + off)
                    values.append(span[lo - s0:hi - s0])
            off += len(c.token_ids)
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values)

    @staticmethod
    def _logprobs(top, token_list: list[int], ks: list[int | None]) -> list[dict[int, float]]:
        """Per row r: the top ks[r] (None: 0) and token_list[r]'s logprob."""
        chosen, vals, ids = (t.tolist() for t in top)
        out = []
        for r, n in enumerate(ks):
            n = n or 0
            d = dict(zip(ids[r][:n], vals[r][:n]))
            d[token_list[r]] = chosen[r]
            out.append(d)
        return out


def _copy_to_host(h: StepHandle, values: torch.Tensor) -> StepHandle:
    """Starts the copy of a step's results to pinned host memory (`collect` waits on h.done)."""
    if values.is_cuda:
        h.host_tokens = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        h.host_tokens.copy_(values, non_blocking=True)
        h.done = torch.cuda.Event()
        h.done.record()
    else:
        h.host_tokens = values
    return h


def _graphs_for(model: CausalLM, cache: V4Cache, device: torch.device, drafter=None):
    """Decode graphs need a CUDA device, a cache with scratch rows, bf16 activations (grouped-GEMM
    experts; quantised weights through the Triton kernels: the reference loop syncs with the host)
    and a model that allows them (no host-side per-step inputs: V4.1 Engram tables left on the host)."""
    from deepinfer.kernels.grouped_gemm import triton_available
    from deepinfer.worker.cuda_graph import DecodeGraphs

    dense = not any(n.endswith("_scale") for n, _ in model.named_buffers())
    if device.type != "cuda" or cache.scratch_slot is None or model.dtype != torch.bfloat16 \
            or not (dense or triton_available()) or not model.supports_graphs:
        return None
    return DecodeGraphs(model, cache, cache.scratch_slot, cache.scratch_addr, device=str(device), drafter=drafter)
