"""V4.1's FP8 cache format in one launch (kernels/group_fp8.py) against the torch form (formats/group_quant.py), bit
for bit: encode (gathered and scattered), the round trip and the decode of stored rows, under the interpreter on the
CPU and compiled on the GPU; FormatStore("fp8") goes through them."""
import pytest
import torch

from deepinfer.kernels import group_fp8 as gf
from deepinfer.state import kv_state
from interpreter import interpreted_and_gpu

# e4m3 ties in units of the group's scale (midway between neighbours): 2^-10 (0 / 2^-9), 3 * 2^-10, 1 + 1/16 (to 1),
# 1 + 3/16 (to 1.25), 13 * 2^-8 (to 2^-6 across the subnormal boundary), 26, 232
E4M3_TIES = (2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875, 13 * 2.0 ** -8, 26.0, 232.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (tells +0.0 from -0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _random(rows: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows from ~1e-30 to ~1e25 in magnitude (finite after the 2^20 below), every group of 8 at its own scale, a
    zero row, -0.0s, tiny values beside large ones in a group (subnormal results), fp32 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-30, 25, rows)[:, None]
    x = x * torch.exp2(torch.randint(-12, 13, (rows, dim // 8), generator=g).float()).repeat_interleave(8, 1)
    x[rows // 2] = 0
    x[1, ::3] = -0.0
    x[-1, 5] = x[-1].abs().max() * 2.0 ** 20  # the group's other values round to e4m3 subnormals or zero
    if dtype == torch.float32:
        x[rows // 3, 1::5] = -1e-40
    return x.to(dtype)


def _edges(dim: int) -> torch.Tensor:
    """fp32 rows at scale 2^k: groups whose amax is 448 * 2^k * (1 + d * 2^-23), d in -2..2 (where pow2_ceil of the
    rounded product decides between k and k + 1), groups of exact e4m3 ties (amax 448 * 2^k sets the scale), and
    groups at the amax floor 1e-4."""
    g = torch.Generator().manual_seed(5)
    ties = torch.tensor(E4M3_TIES)
    rows = []
    for k in (-20, -7, -2, 0, 1, 3, 9, 60, 110):
        x = torch.zeros(dim).unflatten(0, (-1, gf.G))
        for j in range(x.shape[0]):
            if j % 3 == 1:
                x[j] = ties[torch.randint(len(ties), (gf.G,), generator=g)] * torch.sign(torch.randn(gf.G, generator=g))
                x[j, 0] = 448.0
            elif j % 3 == 2:
                x[j] = torch.randn(gf.G, generator=g) * 1e-5 * 2.0 ** -k  # amax below 1e-4 (before the 2^k)
            else:
                d = (j // 3 + len(rows)) % 5 - 2
                x[j] = torch.rand(gf.G, generator=g) * 448
                x[j, gf.G // 2] = -448.0 * (1 + d * 2.0 ** -23)
        rows.append(x.flatten() * 2.0 ** k)
    return torch.stack(rows)


def check(x: torch.Tensor, codes, back: torch.Tensor | None = None) -> None:
    """codes = (e4m3, bytes) and the round trip `back` equal the torch form's on x's device, bit for bit."""
    want = gf.reference_encode(x)
    for name, got, ref in zip(("codes", "scale"), codes, want):
        assert got.shape == ref.shape and got.dtype == ref.dtype, (name, got.shape, got.dtype)
        assert torch.equal(_bits(got), _bits(ref)), (name, x.dtype, tuple(x.shape), (_bits(got) != _bits(ref)).sum())
    if back is not None:
        assert back.shape == x.shape and back.dtype == x.dtype
        assert torch.equal(_bits(back), _bits(gf.reference_roundtrip(x))), (x.dtype, tuple(x.shape))


def _store(n: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(n, dim, dtype=torch.float8_e4m3fn, device=device),
            torch.zeros(n, dim // gf.G, dtype=torch.uint8, device=device))


def check_scatter(x: torch.Tensor, store, rows: torch.Tensor, src: torch.Tensor | None = None) -> None:
    """store (zeros before) holds the codes of x[src] (x) at `rows` and zeros elsewhere."""
    check(x if src is None else x[src], tuple(t[rows] for t in store))
    untouched = torch.ones(store[0].shape[0], dtype=torch.bool, device=x.device)
    untouched[rows] = False
    assert all((_bits(t[untouched]) == 0).all() for t in store), "rows outside `rows` were written"


def test_the_edge_rows_hit_the_rule_boundaries_and_ties():
    x = _edges(512)
    codes, s = gf.reference_encode(x)
    k = torch.tensor([-20, -7, -2, 0, 1, 3, 9, 60, 110])[:, None]
    e = (s.int() - 127)[:, 0::3]  # the groups of amax 448 * 2^k * (1 + d * 2^-23)
    assert (e == k).any() and (e == k + 1).any(), "both outcomes of pow2_ceil at the boundary occur"
    assert (_bits(codes) == 0x80).any(), "-0 codes"
    floor = (s.int() - 127)[:, 2::3]  # amax below 1e-4 * 2^k: at k = 0 the floor sets the scale
    assert (floor[3] == -22).all()


def test_cpu_tensors_take_the_reference():
    x = _random(9, 512, torch.bfloat16)
    assert torch.equal(_bits(gf.roundtrip(x)), _bits(gf.reference_roundtrip(x)))
    store, rows, src = _store(12, 512, "cpu"), torch.tensor([11, 0, 5]), torch.tensor([8, 2, 2])
    gf.encode_rows(x, *store, rows, src)
    check_scatter(x, store, rows, src)
    back = gf.decode_rows(*store, rows, torch.float32)
    assert torch.equal(_bits(back), _bits(gf.reference_roundtrip(x[src].float())))


def test_format_store_uses_the_ops(monkeypatch):
    calls = []
    for name in ("encode_rows", "roundtrip", "decode_rows"):
        real = getattr(gf, name)
        monkeypatch.setattr(kv_state.group_fp8, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    store = kv_state.FormatStore(rows=6, dim=512, fmt="fp8", device="cpu")
    x = _random(4, 512, torch.float32)
    assert torch.equal(_bits(store.roundtrip(x)), _bits(gf.reference_roundtrip(x)))
    store.write(torch.tensor([5, 1]), x[:2])
    store.write_from(torch.tensor([0, 3]), x, torch.tensor([3, 2]))
    back = store.read(torch.tensor([5, 1, 0, 3]), torch.float32)
    assert calls == ["roundtrip", "encode_rows", "encode_rows", "decode_rows"]
    assert torch.equal(_bits(back), _bits(gf.reference_roundtrip(x[[0, 1, 3, 2]])))
    assert (store.scale[[2, 4]] == 0).all()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="x must be"):
        gf._launch_encode(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="x must be"):
        gf._launch_encode(torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        gf._launch_encode(torch.zeros(2, 64), (torch.zeros(4, 64, dtype=torch.float8_e4m3fn),
                                               torch.zeros(4, 1, dtype=torch.uint8)), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rows must be"):
        gf._launch_encode(torch.zeros(2, 64), _store(4, 64, "cpu"), torch.tensor([0, 1, 2]))


# The kernels against the torch form on the same device, bit for bit: V4.1's 512 and narrow widths, 37 rows (not a
# multiple of a program's rows) and one, the edge rows, a strided view, scatter with and without a gather, decode of
# scattered rows in both dtypes.
CHECK = (
    "import torch\n"
    "from deepinfer.kernels import group_fp8 as gf\n"
    "from test_group_fp8 import _random, _edges, _store, check, check_scatter, _bits\n"
    "for i, (dim, dtype) in enumerate(((512, torch.bfloat16), (512, torch.float32), (64, torch.float32),\n"
    "                                  (96, torch.bfloat16))):\n"
    "    x = _random(37, dim, dtype, i).to(DEV)\n"
    "    check(x, gf._launch_encode(x), gf._launch_encode(x, decode=True))\n"
    "    check(x, gf._launch_encode(x, ROWS=8), gf._launch_encode(x, decode=True, ROWS=8))\n"
    "    check(x[:1], gf._launch_encode(x[:1]), gf._launch_encode(x[:1], decode=True))\n"
    "    store, rows = _store(50, dim, DEV), torch.randperm(50)[:37].to(DEV)\n"
    "    src = torch.randint(0, 37, (37,)).to(DEV)\n"
    "    gf._launch_encode(x, store, rows, src)\n"
    "    check_scatter(x, store, rows, src)\n"
    "    for out in (torch.bfloat16, torch.float32):\n"
    "        got = gf._launch_decode(*store, rows, out)\n"
    "        assert torch.equal(_bits(got), _bits(gf.reference_decode(store[0][rows], store[1][rows], out)))\n"
    "x = _edges(512).to(DEV)\n"
    "check(x, gf._launch_encode(x), gf._launch_encode(x, decode=True))\n"
    "wide = _random(20, 1024, torch.float32, 9).to(DEV)[:, 256:768]  # a strided view\n"
    "check(wide, gf._launch_encode(wide), gf._launch_encode(wide, decode=True))\n"
    "print('ok')\n"
)
test_kernel_equals_torch_in_the_interpreter, test_kernel_equals_torch_on_gpu = interpreted_and_gpu(
    CHECK, "DEV = 'cpu'\n", "DEV = 'cuda'\n")
