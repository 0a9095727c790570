"""Why an engine decode step costs more than the graph replay it launches (flash_slice.py's decode
rows against their decode-graph-replay rows): on a Flash slice engine (V4 or V4.1, random weights,
prefill made up), after warm-up,
  0. the sweep's own decode row (--sweep-rows times, each on a fresh engine): its ms per step, each timed
     step's ms, graphs captured, GC pauses and allocator retries during the timed steps;
  1. seconds per steady `EngineCore.step` and per pipelined `DecodeGraphs.run`, as the sweep times them;
  2. the calls that synchronise the host with the GPU during engine steps (torch's sync debug mode);
  3. the caching allocator's retries and cudaMalloc calls during those steps (a retry frees cached
     blocks and synchronises the device);
  4. a torch.profiler trace of the steps: GPU busy time, the idle time between kernels, and the top
     kernels and host ops.
--phase prefill instead times the sweep's prefill row, then GPU ms per module role over one such step
(summed over layers) and a profiler trace of it.
--smoke runs tiny widths on the CPU (no graphs; sections 1, 2, 3 and the GPU columns are skipped).

    cd benchmarks && PYTHONPATH=.. python profile_engine_step.py --arch v41 --batch 1 --context 256 [--fp8]
    cd benchmarks && PYTHONPATH=.. python profile_engine_step.py --arch v41 --phase prefill --batch 4 --seq 2048
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
import time
import warnings

import torch

import flash_slice as fs
from common import add_commit_arg, recorded_commit


def model_and_kv(args):
    if args.arch == "v41":
        return fs.deepinfer_model_v41(args.fp8), "auto"
    return fs.deepinfer_model(args.fp8), ("fp8" if args.fp8 else "bfloat16")


def sweep_row(model, kv: str, args) -> dict:
    """The sweep's decode row (flash_slice.decode_row_engine + decode_seconds, same prompts, budget and
    steps = DECODE_STEPS_PER_REP x --reps) with decode_seconds' account of its timed steps."""
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    steps = fs.DECODE_STEPS_PER_REP[args.arch] * args.reps
    engine, _ = fs.decode_row_engine(model, args.batch, args.context, kv, steps, False, fs.DEVICE == "cuda", tokens)
    diag: dict = {}
    t = fs.decode_seconds(engine, steps, diag)
    return {"step_ms": round(1e3 * t, 3), **diag}


def build(model, kv: str, args):
    # the made-up prefill takes every prompt in one step: the token budget holds them all
    engine = fs.deepinfer_engine(model, args.batch, args.context + args.steps + 64, kv,
                                 max(8192, args.batch * args.context), False, fs.DEVICE == "cuda")
    # each request its own random prompt, as the sweep's rows: identical prompts decode identical tokens,
    # which route every request to the same experts (a batch-64 step reading ~6 experts a layer, not ~199)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (args.context,), generator=g).tolist()
               for _ in range(args.batch)]
    reqs = fs.start_decoding(engine, prompts, 3 * args.steps + 16)
    for _ in range(fs.DECODE_WARMUP):
        engine.step()
    return engine, reqs


def gpu_gaps(prof) -> tuple[float, float, int]:
    """(GPU busy ms, ms between the first kernel's start and the last one's end not covered by any
    kernel or copy, number of device events) of a profiler trace."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return 0.0, 0.0, 0
    busy, idle, end = 0.0, 0.0, spans[0][0]
    for s, e in spans:
        if s > end:
            idle += s - end
        busy += max(0, e - max(s, end))
        end = max(end, e)
    return busy / 1e3, idle / 1e3, len(spans)


def profiled(step, n: int, args, cuda: bool) -> None:
    """`n` calls of `step` under torch.profiler: wall time, GPU busy / idle time and the top ops."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n
    busy, idle, events = gpu_gaps(prof)
    print(f"under the profiler: {1e3 * wall:.3f} ms per engine step; GPU busy {busy / n:.3f} ms and "
          f"idle between kernels {idle / n:.3f} ms per step, {events / n:.0f} device events per step")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=70))
    if cuda:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))


