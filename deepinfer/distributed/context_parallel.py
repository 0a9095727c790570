"""Context parallelism (CP) for the prefill of one long prompt: DeepSeek-V4 and V4.1, torch.distributed.

Split. The prompt's T tokens are cut into 2*cp equal chunks of c = T / (2cp); rank r takes chunks
r and 2cp-1-r (zig-zag). A query at position p attends to O(p) keys (HCA entries, indexer scores
over p/m entries); chunk r lies as far above the first chunk as chunk 2cp-1-r lies below the last,
so sum(p + 1) over a rank's tokens is c^2 (2cp - 1) + c (c + 1), the same on every rank
(`causal_work`; a contiguous split gives the last rank ~2cp-1 times the first's). Constraint: c is a
multiple of `align` (default: the largest compression ratio), so every compressed window lies
inside one chunk and its entry closes on the rank holding the chunk. `zigzag_split` refuses other
lengths with a ValueError naming num_tokens; `prefill_cp` runs the longest aligned prefix in CP and
the rest (< 2cp*align tokens) as one ordinary step on every rank.

Per layer (models/deepseek_v4.py StepContext.gather, models/block_v41.py StepContext41.gather): each
rank computes every projection of its own tokens only (queries, the window kv, both compressors' kv
and gate scores); the window kv and the compressor projections are all-gathered over the CP group
into step order; each rank then pools every compressed entry and indexer key of the step (linear in
T), writes them, the window ring rows and the compressor carry into its own cache at the addresses
one process uses, and runs the indexer, attention, output projection and MoE for its own queries
only (the quadratic part). V4.1 (CSA2) the same way: a Full layer's PoolCompressor gathers its
projections (ratio > 1) or its latents (ratio 1, one entry per token) and every rank writes every
entry and index key of the step; the reindex / reuse layers' indexer and attention run for the
rank's own queries. Engram's n-gram windows are read from the device token history for the whole
step (which also stores the step's tokens into it, as one process does) and then cut to the rank's
rows. Bounded replay (yoco_prefill_truncation_mode "compact", V4.1): a CP step ends below the request's
replay_from, so every one of its rows stops at the last KV source (as a chunk below replay_from does in one
process: the layer's window kv and compressed state written for every row, nothing above it); the rows from the
last aligned boundary below replay_from on, the kept ones among them, run as one ordinary step on every rank.
Host-side Engram hashing (engram_device="cpu") has no CP path and is refused. After the prefill every rank's
cache is what one process leaves, the carry included, so decoding continues on every rank identically with no
communication. fp32 on the CPU: bit-identical to one process (tests/distributed/test_context_parallel.py); V4.1
in batch-invariant mode (layers/invariant.py), since outside it the CPU GEMM of 1-3 rows (a rank's tokens of one
routed expert) is not row-independent: there logprobs agree within 1e-5.

Sent per token and layer here (correctness first): the window kv (head_dim, activation dtype) and
the compressors' kv + scores in fp32 (CSA: 4*head_dim + 4*index_head_dim; HCA: 2*head_dim; V4.1
Full layers: 2*head_dim at ratio > 1, the head_dim latent at ratio 1). A production version
would send instead: the window kv of the W tokens before each chunk (the
sliding window halo), the compressor projections of the m tokens before each chunk (the CSA
overlap: the carry across the split), and all-gather only the entries and indexer keys each rank
pooled from its own whole windows (T/m rows, not T), overlapped with the query projections.

Entry points: prefill_cp (one request's chunk, start > 0 too: earlier positions come from the
cache), generate_cp (greedy driver), CPRunner (ModelRunner's execute for an engine whose driver
broadcasts SchedulerOutputs: executor/multiproc.py), run_on_ranks / generate_cp_spawn (gloo
ranks on the CPU).
"""
from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import torch
import torch.distributed as dist

