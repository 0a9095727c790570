"""Steps per second by step size, measured at start-up: the table DSpark's verification scheduler
(spec/schedule.py) trades verify tokens against (DEEPINFER_ENABLE_MTP_VARLEN)."""
from __future__ import annotations

import itertools
import statistics
import time

import torch

from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import ScheduledChunk, SchedulerOutput
from deepinfer.engine.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.schedule import SPSTable


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
    cuda = runner.device.type == "cuda"
    points = []
    for b in sizes:
        req = Request("sps-profile", [0] * b, SamplingParams(max_tokens=1))
        if not kv.allocate(req, b):
            break
        try:
            so = SchedulerOutput([ScheduledChunk(req.request_id, req.slot, 0, [0] * b,
                                                 {m: list(t) for m, t in req.block_tables.items()},
                                                 params=req.params, num_tokens=b)])
            times = []
            for _ in range(reps + 1):
                if cuda:
                    torch.cuda.synchronize(runner.device)
                t0 = time.perf_counter()
                runner.execute(so)
                if cuda:
                    torch.cuda.synchronize(runner.device)
                times.append(time.perf_counter() - t0)
            points.append((b, statistics.median(times[1:])))
        finally:
            kv.free(req)
    if not points:
        raise ValueError("enable_mtp_varlen: the cache cannot hold a one-token step to profile")
    # a bigger step is never taken as cheaper than a smaller one (timing noise would make the scheduler
    # admit drafts of no confidence for the "faster" bigger step)
    slowest = itertools.accumulate((t for _, t in points), max)
    points = [(b, t) for (b, _), t in zip(points, slowest)]
    return SPSTable.from_points(points, max(max_batch, points[-1][0]))
