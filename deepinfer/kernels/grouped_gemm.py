"""Grouped GEMM over expert-sorted rows, dequantising the weights as they are loaded.

    out[r, :] = A[r, :] @ W[e(r)]^T        A [M, K] bf16, out [M, N] bf16, fp32 accumulation

Rows are sorted by expert; `offs` [E] int32 holds the cumulative row ends (torch._grouped_mm's
convention: expert e owns rows offs[e-1] .. offs[e]-1, with 0 before expert 0; rows past offs[-1]
are left unwritten). W is one of
  * dense      [E, N, K] bf16 (fp16/fp32 are cast to bf16 in registers);
  * FP8        [E, N, K] float8_e4m3fn + block scales [E, ceil(N/bo), ceil(K/bi)] (E8M0 or fp32);
  * FP4        [E, N, K/2] int8, two e2m1 codes a byte (even column in the low nibble)
               + E8M0 scales [E, N, K/32].
A dense Linear is E = 1 with offs = None (all rows, 2-D weight accepted). Only the weights are
quantised: activations stay bf16 (W8A16 / W4A16), each weight tile is widened to bf16 in
registers and fed to tl.dot (bf16 x bf16 -> fp32). fp8 e4m3 and e2m1 x 2^k are exact in bf16,
so with E8M0 scales the kernel multiplies the same operands as `reference`.

Schedule (no host sync, CUDA-graph capturable): the grid is (m_tiles, cdiv(N, BLOCK_N)) where
m_tiles is an upper bound known from shapes alone: an expert with c > 0 rows needs cdiv(c, BLOCK_M)
tiles, so the total is at most (M + min(E, M) * (BLOCK_M - 1)) // BLOCK_M. Every program rebuilds
the tile -> expert map from `offs` in registers (per-expert tile counts, cumsum, count of the
experts that end at or before its tile), so no auxiliary launch is needed; programs past the real
tile count return at once. A tile never spans two experts; its rows outside the expert are masked.
Few output tiles (decode: a dense Linear, or the experts of a few tokens): K is split over a third
grid axis into fp32 partials [S, M, N] that a second launch sums in split order (deterministic; S
from the shapes only, and never when tiles are passed explicitly, as batch-invariant mode does).

Dequantisation in the K loop:
  * FP8: e4m3 -> bf16; when the scale block covers the whole K tile (bi % BLOCK_K == 0) the scale
    depends on the output column only and is applied to the tile's partial product in fp32
    (acc += dot(a, w) * s[n]); otherwise each weight element is scaled before the dot, with the
    tile's [BLOCK_N, BLOCK_K / bi] scales loaded once and broadcast when bi divides BLOCK_K (the
    (1, 32) blocks of FP4 experts repacked to FP8), gathered per element otherwise.
  * FP4: the packed bytes [BLOCK_N, BLOCK_K/2] are split into low / high nibbles; each code is widened
    by placing its bits in an fp16 (e2m1_fp32: shifts, no value arithmetic) and multiplied by its
    E8M0 scale (exact for scale bytes 2..252, which keeps every product in fp32's normal range), with
    the tile's BLOCK_K / 32 scale bytes per row loaded once and broadcast. The even / odd columns of A
    are loaded separately so each nibble plane goes to its own dot (no register shuffle).
  * E8M0 bytes are decoded by placing the byte in an fp32 exponent field (byte 0 -> 2^-127).
Under TRITON_INTERPRET=1 (CPU tensors) the dot operands are rounded to bf16 and then widened to
fp32, because the interpreter's tl.dot cannot multiply bf16; on CUDA they stay bf16.

Swap (`_grouped_gemm_swap_kernel`, `_launch(swap=True)`; the default for one FP8 group with E8M0 blocks at
2 .. SWAP_ROWS - 1 rows, `swap_config`): the dot kernel's product
transposed, out^T tile = W tile x A tile^T, so the widened weight tile is the MMA's first operand, which Hopper's
wgmma reads from registers (the second, the rows' bf16 activations, from shared memory), and the row count is the
MMA's N (16 and up) instead of its M (64 per warpgroup). FP8 weights with E8M0 scales fold the scale into the bf16
weight (a power of two times an e4m3 value: exact, as `reference` dequantises), so the product accumulates in
place and sm_90 builds keep the MMAs of several K tiles in flight (`wgmma.wait_group` 7 in the loop), where the
dot kernel's scale-after-product waits for each (`wait_group` 0). Dense weights, and FP8 with E8M0 blocks
spanning whole K tiles only.

GEMV (`_grouped_gemv_kernel`, decode row counts): with one row, tl.dot's 16-row MMA tile wastes 15/16
of its work, and the dot kernel streamed FP8 weights far below the HBM bandwidth at M = 1 (measured:
benchmarks/NOTES.md, "Measurements behind the kernels' defaults"). The GEMV kernel computes
ROWS (1, 2, 4) rows x BLOCK_N columns a program without tensor cores: each K step loads a
[BLOCK_N, BLOCK_K] weight tile (16 contiguous bytes a thread, pipelined through shared memory by
cp.async over num_stages), widens it to fp32 exactly (e4m3 -> fp16 -> fp32; dense weights as they
are), multiplies it by each row's bf16 activations widened to fp32 and sums each thread's 16-byte
chunk of products in registers (FMAs, no shuffles in the loop). The FP8 block scale multiplies those
chunk sums when a chunk never straddles two scale blocks (bi a multiple of the chunk: V4's 128-blocks,
(1, 128) and (1, 32) experts), else each weight element; one reduction over the chunks ends the
program. Same arguments, tile -> group map (ROWS is its row tile) and split-K partials as the dot
kernel. With E8M0 scales both kernels sum fp32 products of the same exact operands (only the order
of the fp32 sums differs); fp32 scales (not powers of two) multiply in fp32, without the bf16 rounding
of the scaled weight that `reference` applies. FP4 stays on the dot kernel. `grouped_gemm` picks the
GEMV from default tiles for FP8 at few rows per group (use_gemv; dense weights keep the dot kernel);
explicit tiles (batch-invariant mode) never reach it.
"""
from __future__ import annotations

import torch

from deepinfer.kernels import interpreted, sm_count
from deepinfer.kernels.split_sum import split_sum_into
from deepinfer.formats.quant import dequant_fp4, dequant_fp8_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

DENSE, FP8, FP4 = 0, 1, 2
FP4_GROUP = 32


def triton_available() -> bool:
    return triton is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _format(w: torch.Tensor) -> int:
    if w.dtype == torch.float8_e4m3fn:
        return FP8
    if w.dtype in (torch.int8, torch.uint8):
        return FP4
    if w.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return DENSE
    raise TypeError(f"grouped_gemm: unsupported weight dtype {w.dtype}")