from deepinfer.engine.outputs import CONTEXT_TOKENS, PLACEHOLDER, ModelOutput, SchedulerOutput
from deepinfer.layers import invariant
from deepinfer.layers.engram_hash import history_windows
from deepinfer.models.interface import CausalLM
from deepinfer.state.forward_batch import ForwardBatch, SeqChunk, build_forward_batch
from deepinfer.worker.model_runner import ModelRunner, StepHandle


def zigzag_split(num_tokens: int, cp_size: int, align: int = 1) -> list[np.ndarray]:
    """Per rank, the step rows (ascending) it computes: chunks r and 2cp-1-r of 2cp equal chunks.
    num_tokens must be a multiple of 2 * cp_size * align (chunk boundaries on whole windows)."""
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size: expected an integer >= 1, got {cp_size!r}")
    if align < 1:
        raise ValueError(f"align: expected >= 1, got {align!r}")
    unit = 2 * cp_size * align
    if num_tokens <= 0 or num_tokens % unit:
        raise ValueError(f"num_tokens: {num_tokens} is not a positive multiple of 2 * cp_size * align = {unit} "
                         f"(zig-zag chunks of whole compression windows); use aligned_prefix()")
    c = num_tokens // (2 * cp_size)
    return [np.concatenate((np.arange(r * c, (r + 1) * c), np.arange((2 * cp_size - 1 - r) * c, (2 * cp_size - r) * c)))
            for r in range(cp_size)]


def aligned_prefix(num_tokens: int, cp_size: int, align: int = 1) -> int:
    """The longest prefix zigzag_split accepts (0 when the prompt is shorter than one unit)."""
    unit = 2 * cp_size * align
    return num_tokens // unit * unit


def cp_rows(num_tokens: int, start: int, replay_from: int) -> int:
    """Of a chunk of `num_tokens` at `start`, the leading rows a context-parallel step may take: those below
    replay_from (bounded replay keeps the rows from it on past the last KV source; 0: none is kept apart)."""
    return num_tokens if replay_from == 0 else max(0, min(num_tokens, replay_from - start))


def causal_work(rows: np.ndarray, start: int = 0) -> int:
    """Keys a causal query set attends to, counting every earlier position: sum(pos + 1)."""
    return int((rows + start + 1).sum())


class RowGather:
    """This rank's rows -> the whole step's rows in step order (all_gather over `group`)."""

    def __init__(self, split: list[np.ndarray], group: dist.ProcessGroup | None, device):
        self.group, self.size = group, len(split)
        self.order = torch.from_numpy(np.concatenate(split)).to(device)
        self.calls = self.bytes = 0  # collectives issued and bytes this rank received (tests, reports)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        out = torch.empty((self.order.numel(), *x.shape[1:]), dtype=x.dtype, device=x.device)
        out[self.order] = torch.cat(parts)
        self.calls += 1
        self.bytes += out.numel() * out.element_size()
        return out


def local_view(full: ForwardBatch, rows: torch.Tensor, windows: torch.Tensor | None = None) -> ForwardBatch:
    """The batch of one CP rank: per-token fields (ids, positions, window and entry visibility,
    Engram n-gram windows) of `rows` only; write plans (ring rows, compressor sources, carry, entry
    addresses) of the whole step, read against gathered tensors (StepContext.gather). One request
    only. `windows`: the whole step's n-gram windows [T, K] where `full` plans a device history
    (engram_windows); the rank's rows of them replace the history plan."""
    if len(full.req_lens) != 1:
        raise ValueError(f"chunks: context parallelism runs one request per step, got {len(full.req_lens)}")
    if full.replay is not None and full.replay.rows.numel():
        raise ValueError("context parallelism: a step's rows that bounded replay keeps past the last KV source "
                         "run as an ordinary step; a context-parallel step ends below replay_from")
    if full.input_embeds is not None or full.token_windows is not None:
        raise ValueError("context parallelism: image inputs and host-side Engram windows are not supported")
    if (full.history is None) != (windows is None):
        raise ValueError("windows: give the step's n-gram windows exactly when the batch plans a device history")
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    plans = {k: dataclasses.replace(p, visible=p.visible[rows]) for k, p in full.plans.items()}
    local = ForwardBatch(full.input_ids[rows], full.positions[rows], full.token_req[rows],
                         full.logits_idx[:0], full.win_new[rows], full.win_ring[rows],
                         full.ring_src, full.ring_dst, plans, pick(windows), None, pick(full.image_mask),
                         req_lens=(rows.numel(),))
    local.replay = full.replay  # no kept rows: its per-row fields are empty, its ring plan the whole step's
    return local


