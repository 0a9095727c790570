"""Engram n-gram hash and table-row lookup of one Engram layer (DeepSeek-V4.1), in one launch.

For T tokens with windows [T, K] (raw token ids, column k = the token k positions back, -1 = none
or an image token), one layer's constants (multipliers [K], primes / offsets [HH] with HH = (K - 1)
* n_heads, n-gram size 2's heads first) and its table:
  blocked[t, k] = any(windows[t, :k + 1] < 0)                       (cumulative)
  comp[t, k]    = pad_id if blocked else token_map[windows[t, k]]
  hash[t, n]    = XOR over k <= n of comp[t, k] * multipliers[k]    (the (n + 1)-gram, n = 1 .. K - 1)
  row[t, j]     = hash[t, 1 + j // n_heads] % primes[j] + offsets[j]
  emb[t, j, :]  = table row `row[t, j]`, dequantised to `dtype`      -> [T, HH, head_dim]
The table is FP8 e4m3 codes [rows, head_dim] with one E8M0 scale per 32 columns [rows, head_dim / 32]
(value = code * 2^(byte - 127)), or dense (bf16 / fp32).

Exactness (the kernel gives the reference's bits):
  * hash: int64 throughout. Multipliers are odd and < int64_max // compressed_vocab
    (EngramHashParams.build), so comp * multiplier < int64_max never wraps; XOR of non-negative
    values is non-negative, and `%` of non-negative int64 (Triton's truncated remainder) equals
    torch's floored one.
  * FP8: every e4m3 value is a multiple of 2^-9 with <= 4 significant bits and 2^(byte - 127) is
    built from its bits (byte 0: the subnormal 2^-127, 255: inf, as exp2 gives), so the fp32
    product is exact (or inf, in both); to bf16 it is exact above 2^-126, and below it both round
    the same fp32 value to nearest even once. Dense tables: one round-to-nearest-even cast.
  * ids >= len(token_map) (the reference raises) hash as pad_id here rather than read out of bounds.
Grid: (T, cdiv(head_dim, BLOCK_D)); each program hashes its token's window (K scalar loads) and
gathers the [HH, BLOCK_D] tile.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deepinfer.formats.quant import dequant_fp8_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

SCALE_GROUP = 32   # table columns per E8M0 scale
MAX_BLOCK_D = 256


def hash_rows(windows: torch.Tensor, token_map: torch.Tensor | None, multipliers: torch.Tensor, primes: torch.Tensor,
              offsets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Table rows [T, HH] of one layer (torch; the first half of `reference`). token_map None: the
    windows hold compressed ids already."""
    K = windows.shape[-1]
    bad = torch.cummax((windows < 0).to(torch.uint8), dim=-1).values.bool()
    safe = windows.long().clamp(min=0)
    comp = (safe if token_map is None else token_map.long()[safe]).masked_fill(bad, pad_id)
    prod = comp * multipliers.long()
    grams = [prod[:, 0]]
    for k in range(1, K):
        grams.append(grams[-1] ^ prod[:, k])
    per_head = torch.stack(grams[1:], dim=1).repeat_interleave(primes.shape[0] // (K - 1), dim=1)
    return per_head % primes.long() + offsets.long()


def reference(windows: torch.Tensor, token_map: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
              offsets: torch.Tensor, pad_id: int, weight: torch.Tensor, scale: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """emb [T, HH, head_dim] in `dtype`: the hashed rows gathered and dequantised as EngramTable.lookup does."""
    rows = hash_rows(windows, token_map, multipliers, primes, offsets, pad_id)
    w = weight[rows]
    if scale is not None:
        w = dequant_fp8_blocks(w.flatten(0, -2), scale[rows].flatten(0, -2), (1, SCALE_GROUP), dtype).view(w.shape)
    return w.to(dtype)


if triton is not None:
    @triton.jit
    def _engram_lookup_kernel(win, tmap, mult, primes, offsets, w, s, out, V, pad_id, HH, D, NH, w_stride, s_stride,
                              K: tl.constexpr, BLOCK_HH: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                              GROUP: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_HH)
        h_ok = heads < HH
        gram = heads // NH + 1                      # head j hashes the (gram + 1)-gram: columns 0 .. gram
        hv = tl.zeros([BLOCK_HH], tl.int64)
        for k in tl.static_range(K):
            raw = tl.load(win + t * K + k)
            if k == 0:
                blocked = raw < 0
            else:
                blocked = blocked | (raw < 0)
            ok = (~blocked) & (raw < V)
            comp = tl.where(ok, tl.load(tmap + tl.where(ok, raw, 0), mask=ok, other=0), pad_id)
            prod = comp * tl.load(mult + k)
            if k == 0:
                roll = prod
            else:
                roll = roll ^ prod
                hv = tl.where(gram == k, roll, hv)
        p = tl.load(primes + heads, mask=h_ok, other=1)
        row = hv % p + tl.load(offsets + heads, mask=h_ok, other=0)
        row = tl.where(h_ok, row, 0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = h_ok[:, None] & (cols < D)[None, :]
        v = tl.load(w + row[:, None] * w_stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if FP8:
            b = tl.load(s + row[:, None] * s_stride + (cols // GROUP)[None, :], mask=m, other=127).to(tl.int32)
            bits = tl.where(b == 0, 0x00400000, b << 23)          # E8M0 byte -> 2^(byte - 127), exactly
            v = v * bits.to(tl.float32, bitcast=True)
        tl.store(out + (t * HH + heads[:, None]) * D + cols[None, :], v.to(out.dtype.element_ty), mask=m)


def engram_lookup(windows: torch.Tensor, token_map: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                  offsets: torch.Tensor, pad_id: int, weight: torch.Tensor, scale: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """emb [T, HH, head_dim]: the Triton kernel when the table is on CUDA, `reference` otherwise. Every input
    on the table's device; no host syncs (shapes only), so it can be captured in a CUDA graph."""
    if triton is None or not weight.is_cuda:
        return reference(windows, token_map, multipliers, primes, offsets, pad_id, weight, scale, dtype)
    return _launch(windows, token_map, multipliers, primes, offsets, pad_id, weight, scale, dtype)


def _launch(windows, token_map, multipliers, primes, offsets, pad_id, weight, scale, dtype) -> torch.Tensor:
    """The launch without the device checks (also runs under TRITON_INTERPRET=1)."""
    T, K = windows.shape
    HH, D = primes.shape[0], weight.shape[1]
    if K < 2 or HH % (K - 1) or multipliers.shape[0] != K or offsets.shape[0] != HH:
        raise ValueError(f"engram lookup: windows of {K} columns need {K} multipliers and (K - 1) * n_heads "
                         f"primes / offsets, got {multipliers.shape[0]} / {HH} / {offsets.shape[0]}")
    fp8 = scale is not None
    if fp8 and (D % SCALE_GROUP or scale.shape[1] != D // SCALE_GROUP or scale.stride(1) != 1):
        raise ValueError(f"engram lookup: FP8 table {tuple(weight.shape)} needs one scale per {SCALE_GROUP} "
                         f"columns, got {tuple(scale.shape)}")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty(T, HH, D, dtype=dtype, device=weight.device)
    if T == 0:
        return out
    if fp8:
        s = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    else:
        s = weight  # never read
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(D))
    grid = (T, triton.cdiv(D, block_d))
    i64 = lambda t: t.long().contiguous()  # noqa: E731
    _engram_lookup_kernel[grid](i64(windows), i64(token_map), i64(multipliers), i64(primes), i64(offsets), weight, s,
                                out, token_map.shape[0], pad_id, HH, D, HH // (K - 1), weight.stride(0), s.stride(0),
                                K=K, BLOCK_HH=triton.next_power_of_2(HH), BLOCK_D=block_d, FP8=fp8,
                                GROUP=SCALE_GROUP, num_warps=4)
    return out


@dataclass(frozen=True)
class EngramQuery:
    """One Engram layer's lookup inputs for a step: the windows [T, K] (shared by the layers) and that layer's
    hash constants, all on the table's device. Indexing picks tokens (bounded replay's row subset)."""

    windows: torch.Tensor
    token_map: torch.Tensor
    multipliers: torch.Tensor
    primes: torch.Tensor
    offsets: torch.Tensor
    pad_id: int

    @property
    def device(self) -> torch.device:
        return self.windows.device

    def __getitem__(self, idx) -> "EngramQuery":
        return replace(self, windows=self.windows[idx])

    def lookup(self, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return engram_lookup(self.windows, self.token_map, self.multipliers, self.primes, self.offsets, self.pad_id,
                             weight, scale, dtype)
