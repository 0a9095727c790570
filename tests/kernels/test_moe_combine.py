import pytest
import torch

from deepinfer.kernels.moe_combine import inverse_permutation, moe_combine, reference
from interpreter import interpreted_and_gpu, run_interpreted



def _inputs(T: int, k: int, D: int, E: int, device: str):
    """Expert-sorted y [T*k, D] bf16, the sort order and routing weights [T, k] fp32, as Experts.grouped has them."""
    g = torch.Generator(device="cpu").manual_seed(T * 131 + k * 7 + D)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    order = torch.argsort(idx.flatten(), stable=True)
    y = torch.randn(T * k, D, generator=g).to(torch.bfloat16)
    weights = torch.rand(T, k, generator=g) + 0.01
    weights = weights / weights.sum(-1, keepdim=True)  # as the router's (up to route_scale)
    return y.to(device), order.to(device), weights.to(device)


def _index_add(y, order, weights, k):
    """The former Experts.grouped formulation (sums in expert order)."""
    tok = order // k
    out = torch.zeros(weights.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    return out.index_add_(0, tok, y.float() * weights.flatten()[order, None])


def test_inverse_permutation():
    order = torch.randperm(50)
    inv = inverse_permutation(order)
    assert torch.equal(inv[order], torch.arange(50)) and torch.equal(order[inv], torch.arange(50))


@pytest.mark.parametrize("T,k,D", [(1, 6, 80), (37, 6, 80), (37, 1, 64), (16, 6, 4096)])
def test_reference_matches_the_index_add_formulation(T, k, D):
    y, order, weights = _inputs(T, k, D, 16, "cpu")
    torch.testing.assert_close(reference(y, order, weights, k), _index_add(y, order, weights, k),
                               atol=1e-6, rtol=1e-6)
    assert torch.equal(moe_combine(y, order, weights, k), reference(y, order, weights, k))  # cpu: reference


ROWS_CHECK = (
    "import torch\n"
    "from deepinfer.kernels.moe_combine import _launch, inverse_permutation, moe_combine\n"
    "from test_moe_combine import _inputs\n"
    "y, order, weights = _inputs(37, 6, 80, 16, DEV)\n"
    "inv = inverse_permutation(order)\n"  # token 0's rows in slot order: pair j sits at sorted row inv[j]
    "want = torch.zeros(80, device=DEV)\n"  # the documented sum: rounded products added in slot order
    "for j in range(6):\n"
    "    want = want + y[inv[j]].float() * weights[0, j]\n"
    "alone = (y[inv[:6]], torch.arange(6, device=DEV), weights[:1], 6)\n"
    "for run in (_launch, moe_combine):\n"  # the kernel; the dispatch (CPU: the reference)
    "    assert torch.equal(run(y, order, weights, 6)[0], want), run\n"
    "    assert torch.equal(run(*alone)[0], want), run\n"
    "print('ok')\n")

# Token 0's row depends only on its own k outputs and weights, not on the batch's sort order
test_rows_are_independent_of_the_other_tokens_routing_in_the_triton_interpreter, \
    test_rows_are_independent_of_the_other_tokens_routing_on_gpu = interpreted_and_gpu(
        ROWS_CHECK, "DEV = 'cpu'\n", "DEV = 'cuda'\n")


@pytest.mark.gpu
@pytest.mark.parametrize("T,k,D", [(1, 6, 4096), (37, 6, 4096), (37, 6, 80), (1, 1, 80), (37, 1, 4096),
                                   (300, 6, 1000), (8192, 6, 4096)])
def test_kernel_matches_reference_exactly_on_gpu(T, k, D):
    y, order, weights = _inputs(T, k, D, 64, "cuda")
    got, want = moe_combine(y, order, weights, k), reference(y, order, weights, k)
    assert got.shape == (T, D) and got.dtype == torch.float32
    assert torch.equal(got, want)
    torch.testing.assert_close(got, _index_add(y, order, weights, k), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(1, 4096), (37, 4096), (300, 1000)])
