"""Interleaved RoPE on the trailing R channels, optionally preceded by a weightless RMSNorm.

x [N, ..., D] (middle dims = heads, flattened; may be absent), cos/sin [N, R/2] fp32 shared by
all heads of a token. Per (token n, head h) row, channels c = D - R + 2j, D - R + 2j + 1 form
pair j:
  (optional) x = (x * rsqrt(sum(x^2) / D + eps)).to(x.dtype)      fp32 math, cast back first
  s = -sin[n, j] if inverse else sin[n, j]
  out[c]     = fma(x[c], cos[n, j], -(x[c + 1] * s))             fp32, cast to x.dtype
  out[c + 1] = fma(x[c], s, x[c + 1] * cos[n, j])
The leading D - R ("nope") channels are copied (normalised first when asked). The torch form
is a slice/float/stack/cat chain of ~10 launches (plus ~6 for the norm); this is one, reading
and writing each row once (in place: only the rope channels). Grid: ROWS (token, head) rows per
program.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
              norm_eps: float | None = None) -> torch.Tensor:
    """Plain torch: same contract as `rope`."""
    if norm_eps is not None:
        xf = x.float()
        x = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)).to(x.dtype)
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.float().view(shape), sin.float().view(shape)
    if inverse:
        s = -s
    nope, r = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:].float()
    even, odd = r[..., 0::2], r[..., 1::2]
    rot = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat((nope, rot.to(x.dtype)), dim=-1)


if triton is not None:
    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, R, H, stride_xn, stride_xh, stride_on, stride_oh,
                     stride_cn, stride_sn, eps, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, INVERSE: tl.constexpr, NORM: tl.constexpr,
                     COPY_NOPE: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        r_ok = rows < R
        n = (rows // H).to(tl.int64)
        h = (rows % H).to(tl.int64)
        x_row = (x_ptr + n * stride_xn + h * stride_xh)[:, None]                     # [ROWS, 1]
        o_row = (out_ptr + n * stride_on + h * stride_oh)[:, None]
        NOPE: tl.constexpr = D - 2 * HALF
        dt = out_ptr.dtype.element_ty

        j = tl.arange(0, BLOCK_HALF)[None, :]
        jm = r_ok[:, None] & (j < HALF)
        ev = tl.load(x_row + NOPE + 2 * j, mask=jm, other=0.0)
        od = tl.load(x_row + NOPE + 2 * j + 1, mask=jm, other=0.0)
        if NORM:
            cols = tl.arange(0, BLOCK_D)[None, :]
            xf = tl.load(x_row + cols, mask=r_ok[:, None] & (cols < D), other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
            tl.store(o_row + cols, (xf * r).to(dt), mask=r_ok[:, None] & (cols < NOPE))
            ev = (ev.to(tl.float32) * r).to(dt)
            od = (od.to(tl.float32) * r).to(dt)
        elif COPY_NOPE:
            if NOPE > 0:
                cols = tl.arange(0, BLOCK_D)[None, :]
                cm = r_ok[:, None] & (cols < NOPE)
                tl.store(o_row + cols, tl.load(x_row + cols, mask=cm, other=0.0), mask=cm)
        e = ev.to(tl.float32)
        o = od.to(tl.float32)
        c = tl.load(cos_ptr + n[:, None] * stride_cn + j, mask=jm, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + n[:, None] * stride_sn + j, mask=jm, other=0.0).to(tl.float32)
        if INVERSE:
            sn = -sn
        # explicit fma: left to the compiler, the in-place and copying variants may contract
        # e*c - o*s differently (an ulp apart); spelled out, every variant rounds the same way
        tl.store(o_row + NOPE + 2 * j, tl.fma(e, c, -(o * sn)).to(dt), mask=jm)
        tl.store(o_row + NOPE + 2 * j + 1, tl.fma(e, sn, o * c).to(dt), mask=jm)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         norm_eps: float | None = None, inplace: bool = False) -> torch.Tensor:
    """Fused on CUDA (Triton), the torch reference elsewhere; same contract as `reference`.
    inplace (no norm): the rope channels of x are rewritten and x is returned; only they are read
    and written (an eighth of the row traffic at D = 512, R = 64)."""
    if triton is None or not x.is_cuda or x.numel() == 0 or x.dim() < 2:
        out = reference(x, cos, sin, inverse, norm_eps)
        return x.copy_(out) if inplace else out
    return _launch(x, cos, sin, inverse, norm_eps, inplace)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool,
            norm_eps: float | None, inplace: bool = False, rows: int | None = None,
            num_warps: int | None = None) -> torch.Tensor:
    """The Triton launch itself (any device the active Triton backend takes, e.g. the interpreter)."""
    N, D = x.shape[0], x.shape[-1]
    half = cos.shape[-1]
    norm = norm_eps is not None
    if inplace and norm:
        raise ValueError("rope: inplace does not take norm_eps (the norm rewrites every channel)")
    x3 = x.reshape(N, -1, D)
    if inplace and x3.data_ptr() != x.data_ptr():
        raise ValueError("rope: inplace needs x viewable as [N, heads, D]")
    if x3.stride(-1) != 1:
        if inplace:
            raise ValueError("rope: inplace needs unit stride in the last dim")
        x3 = x3.contiguous()
    H = x3.shape[1]
    cos2 = cos.float().expand(N, half)          # a single position row broadcasts (stride 0)
    sin2 = sin.float().expand(N, half)
    if cos2.stride(-1) != 1:
        cos2 = cos2.contiguous()
    if sin2.stride(-1) != 1:
        sin2 = sin2.contiguous()
    out = x3 if inplace else torch.empty(N, H, D, dtype=x.dtype, device=x.device)
    block_d = triton.next_power_of_2(D)
    block_half = triton.next_power_of_2(half)
    # fixed per path, never by N (the norm's reduction tree must not depend on the batch): 4 rows per
    # program, 1 warp (norm) / 2 warps (in place), the fastest swept layouts (benchmarks/NOTES.md)
    rows = rows or 4
    num_warps = num_warps or (2 if inplace else 1)
    _rope_kernel[(triton.cdiv(N * H, rows),)](
        x3, cos2, sin2, out, N * H, H, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1),
        cos2.stride(0), sin2.stride(0), norm_eps if norm else 0.0, D=D, HALF=half, BLOCK_D=block_d,
        BLOCK_HALF=block_half, ROWS=rows, INVERSE=bool(inverse), NORM=norm, COPY_NOPE=not inplace,
        num_warps=num_warps)
    return x if inplace else out.view(x.shape)
