"""RMSNorm in float32, weight kept in float32 (DeepSeek computes every norm in fp32)."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import rms_norm as _kernel


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim, computed in fp32, returned in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused Triton launch (torch fallback inside when Triton is absent)
            return _kernel.rms_norm(x, self.eps, self.weight, x.dtype)
        return (rms_norm(x, self.eps) * self.weight).to(x.dtype)
