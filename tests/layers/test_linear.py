"""Linear helpers: stacked same-input projections (one GEMM for several weights)."""
import pytest
import torch
import torch.nn.functional as F

from deepinfer.layers.linear import Linear, QuantSpec, fuse_output_rows, stacked_forward


def _fp8_linear(i: int, o: int, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(i, o, torch.bfloat16, QuantSpec(block_size=(128, 128)))
    lin.weight.copy_((torch.randn(o, i, generator=g) * 4).to(torch.float8_e4m3fn))
    lin.scale.copy_(torch.randint(117, 122, lin.scale.shape, generator=g, dtype=torch.uint8).view(lin.scale.dtype))
    return lin


def test_fused_rows_give_each_parts_output_and_share_storage():
    torch.manual_seed(0)
    for make in (lambda o, s: Linear(256, o, torch.float32), lambda o, s: _fp8_linear(256, o, s)):
        a, b = make(128, 1), make(384, 2)
        if a.block_size is None:
            a.weight.data.normal_(), b.weight.data.normal_()
        x = torch.randn(5, 256)
        want = torch.cat((a.forward_fp32(x), b.forward_fp32(x)), dim=1)
        fused = fuse_output_rows((a, b))
        assert fused is not None and fused.out_features == 512
        torch.testing.assert_close(fused.forward_fp32(x), want, atol=1e-5, rtol=1e-5)
        assert a.weight.data_ptr() == fused.weight.data_ptr()        # views, no copy kept
        assert b.weight.data_ptr() == fused.weight[128:].data_ptr()
        if a.block_size is None:                                     # later in-place loads reach the fused weight
            b.weight.data.fill_(0.5)
            assert (fused.weight[128:] == 0.5).all()
        assert "weight" in dict(a.named_parameters()) or "weight" in dict(a.named_buffers())


def test_fused_rows_keep_the_parts_prepared_scales():
    """A fused Linear (built lazily, after prepare_fp8_linears ran on its parts) carries their widened W8A8 scales
    stacked, or none when a part has none (then W8A8 widens per call, as for any unprepared Linear)."""
    a, b = _fp8_linear(256, 128, 1), _fp8_linear(256, 256, 2)
    a.scale_fp32, b.scale_fp32 = torch.rand(1, 2), torch.rand(2, 2)
    fused = fuse_output_rows((a, b))
    assert torch.equal(fused.scale_fp32, torch.cat((a.scale_fp32, b.scale_fp32)))
    assert fused.w8a8_scale() is fused.scale_fp32
    c, d = _fp8_linear(256, 128, 3), _fp8_linear(256, 128, 4)
    c.scale_fp32 = torch.rand(1, 2)
    assert fuse_output_rows((c, d)).scale_fp32 is None
    assert fuse_output_rows((Linear(64, 32, torch.float32), Linear(64, 16, torch.float32))).scale_fp32 is None


def test_parts_that_cannot_share_a_gemm():
    assert fuse_output_rows((Linear(64, 32, torch.float32), Linear(48, 32, torch.float32))) is None
    assert fuse_output_rows((_fp8_linear(256, 64, 0), _fp8_linear(256, 128, 1))) is None  # 64 rows: half a block
    assert fuse_output_rows((Linear(256, 128, torch.float32), _fp8_linear(256, 128, 1))) is None


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [7, 70])  # W8A16 and (FP8_GEMM_ROWS <= 70) W8A8 on prepared scales
def test_fused_rows_on_gpu(rows):
    from deepinfer.layers.linear import prepare_fp8_linears
    for fp8 in (False, True):
        if fp8:
            a, b = _fp8_linear(4096, 1024, 1).cuda(), _fp8_linear(4096, 512, 2).cuda()
            prepare_fp8_linears(torch.nn.ModuleList([a, b]))
        else:
            a, b = Linear(4096, 1024, torch.bfloat16).cuda(), Linear(4096, 512, torch.bfloat16).cuda()
            a.weight.data.normal_(0, 0.02), b.weight.data.normal_(0, 0.02)
        x = torch.randn(rows, 4096, device="cuda").to(torch.bfloat16)
        want = torch.cat((a(x), b(x)), dim=1).float()
        torch.testing.assert_close(fuse_output_rows((a, b))(x).float(), want, atol=2e-2, rtol=2e-2)


def test_stacked_forward_runs_parts_alone_on_the_cpu():
    a, b = Linear(64, 32, torch.float32), Linear(64, 16, torch.float32)
    a.weight.data.normal_(), b.weight.data.normal_()
    owner = torch.nn.Module()
    x = torch.randn(3, 64)
    ya, yb = stacked_forward(owner, "_ab", (a, b), x, fp32=True)
    assert torch.equal(ya, a.forward_fp32(x)) and torch.equal(yb, b.forward_fp32(x)) and "_ab" not in owner.__dict__


