"""DeepSeek-V4.1 Engram: hashed n-gram memory gated into every residual stream (docs/models.md)."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.formats.quant import dequant_fp8_blocks
from deepinfer.layers import invariant
from deepinfer.layers.linear import DENSE, Linear, QuantSpec


class EngramTable(nn.Module):
    """The hashed n-gram table: FP8 rows with one E8M0 scale per 32 columns as stored, or dense.
    With `host_resident` it is created on the meta device for the loader to bind to the shards'
    bytes, memory-mapped on the host: only looked-up rows are read and moved to the compute device."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, quantized: bool, host_resident: bool = False):
        super().__init__()
        dev = "meta" if host_resident else None
        if quantized:
            self.register_buffer("weight", torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device=dev))
            self.register_buffer("scale", torch.empty(rows, dim // 32, dtype=torch.float8_e8m0fnu, device=dev))
        else:
            self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype, device=dev), requires_grad=False)
            self.scale = None

    def lookup(self, rows: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """rows [...] (any device) -> [..., dim] on `device`."""
        rows = rows.to(self.weight.device)
        w = self.weight[rows]
        if self.scale is not None:
            w = dequant_fp8_blocks(w.flatten(0, -2), self.scale[rows].flatten(0, -2), (1, 32), dtype).view(w.shape)
        return w.to(device=device, dtype=dtype, non_blocking=True)


class Engram(nn.Module):
    """Gated injection of hashed n-gram memory into every residual stream (before the block)."""

    def __init__(self, dim: int, n_streams: int, rows: int, head_dim: int, hash_heads: int, eps: float,
                 dtype: torch.dtype, quant: QuantSpec = DENSE, fp8_table: bool = False, host_resident: bool = False):
        super().__init__()
        self.dim, self.n, self.eps = dim, n_streams, eps
        self.embed = EngramTable(rows, head_dim, dtype, fp8_table, host_resident)
        self.wkv = Linear(hash_heads * head_dim, dim * (n_streams + 1), dtype, quant)
        self.q_weight = nn.Parameter(torch.ones(n_streams, dim, dtype=dtype), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(n_streams, dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        """x [T, n, D], rows [T, hash_heads] table rows; token_mask False = image/pad (gate 0)."""
        emb = self.embed.lookup(rows, x.dtype, x.device).flatten(1)
        key, value = self.wkv(emb).split((self.n * self.dim, self.dim), dim=-1)
        key, h = key.float().unflatten(-1, (self.n, self.dim)), x.float()
        w = self.q_weight.float() * self.k_weight.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * w * key).sum(-1) * rstd * self.dim ** -0.5
        gate = invariant.pointwise(torch.sigmoid, torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask[:, None], 0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(x.dtype)

