"""Decode-size GEMMs over quantised weights: kernels/decode_gemm.py against grouped_gemm and bf16.

Cases, at the Flash slices' widths (weights random, in the checkpoint's formats):
  linear   the FP8 projections of fp8_gemm_bench.SHAPES (V4 128 x 128 blocks, V4.1 32 x 32) at
           M = 1, 4, 8, 16, 64 rows;
  experts  one routed-expert projection (w1: N = moe_intermediate_size, K = hidden; w2: the reverse)
           over T tokens x top-6 of E experts (random distinct experts per token, rows sorted by
           expert), FP4 as shipped ('fp4'), repacked as FP8 codes with (1, 32) scales ('fp8-1x32')
           and bf16.
Paths: bf16 (F.linear / torch._grouped_mm on a bf16 copy), grouped (grouped_gemm, its default
tiles: what ran before decode_gemm), decode (decode_gemm, default_config), and with --sweep each
decode tile configuration of SWEEP (the best kept per case, all in the JSON).
Each row: median us (triton.testing.do_bench, L2 flushed), GB/s over the bytes a perfect kernel
moves (the weight rows of the experts hit + activations + output), x_roofline against those bytes at
the measured copy bandwidth.

    python benchmarks/decode_gemm_bench.py --out benchmarks/results/DATE-h200-decode-gemm-COMMIT.json [--sweep]
    python benchmarks/decode_gemm_bench.py --smoke     # tiny shapes on the CPU (torch references)
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from common import add_commit_arg, recorded_commit
from fp8_gemm_bench import SHAPES, copy_gbps, make_weight, timer

from deepinfer.formats.quant import dequant_fp4, dequant_fp8_blocks, unpack_fp4
from deepinfer.kernels import decode_gemm as dg
from deepinfer.kernels.grouped_gemm import grouped_gemm

EXPERTS = {"v4": (256, 4096, 2048, 6), "v41": (384, 5120, 2304, 6)}  # E, hidden, moe_intermediate_size, top-k
LINEAR_M = (1, 4, 8, 16, 64)
TOKENS = (1, 4, 16, 64, 128)
SWEEP = dict(ROWS=(1, 2, 4, 8), BLOCK_N=(16, 32, 64), BLOCK_K=(128, 256), num_warps=(2, 4, 8), SPLIT_K=(1, 4, 16))


def routed(T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Expert ids of T tokens x k distinct experts, sorted: the grouped GEMM's row order."""
    return torch.rand(T, E, generator=g).topk(k, dim=1).indices.flatten().sort().values


