"""Step times measured at start-up, what DSpark's verification scheduler (spec/schedule.py) trades verify
tokens against (DEEPINFER_ENABLE_MTP_VARLEN): steps per second by step size (eager steps), or seconds by
requests and drafts each (steps replayed as CUDA graphs)."""
from __future__ import annotations

import itertools
import statistics
import time

import numpy as np
import torch

from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import ScheduledChunk, SchedulerOutput
from deepinfer.engine.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.schedule import SPSTable, StepTimes


def _median_seconds(runner, so: SchedulerOutput, reps: int) -> float:
    """The median wall time of `reps` runner.execute(so), after one more (warm-up, graph capture)."""
    cuda = runner.device.type == "cuda"
    times = []
    for _ in range(reps + 1):
        if cuda:
            torch.cuda.synchronize(runner.device)
        t0 = time.perf_counter()
        runner.execute(so)
        if cuda:
            torch.cuda.synchronize(runner.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _pipelined_seconds(runner, so: SchedulerOutput, reps: int) -> float:
    """Seconds per step of `reps` runs of `so` each launched before the one before it is collected (async
    scheduling's steady state: one step's host work overlaps the step in flight), after one run (warm-up, graph
    capture). A runner whose launches wait for other replicas' (`pipelines` False: lockstep data parallelism) is
    timed a step at a time (_median_seconds)."""
    if not getattr(runner, "pipelines", True):
        return _median_seconds(runner, so, reps)
    cuda = runner.device.type == "cuda"
    runner.execute(so)
    if cuda:
        torch.cuda.synchronize(runner.device)
    t0 = time.perf_counter()
    prev = runner.launch(so)
    for _ in range(reps - 1):
        h = runner.launch(so)
        runner.collect(prev)
        prev = h
    runner.collect(prev)
    if cuda:
        torch.cuda.synchronize(runner.device)
    return (time.perf_counter() - t0) / reps


def profile_sps(runner, kv: KVCacheManager, max_tokens: int, max_batch: int, reps: int = 3) -> SPSTable:
    """Seconds per step at B = 1, 2, 4, ... up to min(max_tokens, max_batch) tokens: one request's B-token chunk from
    position 0 through runner.execute (what a B-token verify step costs, to first order: the same
    weights and about the same attention work), the median of `reps` runs after a warm-up. Sizes the
    free cache cannot hold are skipped; the table extends past the last measured size linearly, up to
    `max_batch` (the most tokens a verify step can ask for)."""
    top = max(1, min(max_tokens, max_batch))
    sizes, b = [], 1
    while b < top:
        sizes.append(b)
        b *= 2
    sizes.append(top)
    points = []
    for b in sizes:
        req = Request("sps-profile", [0] * b, SamplingParams(max_tokens=1))
        if not kv.allocate(req, b):
            break
        try:
            so = SchedulerOutput([ScheduledChunk(req.request_id, req.slot, 0, [0] * b,
                                                 {m: list(t) for m, t in req.block_tables.items()},
                                                 params=req.params, num_tokens=b)])
            points.append((b, _median_seconds(runner, so, reps)))
        finally:
            kv.free(req)
    if not points:
        raise ValueError("enable_mtp_varlen: the cache cannot hold a one-token step to profile")
    # a bigger step is never taken as cheaper than a smaller one (timing noise would make the scheduler
    # admit drafts of no confidence for the "faster" bigger step)
    slowest = itertools.accumulate((t for _, t in points), max)
    points = [(b, t) for (b, _), t in zip(points, slowest)]
    return SPSTable.from_points(points, max(max_batch, points[-1][0]))


def step_buckets(max_requests: int) -> list[int]:
    """The request counts StepTimes measures: the graphs' batch buckets below max_requests, then max_requests."""
    from deepinfer.worker.cuda_graph import BATCH_BUCKETS

    return [b for b in BATCH_BUCKETS if b < max_requests] + [max_requests]


def profile_step_times(runner, kv: KVCacheManager, k: int, max_requests: int, max_tokens: int,
                       reps: int = 8) -> StepTimes:
    """StepTimes at n = step_buckets(max_requests) requests and l = 0..k drafts each: n requests of l + 1 tokens
    from position 0 (each a pending token and l drafts, all verified and sampled), through the runner, the
    step drafting the next block when l > 0 (SchedulerOutput.propose), so that the time is what such a decode
    step costs on this runner: its graph replays, verification and draft included. Seconds per step of `reps`
    steps launched one ahead of the last one's read-back, as async scheduling runs decode and verify steps
    (_pipelined_seconds). Sizes past the token budget or the free cache are np.inf."""
    buckets = step_buckets(max_requests)
    seconds = np.full((len(buckets), k + 1), np.inf)
    for i, n in enumerate(buckets):
        for length in range(k + 1):
            q = length + 1
            if n * q > max_tokens:
                break
            reqs = [Request(f"step-profile-{j}", [0] * q, SamplingParams(max_tokens=1)) for j in range(n)]
            held = list(itertools.takewhile(lambda r: kv.allocate(r, q), reqs))
            try:
                if len(held) < n:
                    break
                so = SchedulerOutput([ScheduledChunk(r.request_id, r.slot, 0, [0] * q,
                                                     {m: list(t) for m, t in r.block_tables.items()}, 1, r.params,
                                                     num_tokens=q, num_draft=length) for r in reqs],
                                     propose=length > 0)
                seconds[i, length] = _pipelined_seconds(runner, so, reps)
            finally:
                for r in held:
                    kv.free(r)
    if not np.isfinite(seconds[:, 0]).all():
        raise ValueError("enable_mtp_varlen: the cache or token budget cannot hold one token for every "
                         f"request of {buckets}")
    return StepTimes(buckets, seconds)
