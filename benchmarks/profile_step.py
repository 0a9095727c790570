"""Where a Flash-slice step spends its time: torch.profiler tables (GPU kernels, host ops).

    python benchmarks/profile_step.py --phase prefill --batch 4 --seq 2048
    python benchmarks/profile_step.py --phase decode --batch 1 --context 256 [--fp8]
"""
from __future__ import annotations

import argparse

import torch

import flash_slice as fs


def print_module_times(model, step) -> None:
    """GPU time per sub-module (CUDA events around each call), summed over layers by role."""
    starts, spans = {}, {}

    def pre(name):
        def hook(mod, inp):
            starts[name] = torch.cuda.Event(enable_timing=True)
            starts[name].record()
        return hook

    def post(name):
        def hook(mod, inp, out):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            spans.setdefault(name, []).append((starts[name], end))
        return hook

    handles = []
    for name, mod in model.named_modules():
        if 2 <= name.count(".") + 1 <= 4 and name.startswith("layers.") or name in ("embed", "head"):
            handles += [mod.register_forward_pre_hook(pre(name)), mod.register_forward_hook(post(name))]
    step()
    torch.cuda.synchronize()
    for h in handles:
        h.remove()
    by_role: dict[str, float] = {}
    for name, evs in spans.items():
        role = name.split(".", 2)[-1] if name.startswith("layers.") else name
        by_role[role] = by_role.get(role, 0.0) + sum(a.elapsed_time(b) for a, b in evs)
    print("GPU ms per module role (summed over layers; parents include children):")
    for role, ms in sorted(by_role.items(), key=lambda kv: -kv[1]):
        print(f"  {role:<40}{ms:9.3f}")


def print_module_launches(model, step) -> None:
    """Kernels launched per module role (self: a launch counts for the innermost module whose call
    encloses it on the host), summed over layers; decode steps are launch-bound, so the counts
    say where launches can be cut."""
    handles, ranges = [], {}

    def pre(name):
        def hook(mod, inp):
            ranges[name] = torch.profiler.record_function(f"mod:{name}")
            ranges[name].__enter__()
        return hook

    def post(name):
        def hook(mod, inp, out):
            ranges.pop(name).__exit__(None, None, None)
        return hook

    for name, mod in model.named_modules():
        if name:
            handles += [mod.register_forward_pre_hook(pre(name)), mod.register_forward_hook(post(name))]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    for h in handles:
        h.remove()
    evs = prof.events()
    spans = [(e.time_range.start, e.time_range.end, e.name[4:]) for e in evs if e.name.startswith("mod:")]
    count: dict[str, list] = {}
    for e in evs:
        if not e.kernels or e.name.startswith("mod:"):
            continue
        t = e.time_range.start
        inner = min((sp for sp in spans if sp[0] <= t <= sp[1]), key=lambda sp: sp[1] - sp[0], default=None)
        name = inner[2] if inner else "(outside modules)"
        role = name.split(".", 2)[-1] if name.startswith("layers.") else name
        c = count.setdefault(role, [0, 0.0, {}])
        c[0] += len(e.kernels)
        c[1] += sum(k.duration for k in e.kernels)
        c[2][e.name] = c[2].get(e.name, 0) + len(e.kernels)
    print(f"kernels per module role (self, summed over layers): {sum(c[0] for c in count.values())} in all")
    for role, (n, us, ops) in sorted(count.items(), key=lambda kv: -kv[1][0]):
        top = ", ".join(f"{op} {k}" for op, k in sorted(ops.items(), key=lambda kv: -kv[1])[:6])
        print(f"  {role:<32}{n:5d} launches {us / 1e3:7.3f} ms  [{top}]")


