"""Probe: does an L2 prefetch on a side stream, during a window of small kernels, speed up the next GEMV?"""
import json

import torch
import triton
import triton.language as tl

from deepinfer.kernels.grouped_gemm import grouped_gemm

@triton.jit
def _prefetch(ptr, n_bytes, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * LINES * 128 + tl.arange(0, LINES).to(tl.int64) * 128
    offs = tl.minimum(offs, n_bytes - 1)
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];", "=r,l", [ptr + offs], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptr + offs], dtype=tl.int32, is_pure=False, pack=1)

def prefetch(t, evict_last=True, lines=1024):
    n = t.numel() * t.element_size()
    u8 = t.view(-1).view(torch.uint8)
    _prefetch[(triton.cdiv(n, 128 * lines),)](u8, n, LINES=lines, EVICT_LAST=evict_last, num_warps=4)

def graph_us(capture, replays: int = 20) -> float:
    """us per replay of a CUDA graph holding what `capture` launches (one warm replay first)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        capture()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / replays * 1e3


res = {}
for N, K, name in ((4096, 8192, "wo_b 4096x8192"), (32768, 1024, "wq_b 32768x1024"), (1536, 4096, "wq_a+wkv 1536x4096")):
    n_w = max(8, int(300e6 // (N * K)))
    ws = [((torch.randn(N, K, device="cuda") * 4).to(torch.float8_e4m3fn),
           torch.randint(118, 124, (N // 128, K // 128), dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)) for _ in range(n_w)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    for w, s in ws[:2]:
        grouped_gemm(x, w, None, s, (128, 128)); prefetch(w)
    torch.cuda.synchronize()
    def body(mode, sleep_cycles):
        main = torch.cuda.current_stream()
        for w, s in ws:
            if mode != "none":
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch(w, evict_last=(mode == "evict_last"))
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            if mode != "none":
                main.wait_stream(side)
            grouped_gemm(x, w, None, s, (128, 128))
    out = {}
    for mode in ("none", "evict_last", "normal"):
        for cyc in (0, 60000):
            out[f"{mode}-sleep{cyc}"] = graph_us(lambda: body(mode, cyc)) / n_w  # us per (sleep + gemv)
    out["sleep-alone"] = graph_us(lambda: [torch.cuda._sleep(60000) for _ in ws]) / n_w
    res[name] = out
    print(name, json.dumps({k: round(v, 2) for k, v in out.items()}), flush=True)
    del ws
