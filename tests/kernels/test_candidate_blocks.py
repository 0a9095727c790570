"""CSA2 candidate blocks: the kernel path gives the reference's (the stable sort's) booleans."""
import pytest
import torch

from deepinfer.kernels.candidate_blocks import candidate_blocks, reference
from interpreter import SHIMS, run_interpreted


def case(T: int, W: int, seed: int = 0, device: str = "cpu"):
    """Indexer-like scores on a coarse grid (many equal block maxima), -inf past each token's
    visible count (0 .. W), signed zeros."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(T, W, generator=g) * 2).round() / 2
    s[torch.rand(T, W, generator=g) < 0.2] = -0.0
    visible = torch.randint(0, W + 1, (T,), generator=g)
    visible[0], visible[-1] = 0, W
    s = s.masked_fill(torch.arange(W) >= visible[:, None], float("-inf"))
    return s.to(device), visible.to(device)


def test_reference_keeps_the_best_blocks_and_the_newest():
    inf = float("-inf")
    s = torch.tensor([[5.0, 1.0, 2.0, 2.0, 0.0, 7.0, 1.0, inf],
                      [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, inf, inf]])
    visible = torch.tensor([7, 6])
    # row 0: block maxima 5, 2, 7, 1(newest -> kept); top 2 = newest + block 2
    # row 1: maxima 1, 1, 1(newest); top 2 = newest + block 0 (tie -> lowest block)
    got = reference(s, visible, 2, 2)
    assert got.int().tolist() == [[0, 0, 0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 1, 1, 0, 0]]
    assert torch.equal(candidate_blocks(s, visible, 2, 2), got)  # CPU: the reference


CHECK = """
import torch
from deepinfer.kernels.candidate_blocks import _launch, reference
from test_candidate_blocks import case
for T, W, k, block in CASES:
    s, vis = case(T, W, seed=W + k, device=DEVICE)
    assert torch.equal(_launch(s, vis, k, block), reference(s, vis, k, block)), (T, W, k, block)
print('ok')
"""


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    cases = [(3, 5, 1, 2), (9, 200, 4, 8), (9, 200, 40, 8), (5, 301, 7, 3), (4, 2000, 30, 8), (2, 64, 2, 1)]
    run_interpreted(SHIMS + f"DEVICE = 'cpu'\nCASES = {cases}\n" + CHECK)


@pytest.mark.gpu
def test_kernel_matches_reference_on_gpu():
    cases = [(1, 4096, 2048, 8), (64, 4096, 100, 8), (64, 70000, 2048, 8), (300, 1000, 16, 8), (7, 513, 5, 3)]
    run_interpreted(f"DEVICE = 'cuda'\nCASES = {cases}\n" + CHECK, interpret=False)