REPLAYS = 50


def back_to_back_replays(graphs) -> tuple[float, float]:
    """(GPU ms, host ms) per replay of the most recently captured decode graph, REPLAYS in a row with no host
    work between them: the GPU's own time for a step's kernels (launch gaps inside the graph included) and
    the host's cost of launching it. Rewrites the same cache rows each time (timing only)."""
    graph = list(graphs.graphs.values())[-1][0]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPLAYS, 1e3 * host / REPLAYS


def synchronising_calls(step, n: int = 1) -> list:
    """The warnings torch's sync debug mode raises over `n` calls of `step` (one per synchronising call)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(n):
                step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return list(caught)


def decode(model, kv: str, args, cuda: bool) -> None:
    for i in range(args.sweep_rows):
        print(f"sweep decode row {i + 1} (a fresh engine, as run_sweep.sh times it): {json.dumps(sweep_row(model, kv, args))}")
    engine, reqs = build(model, kv, args)
    print(f"{args.arch} fp8={args.fp8} batch {args.batch} context {args.context}: async={engine.async_scheduling}, "
          f"graphs={engine.runner.graphs is not None}")
    if cuda:
        step_s = fs.decode_seconds(engine, args.steps)
        replay_s = fs.graph_replay_seconds(engine.runner.graphs, reqs, args.steps)
        print(f"engine step {1e3 * step_s:.3f} ms, graph replay alone {1e3 * replay_s:.3f} ms")
        gpu_ms, host_ms = back_to_back_replays(engine.runner.graphs)
        print(f"one captured decode graph replayed {REPLAYS} times back to back: {gpu_ms:.3f} ms a replay on the GPU "
              f"(CUDA events), {host_ms:.3f} ms of host time a replay call (cudaGraphLaunch); an engine step longer "
              f"than the GPU's time is host-bound")
        before = torch.cuda.memory_stats()
        caught = synchronising_calls(engine.step, args.steps)
        after = torch.cuda.memory_stats()
        sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught)
        print(f"synchronising calls over {args.steps} engine steps: {len(caught)}")
        for site, n in sites.most_common(15):
            print(f"  {n:4d}  {site}")
        for key in ("num_alloc_retries", "num_device_alloc", "num_device_free"):
            print(f"allocator {key} during those steps: {after.get(key, 0) - before.get(key, 0)}")
        free, total = torch.cuda.mem_get_info()
        print(f"device memory free {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    profiled(engine.step, args.steps, args, cuda)
    if args.kernel_sites:
        engine = None
        eager = fs.deepinfer_engine(model, args.batch, args.context + args.steps + 64, kv,
                                    max(8192, args.batch * args.context), False, False)
        g = torch.Generator().manual_seed(1)
        fs.start_decoding(eager, [torch.randint(0, model.config.vocab_size, (args.context,), generator=g).tolist()
                                  for _ in range(args.batch)], 3 * args.steps + 16)
        for _ in range(fs.DECODE_WARMUP):
            eager.step()
        kernel_sites(eager.step, args.steps, args.rows, cuda)


def kernel_sites(step, n: int, rows: int, cuda: bool) -> None:
    """`n` eager steps (no CUDA graphs: each kernel's launching op is visible) under the profiler with Python
    stacks: each (kernel, the deepinfer line that launched it) with its launches and device us per step. Kernels
    launched outside an aten op (Triton's own launcher) have no op to carry a stack: they show as "(no op)"."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()
    sites: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        outer_op = e.name.startswith("aten::") and not (e.cpu_parent is not None
                                                         and e.cpu_parent.name.startswith("aten::"))
        if not cuda and not outer_op:
            continue  # CPU: the outermost aten ops
        site, parent = "(no op)", e.cpu_parent
        while parent is not None:  # with_stack: the Python frames are the op's ancestors
            if "deepinfer/" in parent.name and ".py(" in parent.name and "benchmarks/" not in parent.name:
                site = parent.name[parent.name.index("deepinfer/"):]
                break
            parent = parent.cpu_parent
        for k in (e.kernels if cuda else [e]):
            entry = sites[(k.name[:60], site)]
            entry[0] += 1
            entry[1] += (k.duration if cuda else e.self_cpu_time_total)
    print(f"kernel sites over {n} eager steps (launches and {'device' if cuda else 'CPU'} us per step):")
    for (name, site), (count, us) in sorted(sites.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"  {count / n:5.1f} x {us / n:8.1f} us  {name:60s}  {site}")


def prefill(model, kv: str, args, cuda: bool) -> None:
    """The sweep's prefill row (one engine step taking --batch prompts of --seq tokens, median of --reps),
    then one such step timed per module role (CUDA events) and one under the profiler."""
    from deepinfer import SamplingParams
    from deepinfer.engine.request import Request

    B, S = args.batch, args.seq
    engine = fs.deepinfer_engine(model, B, S + 8, kv, B * S, False, False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (S,), generator=g).tolist() for _ in range(B)]
    t = fs.prefill_seconds(engine, prompts, args.reps)
    print(f"{args.arch} fp8={args.fp8} prefill {B} x {S}: engine step {1e3 * t:.3f} ms (median of {args.reps}, as the "
          f"sweep times it), replay_keep={engine.runner.replay_keep}")
    if args.gluon_ab:  # the same engine with the MoE's W8A8 on variant "tma" at every size, then back
        from deepinfer.layers import moe

        rows, moe.GLUON_ROWS = moe.GLUON_ROWS, 1 << 62
        try:
            t_tma = fs.prefill_seconds(engine, prompts, args.reps)
        finally:
            moe.GLUON_ROWS = rows
        t_again = fs.prefill_seconds(engine, prompts, args.reps)
        print(f"A/B in one engine: W8A8 experts on gluon from {rows} rows {1e3 * t:.3f} ms, then all on tma "
              f"{1e3 * t_tma:.3f} ms, then gluon again {1e3 * t_again:.3f} ms")
        return
    params, ids = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), itertools.count()

    def step():
        for p in prompts:
            engine.add_request(Request(f"profiled{next(ids)}", p, params))
        for r in engine.step():
            engine.completion(r, 0)

    if cuda:
        from profile_step import print_module_times

        print_module_times(model, step)
        caught = synchronising_calls(step)
        print(f"synchronising calls in one prefill step: {len(caught)}")
        for site, n in collections.Counter(f"{w.filename}:{w.lineno}" for w in caught).most_common(15):
            print(f"  {n:4d}  {site}")
    profiled(step, 1, args, cuda)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=("v4", "v41"), default="v41")
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256, help="decode: the sweep row's context")
    ap.add_argument("--seq", type=int, default=2048, help="prefill: prompt length")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--reps", type=int, default=2, help="the sweep's REPS (its decode rows time DECODE_STEPS_PER_REP x reps steps)")
    ap.add_argument("--sweep-rows", type=int, default=2, help="times to run the sweep's own decode row first")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--gluon-ab", action="store_true", help="prefill: time the step again with the MoE's W8A8 on "
                    "variant 'tma' at every size (layers/moe.py GLUON_ROWS), then the default again; nothing else")
    ap.add_argument("--kernel-sites", action="store_true", help="decode: also profile eager steps (no CUDA "
                    "graphs) with Python stacks and list each kernel with the deepinfer line that launched it")
    add_commit_arg(ap)
    args = ap.parse_args()
    print(f"# commit {recorded_commit(args)}: profile_engine_step.py {' '.join(sys.argv[1:])}", flush=True)
    if args.smoke:
        fs.use_smoke_settings()
        args.context, args.seq, args.steps, args.rows, args.reps = 40, 32, 3, 5, 1
    cuda = fs.DEVICE == "cuda"
    model, kv = model_and_kv(args)
    (prefill if args.phase == "prefill" else decode)(model, kv, args, cuda)


if __name__ == "__main__":
    main()
