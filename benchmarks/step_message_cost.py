"""What the driver pays to send one step's plan to its ranks: the shared-memory ring (executor/shm_ring.py) against
the gloo broadcast it replaced (parallel_state.broadcast_object: pickle, then two collectives), and pickle alone.

The plan is a real decode step's SchedulerOutput of `batch` requests, taken from an engine (the multi-process
executor at one rank, the tiny preset on the CPU) after a few steps; the driver's side only (at one rank nobody
reads, so neither path waits for a reader). Microseconds per send: the fastest of 5 runs of --n sends each
(timeit's rule: the slower runs measured other work, the collector's pauses among it).

    python benchmarks/step_message_cost.py --batches 1,64 --out r.json
"""
from __future__ import annotations

import argparse
import json
import pickle
import platform
import tempfile
import time
from datetime import date
from pathlib import Path

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out, write_results


def mean_us(fn, n: int, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return round(1e6 * best, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--out", default=None)
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    from deepinfer import SamplingParams
    from deepinfer.distributed import parallel_state as ps
    from deepinfer.engine.request import Request
    from deepinfer.executor.engine import start_engine
    from deepinfer.executor.worker import EngineArgs
    from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "tiny", PRESETS["tiny"], seed=0, dtype="fp8")
        eargs = EngineArgs(str(path), device="cpu", dtype="float32", kv_cache_dtype="float32",
                           kv_cache_memory=64 << 20, max_num_seqs=max(batches), max_num_batched_tokens=4096,
                           seed=0, distributed_executor_backend="mp")
        with start_engine(eargs) as eng:
            for b in batches:
                params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
                for i in range(b):
                    eng.add_request(Request(f"b{b}-{i}", list(range(10, 40)), params))
                for _ in range(3):
                    eng.step()
                so = eng.core.scheduler.schedule()  # the next decode step's plan (not run)
                msg = ("launch", so, True)
                rows.append({"batch": b, "chunks": len(so.chunks), "pickled_bytes": len(pickle.dumps(msg)),
                             "pickle_us": mean_us(lambda: pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), args.n),
                             "gloo_broadcast_us": mean_us(lambda: ps.broadcast_object(msg), args.n),
                             "shm_ring_us": mean_us(lambda: eng.executor._send(msg), args.n)})
                print(json.dumps(rows[-1]), flush=True)
                eng.abort(list(eng.requests), "measured")
    result = {"device": f"cpu ({platform.processor() or platform.machine()})", "date": str(date.today()),
              "commit": recorded_commit(args), "timing": __doc__.split("\n\n")[1], "rows": rows}
    out = Path(args.out) if args.out else new_results_path(
        Path(__file__).parent / "results" / f"{date.today()}-cpu-step-message-cost-{result['commit']}.json")
    write_results(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
