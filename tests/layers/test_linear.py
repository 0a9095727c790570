"""Linear helpers: stacked same-input projections (one GEMM for several weights)."""
import pytest
import torch

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


def test_parts_that_cannot_share_a_gemm():
    assert fuse_output_rows((Linear(64, 32, torch.float32), Linear(48, 32, torch.float32))) is None
    assert fuse_output_rows((_fp8_linear(256, 64, 0), _fp8_linear(256, 128, 1))) is None  # 64 rows: half a block
    assert fuse_output_rows((Linear(256, 128, torch.float32), _fp8_linear(256, 128, 1))) is None


@pytest.mark.gpu
def test_fused_rows_on_gpu():
    for fp8 in (False, True):
        if fp8:
            a, b = _fp8_linear(4096, 1024, 1).cuda(), _fp8_linear(4096, 512, 2).cuda()
        else:
            a, b = Linear(4096, 1024, torch.bfloat16).cuda(), Linear(4096, 512, torch.bfloat16).cuda()
            a.weight.data.normal_(0, 0.02), b.weight.data.normal_(0, 0.02)
        x = torch.randn(7, 4096, device="cuda").to(torch.bfloat16)
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

