"""Weight-streaming grouped GEMM for decode: few rows per group, quantised weights read once.

    out[r, :] = A[r, :] @ W[e(r)]^T        A [M, K] bf16, out [M, N] bf16, fp32 accumulation

The contract of kernels/grouped_gemm.py (rows sorted by group, `offs` the cumulative row ends, or
offs None for one group; W dense bf16, FP8 e4m3 with block scales, or FP4 e2m1 packed two codes a
byte with E8M0 scales per 32 inputs), for the case that decode meets: 1-8 rows per group (a dense
Linear at a small batch; the routed experts at 64 tokens x 6 of 256 experts, ~1.5 rows each).
There the weight bytes are the whole cost and the tensor-core tile of grouped_gemm (16 rows at
least) mostly multiplies padding, so this kernel
  * multiplies on CUDA cores in fp32: a program loads a [BLOCK_N, BLOCK_K] weight tile, widens it
    in registers and applies it to its ROWS rows (acc[ROWS, BLOCK_N] += sum_k a[r, k] w[n, k]);
  * widens e2m1 codes by placing their bits in an fp16 (grouped_gemm.e2m1_fp32), then scales them;
  * keeps every SM busy with many small programs: grid (row tiles, cdiv(N, BLOCK_N), SPLIT_K),
    K split into SPLIT_K ranges whose fp32 partials [SPLIT_K, M, N] kernels/split_sum.py adds in
    split order. SPLIT_K and the tiles depend on the shapes only (M, N, K, E): deterministic, no
    host sync, CUDA-graph capturable.
A group with more rows than ROWS takes several row tiles, each reading the group's weights (from
L2 after the first); decode_rows() says when this kernel is the right one.
Scales are applied as in grouped_gemm: per output column on the partial product when one scale
block spans the K tile, per weight element otherwise (broadcast over the tile's blocks).
"""
from __future__ import annotations

import torch

from deepinfer.kernels import sm_count
from deepinfer.kernels.grouped_gemm import FP4, FP4_GROUP, FP8, _as_3d, _format, max_m_tiles, reference
from deepinfer.kernels.split_sum import split_sum_into

try:
    import triton
    import triton.language as tl

    from deepinfer.kernels.grouped_gemm import _e8m0, e2m1_fp32, group_tile
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

__all__ = ["decode_gemm", "decode_rows", "default_config", "reference"]

MAX_ROWS = 8  # mean rows per group up to which decode_gemm beats grouped_gemm's tensor-core tiles


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_rows(M: int, E: int) -> bool:
    """Whether M rows over E groups are few enough per group for this kernel."""
    return 0 < M <= MAX_ROWS * max(E, 1)


def default_config(M: int, E: int, N: int, K: int, fmt: int, sms: int) -> dict:
    """ROWS from the mean rows per group; 32-wide N tiles; K split until there are ~4 programs per SM
    (each split keeping at least 2 K tiles)."""
    rows = max(1, min(MAX_ROWS, _cdiv(M, max(E, 1))))
    ROWS = 1 << (rows - 1).bit_length()
    BLOCK_N, BLOCK_K = 32, 256 if fmt == FP4 else 128
    programs = max_m_tiles(M, E, ROWS, E == 1) * _cdiv(N, BLOCK_N)
    k_tiles = _cdiv(K, BLOCK_K)
    split = 1
    while split < 32 and programs * split < 4 * sms and k_tiles >= 4 * split:
        split *= 2
    return dict(ROWS=ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=split, num_warps=4)