def _as_3d(w: torch.Tensor, scale: torch.Tensor | None, offs: torch.Tensor | None):
    if w.dim() == 2:
        if offs is not None and offs.numel() != 1:
            raise ValueError("a 2-D weight is one group: offs must be None or have one entry")
        w = w.unsqueeze(0)
        scale = None if scale is None else scale.unsqueeze(0)
    if offs is None and w.shape[0] != 1:
        raise ValueError(f"offs is required for {w.shape[0]} groups")
    return w, scale


def reference(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, scale: torch.Tensor | None = None,
              block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Plain torch: dequantise each group's weight to a.dtype (formats/quant.py), multiply in fp32.
    Rows past offs[-1] are zero here (the kernel leaves them unwritten)."""
    w, scale = _as_3d(w, scale, offs)
    fmt = _format(w)
    bounds = [0] + ([a.shape[0]] if offs is None else offs.tolist())
    out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi <= lo:
            continue
        if fmt == FP8:
            we = dequant_fp8_blocks(w[e], scale[e], block_size, a.dtype)
        elif fmt == FP4:
            we = dequant_fp4(w[e], scale[e], FP4_GROUP, a.dtype)
        else:
            we = w[e].to(a.dtype)
        out[lo:hi] = (a[lo:hi].float() @ we.float().T).to(a.dtype)
    return out


def default_config(M: int, E: int, fmt: int = DENSE, N: int | None = None, sms: int | None = None) -> dict:
    """Tile sizes from the mean rows per group. Few rows (decode): the weight bytes dominate, so a
    short M tile and wide N/K tiles with deep pipelining; many rows (prefill): compute-bound tiles.
    With N and the SM count known, a dense decode grid of fewer 128-wide programs than SMs takes
    64-wide N tiles (twice the programs streaming weights)."""
    rows = M / max(E, 1)
    if rows <= 16:  # decode: the H200 sweeps at 64 tokens x 6 of 256 experts (benchmarks/NOTES.md)
        if fmt == FP8:  # 128-blocks and (1, 32) blocks both fastest with 64-wide N tiles
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
        if fmt == DENSE and N and sms and max_m_tiles(M, E, 16) * _cdiv(N, 128) < sms:
            # e.g. 1 token x 6 experts: twice the programs streaming weights (event-timed evidence
            # only, benchmarks/NOTES.md)
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
        return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256 if fmt == DENSE else 128, num_warps=4, num_stages=4)
    if rows <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128 if fmt == FP4 else 64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128 if fmt == FP4 else 64, num_warps=8, num_stages=3)


# With default tiles FP8 weights take the GEMV kernel when one group has at most GEMV_ROWS_ONE rows (a Linear
# at decode), or several groups at most GEMV_ROWS rows each on average (routed experts, grouped projections at
# decode). From benchmarks/kernel_sweep.py --only fp8-small --quick (benchmarks/NOTES.md): one row faster than
# the dot kernel at every V4 projection shape, four rows slower at most; from two rows one group takes the swapped
# dot (SWAP_ROWS). Experts: faster at 1 and 8 tokens x 6 of 256 (at most 1 row a group).
GEMV_ROWS = 2
GEMV_ROWS_ONE = 1
# one FP8 group (a Linear) at 2 .. SWAP_ROWS - 1 rows runs the swapped dot by default (layers/linear.py runs W8A8
# from FP8_GEMM_ROWS = 64)
SWAP_ROWS = 64
# One group at one row whose default GEMV tiles would split K (a split_sum launch after it): 8 x 512 weight tiles,
# 2 warps, no split, where N / 8 gives at least 256 programs: faster in CUDA graphs (launch gaps counted) on V4's
# projections with N >= 2048, not at N = 1536 or 64 (kernel_sweep.py --only fp8-small, graph_ms; benchmarks/NOTES.md,
# "2026-12-02, third session").
NARROW_GEMV = dict(BLOCK_N=8, BLOCK_K=512, num_warps=2, num_stages=3)
NARROW_GEMV_MIN_N = 2048
# Several groups of one row each (V4's wo_a at one token: 8 groups of 1024 x 4096) whose default tiles would split K
# take NARROW_GEMV unsplit too: faster than the split in benchmarks/gemv_depth_probe.py (benchmarks/NOTES.md,
# "2026-12-02, fourth session").
# One group at one row, from gemv_depth_probe.py --grid wide (benchmarks/NOTES.md, "2026-12-02, fifth session"):
# K <= SHORT_K_MAX with N >= SHORT_K_MIN_N (V4's wq_b) takes 16 x 512 tiles, 2 warps, no shared-memory pipeline; N below
# NARROW_GEMV_MIN_N whose default tiles would split K (V4's stacked wq_a | wkv, N 1536) takes 8 x 2048 tiles,
# 2 warps, 2 stages, unsplit (no split_sum launch), from WIDE_K_GEMV_MIN_N columns (enough programs to fill the GPU).
SHORT_K_GEMV = dict(BLOCK_N=16, BLOCK_K=512, num_warps=2, num_stages=1)
SHORT_K_MAX = 1024
SHORT_K_MIN_N = 8192
WIDE_K_GEMV = dict(BLOCK_N=8, BLOCK_K=2048, num_warps=2, num_stages=2)
WIDE_K_GEMV_MIN_N = 1024
# grouped_gemv_fused at up to one row a group (the shared expert as group 256 of one token's routed experts):
# 16 x 256 tiles, 2 warps, 3 stages, faster in the same probe than gemv_config's several-group tiles for both the
# w1 | w3 and the w2 launches.
FUSED_GEMV = dict(ROWS=1, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=3)


def use_gemv(M: int, E: int, fmt: int) -> bool:
    """Whether grouped_gemm's default tiles run M rows over E groups through the GEMV kernel."""
    if fmt != FP8 or M == 0:
        return False
    return M <= GEMV_ROWS_ONE if E == 1 else M <= GEMV_ROWS * E


def gemv_config(M: int, E: int) -> dict:
    """GEMV tiles: ROWS covers the mean rows per group (1, 2, 4: one weight read per row tile; a group with
    more rows takes several tiles); BLOCK_K 256 FP8 columns, 3 K tiles in flight a program (num_stages=3).
    One group (a Linear): 16 x 256 weight tiles (4 KiB), 2 warps: each thread loads 16 contiguous bytes of
    4 weight rows per K step, and the narrow column tile doubles the programs, so split_k_for splits K less
    (V4's 4096 x 8192 projection at M = 1: 256 column tiles x 2 splits -> 512 programs, ~3.9 per SM of 132).
    Several groups (routed experts, grouped projections): 32 x 256 tiles (8 KiB), 4 warps. The choice is the
    fastest summed over V4's projection shapes and routed experts at decode in kernel_sweep.py's GEMV sweep
    (benchmarks/NOTES.md, "Measurements behind the kernels' defaults")."""
    rows = 1
    while rows < min(4, _cdiv(M, max(E, 1))):
        rows *= 2
    if E == 1:
        return dict(ROWS=rows, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=3)
    return dict(ROWS=rows, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)

def max_m_tiles(M: int, E: int, block_m: int, one_group: bool = False) -> int:
    """Upper bound on sum_e cdiv(rows_e, block_m) over groups with sum_e rows_e <= M, from shapes only."""
    if one_group:
        return _cdiv(M, block_m)
    return (M + min(E, M) * (block_m - 1)) // block_m


if triton is not None:
    @triton.jit
    def _e8m0(byte):
        """E8M0 bytes -> fp32 2^(byte - 127) (byte placed in the exponent field; 0 -> 2^-127)."""
        b = byte.to(tl.int32) & 0xFF
        return tl.where(b == 0, 5.877471754111438e-39, (b << 23).to(tl.float32, bitcast=True))

    @triton.jit
    def e2m1_fp32(code):
        """4-bit e2m1 codes -> their fp32 values. The 3 magnitude bits are placed at the top of an fp16's
        exponent (2 bits) and mantissa (1 bit), the sign at bit 15: that fp16 is the e2m1 value times
        2^-14 for every code, subnormal (0, 0.5) or not; widened, then times 2^14 (exact)."""
        bits = ((code & 8) << 12) | ((code & 7) << 9)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0

    @triton.jit
    def group_tile(pid_m, offs_ptr, M, E, w_ptr, s_ptr, s_we, s_se, ONE_GROUP: tl.constexpr,
                   E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """Row tile pid_m of the expert-sorted rows -> (live, row0, row_end, w_base, s_base): live 0 for
        tiles past the last real one; else the tile's first row, its group's row end and the group's
        weight / scale bases. One group: tiles of BLOCK_M rows over M. Several (offs: cumulative row
        ends of E groups): group e with c rows owns cdiv(c, BLOCK_M) consecutive tiles."""
        if ONE_GROUP:  # offs_ptr is a placeholder then: this branch alone is compiled
            live = 1
            row0 = pid_m * BLOCK_M
            row_end = M
            w_base = w_ptr
            s_base = s_ptr
        else:
            ids = tl.arange(0, E_PAD)
            ends = tl.load(offs_ptr + ids, mask=ids < E, other=0)
            starts = tl.load(offs_ptr + ids - 1, mask=(ids > 0) & (ids < E), other=0)
            tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
            tile_end = tl.cumsum(tiles, 0)                       # one past each group's last tile
            live = (pid_m < tl.max(tile_end, 0)).to(tl.int32)
            e = tl.sum((tile_end <= pid_m).to(tl.int32), 0)      # groups entirely before this tile
            here = ids == e
            first = tl.sum(tl.where(here, tile_end - tiles, 0), 0)
            row0 = tl.sum(tl.where(here, starts, 0), 0) + (pid_m - first) * BLOCK_M
            row_end = tl.sum(tl.where(here, ends, 0), 0)
            w_base = w_ptr + e.to(tl.int64) * s_we
            s_base = s_ptr + e.to(tl.int64) * s_se
        return live, row0, row_end, w_base, s_base

    @triton.jit
    def _grouped_gemm_kernel(a_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, M, N, E,
                             s_am, s_ak, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_om, s_on,
                             K: tl.constexpr, FMT: tl.constexpr, E8M0: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                             ONE_GROUP: tl.constexpr, E_PAD: tl.constexpr, OP: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SPLIT_K: tl.constexpr = 1):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        K_PART: tl.constexpr = K // SPLIT_K          # the launcher makes it a multiple of BLOCK_K
        if SPLIT_K == 1:
            k_lo = 0                                  # constexpr loop bounds, as without split-K
        else:
            k_lo = tl.program_id(2) * K_PART
        live, row0, row_end, w_base, s_base = group_tile(pid_m, offs_ptr, M, E, w_ptr, s_ptr, s_we, s_se,
                                                          ONE_GROUP, E_PAD, BLOCK_M)
        if live == 0:
            return

        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = (rows < row_end) & (rows < M)
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * s_am
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        w_rows = w_base + cols.to(tl.int64)[:, None] * s_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

        HALF: tl.constexpr = BLOCK_K // 2
        for k0 in range(k_lo, k_lo + K_PART, BLOCK_K):
            if FMT == 2:  # FP4: byte j of the row holds columns 2j (low nibble) and 2j+1 (high)
                kp = k0 // 2 + tl.arange(0, HALF)
                kmask = kp < K // 2
                a_even = tl.load(a_rows + (2 * kp)[None, :] * s_ak, mask=rmask[:, None] & kmask[None, :], other=0.0)
                a_odd = tl.load(a_rows + (2 * kp + 1)[None, :] * s_ak, mask=rmask[:, None] & kmask[None, :],
                                other=0.0)
                wmask = nmask[:, None] & kmask[None, :]
                byte = tl.load(w_rows + kp[None, :] * s_wk, mask=wmask, other=0).to(tl.int32) & 0xFF
                # HALF / 16 scale bytes per row (one per 32 K columns = 16 bytes), broadcast in registers
                NS: tl.constexpr = HALF // 16
                sk = k0 // 32 + tl.arange(0, NS)
                sb = tl.load(s_base + cols[:, None] * s_sn + sk[None, :] * s_sk,
                             mask=nmask[:, None] & (sk < K // 32)[None, :], other=127).to(tl.int32) & 0xFF
                sc = tl.reshape(tl.broadcast_to(_e8m0(sb)[:, :, None], (BLOCK_N, NS, 16)), (BLOCK_N, HALF))
                lo = (e2m1_fp32(byte & 0xF) * sc).to(tl.bfloat16).to(OP)
                hi = (e2m1_fp32(byte >> 4) * sc).to(tl.bfloat16).to(OP)
                acc = tl.dot(a_even.to(tl.bfloat16).to(OP), tl.trans(lo), acc)
                acc = tl.dot(a_odd.to(tl.bfloat16).to(OP), tl.trans(hi), acc)
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                kmask = ks < K
                a = tl.load(a_rows + ks[None, :] * s_ak, mask=rmask[:, None] & kmask[None, :], other=0.0)
                a = a.to(tl.bfloat16).to(OP)
                wmask = nmask[:, None] & kmask[None, :]
                w = tl.load(w_rows + ks[None, :] * s_wk, mask=wmask, other=0.0)
                if FMT == 0:
                    acc = tl.dot(a, tl.trans(w.to(tl.bfloat16).to(OP)), acc)
                elif BI % BLOCK_K == 0:  # one scale block spans the K tile: scale the partial product
                    s = tl.load(s_base + (cols // BO) * s_sn + (k0 // BI) * s_sk, mask=nmask, other=0)
                    s = _e8m0(s) if E8M0 else s.to(tl.float32)
                    acc += tl.dot(a, tl.trans(w.to(tl.bfloat16).to(OP))) * s[None, :]
                elif BLOCK_K % BI == 0:  # BLOCK_K / BI scale blocks per K tile: load those, broadcast in registers
                    NS: tl.constexpr = BLOCK_K // BI
                    sk = k0 // BI + tl.arange(0, NS)
                    s = tl.load(s_base + (cols // BO)[:, None] * s_sn + sk[None, :] * s_sk,
                                mask=nmask[:, None] & (sk * BI < K)[None, :], other=0)
                    s = _e8m0(s) if E8M0 else s.to(tl.float32)
                    wf = tl.reshape(tl.reshape(w.to(tl.float32), (BLOCK_N, NS, BI)) * s[:, :, None], (BLOCK_N, BLOCK_K))
                    acc = tl.dot(a, tl.trans(wf.to(tl.bfloat16).to(OP)), acc)
                else:
                    s = tl.load(s_base + (cols // BO)[:, None] * s_sn + (ks // BI)[None, :] * s_sk,
                                mask=wmask, other=0)
                    s = _e8m0(s) if E8M0 else s.to(tl.float32)
                    acc = tl.dot(a, tl.trans((w.to(tl.float32) * s).to(tl.bfloat16).to(OP)), acc)

        out = out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :] * s_on
        if SPLIT_K > 1:  # fp32 partials [SPLIT_K, M, N] (contiguous), summed in split order below
            out += tl.program_id(2).to(tl.int64) * M * N
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


    @triton.jit
    def _gemv_row(acc, w, a_rows, r: tl.constexpr, row0, row_end, M, ks, kmask, s_ak, sc,
                  FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KV: tl.constexpr):
        """acc [BLOCK_N, BLOCK_K / KV] += row r's products with the widened tile w [BLOCK_N, BLOCK_K], summed over
        each thread's KV contiguous K (FMAs in registers, no shuffles), times the chunk scales sc when FP8."""
        a = tl.load(a_rows + ks * s_ak, mask=kmask & (row0 + r < row_end) & (row0 + r < M), other=0.0)
        part = tl.sum(tl.reshape(w * a.to(tl.float32)[None, :], (BLOCK_N, BLOCK_K // KV, KV)), axis=2)
        return acc + part * sc if FMT == 1 else acc + part

    @triton.jit
    def _grouped_gemv_kernel(a_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, M, N, E,
                             s_am, s_ak, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_om, s_on,
                             pair_w, pair_s, extra_w, extra_s, extra_pair_w, extra_pair_s,
                             K: tl.constexpr, FMT: tl.constexpr, E8M0: tl.constexpr, BO: tl.constexpr,
                             BI: tl.constexpr, ONE_GROUP: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KV: tl.constexpr,
                             SPLIT_K: tl.constexpr = 1, STAGES: tl.constexpr = 1, PAIR: tl.constexpr = False,
                             EXTRA: tl.constexpr = False, BO_EXTRA: tl.constexpr = 1):
        """The few-row path (module docstring, "GEMV"): ROWS (1, 2 or 4) rows x BLOCK_N columns a program, fp32
        FMAs of exactly widened operands, no tl.dot. Same arguments and tile -> group map as the dot kernel;
        KV: the weight elements one thread loads contiguously (16 bytes). PAIR / EXTRA (grouped_gemv_fused):
        the second half of grid axis 1 multiplies by a second weight of w's shape at element offset pair_w
        (scales pair_s) into output columns N .. 2N - 1; the last of E groups multiplies by another weight
        at offset extra_w (scales extra_s, scale blocks BO_EXTRA rows; its pair at extra_pair_w / _s)."""
        K_PART: tl.constexpr = K // SPLIT_K  # a multiple of BLOCK_K (the launcher checks)
        k_lo = tl.program_id(2) * K_PART     # grid axis 2: the K splits (one without split-K)
        live, row0, row_end, w_base, s_base = group_tile(tl.program_id(0), offs_ptr, M, E, w_ptr, s_ptr, s_we,
                                                          s_se, ONE_GROUP, E_PAD, ROWS)
        if live == 0:
            return

        pid_n = tl.program_id(1)
        half = 0
        if PAIR:  # grid axis 1: N tiles of the first weight, then as many of its pair
            n_tiles = tl.cdiv(N, BLOCK_N)
            half = (pid_n >= n_tiles).to(tl.int32)
            pid_n -= half * n_tiles
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        srow = cols // BO  # each column's scale row
        if EXTRA:  # the last group reads the extra weight (element offsets from w_ptr / s_ptr: 1-byte elements)
            last = row0 >= tl.load(offs_ptr + E - 2)
            if PAIR:
                w_base = tl.where(last, w_ptr + extra_w + half * extra_pair_w, w_base + half * pair_w)
                s_base = tl.where(last, s_ptr + extra_s + half * extra_pair_s, s_base + half * pair_s)
            else:
                w_base = tl.where(last, w_ptr + extra_w, w_base)
                s_base = tl.where(last, s_ptr + extra_s, s_base)
            srow = tl.where(last, cols // BO_EXTRA, srow)
        elif PAIR:
            w_base += half * pair_w
            s_base += half * pair_s
        w_rows = w_base + cols.to(tl.int64)[:, None] * s_wn
        chunk = tl.arange(0, BLOCK_K // KV)
        # one accumulator per row (ROWS is 1, 2 or 4; unused ones are never updated or stored)
        acc0 = tl.zeros([BLOCK_N, BLOCK_K // KV], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K // KV], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K // KV], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K // KV], dtype=tl.float32)
        a_rows = a_ptr + row0.to(tl.int64) * s_am
        for k0 in tl.range(k_lo, k_lo + K_PART, BLOCK_K, num_stages=STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            wmask = nmask[:, None] & kmask[None, :]
            w = tl.load(w_rows + ks[None, :] * s_wk, mask=wmask, other=0.0).to(tl.float32)  # exact widening
            sc = 1.0
            if FMT == 1:  # FP8: the block scale of each thread's KV-wide chunk (or of each element)
                if BI % BLOCK_K == 0:  # one scale per column over the K tile
                    s = tl.load(s_base + srow * s_sn + (k0 // BI) * s_sk, mask=nmask, other=0)
                    sc = (_e8m0(s) if E8M0 else s.to(tl.float32))[:, None]
                elif BI % KV == 0 and BLOCK_K % BI == 0:  # a chunk never straddles two scale blocks
                    # BLOCK_K / BI per-column scale vectors, spread over the chunks by selects: loads of
                    # [BLOCK_N] take the chunks' layout, a [BLOCK_N, chunks] gather would impose its own
                    sc = tl.zeros([BLOCK_N, BLOCK_K // KV], dtype=tl.float32)
                    for j in tl.static_range(BLOCK_K // BI):
                        s = tl.load(s_base + srow * s_sn + (k0 // BI + j) * s_sk,
                                    mask=nmask & (k0 + j * BI < K), other=0)
                        s = _e8m0(s) if E8M0 else s.to(tl.float32)
                        sc = tl.where((chunk * KV // BI == j)[None, :], s[:, None], sc)
                else:  # odd blocks: scale each weight element
                    s = tl.load(s_base + srow[:, None] * s_sn + (ks // BI)[None, :] * s_sk, mask=wmask,
                                other=0)
                    w = w * (_e8m0(s) if E8M0 else s.to(tl.float32))
            acc0 = _gemv_row(acc0, w, a_rows, 0, row0, row_end, M, ks, kmask, s_ak, sc, FMT, BLOCK_N, BLOCK_K, KV)
            if ROWS > 1:
                acc1 = _gemv_row(acc1, w, a_rows + s_am, 1, row0, row_end, M, ks, kmask, s_ak, sc, FMT, BLOCK_N,
                                 BLOCK_K, KV)
            if ROWS > 2:
                acc2 = _gemv_row(acc2, w, a_rows + 2 * s_am, 2, row0, row_end, M, ks, kmask, s_ak, sc, FMT,
                                 BLOCK_N, BLOCK_K, KV)
                acc3 = _gemv_row(acc3, w, a_rows + 3 * s_am, 3, row0, row_end, M, ks, kmask, s_ak, sc, FMT,
                                 BLOCK_N, BLOCK_K, KV)

        out = out_ptr + row0.to(tl.int64) * s_om + (cols + half * N) * s_on
        if SPLIT_K > 1:  # fp32 partials [SPLIT_K, M, N or 2N] (contiguous), summed in split order
            out += tl.program_id(2).to(tl.int64) * M * s_om
        ty = out_ptr.dtype.element_ty
        tl.store(out, tl.sum(acc0, axis=1).to(ty), mask=nmask & (row0 < row_end) & (row0 < M))
        if ROWS > 1:
            tl.store(out + s_om, tl.sum(acc1, axis=1).to(ty), mask=nmask & (row0 + 1 < row_end) & (row0 + 1 < M))
        if ROWS > 2:
            tl.store(out + 2 * s_om, tl.sum(acc2, axis=1).to(ty), mask=nmask & (row0 + 2 < row_end) & (row0 + 2 < M))
            tl.store(out + 3 * s_om, tl.sum(acc3, axis=1).to(ty), mask=nmask & (row0 + 3 < row_end) & (row0 + 3 < M))

if triton is not None:
    @triton.jit
    def _grouped_gemm_swap_kernel(a_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, M, N, E,
                                  s_am, s_ak, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_om, s_on,
                                  K: tl.constexpr, FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                                  ONE_GROUP: tl.constexpr, E_PAD: tl.constexpr, OP: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  SPLIT_K: tl.constexpr = 1):
        """The swapped dot (module docstring, "Swap"): acc [BLOCK_N, BLOCK_M] = W tile x A tile^T, the widened
        weight tile the MMA's first operand (in registers), the rows' activations its second; stored transposed.
        FP8 (FMT 1) takes E8M0 scales with BI a multiple of BLOCK_K only (the launcher checks)."""
        K_PART: tl.constexpr = K // SPLIT_K
        if SPLIT_K == 1:
            k_lo = 0
        else:
            k_lo = tl.program_id(2) * K_PART
        live, row0, row_end, w_base, s_base = group_tile(tl.program_id(0), offs_ptr, M, E, w_ptr, s_ptr, s_we, s_se,
                                                          ONE_GROUP, E_PAD, BLOCK_M)
        if live == 0:
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = (rows < row_end) & (rows < M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        a_cols = a_ptr + rows.to(tl.int64)[None, :] * s_am
        w_rows = w_base + cols.to(tl.int64)[:, None] * s_wn
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_PART, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            w = tl.load(w_rows + ks[None, :] * s_wk, mask=nmask[:, None] & kmask[None, :], other=0.0)
            if FMT == 1:  # one power-of-two scale per weight row over the K tile: exact in the bf16 weight
                sc = _e8m0(tl.load(s_base + (cols // BO) * s_sn + (k0 // BI) * s_sk, mask=nmask, other=0))
                wb = (w.to(tl.float32) * sc[:, None]).to(tl.bfloat16).to(OP)
            else:
                wb = w.to(tl.bfloat16).to(OP)
            at = tl.load(a_cols + ks[:, None] * s_ak, mask=kmask[:, None] & rmask[None, :], other=0.0)
            acc = tl.dot(wb, at.to(tl.bfloat16).to(OP), acc)  # in place: the MMAs stay in flight across K tiles
        out = out_ptr + rows.to(tl.int64)[None, :] * s_om + cols[:, None] * s_on
        if SPLIT_K > 1:  # fp32 partials [SPLIT_K, M, N] (contiguous), summed in split order
            out += tl.program_id(2).to(tl.int64) * M * N
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & rmask[None, :])


def split_k_for(m_tiles: int, N: int, K: int, cfg: dict, sms: int) -> int:
    """Splits of K when the output tiles (m_tiles row tiles x N / BLOCK_N) leave most SMs idle (decode:
    the FP8 projections, the experts of a few tokens): a power of two up to 16 that brings the
    programs to ~2 per SM, keeping >= 4 K tiles per split and the splits a whole number of K tiles."""
    programs = m_tiles * _cdiv(N, cfg["BLOCK_N"])
    k_tiles = K // cfg["BLOCK_K"] if K % cfg["BLOCK_K"] == 0 else 1
    s = 1
    while s < 16 and programs * s < 2 * sms and k_tiles % (2 * s) == 0 and k_tiles // (2 * s) >= 4:
        s *= 2
    return s


def _launch(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, scale: torch.Tensor | None,
            block_size: tuple[int, int], BLOCK_M=None, BLOCK_N=None, BLOCK_K=None, num_warps=None,
            num_stages=None, split_k: int = 1, gemv: bool = False, ROWS=None, swap: bool = False) -> torch.Tensor:
    """The Triton launch on whatever device the tensors are on (CPU only under TRITON_INTERPRET=1).
    gemv=False: the dot kernel (tiles BLOCK_M / N / K); gemv=True: the GEMV kernel (tiles ROWS, BLOCK_N,
    BLOCK_K; dense or FP8 weights). Unset tiles take default_config / gemv_config."""
    w, scale = _as_3d(w, scale, offs)
    fmt = _format(w)
    E, N = w.shape[0], w.shape[1]
    K = w.shape[2] * 2 if fmt == FP4 else w.shape[2]
    M = a.shape[0]
    if a.dim() != 2 or a.shape[1] != K:
        raise ValueError(f"grouped_gemm: A {tuple(a.shape)} does not match weight {tuple(w.shape)} (K={K})")
    if offs is not None and (offs.dim() != 1 or offs.shape[0] != E):
        raise ValueError(f"grouped_gemm: offs {tuple(offs.shape)} for {E} groups")
    bo, bi = block_size if fmt == FP8 else (1, 1)
    if fmt == FP8:
        want = (E, _cdiv(N, bo), _cdiv(K, bi))
    elif fmt == FP4:
        if K % FP4_GROUP:
            raise ValueError(f"grouped_gemm: FP4 needs K % {FP4_GROUP} == 0, got {K}")
        want = (E, N, K // FP4_GROUP)
    if fmt == DENSE:
        if scale is not None:
            raise ValueError("grouped_gemm: a dense weight takes no scale")
        scale = w  # unused placeholder pointer
        e8m0 = False
    else:
        if scale is None or tuple(scale.shape) != want:
            raise ValueError(f"grouped_gemm: scale {None if scale is None else tuple(scale.shape)} for weight "
                             f"{tuple(w.shape)}, expected {want}")
        e8m0 = scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
        if e8m0:
            scale = scale.view(torch.uint8)
        elif not scale.is_floating_point():
            raise TypeError(f"grouped_gemm: unsupported scale dtype {scale.dtype}")
    one_group = offs is None
    if gemv:
        if fmt == FP4:
            raise ValueError("grouped_gemm: the GEMV takes dense or FP8 weights (FP4 runs the dot kernel)")
        if BLOCK_M is not None:
            raise ValueError("grouped_gemm: the GEMV's row tile is ROWS, not BLOCK_M")
        if ROWS not in (None, 1, 2, 4):
            raise ValueError(f"grouped_gemm: the GEMV's ROWS must be 1, 2 or 4, got {ROWS}")
        cfg = gemv_config(M, E)
        given = (("ROWS", ROWS), ("BLOCK_N", BLOCK_N), ("BLOCK_K", BLOCK_K), ("num_warps", num_warps),
                 ("num_stages", num_stages))
    else:
        if ROWS is not None:
            raise ValueError("grouped_gemm: ROWS is the GEMV's row tile (gemv=True)")
        cfg = default_config(M, E, fmt, N, sm_count(a.device) if a.is_cuda else None)
        given = (("BLOCK_M", BLOCK_M), ("BLOCK_N", BLOCK_N), ("BLOCK_K", BLOCK_K), ("num_warps", num_warps),
                 ("num_stages", num_stages))
    for k, v in given:
        if v is not None:
            cfg[k] = v
    if swap:
        if gemv or fmt == FP4 or (fmt == FP8 and (not e8m0 or bi % cfg["BLOCK_K"])):
            raise ValueError("grouped_gemm: swap=True takes dense weights or FP8 with E8M0 scales whose blocks span "
                             "whole K tiles (BI a multiple of BLOCK_K), on the dot path")
        if cfg["BLOCK_M"] < 16 or cfg["BLOCK_N"] < 16:
            raise ValueError("grouped_gemm: swap=True needs BLOCK_M and BLOCK_N >= 16")
    if gemv and cfg["BLOCK_K"] % (16 // w.element_size()):
        raise ValueError(f"grouped_gemm: the GEMV's BLOCK_K must be a multiple of {16 // w.element_size()} "
                         f"(16 bytes of {w.dtype} a thread)")
    if fmt == FP4 and cfg["BLOCK_K"] < 32:
        raise ValueError("grouped_gemm: FP4 needs BLOCK_K >= 32 (each nibble plane feeds a K/2-wide dot)")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if split_k > 1 and K % (split_k * cfg["BLOCK_K"]):
        raise ValueError(f"grouped_gemm: split_k {split_k} needs K % (split_k * BLOCK_K) == 0")
    dst = out if split_k == 1 else torch.empty(split_k, M, N, dtype=torch.float32, device=a.device)
    args = (a, w, scale, a if one_group else offs, dst, M, N, E,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
            scale.stride(0), scale.stride(1), scale.stride(2), N, 1)
    common = dict(K=K, FMT=fmt, E8M0=e8m0, BO=bo, BI=bi, ONE_GROUP=one_group,
                  E_PAD=max(16, triton.next_power_of_2(E)), SPLIT_K=split_k)
    if gemv:
        grid = (max_m_tiles(M, E, cfg["ROWS"], one_group), triton.cdiv(N, cfg["BLOCK_N"]), split_k)
        _grouped_gemv_kernel[grid](*args, 0, 0, 0, 0, 0, 0, **common, KV=16 // w.element_size(),
                                   STAGES=cfg["num_stages"], **cfg)
    elif swap:
        grid = (max_m_tiles(M, E, cfg["BLOCK_M"], one_group), triton.cdiv(N, cfg["BLOCK_N"]), split_k)
        common.pop("E8M0")
        # the interpreter's tl.dot cannot multiply bf16 (the sm_90 builds of tests/kernels/sm90.py keep bf16)
        _grouped_gemm_swap_kernel[grid](*args, **common, **cfg, OP=tl.float32 if interpreted() else tl.bfloat16)
    else:
        grid = (max_m_tiles(M, E, cfg["BLOCK_M"], one_group), triton.cdiv(N, cfg["BLOCK_N"]), split_k)
        _grouped_gemm_kernel[grid](*args, **common, **cfg,
                                   OP=tl.float32 if interpreted() else tl.bfloat16)  # interpreter: no bf16 tl.dot
    if split_k > 1:
        split_sum_into(dst, out)
    return out


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, scale: torch.Tensor | None = None,
                 block_size: tuple[int, int] = (128, 128), *, BLOCK_M: int | None = None,
                 BLOCK_N: int | None = None, BLOCK_K: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None) -> torch.Tensor:
    """out [M, N] bf16 = A [M, K] bf16 @ W[e]^T per row group. Triton on CUDA, `reference` elsewhere.
    `block_size` (bo, bi) is read for FP8 weights only; the format follows w.dtype (bf16/fp16/fp32
    dense, float8_e4m3fn FP8, int8 packed FP4). Without tile kwargs `default_launch` picks the kernel
    (FP8 at decode row counts: the GEMV), its tiles and K split; with them, the dot kernel runs them as
    given. No host sync: the launch depends on shapes only (CUDA-graph capturable)."""
    if triton is None or not a.is_cuda:
        return reference(a, w, offs, scale, block_size)
    if a.dtype != torch.bfloat16:
        raise TypeError(f"grouped_gemm: activations must be bf16, got {a.dtype}")
    tiles = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages)
    return _launch(a, w, offs, scale, block_size,
                   **launch_kwargs(a.shape[0], w, offs, tiles, sm_count(a.device), scale, block_size))


def grouped_gemv_fused(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                       block_size: tuple[int, int], pair: tuple[torch.Tensor, torch.Tensor] | None = None,
                       extra: tuple | None = None, extra_block: tuple[int, int] | None = None,
                       **tiles) -> torch.Tensor:
    """One GEMV launch for the expert-sorted rows a [M, K] bf16 over FP8 experts w [E, N, K] (E8M0 scales
    `scale`, blocks `block_size`), with up to two more weights in the same launch:
      * pair (w2, s2), w's shape and layout: out [M, 2N] = [a W^T | a W2^T] per group (gate and up);
      * extra: the last of offs' E + 1 groups multiplies by another [N, K] weight instead of an expert, as
        (wx, sx), or ((wx, sx), (wx2, sx2)) with pair; its scales in `extra_block` blocks (bo, block_size[1]),
        its rows and columns strided as one expert's (the shared expert as group E).
    Per output element the same products and sums as grouped_gemm's GEMV with the same tiles; no host sync
    (CUDA-graph capturable). `tiles`: GEMV tiles and split_k (default: gemv_config / split_k_for for the
    launch's programs). Elsewhere than CUDA, `fused_reference`."""
    error = fused_layout_error(w, scale, offs.shape[0], pair, extra, extra_block or block_size, block_size)
    if error:
        raise ValueError(f"grouped_gemv_fused: {error}")
    halves = [(w, scale)] + ([pair] if pair is not None else [])
    xparts = None if extra is None else (list(extra) if pair is not None else [extra])
    bx = None if extra is None else (extra_block or block_size)
    if triton is None or not a.is_cuda:
        return fused_reference(a, w, scale, offs, block_size, pair, extra, bx)
    if a.dtype != torch.bfloat16:
        raise TypeError(f"grouped_gemv_fused: activations must be bf16, got {a.dtype}")
    return _launch_fused(a, halves, xparts, offs, block_size, bx or block_size, sm_count(a.device), **tiles)


def fused_layout_error(w: torch.Tensor, scale: torch.Tensor, groups: int, pair=None, extra=None,
                       extra_block: tuple[int, int] | None = None,
                       block_size: tuple[int, int] | None = None) -> str | None:
    """Why grouped_gemv_fused cannot take these weights (its arguments; `groups`: offs' length), or None."""
    halves = [(w, scale)] + ([pair] if pair is not None else [])
    xparts = None if extra is None else (list(extra) if pair is not None else [extra])
    E = w.shape[0] + (extra is not None)
    if (w.dim() != 3 or w.dtype != torch.float8_e4m3fn or scale.dim() != 3
            or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8) or groups != E):
        return (f"FP8 experts [E, N, K] with E8M0 scales and offs for {E} groups, got w {tuple(w.shape)} {w.dtype}, "
                f"scale {scale.dtype}, {groups} offsets")
    for wh, sh in halves[1:]:
        if (wh.shape != w.shape or wh.stride() != w.stride() or sh.shape != scale.shape
                or sh.stride() != scale.stride() or wh.dtype != w.dtype or sh.dtype != scale.dtype):
            return "pair must have w's and scale's shapes, strides and dtypes"
    if xparts is not None:
        if len(xparts) != len(halves) or (block_size and extra_block and extra_block[1] != block_size[1]):
            return "extra needs one weight per half and the experts' K blocks"
        for wx, sx in xparts:
            want = (_cdiv(w.shape[1], extra_block[0]), scale.shape[2])
            if (wx.shape != w.shape[1:] or wx.stride() != w.stride()[1:] or wx.dtype != w.dtype
                    or tuple(sx.shape) != want or sx.stride(1) != scale.stride(2) or sx.dtype != scale.dtype
                    or (want[0] > 1 and sx.stride(0) != scale.stride(1))):
                return (f"extra weight {tuple(wx.shape)} / scale {tuple(sx.shape)} must be laid out as one expert's "
                        f"({tuple(w.shape[1:])}, scale {want})")
    return None


def _launch_fused(a, halves, xparts, offs, block_size, bx, sms: int, ROWS=None, BLOCK_N=None, BLOCK_K=None,
                  num_warps=None, num_stages=None, split_k=None) -> torch.Tensor:
    """grouped_gemv_fused's launch without the device check (also runs under TRITON_INTERPRET=1)."""
    (w, scale), M, E = halves[0], a.shape[0], offs.shape[0]
    N, K = w.shape[1], w.shape[2]
    if a.dim() != 2 or a.shape[1] != K:
        raise ValueError(f"grouped_gemv_fused: A {tuple(a.shape)} does not match weight {tuple(w.shape)}")
    n_out = N * len(halves)
    cfg = dict(FUSED_GEMV) if M <= E else gemv_config(M, E)
    for k, v in (("ROWS", ROWS), ("BLOCK_N", BLOCK_N), ("BLOCK_K", BLOCK_K), ("num_warps", num_warps),
                 ("num_stages", num_stages)):
        if v is not None:
            cfg[k] = v
    if split_k is None:
        split_k = split_k_for(max_m_tiles(M, E, cfg["ROWS"]), n_out, K, cfg, sms)
    if split_k > 1 and K % (split_k * cfg["BLOCK_K"]):  # unsplit, the K loop masks its last tile
        raise ValueError(f"grouped_gemv_fused: split_k {split_k} needs K % (split_k * BLOCK_K) == 0")
    out = torch.empty(M, n_out, dtype=torch.bfloat16, device=a.device)
    if M == 0:
        return out
    dst = out if split_k == 1 else torch.empty(split_k, M, n_out, dtype=torch.float32, device=a.device)
    u8 = scale.view(torch.uint8)

    def delta(t, base):  # element offsets between 1-byte tensors (the kernel's pointer arithmetic)
        return t.data_ptr() - base.data_ptr()

    pair_w = delta(halves[1][0], w) if len(halves) > 1 else 0
    pair_s = delta(halves[1][1], scale) if len(halves) > 1 else 0
    extra_w = extra_s = extra_pair_w = extra_pair_s = 0
    if xparts is not None:
        extra_w, extra_s = delta(xparts[0][0], w), delta(xparts[0][1], scale)
        if len(xparts) > 1:
            extra_pair_w, extra_pair_s = delta(xparts[1][0], xparts[0][0]), delta(xparts[1][1], xparts[0][1])
    grid = (max_m_tiles(M, E, cfg["ROWS"]), triton.cdiv(N, cfg["BLOCK_N"]) * len(halves), split_k)
    _grouped_gemv_kernel[grid](
        a, w, u8, offs, dst, M, N, E, a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        u8.stride(0), u8.stride(1), u8.stride(2), n_out, 1, pair_w, pair_s, extra_w, extra_s, extra_pair_w,
        extra_pair_s, K=K, FMT=FP8, E8M0=True, BO=block_size[0], BI=block_size[1], ONE_GROUP=False,
        E_PAD=max(16, triton.next_power_of_2(E)), SPLIT_K=split_k, KV=16, STAGES=cfg["num_stages"],
        PAIR=len(halves) > 1, EXTRA=xparts is not None, BO_EXTRA=bx[0], **cfg)
    if split_k > 1:
        split_sum_into(dst, out)
    return out


def fused_reference(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                    block_size: tuple[int, int], pair=None, extra=None,
                    extra_block: tuple[int, int] | None = None) -> torch.Tensor:
    """grouped_gemv_fused in plain torch (`reference` per weight; the extra group's rows through its weight)."""
    halves = [(w, scale)] + ([pair] if pair is not None else [])
    xparts = None if extra is None else (list(extra) if pair is not None else [extra])
    outs = []
    for h, (wh, sh) in enumerate(halves):
        if xparts is None:
            outs.append(reference(a, wh, offs, sh, block_size))
            continue
        y = reference(a, wh, offs[:-1], sh, block_size)  # rows past offs[-2] stay zero there
        lo, hi = (int(v) for v in offs[-2:].tolist())
        if hi > lo:
            wx = dequant_fp8_blocks(xparts[h][0], xparts[h][1], extra_block or block_size, a.dtype)
            y[lo:hi] = (a[lo:hi].float() @ wx.float().T).to(a.dtype)
        outs.append(y)
    return torch.cat(outs, dim=1)


def launch_kwargs(M: int, w: torch.Tensor, offs: torch.Tensor | None, tiles: dict, sms: int,
                  scale: torch.Tensor | None = None, block_size: tuple[int, int] = (128, 128)) -> dict:
    """grouped_gemm's _launch kwargs for M rows: any tile given -> those tiles, dot kernel, no K split
    (batch-invariant mode: one path at every M); none -> default_launch (the swapped dot allowed for
    E8M0 scales whose K blocks are multiples of 128)."""
    if any(v is not None for v in tiles.values()):
        return tiles
    fmt, (E, N, Kw) = _format(w), (w.shape if w.dim() == 3 else (1, *w.shape))
    swap_ok = (scale is not None and scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
               and block_size[1] % 128 == 0)
    return default_launch(M, E, fmt, N, Kw * 2 if fmt == FP4 else Kw, sms, offs is None, swap_ok)


def swap_config(M: int) -> dict:
    """The swapped dot's tiles at M rows: the row tile (the MMA's N) the next power of two from 16 to 64,
    64 weight rows by 128 K a step, 4 warps, 3 stages (kernel_sweep.py --only fp8-rows: benchmarks/NOTES.md)."""
    return dict(BLOCK_M=min(64, max(16, triton.next_power_of_2(M))), BLOCK_N=64, BLOCK_K=128, num_warps=4,
                num_stages=3)


def default_launch(M: int, E: int, fmt: int, N: int, K: int, sms: int, one_group: bool,
                   swap_ok: bool = False) -> dict:
    """_launch's kwargs when grouped_gemm is given no tiles: the GEMV kernel where use_gemv says so, the
    swapped dot for one FP8 group at 2 .. SWAP_ROWS - 1 rows when swap_ok (E8M0 blocks spanning whole
    128-wide K tiles), else the dot kernel, each with default tiles and split_k_for's K split. Explicit
    tiles (batch-invariant mode passes them at every M) skip this: the dot kernel, unsplit, whatever the
    row count."""
    if use_gemv(M, E, fmt):
        cfg = gemv_config(M, E)
        split = split_k_for(max_m_tiles(M, E, cfg["ROWS"], one_group), N, K, cfg, sms)
        if split > 1 and K % NARROW_GEMV["BLOCK_K"] == 0 and (
                (E == 1 and N >= NARROW_GEMV_MIN_N) or (E > 1 and M == E and cfg["ROWS"] == 1)):
            return dict(gemv=True, **NARROW_GEMV, split_k=1)
        if E == 1 and M == 1 and split > 1 and WIDE_K_GEMV_MIN_N <= N and K % WIDE_K_GEMV["BLOCK_K"] == 0:
            return dict(gemv=True, **WIDE_K_GEMV, split_k=1)
        if E == 1 and M == 1 and split == 1 and K <= SHORT_K_MAX and N >= SHORT_K_MIN_N and \
                K % SHORT_K_GEMV["BLOCK_K"] == 0:
            return dict(gemv=True, **SHORT_K_GEMV, split_k=1)
        return dict(gemv=True, split_k=split)
    if swap_ok and one_group and fmt == FP8 and 2 <= M < SWAP_ROWS:
        cfg = swap_config(M)
        return dict(swap=True, **cfg, split_k=split_k_for(max_m_tiles(M, E, cfg["BLOCK_M"], True), N, K, cfg, sms))
    cfg = default_config(M, E, fmt, N, sms)
    return dict(split_k=split_k_for(max_m_tiles(M, E, cfg["BLOCK_M"], one_group), N, K, cfg, sms))