@pytest.mark.gpu
def test_stacked_forward_on_gpu():
    a, b = Linear(4096, 1024, torch.bfloat16).cuda(), Linear(4096, 1024, torch.bfloat16).cuda()
    a.weight.data.normal_(0, 0.02), b.weight.data.normal_(0, 0.02)
    x = torch.randn(5, 4096, device="cuda").to(torch.bfloat16)
    want = (a.forward_fp32(x), b.forward_fp32(x))
    owner = torch.nn.Module()
    got = stacked_forward(owner, "_ab", (a, b), x, fp32=True)
    assert owner.__dict__["_ab"] is not False and "_ab" not in dict(owner.named_modules())
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)



# ---- FP8 linears: W8A8 (act_quant + FP8 GEMM) from FP8_GEMM_ROWS rows, W8A16 below and in invariant mode

def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _fp8_case(rows: int, i: int, o: int, block=(128, 128), seed=0):
    from deepinfer.formats.quant import dequant_fp8_blocks
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(o, i, generator=g) * 4).to(torch.float8_e4m3fn)
    s = torch.randint(117, 122, (-(-o // block[0]), -(-i // block[1])), generator=g, dtype=torch.uint8)
    x = torch.randn(rows, i, generator=g).to(torch.bfloat16)
    s = s.view(torch.float8_e8m0fnu)
    return x, w, s, F.linear(x.float(), dequant_fp8_blocks(w, s, block))


def test_fp8_gemm_rows_picks_w8a8_for_many_rows_outside_invariant_mode():
    from deepinfer.layers import invariant
    from deepinfer.layers.linear import FP8_GEMM_ROWS, fp8_gemm_rows
    assert fp8_gemm_rows(FP8_GEMM_ROWS, (128, 128)) and not fp8_gemm_rows(8192, (32, 32))  # V4.1's: W8A16
    assert not fp8_gemm_rows(FP8_GEMM_ROWS - 1, (128, 128))         # decode sizes: W8A16
    assert not fp8_gemm_rows(8192, (16, 48)) and not fp8_gemm_rows(8192, (1, 8))  # no e4m3 dot over K
    with invariant.mode(True):
        assert not fp8_gemm_rows(8192, (128, 128))                 # one path whatever the batch


def test_fp8_linear_is_act_quant_then_the_fp8_gemm():
    """On CPU tensors fp8_linear runs both references: the reference's W8A8 arithmetic, within
    e4m3's activation rounding of the exact product."""
    from deepinfer.kernels import act_quant, fp8_gemm
    from deepinfer.layers.linear import fp8_linear
    for block in ((128, 128), (32, 32)):
        x, w, s, exact = _fp8_case(37, 256, 96, block)
        got = fp8_linear(x, w, s, block)
        assert got.shape == (37, 96) and got.dtype == torch.bfloat16
        assert torch.equal(got, fp8_gemm.reference(*act_quant.reference(x, 128), w, s, 128, block))
        assert 1e-3 < _rel(got, exact) < 0.04


def test_fp8_grouped_projection_quantises_each_groups_input_alone():
    """forward_grouped's W8A8 form: one act_quant over [T, G * I] equals each group's own (no 1 x 128
    group straddles two groups' inputs), then one GEMM per group."""
    from deepinfer.layers.linear import fp8_linear, fp8_linear_grouped
    G, I, O, T = 4, 256, 128, 9
    _, w, s, _ = _fp8_case(0, I, G * O, seed=1)                     # G row blocks of [O, I]
    xg = torch.randn(T, G, I).to(torch.bfloat16)
    want = torch.cat([fp8_linear(xg[:, g].contiguous(), w[g * O:(g + 1) * O], s[g:(g + 1)], (128, 128))
                      for g in range(G)], dim=1)
    assert torch.equal(fp8_linear_grouped(xg, w, s, (128, 128)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("rows", [5, 300, 4096])
def test_fp8_linear_paths_on_gpu(block, rows):
    """From FP8_GEMM_ROWS rows (128-wide blocks) Linear.forward is W8A8 (the CPU's fp8_linear to bf16
    rounding: rel < 4e-3),
    below it W8A16 (the exact product to rel < 4e-3); invariant mode is W8A16 at every size, the same bits
    as grouped_gemm with GEMM_TILES."""
    from deepinfer.kernels.grouped_gemm import grouped_gemm
    from deepinfer.layers import invariant
    from deepinfer.layers.linear import fp8_gemm_rows, fp8_linear
    x, w, s, exact = _fp8_case(rows, 1024, 1536, block)
    lin = Linear(1024, 1536, torch.bfloat16, QuantSpec(block_size=block))
    lin.weight.copy_(w)
    lin.scale.copy_(s)
    lin.cuda()
    y = lin(x.cuda()[None])[0]
    assert y.shape == (rows, 1536) and y.dtype == torch.bfloat16
    if fp8_gemm_rows(rows, block):
        assert _rel(y.cpu(), fp8_linear(x, w, s, block)) < 4e-3
    else:
        assert _rel(y.cpu(), exact) < 4e-3
    with invariant.mode(True):
        yi = lin(x.cuda())
    assert torch.equal(yi, grouped_gemm(x.cuda(), lin.weight, None, lin.scale, block, **invariant.GEMM_TILES))
    assert _rel(yi.cpu(), exact) < 4e-3


def test_grouped_projection_keeps_w8a16_longer_and_prepare_is_a_no_op_off_the_gpu():
    """forward_grouped's W8A8 (one GEMM per group) starts at GROUPED_FP8_GEMM_ROWS, above Linear's threshold;
    prepare_fp8_linears widens scales on CUDA only (a CPU model keeps scale_fp32 None: W8A8 widens per call)."""
    from deepinfer.layers.linear import (FP8_GEMM_ROWS, GROUPED_FP8_GEMM_ROWS, fp8_gemm_rows, prepare_fp8_linears,
                                         w8a8_blocks)
    assert FP8_GEMM_ROWS < GROUPED_FP8_GEMM_ROWS
    assert fp8_gemm_rows(FP8_GEMM_ROWS, (128, 128)) and not fp8_gemm_rows(FP8_GEMM_ROWS, (128, 128),
                                                                          GROUPED_FP8_GEMM_ROWS)
    assert w8a8_blocks((128, 128)) and not w8a8_blocks((32, 32)) and not w8a8_blocks((128, 96))
    lin = Linear(256, 128, torch.bfloat16, QuantSpec(block_size=(128, 128)))
    model = torch.nn.Sequential(lin)
    prepare_fp8_linears(model)
    assert lin.scale_fp32 is None and lin.w8a8_scale() is lin.scale
    lin.scale_fp32 = torch.ones(1, 2)
    assert lin.w8a8_scale() is lin.scale_fp32
    assert "scale_fp32" not in lin.state_dict()                        # never saved or loaded


@pytest.mark.gpu
def test_prepared_scales_feed_w8a8_on_gpu():
    """prepare_fp8_linears widens a CUDA Linear's E8M0 scales once; W8A8 on them gives the same bits as on the
    E8M0 scales (widened per call)."""
    from deepinfer.formats.quant import scale_to_float
    from deepinfer.layers.linear import FP8_GEMM_ROWS, prepare_fp8_linears
    x, w, s, _ = _fp8_case(FP8_GEMM_ROWS + 3, 1024, 1536, (128, 128))
    lin = Linear(1024, 1536, torch.bfloat16, QuantSpec(block_size=(128, 128)))
    lin.weight.copy_(w)
    lin.scale.copy_(s)
    lin.cuda()
    before = lin(x.cuda())
    prepare_fp8_linears(torch.nn.Sequential(lin))
    assert lin.scale_fp32.dtype == torch.float32 and torch.equal(lin.scale_fp32, scale_to_float(lin.scale))
    assert torch.equal(lin(x.cuda()), before)


@pytest.mark.gpu
def test_fp8_grouped_projection_w8a8_on_gpu():
    from deepinfer.layers.linear import GROUPED_FP8_GEMM_ROWS, GROUPED_GEMM_ROWS, fp8_linear_grouped
    G, I, O = 8, 512, 256
    T = max(GROUPED_FP8_GEMM_ROWS, GROUPED_GEMM_ROWS) + 88
    lin = Linear(I, G * O, torch.bfloat16, QuantSpec(block_size=(128, 128)))
    lin.weight.copy_((torch.randn(G * O, I) * 4).to(torch.float8_e4m3fn))
    lin.scale.copy_(torch.randint(117, 122, lin.scale.shape, dtype=torch.uint8).view(lin.scale.dtype))
    x = torch.randn(T, G, I).to(torch.bfloat16)
    want = fp8_linear_grouped(x, lin.weight, lin.scale, (128, 128))
    lin.cuda()
    got = lin.forward_grouped(x.cuda())
    assert got.shape == (T, G * O) and _rel(got.cpu(), want) < 4e-3
