"""FP8 linear GEMMs at the Flash slices' projection shapes: bf16 cuBLAS vs W8A16 vs W8A8.

Paths, each timed alone on the same input x [M, K] bf16 (weights random, in the checkpoint's format):
  bf16          F.linear on a bf16 copy of the weight (cuBLAS), the bf16 engine's GEMM;
  w8a16         kernels/grouped_gemm.py, one group, default tiles: what Linear runs below FP8_GEMM_ROWS;
  w8a8          layers/linear.py fp8_linear: act_quant (1 x 128, pow2 scales) + fp8_gemm with the backend
                Linear picks (torch._scaled_mm blockwise for 128 x 128 blocks where it runs, else Triton);
  w8a8-triton   the same with the Triton FP8 GEMM forced;
  act_quant     the activation quantisation alone (part of both w8a8 rows).
Each row: median microseconds (triton.testing.do_bench on CUDA, L2 flushed before every call), TFLOP/s
(2 M N K), GB/s (weight + x + out bytes), and the ratio to the roofline of that path:
max(bytes / measured copy bandwidth, FLOPs / peak) with peaks 790 TFLOP/s (bf16 / W8A16 operands) and
1580 TFLOP/s (W8A8), the H200's nominal dense rates (spec deepseek-v4.md 6.4). `linear_path` says which
path Linear.forward takes at that M. wo_a is one of its 8 groups (count 8 per layer).

    python benchmarks/fp8_gemm_bench.py --out benchmarks/results/2026-12-01-h200-fp8-gemm.json
    python benchmarks/fp8_gemm_bench.py --smoke   # tiny shapes on the CPU (torch references); temp dir
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from common import add_commit_arg, recorded_commit

from deepinfer.formats.quant import dequant_fp8_blocks
from deepinfer.kernels.act_quant import act_quant
from deepinfer.kernels.fp8_gemm import fp8_gemm, use_scaled_mm
from deepinfer.kernels.grouped_gemm import grouped_gemm
from deepinfer.layers.linear import ACT_GROUP, FP8_GEMM_ROWS, fp8_gemm_rows, fp8_linear

PEAK_TFLOPS = {"bf16": 790.0, "w8a16": 790.0, "w8a8": 1580.0, "w8a8-triton": 1580.0, "act_quant": 1580.0}
# (name, N, K, count per layer): V4-Flash (128 x 128 blocks) and V4.1-Flash (32 x 32), fused as the model runs them
SHAPES = {
    "v4": ((128, 128), [("wq_a+wkv", 1536, 4096, 1), ("wq_b", 32768, 1024, 1), ("wo_a group", 1024, 4096, 8),
                        ("wo_b", 4096, 8192, 1), ("indexer.wq_b", 8192, 1024, 1),
                        ("shared w1+w3", 4096, 4096, 1), ("shared w2", 4096, 2048, 1)]),
    "v41": ((32, 32), [("wq_a+wkv", 1792, 5120, 1), ("wq_b", 32768, 1280, 1), ("wo_a group", 1024, 4096, 8),
                       ("wo_b", 5120, 8192, 1), ("indexer.wq_b", 4096, 1280, 1),
                       ("shared w1+w3", 4608, 5120, 1), ("shared w2", 5120, 2304, 1)]),
}
SMOKE_SHAPES = {"v4": ((128, 128), [("tiny", 256, 256, 1), ("tiny group", 128, 256, 2)]),
                "v41": ((32, 32), [("tiny", 96, 128, 1)])}
PATHS = ("bf16", "w8a16", "w8a8", "w8a8-triton", "act_quant")


def timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: 1e3 * do_bench(fn, warmup=10, rep=50, return_mode="median")

    def cpu(fn, reps: int = 3) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return 1e6 * sorted(ts)[len(ts) // 2]
    return cpu


def copy_gbps(device: str) -> float:
    """Device copy bandwidth (read + write bytes / s), the roofline's byte rate."""
    if device != "cuda":
        return 1.0
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timer(device)(lambda: dst.copy_(src))
    return 2 * src.numel() / us / 1e3


