"""Grouped FP8 x FP8 GEMM over expert-sorted rows (W8A8: the routed experts at prefill sizes; W4A8: FP4 experts
read as shipped).

    out[r, n] = sum_k (q_a[r, k] * s_a[r, k // ga]) * (q_w[e(r), n, k] * s_w[e(r), n // bo, k // bi])  -> bf16

A [M, K] e4m3 with per-row group scales s_a [M, ceil(K/ga)] fp32 (kernels/act_quant.py's output, any
strides: its column-major layout included); W [E, N, K] e4m3 with block scales s_w [E, ceil(N/bo),
ceil(K/bi)] (E8M0 or fp32). Rows sorted by expert with `offs` [E] int32 the cumulative row ends
(kernels/grouped_gemm.py's convention: rows past offs[-1] are left unwritten).

The recipe is DeepSeek's for FP8 weights (spec deepseek-v4.md 3.14; kernels/fp8_gemm.py for one
weight): each BLOCK_K-wide K step is one e4m3 x e4m3 tl.dot (fp32 result on the tensor cores),
multiplied by s_a[rows, k // ga] (x) s_w[cols // bo, k // bi] and added to an fp32 accumulator.
BLOCK_K divides min(ga, bi), so one scale of each operand covers a step. V4's FP4 routed experts
reach this kernel as FP8 codes whose (1, 32) E8M0 scales were folded to (1, 128)
(formats/quant.py fold_e8m0_groups): ga = bi = 128, bo = 1.

Schedule (no host sync, CUDA-graph capturable): kernels/grouped_gemm.py's tile -> expert map
(`group_tile`: an upper bound of row tiles from the shapes, programs past the real count return).
The grid is one axis, output column tiles fastest: the programs running at once share a few row
tiles (each A tile read from memory once) and walk their experts' weights, which the row tiles of
the same expert read back from L2.

Variants (`variant=`; "pointer" is the default; the engine's MoE layer runs "tma" where `tma_variant_ok`):
  * "pointer": A and W tiles loaded through pointer tensors (cp.async pipelined by Triton);
  * "gluon": kernels/grouped_gemm_fp8_gluon.py, sm_90 only: TMA operands as "tma", each K step's wgmma
    in flight while the previous step's product is scaled and added (its own tiles and checks);
  * "tma": Hopper's tensor memory accelerator. Host-side tensor descriptors over A [M, K] and W viewed
    as [E * N, K] (block [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K]); a tile's rows past its expert's end
    (or its columns past N) are the next expert's rows, read and multiplied but never stored (the store
    is masked as in "pointer"); reads past M / E * N / K are zero-filled by the hardware. The address
    arithmetic leaves the registers. Needs W's experts contiguous (stride(0) == N * stride(1)) and
    16-byte aligned strides (K % 16 == 0).
    With `programs=P` the "tma" grid is persistent: P programs (e.g. the SM count), program p taking
    tiles p, p + P, ... of the same tile order until it meets the first tile past the real count.

W4A8 (packed FP4 weights, variant "pointer" only, `block` (1, 32)): W [E, N, K/2] int8 / uint8, byte j of a
row holding column 2j in its low nibble and 2j + 1 in its high nibble (kernels/grouped_gemm.py's FP4
layout, formats/quant.py unpack_fp4), with E8M0 scales [E, N, K/32]; K % 32 == 0. The weight bytes are read
as shipped (half the bytes of the FP8 repack) and turned into e4m3 operands with bit operations only: for a
nibble c (bit 3 sign, bits 2..0 = e1 e0 m) the byte ((c & 7) << 2) | ((c & 8) << 4) is the e4m3 value
e2m1(c) * 2^-6 exactly, for all 16 codes (the normal codes land in e4m3 exponent fields 1..3, code 1 = 0.5
on the subnormal 4/8 * 2^-6); for a whole byte b the low code is ((b & 0x07) << 2) | ((b & 0x08) << 4) and
the high one ((b >> 2) & 0x1C) | (b & 0x80). On CUDA that is PTX over 4 bytes a 32-bit register
(`asm`, default on; the plain Triton byte ops, one byte a lane, are what the interpreter runs). The two
code planes are put back in K order with tl.join + reshape ([n, j, 2] -> column 2j + nibble). A weight
scale 2^(s - 127) holds for 32 columns only, so each 32-wide group is its own e4m3 x e4m3 tl.dot (K = 32,
the fp8 MMA's K), multiplied by s_a[row] (one per 128-column activation group: BLOCK_K divides ga) x
s_w[n, group] and added to the fp32 accumulator; the 2^6 the codes leave out is applied once at the end
(folding it into the scale would overflow fp32 for scale bytes 249..254). A K step of BLOCK_K columns
loads its activation scales and its BLOCK_K / 32 scale bytes per column one step ahead. Tiles of 64 rows
run fp8 wgmma; decode's 16-row tiles (w4a8_config) run Triton's MMAv2, which on sm_90 widens both e4m3
operands to fp16 (exactly) for fp16 mma.sync.
Not used by the engine: measured slower than the FP8 repack at decode and prefill sizes (benchmarks/NOTES.md,
"Measurements behind the kernels' defaults"): the per-group rescaling and the conversion bound it, not the bytes.

Products of two e4m3 values are exact in fp32; only summation order differs from `reference`
(both operands dequantised in fp32, packed FP4 by dequant_fp4, fp32 matmul, bf16). Under TRITON_INTERPRET=1
the operands are widened to fp32 before the dot (the interpreter's tl.dot cannot multiply fp8 bit patterns).
"""
from __future__ import annotations

