"""Indexer top-k by counting ranks: the same ids as the stable descending sort."""
import pytest
import torch

from deepinfer.kernels.index_topk import index_topk, reference
from deepinfer.layers.attention import Indexer
from interpreter import SHIMS, interpreted_and_gpu, run_interpreted


def case(T: int, N: int, seed: int = 0, device: str = "cpu"):
    """Scores with many ties (rounded to a coarse grid), some -inf, visible counts 0..N."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(T, N, generator=g) * 2).round() / 2
    s[torch.rand(T, N, generator=g) < 0.1] = float("-inf")
    visible = torch.randint(0, N + 1, (T,), generator=g)
    return s.to(device), visible.to(device)


def test_reference_orders_by_score_then_lowest_id():
    inf = float("-inf")
    s = torch.tensor([[1.0, 3.0, 3.0, inf, 2.0, 5.0], [0.5, 0.5, 0.5, 0.5, 9.0, 9.0]])
    visible = torch.tensor([6, 3])  # row 1: entries 3.. are not visible
    assert reference(s, visible, 4).tolist() == [[5, 1, 2, 4], [0, 1, 2, -1]]
    assert Indexer._top(s, visible, 4).tolist() == [[5, 1, 2, 4], [0, 1, 2, -1]]  # the Indexer's selection
    assert torch.equal(index_topk(s, visible, 2), reference(s, visible, 2))  # CPU: the reference


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        SHIMS +
        "import torch\n"
        "from deepinfer.kernels.index_topk import _launch, reference\n"
        "from test_index_topk import case\n"
        "for T, N, k in [(1, 5, 3), (4, 70, 70), (6, 130, 9), (3, 64, 1)]:\n"
        "    s, vis = case(T, N, seed=N)\n"
        "    vis[0] = N\n"
        "    got, want = _launch(s, vis, k), reference(s, vis, k)\n"
        "    assert torch.equal(got, want), (T, N, k, got, want)\n"
        "print('ok')\n")
    run_interpreted(code)


@pytest.mark.gpu
@pytest.mark.parametrize("T,N,k", [(1, 64, 64), (1, 512, 512), (64, 600, 512), (37, 1000, 7), (200, 33, 16)])
def test_kernel_matches_reference_on_gpu(T, N, k):
    s, visible = case(T, N, seed=T, device="cuda")
    assert torch.equal(index_topk(s, visible, k), reference(s, visible, k))


def masked_case(T: int, N: int, seed: int = 0, device: str = "cpu"):
    """`case` plus signed zeros (equal scores: a tie) and an allowed mask."""
    s, visible = case(T, N, seed)
    g = torch.Generator().manual_seed(seed + 1)
    s[torch.rand(T, N, generator=g) < 0.2] = -0.0
    s[torch.rand(T, N, generator=g) < 0.2] = 0.0
    allowed = torch.rand(T, N, generator=g) < 0.7
    return s.to(device), visible.to(device), allowed.to(device)


def test_reference_with_allowed_masks_before_selecting():
    inf = float("-inf")
    s = torch.tensor([[1.0, 3.0, 3.0, inf, 2.0, 5.0], [-0.0, 0.0, -0.0, 0.5, 9.0, 9.0]])
    allowed = torch.tensor([[True, True, False, True, True, False], [True] * 6])
    assert reference(s, torch.tensor([6, 4]), 4, allowed).tolist() == [[1, 4, 0, -1], [3, 0, 1, 2]]


MASKED_CHECK = """
import torch
from deepinfer.kernels.index_topk import _launch, _launch_long, index_topk, reference
from test_index_topk import masked_case
for T, N, k in CASES:
    s, vis, allowed = masked_case(T, N, seed=N, device=DEVICE)
    vis[0] = N
    for a in (None, allowed):
        want = reference(s, vis, k, a)
        assert torch.equal(_launch_long(s, vis, k, a), want), (T, N, k)
        if N <= 1024 and T * N * N <= 1 << 24:
            assert torch.equal(_launch(s, vis, k, a), want), (T, N, k)
        assert torch.equal(index_topk(s, vis, k, a), want), (T, N, k)
print('ok')
"""
_CPU_CASES = [(1, 5, 3), (4, 70, 70), (6, 1300, 9), (3, 64, 1), (5, 2100, 700)]
_GPU_CASES = [(1, 4096, 512), (64, 600, 512), (200, 33, 16), (3, 70000, 2048), (8, 1025, 1025)]
test_long_rows_and_masks_in_the_triton_interpreter, test_long_rows_and_masks_on_gpu = interpreted_and_gpu(
    MASKED_CHECK, f"DEVICE = 'cpu'\nCASES = {_CPU_CASES}\n", f"DEVICE = 'cuda'\nCASES = {_GPU_CASES}\n")
