"""Token bitmask applied to logits in place: -inf where the row's bit is 0, ids past 32 * W masked."""
import pytest
import torch

from deepinfer.kernels.token_bitmask import apply_token_bitmask, reference
from interpreter import interpreted_and_gpu


def _by_hand(logits, bitmask, rows):
    out = logits.clone()
    for r in range(logits.shape[0]):
        m = bitmask[r if rows is None else int(rows[r])]
        for v in range(logits.shape[1]):
            if v >= 32 * m.shape[0] or not (int(m[v // 32]) >> (v % 32)) & 1:
                out[r, v] = float("-inf")
    return out


@pytest.mark.parametrize("V, W, rows", [(70, 3, None), (70, 2, None), (64, 2, [2, 0, 2]), (5, 1, [1, 1, 0])])
def test_reference_matches_the_bits_read_by_hand(V, W, rows):
    g = torch.Generator().manual_seed(V + W)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, W), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -1  # all 32 bits, bit 31 included
    bitmask[1, -1] = 0
    rows = None if rows is None else torch.tensor(rows)
    logits = torch.randn(3, V, generator=g)
    want = _by_hand(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)  # the CPU path is the reference
    assert torch.equal(logits, want)
    assert not torch.isinf(logits).all()


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask(torch.zeros(2, 40), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(torch.zeros(2, 40), torch.zeros(4, 2, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="bitmask has 1 rows"):
        apply_token_bitmask(torch.zeros(2, 40), torch.zeros(1, 2, dtype=torch.int32))


CHECK = (
    "import importlib.util, pathlib, tempfile, torch\n"
    "from deepinfer.kernels import token_bitmask\n"
    "from deepinfer.kernels.token_bitmask import apply_token_bitmask, reference\n"
    "def check(launch):\n"
    "    g = torch.Generator().manual_seed(0)\n"
    "    for R, V, W, n_masks, indirect, dtype in [(3, 1000, 32, 3, False, torch.float32), (4, 1000, 32, 7, True, torch.float32),\n"
    "            (5, 129, 5, 5, False, torch.bfloat16), (2, 2049, 40, 6, True, torch.bfloat16), (1, 31, 1, 1, False, torch.float32),\n"
    "            (3, 4096, 128, 3, False, torch.float32), (0, 64, 2, 1, False, torch.float32)]:\n"
    "        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (n_masks, W), generator=g, dtype=torch.int64).to(torch.int32)\n"
    "        if n_masks > 1:\n"
    "            bitmask[0] = -1\n"
    "            bitmask[1] = 0\n"
    "        rows = torch.randint(0, n_masks, (R,), generator=g) if indirect else None\n"
    "        big = torch.randn(R, V + 9, generator=g).to(dtype)\n"
    "        want = big[:, :V].clone()\n"
    "        reference(want, bitmask, rows)\n"
    "        dev = big.to(DEV, copy=True)\n"  # a copy on the CPU too: big keeps the values before the launch
    "        launch(dev[:, :V], bitmask.to(DEV), None if rows is None else rows.to(DEV))\n"  # strided rows
    "        assert torch.equal(dev[:, :V].cpu(), want), (R, V, W, indirect)\n"
    "        assert torch.equal(dev[:, V:].cpu(), big[:, V:]), ('wrote past column V', R, V, W, indirect)\n"
    "check(apply_token_bitmask if DEV == 'cuda' else token_bitmask._launch)\n"
    "if DEV == 'cpu':\n"  # the check must see a kernel that ignores the column bound (a row's tail is past V)
    "    src = pathlib.Path(token_bitmask.__file__).read_text()\n"
    "    old = 'mask=(cols < V) & (bit == 0)'\n"
    "    assert old in src\n"
    "    path = pathlib.Path(tempfile.mkdtemp()) / 'token_bitmask_mutant.py'\n"
    "    path.write_text(src.replace(old, 'mask=(cols < V + 9) & (bit == 0)'))\n"
    "    spec = importlib.util.spec_from_file_location('token_bitmask_mutant', path)\n"
    "    mutant = importlib.util.module_from_spec(spec)\n"
    "    spec.loader.exec_module(mutant)\n"
    "    try:\n"
    "        check(mutant._launch)\n"
    "    except AssertionError as e:\n"
    "        assert 'wrote past column V' in str(e), e\n"
    "    else:\n"
    "        raise SystemExit('a kernel writing past column V passed the check')\n"
    "print('ok')\n")

test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(CHECK, "DEV = 'cpu'\n",
                                                                                "DEV = 'cuda'\n")


@pytest.mark.gpu
def test_kernel_in_a_cuda_graph_reads_the_mask_at_replay():
    logits = torch.zeros(4, 129280, device="cuda")
    bitmask = torch.zeros(8, 4040, dtype=torch.int32, device="cuda")
    rows = torch.tensor([3, 0, 7, 3], device="cuda")
    apply_token_bitmask(logits.clone(), bitmask, rows)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_token_bitmask(logits, bitmask, rows)
    host = torch.randint(-2 ** 31, 2 ** 31 - 1, (8, 4040), dtype=torch.int64).to(torch.int32)
    bitmask.copy_(host)
    logits.zero_()
    graph.replay()
    want = torch.zeros(4, 129280)
    reference(want, host, rows.cpu())
    assert torch.equal(logits.cpu(), want)


def test_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    from sm90 import compile_sm90, record

    from deepinfer.kernels import token_bitmask
    with record() as launches:
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (None, torch.zeros(64, dtype=torch.int64)):  # V4's vocab, 64 decode rows
                token_bitmask._launch(torch.empty(64, 129280, dtype=dtype), torch.zeros(64, 4040, dtype=torch.int32), rows)
    assert len(launches) == 4
    for launch in launches:
        compile_sm90(launch)
