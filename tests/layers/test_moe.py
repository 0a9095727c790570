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


