"""FP8 x FP8 GEMM with block scales on both operands (W8A8, the compute-bound path of an FP8 Linear).

    out[m, n] = sum_k  (q_a[m, k] * s_a[m, k // ga]) * (q_w[n, k] * s_w[n // bo, k // bi])   -> bf16

A [M, K] e4m3 with per-row group scales s_a [M, ceil(K/ga)] fp32 (kernels/act_quant.py, any
strides), W [N, K] e4m3 as the checkpoint stores it with block scales s_w [ceil(N/bo), ceil(K/bi)]
(E8M0 or fp32). ga, bo, bi powers of two.

What DeepSeek's reference computes (spec deepseek-v4.md 3.14): every linear with FP8 weights
quantises its input per 1 x 128 group with power-of-two scales (`act_quant`) and runs an FP8 x FP8
GEMM over 128 x 128 weight blocks; the products of a 128-wide K block are summed on the tensor
cores and that partial sum is multiplied by s_a[m, kb] * s_w[nb, kb] in fp32 and added to an fp32
accumulator ("promotion" per K block); the result is cast to bf16. V4.1's checkpoint has 32 x 32
weight blocks (deepseek-v41.md section 12); its reference's activation recipe is not in the spec:
this file keeps the V4 recipe (1 x 128 activation groups) and promotes every min(ga, bi) = 32 columns.

How it differs from dequantise-then-bf16 (kernels/grouped_gemm.py, W8A16): there the activations
stay bf16 (8 mantissa bits) and each weight is widened exactly, so W8A16 is the more precise of the
two; here each activation is rounded to e4m3 (3 mantissa bits, relative error <= 2^-4 per element,
its group's largest value in [224, 448] with pow2 scales) before the product, exactly as the
reference does. Products of two e4m3 values are exact in fp32; only summation order differs from
`reference` (fp32 dequantise both, fp32 matmul).

Two implementations, chosen per call by `fp8_gemm` (`use_scaled_mm`):
  * torch._scaled_mm with blockwise scaling (cuBLAS; BlockWise1x128 on A, BlockWise128x128 on W),
    when the recipe is exactly the reference's: ga = 128, W blocks 128 x 128, K % 128 == 0,
    N % 128 == 0 (whole weight blocks: every V4 projection), (K / 128) % 4 == 0 (torch versions
    differ on the row stride they require of the weight scales, and agree when it is a multiple of
    4), on a device where a trial call succeeded (probed once per device, never during CUDA-graph
    capture). W's scales become fp32 [nb, kb]; A's
    rows are padded by act_quant to a multiple of 16 (their scale stride is the padded row count).
    Why cuBLAS here: benchmarks/NOTES.md (fp8_gemm). A may have a row stride above K
    (forward_grouped's column slices): torch hands it to cuBLAS as it is.
  * the Triton kernel below for every other block shape (V4.1's 32 x 32): a tile of BLOCK_M x
    BLOCK_N outputs walks K in steps of SK = min(ga, bi) columns; each step's e4m3 x e4m3 tl.dot
    (fp32 result) is scaled by s_a[rows, k // ga] (x) s_w[cols // bo, k // bi] and added to the
    accumulator. Under TRITON_INTERPRET=1 the operands are widened to fp32 first (the interpreter's
    tl.dot cannot multiply fp8 bit patterns); e4m3 values are exact in fp32.
"""
from __future__ import annotations

import torch

from deepinfer.formats.quant import dequant_fp8_blocks, scale_to_float
from deepinfer.kernels import interpreted
from deepinfer.kernels.act_quant import dequant as act_dequant

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

ROW_PAD = 16  # act_quant's row padding for the cuBLAS path


def _interpreted() -> bool:
    """Under TRITON_INTERPRET=1 the dot operands are widened to fp32 (sm_90 compiles, run on CPU
    tensors by tests/kernels/sm90.py, keep the e4m3 dot)."""
    return interpreted()


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group: int,
           block: tuple[int, int]) -> None:
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_gemm: A {tuple(a.shape)} and weight {tuple(w.shape)} are not [M, K] and [N, K]")
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_gemm: A and weight must be float8_e4m3fn, got {a.dtype} and {w.dtype}")
    if not all(_pow2(v) for v in (group, *block)):
        raise ValueError(f"fp8_gemm: group {group} and block {block} must be powers of two")
    M, K = a.shape
    N = w.shape[0]
    if tuple(a_scale.shape) != (M, _cdiv(K, group)):
        raise ValueError(f"fp8_gemm: a_scale {tuple(a_scale.shape)}, expected {(M, _cdiv(K, group))}")
    want = (_cdiv(N, block[0]), _cdiv(K, block[1]))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"fp8_gemm: w_scale {tuple(w_scale.shape)} for weight {tuple(w.shape)}, expected {want}")


