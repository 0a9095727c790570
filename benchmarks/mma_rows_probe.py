"""Does a GEMM row's result depend on the tile shape around it? (GPU probe for batch invariance.)

Batch-invariant mode runs every GEMM with one fixed tiling (BLOCK_M x BLOCK_N x BLOCK_K) whatever
the row count, which costs speed: 64-row tiles waste the tensor cores at decode, and prefill would
prefer other tiles. A row's reduction order over K is set by BLOCK_K and the split count; whether
the tensor-core instruction (mma.sync for 16-row tiles, wgmma for 64+ rows on Hopper, different
N widths) rounds the same is a hardware question this probe answers: the same x rows times the
same weight, bf16 and fp32 inputs, through kernels/invariant_matmul.py's kernel and the grouped
GEMM at several BLOCK_M / BLOCK_N / num_warps, compared bit for bit with the fixed tiling.

    python benchmarks/mma_rows_probe.py [--out results.json]

If every variant with the same BLOCK_K matches, invariant mode may pick BLOCK_M (and BLOCK_N) by
shape and keep bit-identical rows; any mismatch means the fixed tiling must stay.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from common import add_commit_arg, recorded_commit, refuse_existing_out

from deepinfer.kernels import grouped_gemm as gg
from deepinfer.kernels import invariant_matmul as im


def run_matmul(x, w, bm, bn, bk, warps):
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    im._matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), 1)](
        x, w, out, M, N, x.stride(0), w.stride(0), N, K=K, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        BM=bm, BN=bn, BK=bk, SPLITS=1, num_warps=warps, num_stages=3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    torch.manual_seed(0)
    rows = []
    for dtype, (M, N, K) in itertools.product((torch.bfloat16, torch.float32), ((200, 1024, 4096), (7, 512, 1024))):
        x = torch.randn(M, K, device="cuda").to(dtype)
        w = (torch.randn(N, K, device="cuda") * 0.02).to(dtype)
        base = run_matmul(x, w, im.BLOCK_M, im.BLOCK_N, im.BLOCK_K, 4)
        for bm, bn, warps in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8)):
            if dtype == torch.float32 and bm * bn > 64 * 64:
                continue  # fp32 operands: large tiles exceed shared memory
            try:
                got = run_matmul(x, w, bm, bn, im.BLOCK_K, warps)
            except Exception as e:  # noqa: BLE001 - a config the compiler refuses is a result too
                rows.append({"kernel": "invariant_matmul", "dtype": str(dtype), "M": M, "N": N, "K": K, "BM": bm,
                             "BN": bn, "warps": warps, "error": type(e).__name__})
                continue
            rows.append({"kernel": "invariant_matmul", "dtype": str(dtype), "M": M, "N": N, "K": K, "BM": bm,
                         "BN": bn, "warps": warps, "identical": bool(torch.equal(got, base)),
                         "max_abs_diff": (got - base).abs().max().item()})
            print(json.dumps(rows[-1]), flush=True)
    # grouped GEMM (routed experts): 6 experts with uneven rows, dense bf16 and FP8 weights
    counts = [1, 5, 0, 37, 2, 19]
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts), 4096, device="cuda").to(torch.bfloat16)
    wd = (torch.randn(6, 2048, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    w8 = (torch.randn(6, 2048, 4096, device="cuda") * 4).to(torch.float8_e4m3fn)
    s8 = torch.randint(117, 122, (6, 16, 32), device="cuda", dtype=torch.uint8).view(torch.float8_e8m0fnu)
    for fmt, (w, s) in {"bf16": (wd, None), "fp8": (w8, s8)}.items():
        base = gg.grouped_gemm(a, w, offs, s, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
        for bm, bn, warps in itertools.product((16, 32, 64, 128), (64, 128), (4, 8)):
            got = gg.grouped_gemm(a, w, offs, s, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, num_warps=warps, num_stages=3)
            rows.append({"kernel": "grouped_gemm", "fmt": fmt, "BM": bm, "BN": bn, "warps": warps,
                         "identical": bool(torch.equal(got, base)),
                         "max_abs_diff": (got.float() - base.float()).abs().max().item()})
            print(json.dumps(rows[-1]), flush=True)
    same = [r for r in rows if r.get("identical")]
    print(f"{len(same)} of {len(rows)} variants give the fixed tiling's bits")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "commit": recorded_commit(args), "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
