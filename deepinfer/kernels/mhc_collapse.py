"""mHC collapse of the n residual streams into a sub-layer input, optionally RMS-normalised.

For a token with streams X [n, D] (bf16/fp32) and weights pre [n] (fp32):
  h = sum_i pre[i] * X[i]                     (fp32, rounded to X's dtype)
  out = h * rsqrt(mean(h^2) + eps) * w        (if a norm weight w [D] is given; fp32, out in X's dtype)
which is `layers.mhc.collapse` followed by the sub-layer's RMSNorm, rounding in the same places.
The torch form writes an fp32 [T, n, D] product and reads it back; this reads X once.
Grid: one program per token (the whole row in registers for the norm).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def reference(x: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0):
    """Plain torch: x [T, n, D], pre [T, n] -> [T, D] in x's dtype."""
    h = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    if weight is None:
        return h
    f = h.float()
    return (f * torch.rsqrt(f.square().mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


if triton is not None:
    @triton.jit
    def _collapse_kernel(x_ptr, pre_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, N: tl.constexpr,
                         BLOCK: tl.constexpr, HAS_NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < D
        h = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(N):
            p = tl.load(pre_ptr + t * N + i)
            h += p * tl.load(x_ptr + (t * N + i) * D + cols, mask=live, other=0.0).to(tl.float32)
        h = h.to(out_ptr.dtype.element_ty)
        if HAS_NORM:
            f = h.to(tl.float32)
            r = tl.rsqrt(tl.sum(f * f, axis=0) / D + eps)
            h = (f * r * tl.load(w_ptr + cols, mask=live, other=0.0)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * D + cols, h, mask=live)


def mhc_collapse(x: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
    """Fused on CUDA (Triton), the torch reference elsewhere; same contract as `reference`."""
    if triton is None or not x.is_cuda or x.shape[0] == 0:
        return reference(x, pre, weight, eps)
    return _launch(x, pre, weight, eps)


def _launch(x, pre, weight, eps):
    T, n, D = x.shape
    x = x.contiguous()
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    w = weight.float().contiguous() if weight is not None else pre
    _collapse_kernel[(T,)](x, pre.float().contiguous(), w, out, eps, D=D, N=n, BLOCK=block,
                           HAS_NORM=weight is not None, num_warps=8 if block >= 4096 else 4)
    return out
