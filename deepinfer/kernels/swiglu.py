"""Clamped SwiGLU in one pass: the expert activation between the up / gate and the down GEMM.

    out[m, f] = silu(min(gate[m, f], limit)) * clamp(up[m, f], -limit, limit)

gate and up [M, F] (bf16 from the GEMMs; any float dtype) are widened to fp32, the product is
formed in fp32 and rounded once to `out_dtype` on store. The torch formulation (`reference`)
materialises three fp32 [M, F] temporaries plus the cast; the kernel reads each input once and
writes the output once (in prefill, M = T * k = 49152 rows of F = 2048: ~0.6 GB instead of
several GB per layer).

Invariants: inputs may have any row stride (e.g. column slices of one fused [M, 2F] tensor)
but unit column stride; the output is a fresh contiguous [M, F]. Grid (M, cdiv(F, BLOCK)) from
shapes only: no host sync, CUDA-graph capturable. Each element is independent of the others
and of M, so the result does not depend on the batch composition.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def reference(gate: torch.Tensor, up: torch.Tensor, limit: float,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32, cast to out_dtype."""
    return (F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)).to(out_dtype)


if triton is not None:
    @triton.jit
    def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, F, stride_g, stride_u, limit, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < F
        g = tl.load(gate_ptr + row * stride_g + cols, mask=live, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * stride_u + cols, mask=live, other=0.0).to(tl.float32)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g * tl.sigmoid(g) * u
        tl.store(out_ptr + row * F + cols, h.to(out_ptr.dtype.element_ty), mask=live)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view with unit column stride (copies only when there is none)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(1) == 1 else t.contiguous()


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Fused on CUDA (Triton), the torch reference elsewhere; same contract as `reference`.
    gate, up [..., F] of the same shape -> [..., F] out_dtype."""
    if triton is None or not gate.is_cuda:
        return reference(gate, up, limit, out_dtype)
    return _launch(gate, up, limit, out_dtype)


def _launch(gate: torch.Tensor, up: torch.Tensor, limit: float, out_dtype: torch.dtype) -> torch.Tensor:
    """The launch without the device check (also runs under TRITON_INTERPRET=1)."""
    assert gate.shape == up.shape, (gate.shape, up.shape)
    shape = gate.shape
    g, u = _rows(gate), _rows(up)
    M, Fdim = g.shape
    out = torch.empty(M, Fdim, dtype=out_dtype, device=gate.device)
    if M == 0 or Fdim == 0:
        return out.view(shape)
    block = min(1024, triton.next_power_of_2(Fdim))
    _swiglu_kernel[(M, triton.cdiv(Fdim, block))](g, u, out, Fdim, g.stride(0), u.stride(0), float(limit),
                                                  BLOCK=block, num_warps=4)
    return out.view(shape)
