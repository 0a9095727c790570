"""Where a decode step of the Flash slice spends its host time: torch.profiler op table.

    python benchmarks/profile_decode.py --batch 1 --context 256
"""
from __future__ import annotations

import argparse

import torch

import flash_slice as fs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    from deepinfer.layers.forward_batch import SeqChunk, build_forward_batch
    from deepinfer.worker.kv_cache import static_v4_cache

    model = fs.deepinfer_model(fp8=False)
    cfg = model.config
    cache = static_v4_cache(cfg, args.batch, args.context + 8, "bfloat16", "cuda", block_size=64)
    chunks = [SeqChunk(i, args.context, [7], cache.static_tables(i)) for i in range(args.batch)]

    def step():
        b = build_forward_batch(chunks, cfg.sliding_window, cache.compress_kinds, cache.block_size, "cuda")
        with torch.inference_mode():
            return model.compute_logits(model(b, cache.layers)[b.logits_idx])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"CUDA kernels per step: {kernels}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
