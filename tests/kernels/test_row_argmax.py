"""Row argmax: the same indices as torch.argmax(-1) -- random rows, ties across lanes, slices and steps,
NaN rows, -inf rows, strided inputs, bf16 / fp16, every split shape."""
import pytest
import torch

from deepinfer.kernels import row_argmax as ra
from interpreter import interpreted_and_gpu

# Interpreter cost grows with R * cdiv(V, block_v) (one step of one program each): small blocks and
# small `programs` targets reach many slices and many steps per slice on short rows.
CHECK = (
    "import torch\n"
    "from deepinfer.kernels import row_argmax as ra\n"
    "g = torch.Generator().manual_seed(0)\n"
    "nan, inf = float('nan'), float('inf')\n"
    "def case(x, block_v=ra.BLOCK_V, programs=ra.TARGET_PROGRAMS, what=''):\n"
    "    x = x.to(DEV)\n"
    "    default = block_v == ra.BLOCK_V and programs == ra.TARGET_PROGRAMS\n"
    "    got = ra.row_argmax(x) if DEV == 'cuda' and default else ra._launch(x, block_v, programs=programs)\n"
    "    assert got.dtype == torch.int64 and got.shape == (x.shape[0],), (what, got.shape, got.dtype)\n"
    "    for want in (x.argmax(-1), x.cpu().argmax(-1)):\n"
    "        bad = (got.cpu() != want.cpu()).nonzero().flatten().tolist()\n"
    "        assert not bad, (what, tuple(x.shape), block_v, programs, bad[:5], got.cpu()[bad[:5]], want.cpu()[bad[:5]])\n"
    # random rows at the sampler's sizes (S = 32 a row at R = 1, one slice a row at V = 1000)
    "for R, V in ((1, 129280), (3, 129280), (1, 1000), (3, 1000), (64, 1000), (1, 8191), (3, 8191), (64, 8191)):\n"
    "    case(torch.randn(R, V, generator=g), what='random')\n"
    # many slices of one step; a few slices of many steps; one slice of many steps (stage 1 writes the
    # answer); then ties planted at the lane, step and slice boundaries the split has
    "for R, V, B, P in ((1, 1000, 16, 512), (1, 1000, 16, 4), (3, 1000, 64, 1), (5, 2000, 64, 12)):\n"
    "    case(torch.randn(R, V, generator=g), B, P, 'random small blocks')\n"
    "    S, bps = ra.plan(R, V, B, P)\n"
    "    assert (S > 1) == (P > 1) and (bps > 1) == (P < 512), (S, bps)\n"
    "    y = torch.randn(R, V, generator=g) - 10\n"
    "    at = [c for c in (B - 1, B, 2 * B, bps * B - 1, bps * B, 2 * bps * B + 5, V - 1) if c < V]\n"
    "    for k in range(len(at)):\n"  # each row of a repeat starts its ties at a later boundary
    "        z = y.clone()\n"
    "        z[:, at[k:]] = 3.0\n"
    "        case(z, B, P, f'ties from column {at[k]}')\n"
    # ties at the default block's boundaries and in far-apart slices
    "x = torch.randn(4, 129280, generator=g)\n"
    "x[0, [4095, 4096, 100000]] = 9.0\n"
    "x[1, [129279, 8192, 65536]] = 9.0\n"
    "x[2, :] = 1.0\n"  # every column ties: 0
    "x[3, [129279]] = 9.0\n"  # the last column of the partial last block
    "case(x, what='ties at the default block')\n"
    # NaN rows (the first NaN wins over larger numbers, +inf, later NaN), -inf rows, +inf, signed zeros
    "x = torch.randn(10, 1000, generator=g)\n"
    "x[0, [700, 100, 500]] = nan\n"
    "x[1, 999] = nan; x[1, 3] = inf\n"
    "x[2, :] = nan\n"
    "x[3, :] = -inf\n"
    "x[4, :] = -inf; x[4, 600] = nan\n"
    "x[5, :] = -inf; x[5, 417] = -1e30\n"
    "x[6, [10, 20]] = inf\n"
    "x[7, :] = 0.0; x[7, ::3] = -0.0\n"
    "x[8, :] = -inf; x[8, 999] = 0.0\n"
    "x[9, 64] = nan; x[9, 0] = nan\n"
    "for B, P in ((ra.BLOCK_V, 512), (64, 512), (64, 20), (16, 10)):\n"
    "    case(x, B, P, 'nan / inf rows')\n"
    "case(x.repeat(30, 1), what='nan / inf rows, one slice a row')\n"
    # strided rows and columns
    "w = torch.randn(5, 9000, generator=g)\n"
    "w[1, [17, 4200]] = 50.0; w[2, 4000] = nan\n"
    "case(w[:, :8191], what='row stride != V')\n"
    "case(w[1:4, 7:1000], 64, 6, 'offset rows')\n"
    "case(torch.randn(1000, 3, generator=g).t(), what='column stride != 1')\n"
    "case(torch.randn(1000, 3, generator=g).t(), 64, 4, 'column stride != 1')\n"
    # low precision: many exact ties after rounding
    "for dtype in (torch.bfloat16, torch.float16):\n"
    "    x = (torch.randn(3, 8191, generator=g) * 4).round().to(dtype)\n"
    "    x[1, 5] = nan\n"
    "    case(x, what=str(dtype))\n"
    "    case(x[:, :1000], 64, 6, str(dtype))\n"
    "assert ra._launch(torch.empty(0, 5).to(DEV)).shape == (0,)\n"
    "print('ok')\n")

