"""Grouped FP8 x FP8 GEMM over expert-sorted rows (W8A8) in Gluon for sm_90: the product of one K step is
promoted (scaled and added to the fp32 total) while the next step's wgmma runs.

Variant "gluon" of kernels/grouped_gemm_fp8.py (whose `_launch` checks shapes and dtypes, then calls `launch`
here; its `reference` is this op's plain-torch reference). Computes, for variant "tma"'s inputs:

    out[r, n] = sum_k (q_a[r, k] * s_a[r, k // ga]) * (q_w[e(r), n, k] * s_w[e(r), n // bo, k // bi])  -> bf16

A [M, K] e4m3, s_a [M, ceil(K/ga)] fp32 (any strides), W [E, N, K] e4m3 with its experts contiguous,
s_w [E, ceil(N/bo), ceil(K/bi)] E8M0 (float8_e8m0fnu / uint8) or fp32, `offs` [E] int32 cumulative row
ends (rows past offs[-1] are left unwritten). 128 divides ga and bi (one scale of each operand per K
step of 128); any bo.

Why Gluon: in Triton 3.6 every `acc += tl.dot(a, b) * scale` gets `wgmma.wait_group 0` right after the
dot, so the tensor cores idle while each step's product is scaled. Here each K step t is one async
`warpgroup_mma` into a fresh accumulator (use_acc=False) and `warpgroup_mma_wait(1)` then waits for step
t - 1 only: step t's MMAs run while step t - 1's product is multiplied by s_a[rows] x s_w[cols] and added
to the fp32 total.

Schedule per output tile (BLOCK_M rows of one expert x BLOCK_N columns; grid and tile order as variant
"tma": grouped_gemm.py's tile -> expert map on the device, no host sync, CUDA-graph capturable):
  * STAGES shared-memory slots, each an A tile [BLOCK_M, BLOCK_K] and a W tile [BLOCK_N, BLOCK_K] filled
    by TMA (descriptors over A [M, K] and W viewed as [E * N, K]; reads past M / E * N / K are zeros)
    and signalled by one mbarrier per slot (expect-tx of both tiles' bytes). Steps 0 .. STAGES - 1 are
    loaded first; once step s's MMA has completed in both warpgroups (wgmma wait, then a CTA barrier),
    its slot is refilled with step s + STAGES.
  * K steps run in groups of GROUP (group_steps): the group's first MMA is issued; for each next step t,
    its MMA is issued, `warpgroup_mma_wait(1)` completes step t - 1's, whose product is promoted while
    step t's runs; the group ends with `warpgroup_mma_wait(0)` and the last product's promotion, so no
    MMA is in flight across the loop's back edge. Why groups: when the loop carries an MMA in flight
    whose accumulator non-wgmma instructions read in the next iteration, ptxas 12.8 (Triton 3.6's) reports C7514
    ("wgmma.mma_async instructions are serialized due to non wgmma instructions reading accumulator
    registers ...") and serialises every wgmma, undoing the overlap. So GROUP - 1 of every GROUP
    promotions overlap an MMA; GROUP 1 is the no-overlap baseline. Three accumulators (total, the
    product being promoted, the MMA in flight) are 3 x 64 fp32 registers a thread; at GROUP > 3 the
    sm_90 build spills.
Rows of a tile past its expert's end (the next expert's rows) are multiplied but never stored.

Warp-specialised kernel (tile option ws=True; opt-in: measured slower than the default tiles, benchmarks/NOTES.md),
in the "ping-pong" style: a tile is 2 x BLOCK_M rows of one expert (BLOCK_M 64) x BLOCK_N columns, and
gl.warp_specialize splits the CTA into
  * a producer partition (1 warp, 40 registers a thread by setmaxnreg) issuing step t's TMA loads (the A tile of
    both halves' rows, the W tile) into slot t % STAGES once the slot's `empty` mbarrier says both consumers
    released step t - STAGES;
  * two consumer warpgroups (the default partition and a 4-warp worker, 232 registers each), consumer i running
    the grouped K loop above on rows i * 64 .. of each slot's A tile with the shared W tile, and releasing a slot
    (one arrival on its `empty`) once its MMA reading it completed. They alternate on the tensor cores: two `turn`
    mbarriers make consumer 1 issue step t after consumer 0 did, and consumer 0 step t + 1 after consumer 1 issued
    step t, so one's promotion runs while the other's MMA does. A consumer whose rows all lie past the expert's end
    only releases the slots (and the other takes no turns).
Each consumer stores its own rows. No MMA is in flight across a loop's back edge here either (sm_90 builds: no
C7514, no spills at group_steps <= 3). persistent=True (with ws=True): one program an SM, each taking tiles pid,
pid + programs, ... (every partition walks the same list through the tile -> expert map; slot and turn phases
count on across tiles), so that the producer loads a tile's first steps while the consumers finish the previous
one (one CTA an SM otherwise leaves each tile's pipeline fill and store exposed: 384 threads x 168 registers).
Its sm_90 build at group_steps 3 spills a few per-tile scalars (56 bytes; none at group_steps 1).
"""
from __future__ import annotations