def make_weight(N: int, K: int, block: tuple[int, int], device: str):
    w = (torch.randn(N, K, device=device) * 4).to(torch.float8_e4m3fn)
    s = torch.randint(117, 122, (-(-N // block[0]), -(-K // block[1])), dtype=torch.uint8, device=device)
    return w, s.view(torch.float8_e8m0fnu)


def paths(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> dict:
    wb = dequant_fp8_blocks(w, s, block, torch.bfloat16)

    def w8a8_triton():
        q, qs = act_quant(x, ACT_GROUP)
        return fp8_gemm(q, qs, w, s, ACT_GROUP, block, "triton")

    return {"bf16": lambda: F.linear(x, wb), "w8a16": lambda: grouped_gemm(x, w, None, s, block),
            "w8a8": lambda: fp8_linear(x, w, s, block), "w8a8-triton": w8a8_triton,
            "act_quant": lambda: act_quant(x, ACT_GROUP)}


def bytes_moved(path: str, M: int, N: int, K: int) -> int:
    xb = M * K * 2
    if path == "act_quant":
        return xb + M * K + 4 * M * (K // ACT_GROUP)
    wb = N * K * (2 if path == "bf16" else 1)
    return wb + xb + M * N * 2


def bench(slices: list[str], ms: list[int], device: str, smoke: bool) -> tuple[list[dict], float]:
    time_us = timer(device)
    gbps = copy_gbps(device)
    rows = []
    for sl in slices:
        block, shapes = (SMOKE_SHAPES if smoke else SHAPES)[sl]
        for name, N, K, count in shapes:
            w, s = make_weight(N, K, block, device)
            for M in ms:
                x = torch.randn(M, K, device=device).to(torch.bfloat16)
                picked = "w8a8" if fp8_gemm_rows(M, block) else "w8a16"
                backend = "scaled_mm" if use_scaled_mm(x.device, N, K, ACT_GROUP, block) else "triton"
                for path, fn in paths(x, w, s, block).items():
                    us = time_us(fn)
                    flops = 0 if path == "act_quant" else 2 * M * N * K
                    nbytes = bytes_moved(path, M, N, K)
                    roof = max(nbytes / gbps / 1e3, flops / PEAK_TFLOPS[path] / 1e6)
                    rows.append(dict(slice=sl, name=name, N=N, K=K, count=count, block=list(block), M=M, path=path,
                                     us=round(us, 2), tflops=round(flops / us / 1e6, 3), gbps=round(nbytes / us / 1e3, 3),
                                     roofline_us=round(roof, 2), x_roofline=round(us / roof, 2) if roof else None,
                                     linear_path=picked, w8a8_backend=backend if path == "w8a8" else
                                     ("triton" if path == "w8a8-triton" else None)))
                    print(f"{sl:4} {name:14} N={N:6} K={K:5} M={M:5} {path:12} {us:10.1f} us "
                          f"{rows[-1]['tflops']:8.1f} TFLOP/s {rows[-1]['gbps']:8.1f} GB/s  x{rows[-1]['x_roofline']}",
                          flush=True)
    return rows, gbps


def summary(rows: list[dict]) -> list[dict]:
    """Per slice and M: the layer's projection GEMMs summed (count-weighted) per path, and ratios to bf16."""
    out = []
    for sl in sorted({r["slice"] for r in rows}):
        for M in sorted({r["M"] for r in rows}):
            tot = {}
            for r in rows:
                if r["slice"] == sl and r["M"] == M:
                    tot[r["path"]] = tot.get(r["path"], 0.0) + r["us"] * r["count"]
            picked = next(r["linear_path"] for r in rows if r["slice"] == sl and r["M"] == M)
            out.append(dict(slice=sl, M=M, layer_us={k: round(v, 1) for k, v in tot.items()}, linear_path=picked,
                            linear_vs_bf16=round(tot[picked] / tot["bf16"], 3),
                            w8a8_vs_bf16=round(tot["w8a8"] / tot["bf16"], 3),
                            w8a16_vs_bf16=round(tot["w8a16"] / tot["bf16"], 3)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", default="v4,v41", help="comma-separated: v4 (128x128 blocks), v41 (32x32)")
    ap.add_argument("--m", default=f"1,64,{FP8_GEMM_ROWS},8192", help="comma-separated row counts")
    ap.add_argument("--out", default=None, help="results JSON (default: printed path under a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (torch references)")
    add_commit_arg(ap)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fp8_gemm_bench: needs CUDA (or --smoke)")
    ms = [int(m) for m in args.m.split(",")]
    if args.smoke:
        ms = [m for m in ms if m <= 64] + [FP8_GEMM_ROWS + 1]
    torch.manual_seed(0)
    with torch.inference_mode():
        rows, gbps = bench(args.slices.split(","), ms, device, args.smoke)
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result = dict(commit=recorded_commit(args), date=date.today().isoformat(), device=dev_name,
                  torch=torch.__version__, smoke=args.smoke, fp8_gemm_rows=FP8_GEMM_ROWS, copy_gbps=round(gbps, 1),
                  peak_tflops=PEAK_TFLOPS, rows=rows, summary=summary(rows))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fp8_gemm_bench_")) / "fp8_gemm_bench.json"
    out.write_text(json.dumps(result, indent=1))
    for s in result["summary"]:
        print(s)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
