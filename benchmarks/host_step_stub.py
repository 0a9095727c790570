"""Host time of an engine decode step with the model's forward stubbed out: `EngineCore.step` as LLM
wires it (async scheduling, the scheduler, DecodeGraphs' planning and input packing, placeholder
fill, sampling, collect), with the graph replay replaced by zero logits, on the CPU. It isolates the
host side that a GPU step overlaps; cProfile's top functions by own time follow each row.

    PYTHONPATH=. python benchmarks/host_step_stub.py [--batches 1,64] [--steps 50]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.engine.request import Request
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from engine_overhead import NoOpGraphs


def measure(name: str, preset: str, batches: list[int], steps: int, rows: int, root: Path) -> list[str]:
    ckpt = write_checkpoint(root / name, PRESETS[preset], seed=0, dtype="fp8")
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=max(batches))
    r = llm.engine.core.runner
    r.graphs = NoOpGraphs(r.model, r.cache, r.cache.scratch_slot, r.cache.scratch_addr, device="cpu")
    out = []
    for B in batches:
        params = SamplingParams(temperature=0, max_tokens=steps + 32, ignore_eos=True)
        reqs = [Request(f"{name}-{B}-{i}", [0] + [5 + (i + j) % 900 for j in range(200)], params) for i in range(B)]
        for q in reqs:
            llm.engine.add_request(q)
        for _ in range(6):  # the prefill (a real forward on the CPU), then steady decode steps
            llm.engine.step()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            llm.engine.step()
        prof.disable()
        ms = 1e3 * (time.perf_counter() - t) / steps
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
        out.append(f"{name} ({preset}) batch {B}: {ms:.3f} ms host per engine step (forward stubbed, under cProfile), "
                   f"async={llm.engine.core.async_scheduling}\n{text.getvalue()}")
        print(out[-1].splitlines()[0], flush=True)
        llm.engine.abort([q.request_id for q in reqs], "measured")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--out", default=None, help="text report (default: print only)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        report = [line for name, preset in (("v4", "tiny"), ("v41", "tiny41"))
                  for line in measure(name, preset, batches, args.steps, args.rows, Path(tmp))]
    if args.out:
        Path(args.out).write_text("\n".join(report))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
