"""Tile-config sweep of the Triton kernels at the Flash slice's shapes (H200), with the torch baseline.

    python benchmarks/kernel_sweep.py [--only moe|attn|attn-kinds|rope|decode-small|dense-small|fp8-small|fp8-rows|
                                              argmax]

MoE: 256 experts, K=4096 -> N=2048 (w1/w3), tokens x 6 experts routed at random: decode batch 1
and 64 (bf16 torch._grouped_mm vs the Triton kernel on bf16 / FP8-block / FP4 weights), prefill
8192 tokens (bf16). Attention: 64 heads x 512, window 128 + 512 selected entries (CSA), bf16 KV,
prefill 8192 tokens and decode batch 1 / 64. Median of CUDA-event timings; GB/s where weight-bound.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from common import add_commit_arg, recorded_commit, refuse_existing_out

from deepinfer.kernels import grouped_gemm as gg
from deepinfer.kernels import sparse_attention as sa


def bench(fn, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def bench_device(fn, reps: int = 20) -> float:
    """GPU ms of fn's kernels per call (profiler device time, launch gaps excluded): CUDA-event
    timing of a few-microsecond launch measures the host's launch latency instead."""
    return device_time_and_launches(fn, reps)[0]


def device_time_and_launches(fn, reps: int = 20) -> tuple[float, float]:
    """(GPU ms per call, kernels per call) from the profiler: in a CUDA graph each kernel also costs
    a launch gap (~0.7 us on the H200 slice step), so both matter."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return (sum(e.self_device_time_total for e in ev) / reps / 1e3, sum(e.count for e in ev) / reps)


def moe_inputs(tokens: int, E=256, K=4096, N=2048, topk=6):
    idx = torch.stack([torch.randperm(E, device="cuda")[:topk] for _ in range(tokens)])
    counts = torch.bincount(idx.flatten(), minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    M = tokens * topk
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    w8 = (torch.randn(E, N, K, device="cuda") * 100).to(torch.float8_e4m3fn)
    s8 = torch.full((E, N // 128, K // 128), 120, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
    w4 = torch.randint(-128, 127, (E, N, K // 2), dtype=torch.int8, device="cuda")
    s4 = torch.full((E, N, K // 32), 120, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
    touched = int((counts > 0).sum())
    s32 = torch.full((E, N, K // 32), 120, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
    # fp8x32: FP4 experts as the GPU runs them (repacked to e4m3 codes, one E8M0 scale per 32 inputs)
    return a, offs, {"bf16": (w16, None), "fp8": (w8, s8), "fp4": (w4, s4), "fp8x32": (w8, s32)}, touched


def moe_sweep(rows: list) -> None:
    K, N = 4096, 2048
    for tokens in (1, 64, 8192):
        a, offs, ws, touched = moe_inputs(tokens)
        per_expert = {"bf16": 2 * N * K, "fp8": N * K * (1 + 1 / 16384), "fp4": N * K * (0.5 + 1 / 32),
                      "fp8x32": N * K * (1 + 1 / 32)}
        w16 = ws["bf16"][0]
        t = bench(lambda: torch._grouped_mm(a, w16.transpose(1, 2), offs=offs))
        rows.append({"kernel": "moe", "tokens": tokens, "fmt": "bf16", "impl": "torch._grouped_mm", "ms": t,
                     "GBps": touched * per_expert["bf16"] / t / 1e6})
        print(json.dumps(rows[-1]), flush=True)
        fmts = ("bf16",) if tokens > 64 else ("bf16", "fp8", "fp4", "fp8x32")
        for fmt in fmts:
            w, s = ws[fmt]
            block = (1, 32) if fmt == "fp8x32" else (128, 128)
            if tokens > 64:
                grid = itertools.product([64, 128], [128, 256], [64], [4, 8], [3, 4])
            else:
                grid = itertools.product([16], [32, 64, 128], [128, 256], [4, 8], [3, 4])
            best = None
            for bm, bn, bk, nw, ns in grid:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
                try:
                    t = bench(lambda: gg.grouped_gemm(a, w, offs, s, block, **cfg))
                except Exception as e:  # out of shared memory / registers for this tile
                    print(f"skip {fmt} {cfg}: {type(e).__name__}", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            t, cfg = best
            dflt = bench(lambda: gg.grouped_gemm(a, w, offs, s, block))
            rows.append({"kernel": "moe", "tokens": tokens, "fmt": fmt, "impl": "triton", "ms": t, "best": cfg,
                         "default_ms": dflt, "GBps": touched * per_expert[fmt] / t / 1e6})
            print(json.dumps(rows[-1]), flush=True)


def attn_inputs(T: int, prefill: bool, H=64, D=512, W=128, K=512, entries=4096):
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    j = torch.arange(W, device="cuda")
    t = torch.arange(T, device="cuda")[:, None]
    if prefill:
        win_new = torch.where(t - (W - 1) + j >= 0, t - (W - 1) + j, -1)
        win_ring = torch.full_like(win_new, -1)
    else:  # decode: the token itself is new, the rest come from the ring
        win_new = torch.where(j == W - 1, t.expand(T, W), -1)
        win_ring = torch.where(j < W - 1, t * W + j, -1)
    ring = torch.randn(T * W, D, device="cuda", dtype=torch.bfloat16)
    ent = torch.randn(entries, D, device="cuda", dtype=torch.bfloat16)
    addr = torch.randint(0, entries, (T, K), device="cuda")
    sinks = torch.zeros(H, device="cuda")
    return (q, kv, win_new, win_ring, (ring,), "bfloat16", addr, (ent,), "bfloat16", sinks, D ** -0.5)


def attn_sweep(rows: list) -> None:
    for T, prefill in ((8192, True), (1, False), (64, False)):
        args = attn_inputs(T, prefill)
        ref_ms = bench(lambda: sa.reference(*args), 3) if T <= 64 else None
        splits = [None] if prefill else [None, 1, 4, 8, 16]
        best = None
        for bh, bn, nw, ns, sp in itertools.product([16, 32], [32, 64], [4, 8], [1, 2], splits):
            cfg = dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns, num_splits=sp)
            try:
                t = bench(lambda: sa.sparse_attention(*args, **cfg))
            except Exception as e:
                print(f"skip attn {cfg}: {type(e).__name__}", flush=True)
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        dflt = bench(lambda: sa.sparse_attention(*args))
        flops = 4 * T * 64 * 512 * (128 + 512)
        rows.append({"kernel": "sparse_attention", "tokens": T, "phase": "prefill" if prefill else "decode",
                     "ms": best[0], "best": best[1], "default_ms": dflt, "torch_reference_ms": ref_ms,
                     "TFLOPs": flops / best[0] / 1e9})
        print(json.dumps(rows[-1]), flush=True)


def attn_kinds(rows: list) -> None:
    """Prefill 4 x 2048 tokens per layer kind as the slice runs them: sliding (window only), CSA
    (window + 512 top-k entries, the valid ones first: min(512, pos // 4)), HCA (window + all
    pos // 128 entries)."""
    T, L = 8192, 2048
    pos = torch.arange(T, device="cuda") % L
    for kind, K, n_valid in (("sliding", 0, None), ("csa", 512, (pos // 4).clamp(max=512)),
                             ("hca", L // 128, pos // 128)):
        args = list(attn_inputs(T, True, K=max(K, 1)))
        j = torch.arange(128, device="cuda")
        args[2] = torch.where(pos[:, None] - 127 + j >= 0, torch.arange(T, device="cuda")[:, None] - 127 + j, -1)
        if K:
            args[6] = torch.where(torch.arange(K, device="cuda") < n_valid[:, None], args[6][:, :K], -1)
        else:
            args[6] = args[7] = args[8] = None
        for bh, bn, nw, ns in itertools.product([16, 32, 64], [32, 64], [4, 8], [2]):
            cfg = dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns)
            try:
                t = bench(lambda: sa.sparse_attention(*args, **cfg))
            except Exception as e:
                print(f"skip {kind} {cfg}: {type(e).__name__}", flush=True)
                continue
            rows.append({"kernel": "sparse_attention", "kind": kind, "tokens": T, "ms": t, "cfg": cfg})
            print(json.dumps(rows[-1]), flush=True)
        rows.append({"kernel": "sparse_attention", "kind": kind, "tokens": T, "default_ms": bench(
            lambda: sa.sparse_attention(*args))})
        print(json.dumps(rows[-1]), flush=True)


def rope_sweep(rows: list) -> None:
    """RoPE at prefill 8192 tokens x 64 heads x 512: the q path (norm + rope, out of place) and the
    output's inverse rope in place, over rows per program and warps."""
    from deepinfer.kernels import rope as rk

    x = torch.randn(8192, 64, 512, device="cuda").to(torch.bfloat16)
    ang = torch.rand(8192, 32, device="cuda") * 6
    cos, sin = ang.cos(), ang.sin()
    for mode in ("norm", "inplace"):
        for r, nw in itertools.product([1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8]):
            if mode == "norm" and r > 16:
                continue
            t = bench(lambda: rk._launch(x, cos, sin, mode == "inplace", 1e-6 if mode == "norm" else None,
                                         mode == "inplace", rows=r, num_warps=nw))
            moved = x.numel() * 2 * (2 if mode == "norm" else 2 * 64 / 512)
            rows.append({"kernel": "rope", "mode": mode, "rows": r, "num_warps": nw, "ms": t, "GBs": moved / t / 1e6})
            print(json.dumps(rows[-1]), flush=True)


def decode_small(rows: list) -> None:
    """Decode-size launches of the slice, timed by their kernels' device time (bench_device): the
    MoE pair sort (moe_align over block / warps vs torch), the mHC mix at 1 and 64 tokens over K
    splits, the mHC coefficients over rows per program / warps, the fused router vs torch, the routed
    experts' w1 over N / K tiles, V4's grouped output projection wo_a with FP8 weights (grouped GEMM
    vs dequant + einsum)."""
    from deepinfer.kernels import mhc_mix as mm
    from deepinfer.kernels import moe_align as ma
    from deepinfer.layers.linear import Linear, QuantSpec, grouped_linear

    for M in (6, 384):
        idx = torch.randint(0, 256, (M // 6, 6), device="cuda")
        rows.append({"kernel": "moe_align", "M": M, "impl": "torch", "ms": bench_device(lambda: ma.reference(idx, 256))})
        print(json.dumps(rows[-1]), flush=True)
        for blk, nw in itertools.product([16, 32, 64, 128], [1, 2, 4]):
            rows.append({"kernel": "moe_align", "M": M, "block": blk, "num_warps": nw,
                         "ms": bench_device(lambda: ma._launch(idx, 256, blk, nw))})
            print(json.dumps(rows[-1]), flush=True)
    fn = torch.randn(24, 16384, device="cuda") * 0.01
    for T in (1, 64):
        x = torch.randn(T, 16384, device="cuda").to(torch.bfloat16)
        for sp in (1, 4, 8, 16, 32, 64, 128, 256):
            rows.append({"kernel": "mhc_mix", "T": T, "splits": sp,
                         "ms": bench_device(lambda: mm._launch(x, fn, 1e-6, sp))})
            print(json.dumps(rows[-1]), flush=True)
    from deepinfer.kernels import mhc_coeffs as mc

    base, scale = torch.randn(24, device="cuda") * 0.1, torch.rand(3, device="cuda")
    for T in (1, 64, 8192):
        mix = torch.randn(T, 24, device="cuda")
        for blk, nw in itertools.product([1, 4, 16, 64], [1, 2, 4]):
            rows.append({"kernel": "mhc_coeffs", "T": T, "block": blk, "num_warps": nw,
                         "ms": bench_device(lambda: mc._launch(mix, base, scale, 4, 20, 1e-6, blk, nw))})
            print(json.dumps(rows[-1]), flush=True)
    from deepinfer.kernels import router as rt

    for T, hashed in itertools.product((1, 64), (True, False)):
        logits = torch.randn(T, 256, device="cuda")
        table = torch.randint(0, 256, (1000, 6), device="cuda")
        ids, bias = torch.randint(0, 1000, (T,), device="cuda"), torch.randn(256, device="cuda") * 0.1
        kw = dict(ids=ids, tid2eid=table) if hashed else dict(bias=bias)
        for impl, f in (("kernel", lambda: rt.route(logits, 6, 2.5, **kw)),
                        ("torch", lambda: rt.reference(logits, 6, 2.5, **kw))):
            rows.append({"kernel": "router", "T": T, "hashed": hashed, "impl": impl, "ms": bench_device(f)})
            print(json.dumps(rows[-1]), flush=True)
    from deepinfer.kernels import grouped_gemm as gg2

    w = (torch.randn(256, 2048, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    for T in (1, 4, 64):  # routed experts' w1 at decode: default tiles vs the other N width
        idx = torch.randint(0, 256, (T, 6), device="cuda")
        order, tok, offs, _ = ma.moe_align(idx, 256)
        a = torch.randn(T * 6, 4096, device="cuda").to(torch.bfloat16)
        for bn, bk in ((None, None), (64, 128), (128, 256), (32, 128)):
            t = bench_device(lambda: gg2.grouped_gemm(a, w, offs, BLOCK_N=bn, BLOCK_K=bk) if bn else
                             gg2.grouped_gemm(a, w, offs))
            rows.append({"kernel": "experts_w1", "T": T, "BLOCK_N": bn or "default", "BLOCK_K": bk or "default",
                         "ms": t, "GBs": min(T * 6, 256) * 2048 * 4096 * 2 / t / 1e6})
            print(json.dumps(rows[-1]), flush=True)
    lin = Linear(4096, 8 * 1024, torch.bfloat16, QuantSpec(block_size=(128, 128)), device="cuda")
    lin.weight.copy_((torch.randn(8192, 4096, device="cuda") * 4).to(torch.float8_e4m3fn))
    lin.scale.copy_(torch.randint(117, 122, lin.scale.shape, dtype=torch.uint8).view(lin.scale.dtype))
    for T in (1, 64):
        x = torch.randn(T, 8, 4096, device="cuda").to(torch.bfloat16)
        for impl, f in (("grouped_gemm", lambda: lin.forward_grouped(x)),
                        ("dequant+einsum", lambda: grouped_linear(x, lin.dense_weight(x.dtype).view(8, 1024, 4096)))):
            rows.append({"kernel": "wo_a_fp8", "T": T, "impl": impl, "ms": bench_device(f)})
            print(json.dumps(rows[-1]), flush=True)


# (N, K) of the slice's bf16 decode projections with bf16 outputs: V4 attention's stacked wq_a + wkv,
# wq_b, wo_b, the shared expert's stacked w1 + w3 and w2, the indexer's wq_b and weights_proj
DENSE_SHAPES = ((1536, 4096), (32768, 1024), (4096, 8192), (4096, 4096), (4096, 2048), (8192, 1024),
                (64, 4096), (2048, 4096))


def dense_small(rows: list) -> None:
    """Dense bf16 projections at decode sizes: cuBLAS (F.linear) vs the Triton GEMM with one group
    over N tile widths and K splits. Each call reads the next of enough weight copies to exceed the
    L2 (a decode step reads every weight once from HBM)."""
    import math
    import torch.nn.functional as F

    for N, K in DENSE_SHAPES:
        nbytes = N * K * 2
        ws = [(torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
              for _ in range(max(2, math.ceil(256e6 / nbytes)))]
        it = itertools.cycle(ws)
        for M in (1, 4, 16, 64):
            a = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            variants = [("cublas", lambda: F.linear(a, next(it))), ("triton-auto", lambda: gg.grouped_gemm(a, next(it), None))]
            if M <= 4:
                for bn, sk in itertools.product((32, 64, 128), (1, 2, 4, 8, 16)):
                    if K % (sk * 128) or K // (sk * 128) < 2:
                        continue
                    variants.append((f"triton-bn{bn}-sk{sk}", lambda bn=bn, sk=sk: gg._launch(
                        a, next(it), None, None, (1, 1), BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, num_warps=4,
                        num_stages=4, split_k=sk)))
            for name, f in variants:
                t, n = device_time_and_launches(f)
                rows.append({"kernel": "dense", "N": N, "K": K, "M": M, "impl": name, "ms": t, "launches": n,
                             "GBs": nbytes / t / 1e6})
                print(json.dumps(rows[-1]), flush=True)


# GEMV tiles swept at M = 1 (ROWS = 1): (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k; None: split_k_for's).
# Entries 1-14 vary the weight tile, warps and cp.async stages at the automatic split, 15-19 the split, 20 a
# wide tile; test_grouped_gemm.py builds each for sm_90 (no spills).
GEMV_SWEEP = [(8, 256, 1, 3, 1), (8, 256, 2, 3, 1), (8, 512, 2, 3, 1), (16, 256, 2, 3, 1), (16, 512, 2, 3, 1),
              (16, 256, 2, 4, 1),  # no K split: one launch (in a graph, no split_sum launch and gap)
              (32, 256, 4, 2, None), (32, 256, 4, 3, None), (32, 256, 4, 4, None), (32, 256, 4, 1, None),
              (16, 256, 4, 3, None), (16, 512, 4, 3, None), (32, 512, 4, 2, None), (32, 512, 4, 3, None),
              (64, 256, 4, 2, None), (64, 256, 8, 3, None), (64, 512, 8, 2, None), (32, 128, 4, 4, None),
              (64, 128, 4, 3, None), (16, 256, 2, 3, None), (32, 256, 4, 2, 1), (32, 256, 4, 2, 2),
              (32, 256, 4, 2, 8), (16, 256, 4, 2, 8), (32, 256, 4, 3, 16), (128, 256, 8, 3, None)]
GEMV_SWEEP_M4 = [(32, 256, 4, 2, None), (32, 256, 4, 3, None), (64, 256, 8, 3, None), (16, 256, 4, 3, None)]
# the routed experts' GEMV tiles (ROWS, BLOCK_N, BLOCK_K, num_warps, num_stages), K split automatic
GEMV_EXPERT_SWEEP = [(1, 32, 256, 4, 2), (1, 32, 256, 4, 3), (1, 64, 256, 8, 3), (1, 16, 256, 4, 3),
                     (1, 32, 512, 4, 2), (2, 32, 256, 4, 2)]


def gemv_kwargs(M: int, E: int, N: int, K: int, one_group: bool, entry: tuple, rows: int | None = None,
                sms: int | None = None) -> dict | None:
    """_launch's kwargs for a GEMV sweep entry (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k), or None
    when the split does not divide K into whole tiles. sms: the device's SM count unless given."""
    bn, bk, nw, ns, sk = entry
    cfg = dict(gg.gemv_config(M, E), BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
    if rows is not None:
        cfg["ROWS"] = rows
    if sk is None:
        sms = sms or torch.cuda.get_device_properties(0).multi_processor_count
        sk = gg.split_k_for(gg.max_m_tiles(M, E, cfg["ROWS"], one_group), N, K, cfg, sms)
    if K % (sk * bk):
        return None
    return dict(cfg, gemv=True, split_k=sk)


def dot_default_kwargs(M: int, E: int, N: int, K: int, one_group: bool) -> dict:
    """The dot kernel with its default tiles and split (grouped_gemm's choice before the GEMV)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = gg.default_config(M, E, gg.FP8, N, sms)
    return dict(split_k=gg.split_k_for(gg.max_m_tiles(M, E, cfg["BLOCK_M"], one_group), N, K, cfg, sms))


def gemv_label(kw: dict) -> str:
    return "gemv-r{ROWS}-bn{BLOCK_N}-bk{BLOCK_K}-w{num_warps}-s{num_stages}-sk{split_k}".format(**kw)


def fp8_small(rows: list) -> None:
    """FP8 (128 x 128 blocks, E8M0 scales) projections at decode sizes through the W8A16 Triton kernels
    (Linear.forward below FP8_GEMM_ROWS): grouped_gemm's default (`triton-auto`: the GEMV at M <= 4), the
    dot kernel's default tiles and split (`triton-dot-auto`), the dot kernel over N tile widths, K tile depths
    and K splits (M = 1 and 64), the GEMV over GEMV_SWEEP (M = 1) / GEMV_SWEEP_M4 (M = 4), with cuBLAS on the
    bf16 weight beside them. As dense_small, each call reads the next of enough weight copies to exceed the
    L2; GBs counts the FP8 bytes. Then V4's routed experts (fp8_experts)."""
    import math
    import torch.nn.functional as F

    for N, K in DENSE_SHAPES:
        nbytes = N * K
        copies = max(2, math.ceil(256e6 / nbytes))
        ws = [((torch.randn(N, K, device="cuda") * 8).to(torch.float8_e4m3fn),
               torch.randint(115, 125, (-(-N // 128), -(-K // 128)), dtype=torch.uint8, device="cuda"))
              for _ in range(copies)]
        it = itertools.cycle(ws)
        dense = itertools.cycle([(torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
                                 for _ in range(max(2, math.ceil(256e6 / (2 * nbytes))))])
        for M in (1, 4, 64):
            a = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            variants = [("cublas-bf16", lambda: F.linear(a, next(dense))),
                        ("triton-auto", lambda: gg.grouped_gemm(a, *_pair(it), block_size=(128, 128)))]
            if M <= 4:  # the dot kernel's default (triton-auto's kernel at M = 64)
                variants.append(("triton-dot-auto", lambda kw=dot_default_kwargs(M, 1, N, K, True): gg._launch(
                    a, *_pair(it), (128, 128), **kw)))
            if M != 4:  # the dot kernel's tiles (dropped, as the slowest of the b3a388c sweep or never the
                # best of a shape at M = 1 or 64 but N = 64's: BLOCK_N 128, 8 and 16 splits)
                for bn, bk, sk in itertools.product((32, 64), (128, 256), (1, 2, 4)):
                    if K % (sk * bk) or K // (sk * bk) < 2:
                        continue
                    variants.append((f"triton-bn{bn}-bk{bk}-sk{sk}", lambda bn=bn, bk=bk, sk=sk: gg._launch(
                        a, *_pair(it), (128, 128), BLOCK_M=16 if M <= 16 else 64, BLOCK_N=bn, BLOCK_K=bk,
                        num_warps=4, num_stages=4, split_k=sk)))
            for entry in {1: GEMV_SWEEP, 4: GEMV_SWEEP_M4}.get(M, []):
                kw = gemv_kwargs(M, 1, N, K, True, entry)
                if kw is not None and gemv_label(kw) not in {name for name, _ in variants}:  # an explicit split
                    # equal to the automatic one is timed once
                    variants.append((gemv_label(kw), lambda kw=kw: gg._launch(a, *_pair(it), (128, 128), **kw)))
            if QUICK:  # the defaults only: what the engine runs against the dot kernel and cuBLAS
                variants = [v for v in variants if v[0] in ("cublas-bf16", "triton-auto", "triton-dot-auto")]
            for name, f in variants:
                _timed_row(rows, {"kernel": "fp8-linear", "N": N, "K": K, "M": M, "impl": name}, f,
                           2 * nbytes if name.startswith("cublas") else nbytes)
        del ws, dense, it
    fp8_experts(rows)


QUICK = False  # --quick: fp8-small times the default kernels only (a short device call)

FP8_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SWAP_TILES = ((64, 4, 3), (64, 4, 4), (128, 8, 3))  # the swapped dot's (BLOCK_N, num_warps, num_stages)


def fp8_rows(rows: list) -> None:
    """Where W8A8 overtakes W8A16 for FP8 Linears (layers/linear.py FP8_GEMM_ROWS): V4's projections (128 x 128
    E8M0 blocks) at FP8_ROWS rows through `w8a16` (grouped_gemm's default: the GEMV / dot kernel), `w8a8`
    (layers/linear.py fp8_linear as Linear runs it: act_quant with rows padded, the E8M0 scales widened to fp32
    each call, cuBLAS blockwise torch._scaled_mm), `w8a8-fp32-scales` (the same with the weight scales
    already fp32: act_quant + _scaled_mm only), `w8a16-swap-*` (grouped_gemm's opt-in swapped dot over
    SWAP_TILES, its K split from split_k_for), beside `cublas-bf16` on the bf16 weight. Device time of all of
    a path's kernels and their count (launches); GBs counts the FP8 weight bytes."""
    import math
    import torch.nn.functional as F

    from deepinfer.formats.quant import scale_to_float
    from deepinfer.kernels import fp8_gemm as fg
    from deepinfer.kernels.act_quant import act_quant
    from deepinfer.layers.linear import fp8_linear

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K in DENSE_SHAPES:
        nbytes = N * K
        copies = max(2, math.ceil(256e6 / nbytes))
        ws = [((torch.randn(N, K, device="cuda") * 8).to(torch.float8_e4m3fn),
               torch.randint(115, 125, (-(-N // 128), -(-K // 128)), dtype=torch.uint8, device="cuda")
               .view(torch.float8_e8m0fnu)) for _ in range(copies)]
        ws = [(w, s, scale_to_float(s).contiguous()) for w, s in ws]
        it = itertools.cycle(ws)
        dense = itertools.cycle([(torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
                                 for _ in range(max(2, math.ceil(256e6 / (2 * nbytes))))])

        def w8a16(a):
            w, s, _ = next(it)
            return gg.grouped_gemm(a, w, None, s, (128, 128))

        def swapped(a, cfg, sk):
            w, s, _ = next(it)
            return gg._launch(a, w, None, s, (128, 128), swap=True, split_k=sk, **cfg)

        def fp32_scales(a):
            w, _, s32 = next(it)
            q, qs = act_quant(a, 128, rows=-(-a.shape[0] // fg.ROW_PAD) * fg.ROW_PAD)
            return torch._scaled_mm(q, w.t(), scale_a=qs, scale_b=s32.t(), out_dtype=torch.bfloat16)

        for M in FP8_ROWS:
            a = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            variants = [("cublas-bf16", lambda: F.linear(a, next(dense))),
                        ("w8a16", lambda: w8a16(a)),
                        ("w8a8", lambda: fp8_linear(a, *next(it)[:2], (128, 128))),
                        ("w8a8-fp32-scales", lambda: fp32_scales(a))]
            for bn, nw, ns in SWAP_TILES:  # grouped_gemm's swapped dot (opt-in): rows as the MMA's N
                cfg = dict(BLOCK_M=min(64, max(16, 1 << (M - 1).bit_length())), BLOCK_N=bn, BLOCK_K=128,
                           num_warps=nw, num_stages=ns)
                sk = gg.split_k_for(gg.max_m_tiles(M, 1, cfg["BLOCK_M"], True), N, K, cfg, sms)
                variants.append((f"w8a16-swap-bm{cfg['BLOCK_M']}-bn{bn}-w{nw}-s{ns}-sk{sk}",
                                 lambda cfg=cfg, sk=sk: swapped(a, cfg, sk)))
            for name, f in variants:
                _timed_row(rows, {"kernel": "fp8-rows", "N": N, "K": K, "M": M, "impl": name}, f,
                           2 * nbytes if name.startswith("cublas") else nbytes)
        del ws, dense, it

# V4's routed experts: w1 / w3 and w2 (N, K), 256 experts
EXPERT_SHAPES, EXPERTS = ((2048, 4096), (4096, 2048)), 256


def fp8_experts(rows: list) -> None:
    """V4's routed experts at decode through W8A16: 256 experts, FP8 codes with folded (1, 128) E8M0 scales,
    w1 / w3 (N 2048, K 4096) and w2 (N 4096, K 2048), 1 and 8 tokens x 6 experts routed at random (a new
    routing each call, from 8 drawn beforehand, so the experts read are rarely in the L2): grouped_gemm's
    default (`triton-auto`: the GEMV), the dot kernel's default tiles and split, GEMV_EXPERT_SWEEP. GBs: the
    FP8 bytes of the experts a call reads (distinct experts of its routing)."""
    E = EXPERTS
    for N, K in EXPERT_SHAPES:
        w = (torch.randn(E, N, K, device="cuda") * 8).to(torch.float8_e4m3fn)
        s = torch.randint(115, 125, (E, N, K // 128), dtype=torch.uint8, device="cuda")
        for tokens in (1, 8):
            M = tokens * 6
            routings = []
            for _ in range(8):
                idx = torch.stack([torch.randperm(E, device="cuda")[:6] for _ in range(tokens)])
                counts = torch.bincount(idx.flatten(), minlength=E)
                routings.append((torch.randn(M, K, device="cuda").to(torch.bfloat16),
                                 torch.cumsum(counts, 0).to(torch.int32), int((counts > 0).sum())))
            touched = sum(r[2] for r in routings) / len(routings)
            it = itertools.cycle(routings)

            def routed(launch, it=it):  # each call: the next routing's rows and offsets
                def f():
                    a, offs, _ = next(it)
                    return launch(a, offs)
                return f
            variants = [("triton-auto", routed(lambda a, offs: gg.grouped_gemm(a, w, offs, s, (1, 128)))),
                        ("triton-dot-auto", routed(lambda a, offs, kw=dot_default_kwargs(M, E, N, K, False):
                                                   gg._launch(a, w, offs, s, (1, 128), **kw)))]
            for r, bn, bk, nw, ns in () if QUICK else GEMV_EXPERT_SWEEP:
                kw = gemv_kwargs(M, E, N, K, False, (bn, bk, nw, ns, None), rows=r)
                variants.append((gemv_label(kw), routed(lambda a, offs, kw=kw: gg._launch(a, w, offs, s, (1, 128),
                                                                                        **kw))))
            for name, f in variants:
                _timed_row(rows, {"kernel": "fp8-experts", "N": N, "K": K, "tokens": tokens, "M": M, "impl": name},
                           f, touched * N * K)
        del w, s


def graph_ms(f, calls: int = 20) -> float:
    """ms per call of `calls` calls of f captured in one CUDA graph and replayed: what a decode graph pays,
    the gaps between its launches included (profiler device time leaves them out)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            f()
    return bench(graph.replay) / calls


def _timed_row(rows: list, row: dict, f, nbytes: float) -> None:
    """Times f (profiler device time and launches, then in a CUDA graph: graph_ms), appending the row with
    GBs = nbytes / device time; a launch that fails (a tile that does not fit) is an error row, not the end
    of the sweep, and a call that cannot be captured leaves graph_ms out."""
    try:
        t, n = device_time_and_launches(f)
    except Exception as e:  # noqa: BLE001
        rows.append({**row, "error": str(e)[:200]})
        print(json.dumps(rows[-1]), flush=True)
        return
    out = {**row, "ms": t, "launches": n, "GBs": nbytes / t / 1e6}
    try:
        out["graph_ms"] = graph_ms(f)
    except Exception as e:  # noqa: BLE001
        out["graph_error"] = str(e)[:200]
    rows.append(out)
    print(json.dumps(rows[-1]), flush=True)


def _pair(it):
    """The next (weight, scale) of an FP8 copy cycle, as grouped_gemm's (w, offs=None, scale) arguments."""
    w, s = next(it)
    return w, None, s


def argmax_sweep(rows: list) -> None:
    """The sampler's greedy argmax over V4's vocabulary (fp32 logits [R, 129280]): torch.argmax against
    row_argmax (defaults, then other block widths / warps / grid targets) at R = 1, 8, 64, 256. us: kernel
    device time per call; graph_us: per call in a CUDA graph of 20 calls (launch gaps included); GBs: the
    logits read once."""
    from deepinfer.kernels import row_argmax as ra

    V = 129280
    variants = [(b, w, p) for b, w, p in itertools.product((1024, 2048, 4096, 8192), (4, 8), (264, 512, 1056))
                if (b, w, p) != (ra.BLOCK_V, ra.NUM_WARPS, ra.TARGET_PROGRAMS)]
    for R in (1, 8, 64, 256):
        x = torch.randn(R, V, device="cuda")
        x[:, V - 1] = x.amax(-1)  # a tie with each row's earlier maximum (the earlier index wins)
        want = x.argmax(-1)
        impls = [("torch", lambda: x.argmax(-1), None), ("row_argmax", lambda: ra.row_argmax(x), ra.plan(R, V))]
        impls += [(f"row_argmax-b{b}-w{w}-p{p}", lambda b=b, w=w, p=p: ra._launch(x, b, w, p), ra.plan(R, V, b, p))
                  for b, w, p in variants]
        for name, f, split in impls:
            assert torch.equal(f(), want), name
            t, n = device_time_and_launches(f)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    f()
            g_ms = bench(graph.replay) / 20
            rows.append({"kernel": "argmax", "R": R, "V": V, "impl": name, "us": t * 1e3, "launches": n,
                         "graph_us": g_ms * 1e3, "GBs": R * V * 4 / t / 1e6, "slices": split and split[0]})
            print(json.dumps(rows[-1]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweeps = {"moe": moe_sweep, "attn": attn_sweep, "attn-kinds": attn_kinds, "rope": rope_sweep,
              "decode-small": decode_small, "dense-small": dense_small, "fp8-small": fp8_small, "fp8-rows": fp8_rows,
              "argmax": argmax_sweep}
    ap.add_argument("--only", choices=tuple(sweeps))
    ap.add_argument("--quick", action="store_true", help="fp8-small: the default kernels only (cuBLAS bf16, "
                    "grouped_gemm's default, the dot kernel's default)")
    ap.add_argument("--out")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    global QUICK
    QUICK = args.quick
    torch.manual_seed(0)
    rows: list = []
    for name, sweep in sweeps.items():
        if args.only in (None, name):
            sweep(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "commit": recorded_commit(args), "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
