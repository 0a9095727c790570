"""Registers, spills and shared memory of the grouped FP8 GEMM (kernels/grouped_gemm_fp8.py) on sm_90, no GPU.

Each (variant, tile configuration) is launched with CPU tensors of V4-Flash's routed-expert shapes inside
tests/kernels/sm90.py's recorder and compiled ahead of time for sm_90 with the JIT's argument
specialisation (`compile_sm90(..., specialize=True)`: what the H200 would build for these shapes).
Triton 3.6's CompiledKernel fills n_regs / n_spills only when it loads the cubin on a device
(CompiledKernel._init_handles asks the driver), so they are read here from `ptxas -v` run on the
kernel's PTX with the ptxas bundled in Triton's wheel (the compiler's own options for sm_90a, line info
only); shared memory is the compiled metadata's `shared` (bytes a CTA allocates, all pipeline stages).

Per row: registers per thread, spill stores / loads and stack frame bytes, shared bytes, how many CTAs
fit an SM by registers (65536 per SM, allocated per warp in units of 256) and by shared memory (228 KiB
per SM, 1 KiB reserved per CTA, at most 227 KiB per CTA: above that the launch fails), and the loads
the pipeliner put in flight (cp.async or TMA copies in the TTGIR).

    python benchmarks/sm90_kernel_resources.py --out benchmarks/results/<date>-sm90-grouped-gemm-fp8-resources.json
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels"), str(ROOT / "benchmarks")]

import triton  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402

from common import add_commit_arg, recorded_commit, refuse_existing_out  # noqa: E402
from sm90 import compile_sm90, record  # noqa: E402

from deepinfer.kernels import grouped_gemm_fp8 as g8  # noqa: E402

REGS_PER_SM, SMEM_PER_SM, SMEM_PER_CTA, SMEM_RESERVED, MAX_WARPS = 65536, 228 * 1024, 227 * 1024, 1024, 64
# V4-Flash's routed experts at 8192 tokens x top-6 (256 experts): w1 / w3 and w2
SHAPES = {"w1": (2048, 4096), "w2": (4096, 2048)}
EXPERTS, ROWS = 256, 8192 * 6


def grid_configs() -> list[dict]:
    """BLOCK_M 64 / 128 x BLOCK_N 64 / 128 / 256 x 4 / 8 warps x 3 / 4 / 5 stages, BLOCK_K 128."""
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=128, num_warps=w, num_stages=s)
            for m in (64, 128) for n in (64, 128, 256) for w in (4, 8) for s in (3, 4, 5)]


def label(cfg: dict) -> str:
    return "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}/w{num_warps}/s{num_stages}".format(**cfg)


def ptxas_usage(ptx: str) -> dict:
    """registers / spill bytes / stack frame from `ptxas -v` on the PTX (sm_90a, as Triton assembles it)."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(90).path, "-lineinfo", "-v", "--gpu-name=sm_90a", str(src), "-o",
                              str(Path(d) / "k.o")], capture_output=True, text=True, check=True)
    log = res.stderr

    def grab(pattern: str) -> int:
        m = re.search(pattern, log)
        if m is None:
            raise ValueError(f"sm90_kernel_resources: no '{pattern}' in ptxas -v output:\n{log}")
        return int(m.group(1))
    return dict(registers=grab(r"Used (\d+) registers"), spill_stores=grab(r"(\d+) bytes spill stores"),
                spill_loads=grab(r"(\d+) bytes spill loads"), stack_frame=grab(r"(\d+) bytes stack frame"))


