"""Interleaved (GPT-J pair) RoPE on the last `rope_dim` channels, with optional YaRN.

Pairs are channels (2j, 2j+1) of the trailing rope slice; the leading channels
("nope") are untouched. YaRN here only interpolates frequencies: there is no
attention/mscale factor (docs/models.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.kernels import rope as _kernel
from deepinfer.layers import invariant
from deepinfer.layers.norm import rms_norm


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation of the compressed layers' RoPE (config: models/config_keys.py)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None = None) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    if yarn is None:
        return inv

    def corr_dim(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = original (high-frequency) channel, 0 = fully interpolated
    return inv / yarn.factor * (1 - keep) + inv * keep


@dataclass
class RopeCache:
    """cos/sin [N, rope_dim/2] (fp32) for a vector of positions."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def at(cls, positions: torch.Tensor, inv_freq: torch.Tensor) -> "RopeCache":
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
        return cls(invariant.pointwise(torch.cos, freqs), invariant.pointwise(torch.sin, freqs))


def apply_rope(x: torch.Tensor, rope: RopeCache, inverse: bool = False, overwrite: bool = False) -> torch.Tensor:
    """Rotate the trailing rope slice of x [N, ..., D]; cos/sin broadcast over middle dims.
    overwrite: x is the caller's own fresh tensor and may be rotated in place (CUDA: only the rope
    channels are read and written); use the return value either way."""
    if x.is_cuda:  # one fused Triton launch (torch fallback inside when Triton is absent)
        inplace = overwrite and x.numel() > 0 and x.is_contiguous()
        return _kernel.rope(x, rope.cos, rope.sin, inverse, inplace=inplace)
    half = rope.cos.shape[-1]
    shape = (rope.cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = rope.cos.view(shape), rope.sin.view(shape)
    if inverse:
        sin = -sin
    nope, r = x[..., : -2 * half], x[..., -2 * half:].float()
    even, odd = r[..., 0::2], r[..., 1::2]
    rot = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rot.to(x.dtype)), dim=-1)


def norm_rope(x: torch.Tensor, eps: float, rope: RopeCache) -> torch.Tensor:
    """apply_rope(rms_norm(x, eps).to(x.dtype), rope): weightless per-vector RMSNorm over the last dim,
    cast back to x.dtype, then RoPE. One fused Triton launch on CUDA."""
    if x.is_cuda:
        return _kernel.rope(x, rope.cos, rope.sin, norm_eps=eps)
    return apply_rope(rms_norm(x, eps).to(x.dtype), rope)
