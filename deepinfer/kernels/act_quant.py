"""Per-token group FP8 quantisation of activations (the reference's `act_quant`).

    x [M, K] (bf16 / fp32)  ->  q [M, K] float8_e4m3fn,  s [M, ceil(K / group)] fp32
    s[m, g] = max(amax(|x[m, g*group : (g+1)*group]|), 1e-4) * (1 / 448), rounded UP to a power of
              two when `pow2` (the checkpoints' scale_fmt "ue8m0": an E8M0 byte holds it exactly)
    q[m, k] = e4m3(clamp(x[m, k] / s[m, k // group], -448, 448))     (round to nearest even)

so that q * s reproduces x to e4m3's 3 mantissa bits, and every group's largest value lands in
[224, 448] (pow2) or at 448 (plain scales). This is DeepSeek V4's inference recipe for every
linear with FP8 weights (docs: spec deepseek-v4.md section 3.14): groups of 1 x 128 along K with
power-of-two scales; the same rule (1e-4 floor, x (1/448), exponent bump) as formats/group_quant.py's
fp8 cache format.

Output layout: `s` is returned as an [M, G] view of column-major storage ([G, M_pad] row-major,
stride (1, M_pad)), the layout torch._scaled_mm's BlockWise1x128 recipe takes; `rows` pads both
outputs to M_pad >= M rows (pad rows are left unwritten: their GEMM rows are cut off by the
caller). One program quantises BLOCK_M rows x one group; loads, the amax and the division are
fp32, so a row's result never depends on the other rows (batch-invariant as it is).
"""
from __future__ import annotations

import torch

from deepinfer.formats.group_quant import pow2_ceil
from deepinfer.kernels import interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def _check(x: torch.Tensor, group: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"act_quant: x must be [M, K], got shape {tuple(x.shape)}")
    if group < 16 or group & (group - 1):
        raise ValueError(f"act_quant: group must be a power of two >= 16, got {group}")


def _alloc(x: torch.Tensor, group: int, rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    rows = M if rows is None else rows
    if rows < M:
        raise ValueError(f"act_quant: rows {rows} < M {M}")
    G = -(-K // group)
    q = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(G, rows, dtype=torch.float32, device=x.device).t()  # [rows, G], stride (1, rows)
    return q, s


def reference(x: torch.Tensor, group: int = 128, pow2: bool = True,
              rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same outputs and layout as the kernel (pad rows zero here)."""
    _check(x, group)
    M, K = x.shape
    q, s = _alloc(x, group, rows)
    G = s.shape[1]
    xf = torch.zeros(M, G * group, dtype=torch.float32, device=x.device)
    xf[:, :K] = x.float()
    g = xf.view(M, G, group)
    scale = g.abs().amax(-1).clamp_min(AMAX_FLOOR) * (1 / FP8_MAX)
    if pow2:
        scale = pow2_ceil(scale)
    vals = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(M, G * group)[:, :K]
    q.zero_()
    s.zero_()
    q[:M] = vals.to(torch.float8_e4m3fn)
    s[:M] = scale
    return q, s


def dequant(q: torch.Tensor, s: torch.Tensor, group: int = 128) -> torch.Tensor:
    """q * s in fp32 ([M, K]): the value the FP8 GEMM multiplies."""
    K = q.shape[1]
    return q.float() * s.float().repeat_interleave(group, dim=1)[:, :K]


if triton is not None:
    @triton.jit
    def _e4m3_grid(v):
        """fp32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32: normal
        values keep 3 mantissa bits (the carry may bump the exponent), subnormals (|v| < 2^-6) go to
        the nearest multiple of 2^-9 (integer rounding of v * 512 by adding and removing 1.5 * 2^23).
        The cast that follows is then exact on any backend (Triton 3.6's interpreter rounds fp8
        casts without carrying into the exponent)."""
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # clear the 20 low mantissa bits
        normal = bits.to(tl.float32, bitcast=True)
        sub = ((v * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        return tl.where(tl.abs(v) < 0.015625, sub, normal)

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, s_xm, s_xk, s_qm, s_sm, s_sg,
                          GROUP: tl.constexpr, POW2: tl.constexpr, BLOCK_M: tl.constexpr, HW_CAST: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        g = tl.program_id(1)
        cols = g * GROUP + tl.arange(0, GROUP)
        rmask = rows < M
        mask = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * s_xm + cols[None, :] * s_xk, mask=mask,
                    other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
        s = amax * (1.0 / 448.0)
        if POW2:  # exponent bump when any mantissa bit is set: the next power of two up, exactly
            bits = s.to(tl.int32, bitcast=True)
            ex = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            s = (ex << 23).to(tl.float32, bitcast=True)
            # s = 2^(ex - 127) with 1 <= ex <= 253 (amax floor 1e-4, finite amax): 1 / s = 2^(127 - ex) is a
            # normal fp32, and x * (1 / s) rounds the same real value x / s as the division does
            q = x * ((254 - ex) << 23).to(tl.float32, bitcast=True)[:, None]
        else:
            q = tl.math.div_rn(x, tl.broadcast_to(s[:, None], (BLOCK_M, GROUP)))
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        if HW_CAST:  # the hardware's fp32 -> e4m3 conversion rounds to nearest even (CUDA)
            q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            q = _e4m3_grid(q).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * s_qm + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows.to(tl.int64) * s_sm + g * s_sg, s, mask=rmask)


def _launch(x: torch.Tensor, group: int = 128, pow2: bool = True, rows: int | None = None,
            BLOCK_M: int = 16, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launch on whatever device x is on (CPU only under TRITON_INTERPRET=1)."""
    _check(x, group)
    q, s = _alloc(x, group, rows)
    M, K = x.shape
    if M == 0 or K == 0:
        return q, s
    grid = (triton.cdiv(M, BLOCK_M), s.shape[1])
    _act_quant_kernel[grid](x, q, s, M, K, x.stride(0), x.stride(1), q.stride(0), s.stride(0), s.stride(1),
                            GROUP=group, POW2=pow2, BLOCK_M=BLOCK_M, HW_CAST=not interpreted(), num_warps=num_warps)
    return q, s


def act_quant(x: torch.Tensor, group: int = 128, pow2: bool = True,
              rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, K] e4m3, s [rows, ceil(K/group)] fp32 column-major) for x [M, K]; rows defaults
    to M. Triton on CUDA, `reference` elsewhere. No host sync (CUDA-graph capturable)."""
    if triton is None or not x.is_cuda:
        return reference(x, group, pow2, rows)
    return _launch(x, group, pow2, rows)