import math

import torch

from deepinfer.formats.quant import dequant_fp4, dequant_fp8_blocks
from deepinfer.kernels.act_quant import dequant as act_dequant
from deepinfer.kernels.fp8_gemm import _interpreted
from deepinfer.kernels.grouped_gemm import max_m_tiles

try:
    import triton
    import triton.language as tl

    from deepinfer.kernels.grouped_gemm import _e8m0, group_tile
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None
try:  # variant "tma" only: a Triton without host tensor descriptors still runs the default variant
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8)  # weight scales as exponent bytes
VARIANTS = ("pointer", "tma", "gluon")
W4_DTYPES = (torch.int8, torch.uint8)  # packed FP4 weights: two e2m1 codes a byte (W4A8)
FP4_GROUP = 32                          # K columns per E8M0 scale of a packed FP4 weight


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tma_variant_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether variant "tma" takes A [M, K] and W [E, N, K] as they are (what `_launch_tma` checks, as a
    test instead of an error): a Triton with host descriptors, W's experts contiguous, unit stride along K,
    16-byte aligned bases and row strides."""
    return (TensorDescriptor is not None and w.dim() == 3 and a.stride(1) == 1 and w.stride(2) == 1
            and w.stride(0) == w.shape[1] * w.stride(1) and a.stride(0) % 16 == 0 and w.stride(1) % 16 == 0
            and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def _check(a, a_scale, w, w_scale, offs, group, block) -> None:
    if w.dtype in W4_DTYPES:
        _check_w4(a, a_scale, w, w_scale, offs, group, block)
        return
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_gemm_fp8: A {tuple(a.shape)} and weight {tuple(w.shape)} are not [M, K] and "
                         "[E, N, K]")
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"grouped_gemm_fp8: A and weight must be float8_e4m3fn, got {a.dtype} and {w.dtype}")
    M, K = a.shape
    E, N = w.shape[0], w.shape[1]
    if tuple(a_scale.shape) != (M, _cdiv(K, group)):
        raise ValueError(f"grouped_gemm_fp8: a_scale {tuple(a_scale.shape)}, expected {(M, _cdiv(K, group))}")
    want = (E, _cdiv(N, block[0]), _cdiv(K, block[1]))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"grouped_gemm_fp8: w_scale {tuple(w_scale.shape)} for weight {tuple(w.shape)} "
                         f"with block {tuple(block)}, expected {want}")
    if w_scale.dtype not in E8M0_DTYPES and not w_scale.is_floating_point():
        raise TypeError(f"grouped_gemm_fp8: w_scale dtype {w_scale.dtype} is neither E8M0 nor floating point")
    if offs is None or offs.dim() != 1 or offs.shape[0] != E:
        raise ValueError(f"grouped_gemm_fp8: offs {None if offs is None else tuple(offs.shape)} for {E} groups")


def _check_w4(a, a_scale, w, w_scale, offs, group, block) -> None:
    """Packed FP4 weights (W4A8): w [E, N, K/2] int8/uint8, w_scale [E, N, K/32] E8M0, block (1, 32)."""
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != 2 * w.shape[2]:
        raise ValueError(f"grouped_gemm_fp8: A {tuple(a.shape)} and packed FP4 weight {tuple(w.shape)} are not "
                         "[M, K] and [E, N, K/2]")
    if a.dtype != torch.float8_e4m3fn:
        raise TypeError(f"grouped_gemm_fp8: A must be float8_e4m3fn, got {a.dtype}")
    M, K = a.shape
    E, N = w.shape[0], w.shape[1]
    if tuple(block) != (1, FP4_GROUP):
        raise ValueError(f"grouped_gemm_fp8: block {tuple(block)} for a packed FP4 weight, expected (1, {FP4_GROUP})")
    if K % FP4_GROUP:
        raise ValueError(f"grouped_gemm_fp8: packed FP4 weight needs K % {FP4_GROUP} == 0, got K {K}")
    if group % FP4_GROUP:
        raise ValueError(f"grouped_gemm_fp8: group {group} must be a multiple of {FP4_GROUP} for a packed FP4 weight")
    if tuple(a_scale.shape) != (M, _cdiv(K, group)):
        raise ValueError(f"grouped_gemm_fp8: a_scale {tuple(a_scale.shape)}, expected {(M, _cdiv(K, group))}")
    if tuple(w_scale.shape) != (E, N, K // FP4_GROUP):
        raise ValueError(f"grouped_gemm_fp8: w_scale {tuple(w_scale.shape)} for packed FP4 weight {tuple(w.shape)}, "
                         f"expected {(E, N, K // FP4_GROUP)}")
    if w_scale.dtype not in E8M0_DTYPES:
        raise TypeError(f"grouped_gemm_fp8: w_scale of a packed FP4 weight must be E8M0 (float8_e8m0fnu / uint8), "
                        f"got {w_scale.dtype}")
    if offs is None or offs.dim() != 1 or offs.shape[0] != E:
        raise ValueError(f"grouped_gemm_fp8: offs {None if offs is None else tuple(offs.shape)} for {E} groups")


def reference(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              offs: torch.Tensor, group: int = 128, block: tuple[int, int] = (1, 128)) -> torch.Tensor:
    """Plain torch: A and each group's W dequantised to fp32, one fp32 matmul per group, cast to bf16.
    Rows past offs[-1] are zero here (the kernel leaves them unwritten)."""
    _check(a, a_scale, w, w_scale, offs, group, block)
    x = act_dequant(a, a_scale, group)
    bounds = [0] + offs.tolist()
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            we = (dequant_fp4(w[e], w_scale[e], FP4_GROUP) if w.dtype in W4_DTYPES
                  else dequant_fp8_blocks(w[e], w_scale[e], block))
            out[lo:hi] = (x[lo:hi] @ we.T).to(torch.bfloat16)
    return out


def default_config(M: int, E: int) -> dict:
    """64 x 128 x 128 tiles, 4 warps, 4 stages at every size (the fastest of the configurations tried
    at V4's expert shapes: benchmarks/NOTES.md, "Measurements behind the kernels' defaults")."""
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)


