"""Row copies for one or two tensor pairs under one index plan: the gather + index_put results."""
import torch

from deepinfer.kernels.copy_rows import copy_rows
from interpreter import interpreted_and_gpu

CHECK = (
    "import torch\n"
    "from deepinfer.kernels.copy_rows import copy_rows, _launch, reference\n"
    "g = torch.Generator().manual_seed(0)\n"
    "for R, widths, dtype in [(5, (48, 80), torch.float32), (1, (1024, 1024), torch.float32),\n"
    "                         (37, (512, 600), torch.bfloat16), (0, (16, 16), torch.float32),\n"
    "                         (9, (512,), torch.bfloat16), (3, (700,), torch.float32)]:\n"
    "    pairs, want = [], []\n"
    "    for w in widths:\n"
    "        dst = torch.randn(50, w, generator=g).to(dtype)\n"
    "        src = torch.randn(60, w + 7, generator=g).to(dtype)[:, :w]\n"  # strided rows
    "        pairs.append((dst.to(DEV), src.to(DEV)))\n"
    "        want.append((dst.clone(), src.clone()))\n"
    "    dst_idx = torch.randperm(50, generator=g)[:R].to(DEV)\n"
    "    src_idx = torch.randint(0, 60, (R,), generator=g).to(DEV)\n"
    "    reference(want, dst_idx.cpu(), src_idx.cpu())\n"
    "    (copy_rows if DEV == 'cuda' else _launch)(tuple(pairs), dst_idx, src_idx)\n"
    "    for (d, _), (w, _) in zip(pairs, want):\n"
    "        assert torch.equal(d.cpu(), w), (R, widths)\n"
    "print('ok')\n")


def test_cpu_uses_the_reference():
    a, b = torch.zeros(4, 3), torch.zeros(4, 5)
    sa, sb = torch.randn(6, 3), torch.randn(6, 5)
    copy_rows(((a, sa), (b, sb)), torch.tensor([2, 0]), torch.tensor([5, 1]))
    assert torch.equal(a[2], sa[5]) and torch.equal(b[0], sb[1]) and a[1].abs().sum() == 0


test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(CHECK, "DEV = 'cpu'\n",
                                                                                "DEV = 'cuda'\n")


def test_ring_write_from_matches_write_of_the_gathered_rows():
    from deepinfer.state.kv_state import EntryStore, FormatStore
    g = torch.Generator().manual_seed(1)
    x, rows, src = torch.randn(6, 64, generator=g), torch.tensor([7, 2, 4]), torch.tensor([5, 0, 3])
    for make in (lambda: EntryStore(10, 64, 16, "float32", "cpu"), lambda: EntryStore(10, 64, 16, "fp8", "cpu"),
                 lambda: FormatStore(10, 64, "bfloat16", "cpu")):
        a, b = make(), make()
        a.write_from(rows, x, src)
        b.write(rows, x[src])
        assert all(torch.equal(u, v) for u, v in zip(a.tensors(), b.tensors()))
