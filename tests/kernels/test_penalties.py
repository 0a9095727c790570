"""The penalties (repetition, frequency, presence) on logits rows in place: the torch reference against the
formula read entry by entry, and the Triton kernel against the reference bit for bit (interpreter; a GPU twin)."""
import pytest
import torch

from deepinfer.kernels.penalties import apply_penalties
from interpreter import interpreted_and_gpu


def _case(P=3, R=5, S=4, V=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g) * 3
    logits[:, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])  # signs and zeros at the x > 0 branch
    counts = torch.randint(0, 3, (S, V), generator=g, dtype=torch.int32) * torch.randint(0, 2, (S, V), generator=g,
                                                                                         dtype=torch.int32)
    prompt = torch.randint(0, 2, (S, V), generator=g, dtype=torch.uint8)
    rows = torch.randperm(R, generator=g)[:P]
    slots = torch.randint(0, S, (P,), generator=g)
    rep = torch.rand(P, generator=g) * 1.9 + 0.05
    freq = torch.rand(P, generator=g) * 4 - 2
    pres = torch.rand(P, generator=g) * 4 - 2
    return logits, rows, slots, counts, prompt, rep, freq, pres


def test_reference_is_the_formula_entry_by_entry():
    logits, rows, slots, counts, prompt, rep, freq, pres = _case()
    want = logits.clone()
    for p in range(rows.shape[0]):
        r, s = int(rows[p]), int(slots[p])
        for v in range(logits.shape[1]):
            x, c = want[r, v].clone(), float(counts[s, v])
            if prompt[s, v] or c > 0:
                x = x / rep[p] if x > 0 else x * rep[p]
            x = x - freq[p] * c
            want[r, v] = x - pres[p] * (1.0 if c > 0 else 0.0)
    got = logits.clone()
    apply_penalties(got, rows, slots, counts, prompt, rep, freq, pres)  # the CPU path is the reference
    assert torch.equal(got, want)
    untouched = [r for r in range(logits.shape[0]) if r not in rows.tolist()]
    assert torch.equal(got[untouched], logits[untouched])


def test_bad_arguments_name_themselves():
    logits, rows, slots, counts, prompt, rep, freq, pres = _case()
    with pytest.raises(ValueError, match="logits"):
        apply_penalties(logits.double(), rows, slots, counts, prompt, rep, freq, pres)
    with pytest.raises(ValueError, match="counts"):
        apply_penalties(logits, rows, slots, counts.long(), prompt, rep, freq, pres)
    with pytest.raises(ValueError, match="prompt"):
        apply_penalties(logits, rows, slots, counts, prompt.bool(), rep, freq, pres)
    with pytest.raises(ValueError, match="freq"):
        apply_penalties(logits, rows, slots, counts, prompt, rep, freq[:1], pres)


CHECK = (
    "import torch\n"
    "from test_penalties import _case\n"
    "from deepinfer.kernels import penalties\n"
    "from deepinfer.kernels.penalties import apply_penalties, reference\n"
    "launch = apply_penalties if DEV == 'cuda' else penalties._launch\n"
    "for P, R, S, V, seed in [(3, 5, 4, 70, 0), (8, 8, 8, 2500, 1), (1, 2, 1, 1024, 2), (0, 2, 1, 64, 3)]:\n"
    "    args = _case(P, R, S, V, seed)\n"
    "    want = args[0].clone()\n"
    "    reference(want, *args[1:])\n"
    "    wide = torch.zeros(R, V + 7)\n"  # strided rows: nothing past column V may be written
    "    wide[:, :V] = args[0]\n"
    "    dev = wide.to(DEV)\n"
    "    launch(dev[:, :V], *(t.to(DEV) for t in args[1:]))\n"
    "    assert torch.equal(dev[:, :V].cpu(), want), (P, V, (dev[:, :V].cpu() != want).sum())\n"
    "    assert not dev[:, V:].any(), 'wrote past column V'\n"
    "print('ok')\n")

test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(CHECK, "DEV = 'cpu'\n",
                                                                                "DEV = 'cuda'\n")
