"""The fused MoE router: the experts of the torch form (ties to the lowest index) and its weights."""
import pytest
import torch

from deepinfer.kernels.router import reference, route
from interpreter import run_interpreted


def stable_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k ids, best first, equal values in ascending id order (the kernel's tie rule)."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :k]


def make(T: int, E: int, k: int, vocab: int = 50, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 4
    logits[0, :3] = torch.tensor([25.0, -30.0, 0.0])  # both softplus branches and log1p's tiny range
    bias = torch.randn(E, generator=g) * 0.1
    bias_vl = torch.randn(E, generator=g) * 0.1
    ids = torch.randint(0, vocab, (T,), generator=g)
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)])
    image = torch.rand(T, generator=g) < 0.5
    return [t.to(device) for t in (logits, bias, bias_vl, ids, table, image)]


def check(logits, bias, bias_vl, ids, table, image, k, launch):
    # hash routing: the table's ids, weights as the reference's
    w, idx = launch(logits, k, 2.5, ids, table)
    rw, ridx = reference(logits, k, 2.5, ids, table)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)
    # top-k, with and without image tokens (bias_vl); experts 5 and 9 tie at the top of row 1
    logits, bias, bias_vl = logits.clone(), bias.clone(), bias_vl.clone()
    tie = logits.shape[0] > 1
    if tie:
        logits[1, 5] = logits[1, 9] = 30.0
        bias[5], bias_vl[5] = bias[9], bias_vl[9]
    for img in (None, image):
        w, idx = launch(logits, k, 2.5, bias=bias, bias_vl=bias_vl, image_mask=img)
        b = bias if img is None else torch.where(img[:, None], bias_vl, bias)
        s = torch.nn.functional.softplus(logits.float()).sqrt()
        want = stable_topk(s + b, k)
        assert torch.equal(idx, want) and (not tie or want[1, :2].tolist() == [5, 9])
        g = s.gather(1, want)
        torch.testing.assert_close(w, g / g.sum(-1, keepdim=True) * 2.5, atol=1e-6, rtol=1e-5)


def test_cpu_falls_back_to_the_reference():
    logits, bias, bias_vl, ids, table, image = make(7, 16, 4)
    w, idx = route(logits, 4, 2.5, bias=bias)
    rw, ridx = reference(logits, 4, 2.5, bias=bias)
    assert torch.equal(w, rw) and torch.equal(idx, ridx)


def test_kernel_in_the_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(
        "import torch\n"
        "from deepinfer.kernels.router import _launch\n"
        "from test_router import make, check\n"
        "for T, E, k in [(5, 16, 4), (3, 40, 6), (2, 256, 8)]:\n"
        "    check(*make(T, E, k), k, _launch)\n"
        "print('ok')\n")


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k", [(1, 256, 6), (64, 256, 6), (1000, 256, 6), (7, 384, 8), (3, 40, 6)])
def test_kernel_on_gpu(T, E, k):
    check(*make(T, E, k, device="cuda"), k, route)
