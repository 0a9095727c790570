"""The multi-process executor at one rank against the in-process engine: decode throughput on the Flash slices.

Every parallel layout runs through the multi-process executor (deepinfer/executor/multiproc.py): each step's
plan is pickled and broadcast over a gloo group, every rank launches it, and the driver's EngineCore collects
its own rank's tokens. At one rank (distributed_executor_backend="mp") that path runs with nobody to send to,
so its cost beside the in-process engine ("uni", the same Worker called directly) is the executor's own
per-step overhead. Both engines are built by the same builder (executor/engine.py start_engine) from the
slice's config.json (flash_slice.py SLICES) with random weights (load_format "dummy": the checkpoint's
formats, FP8 blocks and FP4 experts as LLM holds them on CUDA), CUDA graphs and async scheduling on, greedy
decode of `batch` requests at a context; one engine per (slice, executor), in one process, uni then mp. Timing: seconds per Engine.step() over steady decode steps (one step in flight at
the start and at the end), the median of --reps runs; tokens/s = batch / step time (every step emits one
token per request).

    python benchmarks/executor_overhead.py --slices v4,v41 --batches 1,64 --out r.json
    python benchmarks/executor_overhead.py --smoke   # the tiny presets on the CPU: checks the script
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out, write_results

WARMUP = 8
PHASE_STACKS_S = 240  # a phase (engine start-up, one row) still running after this prints every thread's stack
T0 = time.monotonic()


def phase(what: str) -> None:
    """On stderr, with the seconds since start; re-arms the stack dump of a phase that hangs."""
    print(f"[{time.monotonic() - T0:7.1f} s] {what}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(PHASE_STACKS_S, exit=False)


def slice_dir(root: Path, arch: str, smoke: bool) -> Path:
    """config.json and tokenizer of the slice (no weights: load_format "dummy")."""
    from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

    if smoke:
        cfg = PRESETS["tiny" if arch == "v4" else "tiny41"]
    else:
        import flash_slice

        cfg = flash_slice.slice_config() if arch == "v4" else flash_slice.slice_config_v41()
    return write_checkpoint(root / arch, cfg, seed=0, dtype="fp8", weights=False)


def engine(path: Path, arch: str, backend: str, batch: int, context: int, device: str):
    from deepinfer.executor.engine import start_engine
    from deepinfer.executor.worker import EngineArgs

    cuda = device == "cuda"
    args = EngineArgs(str(path), device=device, dtype="bfloat16" if cuda else "float32", quantized=cuda,
                      load_format="dummy", kv_cache_dtype="auto" if cuda else "float32",
                      # the cache the rows need (batch x context tokens) with room; prefill in chunks of 2048
                      # tokens: a step of batch x context tokens ran the V4.1 slice out of memory on an 80 GB
                      # H100 (its weights take most of it)
                      kv_cache_memory=(2 << 30) if cuda else (64 << 20), max_model_len=context + 64,
                      max_num_seqs=batch, max_num_batched_tokens=2048, seed=0,
                      enforce_eager=not cuda, distributed_executor_backend=backend,
                      # FP4 experts as FP8 codes where LLM would hold them so (the V4 slice fits twice over; the
                      # V4.1 slice's 8 layers of 384 experts would not)
                      repack_fp4_experts=cuda and arch == "v4")
    return start_engine(args, async_scheduling=True)


def decode_step_seconds(eng, batch: int, context: int, steps: int, reps: int) -> tuple[float, dict]:
    """Median seconds per Engine.step() in steady decode of `batch` requests (prefilled by real steps)."""
    from deepinfer import SamplingParams
    from deepinfer.engine.request import Request

    g = torch.Generator().manual_seed(0)
    vocab = eng.model.config.vocab_size
    total = WARMUP + reps * steps + 8
    prompt = context - total
    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    reqs = [Request(f"r{i}", torch.randint(0, vocab, (prompt,), generator=g).tolist(), params) for i in range(batch)]
    for r in reqs:
        eng.add_request(r)
    while any(len(r.output_token_ids) == 0 for r in reqs):  # prefill
        eng.step()
    for _ in range(WARMUP):
        eng.step()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            if eng.step():
                raise RuntimeError("a request finished inside a timed decode run")
        times.append((time.perf_counter() - t) / steps)
    runner = eng.executor.worker.runner
    core = eng.core
    info = {"cuda_graphs": getattr(runner, "graphs", None) is not None, "async_scheduling": core.async_scheduling}
    eng.abort([r.request_id for r in reqs], "measured")
    return statistics.median(times), info


def _host(gpu: str, smoke: bool) -> str:
    if smoke:
        return "cpu-smoke"
    return next((k.lower() for k in ("H200", "H100") if k in gpu), "gpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slices", default="v4,v41")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="the tiny presets on the CPU (checks the script)")
    ap.add_argument("--out", default=None)
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.slices.split(","):
            path = slice_dir(Path(tmp), arch, args.smoke)
            for backend in ("uni", "mp"):  # one engine each, every batch's rows on it
                eng = None
                try:
                    phase(f"{arch} {backend}: starting the engine")
                    eng = engine(path, arch, backend, max(batches), args.context, device)
                    for batch in batches:
                        phase(f"{arch} {backend}: batch {batch}")
                        row = {"slice": arch, "executor": backend, "batch": batch, "context": args.context}
                        try:
                            t, info = decode_step_seconds(eng, batch, args.context, args.steps, args.reps)
                            row.update(step_ms=round(1e3 * t, 4), tokens_per_s=round(batch / t, 2), **info)
                        except Exception as e:  # noqa: BLE001 (recorded; the other rows still run)
                            row.update(step_ms=None, note=f"failed: {type(e).__name__}: {str(e)[:300]}")
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                except Exception as e:  # noqa: BLE001 (the engine did not start: every row of it says why)
                    for batch in batches:
                        rows.append({"slice": arch, "executor": backend, "batch": batch, "context": args.context,
                                     "step_ms": None, "note": f"failed: {type(e).__name__}: {str(e)[:300]}"})
                finally:
                    if eng is not None:
                        eng.close()
                    eng = None
                    gc.collect()
                    if device == "cuda":
                        torch.cuda.empty_cache()
    faulthandler.cancel_dump_traceback_later()
    for arch in args.slices.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            uni = next((r for r in rows if (r["slice"], r["executor"], r["batch"]) == (arch, "uni", batch)), None)
            mp = next((r for r in rows if (r["slice"], r["executor"], r["batch"]) == (arch, "mp", batch)), None)
            if uni and mp and uni["step_ms"] and mp["step_ms"]:
                mp["ratio_to_uni"] = round(mp["tokens_per_s"] / uni["tokens_per_s"], 4)
    result = {"device": gpu, "date": str(date.today()), "commit": recorded_commit(args), "timing": __doc__.split(
        "\n\n")[1], "rows": rows}
    out = Path(args.out) if args.out else new_results_path(
        Path(__file__).parent / "results" / f"{date.today()}-{_host(gpu, args.smoke)}"
        f"-executor-overhead-{result['commit']}.json")
    if args.smoke and not args.out:
        out = Path(tempfile.mkdtemp()) / out.name
    write_results(out, json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(f"{r['slice']:4} {r['executor']:3} B={r['batch']:3} step_ms={r['step_ms']} "
              f"ratio={r.get('ratio_to_uni', '')} {r.get('note', '')}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
