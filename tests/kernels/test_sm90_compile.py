"""Every Triton kernel compiles for sm_90 at the launch configurations the Flash slice uses.

The launchers run with CPU tensors of the model's widths (few rows) inside `sm90.record()`, so the
constexprs, dtypes and tile options are the ones a real step would pass; each distinct launch is
then compiled ahead of time for the H200's architecture. No GPU needed.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from sm90 import compile_sm90, record  # noqa: E402

from deepinfer.kernels import (compress_pool, copy_rows, grouped_gemm, index_scores, index_topk,  # noqa: E402
                               invariant_matmul, mhc_coeffs, mhc_collapse, mhc_expand, mhc_mix, moe_align,
                               moe_combine, rms_norm, rope, router, sparse_attention, split_sum, swiglu)
from deepinfer.kernels import index_query  # noqa: E402
from deepinfer.layers import invariant  # noqa: E402

BF = torch.bfloat16
SM90_MAX_SHARED = 227 * 1024  # dynamic shared memory one block may take on H100 / H200 (CUDA's sm_90 limit)


def _e(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype)  # values are never read: launches are recorded, not run


def _i(*shape, dtype=torch.int64):
    return torch.zeros(*shape, dtype=dtype)


def attention_launches():
    H, D, W = 64, 512, 128
    fp8_store = (_e(40, 448, dtype=torch.float8_e4m3fn), _i(40, 7, dtype=torch.uint8), _e(40, 64))
    for T, fmt in ((1, "bfloat16"), (64, "bfloat16"), (1024, "bfloat16"), (1, "fp8"), (64, "fp8")):
        store = (_e(40, D),) if fmt == "bfloat16" else fp8_store
        args = (_e(T, H, D), _e(T, D), _i(T, W), _i(T, W), store, fmt, _i(T, 512), store, fmt,
                _e(H, dtype=torch.float32), D ** -0.5)
        cfg = sparse_attention.default_config(T, fmt == "fp8")
        sparse_attention._launch(*args, **cfg, num_splits=4 if T == 1 else 1)
        sparse_attention._launch(*args, **cfg, num_splits=1, indirect=(_i(T), _i(3, 1024)))
        inv = {k: v for k, v in invariant.ATTENTION_TILES.items()}
        for programs in (True, False):
            sparse_attention._launch(*args, **inv, split_programs=programs, indirect=(_i(T), _i(3, 1024)))
    sparse_attention._launch(_e(3, H, D), _e(3, D), _i(3, W), _i(3, W), (_e(40, D),), "bfloat16", None, None, None,
                             _e(H, dtype=torch.float32), D ** -0.5)


def moe_launches():
    for M, E in ((6, 256), (384, 256), (8192 * 6, 256)):
        a, offs = _e(M, 4096), _i(E, dtype=torch.int32)  # 8192 x 6 pairs: the prefill tiles
        grouped_gemm._launch(a, _e(E, 2048, 4096), offs, None, (128, 128))
        grouped_gemm._launch(a, _e(E, 2048, 4096, dtype=torch.float8_e4m3fn), offs,
                             _i(E, 16, 32, dtype=torch.uint8).view(torch.float8_e8m0fnu), (128, 128))
        grouped_gemm._launch(a, _e(E, 2048, 4096, dtype=torch.float8_e4m3fn), offs,
                             _i(E, 2048, 128, dtype=torch.uint8).view(torch.float8_e8m0fnu), (1, 32))
        grouped_gemm._launch(a, _i(E, 2048, 2048, dtype=torch.int8), offs,  # FP4 experts as shipped
                             _i(E, 2048, 128, dtype=torch.uint8).view(torch.float8_e8m0fnu), (1, 32))
    grouped_gemm._launch(_e(6, 4096), _i(256, 2048, 2048, dtype=torch.int8), _i(256, dtype=torch.int32),
                         _i(256, 2048, 128, dtype=torch.uint8), (1, 32), split_k=2)  # experts of one token, K split
    grouped_gemm._launch(_e(1, 4096), _e(1024, 4096, dtype=torch.float8_e4m3fn), None,
                         _i(8, 32, dtype=torch.uint8).view(torch.float8_e8m0fnu), (128, 128), split_k=8)
    grouped_gemm._launch(_e(6, 4096), _e(4, 2048, 4096), _i(4, dtype=torch.int32), None, (128, 128),
                         **invariant.GEMM_TILES)
    gemv_expert_launches()
    for T in (1, 64):
        moe_align._launch(_i(T, 6), 256)
        router._launch(_e(T, 256, dtype=torch.float32), 6, 1.5, _i(T), _i(1000, 6))
        router._launch(_e(T, 256, dtype=torch.float32), 6, 1.5, bias=_e(256, dtype=torch.float32),
                       bias_vl=_e(256, dtype=torch.float32), image_mask=_i(T, dtype=torch.bool))
        moe_combine._launch(_e(T * 6, 4096), _i(T * 6), _e(T, 6, dtype=torch.float32), 6, _i(T * 6), _e(T, 4096), BF)
        moe_combine._launch(_e(T * 6, 4096), _i(T * 6), _e(T, 6, dtype=torch.float32), 6)
        swiglu._launch(_e(T, 2048), _e(T, 2048), 10.0, BF)


def gemv_expert_launches():
    """grouped_gemm's GEMV with its default tiles and split: V4's routed experts (FP8 codes, folded (1, 128) and
    (1, 32) E8M0 scales) at 1 and 8 tokens x 6 (w1 / w3 N=2048 K=4096, w2 N=4096 K=2048)."""
    for M, block in ((6, (1, 128)), (48, (1, 128)), (6, (1, 32))):
        for N, K in ((2048, 4096), (4096, 2048)):
            kw = grouped_gemm.default_launch(M, 256, grouped_gemm.FP8, N, K, 132, False)
            assert kw.get("gemv"), (M, N, K)
            grouped_gemm._launch(_e(M, K), _e(256, N, K, dtype=torch.float8_e4m3fn), _i(256, dtype=torch.int32),
                                 _i(256, N, K // block[1], dtype=torch.uint8).view(torch.float8_e8m0fnu), block, **kw)
    # one token: the shared expert as group 256 of its 6 routed rows (grouped_gemv_fused), w1 | w3 in one launch
    # (128 x 128 blocks for the shared expert), then w2
    e4, e8 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    for N, K, pair in ((2048, 4096, True), (4096, 2048, False)):
        halves = [(_e(256, N, K, dtype=e4), _i(256, N, K // 128, dtype=torch.uint8).view(e8))
                  for _ in range(1 + pair)]
        extra = [(_e(N, K, dtype=e4), _i(N // 128, K // 128, dtype=torch.uint8).view(e8)) for _ in range(1 + pair)]
        grouped_gemm._launch_fused(_e(7, K), halves, extra, _i(257, dtype=torch.int32), (1, 128), (128, 128), 132)


def gemv_linear_launches():
    """grouped_gemm's GEMV: V4's FP8 (128 x 128 blocks) decode projections at 1 row (default tiles and split) and
    at 3 rows (ROWS 4, forced: the default keeps the dot kernel above GEMV_ROWS_ONE rows), and a grouped
    projection (wo_a: 8 groups, 2 rows each)."""
    for M in (1, 3):
        for N, K in ((1536, 4096), (32768, 1024), (4096, 8192), (64, 4096)):
            if M <= grouped_gemm.GEMV_ROWS_ONE:
                kw = grouped_gemm.default_launch(M, 1, grouped_gemm.FP8, N, K, 132, True)
                assert kw.get("gemv"), (M, N, K)
            else:
                kw = {"gemv": True, "ROWS": 4}
            grouped_gemm._launch(_e(M, K), _e(N, K, dtype=torch.float8_e4m3fn), None,
                                 _i(-(-N // 128), K // 128, dtype=torch.uint8).view(torch.float8_e8m0fnu), (128, 128),
                                 **kw)
    kw = grouped_gemm.default_launch(16, 8, grouped_gemm.FP8, 1024, 4096, 132, False)
    grouped_gemm._launch(_e(16, 4096), _e(8, 1024, 4096, dtype=torch.float8_e4m3fn), _i(8, dtype=torch.int32),
                         _i(8, 8, 32, dtype=torch.uint8).view(torch.float8_e8m0fnu), (128, 128), **kw)


def dense_launches():
    gemv_linear_launches()
    for M, dtype in ((1, BF), (200, BF), (3, torch.float32)):
        invariant_matmul._launch(_e(M, 4096, dtype=dtype), _e(1024, 4096, dtype=dtype))
        invariant_matmul._launch(_e(M, 4096, dtype=dtype), _e(1024, 4096, dtype=dtype), torch.float32, n_splits=1)
    split_sum._launch(_e(8, 2, 1024, dtype=torch.float32), _e(2, 1024))
    for T in (1, 64, 8192):
        x = _e(T, 16384)
        mhc_mix._launch(x, _e(24, 16384, dtype=torch.float32), 1e-6)
        mhc_mix._launch(x, _e(24, 16384, dtype=torch.float32), 1e-6, mhc_mix.fixed_splits(16384), 16)
        mhc_coeffs._launch(_e(T, 24, dtype=torch.float32), _e(24, dtype=torch.float32), _e(3, dtype=torch.float32), 4,
                           20, 1e-6)
        mhc_collapse._launch(_e(T, 4, 4096), _e(T, 4, dtype=torch.float32), _e(4096, dtype=torch.float32), 1e-6)
        mhc_expand._launch(_e(T, 4, 4096), _e(T, 4096), _e(T, 4, dtype=torch.float32), _e(T, 4, 4, dtype=torch.float32))
    for T in (1, 64):
        x, cs = _e(T, 64, 512), _e(T, 32, dtype=torch.float32)
        rope._launch(x, cs, cs, False, 1e-6)
        rope._launch(x, cs, cs, True, None, inplace=True)
        rms_norm._launch(_e(T, 4096), 1e-6, _e(4096, dtype=torch.float32), None)
        rms_norm._launch(_e(T, 1024), 1e-6, _e(1024, dtype=torch.float32), None)
    compress_pool._launch(_e(8, 1024, dtype=torch.float32), _e(8, 1024, dtype=torch.float32),
                          _e(8, 1024, dtype=torch.float32), _e(8, 1024, dtype=torch.float32), _i(2, 8), _i(2, 8), 512,
                          True)
    compress_pool._launch(_e(8, 512, dtype=torch.float32), _e(8, 512, dtype=torch.float32),
                          _e(8, 512, dtype=torch.float32), _e(8, 512, dtype=torch.float32), _i(1, 128), _i(1, 128), 512,
                          False)
    copy_rows._launch(((_e(16, 1024, dtype=torch.float32), _e(8, 1024, dtype=torch.float32)),
                       (_e(16, 1024, dtype=torch.float32), _e(8, 1024, dtype=torch.float32))), _i(8), _i(8))
    index_scores._launch(_e(4, 64, 128), _e(512, 128), _e(4, 64, dtype=torch.float32), _i(4))
    index_topk._launch(_e(4, 512, dtype=torch.float32), _i(4), 64)
    index_query._launch(_e(4, 64, 128), cuda_log2=True)                       # V4's queries; tiny models' fp32
    index_query._launch(_e(4, 16, 64, dtype=torch.float32), cuda_log2=True)
    index_query._launch_keys(_e(4, 128), cuda_log2=True)
    for T in (1, 64):
        index_scores._launch_per_token(_e(T, 64, 128), _e(4096, 128), _i(T, 1024), _i(T),
                                       _e(T, 64, dtype=torch.float32), _i(T))


@pytest.mark.parametrize("launches", [attention_launches, moe_launches, dense_launches])
def test_kernels_compile_for_sm90(launches):
    with record() as got:
        launches()
    assert got, "no launch was recorded"
    seen = {}
    for launch in got:
        seen.setdefault(launch.key, launch)
    failed = []
    for launch in seen.values():
        try:  # built as the JIT builds it on a GPU (specialised: loads pipelined through shared memory)
            shared = compile_sm90(launch, specialize=True).metadata.shared
        except Exception as e:  # noqa: BLE001 - report every failing configuration at once
            failed.append(f"{launch.fn.__name__} {launch.constexprs} {launch.options}: {type(e).__name__}: "
                          + " | ".join(str(e).strip().splitlines()[-3:]))
            continue
        if shared > SM90_MAX_SHARED:  # the device would refuse the launch (OutOfResources)
            failed.append(f"{launch.fn.__name__} {launch.constexprs} {launch.options}: {shared} bytes of shared "
                          f"memory, above sm_90's {SM90_MAX_SHARED}")
    assert not failed, "\n".join(failed)


def attention_v41_launches():
    """V4.1-Flash's attention: fp8 window ring (e4m3, E8M0 per 32) and nvfp4 entries (e2m1, e4m3 per 16),
    decoded in the kernel; SWA layers without entries."""
    H, D, W = 64, 512, 128
    ring = (_e(40, D, dtype=torch.float8_e4m3fn), _i(40, D // 32, dtype=torch.uint8))
    ent = (_i(40, D // 2, dtype=torch.uint8), _e(40, D // 16, dtype=torch.float8_e4m3fn))
    for T in (1, 64, 1024):
        cfg = sparse_attention.default_config(T, True)
        head = (_e(T, H, D), _e(T, D), _i(T, W), _i(T, W), ring, "v41fp8")
        sinks = (_e(H, dtype=torch.float32), D ** -0.5)
        args = head + (_i(T, 512), ent, "nvfp4") + sinks
        sparse_attention._launch(*args, **cfg, num_splits=4 if T == 1 else 1)
        sparse_attention._launch(*args, **cfg, num_splits=1, indirect=(_i(T), _i(3, 1024)))
        sparse_attention._launch(*head, None, None, None, *sinks, **cfg, num_splits=4 if T == 1 else 1)
        for programs in (True, False):
            sparse_attention._launch(*args, **invariant.ATTENTION_TILES, split_programs=programs,
                                     indirect=(_i(T), _i(3, 1024)))
            sparse_attention._launch(*head, None, None, None, *sinks, **invariant.ATTENTION_TILES,
                                     split_programs=programs)


def test_v41_attention_compiles_for_sm90():
    test_kernels_compile_for_sm90(attention_v41_launches)


def csa2_launches():
    """V4.1-Flash's CSA2: indexer scores (64 heads x 128) against mxfp4 / bf16 keys read by address,
    the candidate source's block selection (2048 blocks of 8), the top-512 with and without the
    candidate mask (counting and packed-key paths), the ratio-2 pooling (2 slots, width 512)."""
    from deepinfer.kernels import candidate_blocks
    H, D, F32 = 64, 128, torch.float32
    stores = {"mxfp4": (_i(4096, D // 2, dtype=torch.uint8), _i(4096, D // 32, dtype=torch.uint8)),
              "bfloat16": (_e(4096, D),)}
    for fmt, store in stores.items():
        scale = store[1] if fmt == "mxfp4" else None
        index_scores._launch(_e(64, H, D), store[0], _e(64, H, dtype=F32), _i(64), scale=scale, rows=_i(1024), fmt=fmt)
        for T in (1, 64):
            index_scores._launch_per_token(_e(T, H, D), store[0], _i(T, 1024), _i(T), _e(T, H, dtype=F32), _i(T),
                                           scale=scale, fmt=fmt)
    for T, N in ((1, 1024), (64, 1024), (64, 20000)):
        s, allowed = _e(T, N, dtype=F32), _i(T, N, dtype=torch.bool)
        if N <= index_topk.MAX_N:
            index_topk._launch(s, _i(T), 512, allowed)
        index_topk._launch_long(s, _i(T), 512, allowed)
        index_topk._launch_long(s, _i(T), 512)
        for topk_blocks in (16, 2048):  # a k-th key per row, or every block kept (2048 >= N / 8)
            candidate_blocks._launch(s, _i(T), topk_blocks, 8)
    compress_pool._launch(_e(8, 1024, dtype=F32)[:, :512], _e(8, 512, dtype=F32), _e(8, 512, dtype=F32),
                          _e(8, 512, dtype=F32), _i(4, 2), _i(4, 2), 512, False)


def test_csa2_compiles_for_sm90():
    test_kernels_compile_for_sm90(csa2_launches)


def engram_launches():
    """V4.1-Flash's Engram lookup (4-grams, 8 heads: 24 hash heads x 256 columns): FP8 table with E8M0 per 32
    and a dense bf16 one, out in bf16 / fp32, decode and prefill token counts."""
    from deepinfer.kernels import engram_lookup
    K, HH, D = 4, 24, 256
    consts = (_i(512), _i(K), _i(HH), _i(HH), 2)
    tables = ((_e(4096, D, dtype=torch.float8_e4m3fn), _i(4096, D // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)),
              (_e(4096, D), None))
    for T in (1, 64, 8192):
        for w, s in tables:
            for dtype in (BF, torch.float32):
                engram_lookup._launch(_i(T, K), *consts, w, s, dtype)
    engram_lookup._launch(_i(3, 2), _i(512), _i(2), _i(1), _i(1), 0, _e(64, 48, dtype=torch.float32), None, BF)


def test_engram_compiles_for_sm90():
    test_kernels_compile_for_sm90(engram_launches)


def fp8_linear_launches():
    """W8A8 linears (prefill row counts): the 1 x 128 activation quantisation at V4 / V4.1 widths, and the
    Triton FP8 GEMM for V4's 128 x 128 blocks (fallback where cuBLAS blockwise is unavailable) and V4.1's
    32 x 32 blocks, E8M0 and fp32 weight scales (the recorder's CPU tensors keep the e4m3 dot)."""
    from deepinfer.kernels import act_quant, fp8_gemm
    E4 = torch.float8_e4m3fn
    for T in (256, 8192):
        for K in (4096, 5120, 1024):
            act_quant._launch(_e(T, K), 128, True, rows=-(-T // 16) * 16)
    act_quant._launch(_e(300, 4096, dtype=torch.float32), 32, False)
    e8 = lambda *s: _i(*s, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # noqa: E731
    for T in (256, 8192):
        a, sa = _e(T, 4096, dtype=E4), _e(32, T, dtype=torch.float32).t()
        fp8_gemm._launch(a, sa, _e(1536, 4096, dtype=E4), e8(12, 32))
        fp8_gemm._launch(a, sa, _e(1536, 4096, dtype=E4), _e(12, 32, dtype=torch.float32))
        fp8_gemm._launch(_e(T, 5120, dtype=E4), _e(40, T, dtype=torch.float32).t(), _e(1280, 5120, dtype=E4),
                         e8(40, 160), 128, (32, 32))


def test_fp8_linear_kernels_compile_for_sm90():
    test_kernels_compile_for_sm90(fp8_linear_launches)


def fp8_expert_variant_launches():
    """grouped_gemm_fp8's opt-in variant "tma" (tensor descriptors) at V4-Flash's routed-expert prefill shapes
    (8192 and ~2.7k tokens x top-6 of 256; w1 / w3 N=2048 K=4096, w2 N=4096 K=2048, folded (1, 128) E8M0
    scales): default tiles, 128-row tiles, and a persistent grid of two programs per H200 SM."""
    from deepinfer.kernels import grouped_gemm_fp8 as g8
    E4, E = torch.float8_e4m3fn, 256
    for M in (8192 * 6, 2731 * 6):
        for N, K in ((2048, 4096), (4096, 2048)):
            args = (_e(M, K, dtype=E4), _e(K // 128, M, dtype=torch.float32).t(), _e(E, N, K, dtype=E4),
                    _i(E, N, K // 128, dtype=torch.uint8).view(torch.float8_e8m0fnu), _i(E, dtype=torch.int32))
            g8._launch(*args, variant="tma")
            g8._launch(*args, variant="tma", programs=264)
            g8._launch(*args, variant="tma", BLOCK_M=128, num_warps=8, num_stages=3)


def test_fp8_expert_variants_compile_for_sm90():
    """Compiled generically and as the JIT specialises them on the device (16-byte aligned pointers, strides
    divisible by 16, a unit stride as constexpr): the build the H200 runs moves its tiles by TMA."""
    from sm90 import compile_sm90
    test_kernels_compile_for_sm90(fp8_expert_variant_launches)
    with record() as got:
        fp8_expert_variant_launches()
    for launch in {launch.key: launch for launch in got}.values():
        assert "ttng.async_tma_copy_global_to_local" in compile_sm90(launch, specialize=True).asm["ttgir"]


def w4a8_expert_launches():
    """V4-Flash's routed experts read as shipped (packed FP4, E8M0 per (1, 32)) at decode batch 1 and 64 (6 and
    384 expert-sorted rows of 256 experts) and one prefill size: w1 / w3 N=2048 K=4096 (K/2 = 2048 bytes a
    row), w2 N=4096 K=2048; w4a8_config's tiles (16 rows at decode, 64 above) with the PTX and the plain nibble
    conversion, and 64-row (wgmma) tiles at every size."""
    from deepinfer.kernels import grouped_gemm_fp8 as g8
    E4, E = torch.float8_e4m3fn, 256
    for M in (6, 384, 2731 * 6):
        for N, K in ((2048, 4096), (4096, 2048)):
            args = (_e(M, K, dtype=E4), _e(K // 128, M, dtype=torch.float32).t(), _i(E, N, K // 2, dtype=torch.int8),
                    _i(E, N, K // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu), _i(E, dtype=torch.int32), 128,
                    (1, 32))
            g8._launch(*args)
            g8._launch(*args, asm=False)
            g8._launch(*args, BLOCK_M=64)
            g8._launch(*args, BLOCK_M=64, BLOCK_N=64, num_stages=6)


def test_w4a8_experts_compile_for_sm90():
    """Shared memory within sm_90's limit; registers and spills: tests/kernels/test_grouped_gemm_fp8_w4a8.py."""
    test_kernels_compile_for_sm90(w4a8_expert_launches)


def entry_quant_launches():
    """EntryStore fp8 (V4: 448 nope dims in 7 groups of 64 + 64 rope dims): the scattered write with and
    without the ring's gather (write_from), the round trip, bf16 and fp32 rows (the tiny models'); decode batch
    1 and 64 rows (a program's tile does not depend on the row count); with the norm (RMSNorm + RoPE first):
    the window kv's round trip with and without its store, the compressed entries' write."""
    from deepinfer.kernels import entry_quant
    E4, U8 = torch.float8_e4m3fn, torch.uint8
    for T in (1, 64):
        store = (_e(T + 8, 448, dtype=E4), _i(T + 8, 7, dtype=U8), _e(T + 8, 64))
        norm = (_e(512, dtype=torch.float32), 1e-6, _e(T, 32, dtype=torch.float32), _e(T, 32, dtype=torch.float32))
        for dtype in (BF, torch.float32):
            x = _e(T, 512, dtype=dtype)
            entry_quant._launch(x, 64, store, _i(T), cuda_math=True)
            entry_quant._launch(x, 64, decode=True, cuda_math=True)
            entry_quant._launch(x, 64, store, _i(T), decode=True, cuda_math=True, norm=norm)
            entry_quant._launch(x, 64, store, _i(T), cuda_math=True, norm=norm)
            entry_quant._launch(x, 64, decode=True, cuda_math=True, norm=norm)  # the ring at prefill: no store
        entry_quant._launch(_e(T, 512), 64, store, _i(T), _i(T), cuda_math=True)


def test_entry_quant_compiles_for_sm90():
    test_kernels_compile_for_sm90(entry_quant_launches)


def row_argmax_launches():
    """The sampler's greedy argmax over V4's vocabulary (129280): fp32 logits at decode batch 1 (32 slices
    a row), 64 (a few slices) and 1024 (one slice a row: stage 1 writes the answer), bf16 rows, and a
    strided view."""
    from deepinfer.kernels import row_argmax
    for R in (1, 64, 1024):
        row_argmax._launch(_e(R, 129280, dtype=torch.float32))
    row_argmax._launch(_e(8, 129280))
    row_argmax._launch(_e(8, 129536, dtype=torch.float32)[:, :129280])


def test_row_argmax_compiles_for_sm90():
    test_kernels_compile_for_sm90(row_argmax_launches)


def test_swapped_dot_keeps_mmas_in_flight_on_sm90():
    """grouped_gemm's swapped dot (swap=True) at decode row counts of V4's 4096 x 4096 FP8 projection and its
    routed experts, built as the JIT would on an H200: wgmma reads the widened weight from registers and the
    loop waits for all but the latest MMAs (wait_group > 0), where the dot kernel's scale-after-product waits
    for each (wait_group 0 only)."""
    import re

    E4, e8 = torch.float8_e4m3fn, lambda *s: _i(*s, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # noqa: E731
    cases = [(M, (_e(M, 4096), _e(4096, 4096, dtype=E4), None, e8(32, 32), (128, 128))) for M in (16, 64)]
    cases.append((48, (_e(48, 4096), _e(256, 2048, 4096, dtype=E4), _i(256, dtype=torch.int32), e8(256, 2048, 32),
                       (1, 128))))
    for M, args in cases:
        for swap in (True, False):
            with record() as got:
                grouped_gemm._launch(*args, BLOCK_M=16 if swap or M <= 16 else 64, BLOCK_N=64, BLOCK_K=128,
                                     num_warps=4, num_stages=3, swap=swap)
            ptx = compile_sm90(got[0], specialize=True).asm["ptx"]
            waits = {int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}
            if swap:
                assert "wgmma.mma_async" in ptx and max(waits) > 0, (M, waits)
                assert re.search(r"wgmma\.mma_async[^;]*\{\s*%r", ptx), "the weight operand comes from registers"
            else:
                assert waits <= {0}, (M, waits)                          # (mma.sync below 64 rows: no waits)


def test_swapped_dot_default_tiles_build_for_sm90(monkeypatch):
    """The swapped dot as grouped_gemm's default launches it (swap_config, split_k_for) for V4's FP8 projections
    at 2, 32 and 63 rows: no spills, the weight operand from registers, MMAs kept in flight."""
    import re
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90_kernel_resources import ptxas_usage

    e8 = lambda *s: _i(*s, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # noqa: E731
    for M in (2, 32, 63):
        for N, K in ((4096, 8192), (32768, 1024)):
            kw = grouped_gemm.default_launch(M, 1, grouped_gemm.FP8, N, K, 132, True, swap_ok=True)
            assert kw.get("swap"), (M, N, K, kw)
            with record() as got:
                grouped_gemm._launch(_e(M, K), _e(N, K, dtype=torch.float8_e4m3fn), None, e8(N // 128, K // 128),
                                     (128, 128), **kw)
            ptx = compile_sm90(got[0], specialize=True).asm["ptx"]
            usage = ptxas_usage(ptx)
            waits = {int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}
            assert usage["spill_stores"] == 0 and max(waits) > 0, (M, N, K, usage, waits)
            assert re.search(r"wgmma\.mma_async[^;]*\{\s*%r", ptx), (M, N, K)


def test_gluon_launches_record_and_build_for_sm90():
    """sm90.record / compile_sm90 take Gluon kernels (grouped_gemm_fp8 variant "gluon": its own AST source and
    TMA descriptor type), as benchmarks/sm90_kernel_resources.py compiles every variant."""
    from deepinfer.kernels import grouped_gemm_fp8 as g8
    from deepinfer.kernels import grouped_gemm_fp8_gluon as ggl

    if not ggl.available():
        pytest.skip("this Triton has no Gluon")
    e4 = torch.float8_e4m3fn
    with record() as got:
        g8._launch(_e(512, 4096, dtype=e4), _e(32, 512, dtype=torch.float32).t(), _e(8, 2048, 4096, dtype=e4),
                   _i(8, 2048, 32, dtype=torch.uint8).view(torch.float8_e8m0fnu), _i(8, dtype=torch.int32), 128,
                   (1, 128), variant="gluon")
    (launch,) = got
    ptx = compile_sm90(launch, specialize=True).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