def occupancy(regs: int, warps: int, shared: int) -> dict:
    """CTAs an SM holds by registers (per-warp allocation, 8-register granularity per thread) and shared memory."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_smem = SMEM_PER_SM // (shared + SMEM_RESERVED) if shared <= SMEM_PER_CTA else 0
    return dict(ctas_by_registers=by_regs, ctas_by_shared=by_smem,
                ctas_per_sm=min(by_regs, by_smem, MAX_WARPS // warps), fits=shared <= SMEM_PER_CTA)


def resources(variant: str, cfg: dict, shape: str = "w1", programs: int | None = None) -> dict:
    """One row: the launch recorded at V4's expert shape and compiled for sm_90 as the JIT would."""
    N, K = SHAPES[shape]
    e4 = torch.float8_e4m3fn
    row = dict(variant=variant if programs is None else f"{variant}-persistent", config=label(cfg), shape=shape,
               N=N, K=K, **cfg)
    try:
        with record() as got:
            g8._launch(torch.empty(ROWS, K, dtype=e4), torch.empty(K // 128, ROWS).t(),  # act_quant's column-major
                       torch.empty(EXPERTS, N, K, dtype=e4),
                       torch.zeros(EXPERTS, N, K // 128, dtype=torch.uint8).view(torch.float8_e8m0fnu),
                       torch.zeros(EXPERTS, dtype=torch.int32), 128, (1, 128), variant=variant, programs=programs,
                       **cfg)
    except ValueError as e:  # tiles the variant's launcher refuses (variant "gluon": BLOCK_M == 16 * num_warps)
        return dict(row, error=f"refused: {e}")
    (launch,) = got
    try:
        kernel = compile_sm90(launch, specialize=True)
    except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a result too
        return dict(row, error=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
    ttgir = kernel.asm["ttgir"]
    usage = ptxas_usage(kernel.asm["ptx"])
    return dict(row, **usage, shared=kernel.metadata.shared,
                async_copies=ttgir.count("ttg.async_copy_global_to_local"),
                tma_copies=ttgir.count("ttng.async_tma_copy_global_to_local"),
                **occupancy(usage["registers"], cfg["num_warps"], kernel.metadata.shared))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(g8.VARIANTS), help=f"comma-separated, of {g8.VARIANTS}")
    ap.add_argument("--persistent", type=int, default=132,
                    help="variant tma also as a persistent grid of this many programs (the H200's SMs; 0: not)")
    ap.add_argument("--shapes", default="w1", help="comma-separated of w1 (N 2048, K 4096), w2 (N 4096, K 2048)")
    ap.add_argument("--out", default=None, help="results JSON (default: printed only)")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    from fp8_gemm_bench import SWEEP
    configs = grid_configs()
    for entry in SWEEP:  # the bench's tile choices outside the grid (its variants are compiled below anyway)
        tiles = {k: entry[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
        configs += [tiles] if tiles not in configs else []
    rows = []
    for shape in args.shapes.split(","):
        runs = [(v, None) for v in args.variants.split(",")]
        runs += [("tma", args.persistent)] if "tma" in args.variants.split(",") and args.persistent else []
        for variant, programs in runs:
            for cfg in configs:
                r = resources(variant, cfg, shape, programs)
                rows.append(r)
                if "error" in r:
                    print(f"{r['variant']:14} {shape} {r['config']:22} error: {r['error']}", flush=True)
                    continue
                print(f"{r['variant']:14} {shape} {r['config']:22} regs {r['registers']:3}  spill st/ld "
                      f"{r['spill_stores']:4}/{r['spill_loads']:4}  shared {r['shared']:6}  CTAs/SM {r['ctas_per_sm']} (regs "
                      f"{r['ctas_by_registers']}, smem {r['ctas_by_shared']})", flush=True)
    ptxas_version = subprocess.run([get_ptxas(90).path, "--version"], capture_output=True, text=True).stdout
    result = dict(commit=recorded_commit(args), date=date.today().isoformat(), target="sm_90 (ahead of time, no GPU)",
                  command="python " + " ".join(["benchmarks/sm90_kernel_resources.py"] + sys.argv[1:]),
                  triton=triton.__version__, ptxas=ptxas_version.strip().splitlines()[-1], experts=EXPERTS, rows_m=ROWS,
                  default_config=g8.default_config(ROWS, EXPERTS), rows=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