def expert_case(E: int, N: int, K: int, fmt: str, device: str, g: torch.Generator):
    """(w, scale, block, bf16 copy) of one projection of E experts [E, N, K]."""
    codes = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
    s = torch.randint(117, 122, (E, N, K // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w, s = codes.to(device), s.to(device)
    dense = torch.stack([dequant_fp4(w[e], s[e], 32, torch.bfloat16) for e in range(E)])
    if fmt == "fp8-1x32":
        w = torch.stack([unpack_fp4(w[e]).to(torch.float8_e4m3fn) for e in range(E)])
    return w, s, (1, 32), dense


def cases(smoke: bool, device: str):
    """(kind, slice, name, fmt, a, w, offs, scale, block, dense, bytes) for every benchmarked GEMM."""
    g = torch.Generator().manual_seed(0)  # experts first: a --sweep budget reaches them before the linears
    for sl, (E, D, F_, k) in EXPERTS.items():
        if smoke:
            E, D, F_ = 8, 128, 64
        for name, N, K in (("w1", F_, D), ("w2", D, F_)):
            for fmt in ("fp4", "fp8-1x32"):
                w, s, block, dense = expert_case(E, N, K, fmt, device, g)
                for T in TOKENS[:2] if smoke else TOKENS:
                    ids = routed(T, E, k, g)
                    offs = torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32).to(device)
                    a = torch.randn(ids.numel(), K, device=device).to(torch.bfloat16)
                    hit = int(ids.unique().numel())
                    wbytes = hit * N * K // (2 if fmt == "fp4" else 1) + hit * N * K // 32
                    yield ("experts", sl, f"{name} T={T}", fmt, a, w, offs, s, block, dense,
                           wbytes + 2 * ids.numel() * (K + N))
    for sl, (block, shapes) in SHAPES.items():
        for name, N, K, _ in (shapes[:2] if smoke else shapes):
            N, K = (min(N, 256), min(K, 256)) if smoke else (N, K)
            w, s = make_weight(N, K, block, device)
            dense = dequant_fp8_blocks(w, s, block, torch.bfloat16)
            for M in LINEAR_M[:2] if smoke else LINEAR_M:
                a = torch.randn(M, K, device=device).to(torch.bfloat16)
                yield ("linear", sl, name, "fp8", a, w, None, s, block, dense, N * K + 2 * M * (K + N))


def bf16_path(a, dense, offs):
    if offs is None:
        return lambda: F.linear(a, dense)
    if hasattr(torch, "_grouped_mm") and a.is_cuda:
        wt = dense.transpose(1, 2)
        return lambda: torch._grouped_mm(a, wt, offs=offs)
    return lambda: grouped_gemm(a, dense, offs)


def run(args) -> dict:
    device = "cpu" if args.smoke else "cuda"
    time_us, gbps = timer(device), copy_gbps(device)
    rows, t_end = [], time.monotonic() + args.budget_s
    for kind, sl, name, fmt, a, w, offs, s, block, dense, nbytes in cases(args.smoke, device):
        if args.only and kind != args.only:
            continue
        paths = {"bf16": bf16_path(a, dense, offs),
                 "grouped": lambda: grouped_gemm(a, w, offs, s, block),
                 "decode": lambda: dg.decode_gemm(a, w, offs, s, block)}
        want = paths["bf16"]().float()
        base = dict(kind=kind, slice=sl, name=name, fmt=fmt, M=a.shape[0], N=w.shape[1], K=a.shape[1],
                    experts=1 if offs is None else w.shape[0], bytes=nbytes)
        for path, fn in paths.items():
            try:
                err = (fn().float() - want).abs().max().item()
            except Exception as e:  # recorded in the row; the other paths and cases still run
                rows.append(dict(base, path=path, error=f"{type(e).__name__}: {str(e)[-300:]}"))
                print(f"{kind:7} {sl:4} {name:14} {fmt:8} M={a.shape[0]:4} {path:8} failed: {type(e).__name__}")
                continue
            us = time_us(fn)
            rows.append(dict(base, path=path, us=round(us, 2), max_abs_diff=err,
                             gbps=round((2 * nbytes if path == "bf16" else nbytes) / us / 1e3, 1),
                             x_roofline=round(us / (nbytes / gbps / 1e3), 2),
                             config=dg.default_config(a.shape[0], base["experts"], w.shape[1], a.shape[1],
                                                      dg._format(w), 132) if path == "decode" else None))
            print(f"{kind:7} {sl:4} {name:14} {fmt:8} M={a.shape[0]:4} {path:8} {us:9.1f} us "
                  f"x{rows[-1]['x_roofline']:6}  err {err:.3g}", flush=True)
        if args.sweep and not args.smoke and time.monotonic() < t_end:
            best = None
            for vals in itertools.product(*SWEEP.values()):
                cfg = dict(zip(SWEEP, vals))
                if cfg["ROWS"] > max(1, -(-a.shape[0] // base["experts"])) * 2:
                    continue
                try:
                    us = time_us(lambda: dg._launch(a, w, offs, s, block, **cfg))
                except Exception as e:  # a tile the compiler refuses: recorded, not fatal
                    rows.append(dict(base, path="decode-sweep", config=cfg, error=str(e)[:200]))
                    continue
                rows.append(dict(base, path="decode-sweep", config=cfg, us=round(us, 2),
                                 x_roofline=round(us / (nbytes / gbps / 1e3), 2)))
                if best is None or us < best[0]:
                    best = (us, cfg)
                if time.monotonic() > t_end:
                    break
            if best:
                print(f"        best {best[0]:9.1f} us {best[1]}", flush=True)
    return dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", date=str(date.today()),
                commit=recorded_commit(args), copy_gbps=round(gbps, 1), rows=rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--only", choices=("linear", "experts"), help="one kind of case")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping after this many seconds")
    add_commit_arg(p)
    args = p.parse_args()
    res = run(args)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
