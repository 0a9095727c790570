"""The FP8 cache entries' encode / scatter / round trip (kernels/entry_quant.py) against the torch form, bit for
bit: under the interpreter on the CPU (numpy's log2, true division, as torch on the CPU), compiled on the GPU
(libdevice's log2f and the fp32 reciprocal of 448, as torch on CUDA), where V4's shapes and groups whose amax is
448 * 2^k just above / below a power of two are checked against torch on CUDA."""
import pytest
import torch

from deepinfer.kernels import entry_quant as eq
from deepinfer.state import kv_state
from interpreter import interpreted_and_gpu

# (dim, rope_dim, dtype): V4's 448 + 64 (7 groups of 64); narrow test models' groups gcd(64, nope) = 32, 16, 4, 8;
# a rope width that is not a power of two; no rope dims
CASES = ((512, 64, torch.float32), (512, 64, torch.bfloat16), (48, 16, torch.float32), (40, 8, torch.bfloat16),
         (56, 8, torch.float16), (24, 4, torch.float32), (70, 6, torch.float32), (72, 0, torch.bfloat16))
# e4m3 ties (midway between neighbours, in units of the group's scale): 2^-10 (0 / 2^-9), 3 * 2^-10, normal
# ties 1 + 1/16 (to 1), 1 + 3/16 (to 1.25), 13 * 2^-8 (to 2^-6 across the subnormal boundary), 26, 464 / 2
E4M3_TIES = (2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875, 13 * 2.0 ** -8, 26.0, 232.0)
BF16_TIES = (1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(3 + 2.0 ** -7))  # rope values midway between bf16 neighbours


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (tells +0.0 from -0.0, compares NaN codes)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _random(rows: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows from ~1e-35 to ~1e35 in magnitude (fp16: 1e-3 .. 1e2), every group of 4 at its own scale, a zero
    row, a row of one negative value, -0.0s, fp32 subnormals beside larger values, a row of subnormals only."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-3, 2) if dtype == torch.float16 else (-35, 35)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(lo, hi, rows)[:, None]
    x = x * torch.exp2(torch.randint(-6, 7, (rows, -(-dim // 4)), generator=g).float()).repeat_interleave(4, 1)[:, :dim]
    x[rows // 2] = 0
    x[rows // 3] = -3.0
    x[1, ::3] = -0.0
    if dtype == torch.float32:
        x[2, 1::5] = -1e-40
        x[3] = 1e-41
    return x.to(dtype)


def _edges(dim: int, rope_dim: int) -> torch.Tensor:
    """fp32 rows, one group scale 2^k each: groups whose amax is 448 * 2^k * (1 + d * 2^-23), d in -2..2 (where
    the ceil(log2) rule and its rounding decide between k and k + 1), and groups of exact e4m3 ties at scale 2^k
    (amax 448 * 2^k sets it); rope dims on bf16 ties."""
    nope = dim - rope_dim
    G = eq.group_size(nope)
    g = torch.Generator().manual_seed(5)
    ties = torch.tensor(E4M3_TIES)
    rows = []
    for k in (-100, -40, -7, -2, 0, 1, 2, 3, 4, 9, 60, 110):
        x = torch.zeros(nope).unflatten(0, (-1, G))
        for j in range(x.shape[0]):
            if j % 2:
                x[j] = ties[torch.randint(len(ties), (G,), generator=g)] * torch.sign(torch.randn(G, generator=g))
                x[j, 0] = 448.0
            else:
                d = (j // 2 + len(rows)) % 5 - 2
                x[j] = torch.rand(G, generator=g) * 448
                x[j, G // 2] = -448.0 * (1 + d * 2.0 ** -23)
        rope = torch.tensor(BF16_TIES)[torch.randint(len(BF16_TIES), (rope_dim,), generator=g)]
        rows.append(torch.cat((x.flatten() * 2.0 ** k, rope)))
    return torch.stack(rows)


def _specials(dim: int, rope_dim: int) -> torch.Tensor:
    """fp32 rows with +-inf (a group of scale 2^127: inf codes saturate to +-448, its finite values round to
    +-0), a NaN (its group: codes 0x7F, byte 0), values near fp32's max."""
    x = torch.randn(4, dim, generator=torch.Generator().manual_seed(2))
    x[0, 1] = float("inf")
    x[1, 0] = -float("inf")
    x[2, 2] = float("nan")
    x[3, :3] = torch.tensor([3.4e38, -3.0e38, 1.7e38])
    return x


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    return x.float().isfinite().all(-1)


def check(x: torch.Tensor, rope_dim: int, codes, back: torch.Tensor | None = None) -> None:
    """codes = (q, scale, rope) and the round trip `back` equal the torch form's on x's device, bit for bit, on
    rows of finite values; rows with inf / NaN follow the kernel's documented contract (torch's fp8 cast of
    inf changed with its version: compared with it only on the CPU's torch >= 2.12)."""
    ref = eq.reference(x, rope_dim)
    fin = _finite_rows(x)
    for name, got, want in zip(("q", "scale", "rope"), codes, ref):
        assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, got.dtype)
        assert torch.equal(_bits(got)[fin], _bits(want)[fin]), (name, x.dtype, tuple(x.shape), rope_dim,
                                                               (_bits(got) != _bits(want)).sum().item())
    if back is not None:
        want = eq.reference_decode(*ref, x.dtype)
        assert back.shape == x.shape and back.dtype == x.dtype
        assert torch.equal(_bits(back)[fin], _bits(want)[fin]), (x.dtype, tuple(x.shape), rope_dim)
    if fin.all():
        return
    nope = x.shape[-1] - rope_dim
    G = eq.group_size(nope)
    g = x[~fin][:, :nope].float().unflatten(-1, (-1, G))
    nan, inf = g.isnan().any(-1), ~g.isnan().any(-1) & g.isinf().any(-1)
    q, s = _bits(codes[0][~fin]).unflatten(-1, (-1, G)), codes[1][~fin]
    assert (s[nan] == 0).all() and (q[nan] == 0x7F).all(), "NaN groups: byte 0, codes 0x7F"
    assert (s[inf] == 254).all(), "inf groups: scale 2^127"
    assert torch.equal(q[g.isinf()], torch.where(g[g.isinf()] > 0, 0x7E, 0xFE).to(torch.uint8)), "inf -> +-448"
    fin_in_inf = inf[..., None] & g.isfinite()
    assert torch.equal(q[fin_in_inf] & 0x7F, torch.zeros_like(q[fin_in_inf])), "finite values beside inf -> +-0"
    if back is not None:
        b = back[~fin][:, :nope].float().unflatten(-1, (-1, G))
        assert b[nan].isnan().all() and torch.equal(b[g.isinf()], g[g.isinf()]) and (b[fin_in_inf] == 0).all()


def mutants_fail(run, swaps) -> None:
    """For each (old, new): kernels/entry_quant.py with old replaced by new, loaded as its own module, must fail
    run(module) with an AssertionError (under the interpreter)."""
    import importlib.util
    import pathlib
    import tempfile

    src = pathlib.Path(eq.__file__).read_text()
    for old, new in swaps:
        assert old in src, old
        path = pathlib.Path(tempfile.mkdtemp()) / "entry_quant_mutant.py"
        path.write_text(src.replace(old, new))
        spec = importlib.util.spec_from_file_location("entry_quant_mutant", path)
        mutant = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mutant)
        try:
            run(mutant)
        except AssertionError:
            continue
        raise SystemExit(f"the mutant {new!r} passed the checks")


def _store(n: int, dim: int, rope_dim: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nope = dim - rope_dim
    return (torch.zeros(n, nope, dtype=torch.float8_e4m3fn, device=device),
            torch.zeros(n, nope // eq.group_size(nope), dtype=torch.uint8, device=device),
            torch.zeros(n, rope_dim, dtype=torch.bfloat16, device=device))


def check_scatter(x: torch.Tensor, rope_dim: int, store, rows: torch.Tensor, src: torch.Tensor | None = None,
                  back: torch.Tensor | None = None) -> None:
    """store (zeros before) holds the codes of x[src] (x) at `rows` and zeros elsewhere."""
    xs = x if src is None else x[src]
    check(xs, rope_dim, tuple(t[rows] for t in store), back)
    untouched = torch.ones(store[0].shape[0], dtype=torch.bool, device=x.device)
    untouched[rows] = False
    assert all((_bits(t[untouched]) == 0).all() for t in store), "rows outside `rows` were written"


def test_cpu_tensors_take_the_reference():
    x = _random(9, 512, torch.bfloat16).view(3, 3, 512)
    codes = eq.entry_encode(x, 64)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(codes, eq.reference(x, 64)))
    assert torch.equal(_bits(eq.entry_roundtrip(x, 64)), _bits(eq.reference_roundtrip(x, 64)))
    x = x.flatten(0, 1)
    store, rows, src = _store(12, 512, 64, "cpu"), torch.tensor([11, 0, 5]), torch.tensor([8, 2, 2])
    eq.entry_encode(x, 64, store, rows, src)
    check_scatter(x, 64, store, rows, src)
    store = _store(12, 512, 64, "cpu")
    back = eq.entry_roundtrip(x[:3], 64, store, rows)
    check_scatter(x[:3], 64, store, rows, back=back)


def test_the_edge_rows_hit_the_rule_boundaries_and_ties():
    x = _edges(512, 64)
    q, s, r = eq.reference(x, 64)
    e = s.float() - 127
    amax = x[:, :448].unflatten(-1, (7, 64)).abs().amax(-1)
    k = torch.log2(torch.tensor([2.0 ** k for k in (-100, -40, -7, -2, 0, 1, 2, 3, 4, 9, 60, 110)]))[:, None]
    above = amax > 448 * torch.exp2(k)
    assert (e[above] == k.expand_as(e)[above] + 1).any() and (e[above] == k.expand_as(e)[above]).any(), \
        "amax just above 448 * 2^k: both outcomes of the rounded log2 occur"
    assert (e[~above] == k.expand_as(e)[~above]).all()
    ties = x[:, :448].unflatten(-1, (7, 64))[:, 1::2] / torch.exp2(k)[..., None]
    assert all((ties.abs() == t).any() for t in E4M3_TIES)
    assert (q.view(torch.uint8) == 0x80).any() and (r.float() == 1.0).any(), "-0 codes; a bf16 tie to even"
    out = eq.reference(_specials(512, 64), 64)
    assert (out[1][:2] == 254).any() and (out[1][2] == 0).any()


def test_entry_store_uses_the_ops(monkeypatch):
    calls = []
    real_encode, real_roundtrip = eq.entry_encode, eq.entry_roundtrip
    monkeypatch.setattr(kv_state, "entry_encode", lambda *a: calls.append("encode") or real_encode(*a))
    monkeypatch.setattr(kv_state, "entry_roundtrip", lambda *a: calls.append("roundtrip") or real_roundtrip(*a))
    store = kv_state.EntryStore(rows=6, dim=512, rope_dim=64, fmt="fp8", device="cpu")
    x = _random(4, 512, torch.float32)
    assert torch.equal(_bits(store.roundtrip(x)), _bits(eq.reference_roundtrip(x, 64)))
    store.write(torch.tensor([5, 1]), x[:2])
    store.write_from(torch.tensor([0, 3]), x, torch.tensor([3, 2]))
    assert calls == ["roundtrip", "encode", "encode"]
    back = store.read(torch.tensor([5, 1, 0, 3]), torch.float32)
    assert torch.equal(_bits(back), _bits(eq.reference_roundtrip(x[[0, 1, 3, 2]], 64)))
    assert (store.nope_scale[[2, 4]] == 0).all()
    exact = kv_state.EntryStore(4, 64, 16, "bfloat16", "cpu")
    exact.write(torch.tensor([1]), x[:1, :64])
    assert torch.equal(exact.roundtrip(x[:, :64]), x[:, :64].to(torch.bfloat16).float()) and len(calls) == 3


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="x must be"):
        eq._launch(torch.zeros(2, 64, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="x must be"):
        eq._launch(torch.zeros(2, 64), 64)
    with pytest.raises(ValueError, match="out scale must be"):
        eq._launch(torch.zeros(2, 64), 16, (torch.zeros(4, 48, dtype=torch.float8_e4m3fn),
                                            torch.zeros(4, 1, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.bfloat16)),
                   torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rows must be"):
        eq._launch(torch.zeros(2, 64), 16, _store(4, 64, 16, "cpu"), torch.tensor([0, 1, 2]))


# The kernel against the torch form on the same device, bit for bit: every CASES shape (37 rows: not a multiple
# of a program's rows), the edge and special rows, a strided view, scatter to arbitrary rows with and without a
# gather (src) and with the round trip; under the interpreter, mutants of the kernel (floor for ceil, the sign
# taken from the value, bf16 ties rounded up) must fail the same checks.
CHECK = (
    "import warnings\n"
    "import torch\n"
    "warnings.simplefilter('ignore')  # the interpreter's numpy overflows on inf rows\n"
    "from deepinfer.kernels import entry_quant as eq\n"
    "from test_entry_quant import CASES, _random, _edges, _specials, _store, check, check_scatter, mutants_fail\n"
    "def run(mod):\n"
    "    for i, (dim, rope, dtype) in enumerate(CASES):\n"
    "        x = _random(37, dim, dtype, i).to(DEV)\n"
    "        check(x, rope, mod._launch(x, rope), mod._launch(x, rope, decode=True))\n"
    "        check(x, rope, mod._launch(x, rope, ROWS=8), mod._launch(x, rope, decode=True, ROWS=8))  # 37 > 4 x 8\n"
    "        if dtype == torch.float32:\n"
    "            for y in (_edges(dim, rope), _specials(dim, rope)):\n"
    "                y = y.to(DEV)\n"
    "                check(y, rope, mod._launch(y, rope), mod._launch(y, rope, decode=True))\n"
    "        g = torch.Generator().manual_seed(i)\n"
    "        rows, src = torch.randperm(50, generator=g)[:20].to(DEV), torch.randint(37, (20,), generator=g).to(DEV)\n"
    "        store = _store(50, dim, rope, DEV)\n"
    "        assert mod._launch(x, rope, store, rows, src) is store\n"
    "        check_scatter(x, rope, store, rows, src)\n"
    "        store = _store(50, dim, rope, DEV)\n"
    "        back = mod._launch(x[:20], rope, store, rows.int(), decode=True)\n"
    "        check_scatter(x[:20], rope, store, rows, back=back)\n"
    "    x = _random(24, 512, torch.bfloat16, 9).to(DEV).view(4, 6, 512)\n"
    "    check(x[:, 1], 64, mod._launch(x[:, 1], 64), mod._launch(x[:, 1], 64, decode=True))  # strided rows\n"
    "    check(x, 64, mod._launch(x, 64), mod._launch(x, 64, decode=True))  # [4, 6, 512]\n"
    "run(eq)\n"
    "if DEV == 'cpu':\n"
    "    mutants_fail(run, (('tl.ceil(lg)', 'tl.floor(lg)'), ('neg = (bits < 0)', 'neg = (x < 0.0)'),\n"
    "                       ('0x7FFF + ((b >> 16) & 1)', '0x8000')))\n"
    "if DEV == 'cuda':  # V4's shapes through EntryStore (decode batch 64, a 4 x 2048 prefill), torch on CUDA\n"
    "    from deepinfer.state.kv_state import EntryStore\n"
    "    g = torch.Generator(device='cuda').manual_seed(0)\n"
    "    for T, dtype in ((1, torch.bfloat16), (64, torch.bfloat16), (8192, torch.bfloat16), (300, torch.float32)):\n"
    "        x = (torch.randn(T, 512, device='cuda', generator=g) * 3).to(dtype)\n"
    "        s = EntryStore(9000, 512, 64, 'fp8', 'cuda')\n"
    "        rows = torch.randperm(9000, device='cuda', generator=g)[:T]\n"
    "        s.write(rows, x)\n"
    "        check_scatter(x, 64, s.tensors(), rows)\n"
    "        check(x, 64, tuple(t[rows] for t in s.tensors()), s.roundtrip(x))\n"
    "        s = EntryStore(9000, 512, 64, 'fp8', 'cuda')\n"
    "        src = torch.randint(T, (T,), device='cuda', generator=g)\n"
    "        s.write_from(rows, x, src)\n"
    "        check_scatter(x, 64, s.tensors(), rows, src)\n"
    "print('ok')\n")

test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(CHECK, "DEV = 'cpu'\n",
                                                                                "DEV = 'cuda'\n")


# `norm` (RMSNorm + RoPE before encoding) against reference_norm_rope then the torch encode: rows of multiples of
# 1/8 (their sums of squares are exact in any order), so under the interpreter (numpy's rsqrt as torch's on the
# CPU) codes and round trip are bit-equal; compiled (the GPU's approximate rsqrt) the round trip is within one
# e4m3 step of its group and nearly every code equal. Mutants: the weight applied after the cast, sine's sign.
NORM_CHECK = (
    "import torch\n"
    "from deepinfer.kernels import entry_quant as eq\n"
    "from test_entry_quant import _store, check, check_scatter, check_norm_close, mutants_fail\n"
    "def run(mod):\n"
    "    for dim, rope, dtype in ((512, 64, torch.bfloat16), (512, 64, torch.float32), (48, 16, torch.float32),\n"
    "                             (40, 8, torch.bfloat16)):\n"
    "        g = torch.Generator().manual_seed(dim + rope)\n"
    "        x = (torch.randint(-16, 17, (37, dim), generator=g).float() / 8)\n"
    "        x[0] = 0  # rsqrt(eps)\n"
    "        x = x.to(dtype).to(DEV)\n"
    "        w = (1 + torch.randint(-8, 9, (dim,), generator=g).float() / 16).to(DEV)\n"
    "        cos, sin = (torch.rand(2, 37, rope // 2, generator=g) * 2 - 1).to(DEV).unbind(0)\n"
    "        for norm in ((w, 1e-6, cos, sin), (w, 1e-6, cos[:1], sin[:1])):  # per row; one position for all\n"
    "            xn = eq.reference_norm_rope(x.cpu(), tuple(t.cpu() if torch.is_tensor(t) else t for t in norm))\n"
    "            rows = torch.randperm(50, generator=g)[:37].to(DEV)\n"
    "            store = _store(50, dim, rope, DEV)\n"
    "            back = mod._launch(x, rope, store, rows, decode=True, norm=norm)\n"
    "            codes = mod._launch(x, rope, norm=norm)\n"
    "            alone = mod._launch(x, rope, decode=True, norm=norm)  # the round trip without a store\n"
    "            if DEV == 'cpu':\n"
    "                check(xn, rope, codes, back)\n"
    "                check(xn, rope, codes, alone)\n"
    "                check_scatter(xn, rope, store, rows, back=back)\n"
    "            else:\n"
    "                check_norm_close(xn, rope, [t.cpu() for t in codes], back.cpu())\n"
    "                check_norm_close(xn, rope, [t.cpu() for t in codes], alone.cpu())\n"
    "                check_norm_close(xn, rope, [t[rows].cpu() for t in store], back.cpu())\n"
    "run(eq)\n"
    "if DEV == 'cpu':\n"
    "    mutants_fail(run, (('x = _to_x_dtype((x * rn[:, None, None]) * wn[None, :, :], BF16)',\n"
    "                        'x = _to_x_dtype(x * rn[:, None, None], BF16) * wn[None, :, :]'),\n"
    "                       ('ev * cs - od * sn', 'ev * cs + od * sn')))\n"
    "print('ok')\n")

test_norm_in_the_triton_interpreter, test_norm_on_gpu = interpreted_and_gpu(NORM_CHECK, "DEV = 'cpu'\n",
                                                                            "DEV = 'cuda'\n")


def check_norm_close(xn: torch.Tensor, rope_dim: int, codes, back: torch.Tensor) -> None:
    """The compiled norm path against the torch form on the CPU: the round trip within one e4m3 step (1/8 of the
    value's binade, at least the smallest step of twice the group's scale) of the reference's; rope dims within
    2^-6 of their row's largest (a bf16 step of a rotated pair's inputs: e * c - o * s may cancel); at least
    99 % of the codes equal."""
    want = eq.reference(xn, rope_dim)
    want_back = eq.reference_decode(*want, xn.dtype).float()
    nope = xn.shape[-1] - rope_dim
    scale = torch.exp2(want[1].float() - 127).repeat_interleave(eq.group_size(nope), -1)
    step = torch.maximum(want_back[:, :nope].abs() / 8, scale * 2.0 ** -8)
    assert ((back.float()[:, :nope] - want_back[:, :nope]).abs() <= step * 1.001).all()
    r_got, r_want = back.float()[:, nope:], want_back[:, nope:]
    assert ((r_got - r_want).abs() <= r_want.abs().amax(-1, keepdim=True) * 2.0 ** -6 + 1e-30).all()
    assert (_bits(codes[0]) == _bits(want[0])).float().mean() >= 0.99


# groups whose amax is 448 * 2^k * (1 + d * 2^-23) for every k the rule reaches and d in -3..3, fp32 and bf16:
# where CUDA's fp32 reciprocal of 448 and libdevice's log2f round onto k the kernel must too (these rows give a
# different scale on the CPU's true division for some k: checked, so the case is exercised)
ADVERSARIAL = (
    "import torch\n"
    "from deepinfer.kernels import entry_quant as eq\n"
    "from test_entry_quant import check\n"
    "k = torch.arange(-100, 127, dtype=torch.float32)\n"
    "rows = []\n"
    "for d in range(-3, 4):\n"
    "    amax = 448.0 * torch.exp2(k) * (1 + d * 2.0 ** -23)\n"
    "    g = torch.rand(len(k), 8, 64, generator=torch.Generator().manual_seed(d + 3)) * amax[:, None, None]\n"
    "    g[:, :, 7] = amax[:, None] * torch.tensor([1, -1, 1, -1, 1, 1, -1, 1.0])\n"
    "    rows.append(g.flatten(1))\n"
    "x = torch.cat(rows)[:, :512]\n"
    "x = x[x.isfinite().all(-1)]\n"
    "assert (eq.reference(x.cuda(), 64)[1].cpu() != eq.reference(x, 64)[1]).any(), 'CUDA rule not exercised'\n"
    "for dtype in (torch.float32, torch.bfloat16):\n"
    "    y = x.to(dtype).cuda()\n"
    "    check(y, 64, eq._launch(y, 64), eq._launch(y, 64, decode=True))\n"
    "    check(y, 64, eq.entry_encode(y, 64), eq.entry_roundtrip(y, 64))\n"
    "print('ok')\n")


@pytest.mark.gpu
def test_adversarial_scales_on_gpu():
    from interpreter import run_interpreted
    run_interpreted(ADVERSARIAL, interpret=False)
