"""DeepSeek's number formats: FP8 e4m3 blocks, FP4 e2m1 pairs, E8M0 power-of-two scales.

Weights (checkpoint): W = e4m3(q) * scale[i // bo, j // bi]; routed experts
W[o, k] = E2M1[nibble(o, k)] * scale[o, k // 32], two codes per byte, even column in
the low nibble. Activations/KV (the reference's QAT simulation): groups of g values
share a power-of-two scale 2^ceil(log2(amax / fmt_max)).
"""
from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
# E2M1 code -> value; bit 3 is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 / float8_e8m0fnu) or float scales -> float32 multipliers."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    s = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return s[..., : shape[-2], : shape[-1]]  # the last block may be ragged


def dequant_fp8_blocks(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if w.dtype != torch.float8_e4m3fn:
        w = w.view(torch.float8_e4m3fn)
    expected = (-(-w.shape[-2] // block[0]), -(-w.shape[-1] // block[1]))
    if tuple(scale.shape[-2:]) != expected:
        raise ValueError(f"fp8 scale shape {tuple(scale.shape)} does not match weight "
                         f"{tuple(w.shape)} with block {block} (expected {expected})")
    out = w.to(torch.float32) * _expand_blocks(scale_to_float(scale), w.shape, block)
    return out.to(dtype)


def _pow2_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= fmt_max (E8M0 range)."""
    exp = torch.ceil(torch.log2(amax.clamp(min=1e-30) / fmt_max)).clamp(-127, 127)
    return torch.exp2(exp)


def quant_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [out, in] -> (e4m3 weight, E8M0 scale [ceil(out/bo), ceil(in/bi)])."""
    bo, bi = block
    out_f, in_f = w.shape
    pad = torch.zeros(-(-out_f // bo) * bo, -(-in_f // bi) * bi, dtype=torch.float32)
    pad[:out_f, :in_f] = w.float()
    tiles = pad.view(pad.shape[0] // bo, bo, pad.shape[1] // bi, bi)
    scale = _pow2_scale(tiles.abs().amax(dim=(1, 3)), FP8_MAX)
    q = (w.float() / _expand_blocks(scale, w.shape, block)).to(torch.float8_e4m3fn)
    return q, float_to_e8m0(scale)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    exp = torch.round(torch.log2(scale)).to(torch.int32) + 127
    return exp.clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def fold_e8m0_groups(w: torch.Tensor, scale: torch.Tensor, group: int = 32,
                     factor: int = 4) -> tuple[torch.Tensor, torch.Tensor] | None:
    """E4M3 codes w [..., K] with one E8M0 scale per `group` inputs (scale [..., K / group]) -> the same
    values with one scale per group * factor inputs: (codes [..., K] e4m3, scale [..., K / (group * factor)]
    in scale's dtype), or None when that cannot be exact.

    Each fold block of `factor` groups (exponent bytes e_i) takes one exponent S, and group i's codes
    become c * 2^(e_i - S). S is the smallest exponent keeping every re-scaled code <= 448: the
    largest e_i when every group uses e4m3's full range (FP8 quantised by amax), up to 6 lower for
    codes of FP4 origin (|c| <= 6), which moves the small groups' codes up instead of into e4m3's
    subnormals. Exact means every re-scaled code is an e4m3 value (2^-9 is the smallest step, 448 the
    largest value): checked as codes' == c * 2^(e_i - S) in fp32 (both sides exact), which is
    dequant(codes', S) == dequant(c, e_i) bit for bit. One block that would lose a bit (e.g. a group
    9 or more binades below a full-range neighbour holding 2^-9), a NaN scale byte (255) or
    K % (group * factor) != 0 -> None: the caller keeps the per-`group` copy."""
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fold_e8m0_groups: w must be float8_e4m3fn, got {w.dtype}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"fold_e8m0_groups: scale must be E8M0 (float8_e8m0fnu / uint8), got {scale.dtype}")
    K = w.shape[-1]
    if tuple(scale.shape) != (*w.shape[:-1], K // group) or K % group:
        raise ValueError(f"fold_e8m0_groups: scale {tuple(scale.shape)} for w {tuple(w.shape)} with group {group}")
    if K % (group * factor):
        return None
    e = scale.view(torch.uint8).to(torch.int32).unflatten(-1, (-1, factor))        # [..., G, F]
    if bool((e == 255).any()):
        return None
    v = w.float().unflatten(-1, (-1, factor, group))                                 # [..., G, F, g]
    mant, ex = torch.frexp(v.abs().amax(-1))                                         # amax = mant * 2^ex
    headroom = torch.where(mant <= 0.875, 9 - ex, 8 - ex)                            # 448 = 0.875 * 2^9
    headroom = torch.where(mant > 0, headroom, 512)                                  # all-zero groups: any S
    shared = (e - headroom).amax(-1).clamp(0, 254)                                   # [..., G]
    shift = (e - shared.unsqueeze(-1)).clamp(-40, 40)                                # |shift| > 40 loses anyway
    want = v * torch.exp2(shift.float()).unsqueeze(-1)                               # exact in fp32
    codes = want.to(torch.float8_e4m3fn)
    if not torch.equal(codes.float(), want):
        return None
    return codes.flatten(-3), shared.to(torch.uint8).view(scale.dtype)


@functools.lru_cache(maxsize=None)
def fp4_table(device: torch.device) -> torch.Tensor:
    """E2M1 code -> value, made once per device (no host copies inside captured CUDA graphs)."""
    return torch.tensor(FP4_VALUES, dtype=torch.float32).to(device)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., n/2] -> float32 values [..., n] (low nibble = even column)."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return fp4_table(packed.device)[codes.long()]


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = 32,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    vals = unpack_fp4(packed)
    if scale.shape[-1] * group != vals.shape[-1] or scale.shape[:-1] != vals.shape[:-1]:
        raise ValueError(f"fp4 scale shape {tuple(scale.shape)} does not match packed weight "
                         f"{tuple(packed.shape)} with group {group}")
    out = vals * scale_to_float(scale).repeat_interleave(group, dim=-1)
    return out.to(dtype)


@functools.lru_cache(maxsize=None)
def _fp4_boundaries(device: torch.device) -> torch.Tensor:
    """Midpoints between adjacent E2M1 magnitudes; a tie rounds to the even code (RNE), so the
    midpoints whose upper neighbour is even are nudged down one ulp to send ties upward."""
    mags = FP4_VALUES[:8]
    mids = torch.tensor([(a + b) / 2 for a, b in zip(mags, mags[1:])], dtype=torch.float32)
    up = torch.tensor([(i + 1) % 2 == 0 for i in range(7)])
    return torch.where(up, torch.nextafter(mids, torch.zeros_like(mids)), mids).to(device)


def _fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the E2M1 grid; x already scaled into [-6, 6]."""
    idx = torch.bucketize(x.abs().clamp(max=FP4_MAX), _fp4_boundaries(x.device))
    sign = (torch.signbit(x) & (idx > 0)).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def quant_fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., n] -> (int8 packed [..., n/2], E8M0 scale [..., n/group])."""
    g = w.float().unflatten(-1, (-1, group))
    scale = _pow2_scale(g.abs().amax(dim=-1), FP4_MAX)
    codes = _fp4_codes(g / scale.unsqueeze(-1)).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), float_to_e8m0(scale)


def fp4_roundtrip(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    packed, scale = quant_fp4(x, group)
    return dequant_fp4(packed, scale, group, x.dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two width, got {n}")
    shape = x.shape
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return (y.reshape(shape) * n ** -0.5).to(x.dtype)