def engram_windows(full: ForwardBatch, token_history: torch.Tensor | None) -> torch.Tensor | None:
    """The step's Engram n-gram windows [T, K] read from the per-slot device history, which then
    holds the step's tokens (what one process's step does); None for a batch without a history plan."""
    if full.history is None:
        return None
    if token_history is None:
        raise ValueError("token_history: a batch planned with a device history needs the cache's token history")
    return history_windows(full.input_ids, full.image_mask, token_history, full.history)


def _plan(model: CausalLM, chunks: list[SeqChunk], block_size: int, device, ring_slack: int = 0) -> ForwardBatch:
    """build_forward_batch as the runner plans it for `model` (Engram: windows from the device history; rings
    with the cache's `ring_slack` rows per slot beyond the window)."""
    if model.host_inputs:
        raise ValueError("context parallelism: Engram tables on the host (engram_device='cpu') hash on the host; "
                         "not supported")
    cfg = model.config
    return build_forward_batch(chunks, cfg.sliding_window, set(model.compressed_kinds(cfg)), block_size, device,
                               device_history=model.token_history, ring_slack=ring_slack)


def _forward_step(model, caches, chunk: SeqChunk, block_size: int, device, token_history, ring_slack: int,
                  cp_size: int, rank: int, group, align: int) -> tuple[torch.Tensor, RowGather | None]:
    """Trunk output (streams or hidden) of the step's last token (every rank) for one CP step of `chunk`."""
    full = _plan(model, [chunk], block_size, device, ring_slack)
    if cp_size == 1:
        return model(full, caches, token_history=token_history)[full.logits_idx], None
    split = zigzag_split(len(chunk.token_ids), cp_size, align)
    gather = RowGather(split, group, device)
    rows = torch.from_numpy(split[rank]).to(device)
    streams = model(local_view(full, rows, engram_windows(full, token_history)), caches, gather=gather)
    # zig-zag: the step's last token is the last row of rank 0 (chunk 2cp-1)
    last = streams[-1:].contiguous() if rank == 0 else torch.empty_like(streams[-1:])
    dist.broadcast(last, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return last, gather


@torch.inference_mode()
def forward_cp_rows(model, caches, chunk: SeqChunk, block_size: int, group: dist.ProcessGroup, align: int,
                    token_history: torch.Tensor | None = None, ring_slack: int = 0,
                    draft_features: bool = False) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor | None]:
    """One CP step of `chunk` (its length a multiple of 2 * cp * align; below its replay_from, if any) that leaves
    every rank the whole step's trunk output: (the step's batch as one process plans it, its states [T, ...], and
    with `draft_features` the draft features [T, F]), all-gathered into step order. What a drafter observes of a
    step one process ran."""
    device = next(model.parameters()).device
    full = _plan(model, [chunk], block_size, device, ring_slack)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    split = zigzag_split(len(chunk.token_ids), cp, align)
    gather = RowGather(split, group, device)
    rows = torch.from_numpy(split[rank]).to(device)
    local = local_view(full, rows, engram_windows(full, token_history))
    if draft_features:
        streams, feats = model(local, caches, gather=gather, draft_features=True)
        return full, gather(streams), gather(feats)
    return full, gather(model(local, caches, gather=gather)), None


