"""RMSNorm over the last dim in one kernel (fp32 math, one read and one write of the row).

For a row x [D] (all leading dims flattened into rows), with optional fp32 weight w [D]:
  y = x * rsqrt(sum(x^2) / D + eps)          (fp32)
  y = y * w                                   (if a weight is given)
  out = y.to(out_dtype)                       (out_dtype defaults to x.dtype)
The torch form (x.float(), square, mean, rsqrt, mul, mul, cast) is ~6 launches and as many
passes over memory; this is one. Grid: one program per block of ROWS rows. Widths up to
MAX_BLOCK are done in a single pass with the row tile held in registers; wider rows loop over
NCHUNK (constexpr) chunks twice (sum of squares, then normalise and store).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

MAX_BLOCK = 8192


def reference(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch: same contract as `rms_norm`."""
    y = x.float()
    y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(out_dtype or x.dtype)


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, stride_x, eps,
                         D: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                         NCHUNK: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                      # [ROWS]
        live = rows < n_rows
        x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_x                   # [ROWS, 1]
        o_row = out_ptr + rows.to(tl.int64)[:, None] * D
        cols = tl.arange(0, BLOCK)
        if NCHUNK == 1:
            m = live[:, None] & (cols < D)[None, :]
            x = tl.load(x_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)                       # [ROWS]
            y = x * r[:, None]
            if HAS_W:
                y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
            tl.store(o_row + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
        else:
            acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for c in range(0, NCHUNK):
                cc = c * BLOCK + cols
                m = live[:, None] & (cc < D)[None, :]
                x = tl.load(x_row + cc[None, :], mask=m, other=0.0).to(tl.float32)
                acc += x * x
            r = tl.rsqrt(tl.sum(acc, axis=1) / D + eps)
            for c in range(0, NCHUNK):
                cc = c * BLOCK + cols
                m = live[:, None] & (cc < D)[None, :]
                y = tl.load(x_row + cc[None, :], mask=m, other=0.0).to(tl.float32) * r[:, None]
                if HAS_W:
                    y = y * tl.load(w_ptr + cc, mask=cc < D, other=0.0).to(tl.float32)[None, :]
                tl.store(o_row + cc[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def launch_config(D: int, max_block: int = MAX_BLOCK) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK, NCHUNK, num_warps) for width D."""
    block = min(triton.next_power_of_2(D), max_block)
    nchunk = triton.cdiv(D, block)
    rows = max(1, min(16, 2048 // block))                  # small widths: several rows per program
    warps = 8 if block >= 4096 else 4 if block >= 512 else 2 if block * rows >= 512 else 1
    return rows, block, nchunk, warps


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fused on CUDA (Triton), the torch reference elsewhere; same contract as `reference`."""
    if triton is None or not x.is_cuda or x.numel() == 0:
        return reference(x, eps, weight, out_dtype)
    return _launch(x, eps, weight, out_dtype)


def _launch(x: torch.Tensor, eps: float, weight: torch.Tensor | None, out_dtype: torch.dtype | None,
            max_block: int = MAX_BLOCK) -> torch.Tensor:
    """The Triton launch itself (any device the active Triton backend takes, e.g. the interpreter)."""
    out_dtype = out_dtype or x.dtype
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    out = torch.empty(n_rows, D, dtype=out_dtype, device=x.device)
    w = weight.contiguous() if weight is not None else x2                   # dummy pointer when no weight
    rows, block, nchunk, warps = launch_config(D, max_block)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](x2, w, out, n_rows, x2.stride(0), eps, D=D,
                                                   HAS_W=weight is not None, ROWS=rows, BLOCK=block,
                                                   NCHUNK=nchunk, num_warps=warps)
    return out.view(x.shape)
