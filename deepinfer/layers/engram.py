"""DeepSeek-V4.1 Engram: hashed n-gram memory gated into every residual stream (docs/models.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.formats.quant import dequant_fp8_blocks
from deepinfer.kernels.engram_lookup import EngramQuery
from deepinfer.layers import invariant
from deepinfer.layers.linear import DENSE, Linear, QuantSpec


@dataclass
class StagedRows:
    """Rows of a host-resident table, gathered on the host into pinned memory and copied to the compute
    device on a side stream (`ready` is recorded after the copy; the first reader waits for it)."""

    weight: torch.Tensor                 # [..., dim] as stored (FP8 codes or dense)
    scale: torch.Tensor | None           # [..., dim / 32] E8M0, FP8 tables only
    ready: torch.cuda.Event | None = None

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def wait(self) -> None:
        if self.ready is not None:
            torch.cuda.current_stream(self.weight.device).wait_event(self.ready)
            self.ready = None

    def __getitem__(self, idx) -> "StagedRows":
        self.wait()
        return StagedRows(self.weight[idx], None if self.scale is None else self.scale[idx])


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


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

    def stage(self, rows: torch.Tensor, device: torch.device) -> StagedRows:
        """Host table: rows [...] (host) gathered into pinned memory and sent to `device` without
        waiting; the copy overlaps whatever the device runs before the first lookup."""
        idx = rows.reshape(-1).cpu()
        parts = [self.weight] + ([self.scale] if self.scale is not None else [])
        cuda = torch.device(device).type == "cuda"
        host = [torch.empty((idx.numel(), t.shape[1]), dtype=t.dtype, pin_memory=cuda) for t in parts]
        for t, buf in zip(parts, host):
            torch.index_select(t.view(torch.uint8) if t.element_size() == 1 else t, 0, idx,
                               out=buf.view(torch.uint8) if t.element_size() == 1 else buf)
        shaped = [b.view(*rows.shape, b.shape[-1]) for b in host]
        if not cuda:
            return StagedRows(*[b.to(device) for b in shaped] + [None] * (2 - len(shaped)))
        device = torch.device(device)
        stream = _COPY_STREAMS.setdefault(device, torch.cuda.Stream(device))
        out = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in shaped]
        stream.wait_stream(torch.cuda.current_stream(device))  # the outputs' memory is free in stream order
        with torch.cuda.stream(stream):
            for o, b in zip(out, shaped):
                o.copy_(b, non_blocking=True)
                o.record_stream(stream)
            ready = torch.cuda.Event()
            ready.record(stream)
        return StagedRows(out[0], out[1] if len(out) > 1 else None, ready)

    def lookup(self, rows: torch.Tensor | StagedRows, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """rows [...] (table rows on the table's device, or staged ones) -> [..., dim] on `device`."""
        if isinstance(rows, StagedRows):
            rows.wait()
            w, s = rows.weight, rows.scale
        else:
            rows = rows.to(self.weight.device)
            w, s = self.weight[rows], None if self.scale is None else self.scale[rows]
        if s is not None:
            w = dequant_fp8_blocks(w.flatten(0, -2), s.flatten(0, -2), (1, 32), dtype).view(w.shape)
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

    def forward(self, x: torch.Tensor, rows: torch.Tensor | StagedRows | EngramQuery,
                token_mask: torch.Tensor | None) -> torch.Tensor:
        """x [T, n, D], rows [T, hash_heads] table rows, rows staged from a host table, or the windows and
        hash constants of a device-resident table (hashed and gathered in one kernel); token_mask False =
        image/pad (gate 0)."""
        if isinstance(rows, EngramQuery):
            emb = rows.lookup(self.embed.weight, self.embed.scale, x.dtype).flatten(1)
        else:
            emb = self.embed.lookup(rows, x.dtype, x.device).flatten(1)
        key, value = self.wkv(emb).split((self.n * self.dim, self.dim), dim=-1)
        key, h = key.float().unflatten(-1, (self.n, self.dim)), x.float()
        w = self.q_weight.float() * self.k_weight.float()
        rstd = (torch.rsqrt(invariant.reduce_mean(h.square(), -1) + self.eps)
                * torch.rsqrt(invariant.reduce_mean(key.square(), -1) + self.eps))
        dot = invariant.reduce_sum(h * w * key, -1) * rstd * self.dim ** -0.5
        gate = invariant.pointwise(torch.sigmoid, torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask[:, None], 0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(x.dtype)

