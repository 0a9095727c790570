"""MoE alignment kernel: the same integers as the stable-argsort reference."""
import pytest
import torch

from deepinfer.kernels.moe_align import moe_align, reference
from interpreter import SHIMS, run_interpreted


def test_reference_sorts_pairs_stably_by_expert():
    idx = torch.tensor([[3, 1], [1, 0], [3, 3]])
    order, tok, offs, inv = reference(idx, 5)
    assert order.tolist() == [3, 1, 2, 0, 4, 5]
    assert tok.tolist() == [1, 0, 1, 0, 2, 2]
    assert offs.tolist() == [1, 3, 3, 6, 6] and offs.dtype == torch.int32
    assert inv.tolist() == [3, 1, 2, 0, 4, 5] and torch.equal(order[inv], torch.arange(6))
    assert all(torch.equal(a, b) for a, b in zip(moe_align(idx, 5), (order, tok, offs, inv)))  # CPU: the reference


def test_shared_slot_routes_every_token_to_the_last_expert_once():
    idx = torch.tensor([[3, 1], [1, 0], [3, 3]])
    order, tok, offs, inv = reference(idx, 5, shared_slot=True)
    full = reference(torch.tensor([[3, 1, 4], [1, 0, 4], [3, 3, 4]]), 5)
    assert all(torch.equal(a, b) for a, b in zip((order, tok, offs, inv), full))
    assert offs.tolist() == [1, 3, 3, 6, 9] and tok[6:].tolist() == [0, 1, 2]  # the shared rows last, token order


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        SHIMS +
        "import torch\n"
        "from deepinfer.kernels.moe_align import _launch, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for T, k, E in [(1, 6, 256), (3, 2, 5), (70, 6, 16), (30, 8, 300)]:\n"
        "    idx = torch.randint(0, E, (T, k), generator=g)\n"
        "    for got, want in zip(_launch(idx, E), reference(idx, E)):\n"
        "        assert got.dtype == want.dtype and torch.equal(got, want), (T, k, E)\n"
        "    for got, want in zip(_launch(idx, E + 1, shared_slot=True), reference(idx, E + 1, shared_slot=True)):\n"
        "        assert got.dtype == want.dtype and torch.equal(got, want), ('shared', T, k, E)\n"
        "print('ok')\n")
    run_interpreted(code)


@pytest.mark.gpu
@pytest.mark.parametrize("T,k,E", [(1, 6, 256), (64, 6, 256), (128, 6, 256), (682, 6, 256), (37, 2, 7)])
def test_kernel_matches_reference_on_gpu(T, k, E):
    g = torch.Generator(device="cuda").manual_seed(T)
    idx = torch.randint(0, E, (T, k), generator=g, device="cuda")
    idx[: T // 2, 0] = 3  # many ties
    for shared in (False, True):
        got, want = moe_align(idx, E, shared_slot=shared), reference(idx, E, shared_slot=shared)
        assert len(got) == len(want) == 4
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