if triton is not None:
    @triton.jit
    def _decode_gemm_kernel(a_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, M, N, E, K, K_PART,
                            s_am, s_ak, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_om, s_on,
                            FMT: tl.constexpr, E8M0: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                            ONE_GROUP: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        k_lo = tl.program_id(2) * K_PART              # K_PART: a multiple of BLOCK_K
        k_hi = tl.minimum(k_lo + K_PART, K)
        live, row0, row_end, w_base, s_base = group_tile(pid_m, offs_ptr, M, E, w_ptr, s_ptr, s_we, s_se,
                                                          ONE_GROUP, E_PAD, ROWS)
        if live == 0:
            return

        rows = row0 + tl.arange(0, ROWS)
        rmask = (rows < row_end) & (rows < M)
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * s_am
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        w_rows = w_base + cols.to(tl.int64)[:, None] * s_wn
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)

        HALF: tl.constexpr = BLOCK_K // 2
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if FMT == 2:  # FP4: byte j of a row holds columns 2j (low nibble) and 2j + 1 (high)
                kp = k0 // 2 + tl.arange(0, HALF)
                kmask = kp < K // 2
                amask = rmask[:, None] & kmask[None, :]
                a_even = tl.load(a_rows + (2 * kp)[None, :] * s_ak, mask=amask, other=0.0).to(tl.float32)
                a_odd = tl.load(a_rows + (2 * kp + 1)[None, :] * s_ak, mask=amask, other=0.0).to(tl.float32)
                byte = tl.load(w_rows + kp[None, :] * s_wk, mask=nmask[:, None] & kmask[None, :],
                               other=0).to(tl.int32) & 0xFF
                NS: tl.constexpr = HALF // 16            # one scale per 32 inputs = 16 bytes
                sk = k0 // 32 + tl.arange(0, NS)
                sb = tl.load(s_base + cols[:, None] * s_sn + sk[None, :] * s_sk,
                             mask=nmask[:, None] & (sk < K // 32)[None, :], other=127)
                s = tl.reshape(tl.broadcast_to(_e8m0(sb)[:, :, None], (BLOCK_N, NS, 16)), (BLOCK_N, HALF))
                lo = e2m1_fp32(byte & 0xF) * s
                hi = e2m1_fp32(byte >> 4) * s
                acc += tl.sum(a_even[:, None, :] * lo[None, :, :] + a_odd[:, None, :] * hi[None, :, :], 2)
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                kmask = ks < K
                a = tl.load(a_rows + ks[None, :] * s_ak, mask=rmask[:, None] & kmask[None, :], other=0.0)
                a = a.to(tl.float32)
                wmask = nmask[:, None] & kmask[None, :]
                w = tl.load(w_rows + ks[None, :] * s_wk, mask=wmask, other=0.0).to(tl.float32)
                if FMT == 0:
                    acc += tl.sum(a[:, None, :] * w[None, :, :], 2)
                elif BI % BLOCK_K == 0:  # one scale block spans the K tile: scale the partial product
                    s = tl.load(s_base + (cols // BO) * s_sn + (k0 // BI) * s_sk, mask=nmask, other=0)
                    s = _e8m0(s) if E8M0 else s.to(tl.float32)
                    acc += tl.sum(a[:, None, :] * w[None, :, :], 2) * s[None, :]
                elif BLOCK_K % BI == 0:  # BLOCK_K / BI scale blocks per K tile, broadcast in registers
                    NB: tl.constexpr = BLOCK_K // BI
                    sk = k0 // BI + tl.arange(0, NB)
                    s = tl.load(s_base + (cols // BO)[:, None] * s_sn + sk[None, :] * s_sk,
                                mask=nmask[:, None] & (sk * BI < K)[None, :], other=0)
                    s = _e8m0(s) if E8M0 else s.to(tl.float32)
                    w = tl.reshape(tl.reshape(w, (BLOCK_N, NB, BI)) * s[:, :, None], (BLOCK_N, BLOCK_K))
                    acc += tl.sum(a[:, None, :] * w[None, :, :], 2)
                else:
                    s = tl.load(s_base + (cols // BO)[:, None] * s_sn + (ks // BI)[None, :] * s_sk,
                                mask=wmask, other=0)
                    s = _e8m0(s) if E8M0 else s.to(tl.float32)
                    acc += tl.sum(a[:, None, :] * (w * s)[None, :, :], 2)

        out = out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :] * s_on
        if SPLIT_K > 1:  # fp32 partials [SPLIT_K, M, N] (contiguous), summed in split order after
            out += tl.program_id(2).to(tl.int64) * M * N
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def _scale_view(w: torch.Tensor, scale: torch.Tensor | None, fmt: int, N: int, K: int,
                block_size: tuple[int, int]) -> tuple[torch.Tensor, bool]:
    """The scale tensor as the kernel reads it (E8M0 as uint8) and whether it is E8M0; checks its shape."""
    E = w.shape[0]
    if fmt == FP8:
        want = (E, _cdiv(N, block_size[0]), _cdiv(K, block_size[1]))
    elif fmt == FP4:
        if K % FP4_GROUP:
            raise ValueError(f"decode_gemm: FP4 needs K % {FP4_GROUP} == 0, got {K}")
        want = (E, N, K // FP4_GROUP)
    else:
        if scale is not None:
            raise ValueError("decode_gemm: a dense weight takes no scale")
        return w, False  # unused placeholder pointer
    if scale is None or tuple(scale.shape) != want:
        raise ValueError(f"decode_gemm: scale {None if scale is None else tuple(scale.shape)} for weight "
                         f"{tuple(w.shape)}, expected {want}")
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return scale.view(torch.uint8), True
    if fmt == FP4:
        raise TypeError(f"decode_gemm: FP4 scales are E8M0, got {scale.dtype}")
    if not scale.is_floating_point():
        raise TypeError(f"decode_gemm: unsupported scale dtype {scale.dtype}")
    return scale, False


def _launch(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, scale: torch.Tensor | None,
            block_size: tuple[int, int], **tiles) -> torch.Tensor:
    """The Triton launch on whatever device the tensors are on (CPU only under TRITON_INTERPRET=1);
    `tiles` overrides default_config's keys."""
    w, scale = _as_3d(w, scale, offs)
    fmt = _format(w)
    E, N = w.shape[0], w.shape[1]
    K = w.shape[2] * 2 if fmt == FP4 else w.shape[2]
    M = a.shape[0]
    if a.dim() != 2 or a.shape[1] != K:
        raise ValueError(f"decode_gemm: A {tuple(a.shape)} does not match weight {tuple(w.shape)} (K={K})")
    if offs is not None and (offs.dim() != 1 or offs.shape[0] != E):
        raise ValueError(f"decode_gemm: offs {tuple(offs.shape)} for {E} groups")
    scale, e8m0 = _scale_view(w, scale, fmt, N, K, block_size)
    bo, bi = block_size if fmt == FP8 else (1, 1)
    cfg = default_config(M, E, N, K, fmt, sm_count(a.device) if a.is_cuda else 8)
    unknown = set(tiles) - set(cfg)
    if unknown:
        raise TypeError(f"decode_gemm: unknown tile keys {sorted(unknown)}")
    cfg.update({k: v for k, v in tiles.items() if v is not None})
    if fmt == FP4 and cfg["BLOCK_K"] % 32:
        raise ValueError("decode_gemm: FP4 needs BLOCK_K % 32 == 0 (16 packed bytes per scale)")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    split = cfg.pop("SPLIT_K")
    k_part = _cdiv(_cdiv(K, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = _cdiv(K, k_part)  # no empty split
    dst = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=a.device)
    one_group = offs is None
    grid = (max_m_tiles(M, E, cfg["ROWS"], one_group), triton.cdiv(N, cfg["BLOCK_N"]), split)
    _decode_gemm_kernel[grid](
        a, w, scale, a if one_group else offs, dst, M, N, E, K, k_part,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2), N, 1,
        FMT=fmt, E8M0=e8m0, BO=bo, BI=bi, ONE_GROUP=one_group, E_PAD=max(16, triton.next_power_of_2(E)),
        SPLIT_K=split, **cfg)
    if split > 1:
        split_sum_into(dst, out)
    return out


def decode_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, scale: torch.Tensor | None = None,
                block_size: tuple[int, int] = (128, 128), **tiles) -> torch.Tensor:
    """out [M, N] bf16 = A [M, K] bf16 @ W[e]^T per row group (grouped_gemm's arguments). Triton on
    CUDA, grouped_gemm's `reference` elsewhere. No host sync: the launch depends on shapes only."""
    if triton is None or not a.is_cuda:
        return reference(a, w, offs, scale, block_size)
    if a.dtype != torch.bfloat16:
        raise TypeError(f"decode_gemm: activations must be bf16, got {a.dtype}")
    return _launch(a, w, offs, scale, block_size, **tiles)