import torch

from deepinfer.kernels.grouped_gemm import max_m_tiles

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # a Triton without Gluon (< 3.5) or a CPU-only install
    gluon = None

BLOCK_K = 128  # one activation scale group and one weight scale block per K step
E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8)  # weight scales as exponent bytes
SM90_MAX_SHARED = 227 * 1024  # dynamic shared memory one block may take on H100 / H200
SM90_SMS = 132  # an H100 SXM's / H200's SMs: the persistent grid of a launch recorded without a device


def available() -> bool:
    """Whether this Triton ships Gluon with Hopper's TMA / mbarrier / warpgroup_mma."""
    return gluon is not None


def default_config() -> dict:
    """64 x 128 tiles of one warpgroup (4 warps; two CTAs an SM), 4 stages (4 x 24 KiB of operand slots), K steps
    in groups of 3 (group_steps: two of three promotions overlap an MMA; 1 is the no-overlap baseline, wait 0
    after every step). The fastest of the tiles measured at V4's expert shapes at prefill sizes, ahead of 128 x 128
    tiles of two warpgroups and of variant "tma" (benchmarks/NOTES.md, "2026-12-02, third session"). sm_90 builds:
    no spills, no wgmma serialisation; group_steps 4 spills.
    ws=True selects the warp-specialised kernel (a producer warp and two consumer warpgroups of BLOCK_M rows each,
    tiles of 2 x BLOCK_M rows; see the module docstring), persistent=True (ws only) runs it on one program an SM,
    each taking every SMs-th tile; both measured slower than the default tiles (benchmarks/NOTES.md), so off."""
    return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, group_steps=3, ws=False, persistent=False)


def takes(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group: int,
          block: tuple[int, int]) -> bool:
    """Whether launch takes these inputs with its default tiles on this device (_refuse as a test): an
    sm_90 GPU (Gluon's Hopper wgmma / TMA), 128-wide scale groups, aligned contiguous operands."""
    if not (available() and a.is_cuda and torch.cuda.get_device_capability(a.device) == (9, 0)):
        return False
    try:
        _refuse(a, a_scale, w, w_scale, None, group, block, default_config())
    except ValueError:
        return False
    return True


