import pytest
import torch

from deepinfer.layers.moe import Experts


@pytest.mark.gpu
def test_grouped_gemm_path_matches_the_reference_loop():
    torch.manual_seed(0)
    with torch.device("cuda"):
        ex = Experts(dim=256, inter=128, num_experts=16, limit=10.0, dtype=torch.bfloat16)
        for w in (ex.w1, ex.w2, ex.w3):
            w.data.normal_(0, 0.05)
        x = torch.randn(37, 256, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(16)[:4] for _ in range(37)]).cuda()  # expert 15 may get no token
        weights = torch.rand(37, 4)
    fast = ex(x, weights, idx)  # bf16 on cuda: the grouped GEMM path
    cpu = Experts(dim=256, inter=128, num_experts=16, limit=10.0, dtype=torch.float32)
    for name in ("w1", "w2", "w3"):
        getattr(cpu, name).data.copy_(getattr(ex, name).float().cpu())
    ref = cpu(x.float().cpu(), weights.cpu(), idx.cpu())  # fp32 on the cpu: the reference loop
    torch.testing.assert_close(fast.cpu(), ref, atol=3e-2, rtol=3e-2)


def test_fp4_experts_repacked_as_fp8_keep_every_value():
    """e2m1 -> e4m3 with the same E8M0 scale per 32 inputs is exact: the reference loop gives the same bits."""
    from deepinfer.layers.linear import QuantSpec

    torch.manual_seed(0)
    ex = Experts(dim=64, inter=32, num_experts=4, limit=10.0, dtype=torch.float32,
                 quant=QuantSpec(block_size=(128, 128), fp4_experts=True))
    for name in ("w1", "w2", "w3"):
        getattr(ex, name).copy_(torch.randint(-128, 127, getattr(ex, name).shape, dtype=torch.int8))
        getattr(ex, f"{name}_scale").view(torch.uint8).copy_(
            torch.randint(115, 130, getattr(ex, f"{name}_scale").shape, dtype=torch.uint8))
    x, weights = torch.randn(9, 64), torch.rand(9, 2)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    before = ex(x, weights, idx)
    dense = [ex._w("w1", e, torch.float32) for e in range(4)]
    ex.repack_fp4_as_fp8()
    assert ex.w1.dtype == torch.float8_e4m3fn and ex.w1.shape == (4, 32, 64)
    assert all(torch.equal(ex._w("w1", e, torch.float32), dense[e]) for e in range(4))
    assert torch.equal(ex(x, weights, idx), before)
