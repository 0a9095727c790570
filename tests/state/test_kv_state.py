import torch

from deepinfer.state.kv_state import EntryStore, IndexKeyStore
from deepinfer.formats.quant import hadamard


def test_fp8_entries_store_e4m3_nope_with_pow2_scales_and_bf16_rope():
    g = torch.Generator().manual_seed(0)
    store = EntryStore(rows=8, dim=512, rope_dim=64, fmt="fp8", device="cpu")
    x = torch.randn(3, 512, generator=g) * 5
    rows = torch.tensor([1, 4, 7])
    store.write(rows, x)
    assert store.nope_q.dtype == torch.float8_e4m3fn and store.nope_q.shape == (8, 448)
    assert store.nope_scale.shape == (8, 7)  # one E8M0 scale per 64 nope dims
    back = store.read(rows, torch.float32)
    assert torch.equal(back[:, 448:], x[:, 448:].to(torch.bfloat16).float())
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each group's scale
    grp = x[:, :448].unflatten(-1, (7, 64)).abs().amax(-1, keepdim=True)
    assert ((back[:, :448] - x[:, :448]).unflatten(-1, (7, 64)).abs() <= grp / 16 + 1e-6).all()
    assert torch.equal(store.roundtrip(x), back)


def test_exact_formats_keep_values():
    x = torch.randn(2, 64)
    s32 = EntryStore(4, 64, 16, "float32", "cpu")
    s32.write(torch.tensor([0, 3]), x)
    assert torch.equal(s32.read(torch.tensor([0, 3]), torch.float32), x)
    sbf = EntryStore(4, 64, 16, "bfloat16", "cpu")
    assert torch.equal(sbf.roundtrip(x), x.to(torch.bfloat16).float())


def test_fp4_index_keys_are_rotated_packed_and_scores_stay_close():
    g = torch.Generator().manual_seed(1)
    keys = IndexKeyStore(rows=16, dim=128, fmt="fp4", device="cpu")
    k = torch.randn(16, 128, generator=g)
    keys.write(torch.arange(16), k)
    assert keys.packed.shape == (16, 64) and keys.scale.shape == (16, 4)
    q = torch.randn(4, 128, generator=g)
    approx = keys.prepare_query(q) @ keys.read(torch.arange(16), torch.float32).T
    exact = hadamard(q) @ hadamard(k).T
    assert torch.allclose(exact, q @ k.T, atol=1e-4)  # the rotation is orthogonal
    assert (approx - exact).abs().max() < 0.25 * exact.abs().max()
