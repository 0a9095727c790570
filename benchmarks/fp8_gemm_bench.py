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

--experts: V4-Flash's routed experts instead (256 experts, top-6, hidden 4096, moe_inter 2048; w1 / w3
N=2048 K=4096, w2 N=4096 K=2048) at --tokens tokens a step (8192: 49152 expert-sorted rows), routing
uniform at random. Weights are FP4-origin FP8 codes as layers/moe.py holds them; paths per projection:
  bf16          torch._grouped_mm on bf16 copies of the experts (cutlass), the bf16 engine's path;
  w8a16         kernels/grouped_gemm.py on the (1, 32)-scaled codes (repacked, not folded);
  w8a16-folded  the same on (1, 128) scales (folded: what decode runs after the fold);
  w8a8          act_quant (1 x 128, pow2) + kernels/grouped_gemm_fp8.py on the folded codes;
  w8a8-gemm     the grouped FP8 GEMM alone (w1 and w3 share one act_quant).
  w8a8-gemm-tma, w8a8-gemm-tma-persistent  the same GEMM through grouped_gemm_fp8's variant "tma" (tensor
                descriptors; the MoE layer's path below GLUON_ROWS rows), one program per tile and persistent
                (opt-in: two programs per SM, default_config's tiles fit two CTAs an SM).
  w8a8-gemm-gluon, -gluon-m128, -s3, -s6, -g2, -serial  (CUDA) the same GEMM through variant "gluon"
                (kernels/grouped_gemm_fp8_gluon.py: a K step's wgmma in flight while the previous product is
                scaled; the MoE layer's path at prefill sizes): default tiles, 128-row tiles, 3 / 6 stages, K steps
                in groups of 2, and no overlap.
  w8a8-gemm-gluon-ws, -ws-g1, -ws-s6, -ws-persistent, -ws-persistent-g1  (CUDA) the same through variant
                "gluon"'s warp-specialised kernel (ws=True: a TMA producer warp and two ping-pong consumer warpgroups
                of 64 rows sharing a 128-column W tile): its default (4 stages, K steps in groups of 3), no overlap
                within a consumer (group_steps=1: only the other consumer's promotion beside an MMA), 6 stages, and
                persistent (one program an SM) with groups of 3 and of 1.
  w4a8          act_quant + kernels/grouped_gemm_fp8.py on the same experts as shipped: packed FP4 bytes
                [E, N, K/2] with their (1, 32) E8M0 scales (half the weight bytes of the FP8 codes); w4a8-gemm the
                GEMM alone; w4a8-gemm-plain the GEMM with the plain Triton nibble conversion instead of the PTX one;
                w4a16 kernels/grouped_gemm.py's FP4 path on the same packed bytes (bf16 activations, the weights
                dequantised to bf16 in registers): the other reader of 0.5 byte a weight.
                (Not engine paths yet: layers/moe.py repacks FP4 experts to FP8.)
  cublas-loop   (CUDA, a measurement, not an engine path) the same quantised rows as w8a8-gemm, one cuBLAS
                blockwise torch._scaled_mm per expert with (1, 128) scales on both operands, launched from
                Python; cublas-graph: that loop replayed from a CUDA graph (its GPU time without the host's
                launches). A path the device refuses is a row with its error.
Each row: median microseconds (do_bench, L2 flushed), TFLOP/s (2 rows N K), the relative Frobenius
distance of the path's output from bf16's. --sweep adds SWEEP's tile choices and variants of the grouped FP8
GEMM (path "w8a8-gemm", `config` and `variant` set) once per distinct projection shape (w1 and w2; w3 is w1's).
The summary sums a layer (w1 + w3 + w2; W8A8 and W4A8 with act_quant once per input) with ratios to bf16, and
says which path Experts takes at that row count (layers/moe.py W8A8_ROWS_PER_EXPERT). --sweep also times W4A8_SWEEP's
tile choices of the W4A8 GEMM (path "w4a8-gemm", `config` set).

    python benchmarks/fp8_gemm_bench.py --experts --tokens 1024,2048,4096,8192 \
        --out benchmarks/results/2026-12-01-h200-fp8-experts.json
    python benchmarks/fp8_gemm_bench.py --experts --tokens 8192 --sweep --out fp8-experts-sweep.json
    python benchmarks/fp8_gemm_bench.py --experts --tokens 1,64,512 --sweep --out w4a8-experts.json  # decode sizes
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

from common import add_commit_arg, recorded_commit, refuse_existing_out

from deepinfer.formats.quant import FP4_VALUES, dequant_fp8_blocks
from deepinfer.kernels import sm_count
from deepinfer.kernels.act_quant import act_quant
from deepinfer.kernels.fp8_gemm import fp8_gemm, use_scaled_mm
from deepinfer.kernels.grouped_gemm import grouped_gemm
from deepinfer.kernels.grouped_gemm_fp8 import grouped_gemm_fp8
from deepinfer.layers.linear import ACT_GROUP, FP8_GEMM_ROWS, fp8_gemm_rows, fp8_linear
from deepinfer.layers.moe import W8A8_ROWS_PER_EXPERT

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


# routed experts: (experts, top-k, [(projection, N, K, count per layer)])
EXPERTS = {"v4": (256, 6, [("w1", 2048, 4096, 1), ("w3", 2048, 4096, 1), ("w2", 4096, 2048, 1)])}
SMOKE_EXPERTS = {"v4": (8, 2, [("w1", 128, 256, 1), ("w3", 128, 256, 1), ("w2", 256, 128, 1)])}
EXPERT_PATHS = ("bf16", "w8a16", "w8a16-folded", "w8a8", "w8a8-gemm")
# rows beside them (a failure is recorded, not raised): the opt-in kernel variants and cuBLAS (CUDA only)
# (the gluon rows: variant "gluon" of grouped_gemm_fp8, sm_90 only, timed on CUDA only: gluon_paths)
MEASURED_PATHS = ("w8a8-gemm-tma", "w8a8-gemm-tma-persistent", "w8a8-gemm-gluon", "w8a8-gemm-gluon-m128",
                  "w8a8-gemm-gluon-s3", "w8a8-gemm-gluon-s6", "w8a8-gemm-gluon-g2", "w8a8-gemm-gluon-ws",
                  "w8a8-gemm-gluon-ws-g1", "w8a8-gemm-gluon-ws-s6", "w8a8-gemm-gluon-ws-persistent",
                  "w8a8-gemm-gluon-ws-persistent-g1", "w8a8-gemm-gluon-serial", "cublas-loop", "cublas-graph")
# variant "gluon" (kernels/grouped_gemm_fp8_gluon.py): its default tiles (64 x 128, one warpgroup, 4 stages, K steps
# in groups of 3: two of three promotions overlap the next wgmma), 128-row tiles of two warpgroups, 3 / 6 stages,
# groups of 2, the warp-specialised kernel (ws=True: its default, group_steps=1, 6 stages; persistent, groups of 3
# and 1) and the default kernel with no overlap (group_steps=1: wait 0 after every step), the A/B for the overlap
GLUON_PATHS = {"w8a8-gemm-gluon": {}, "w8a8-gemm-gluon-m128": dict(BLOCK_M=128, num_warps=8),
               "w8a8-gemm-gluon-s3": dict(num_stages=3), "w8a8-gemm-gluon-s6": dict(num_stages=6),
               "w8a8-gemm-gluon-g2": dict(group_steps=2), "w8a8-gemm-gluon-ws": dict(ws=True),
               "w8a8-gemm-gluon-ws-g1": dict(ws=True, group_steps=1),
               "w8a8-gemm-gluon-ws-s6": dict(ws=True, num_stages=6),
               "w8a8-gemm-gluon-ws-persistent": dict(ws=True, persistent=True),
               "w8a8-gemm-gluon-ws-persistent-g1": dict(ws=True, persistent=True, group_steps=1),
               "w8a8-gemm-gluon-serial": dict(group_steps=1)}
# --sweep: grouped_gemm_fp8 tile choices and opt-in variants timed beside its default (path "w8a8-gemm", `config`
# and `variant` set; programs_per_sm: variant "tma" on a persistent grid of that many programs per SM). None of
# them spills registers when compiled for sm_90 at these shapes (benchmarks/sm90_kernel_resources.py; results
# .../2026-12-02-sm90-grouped-gemm-fp8-resources-*.json), except the pointer variant's 128 x 128 x 128 / 8 warps
# (8 bytes); the two spilling choices of the first sweep (128 x 128 x 128 / 4 warps, 128 x 256 x 128) are left out.
_T = dict(BLOCK_K=128)
SWEEP = [dict(_T, BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4),          # default_config
         dict(_T, BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
         dict(_T, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),           # 3 CTAs an SM
         dict(_T, BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=4),
         dict(_T, BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=3),
         dict(_T, BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4),
         dict(_T, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=5)]
SWEEP += [dict(c, variant="tma") for c in SWEEP[:6]]
SWEEP += [dict(_T, BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=4, variant="tma"),
          dict(_T, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, variant="tma"),
          dict(_T, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, variant="tma"),
          dict(_T, BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, variant="tma", programs_per_sm=2),
          dict(_T, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, variant="tma", programs_per_sm=3),
          dict(_T, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, variant="tma", programs_per_sm=1)]
# --sweep, W4A8: grouped_gemm_fp8 on packed FP4 weights (variant "pointer"), 16-row (mma.sync) and 64-row (wgmma)
# tiles; none spills when built for sm_90 at V4's expert shapes (checked on the CPU by
# tests/kernels/test_grouped_gemm_fp8_w4a8.py, which builds every entry).
W4A8_SWEEP = [dict(_T, BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=4),          # w4a8_config at decode
              dict(_T, BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4),
              dict(_T, BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=6),
              dict(_T, BLOCK_M=16, BLOCK_N=256, num_warps=8, num_stages=4),
              dict(BLOCK_K=64, BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=8),
              dict(_T, BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=4),
              dict(_T, BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4),          # w4a8_config above
              dict(_T, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=6),
              dict(_T, BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=4),
              dict(_T, BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=3)]


def expert_offs(T: int, E: int, k: int, device: str) -> torch.Tensor:
    """Cumulative row ends of T tokens routed uniformly at random to k of E experts each (int32)."""
    idx = torch.rand(T, E, device=device).topk(k, dim=1).indices
    return torch.bincount(idx.flatten(), minlength=E).cumsum(0).to(torch.int32)


def expert_weights(E: int, N: int, K: int, dev, packed: bool = False):
    """FP4-origin e4m3 codes [E, N, K] and E8M0 scales per (1, 128); packed: also the same codes as shipped,
    two e2m1 codes a byte [E, N, K/2] int8 (even column in the low nibble)."""
    fp4 = torch.tensor(FP4_VALUES, device=dev)
    codes = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=dev)
    fp4_bytes = torch.empty(E, N, K // 2, dtype=torch.uint8, device=dev) if packed else None
    for e in range(E):  # one expert at a time bounds the temporaries
        idx = torch.randint(0, 16, (N, K), device=dev)
        codes[e] = fp4[idx].to(torch.float8_e4m3fn)
        if packed:
            fp4_bytes[e] = (idx[:, 0::2] | (idx[:, 1::2] << 4)).to(torch.uint8)
    s128 = torch.randint(112, 118, (E, N, K // 128), dtype=torch.uint8, device=dev).view(torch.float8_e8m0fnu)
    return (codes, s128, fp4_bytes.view(torch.int8)) if packed else (codes, s128)


def expert_paths(xs: torch.Tensor, offs: torch.Tensor, E: int, N: int, K: int) -> dict:
    """The paths of one expert projection [E, N, K] on expert-sorted rows xs (FP4-origin codes, random
    E8M0 scales per (1, 128); the (1, 32) copy repeats each scale four times: the same values)."""
    codes, s128, fp4_bytes = expert_weights(E, N, K, xs.device, packed=True)
    s32 = s128.view(torch.uint8).repeat_interleave(4, -1).view(torch.float8_e8m0fnu)
    wb = torch.stack([dequant_fp8_blocks(codes[e], s128[e], (1, 128), torch.bfloat16) for e in range(E)])
    q, qs = act_quant(xs, ACT_GROUP)

    def bf16():
        if xs.is_cuda:
            return torch._grouped_mm(xs, wb.transpose(1, 2), offs=offs)
        return grouped_gemm(xs, wb, offs)  # the CPU smoke run: the dense reference

    def w8a8():
        a, a_s = act_quant(xs, ACT_GROUP)
        return grouped_gemm_fp8(a, a_s, codes, s128, offs, ACT_GROUP, (1, 128))

    out = {"bf16": bf16, "w8a16": lambda: grouped_gemm(xs, codes, offs, s32, (1, 32)),
           "w8a16-folded": lambda: grouped_gemm(xs, codes, offs, s128, (1, 128)), "w8a8": w8a8,
           "w8a8-gemm": lambda: grouped_gemm_fp8(q, qs, codes, s128, offs, ACT_GROUP, (1, 128))}
    programs = 2 * (sm_count(xs.device) if xs.is_cuda else 1)
    for name, kw in (("w8a8-gemm-tma", {}), ("w8a8-gemm-tma-persistent", dict(programs=programs))):
        out[name] = lambda kw=kw: grouped_gemm_fp8(q, qs, codes, s128, offs, ACT_GROUP, (1, 128), variant="tma", **kw)

    def w4a8():
        a, a_s = act_quant(xs, ACT_GROUP)
        return grouped_gemm_fp8(a, a_s, fp4_bytes, s32, offs, ACT_GROUP, (1, 32))

    out["w4a8"] = w4a8
    out["w4a8-gemm"] = lambda: grouped_gemm_fp8(q, qs, fp4_bytes, s32, offs, ACT_GROUP, (1, 32))
    out["w4a8-gemm-plain"] = lambda: grouped_gemm_fp8(q, qs, fp4_bytes, s32, offs, ACT_GROUP, (1, 32),
                                                      **({"asm": False} if xs.is_cuda else {}))
    out["w4a16"] = lambda: grouped_gemm(xs, fp4_bytes, offs, s32, (1, 32))
    if xs.is_cuda:
        out.update(gluon_paths(q, qs, codes, s128, offs))
        out["cublas-loop"] = lambda: cublas_loop(q, qs, codes, s128, offs)()
        out["cublas-graph"] = _graphed(lambda: cublas_loop(q, qs, codes, s128, offs))
    return out


def gluon_paths(q: torch.Tensor, qs: torch.Tensor, codes: torch.Tensor, s128: torch.Tensor, offs: torch.Tensor) -> dict:
    """GLUON_PATHS: the grouped FP8 GEMM of w8a8-gemm (same quantised rows, codes and (1, 128) scales) through
    variant "gluon" with each entry's tiles."""
    return {name: lambda kw=kw: grouped_gemm_fp8(q, qs, codes, s128, offs, ACT_GROUP, (1, 128), variant="gluon", **kw)
            for name, kw in GLUON_PATHS.items()}


def cublas_loop(q: torch.Tensor, qs: torch.Tensor, codes: torch.Tensor, s128: torch.Tensor, offs: torch.Tensor):
    """The routed experts as one cuBLAS blockwise torch._scaled_mm per expert ((1, 128) scales on both operands)
    over act_quant's expert-sorted rows q [M, K] (scales qs) and codes [E, N, K]. Prepared here (host offsets, each
    expert's scales copied into the layouts the blockwise recipe takes: A's (rows, K / 128) column-major, W's
    (K / 128, N)); returns the call that runs the loop into one [M, N] bf16 output."""
    bounds = [0] + offs.tolist()
    out = torch.zeros(q.shape[0], codes.shape[1], dtype=torch.bfloat16, device=q.device)
    calls = []
    for e in range(codes.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            sa = qs[lo:hi].float().t().contiguous().t()
            sb = s128[e].float().t().contiguous()
            calls.append((q[lo:hi], codes[e].t(), sa, sb, out[lo:hi]))

    def run() -> torch.Tensor:
        for a, b, sa, sb, o in calls:
            o.copy_(torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
        return out
    return run


def _graphed(make):
    """A path that builds its call with `make()` on first use, warms it up, captures it in a CUDA graph and then
    replays it (the output buffer is the call's own)."""
    state = {}

    def replay() -> torch.Tensor:
        if "graph" not in state:
            run = make()
            out = run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            state.update(graph=graph, out=out)
        state["graph"].replay()
        return state["out"]
    return replay


def sweep_launch_args(entry: dict, sms: int) -> tuple[str, dict]:
    """A SWEEP entry -> (label, keyword arguments of grouped_gemm_fp8._launch): tiles, `variant`, and for a
    persistent grid `programs` = programs_per_sm x the device's SMs."""
    cfg = {k: v for k, v in entry.items() if k != "programs_per_sm"}
    label = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}/w{num_warps}/s{num_stages}".format(**cfg)
    if "programs_per_sm" in entry:
        cfg["programs"] = entry["programs_per_sm"] * sms
        label += f"/p{entry['programs_per_sm']}"
    return label, cfg


def sweep_rows(fn_for, base: dict, time_us, sms: int, check=None, entries: list[dict] | None = None) -> list[dict]:
    """`entries` (default SWEEP): tile choices and variants of the grouped FP8 GEMM; a choice that fails (compile,
    shared memory) is recorded with its error instead of a time. `check(out)`: the output's relative distance
    from the default's (recorded as rel_err_vs_default)."""
    rows = []
    for entry in SWEEP if entries is None else entries:
        label, cfg = sweep_launch_args(entry, sms)
        variant = cfg.get("variant", "pointer")
        row = dict(base, config=label, variant=variant)
        try:
            fn = fn_for(cfg)
            err = None if check is None else check(fn())
            us = time_us(fn)
        except Exception as e:  # noqa: BLE001 - a tile choice the device refuses is a result too
            rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(f"     sweep {variant:7} {label:25} failed: {rows[-1]['error']}", flush=True)
            continue
        rows.append(dict(row, us=round(us, 2), tflops=round(base["flops"] / us / 1e6, 3),
                         **({} if err is None else dict(rel_err_vs_default=round(err, 6)))))
        print(f"     sweep {variant:7} {label:25} {us:10.1f} us {rows[-1]['tflops']:8.1f} TFLOP/s", flush=True)
    return rows


def bench_experts(tokens: list[int], device: str, smoke: bool, sweep: bool = False,
                  sweep_variants: tuple[str, ...] = ()) -> tuple[list[dict], list[dict]]:
    """Rows per (tokens, projection, path) and a per-layer summary per token count. `sweep_variants`: --sweep
    times only SWEEP's entries of those grouped_gemm_fp8 variants (and no W4A8 entries)."""
    time_us = timer(device)
    rows, summary = [], []
    for sl, (E, k, projs) in (SMOKE_EXPERTS if smoke else EXPERTS).items():
        for T in tokens:
            offs = expert_offs(T, E, k, device)
            M = T * k
            picked = "w8a8" if M >= W8A8_ROWS_PER_EXPERT * E else "w8a16-folded"
            aq, swept = {}, set()
            for name, N, K, count in projs:
                xs = torch.randn(M, K, device=device).to(torch.bfloat16)
                if K not in aq:
                    aq[K] = time_us(lambda: act_quant(xs, ACT_GROUP))
                ref = None
                for path, fn in expert_paths(xs, offs, E, N, K).items():
                    try:
                        out = fn().float()  # every path's result against bf16's: FP8 activation rounding only
                    except Exception as e:  # noqa: BLE001 - a measurement path the device refuses is a result too
                        if path in EXPERT_PATHS:
                            raise
                        rows.append(dict(slice=sl, experts=E, topk=k, tokens=T, M=M, name=name, N=N, K=K, count=count,
                                         path=path, error=f"{type(e).__name__}: {str(e)[:300]}"))
                        print(f"{sl:4} experts {name:3} tokens={T:6} {path:13} failed: {rows[-1]['error']}", flush=True)
                        continue
                    ref = out if ref is None else ref
                    err = float((out - ref).norm() / ref.norm())
                    us = time_us(fn)
                    flops = 2 * M * N * K
                    rows.append(dict(slice=sl, experts=E, topk=k, tokens=T, M=M, name=name, N=N, K=K, count=count,
                                     path=path, us=round(us, 2), tflops=round(flops / us / 1e6, 3),
                                     rel_err_vs_bf16=round(err, 5), experts_path=picked))
                    print(f"{sl:4} experts {name:3} N={N:5} K={K:5} tokens={T:6} rows={M:6} {path:13} {us:10.1f} us "
                          f"{rows[-1]['tflops']:8.1f} TFLOP/s  rel.err {err:.4f}", flush=True)
                    del out
                if sweep and device == "cuda" and (N, K) not in swept:  # w3 has w1's shape
                    swept.add((N, K))
                    from deepinfer.kernels.grouped_gemm_fp8 import _launch
                    q, qs = act_quant(xs, ACT_GROUP)
                    w, ws, w4 = expert_weights(E, N, K, device, packed=True)
                    s4 = ws.view(torch.uint8).repeat_interleave(4, -1).view(torch.float8_e8m0fnu)
                    todo = (("w8a8-gemm", w, ws, (1, 128), SWEEP), ("w4a8-gemm", w4, s4, (1, 32), W4A8_SWEEP))
                    if sweep_variants:  # the W8A8 entries of those variants only
                        todo = (("w8a8-gemm", w, ws, (1, 128),
                                 [c for c in SWEEP if c.get("variant", "pointer") in sweep_variants]),)
                    for path, wt, st, block, entries in todo:
                        want = _launch(q, qs, wt, st, offs, ACT_GROUP, block).float()
                        rows += sweep_rows(
                            lambda cfg, wt=wt, st=st, block=block: lambda: _launch(q, qs, wt, st, offs, ACT_GROUP,
                                                                                   block, **cfg),
                            dict(slice=sl, experts=E, topk=k, tokens=T, M=M, name=name, N=N, K=K, count=0, path=path,
                                 flops=2 * M * N * K), time_us, sm_count(xs.device),
                            lambda out, want=want: float((out.float() - want).norm() / want.norm()), entries)
                    del q, qs, w, ws, w4, s4, want
                del xs
            layer = {p: sum(r["us"] * r["count"] for r in rows if r["slice"] == sl and r["tokens"] == T
                            and r["path"] == p and "config" not in r) for p in EXPERT_PATHS}
            # as Experts runs W8A8: one act_quant per input width (x for w1 and w3, the swiglu output for w2)
            layer["w8a8"] = layer.pop("w8a8-gemm") + sum(aq.values())
            for p in MEASURED_PATHS + ("w4a8-gemm", "w4a16"):  # the measurement paths, where every projection ran
                mine = [r for r in rows if r["slice"] == sl and r["tokens"] == T and r["path"] == p
                        and "config" not in r]
                if mine and all("us" in r for r in mine):
                    # W4A8 as W8A8: the GEMMs and one act_quant per input width; W4A16 the GEMMs alone
                    total = sum(r["us"] * r["count"] for r in mine) + (0.0 if p == "w4a16" else sum(aq.values()))
                    layer["w4a8" if p == "w4a8-gemm" else p] = total
            summary.append(dict(slice=sl, tokens=T, M=M, layer_us={p: round(v, 1) for p, v in layer.items()},
                                act_quant_us={str(K): round(v, 2) for K, v in aq.items()}, experts_path=picked,
                                **{f"{p}_vs_bf16": round(v / layer["bf16"], 3) for p, v in layer.items()
                                   if p != "bf16"}))
    return rows, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", default="v4,v41", help="comma-separated: v4 (128x128 blocks), v41 (32x32)")
    ap.add_argument("--m", default=f"1,64,{FP8_GEMM_ROWS},8192", help="comma-separated row counts")
    ap.add_argument("--out", default=None, help="results JSON (default: printed path under a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (torch references)")
    ap.add_argument("--experts", action="store_true", help="V4's routed experts (grouped GEMMs) instead of the linears")
    ap.add_argument("--tokens", default="8192", help="--experts: comma-separated tokens a step (x top-k rows)")
    ap.add_argument("--sweep", action="store_true", help="--experts: also time SWEEP's W8A8 tile choices (CUDA)")
    ap.add_argument("--sweep-variants", default="", help="--sweep: comma-separated grouped_gemm_fp8 variants whose "
                    "SWEEP entries are timed (default: all entries, and W4A8's)")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fp8_gemm_bench: needs CUDA (or --smoke)")
    if args.experts:
        experts_main(args, device)
        return
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


def experts_main(args: argparse.Namespace, device: str) -> None:
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.smoke:
        tokens = [8, 300]  # W8A16 and W8A8 row counts for 8 experts x top-2
    torch.manual_seed(0)
    with torch.inference_mode():
        rows, summ = bench_experts(tokens, device, args.smoke, args.sweep,
                                   tuple(v for v in args.sweep_variants.split(",") if v))
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result = dict(commit=recorded_commit(args), date=date.today().isoformat(), device=dev_name, torch=torch.__version__,
                  smoke=args.smoke, case="experts", w8a8_rows_per_expert=W8A8_ROWS_PER_EXPERT, rows=rows, summary=summ)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fp8_gemm_bench_")) / "fp8_experts_bench.json"
    out.write_text(json.dumps(result, indent=1))
    for s in summ:
        print(s)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