test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(CHECK, "DEV = 'cpu'\n",
                                                                                "DEV = 'cuda'\n")


def test_torch_argmax_order_on_the_cpu():
    """The order the kernel reproduces, as torch's CPU argmax has it: the first NaN, else the lowest index
    of the largest value (signed zeros tie), 0 for a row of -inf."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, inf, nan], [-inf, -inf, -inf, -inf], [2.0, 5.0, 5.0, 1.0], [-0.0, 0.0, 0.0, -1.0],
                      [inf, 3.0, inf, nan], [-inf, -inf, -inf, -5.0]])
    assert x.argmax(-1).tolist() == [1, 0, 1, 0, 3, 3]
    assert x.bfloat16().argmax(-1).tolist() == [1, 0, 1, 0, 3, 3]


def test_cpu_uses_the_reference_and_bad_input_is_refused():
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(2))
    x[1, 7] = float("nan")
    got = ra.row_argmax(x)
    assert torch.equal(got, x.argmax(-1)) and got.dtype == torch.int64
    assert torch.equal(ra.row_argmax(x.double()), x.double().argmax(-1))
    with pytest.raises(ValueError, match="x must be a 2-D"):
        ra.row_argmax(x[0])
    with pytest.raises(ValueError, match="V = 0"):
        ra.row_argmax(x[:, :0])


@pytest.mark.parametrize("R", [1, 2, 8, 64, 100, 256, 511, 512, 513, 5000])
@pytest.mark.parametrize("V,block_v", [(129280, 4096), (129280, 1024), (1000, 4096), (8191, 16), (10 ** 6, 128)])
def test_plan_covers_each_row_with_nonempty_slices(R, V, block_v):
    S, bps = ra.plan(R, V, block_v)
    blocks = -(-V // block_v)
    assert 1 <= S <= ra.MAX_SLICES and bps >= 1
    assert S * bps * block_v >= V > (S - 1) * bps * block_v  # covered, the last slice starts inside the row
    assert S == min(blocks, ra.MAX_SLICES) or R * S >= ra.TARGET_PROGRAMS or S == -(-blocks // bps)
    if R >= ra.TARGET_PROGRAMS:
        assert S == 1
    if V == 129280 and block_v == 4096 and R == 1:
        assert (S, bps) == (32, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [1, 8, 64, 256, 1024])
def test_matches_cuda_argmax_at_the_sampler_sizes(R, dtype):
    g = torch.Generator(device="cuda").manual_seed(R)
    x = (torch.randn(R, 129280, device="cuda", generator=g) * 3).to(dtype)
    x[:, 129279] = x.max()  # ties with earlier maxima in most rows
    x[0, 77777] = float("nan")
    assert torch.equal(ra.row_argmax(x), x.argmax(-1))
    assert torch.equal(ra.row_argmax(x[:, 1:]), x[:, 1:].argmax(-1))  # row stride != V, unaligned start


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 64])
def test_replays_in_a_cuda_graph(R):
    x = torch.randn(R, 129280, device="cuda")
    ra.row_argmax(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ra.row_argmax(x)
    x.copy_(torch.randn(R, 129280, device="cuda"))
    graph.replay()
    assert torch.equal(out, x.argmax(-1))


def test_the_sampler_takes_every_row_argmax_from_row_argmax(monkeypatch):
    """sample's greedy rows (all-greedy and mixed batches) and the exponential race go through row_argmax."""
    import deepinfer.worker.sampler as sm
    from deepinfer.sampling_params import SamplingParams
    calls = []

    def spy(x):
        calls.append(tuple(x.shape))
        return ra.reference(x)

    monkeypatch.setattr(sm, "row_argmax", spy)
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    greedy = sm.SamplingBatch.build([SamplingParams(temperature=0)] * 5, 30, "cpu")
    assert torch.equal(sm.sample(logits, greedy), logits.argmax(-1)) and calls == [(5, 30)]
    mixed = sm.SamplingBatch.build([SamplingParams(temperature=0)] * 4 + [SamplingParams(temperature=1.0)], 30, "cpu")
    assert torch.equal(sm.sample(logits, mixed, torch.Generator().manual_seed(3))[:4], logits[:4].argmax(-1))
    assert calls == [(5, 30)] * 3  # the race over all rows, then the greedy rows' argmax


@pytest.mark.gpu
def test_the_sampler_on_cuda_matches_torch_argmax():
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.worker.sampler import SamplingBatch, sample
    logits = torch.randn(64, 129280, device="cuda")
    logits[:, [5, 90000]] = 20.0
    logits[3, 100] = float("nan")
    sb = SamplingBatch.build([SamplingParams(temperature=0)] * 64, 129280, "cuda")
    assert torch.equal(sample(logits, sb), logits.argmax(-1))