def reference(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              group: int = 128, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Plain torch: both operands dequantised in fp32, one fp32 matmul, cast to bf16."""
    _check(a, a_scale, w, w_scale, group, block)
    return (act_dequant(a, a_scale, group) @ dequant_fp8_blocks(w, w_scale, block).T).to(torch.bfloat16)


def default_config(M: int, N: int, sk: int) -> dict:
    """Compute-bound tiles (the path runs at prefill sizes); deeper pipelining for short K steps."""
    stages = 4 if sk >= 128 else 6
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=stages)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=stages)


if triton is not None:
    @triton.jit
    def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N,
                         s_am, s_asm, s_asg, s_wn, s_wsn, s_wsk, s_om,
                         K: tl.constexpr, GA: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                         E8M0: tl.constexpr, OP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        nmask = cols < N
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * s_am
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * s_wn
        as_rows = as_ptr + rows.to(tl.int64) * s_asm
        ws_cols = ws_ptr + (cols // BO) * s_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, SK):
            ks = k0 + tl.arange(0, SK)
            kmask = ks < K
            a = tl.load(a_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            sa = tl.load(as_rows + (k0 // GA) * s_asg, mask=rmask, other=0.0)
            sw = tl.load(ws_cols + (k0 // BI) * s_wsk, mask=nmask, other=0)
            if E8M0:  # the byte placed in an fp32 exponent field (0 -> 2^-127)
                b = sw.to(tl.int32) & 0xFF
                sw = tl.where(b == 0, 5.877471754111438e-39, (b << 23).to(tl.float32, bitcast=True))
            else:
                sw = sw.to(tl.float32)
            part = tl.dot(a.to(OP), tl.trans(w.to(OP)))  # e4m3 x e4m3 -> fp32 on the tensor cores
            acc += part * (sa[:, None] * sw[None, :])
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])


def _launch(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group: int = 128,
            block: tuple[int, int] = (128, 128), BLOCK_M=None, BLOCK_N=None, num_warps=None,
            num_stages=None) -> torch.Tensor:
    """The Triton launch on whatever device the tensors are on (CPU only under TRITON_INTERPRET=1)."""
    _check(a, a_scale, w, w_scale, group, block)
    M, K = a.shape
    N = w.shape[0]
    sk = min(group, block[1])
    if sk < 16:
        raise ValueError(f"fp8_gemm: K step min(group, block[1]) = {sk} < 16 (the smallest fp8 dot)")
    if a.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("fp8_gemm: A and weight need unit stride along K")
    cfg = default_config(M, N, sk)
    for k, v in (("BLOCK_M", BLOCK_M), ("BLOCK_N", BLOCK_N), ("num_warps", num_warps), ("num_stages", num_stages)):
        if v is not None:
            cfg[k] = v
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    e8m0 = w_scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
    ws = w_scale.view(torch.uint8) if e8m0 else w_scale
    if not e8m0 and not ws.is_floating_point():
        raise TypeError(f"fp8_gemm: unsupported scale dtype {w_scale.dtype}")
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _fp8_gemm_kernel[grid](a, a_scale, w, ws, out, M, N,
                           a.stride(0), a_scale.stride(0), a_scale.stride(1), w.stride(0), ws.stride(0), ws.stride(1),
                           out.stride(0), K=K, GA=group, BO=block[0], BI=block[1], E8M0=e8m0,
                           OP=tl.float32 if _interpreted() else tl.float8e4nv, SK=sk, **cfg)
    return out


# ---------------------------------------------------------------- torch._scaled_mm (cuBLAS blockwise)

_SCALED_MM_OK: dict[int, bool] = {}


def scaled_mm_shape_ok(N: int, K: int, group: int, block: tuple[int, int]) -> bool:
    """The reference's recipe, in shapes torch._scaled_mm's blockwise path accepts in every version."""
    return group == 128 and tuple(block) == (128, 128) and K % 128 == 0 and N % 128 == 0 and (K // 128) % 4 == 0


def _scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """A [M, K] (M a multiple of ROW_PAD) with a_scale of stride (1, M); W [N, K] with 128-block scales."""
    ws = scale_to_float(w_scale).contiguous()  # [nb, kb] fp32 row-major
    return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=ws.t(), out_dtype=torch.bfloat16)


def scaled_mm_available(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs the blockwise recipe on `device`: one trial call per device,
    made outside CUDA-graph capture (while capturing an unprobed device reads as unavailable)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _SCALED_MM_OK:
        return _SCALED_MM_OK[idx]
    if torch.cuda.is_current_stream_capturing():
        return False
    dev = torch.device("cuda", idx)
    try:
        a = torch.ones(ROW_PAD, 512, dtype=torch.float8_e4m3fn, device=dev)
        sa = torch.ones(4, ROW_PAD, device=dev).t()
        w = torch.ones(128, 512, dtype=torch.float8_e4m3fn, device=dev)
        ok = bool((_scaled_mm(a, sa, w, torch.ones(1, 4, device=dev)) == 512).all())
    except (RuntimeError, TypeError, NotImplementedError):
        ok = False
    _SCALED_MM_OK[idx] = ok
    return ok


def use_scaled_mm(a_device: torch.device, N: int, K: int, group: int, block: tuple[int, int]) -> bool:
    return scaled_mm_shape_ok(N, K, group, block) and scaled_mm_available(a_device)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group: int = 128,
             block: tuple[int, int] = (128, 128), backend: str = "auto") -> torch.Tensor:
    """out [M, N] bf16 for quantised A (act_quant's outputs) and a block-scaled FP8 weight.
    backend "auto": torch._scaled_mm where `use_scaled_mm`, else Triton; "scaled_mm" / "triton"
    force one (benchmarks, tests). CPU tensors: `reference`. No host sync (graph capturable once
    the device was probed)."""
    if triton is None or not a.is_cuda:
        return reference(a, a_scale, w, w_scale, group, block)
    if backend not in ("auto", "scaled_mm", "triton"):
        raise ValueError(f"fp8_gemm: backend must be auto, scaled_mm or triton, got {backend!r}")
    N, K = w.shape
    if backend == "scaled_mm" or (backend == "auto" and use_scaled_mm(a.device, N, K, group, block)):
        _check(a, a_scale, w, w_scale, group, block)
        return _scaled_mm(a, a_scale, w, w_scale)
    return _launch(a, a_scale, w, w_scale, group, block)