if triton is not None:
    @triton.jit
    def _grouped_gemm_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles,
                                 s_am, s_asm, s_asg, s_we, s_wn, s_wse, s_wsn, s_wsk, s_om,
                                 K: tl.constexpr, GA: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                                 E8M0: tl.constexpr, E_PAD: tl.constexpr, OP: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        pid_m = pid // n_tiles
        pid_n = pid % n_tiles
        live, row0, row_end, w_base, ws_base = group_tile(pid_m, offs_ptr, M, E, w_ptr, ws_ptr, s_we, s_wse,
                                                           False, E_PAD, BLOCK_M)
        if live == 0:
            return
        rows, cols = row0 + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, nmask = (rows < row_end) & (rows < M), cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * s_am + ks[None, :]
        w_ptrs = w_base + cols.to(tl.int64)[:, None] * s_wn + ks[None, :]
        as_ptrs = as_ptr + rows.to(tl.int64) * s_asm
        ws_ptrs = ws_base + (cols // BO) * s_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for t in range(0, tl.cdiv(K, BLOCK_K)):  # K step t: one scale of each operand (BLOCK_K | GA, BI)
            left = K - t * BLOCK_K
            a_t = tl.load(a_ptrs, mask=rmask[:, None] & (ks < left)[None, :], other=0.0).to(OP)
            w_t = tl.load(w_ptrs, mask=nmask[:, None] & (ks < left)[None, :], other=0.0).to(OP)
            a_s = tl.load(as_ptrs + (t * BLOCK_K // GA) * s_asg, mask=rmask, other=0.0)
            w_s = tl.load(ws_ptrs + (t * BLOCK_K // BI) * s_wsk, mask=nmask, other=0)
            w_s = _e8m0(w_s) if E8M0 else w_s.to(tl.float32)
            # e4m3 x e4m3 -> fp32 on the tensor cores, promoted to the fp32 accumulator with both scales
            acc += tl.dot(a_t, tl.trans(w_t)) * (a_s[:, None] * w_s[None, :])
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _tma_tile(tile, a_desc, as_ptr, w_desc, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles,
                  s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om,
                  K: tl.constexpr, GA: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, E8M0: tl.constexpr,
                  E_PAD: tl.constexpr, OP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One output tile of the "tma" variant; returns 0 for a tile past the real count (nothing done)."""
        pid_m = tile // n_tiles
        pid_n = tile % n_tiles
        # weight "base" 0 with stride 1: group_tile hands back the tile's expert index itself
        live, row0, row_end, e, ws_base = group_tile(pid_m, offs_ptr, M, E, 0, ws_ptr, 1, s_wse, False, E_PAD,
                                                     BLOCK_M)
        if live != 0:
            rows, cols = row0 + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rmask, nmask = (rows < row_end) & (rows < M), cols < N
            w_row = (e * N + pid_n * BLOCK_N).to(tl.int32)  # in W viewed as [E * N, K]
            as_ptrs = as_ptr + rows.to(tl.int64) * s_asm
            ws_ptrs = ws_base + (cols // BO) * s_wsn
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for t in range(0, tl.cdiv(K, BLOCK_K)):
                # whole tiles: rows of the next expert (or past M / E * N / K: zeros) are multiplied, never stored
                a_t = a_desc.load([row0, t * BLOCK_K]).to(OP)
                w_t = w_desc.load([w_row, t * BLOCK_K]).to(OP)
                a_s = tl.load(as_ptrs + (t * BLOCK_K // GA) * s_asg, mask=rmask, other=0.0)
                w_s = tl.load(ws_ptrs + (t * BLOCK_K // BI) * s_wsk, mask=nmask, other=0)
                w_s = _e8m0(w_s) if E8M0 else w_s.to(tl.float32)
                acc += tl.dot(a_t, tl.trans(w_t)) * (a_s[:, None] * w_s[None, :])
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=rmask[:, None] & nmask[None, :])
        return live

    @triton.jit
    def _grouped_gemm_fp8_tma_kernel(a_desc, as_ptr, w_desc, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles, n_programs,
                                     s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om,
                                     K: tl.constexpr, GA: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                                     E8M0: tl.constexpr, E_PAD: tl.constexpr, OP: tl.constexpr,
                                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                     PERSISTENT: tl.constexpr):
        if PERSISTENT:  # tiles pid, pid + n_programs, ... up to the first one past the real count
            tile = tl.program_id(0)
            live = 1
            while live != 0:
                live = _tma_tile(tile, a_desc, as_ptr, w_desc, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles,
                                 s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K, GA, BO, BI, E8M0, E_PAD, OP,
                                 BLOCK_M, BLOCK_N, BLOCK_K)
                tile += n_programs
        else:
            _tma_tile(tl.program_id(0), a_desc, as_ptr, w_desc, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles,
                      s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K, GA, BO, BI, E8M0, E_PAD, OP,
                      BLOCK_M, BLOCK_N, BLOCK_K)


def w4a8_config(M: int, E: int) -> dict:
    """Packed FP4 weights (W4A8): K steps of 128 (four 32-wide groups, one activation scale), 128-wide N tiles,
    4 warps, 4 stages. Up to 16 rows an expert on average (decode: 64 tokens x top-6 of 256 is 1.5) 16-row
    tiles: Triton's MMAv2 (mma.sync; on sm_90 it widens the e4m3 operands to fp16, exactly, for fp16 MMAs)
    instead of wgmma's 64 rows, a quarter of the multiplies and of the per-group rescaling spent on rows past
    the expert's end; 64-row tiles (fp8 wgmma) above. Built for sm_90: 82 / 193 registers, 30.5 / 60 KiB
    shared, no spills (tests/kernels/test_grouped_gemm_fp8_w4a8.py). A choice from the sm_90 builds; timed
    against the other expert paths in the module docstring (the tile sweep, --experts --sweep's W4A8_SWEEP,
    has not run)."""
    rows = M / max(E, 1)
    return dict(BLOCK_M=16 if rows <= 16 else 64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)


if triton is not None:
    @triton.jit
    def _e2m1_as_e4m3(b, ASM: tl.constexpr):
        """Packed bytes b (uint8, two e2m1 codes) -> (low, high) uint8 bit patterns of e4m3 values equal to
        e2m1(code) * 2^-6: the code's sign to bit 7, its e1 e0 m bits to bits 4..2 (module docstring).
        ASM: PTX over 4 bytes a 32-bit register (CUDA only); else byte ops, one element a lane."""
        if ASM:
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t, u;
                shl.b32 t, $2, 2;
                and.b32 t, t, 0x1C1C1C1C;
                shl.b32 u, $2, 4;
                and.b32 u, u, 0x80808080;
                or.b32 $0, t, u;
                shr.b32 t, $2, 2;
                and.b32 t, t, 0x1C1C1C1C;
                and.b32 u, $2, 0x80808080;
                or.b32 $1, t, u;
                }""",
                constraints="=r,=r,r", args=[b], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
        else:
            return ((b & 0x07) << 2) | ((b & 0x08) << 4), ((b >> 2) & 0x1C) | (b & 0x80)

    @triton.jit
    def _w4a8_scales(as_ptrs, ws_ptrs, t, rmask, nmask, gs, s_asg, s_wsk, K: tl.constexpr, GA: tl.constexpr,
                     NG: tl.constexpr, BLOCK_K: tl.constexpr):
        """K step t's scales: the activation scale per row [BLOCK_M] and the NG = BLOCK_K / 32 weight scales
        per column [BLOCK_N, NG] as fp32 (NG contiguous bytes a row, one load); zeros past K."""
        a_s = tl.load(as_ptrs + (t * BLOCK_K // GA) * s_asg, mask=rmask & (t * BLOCK_K < K), other=0.0)
        ws = tl.load(ws_ptrs[:, None] + (t * NG + gs)[None, :] * s_wsk,
                     mask=nmask[:, None] & (t * NG + gs < K // 32)[None, :], other=0)
        return a_s, _e8m0(ws)

    @triton.jit
    def _grouped_gemm_w4a8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles,
                                  s_am, s_asm, s_asg, s_we, s_wn, s_wse, s_wsn, s_wsk, s_om,
                                  K: tl.constexpr, GA: tl.constexpr, E_PAD: tl.constexpr, OP: tl.constexpr,
                                  ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)  # output column tiles fastest, as in _grouped_gemm_fp8_kernel
        live, row0, row_end, w_base, ws_base = group_tile(pid // n_tiles, offs_ptr, M, E, w_ptr, ws_ptr, s_we,
                                                           s_wse, False, E_PAD, BLOCK_M)
        if live == 0:
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, nmask = (rows < row_end) & (rows < M), cols < N
        ks, kb = tl.arange(0, 32), tl.arange(0, 16)   # one 32-wide K group: 32 A columns, 16 packed W bytes
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * s_am + ks[None, :]
        w_ptrs = w_base + cols.to(tl.int64)[:, None] * s_wn + kb[None, :]
        as_ptrs = as_ptr + rows.to(tl.int64) * s_asm
        ws_ptrs = ws_base + cols.to(tl.int64) * s_wsn
        NG: tl.constexpr = BLOCK_K // 32
        gs = tl.arange(0, NG)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        a_s, ws_t = _w4a8_scales(as_ptrs, ws_ptrs, 0, rmask, nmask, gs, s_asg, s_wsk, K, GA, NG, BLOCK_K)
        for t in range(0, tl.cdiv(K, BLOCK_K)):  # K step t: one activation scale (BLOCK_K | GA)
            # the next step's scales loaded now, used an iteration later (their latency hidden by this step)
            a_next, ws_next = _w4a8_scales(as_ptrs, ws_ptrs, t + 1, rmask, nmask, gs, s_asg, s_wsk, K, GA, NG,
                                           BLOCK_K)
            for g in tl.static_range(NG):  # one dot per 32-wide group: its weight scale is constant
                k0 = t * BLOCK_K + g * 32     # K % 32 == 0: a group lies wholly inside or past K
                a_g = tl.load(a_ptrs + k0, mask=rmask[:, None] & (k0 < K), other=0.0).to(OP)
                byte = tl.load(w_ptrs + k0 // 2, mask=nmask[:, None] & (k0 < K), other=0)
                lo, hi = _e2m1_as_e4m3(byte.to(tl.uint8, bitcast=True), ASM)
                # [n, j, 2] -> [n, 2j + (0: low nibble, 1: high)]: the codes in natural K order
                w_g = tl.reshape(tl.join(lo, hi), (BLOCK_N, 32)).to(tl.float8e4nv, bitcast=True).to(OP)
                w_s = tl.sum(tl.where(gs[None, :] == g, ws_t, 0.0), 1)  # column g of the step's scales
                # e4m3 x e4m3 -> fp32 on the tensor cores; the codes carry 2^-6, returned after the loop
                acc += tl.dot(a_g, tl.trans(w_g)) * (a_s[:, None] * w_s[None, :])
            a_s, ws_t = a_next, ws_next
        acc = acc * 64.0  # the 2^6 the e4m3 codes left out (applied last: 2^(byte - 121) overflows for 249..254)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])


def _launch(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
            group: int = 128, block: tuple[int, int] = (1, 128), variant: str = "pointer", programs: int | None = None,
            **tiles) -> torch.Tensor:
    """The Triton launch on whatever device the tensors are on (CPU only under TRITON_INTERPRET=1).
    `tiles`: BLOCK_M / BLOCK_N / BLOCK_K / num_warps / num_stages over default_config's. `variant`: one of
    VARIANTS; `programs` (variant "tma" only): a persistent grid of that many programs. Packed FP4 weights:
    w4a8_config's tiles, and `asm=False` in `tiles` picks the plain Triton nibble conversion."""
    _check(a, a_scale, w, w_scale, offs, group, block)
    if w.dtype in W4_DTYPES:
        return _launch_w4a8(a, a_scale, w, w_scale, offs, group, variant, programs, **tiles)
    if variant not in VARIANTS:
        raise ValueError(f"grouped_gemm_fp8: variant {variant!r} is not one of {VARIANTS}")
    if programs is not None and (variant != "tma" or programs < 1):
        raise ValueError(f"grouped_gemm_fp8: programs {programs} needs variant 'tma' and at least 1 program")
    if variant == "gluon":  # its own tiles and checks (kernels/grouped_gemm_fp8_gluon.py)
        from deepinfer.kernels.grouped_gemm_fp8_gluon import launch as launch_gluon
        return launch_gluon(a, a_scale, w, w_scale, offs, group, block, **tiles)
    M, K = a.shape
    E, N = w.shape[0], w.shape[1]
    cfg = default_config(M, E)
    cfg.update({k: v for k, v in tiles.items() if v is not None})
    bk = cfg["BLOCK_K"]
    if bk < 32 or min(group, block[1]) % bk:
        raise ValueError(f"grouped_gemm_fp8: BLOCK_K {bk} must be >= 32 and divide min(group, block[1]) = "
                         f"{min(group, block[1])} (one scale of each operand per K step)")
    if a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("grouped_gemm_fp8: A and weight need unit stride along K")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    e8m0 = w_scale.dtype in E8M0_DTYPES
    ws = w_scale.view(torch.uint8) if e8m0 else w_scale
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
    grid = (max_m_tiles(M, E, cfg["BLOCK_M"]) * n_tiles,)
    if variant == "tma":
        _launch_tma(a, a_scale, w, ws, offs, out, group, block, e8m0, n_tiles, grid[0], programs, cfg)
        return out
    _grouped_gemm_fp8_kernel[grid](
        a, a_scale, w, ws, offs, out, M, N, E, n_tiles,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), w.stride(0), w.stride(1),
        ws.stride(0), ws.stride(1), ws.stride(2), out.stride(0),
        K=K, GA=group, BO=block[0], BI=block[1], E8M0=e8m0, E_PAD=max(16, triton.next_power_of_2(E)),
        OP=tl.float32 if _interpreted() else tl.float8e4nv, **cfg)
    return out


def _launch_w4a8(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
                 group: int, variant: str, programs: int | None, asm: bool | None = None, **tiles) -> torch.Tensor:
    """Packed FP4 weights (checked by _check_w4): variant "pointer" only. `asm`: the PTX nibble conversion
    (default: on CUDA; the interpreter cannot run inline assembly)."""
    if variant != "pointer" or programs is not None:
        raise ValueError(f"grouped_gemm_fp8: a packed FP4 weight runs variant 'pointer' only, got variant {variant!r}, "
                         f"programs {programs}")
    M, K = a.shape
    E, N = w.shape[0], w.shape[1]
    cfg = w4a8_config(M, E)
    if tiles.get("BLOCK_K") is None:  # K steps within one activation group (group % 32 == 0: 32, 64 or 128)
        cfg["BLOCK_K"] = math.gcd(cfg["BLOCK_K"], group)
    cfg.update({k: v for k, v in tiles.items() if v is not None})
    bk = cfg["BLOCK_K"]
    if bk < 32 or bk & (bk - 1) or group % bk:
        raise ValueError(f"grouped_gemm_fp8: BLOCK_K {bk} must be a power of two >= 32 dividing group {group} "
                         "(32-wide dots, one activation scale per K step)")
    if a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("grouped_gemm_fp8: A and weight need unit stride along K")
    asm = not _interpreted() if asm is None else asm
    if asm and _interpreted():
        raise ValueError("grouped_gemm_fp8: asm=True cannot run under TRITON_INTERPRET=1 (inline PTX)")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    ws = w_scale.view(torch.uint8)
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
    grid = (max_m_tiles(M, E, cfg["BLOCK_M"]) * n_tiles,)
    _grouped_gemm_w4a8_kernel[grid](
        a, a_scale, w, ws, offs, out, M, N, E, n_tiles,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), w.stride(0), w.stride(1),
        ws.stride(0), ws.stride(1), ws.stride(2), out.stride(0),
        K=K, GA=group, E_PAD=max(16, triton.next_power_of_2(E)),
        OP=tl.float32 if _interpreted() else tl.float8e4nv, ASM=asm, **cfg)
    return out


def _launch_tma(a, a_scale, w, ws, offs, out, group, block, e8m0, n_tiles, tiles_bound, programs, cfg) -> None:
    """Variant "tma": descriptors over A [M, K] and W as [E * N, K]; a persistent grid when `programs`."""
    M, K = a.shape
    E, N = w.shape[0], w.shape[1]
    if TensorDescriptor is None:
        raise ValueError("grouped_gemm_fp8: variant 'tma' needs triton.tools.tensor_descriptor (Triton >= 3.4)")
    if w.stride(0) != N * w.stride(1):
        raise ValueError(f"grouped_gemm_fp8: variant 'tma' needs the weight's experts contiguous, got strides "
                         f"{tuple(w.stride())} for {tuple(w.shape)}")
    if a.stride(0) % 16 or w.stride(1) % 16 or a.data_ptr() % 16 or w.data_ptr() % 16:
        raise ValueError(f"grouped_gemm_fp8: variant 'tma' needs 16-byte aligned A / weight bases and row strides, "
                         f"got A stride {a.stride(0)}, weight stride {w.stride(1)}")
    a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    w_desc = TensorDescriptor(w, [E * N, K], [w.stride(1), 1], [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    n_programs = tiles_bound if programs is None else min(programs, tiles_bound)
    _grouped_gemm_fp8_tma_kernel[(n_programs,)](
        a_desc, a_scale, w_desc, ws, offs, out, M, N, E, n_tiles, n_programs,
        a_scale.stride(0), a_scale.stride(1), ws.stride(0), ws.stride(1), ws.stride(2), out.stride(0),
        K=K, GA=group, BO=block[0], BI=block[1], E8M0=e8m0, E_PAD=max(16, triton.next_power_of_2(E)),
        OP=tl.float32 if _interpreted() else tl.float8e4nv, PERSISTENT=programs is not None, **cfg)


def grouped_gemm_fp8(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     offs: torch.Tensor, group: int = 128, block: tuple[int, int] = (1, 128), variant: str = "pointer",
                     programs: int | None = None, **tiles) -> torch.Tensor:
    """out [M, N] bf16 for act_quant's (A, s_a) and block-scaled FP8 weights [E, N, K] (or packed FP4 weights
    [E, N, K/2] int8 / uint8 with E8M0 scales [E, N, K/32] and block (1, 32): W4A8), rows grouped by
    `offs`. Triton on CUDA, `reference` elsewhere. `tiles` (BLOCK_M/N/K, num_warps, num_stages)
    override default_config; `variant` / `programs`: the opt-in kernel variants (module docstring).
    No host sync (CUDA-graph capturable)."""
    if triton is None or not a.is_cuda:
        return reference(a, a_scale, w, w_scale, offs, group, block)
    return _launch(a, a_scale, w, w_scale, offs, group, block, variant, programs, **tiles)