@torch.inference_mode()
def prefill_cp(model, caches, prompt: list[int], slot: int, block_tables: dict[int, list[int]], block_size: int,
               group: dist.ProcessGroup | None = None, align: int | None = None, start: int = 0,
               stats: dict | None = None, token_history: torch.Tensor | None = None,
               ring_slack: int = 0, replay_from: int = 0) -> torch.Tensor:
    """Prefill `prompt` (positions start..) of the request in `slot` over the CP group; returns the
    fp32 logits [1, V] of its last position, equal on every rank. Every rank's cache then holds the
    request's state as one process would have written it. The longest prefix of 2*cp*align tokens'
    multiples runs in CP, the rest as one ordinary step on every rank. `stats`, if given, receives
    the rows per rank, the collectives and the bytes gathered. `token_history`: the cache's per-slot
    token history (V4.1 Engram), read and updated as one process's step does; `ring_slack`: the cache's (V4Cache
    .ring_slack: its rings' rows per slot beyond the window, which address every ring row); `replay_from`: the
    request's first position past the last KV source (bounded replay; 0: exact prefill), which the CP prefix
    stays below."""
    cfg = model.config
    cp, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    align = align or max(cfg.compress_ratios)
    device = next(model.parameters()).device
    args = (block_size, device, token_history, ring_slack)
    head = aligned_prefix(cp_rows(len(prompt), start, replay_from), cp, align) if cp > 1 else 0
    pieces = [(0, head, cp), (head, len(prompt), 1)] if head else [(0, len(prompt), 1)]
    last = None
    for a, b, size in pieces:
        if a == b:
            continue
        chunk = SeqChunk(slot, start + a, list(prompt[a:b]), block_tables, replay_from=replay_from)
        last, gather = _forward_step(model, caches, chunk, *args, size, rank, group, align)
        if stats is not None and gather is not None:
            stats.update(rows=b - a, cp_rows=(b - a) // size, collectives=gather.calls, gathered_bytes=gather.bytes)
    return model.compute_logits(last)


@torch.inference_mode()
def generate_cp(model, cache, prompt: list[int], max_tokens: int, group: dist.ProcessGroup | None = None,
                slot: int = 0, align: int | None = None, stats: dict | None = None):
    """Greedy generation: CP prefill, then decoding on every rank alike (each holds the whole
    cache; no communication). Returns (tokens, logprob of each chosen token, the prompt's
    last-position log-softmax [V]). `cache`: worker/kv_cache.py V4Cache with room for the request."""
    bs = cache.block_size
    need = {m: -(-((len(prompt) + max_tokens) // m) // bs) for m in cache.num_blocks}
    for m, n in need.items():
        if n > cache.num_blocks[m]:
            raise ValueError(f"cache: ratio {m} needs {n} blocks for this request, has {cache.num_blocks[m]}")
    tables = {m: list(range(n)) for m, n in cache.num_blocks.items()}
    history = getattr(cache, "token_history", None)
    logits = prefill_cp(model, cache.layers, prompt, slot, tables, bs, group, align, stats=stats,
                        token_history=history)
    first = torch.log_softmax(logits[0], -1)
    tokens, lps, lp = [], [], first
    for i in range(max_tokens):
        t = int(lp.argmax())
        tokens.append(t)
        lps.append(float(lp[t]))
        if i + 1 == max_tokens:
            break
        b = _plan(model, [SeqChunk(slot, len(prompt) + i, [t], tables)], bs, lp.device)
        with torch.inference_mode():
            h = model(b, cache.layers, token_history=history)[b.logits_idx]
            lp = torch.log_softmax(model.compute_logits(h)[0], -1)
    return tokens, lps, first



class CPRunner:
    """The ModelRunner surface (execute) for one rank of a CP group: a step that is one request's
    prefill chunk of at least one zig-zag unit (2 * cp * align tokens) runs through prefill_cp; every
    other step (decode, short or batched chunks) runs on the wrapped runner, on every rank alike, as
    each holds the whole cache. Every rank must be given the same SchedulerOutputs (the driver
    broadcasts them: executor/multiproc.py). Sampling: the runner's, from the same logits and
    seed on every rank. DeepSeek-V4 and V4.1 (StepContext.gather / StepContext41.gather); V4.1 with its
    Engram tables on the device; with bounded replay the split ends below the request's replay_from."""

    def __init__(self, runner: ModelRunner, group: dist.ProcessGroup, align: int | None = None):
        model = runner.model
        if not isinstance(model, CausalLM) or not model.supports_context_parallel:
            raise ValueError(f"context_parallel_size: {type(model).__name__} has no context-parallel path "
                             "(models/interface.py CausalLM.supports_context_parallel)")
        if model.host_inputs:
            raise ValueError("context_parallel_size: Engram tables on the host (engram_device='cpu') have no "
                             "context-parallel path; keep them on the device")
        self.runner, self.group = runner, group
        self.cp = dist.get_world_size(group)
        self.align = align or max(runner.model.config.compress_ratios)
        self.cp_steps = 0

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def supports_placeholders(self) -> bool:
        return self.runner.supports_placeholders

    @property
    def graphs(self):
        """The wrapped runner's decode / verify graphs (steps CP does not split run through them)."""
        return self.runner.graphs

    def _splits(self, so: SchedulerOutput) -> bool:
        """One request's prompt chunk of at least one zig-zag unit, without placeholder inputs, images or
        prompt logprobs (those need every row's logits on one rank)."""
        if len(so.chunks) != 1 or so.forks:
            return False
        c = so.chunks[0]
        return (not c.images and not c.prompt_rows and PLACEHOLDER not in c.token_ids
                and aligned_prefix(self._rows(c), self.cp, self.align) > 0)

    def _rows(self, c) -> int:
        """The leading rows of chunk `c` a split may take (cp_rows: below its replay_from)."""
        return cp_rows(len(c.token_ids), c.start, self.runner.replay_from(c))

    def launch(self, so: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        """ModelRunner.launch; a split prefill samples from the last position's logits, which every rank
        holds alike (with the model's drafter: _launch_drafting)."""
        if not self._splits(so):
            return self.runner.launch(so, prev)
        if self.runner.drafter is not None:
            return self._launch_drafting(so, prev)
        c, r = so.chunks[0], self.runner
        with invariant.mode(r.batch_invariant):  # as the runner's own steps
            logits = prefill_cp(r.model, r.cache.layers, c.token_ids, c.slot, c.block_tables, r.cache.block_size,
                                self.group, self.align, start=c.start, token_history=r.cache.token_history,
                                ring_slack=r.cache.ring_slack, replay_from=r.replay_from(c))
            self.cp_steps += 1
            if not c.num_samples:
                return StepHandle({})
            with torch.inference_mode():
                return r._sample_or_defer(so, logits, [0], prev)

    def _launch_drafting(self, so: SchedulerOutput, prev: StepHandle | None) -> StepHandle:
        """A split prefill with the model's drafter: its longest aligned prefix that leaves a token over runs in CP,
        and the drafter observes that prefix's whole output (gathered) as one process's non-sampling chunk; the rest
        is an ordinary step of the runner, which samples, verifies and drafts as one process does."""
        c, r = so.chunks[0], self.runner
        head = aligned_prefix(min(len(c.token_ids) - 1, self._rows(c)), self.cp, self.align)
        if head == 0:
            return r.launch(so, prev)
        first = dataclasses.replace(c, token_ids=c.token_ids[:head], num_samples=0, next_token=c.token_ids[head],
                                    grammar=None)
        with invariant.mode(r.batch_invariant), torch.inference_mode():
            batch, streams, feats = forward_cp_rows(
                r.model, r.cache.layers, SeqChunk(c.slot, c.start, first.token_ids, c.block_tables,
                                                  replay_from=r.replay_from(c)),
                r.cache.block_size, self.group, self.align, r.cache.token_history, r.cache.ring_slack,
                r.drafter.needs_features)
            r.drafter.observe([first], batch, streams, feats)
            r._sample_streams(SchedulerOutput([first]), batch, streams, None)  # samples nothing; MTP writes its ring
        self.cp_steps += 1
        rest = dataclasses.replace(c, start=c.start + head, token_ids=c.token_ids[head:],
                                   prev_tokens=(list(c.prev_tokens) + first.token_ids)[-CONTEXT_TOKENS:])
        return r.launch(dataclasses.replace(so, chunks=[rest]), prev)

    def collect(self, h: StepHandle) -> ModelOutput:
        return self.runner.collect(h)

    def complete(self, h: StepHandle) -> None:
        self.runner.complete(h)

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        return self.collect(self.launch(so))


@dataclasses.dataclass(frozen=True)
class CPArgs:
    """What every CP rank needs (pickled to the spawned ranks)."""

    model_dir: str
    context_parallel_size: int
    dtype: str = "float32"
    kv_cache_dtype: str = "float32"
    max_model_len: int = 1024
    block_size: int = 16
    num_threads: int = 1
    timeout_s: float = 120.0
    quantized: bool = False
    device: str = "cpu"  # "cuda": every rank on the current GPU, collectives still over gloo


def load_rank(args: CPArgs):
    """(model, cache with one slot of max_model_len) as every CP rank holds them."""
    from deepinfer.loader.model_loader import load_model
    from deepinfer.worker.kv_cache import allocate_v4_cache

    model, _ = load_model(args.model_dir, dtype=getattr(torch, args.dtype), device=args.device,
                          quantized=args.quantized)
    blocks = {m: -(-(-(-args.max_model_len // m)) // args.block_size) for m, _ in model.compressed_kinds(model.config)}
    return model, allocate_v4_cache(model.config, 1, blocks, args.kv_cache_dtype, args.device, args.block_size)


def _generate_rank(rank: int, group, args: CPArgs, prompt: list[int], max_tokens: int):
    model, cache = load_rank(args)
    stats: dict = {}
    tokens, lps, first = generate_cp(model, cache, prompt, max_tokens, group, stats=stats)
    return tokens, lps, first.cpu(), stats, [[t.cpu() for t in c.per_slot() + c.paged()] for c in cache.layers]


def generate_cp_spawn(args: CPArgs, prompt: list[int], max_tokens: int) -> list[tuple]:
    """generate_cp on `context_parallel_size` spawned gloo ranks (CPU): per rank, in rank order,
    (tokens, logprobs, first-position log-softmax, stats, its cache tensors per layer)."""
    return run_on_ranks(args.context_parallel_size, _generate_rank, (args, prompt, max_tokens), args.timeout_s,
                        args.num_threads)


def _rank_main(rank: int, world: int, init_method: str, timeout_s: float, num_threads: int, fn, args, results):
    try:
        from datetime import timedelta
        torch.set_num_threads(num_threads)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        # pickled by value: a tensor put on the queue as is would be shared through the rank's
        # memory, gone once it exits
        results.put((rank, None, pickle.dumps(fn(rank, dist.group.WORLD, *args))))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        import traceback
        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(world: int, fn, args: tuple = (), timeout_s: float = 120.0, num_threads: int = 1) -> list:
    """fn(rank, group, *args) on `world` spawned gloo ranks (CPU; fn and args picklable); returns
    their results in rank order. A rank that raises or dies ends the run with a RuntimeError naming
    it; one silent past `timeout_s`, too."""
    import queue
    import tempfile
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_rank_main, args=(r, world, init, timeout_s, num_threads, fn, args, results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < len(procs):
                try:
                    rank, err, res = results.get(timeout=1.0)
                except queue.Empty:
                    missing = sorted(set(range(len(procs))) - set(out))
                    dead = [r for r in missing if procs[r].exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        why = f"exited with {procs[dead[0]].exitcode}" if dead else f"no result in {timeout_s} s"
                        raise RuntimeError(f"context parallel: rank {(dead or missing)[0]} {why}") from None
                    continue
                if err is not None:
                    raise RuntimeError(f"context parallel rank {rank} failed: {err}")
                out[rank] = pickle.loads(res)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(len(procs))]
