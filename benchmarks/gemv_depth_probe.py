"""GEMV tiles with deeper pipelines at one token (H200): V4's decode projections and the fused expert launches,
each timed as 20 calls in one CUDA graph over weights (and routings) that together exceed the L2.

Rows: shape, tiles (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k), us per call (median of ROUNDS timings),
GB/s of FP8 bytes read. `default` is what grouped_gemm / grouped_gemv_fused pick today; it is timed first and last.
--grid wide tries wider K tiles (up to 2048 FP8 columns), 1 to 4 warps and 1 to 4 stages (one stage: plain loads
to registers, no shared-memory pipeline).

    python benchmarks/gemv_depth_probe.py [--grid wide] --commit <hash> --out benchmarks/results/<file>.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from common import add_commit_arg, recorded_commit, refuse_existing_out
from deepinfer.kernels import grouped_gemm as gg

CALLS = 20
ROUNDS = 3
GRIDS = {
    "depth": [(bn, bk, nw, ns) for (bn, nw), bk, ns in itertools.product(((8, 2), (16, 2), (16, 4), (32, 4)),
                                                                           (256, 512), (3, 5))],
    "wide": [(bn, bk, nw, ns) for bn, bk, (nw, ns) in itertools.product(
        (8, 16), (512, 1024, 2048), ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (2, 4)))
        if 16 <= bn * bk // (32 * nw) <= 256],  # 1 to 16 loads of 16 bytes a thread and K tile
}


def timed(fn) -> float:
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 10 / CALLS * 1e3)
    return sorted(times)[ROUNDS // 2]


def scale(*shape):
    return torch.randint(118, 124, shape, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)


def fp8(*shape):
    return (torch.randn(*shape, device="cuda") * 4).to(torch.float8_e4m3fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="depth")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    tiles_grid = GRIDS[args.grid]
    rows = []

    def record(shape, tiles, us, nbytes):
        rows.append({"shape": shape, "tiles": tiles, "us": round(us, 2), "GBs": round(nbytes / us / 1e3, 1)})
        print(json.dumps(rows[-1]), flush=True)

    def sweep(shape, nbytes, K, default, tiled, **fixed):
        """default(i), then tiled(i, tiles) over the grid (K a whole number of K tiles), then default again."""
        record(shape, "default", timed(default), nbytes)
        for bn, bk, nw, ns in tiles_grid:
            if K % bk == 0:
                tiles = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, split_k=1, **fixed)
                record(shape, [bn, bk, nw, ns, 1], timed(lambda i: tiled(i, tiles)), nbytes)
        record(shape, "default (again)", timed(default), nbytes)

    for N, K in ((4096, 8192), (40960, 1024), (4096, 4096), (1536, 4096)):
        copies = max(2, -(-300_000_000 // (N * K)))
        ws = [(fp8(N, K), scale(N // 128, K // 128)) for _ in range(copies)]
        a = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        sweep(f"linear {N}x{K}", N * K, K,
              lambda i: gg.grouped_gemm(a, ws[i % copies][0], None, ws[i % copies][1], (128, 128)),
              lambda i, t: gg._launch(a, ws[i % copies][0], None, ws[i % copies][1], (128, 128), gemv=True, **t))
        del ws
    # wo_a: 8 groups of 1024 x 4096, one row each (Linear.forward_grouped at one token)
    G, O, I = 8, 1024, 4096
    copies = 10
    ws = [(fp8(G, O, I), scale(G, O // 128, I // 128)) for _ in range(copies)]
    a8 = torch.randn(G, I, device="cuda", dtype=torch.bfloat16)
    o8 = torch.arange(1, G + 1, dtype=torch.int32, device="cuda")
    sweep("wo_a 8 x 1024x4096", G * O * I, I,
          lambda i: gg.grouped_gemm(a8, ws[i % copies][0], o8, ws[i % copies][1], (128, 128)),
          lambda i, t: gg._launch(a8, ws[i % copies][0], o8, ws[i % copies][1], (128, 128), gemv=True, **t), ROWS=1)
    del ws
    # experts: 256 x (F 2048, D 4096), 6 routed rows + the shared expert as group 256 (grouped_gemv_fused)
    E, F, D = 256, 2048, 4096
    w1, w3, w2 = fp8(E, F, D), fp8(E, F, D), fp8(E, D, F)
    s1, s3, s2 = scale(E, F, D // 128), scale(E, F, D // 128), scale(E, D, F // 128)
    x1, x3, x2 = fp8(F, D), fp8(F, D), fp8(D, F)
    t1, t3, t2 = scale(F // 128, D // 128), scale(F // 128, D // 128), scale(D // 128, F // 128)
    offs = []
    for _ in range(CALLS):
        ids = torch.randperm(E)[:6].sort().values
        counts = torch.zeros(E + 1, dtype=torch.int32)
        counts[ids] = 1
        counts[E] = 1
        offs.append(counts.cumsum(0).to(torch.int32).cuda())
    a13 = torch.randn(7, D, device="cuda", dtype=torch.bfloat16)
    a2 = torch.randn(7, F, device="cuda", dtype=torch.bfloat16)
    up = dict(pair=(w3, s3), extra=((x1, t1), (x3, t3)), extra_block=(128, 128))
    for name, a, w, s, kw, nbytes in (("experts w1|w3 + shared", a13, w1, s1, up, 7 * 2 * F * D),
                                      ("experts w2 + shared", a2, w2, s2, dict(extra=(x2, t2), extra_block=(128, 128)),
                                       7 * F * D)):
        sweep(name, nbytes, w.shape[2], lambda i: gg.grouped_gemv_fused(a, w, s, offs[i], (1, 128), **kw),
              lambda i, t: gg.grouped_gemv_fused(a, w, s, offs[i], (1, 128), **kw, **t), ROWS=1)
    out = {"device": torch.cuda.get_device_name(), "commit": recorded_commit(args), "calls_per_graph": CALLS,
           "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