def print_gemm_shapes(step) -> None:
    """Per (op, input shapes): calls, GPU time and the weight operand's bytes per second, so small
    projections that stream their weights far below HBM bandwidth stand out."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key not in ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm") or not e.input_shapes:
            continue
        shapes = [s for s in e.input_shapes if s]
        weight = shapes[1] if len(shapes) > 1 else shapes[0]
        n_bytes = 2
        for d in weight:
            n_bytes *= d
        us = e.device_time_total / max(e.count, 1)
        rows.append((e.device_time_total, e.key, shapes, e.count, us, n_bytes / us / 1e3 if us else 0.0))
    print("GEMMs by shape (weight bytes assume 2-byte elements):")
    print(f"  {'op':<18}{'calls':>6}{'us/call':>10}{'GB/s':>9}  shapes")
    for total, key, shapes, count, us, gbs in sorted(rows, reverse=True):
        print(f"  {key:<18}{count:>6}{us:>10.1f}{gbs:>9.0f}  {shapes}")


def graph_breakdown(model, cache, chunks) -> None:
    """Decode through DecodeGraphs: host planning, input copies and replay timed apart."""
    import time

    from deepinfer.worker.cuda_graph import DecodeGraphs

    graphs = DecodeGraphs(model, cache, cache.scratch_slot, cache.scratch_addr)
    t0 = time.perf_counter()
    graphs.run(chunks)
    torch.cuda.synchronize()
    print(f"capture (incl. warm-up): {1e3 * (time.perf_counter() - t0):.1f} ms")
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        key, batch = graphs.plan(chunks)
    torch.cuda.synchronize()
    plan_ms = 1e3 * (time.perf_counter() - t0) / n
    entry = graphs.graphs[key]
    t0 = time.perf_counter()
    for _ in range(n):
        graphs._upload(graphs._stage(batch), entry[1])
    torch.cuda.synchronize()
    copy_ms = 1e3 * (time.perf_counter() - t0) / n
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        entry[0].replay()
    b.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        graphs.run(chunks)
        torch.cuda.synchronize()
    run_ms = 1e3 * (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):  # no sync between steps: planning step i+1 overlaps step i on the GPU
        graphs.run(chunks)
    torch.cuda.synchronize()
    pipe_ms = 1e3 * (time.perf_counter() - t0) / n
    print(f"B={len(chunks)}: plan {plan_ms:.2f} ms, stage+copy {copy_ms:.2f} ms, "
          f"replay (GPU) {a.elapsed_time(b) / n:.3f} ms, run()+sync {run_ms:.2f} ms, pipelined run() {pipe_ms:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("prefill", "decode"), default="decode")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048, help="prompt length (prefill)")
    ap.add_argument("--context", type=int, default=256, help="tokens already cached (decode)")
    ap.add_argument("--fp8", action="store_true", help="FP8/FP4 weights and fp8 KV")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--graphs", action="store_true", help="decode: time host plan / input copies / graph replay")
    ap.add_argument("--sort", default="self_cuda_time_total")
    ap.add_argument("--batch-invariant", action="store_true", help="run the steps in batch-invariant mode")
    ap.add_argument("--cprofile", action="store_true", help="host time per Python function over one step")
    ap.add_argument("--sync-debug", action="store_true", help="list the calls that synchronise with the GPU")
    ap.add_argument("--gemm-shapes", action="store_true",
                    help="GPU time and weight bandwidth of every GEMM shape (aten::mm / bmm / linear) in one step")
    args = ap.parse_args()
    from deepinfer.layers import invariant

    with invariant.mode(args.batch_invariant):
        profile(args)


def profile(args) -> None:
    from deepinfer.state.forward_batch import SeqChunk, build_forward_batch
    from deepinfer.tools.static_cache import static_v4_cache

    model = fs.deepinfer_model(fp8=args.fp8)
    cfg = model.config
    kv = "fp8" if args.fp8 else "bfloat16"
    if args.phase == "prefill":
        cache = static_v4_cache(cfg, args.batch, args.seq + 8, kv, "cuda", block_size=64)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq)).tolist()
        chunks = [SeqChunk(i, 0, ids[i], cache.static_tables(i)) for i in range(args.batch)]
    else:
        cache = static_v4_cache(cfg, args.batch, args.context + 8, kv, "cuda", block_size=64)
        ids = torch.randint(0, cfg.vocab_size, (args.batch,)).tolist()  # random: hash routing spreads experts
        chunks = [SeqChunk(i, args.context, [ids[i]], cache.static_tables(i)) for i in range(args.batch)]

    if args.graphs:
        cache = static_v4_cache(cfg, args.batch, args.context + 8, kv, "cuda", block_size=64, scratch=True)
        chunks = [SeqChunk(i, c.start, c.token_ids, cache.static_tables(i)) for i, c in enumerate(chunks)]
        with torch.inference_mode():
            return graph_breakdown(model, cache, chunks)

    def step():
        b = build_forward_batch(chunks, cfg.sliding_window, cache.compress_kinds, cache.block_size, "cuda")
        with torch.inference_mode():
            return model.compute_logits(model(b, cache.layers)[b.logits_idx])

    for _ in range(2):
        step()
    if args.sync_debug:  # where the host waits for the GPU inside a step: call sites, most frequent first
        import collections
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        torch.cuda.set_sync_debug_mode(0)
        sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught)
        print(f"synchronising calls in one step: {len(caught)}")
        for site, n in sites.most_common(25):
            print(f"  {n:4d}  {site}")
    if args.cprofile:  # host time per function over one step (the GPU runs behind; one sync at the end)
        import cProfile
        import pstats

        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        step()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.rows)
    if args.gemm_shapes:
        print_gemm_shapes(step)
    wall = fs.timed(step, 5)
    print(f"wall time per step (host plan + launch + GPU, synchronised): {1e3 * wall:.2f} ms")
    print_module_times(model, step)
    print_module_launches(model, step)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in cuda)
    print(f"{args.phase} B={args.batch} fp8={args.fp8}: {sum(e.count for e in cuda)} kernels, "
          f"{total / 1e3:.2f} ms GPU time")
    print(events.table(sort_by=args.sort, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