if gluon is not None:
    # registers a thread (setmaxnreg) of the warp-specialised kernel's consumer worker and producer partitions; the
    # default partition (the other consumer) gets what the CTA's 3 warpgroups x 168 leave: 232
    WS_CONSUMER_REGS = gl.constexpr(232)
    WS_PRODUCER_REGS = gl.constexpr(40)

    @gluon.jit
    def _add(x, y):
        return x + y

    @gluon.jit
    def _tile_of(pid_m, offs_ptr, E, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
        """Row tile pid_m -> (live, row0, row_end, e): grouped_gemm.group_tile's map (expert e with c rows owns
        cdiv(c, BLOCK_M) consecutive tiles; live 0 past the last one), in an explicit 1-D layout."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        ids = gl.arange(0, E_PAD, layout=lay)
        ends = gl.load(offs_ptr + ids, mask=ids < E, other=0)
        starts = gl.load(offs_ptr + ids - 1, mask=(ids > 0) & (ids < E), other=0)
        tiles = (gl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
        tile_end = gl.associative_scan(tiles, 0, _add)          # one past each expert's last tile
        live = pid_m < gl.max(tile_end, 0)
        e = gl.sum((tile_end <= pid_m).to(gl.int32), 0)         # experts entirely before this tile
        here = ids == e
        first = gl.sum(gl.where(here, tile_end - tiles, 0), 0)
        row0 = gl.sum(gl.where(here, starts, 0), 0) + (pid_m - first) * BLOCK_M
        row_end = gl.sum(gl.where(here, ends, 0), 0)
        return live, row0, row_end, e

    @gluon.jit
    def _issue_load(a_desc, w_desc, a_bufs, w_bufs, ready, c, t, row0, w_row, pred,
                    STAGES: gl.constexpr, BLOCK_K: gl.constexpr):
        """TMA loads of K step t's A and W tiles into slot c % STAGES (c: the program's count of steps loaded
        before, over its tiles; skipped when pred is false)."""
        s = c % STAGES
        bar = ready.index(s)
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [row0, t * BLOCK_K], bar, a_bufs.index(s), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [w_row, t * BLOCK_K], bar, w_bufs.index(s), pred=pred)

    @gluon.jit
    def _issue_mma(a_bufs, w_bufs, bars, ctr, t, zero, SUB: gl.constexpr, STAGES: gl.constexpr, WS: gl.constexpr):
        """Wait for K step t's operands (in slot c % STAGES, c = ctr[0] + t: ctr[0] steps of earlier tiles), then its
        async MMA into a fresh accumulator. Warp-specialised (bars: ready, empty, turns): the MMA reads rows SUB * 64
        .. of the slot's A tile, and, while both consumers are live (ctr[2]), consumer SUB issues step t after the
        other issued step t - (SUB == 0): the two alternate on the tensor cores, so that one's promotion runs while
        the other's MMA does (turn SUB completes once a step: ctr[1] + t turns before)."""
        c = ctr[0] + t
        s = c % STAGES
        mbarrier.wait(bars[0].index(s), (c // STAGES) & 1)
        a = a_bufs.index(s)
        if WS:
            a = a.slice(SUB * zero.shape[0], zero.shape[0])
            mbarrier.wait(bars[2].index(SUB), ((ctr[1] + t) & 1) ^ (1 - SUB), pred=ctr[2])  # fresh: parity 1 done
        mma = warpgroup_mma(a, w_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        if WS:
            mbarrier.arrive(bars[2].index(1 - SUB), count=1, pred=ctr[2])
        return mma

    @gluon.jit
    def _release(a_desc, w_desc, a_bufs, w_bufs, bars, ctr, t, row0, w_row, K: gl.constexpr, STAGES: gl.constexpr,
                 BLOCK_K: gl.constexpr, WS: gl.constexpr):
        """K step t's MMA completed in this warpgroup: its slot is free for the step STAGES later. Warp-specialised:
        an arrival on the slot's empty barrier (the producer waits for both consumers'); otherwise a CTA barrier
        (both warpgroups done with it) and the refill with step t + STAGES."""
        c = ctr[0] + t
        if WS:
            mbarrier.arrive(bars[1].index(c % STAGES), count=1)
        else:
            gl.thread_barrier()
            nxt = t + STAGES
            _issue_load(a_desc, w_desc, a_bufs, w_bufs, bars[0], c + STAGES, nxt, row0, w_row, nxt * BLOCK_K < K,
                        STAGES, BLOCK_K)

    @gluon.jit
    def _load_scales(as_rows, ws_cols, t, rmask, nmask, s_asg, s_wsk, GA: gl.constexpr, BI: gl.constexpr,
                     E8M0: gl.constexpr, BLOCK_K: gl.constexpr):
        """K step t's scales as fp32: s_a per row (in the accumulator's row layout) and s_w per column, one
        column a thread (ws_cols' 1-D layout: few registers while they are in flight)."""
        a_s = gl.load(as_rows + (t * BLOCK_K // GA) * s_asg, mask=rmask, other=0.0)
        w_s = gl.load(ws_cols + (t * BLOCK_K // BI) * s_wsk, mask=nmask, other=0)
        if E8M0:  # 2^(byte - 127): the byte in fp32's exponent field (byte 0 -> 2^-127)
            b = w_s.to(gl.int32) & 0xFF
            w_s = gl.where(b == 0, 5.877471754111438e-39, (b << 23).to(gl.float32, bitcast=True))
        else:
            w_s = w_s.to(gl.float32)
        return a_s, w_s

    @gluon.jit
    def _promote(total, prod, a_s, w_s, acc_l: gl.constexpr):
        """total + prod x s_a[row] x s_w[col]; s_w redistributed to the accumulator's column layout only now
        (the 32 columns a thread holds are registers while the product is)."""
        w_s = gl.convert_layout(w_s, gl.SliceLayout(0, acc_l))
        return gl.fma(prod * gl.expand_dims(w_s, 0), gl.expand_dims(a_s, 1), total)

    @gluon.jit
    def _step(a_desc, w_desc, a_bufs, w_bufs, bars, ctr, t, prev, total, zero, row0, w_row, as_rows, ws_cols, rmask,
              nmask, s_asg, s_wsk, acc_l: gl.constexpr, K: gl.constexpr, GA: gl.constexpr, BI: gl.constexpr,
              E8M0: gl.constexpr, STAGES: gl.constexpr, BLOCK_K: gl.constexpr, SUB: gl.constexpr, WS: gl.constexpr):
        """K step t (>= 1) with step t - 1's MMA `prev` in flight: issue step t's MMA, wait for step t - 1's,
        release its slot and add its product, scaled, to `total`. Returns (step t's MMA in flight, total)."""
        cur = _issue_mma(a_bufs, w_bufs, bars, ctr, t, zero, SUB, STAGES, WS)
        a_s, w_s = _load_scales(as_rows, ws_cols, t - 1, rmask, nmask, s_asg, s_wsk, GA, BI, E8M0, BLOCK_K)
        prod = warpgroup_mma_wait(1, deps=(prev,))  # step t - 1 done, step t in flight
        _release(a_desc, w_desc, a_bufs, w_bufs, bars, ctr, t - 1, row0, w_row, K, STAGES, BLOCK_K, WS)
        return cur, _promote(total, prod, a_s, w_s, acc_l)

    @gluon.jit
    def _group(a_desc, w_desc, a_bufs, w_bufs, bars, ctr, t0, n: gl.constexpr, total, zero, row0, w_row, as_rows,
               ws_cols, rmask, nmask, s_asg, s_wsk, acc_l: gl.constexpr, K: gl.constexpr, GA: gl.constexpr,
               BI: gl.constexpr, E8M0: gl.constexpr, STAGES: gl.constexpr, BLOCK_K: gl.constexpr, SUB: gl.constexpr,
               WS: gl.constexpr):
        """K steps t0 .. t0 + n - 1, no MMA in flight before or after; returns the total with their products."""
        prev = _issue_mma(a_bufs, w_bufs, bars, ctr, t0, zero, SUB, STAGES, WS)
        for u in gl.static_range(1, n):
            prev, total = _step(a_desc, w_desc, a_bufs, w_bufs, bars, ctr, t0 + u, prev, total, zero, row0, w_row,
                                as_rows, ws_cols, rmask, nmask, s_asg, s_wsk, acc_l, K, GA, BI, E8M0, STAGES, BLOCK_K,
                                SUB, WS)
        t = t0 + n - 1
        a_s, w_s = _load_scales(as_rows, ws_cols, t, rmask, nmask, s_asg, s_wsk, GA, BI, E8M0, BLOCK_K)
        prod = warpgroup_mma_wait(0, deps=(prev,))
        _release(a_desc, w_desc, a_bufs, w_bufs, bars, ctr, t, row0, w_row, K, STAGES, BLOCK_K, WS)
        return _promote(total, prod, a_s, w_s, acc_l)

    @gluon.jit
    def _mma_tile(a_desc, w_desc, a_bufs, w_bufs, bars, ctr, as_ptr, ws_ptr, out_ptr, M, N, row0, row_end, e, pid_n,
                  s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K: gl.constexpr, GA: gl.constexpr, BO: gl.constexpr,
                  BI: gl.constexpr, E8M0: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
                  BLOCK_M: gl.constexpr, SUB: gl.constexpr, WS: gl.constexpr, num_warps: gl.constexpr):
        """Rows row0 + SUB * BLOCK_M .. + BLOCK_M of the tile (one warpgroup a 64 rows) x its BLOCK_N columns: the K
        loop over the slots (loads issued from row0, the slot's first row) and the bf16 store."""
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        KT: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        w_row = (e * N + pid_n * BLOCK_N).to(gl.int32)  # in W viewed as [E * N, K]
        r0 = row0 + SUB * BLOCK_M
        # one warpgroup per 64 rows (BLOCK_M == 16 * num_warps), each MMA instruction the tile's full width
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_N, 32])
        rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_l))
        col_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
        rmask = (rows < row_end) & (rows < M)
        nmask = cols < N
        as_rows = as_ptr + rows.to(gl.int64) * s_asm
        ws_cols = ws_ptr + e.to(gl.int64) * s_wse + (cols // BO) * s_wsn
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_l)
        total = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_l)

        # K steps in groups of GROUP: within a group each step's MMA runs while the previous step's product is
        # promoted; a group ends with no MMA in flight (ptxas serialises every wgmma of a loop whose back edge
        # carries an MMA in flight that non-wgmma instructions read afterwards)
        for j in range(0, KT // GROUP):
            total = _group(a_desc, w_desc, a_bufs, w_bufs, bars, ctr, j * GROUP, GROUP, total, zero, row0, w_row,
                           as_rows, ws_cols, rmask, nmask, s_asg, s_wsk, acc_l, K, GA, BI, E8M0, STAGES, BLOCK_K, SUB,
                           WS)
        if KT % GROUP != 0:
            total = _group(a_desc, w_desc, a_bufs, w_bufs, bars, ctr, KT - KT % GROUP, KT % GROUP, total, zero,
                           row0, w_row, as_rows, ws_cols, rmask, nmask, s_asg, s_wsk, acc_l, K, GA, BI, E8M0, STAGES,
                           BLOCK_K, SUB, WS)

        # 16-byte bf16 stores along a row
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [num_warps, 1], [1, 0])
        res = gl.convert_layout(total.to(gl.bfloat16), out_l)
        orows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_l))
        ocols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_l))
        omask = gl.expand_dims((orows < row_end) & (orows < M), 1) & gl.expand_dims(ocols < N, 0)
        gl.store(out_ptr + gl.expand_dims(orows.to(gl.int64) * s_om, 1) + gl.expand_dims(ocols, 0), res, mask=omask)

    @gluon.jit
    def _this_tile(tile, offs_ptr, N, E, n_tiles, w_desc, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr,
                   num_warps: gl.constexpr):
        """Output tile `tile` (column tiles fastest, as variant "tma"): (live, row0, row_end, e, pid_n, and the
        tile's first row in W viewed as [E * N, K])."""
        live, row0, row_end, e = _tile_of(tile // n_tiles, offs_ptr, E, E_PAD, BLOCK_M, num_warps)
        pid_n = tile % n_tiles
        return live, row0, row_end, e, pid_n, (e * N + pid_n * w_desc.block_type.shape[0]).to(gl.int32)

    @gluon.jit
    def _alloc_slots(a_desc, w_desc, STAGES: gl.constexpr):
        """STAGES slots of an A and a W tile, and each slot's `ready` mbarrier (one arrival: the expect-tx)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        return a_bufs, w_bufs, ready

    @gluon.jit
    def _ws_load_tile(a_desc, w_desc, a_bufs, w_bufs, ready, empty, row0, w_row, c, K: gl.constexpr,
                      STAGES: gl.constexpr):
        """The producer on one live tile, c steps loaded before: step t into slot (c + t) % STAGES once both
        consumers released the step STAGES before (a fresh mbarrier's phase 1 counts as complete: the first pass
        waits for nothing). Returns the steps loaded so far."""
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        KT: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        for t in range(0, KT):
            mbarrier.wait(empty.index((c + t) % STAGES), (((c + t) // STAGES) & 1) ^ 1)
            _issue_load(a_desc, w_desc, a_bufs, w_bufs, ready, c + t, t, row0, w_row, True, STAGES, BLOCK_K)
        return c + KT

    @gluon.jit
    def _ws_producer(a_desc, w_desc, a_bufs, w_bufs, ready, empty, offs_ptr, N, E, n_tiles, all_tiles, row0, w_row,
                     K: gl.constexpr, E_PAD: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
        """The load partition (one warp): this program's tile (row0, w_row), or, PERSISTENT, tiles pid,
        pid + programs, ..."""
        if PERSISTENT:
            c = 0
            for tile in range(gl.program_id(0), all_tiles, gl.num_programs(0)):
                live, row0, row_end, e, pid_n, w_row = _this_tile(tile, offs_ptr, N, E, n_tiles, w_desc, E_PAD,
                                                                  a_desc.block_type.shape[0], 1)
                if live:
                    c = _ws_load_tile(a_desc, w_desc, a_bufs, w_bufs, ready, empty, row0, w_row, c, K, STAGES)
        else:
            _ws_load_tile(a_desc, w_desc, a_bufs, w_bufs, ready, empty, row0, w_row, 0, K, STAGES)

    @gluon.jit
    def _ws_mma_tile(a_desc, w_desc, a_bufs, w_bufs, ready, empty, turns, as_ptr, ws_ptr, out_ptr, M, N, row0, row_end,
                     e, pid_n, c, turned, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K: gl.constexpr, GA: gl.constexpr,
                     BO: gl.constexpr, BI: gl.constexpr, E8M0: gl.constexpr, STAGES: gl.constexpr,
                     GROUP: gl.constexpr, SUB: gl.constexpr):
        """Consumer SUB on one live tile, after c steps of earlier tiles and `turned` turns: its 64 rows, or, when
        they all lie past the expert's end, only the slot releases the producer waits for (then consumer 0, always
        live, takes no turns). Returns (c, turned) after this tile."""
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0] // 2
        KT: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        pp = row0 + BLOCK_M < row_end  # both consumers live
        if row0 + SUB * BLOCK_M < row_end:
            _mma_tile(a_desc, w_desc, a_bufs, w_bufs, (ready, empty, turns), (c, turned, pp), as_ptr, ws_ptr, out_ptr,
                      M, N, row0, row_end, e, pid_n, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K, GA, BO, BI, E8M0,
                      STAGES, GROUP, BLOCK_M, SUB, True, 4)
        else:
            for t in range(0, KT):
                mbarrier.wait(ready.index((c + t) % STAGES), ((c + t) // STAGES) & 1)
                mbarrier.arrive(empty.index((c + t) % STAGES), count=1)
        return c + KT, turned + gl.where(pp, KT, 0)

    @gluon.jit
    def _ws_consumer(a_desc, w_desc, a_bufs, w_bufs, ready, empty, turns, as_ptr, ws_ptr, offs_ptr, out_ptr, M, N, E,
                     n_tiles, all_tiles, row0, row_end, e, pid_n, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om,
                     K: gl.constexpr, GA: gl.constexpr, BO: gl.constexpr, BI: gl.constexpr, E8M0: gl.constexpr,
                     E_PAD: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, PERSISTENT: gl.constexpr,
                     SUB: gl.constexpr):
        """Consumer warpgroup SUB (0: the default partition, 1: a worker): this program's tile (row0, row_end, e,
        pid_n), or, PERSISTENT, tiles pid, pid + programs, ..., counting the steps (slots) and the turns taken."""
        if PERSISTENT:
            c = 0
            turned = 0
            for tile in range(gl.program_id(0), all_tiles, gl.num_programs(0)):
                live, row0, row_end, e, pid_n, w_row = _this_tile(tile, offs_ptr, N, E, n_tiles, w_desc, E_PAD,
                                                                  a_desc.block_type.shape[0], 4)
                if live:
                    c, turned = _ws_mma_tile(a_desc, w_desc, a_bufs, w_bufs, ready, empty, turns, as_ptr, ws_ptr,
                                             out_ptr, M, N, row0, row_end, e, pid_n, c, turned, s_asm, s_asg, s_wse,
                                             s_wsn, s_wsk, s_om, K, GA, BO, BI, E8M0, STAGES, GROUP, SUB)
        else:
            _ws_mma_tile(a_desc, w_desc, a_bufs, w_bufs, ready, empty, turns, as_ptr, ws_ptr, out_ptr, M, N, row0,
                         row_end, e, pid_n, 0, 0, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K, GA, BO, BI, E8M0, STAGES,
                         GROUP, SUB)

    @gluon.jit
    def _ws_run(a_desc, w_desc, as_ptr, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles, all_tiles, row0, row_end, e,
                pid_n, w_row, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K: gl.constexpr, GA: gl.constexpr,
                BO: gl.constexpr, BI: gl.constexpr, E8M0: gl.constexpr, E_PAD: gl.constexpr, STAGES: gl.constexpr,
                GROUP: gl.constexpr, PERSISTENT: gl.constexpr):
        """The warp-specialised region: slots and barriers, then the two consumers and the producer."""
        a_bufs, w_bufs, ready = _alloc_slots(a_desc, w_desc, STAGES)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(empty.index(s), count=2)  # one arrival from each consumer
        for s in gl.static_range(2):
            mbarrier.init(turns.index(s), count=1)
        gl.warp_specialize([
            (_ws_consumer, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turns, as_ptr, ws_ptr, offs_ptr, out_ptr, M,
                            N, E, n_tiles, all_tiles, row0, row_end, e, pid_n, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om,
                            K, GA, BO, BI, E8M0, E_PAD, STAGES, GROUP, PERSISTENT, 0)),
            (_ws_consumer, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turns, as_ptr, ws_ptr, offs_ptr, out_ptr, M,
                            N, E, n_tiles, all_tiles, row0, row_end, e, pid_n, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om,
                            K, GA, BO, BI, E8M0, E_PAD, STAGES, GROUP, PERSISTENT, 1)),
            (_ws_producer, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, offs_ptr, N, E, n_tiles, all_tiles, row0,
                            w_row, K, E_PAD, STAGES, PERSISTENT))],
            [4, 1], [WS_CONSUMER_REGS, WS_PRODUCER_REGS])
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(empty.index(s))
            mbarrier.invalidate(ready.index(s))
        for s in gl.static_range(2):
            mbarrier.invalidate(turns.index(s))

    @gluon.jit
    def _grouped_gemm_fp8_gluon_kernel(a_desc, w_desc, as_ptr, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles, all_tiles,
                                       s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om,
                                       K: gl.constexpr, GA: gl.constexpr, BO: gl.constexpr, BI: gl.constexpr,
                                       E8M0: gl.constexpr, E_PAD: gl.constexpr, STAGES: gl.constexpr,
                                       GROUP: gl.constexpr, WS: gl.constexpr, PERSISTENT: gl.constexpr,
                                       num_warps: gl.constexpr):
        """One output tile a program, of the `all_tiles` (row tiles x n_tiles column tiles). WS: the warp-specialised
        kernel, tiles of 2 x 64 rows (a_desc's block), a producer warp filling the slots and two consumer warpgroups
        (the default partition, num_warps == 4, and a 4-warp worker), one a half, sharing the W tile; PERSISTENT:
        each program takes tiles pid, pid + programs, ... (its producer loads the next tile's first steps while the
        consumers finish and store this one)."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        KT: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        live, row0, row_end, e, pid_n, w_row = _this_tile(gl.program_id(0), offs_ptr, N, E, n_tiles, w_desc, E_PAD,
                                                          BLOCK_M, num_warps)
        if WS and PERSISTENT:  # a program whose first tile is past the last expert may own later ones
            _ws_run(a_desc, w_desc, as_ptr, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles, all_tiles, row0, row_end, e,
                    pid_n, w_row, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K, GA, BO, BI, E8M0, E_PAD, STAGES, GROUP,
                    True)
        elif live:
            if WS:
                _ws_run(a_desc, w_desc, as_ptr, ws_ptr, offs_ptr, out_ptr, M, N, E, n_tiles, all_tiles, row0, row_end,
                        e, pid_n, w_row, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K, GA, BO, BI, E8M0, E_PAD, STAGES,
                        GROUP, False)
            else:
                a_bufs, w_bufs, ready = _alloc_slots(a_desc, w_desc, STAGES)
                for t in gl.static_range(STAGES):  # the first STAGES steps in flight
                    _issue_load(a_desc, w_desc, a_bufs, w_bufs, ready, t, t, row0, w_row, t < KT, STAGES, BLOCK_K)
                _mma_tile(a_desc, w_desc, a_bufs, w_bufs, (ready, ready, ready), (0, 0, False), as_ptr, ws_ptr,
                          out_ptr, M, N, row0, row_end, e, pid_n, s_asm, s_asg, s_wse, s_wsn, s_wsk, s_om, K, GA, BO,
                          BI, E8M0, STAGES, GROUP, BLOCK_M, 0, False, num_warps)
                for s in gl.static_range(STAGES):
                    mbarrier.invalidate(ready.index(s))


