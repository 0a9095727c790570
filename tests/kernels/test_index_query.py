"""The indexer's FP4 query preparation (kernels/index_query.py): Hadamard rotation + FP4 round trip in one
kernel, bit-equal to fp4_roundtrip(hadamard(q.float()), 32).to(q.dtype) (interpreter on the CPU, compiled
on the GPU, where the V4 prefill shape [8192, 64, 128] is checked too)."""
import pytest
import torch

from deepinfer.formats.quant import hadamard
from deepinfer.kernels import index_query as iq
from deepinfer.state import kv_state
from interpreter import interpreted_and_gpu

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midway between adjacent E2M1 magnitudes


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (tells +0.0 from -0.0)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _random(rows: int, D: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows from 1e-33 to 1e33 in magnitude (1e-30 is the amax floor), a zero row, a row of one value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g) * torch.logspace(-33, 33, rows)[:, None]
    x[rows // 2] = 0
    x[rows // 3] = -3.0
    return x.to(dtype)


def _ties(D: int = 64) -> torch.Tensor:
    """fp32 rows whose rotation is exact (D a power of 4: the norm is a power of two, H @ H = I) and lands on
    E2M1 ties and 2^-14 either side of them, at group scales 2^0, 2^5 and 2^-7 (each group's amax is 6 * s)."""
    g = torch.Generator().manual_seed(3)
    vals = torch.tensor(TIES + tuple(t + d for t in TIES for d in (2.0 ** -14, -2.0 ** -14)) + (6.0,))
    rows = []
    for s in (1.0, 32.0, 2.0 ** -7):
        for _ in range(3):
            y = vals[torch.randint(len(vals), (D,), generator=g)] * torch.sign(torch.randn(D, generator=g))
            y[::32] = 6.0
            rows.append(y * s)
    y = torch.stack(rows)
    x = hadamard(y)
    assert torch.equal(hadamard(x), y), "the tie rows must rotate exactly"
    return x


def _specials(D: int) -> torch.Tensor:
    """fp32 rows: one inf (all outputs +-inf), two infs (inf - inf: NaN groups), a NaN, three values near
    fp32's max twice (partial sums overflow: groups of +-inf and finite values, scale 2^127; the finite ones
    at |x| / 2^127 ~ .35 and ~ .2 for D = 32), -0.0s, tiny values."""
    x = torch.zeros(8, D)
    x[0, 5] = float("inf")
    x[1, 0] = x[1, 1] = float("inf")
    x[2, 3] = float("nan")
    x[3, :3] = 3.4e38
    x[4] = -0.0
    x[5] = 1e-36
    x[6, :D // 2] = -1e-31
    x[7, :3] = 2e38
    return x


def _nan_groups(x: torch.Tensor, width: int) -> torch.Tensor:
    """Per group of 32 holding a NaN after the rotation, repeated `width` times: [..., D / 32 * width]."""
    nan = hadamard(x.float()).unflatten(-1, (-1, 32)).isnan().any(-1, keepdim=True)
    return nan.expand(*nan.shape[:-1], width).flatten(-2)


def check(q: torch.Tensor, out: torch.Tensor) -> None:
    """out equals the torch form's result on q's device bit for bit. Groups holding a NaN after the rotation
    give +6.0 (the torch form's result on CUDA; on the CPU it gives E8M0 byte 0 instead: not compared)."""
    ref = iq.reference(q)
    assert out.shape == q.shape and out.dtype == q.dtype
    nan = _nan_groups(q, 32)
    assert (out[nan] == 6.0).all(), "NaN groups give +6.0"
    if q.is_cuda:
        assert torch.equal(_bits(out[nan]), _bits(ref[nan])), "NaN groups differ from torch on CUDA"
    assert torch.equal(_bits(out[~nan]), _bits(ref[~nan])), (q.dtype, tuple(q.shape), (out != ref).sum().item())


def check_keys(k: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """The key encoding equals quant_fp4(hadamard(k.float()), 32) on k's device bit for bit; NaN groups are
    E8M0 127 with codes +6 (0x77), as on CUDA (not compared with the CPU's torch form)."""
    ref_p, ref_s = iq.reference_keys(k)
    assert packed.dtype == torch.int8 and scale.dtype == torch.uint8
    assert packed.shape == ref_p.shape and scale.shape == ref_s.shape
    nan_p, nan_s = _nan_groups(k, 16), _nan_groups(k, 1)
    assert (packed[nan_p] == 0x77).all() and (scale[nan_s] == 127).all(), "NaN groups: +6 codes, scale 1"
    if k.is_cuda:
        assert torch.equal(packed[nan_p], ref_p[nan_p]) and torch.equal(scale[nan_s], ref_s[nan_s]), \
            "NaN groups differ from torch on CUDA"
    assert torch.equal(scale[~nan_s], ref_s[~nan_s]), (k.dtype, tuple(k.shape))
    assert torch.equal(packed[~nan_p], ref_p[~nan_p]), (k.dtype, tuple(k.shape), (packed != ref_p).sum().item())


def test_cpu_tensors_take_the_reference():
    q = _random(9, 128, torch.bfloat16).view(3, 3, 128)
    assert torch.equal(_bits(iq.index_query(q)), _bits(iq.reference(q)))
    p, s = iq.index_keys(q)
    ref_p, ref_s = iq.reference_keys(q)
    assert torch.equal(p, ref_p) and torch.equal(s, ref_s) and s.dtype == torch.uint8


def test_supported_widths_and_dtypes():
    for D in (32, 64, 128, 256, 1024):
        assert iq.supported(torch.zeros(2, D, dtype=torch.bfloat16))
    for D in (16, 48, 2048):
        assert not iq.supported(torch.zeros(2, D))
    assert not iq.supported(torch.zeros(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="q must be"):
        iq._launch(torch.zeros(2, 48))


def test_the_test_rows_hit_ties_and_special_values():
    y = hadamard(_ties())
    scale = 2.0 ** torch.ceil(torch.log2(y.unflatten(-1, (-1, 32)).abs().amax(-1) / 6))
    r = (y.unflatten(-1, (-1, 32)) / scale[..., None]).abs()
    assert all((r == t).any() for t in TIES)
    q = _specials(32)
    out = iq.reference(q)
    assert out[0].isinf().all() and out[4].eq(0).all() and not out[4].signbit().any()
    assert out[3].isinf().any() and (out[3].isfinite() & (out[3] != 0)).any()   # scale 2^127, finite codes


def test_index_key_store_uses_the_ops(monkeypatch):
    calls = []
    monkeypatch.setattr(kv_state, "index_query", lambda q: calls.append(q) or iq.reference(q))
    monkeypatch.setattr(kv_state, "index_keys", lambda k: calls.append(k) or iq.reference_keys(k))
    keys = kv_state.IndexKeyStore(rows=4, dim=64, fmt="fp4", device="cpu")
    q = _random(3, 64, torch.float32)
    assert torch.equal(keys.prepare_query(q), iq.reference(q)) and calls == [q]
    keys.write(torch.tensor([3, 0, 1]), q)
    ref_p, ref_s = iq.reference_keys(q)
    assert calls[1] is q and torch.equal(keys.packed[[3, 0, 1]], ref_p) and torch.equal(keys.scale[[3, 0, 1]], ref_s)
    assert kv_state.IndexKeyStore(rows=4, dim=64, fmt="float32", device="cpu").prepare_query(q) is q


# The kernels (values for queries, packed codes + scales for keys) against the torch forms on the same device,
# bit for bit: widths 32 to 256, bf16 / fp16 / fp32, magnitudes 1e-33 .. 1e33, zero rows, exact ties,
# inf / NaN / overflowing rows, a [T, H, D] view.
CHECK = (
    "import torch\n"
    "from deepinfer.kernels.index_query import _launch, _launch_keys\n"
    "from test_index_query import _random, _ties, _specials, check, check_keys\n"
    "cases = [_random(rows, D, dtype, D) for D, dtype, rows in [(32, torch.bfloat16, 21), (64, torch.float16, 9),\n"
    "                                                           (128, torch.bfloat16, 35), (256, torch.float32, 12)]]\n"
    "for q in cases + [_ties(), _specials(32), _specials(128).to(torch.bfloat16)]:\n"
    "    q = q.to(DEV)\n"
    "    check(q, _launch(q))\n"
    "    check_keys(q, *_launch_keys(q))\n"
    "q = _random(24, 128, torch.bfloat16, 7).to(DEV).view(4, 6, 128)\n"
    "check(q, _launch(q))\n"
    "check(q[:, 1], _launch(q[:, 1]))  # strided rows\n"
    "check_keys(q[:, 1], *_launch_keys(q[:, 1]))\n"
    "if DEV == 'cuda':  # V4 prefill 4 x 2048 tokens, 64 heads\n"
    "    g = torch.Generator(device='cuda').manual_seed(0)\n"
    "    q = (torch.randn(8192, 64, 128, device='cuda', generator=g) * 3).to(torch.bfloat16)\n"
    "    check(q, _launch(q))\n"
    "    from deepinfer.state.kv_state import IndexKeyStore\n"
    "    check(q, IndexKeyStore(16, 128, 'fp4', 'cuda').prepare_query(q))\n"
    "    check_keys(q[:, 0], *_launch_keys(q[:, 0]))  # a strided [8192, 128] view\n"
    "print('ok')\n")

test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(CHECK, "DEV = 'cpu'\n",
                                                                                "DEV = 'cuda'\n")
