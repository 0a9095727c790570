"""DeepSeek-V4.1's cache formats: per-group quantisation on the last axis (docs/models.md).

  fp8    E4M3, one power-of-two scale >= max(amax, 1e-4)/448 per group (values clamped to ±448)
  mxfp4  E2M1, one power-of-two scale >= max(amax, 6*2^-126)/6 per group (E8M0)
  nvfp4  E2M1, one E4M3-rounded scale max(amax, 6*2^-9)/6 per group
E2M1 rounds to nearest, ties to the even code. `encode` returns the stored tensors,
`decode` their value; decode(encode(x)) is the reference's quantise->dequantise round trip.
"""
from __future__ import annotations

import torch

from deepinfer.formats.quant import _fp4_codes, fp4_table

GROUP = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= v for positive normal fp32 v, exactly (exponent bump if any mantissa bit)."""
    bits = v.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 255
    bump = ((bits & ((1 << 23) - 1)) != 0).to(torch.int32)
    return ((exp + bump) << 23).view(torch.float32)


def _scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "fp8":
        return pow2_ceil(amax.clamp_min(1e-4) * (1 / 448))
    if fmt == "mxfp4":
        return pow2_ceil(amax.clamp_min(6 * 2 ** -126) * (1 / 6))
    return (amax.clamp_min(6 * 2 ** -9) / 6).to(torch.float8_e4m3fn).float()


def encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (codes, scales): fp8 -> (e4m3 [..., C], fp32 pow2 [..., C/g]);
    fp4 -> (uint8 packed [..., C/2], scale [..., C/g] as fp32 (mx) or e4m3 (nv))."""
    g = x.float().unflatten(-1, (-1, GROUP[fmt]))
    scale = _scale(g.abs().amax(-1, keepdim=True), fmt)
    if fmt == "fp8":
        q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2)
        return q, _exponent(scale.squeeze(-1))
    codes = _fp4_codes((g / scale).clamp(-6, 6)).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    s = scale.squeeze(-1)
    return packed, (_exponent(s) if fmt == "mxfp4" else s.to(torch.float8_e4m3fn))


def decode(codes: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    if fmt == "fp8":
        vals = codes.float().unflatten(-1, (-1, GROUP[fmt]))
    else:
        b = codes.view(torch.uint8)
        vals = fp4_table(codes.device)[torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2).long()].unflatten(-1, (-1, GROUP[fmt]))
    s = torch.exp2(scale.float() - 127) if scale.dtype == torch.uint8 else scale.float()
    return (vals * s.unsqueeze(-1)).flatten(-2).to(dtype)


def roundtrip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return decode(*encode(x, fmt), fmt, x.dtype)


def _exponent(pow2: torch.Tensor) -> torch.Tensor:
    """A power of two as its E8M0 byte (biased exponent)."""
    return ((pow2.contiguous().view(torch.int32) >> 23) & 255).to(torch.uint8)
