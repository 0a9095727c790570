"""Host time to plan one pure-decode step of the Flash slice (DecodeGraphs.plan: build_forward_batch
with fixed shapes + the graph key), per batch size. CPU only: no GPU and no weights are needed.

With async scheduling the host plans step N+1 while the GPU runs step N, so once the GPU step is
short (decode batch 1: ~1.4 ms on the H200) planning plus the graph launch must stay below it.

    python benchmarks/plan_time.py [--batches 1,64] [--context 256] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

from common import add_commit_arg, recorded_commit, refuse_existing_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)

    import flash_slice as fs
    from deepinfer import SamplingParams
    from deepinfer.engine.request import Request
    from deepinfer.state.forward_batch import SeqChunk
    from deepinfer.models.config import DeepseekV4Config
    from deepinfer.worker.cuda_graph import DecodeGraphs

    class ConfigOnly:  # DecodeGraphs.plan reads the model's config only
        config = DeepseekV4Config.from_dict(fs.slice_config())
        token_history = 0

    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        cfg = ConfigOnly.config
        kv, cache = fs.engine_cache(cfg, B, args.context + 8, "bfloat16", "cpu")
        reqs = [Request(str(i), [5] * (args.context + 1), SamplingParams()) for i in range(B)]
        for r in reqs:
            kv.allocate(r, args.context + 1)
        chunks = [SeqChunk(r.slot, args.context, [5], r.block_tables) for r in reqs]
        graphs = DecodeGraphs(ConfigOnly(), cache, cache.scratch_slot, cache.scratch_addr, device="cpu")
        for _ in range(10):
            graphs.plan(chunks)
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            graphs.plan(chunks)
            ts.append(time.perf_counter() - t)
        rows.append({"batch": B, "context": args.context, "plan_ms": round(1e3 * sorted(ts)[len(ts) // 2], 4)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"host": platform.processor() or platform.machine(), "commit": recorded_commit(args),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