def test_kernel_adds_the_shared_output_on_gpu(T, D):
    """With `add` and a bf16 output: the MoE layer's (sum + float(shared)).to(bf16), bit for bit."""
    y, order, weights = _inputs(T, 6, D, 64, "cuda")
    add = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    inv = inverse_permutation(order)
    got = moe_combine(y, order, weights, 6, inv, add, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (reference(y, order, weights, 6) + add.float()).to(torch.bfloat16))


@pytest.mark.gpu
def test_kernel_under_cuda_graph_capture():
    y, order, weights = _inputs(64, 6, 4096, 64, "cuda")
    moe_combine(y, order, weights, 6)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_combine(y, order, weights, 6)
    y2, order2, weights2 = _inputs(64, 6, 4096, 32, "cuda")
    y.copy_(y2), order.copy_(order2), weights.copy_(weights2)
    graph.replay()
    assert torch.equal(out, reference(y, order, weights, 6))


# moe_align's shared slot: inv holds k + 1 rows a token; the first k are summed with their weights and the shared
# expert's rows (the last T of y) come last as `add`: the same sum as k routed slots plus the shared output
SHARED_SLOT_CHECK = (
    "    from deepinfer.kernels.moe_align import reference as align\n"
    "    from deepinfer.kernels.moe_combine import _launch\n"
    "    E = 8\n"
    "    order, tok, offs, inv = align(idx, E + 1, shared_slot=True)\n"
    "    ys = (torch.randn(T * (k + 1), D, generator=g) * 3).to(torch.bfloat16)\n"
    "    assert torch.equal(tok[T * k:], torch.arange(T))\n"
    "    got = _launch(ys, order, w, k, inv, ys[T * k:], torch.float32, inv_stride=k + 1)\n"
    "    rows = inv.view(T, k + 1)\n"
    "    want = sum(ys[rows[:, j]].float() * w[:, j, None] for j in range(k)) + ys[T * k:].float()\n"
    "    assert torch.equal(got, want), (T, k, D)\n"
    "    assert torch.equal(got, reference(ys, order, w, k, inv, ys[T * k:], inv_stride=k + 1))\n")


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch, triton\n"
        "from deepinfer.kernels.moe_combine import _combine_kernel, inverse_permutation, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for T, k, D in ((5, 3, 40), (4, 1, 16)):\n"
        "    idx = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(T)])\n"
        "    order = torch.argsort(idx.flatten(), stable=True)\n"
        "    y = (torch.randn(T * k, D, generator=g) * 3).to(torch.bfloat16)\n"
        "    w = torch.rand(T, k, generator=g)\n"
        "    out = torch.empty(T, D)\n"
        "    _combine_kernel[(T, triton.cdiv(D, 16))](y, inverse_permutation(order), w, y, out, D, D, 0, K=k,\n"
        "                                             BLOCK_D=16, HAS_ADD=False, INV_STRIDE=k, enable_fp_fusion=False)\n"
        "    assert torch.equal(out, reference(y, order, w, k)), (T, k, D)\n"
        "    add = (torch.randn(T, D + 3, generator=g) * 2).to(torch.bfloat16)[:, :D]\n"  # strided rows
        # fp32 output: the interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest
        # even), so the bf16 output is checked bit for bit on the GPU only
        "    out = torch.empty(T, D)\n"
        "    _combine_kernel[(T, triton.cdiv(D, 16))](y, inverse_permutation(order), w, add, out, D, D, D + 3, K=k,\n"
        "                                             BLOCK_D=16, HAS_ADD=True, INV_STRIDE=k, enable_fp_fusion=False)\n"
        "    assert torch.equal(out, reference(y, order, w, k, add=add)), (T, k, D)\n"
        "    assert torch.equal(reference(y, order, w, k, add=add, out_dtype=torch.bfloat16),\n"
        "                       (reference(y, order, w, k) + add.float()).to(torch.bfloat16))\n" +
        SHARED_SLOT_CHECK +
        "print('ok')\n")
    run_interpreted(code)