_NEEDS = "grouped_gemm_fp8: variant 'gluon' needs"


def _ws_shared(cfg: dict) -> int:
    """Shared memory bytes the warp-specialised kernel takes at most: its operand slots (A tiles of both consumers'
    rows, W tiles; e4m3), each consumer's bf16 tile staged for the store and 1 KiB for the mbarriers and the
    partitions' arguments (an upper bound: sm_90 builds of 64 x 128 tiles at 4 and 6 stages take 147544 and 213112
    bytes, of 64 x 64 tiles at 8 stages 213144)."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    return cfg["num_stages"] * (2 * bm + bn) * BLOCK_K + 2 * bm * bn * 2 + 1024


def _refuse(a, a_scale, w, w_scale, offs, group, block, cfg) -> None:
    """What this kernel takes beyond grouped_gemm_fp8._check: a clear ValueError naming the field."""
    if not available():
        raise ValueError(f"{_NEEDS} triton.experimental.gluon with Hopper's TMA, "
                         "mbarrier and warpgroup_mma (Triton 3.6), not importable here")
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"grouped_gemm_fp8: variant 'gluon' takes e4m3 weights [E, N, K], got weight {w.dtype}")
    if group % BLOCK_K or block[1] % BLOCK_K:
        raise ValueError(f"{_NEEDS} group ({group}) and block[1] ({block[1]}) to be "
                         f"multiples of {BLOCK_K} (one scale of each operand per K step)")
    if a_scale.dtype != torch.float32:
        raise ValueError(f"{_NEEDS} a_scale float32, got a_scale {a_scale.dtype}")
    if w_scale.dtype not in E8M0_DTYPES and w_scale.dtype != torch.float32:
        raise ValueError(f"{_NEEDS} w_scale E8M0 or float32, got w_scale {w_scale.dtype}")
    if offs is not None and offs.dtype != torch.int32:
        raise ValueError(f"{_NEEDS} offs int32, got offs {offs.dtype}")
    if a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError(f"{_NEEDS} unit stride along K, got A stride {tuple(a.stride())}, "
                         f"weight stride {tuple(w.stride())}")
    if w.stride(0) != w.shape[1] * w.stride(1):
        raise ValueError(f"{_NEEDS} the weight's experts contiguous, got weight strides "
                         f"{tuple(w.stride())} for {tuple(w.shape)}")
    if a.stride(0) % 16 or w.stride(1) % 16 or a.data_ptr() % 16 or w.data_ptr() % 16:
        raise ValueError(f"{_NEEDS} 16-byte aligned A / weight bases and row strides, "
                         f"got A stride {a.stride(0)}, weight stride {w.stride(1)}")
    bm, bn, nw, st = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]
    if nw not in (4, 8) or bm != 16 * nw:
        raise ValueError(f"{_NEEDS} BLOCK_M == 16 * num_warps (64 rows a warpgroup) with "
                         f"4 or 8 warps, got BLOCK_M {bm}, num_warps {nw}")
    if bn not in (64, 128, 256):
        raise ValueError(f"{_NEEDS} BLOCK_N 64, 128 or 256, got BLOCK_N {bn}")
    if st < 2:
        raise ValueError(f"{_NEEDS} num_stages >= 2, got num_stages {st}")
    if cfg["group_steps"] < 1:
        raise ValueError(f"{_NEEDS} group_steps >= 1, got group_steps {cfg['group_steps']}")
    for opt in ("ws", "persistent"):
        if cfg[opt] not in (False, True):
            raise ValueError(f"{_NEEDS} {opt} True or False, got {opt} {cfg[opt]!r}")
    if cfg["persistent"] and not cfg["ws"]:
        raise ValueError(f"{_NEEDS} ws=True for persistent=True (the warp-specialised kernel's loop over tiles)")
    if cfg["ws"] and (nw != 4 or bn > 128):
        raise ValueError(f"{_NEEDS} with ws=True consumer warpgroups of 64 rows (BLOCK_M 64, num_warps 4) and "
                         f"BLOCK_N <= 128 (their accumulators' registers), got BLOCK_M {bm}, num_warps {nw}, "
                         f"BLOCK_N {bn}")
    if cfg["ws"] and _ws_shared(cfg) > SM90_MAX_SHARED:
        raise ValueError(f"{_NEEDS} with ws=True num_stages x (2 x BLOCK_M + BLOCK_N) x {BLOCK_K} bytes of slots "
                         f"and the stores' staging within {SM90_MAX_SHARED} bytes, got num_stages {st}, BLOCK_N {bn}")


def launch(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
           group: int = 128, block: tuple[int, int] = (1, 128), **tiles) -> torch.Tensor:
    """out [M, N] bf16 (rows past offs[-1] unwritten) for inputs that grouped_gemm_fp8._check accepted.
    `tiles`: BLOCK_M / BLOCK_N / num_warps / num_stages / group_steps / ws / persistent over default_config's
    (BLOCK_K is 128; None values are ignored). Raises ValueError for inputs or tiles this kernel does not take."""
    cfg = default_config()
    bk = tiles.pop("BLOCK_K", None)
    if bk not in (None, BLOCK_K):
        raise ValueError(f"grouped_gemm_fp8: variant 'gluon' runs BLOCK_K {BLOCK_K}, got BLOCK_K {bk}")
    unknown = set(tiles) - set(cfg)
    if unknown:
        raise ValueError(f"grouped_gemm_fp8: variant 'gluon' takes tiles {sorted(cfg)}, got {sorted(unknown)}")
    cfg.update({k: v for k, v in tiles.items() if v is not None})
    _refuse(a, a_scale, w, w_scale, offs, group, block, cfg)
    M, K = a.shape
    E, N = w.shape[0], w.shape[1]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    e8m0 = w_scale.dtype in E8M0_DTYPES
    ws = w_scale.view(torch.uint8) if e8m0 else w_scale
    bm, bn = cfg["BLOCK_M"] * (2 if cfg["ws"] else 1), cfg["BLOCK_N"]  # ws: a tile is both consumers' rows
    a_desc = GluonTensorDescriptor(a, [M, K], [a.stride(0), 1], [bm, BLOCK_K],
                                   gl.NVMMASharedLayout.get_default_for([bm, BLOCK_K], gl.float8e4nv))
    w_desc = GluonTensorDescriptor(w, [E * N, K], [w.stride(1), 1], [bn, BLOCK_K],
                                   gl.NVMMASharedLayout.get_default_for([bn, BLOCK_K], gl.float8e4nv))
    n_tiles = triton.cdiv(N, bn)
    all_tiles = max_m_tiles(M, E, bm) * n_tiles
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else SM90_SMS
    grid = (min(all_tiles, sms) if cfg["persistent"] else all_tiles,)
    _grouped_gemm_fp8_gluon_kernel[grid](
        a_desc, w_desc, a_scale, ws, offs, out, M, N, E, n_tiles, all_tiles,
        a_scale.stride(0), a_scale.stride(1), ws.stride(0), ws.stride(1), ws.stride(2), out.stride(0),
        K=K, GA=group, BO=block[0], BI=block[1], E8M0=e8m0, E_PAD=max(32 * cfg["num_warps"], triton.next_power_of_2(E)),
        STAGES=cfg["num_stages"], GROUP=cfg["group_steps"], WS=cfg["ws"], PERSISTENT=cfg["persistent"],
        num_warps=cfg["num_warps"])
    return out
