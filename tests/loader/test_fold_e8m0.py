"""formats/quant.py fold_e8m0_groups: E8M0 scales per (1, 32) -> per (1, 128), exact or refused."""
import pytest
import torch

from deepinfer.formats.quant import dequant_fp8_blocks, fold_e8m0_groups, quant_fp4, unpack_fp4

E8 = torch.float8_e8m0fnu


def _scales(rows):
    return torch.tensor(rows, dtype=torch.uint8).view(E8)


def _same_values(w, s, folded):
    """dequantised bit for bit: the (1, 32) original against the (1, 128) fold."""
    codes, s128 = folded
    a = dequant_fp8_blocks(w, s, (1, 32))
    b = dequant_fp8_blocks(codes, s128, (1, 128))
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_fp4_experts_repacked_as_fp8_fold_exactly():
    """Codes of FP4 origin (|c| <= 6) under the per-32 scales DeepSeek's quantiser gives real-looking
    weights: every block folds, the values are unchanged bit for bit."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(-8, 8, (64, 1), generator=g)                    # rows of very different size,
    groups = torch.randint(-4, 4, (64, 32), generator=g)                 # groups of one row within 8 binades
    x = torch.randn(64, 1024, generator=g) * torch.exp2((rows + groups).float()).repeat_interleave(32, 1)
    packed, s = quant_fp4(x)
    w = unpack_fp4(packed).to(torch.float8_e4m3fn)
    folded = fold_e8m0_groups(w, s)
    assert folded is not None
    assert folded[0].dtype == torch.float8_e4m3fn and folded[0].shape == (64, 1024)
    assert folded[1].dtype == E8 and folded[1].shape == (64, 8)
    assert _same_values(w, s, folded)
    with pytest.raises(ValueError, match="scale"):
        fold_e8m0_groups(w, s[:, :4])


def test_full_range_codes_take_the_largest_exponent():
    """Each group holds a code with no headroom (448): the shared scale is the largest of the four, the
    others' codes divided by 2^(e_max - e_i); 1.0 shifted 9 binades down is 2^-9, still exact."""
    w = torch.ones(1, 128)
    w[0, ::32] = 448.0
    w = w.to(torch.float8_e4m3fn)
    s = _scales([[127, 120, 127, 118]])
    folded = fold_e8m0_groups(w, s)
    assert folded is not None and folded[1].view(torch.uint8).tolist() == [[127]]
    assert _same_values(w, s, folded)
    assert folded[0][0, 33].float() == 2.0 ** -7 and folded[0][0, 97].float() == 2.0 ** -9


@pytest.mark.parametrize("low", [1.125, 2.0 ** -9])
def test_a_block_that_would_lose_a_bit_refuses(low):
    """Exponents 9 apart beside a full-range group: 1.125 * 2^-9 and 2^-18 are not e4m3 values."""
    w = torch.full((2, 256), 3.0)
    w[1, 128] = 448.0
    w[1, 160] = low
    w = w.to(torch.float8_e4m3fn)
    s = _scales([[127] * 8, [127, 127, 127, 127, 127, 118, 127, 127]])
    assert fold_e8m0_groups(w, s) is None          # one block of the tensor refuses: no fold at all
    assert fold_e8m0_groups(w[:1], s[:1]) is not None


def test_zero_groups_nan_scales_and_ragged_k():
    w = torch.zeros(1, 128, dtype=torch.float8_e4m3fn)
    w[0, :32] = 2.0
    folded = fold_e8m0_groups(w, _scales([[130, 3, 250, 0]]))  # zero groups: any scale, any spread
    assert folded is not None and _same_values(w, _scales([[130, 3, 250, 0]]), folded)
    assert fold_e8m0_groups(w, _scales([[130, 255, 127, 127]])) is None   # a NaN scale byte
    assert fold_e8m0_groups(torch.zeros(1, 96, dtype=torch.float8_e4m3fn), _scales([[127] * 3])) is None
    with pytest.raises(TypeError, match="E8M0"):
        fold_e8m0_groups(w, torch.ones(1, 4))


def _exact_for(v, e, S):
    """Brute force: every code c * 2^(e_i - S) of a block is an e4m3 value."""
    want = v * torch.exp2((e - S).float()).repeat_interleave(32)
    return torch.equal(want.to(torch.float8_e4m3fn).float(), want)


def test_refuses_only_when_no_shared_exponent_is_exact():
    """Random single blocks (full-range or FP4-origin codes, exponent spreads 0..20): the fold succeeds
    exactly when some shared exponent keeps every code (searched by brute force), and is then exact."""
    g = torch.Generator().manual_seed(1)
    seen = {True: 0, False: 0}
    for i in range(150):
        if i % 2:
            v = (torch.randn(128, generator=g) * 30).to(torch.float8_e4m3fn)
        else:
            v = unpack_fp4(torch.randint(-128, 128, (64,), generator=g, dtype=torch.int8)).to(torch.float8_e4m3fn)
        spread = int(torch.randint(0, 21, (1,), generator=g))
        e = 100 + torch.randint(0, spread + 1, (4,), generator=g, dtype=torch.int32)
        s = e.to(torch.uint8).view(E8)[None]
        got = fold_e8m0_groups(v[None], s)
        possible = any(_exact_for(v.float(), e, S) for S in range(60, 140))
        assert (got is not None) == possible, (i, e.tolist())
        if got is not None:
            assert _same_values(v[None], s, got)
        seen[possible] += 1
    assert seen[True] > 20 and seen[False] > 20
