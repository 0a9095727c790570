import pytest
import torch

from deepinfer.layers.moe import Experts


@pytest.mark.gpu
def test_grouped_gemm_path_matches_the_reference_loop():
    torch.manual_seed(0)
    with torch.device("cuda"):
        ex = Experts(dim=256, inter=128, num_experts=16, limit=10.0, dtype=torch.bfloat16)
        for w in (ex.w1, ex.w2, ex.w3):
            w.data.normal_(0, 0.05)
        x = torch.randn(37, 256, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(16)[:4] for _ in range(37)]).cuda()  # expert 15 may get no token
        weights = torch.rand(37, 4)
    fast = ex(x, weights, idx)  # bf16 on cuda: the grouped GEMM path
    cpu = Experts(dim=256, inter=128, num_experts=16, limit=10.0, dtype=torch.float32)
    for name in ("w1", "w2", "w3"):
        getattr(cpu, name).data.copy_(getattr(ex, name).float().cpu())
    ref = cpu(x.float().cpu(), weights.cpu(), idx.cpu())  # fp32 on the cpu: the reference loop
    torch.testing.assert_close(fast.cpu(), ref, atol=3e-2, rtol=3e-2)


def test_fp4_experts_repacked_as_fp8_keep_every_value():
    """e2m1 -> e4m3 with the same E8M0 scale per 32 inputs is exact: the reference loop gives the same bits."""
    from deepinfer.layers.linear import QuantSpec

    torch.manual_seed(0)
    ex = Experts(dim=64, inter=32, num_experts=4, limit=10.0, dtype=torch.float32,
                 quant=QuantSpec(block_size=(128, 128), fp4_experts=True))
    for name in ("w1", "w2", "w3"):
        getattr(ex, name).copy_(torch.randint(-128, 127, getattr(ex, name).shape, dtype=torch.int8))
        getattr(ex, f"{name}_scale").view(torch.uint8).copy_(
            torch.randint(115, 130, getattr(ex, f"{name}_scale").shape, dtype=torch.uint8))
    x, weights = torch.randn(9, 64), torch.rand(9, 2)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    before = ex(x, weights, idx)
    dense = [ex._w("w1", e, torch.float32) for e in range(4)]
    ex.repack_fp4_as_fp8()
    assert ex.w1.dtype == torch.float8_e4m3fn and ex.w1.shape == (4, 32, 64)
    assert all(torch.equal(ex._w("w1", e, torch.float32), dense[e]) for e in range(4))
    assert torch.equal(ex(x, weights, idx), before)


# ---------------------------------------------------------------- FP4 experts: (1, 128) fold and W8A8 prefill

def _fp4_experts(dim=256, inter=128, E=4, spread=(-3, 3), seed=0, dtype=torch.float32):
    """FP4 experts quantised (formats/quant.py quant_fp4) from weights whose 32-groups differ in size
    by up to `spread` binades within a row (rows of different sizes too), as real checkpoints do."""
    from deepinfer.formats.quant import quant_fp4
    from deepinfer.layers.linear import QuantSpec

    g = torch.Generator().manual_seed(seed)
    ex = Experts(dim=dim, inter=inter, num_experts=E, limit=10.0, dtype=dtype,
                 quant=QuantSpec(block_size=(128, 128), fp4_experts=True))
    for name in ("w1", "w2", "w3"):
        E_, O, I2 = getattr(ex, name).shape
        size = (torch.randint(-2, 3, (E_, O, 1), generator=g) + torch.randint(*spread, (E_, O, 2 * I2 // 32),
                                                                              generator=g)).float()
        w = torch.randn(E_, O, 2 * I2, generator=g) * torch.exp2(size - 8).repeat_interleave(32, -1)
        packed, s = quant_fp4(w)
        getattr(ex, name).copy_(packed)
        getattr(ex, f"{name}_scale").copy_(s)
    return ex


def test_repacked_fp4_experts_fold_to_one_scale_per_128_inputs():
    """Repacking folds every projection's scales to (1, 128) in place, the only copy kept: the dequantised
    experts are bit for bit the ones before, and the reference loop gives the same output."""
    ex = _fp4_experts()
    x, weights = torch.randn(9, 256), torch.rand(9, 2)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    before = ex(x, weights, idx)
    dense = {n: [ex._w(n, e, torch.float32) for e in range(4)] for n in ("w1", "w2", "w3")}
    ex.repack_fp4_as_fp8()
    for name, (O, I) in (("w1", (128, 256)), ("w2", (256, 128)), ("w3", (128, 256))):
        assert getattr(ex, name).dtype == torch.float8_e4m3fn and getattr(ex, name).shape == (4, O, I)
        assert getattr(ex, f"{name}_scale").shape == (4, O, I // 128) and ex._block(name) == (1, 128)
        assert all(torch.equal(ex._w(name, e, torch.float32).view(torch.int32), dense[name][e].view(torch.int32))
                   for e in range(4))
    assert torch.equal(ex(x, weights, idx), before)
    assert ex.fold_scales() == {"w1": True, "w2": True, "w3": True}  # folded already: nothing to do


def test_a_projection_that_cannot_fold_keeps_its_per_32_scales():
    """One block of one expert's w2 whose groups hold 6.0 and 0.5 under exponents 15 binades apart would
    lose bits (no shared exponent keeps 6 * 2^k <= 448 and 0.5 * 2^(k - 15) >= 2^-9): w2 keeps (1, 32)
    scales (W8A16 at every size), w1 and w3 fold."""
    ex = _fp4_experts()
    ex.w2_scale.view(torch.uint8)[3, 7, :4] = torch.tensor([127, 112, 127, 127], dtype=torch.uint8)
    ex.w2.view(torch.uint8)[3, 7, :16] = 0x77   # e2m1 code 7 (6.0) in both nibbles
    ex.w2.view(torch.uint8)[3, 7, 16:32] = 0x11  # code 1 (0.5)
    dense = [ex._w("w2", e, torch.float32) for e in range(4)]
    ex.repack_fp4_as_fp8()
    assert ex._block("w2") == (1, 32) and ex.w2_scale.shape == (4, 256, 4)
    assert ex._block("w1") == ex._block("w3") == (1, 128)
    assert all(torch.equal(ex._w("w2", e, torch.float32), dense[e]) for e in range(4))
    assert not ex._w8a8("w2", 10 ** 6) and ex._w8a8("w1", 10 ** 6)
    T = 140  # 280 rows >= 4 x W8A8_ROWS_PER_EXPERT: w1 and w3 W8A8, w2 W8A16 on the bf16 swiglu output
    x, weights = torch.randn(T, 256).to(torch.bfloat16), torch.rand(T, 2)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(T)])
    got, want = ex.grouped(x, weights, idx), _w8a8_math(ex, x, weights, idx, w8a8=("w1", "w3"))
    assert float((got - want).norm() / want.norm()) < 4e-3


def test_w8a8_is_chosen_by_rows_per_expert_outside_invariant_mode():
    from deepinfer.layers import invariant
    from deepinfer.layers.moe import W8A8_ROWS_PER_EXPERT

    ex = _fp4_experts()
    assert not ex._w8a8("w1", 10 ** 6)  # packed FP4: W8A16 (W4A16) only
    ex.repack_fp4_as_fp8()
    rows = W8A8_ROWS_PER_EXPERT * 4
    assert ex._w8a8("w1", rows) and not ex._w8a8("w1", rows - 1)
    with invariant.mode(True):
        assert not ex._w8a8("w1", rows)
    dense = Experts(dim=256, inter=128, num_experts=4, limit=10.0, dtype=torch.bfloat16)
    assert not dense._w8a8("w1", 10 ** 6)


def _w8a8_math(ex, x, weights, idx, w8a8=("w1", "w2", "w3")):
    """The routed experts as DeepSeek's reference computes them at prefill: every expert input quantised
    per 1 x 128 (act_quant, power-of-two scales) and multiplied by the dequantised weight in fp32,
    one (token, slot) pair at a time. Projections not in `w8a8` take the bf16 input as it is."""
    from deepinfer.kernels.act_quant import dequant, reference as act_quant
    from deepinfer.layers.moe import clamped_swiglu

    def fp8_linear(a, w, name):
        return ((dequant(*act_quant(a)) if name in w8a8 else a.float()) @ w.T).to(torch.bfloat16)

    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            xe = x[t:t + 1]
            h = clamped_swiglu(fp8_linear(xe, ex._w("w1", e, torch.float32), "w1"),
                               fp8_linear(xe, ex._w("w3", e, torch.float32), "w3"), ex.limit).to(torch.bfloat16)
            out[t] += fp8_linear(h, ex._w("w2", e, torch.float32), "w2")[0].float() * weights[t, j]
    return out


def test_prefill_rows_take_w8a8_on_the_dequantised_activations():
    """The grouped path (its CPU references) at W8A8_ROWS_PER_EXPERT rows an expert: the same as the
    reference's FP8-activation math (to bf16 rounding, the quantised inputs being the same), and away
    from W8A16's by FP8 activation rounding; below the threshold it is W8A16's."""
    from deepinfer.layers import moe

    torch.manual_seed(0)
    ex = _fp4_experts()
    ex.repack_fp4_as_fp8()
    T = max(moe.W8A8_ROWS_PER_EXPERT * 4 // 2 + 3, 64)  # top-2 of 4 experts, at or above the threshold
    x = torch.randn(T, 256).to(torch.bfloat16)
    weights, idx = torch.rand(T, 2), torch.stack([torch.randperm(4)[:2] for _ in range(T)])
    got = ex.grouped(x, weights, idx)
    want = _w8a8_math(ex, x, weights, idx)
    w16 = ex(x.float(), weights, idx)  # the reference loop: fp32 activations, no activation rounding

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    assert rel(got, want) < 4e-3
    assert rel(got, w16) > 2 * rel(got, want) and rel(got, w16) < 0.1
    n = (moe.W8A8_ROWS_PER_EXPERT * 4 - 1) // 2  # 2n rows < 4 x W8A8_ROWS_PER_EXPERT: W8A16, bf16 activations
    few = ex.grouped(x[:n], weights[:n], idx[:n])
    assert rel(few, w16[:n]) < 4e-3 and rel(few, want[:n]) > 2 * rel(few, w16[:n])


@pytest.mark.gpu
def test_w8a8_prefill_is_close_to_w8a16_on_gpu(monkeypatch):
    """Prefill-sized routing on the GPU: the W8A8 path (8192 rows: variant "gluon" on an H200) against the W8A16
    one (threshold raised) on the same folded weights; they differ by FP8 activation rounding only (e4m3: ~2^-5
    relative per input)."""
    from deepinfer.layers import moe

    variants, real = [], moe.grouped_gemm_fp8
    monkeypatch.setattr(moe, "grouped_gemm_fp8",
                        lambda *a, variant: variants.append(variant) or real(*a, variant=variant))

    torch.manual_seed(0)
    ex = _fp4_experts(dim=512, inter=256, E=16, dtype=torch.bfloat16)
    ex.repack_fp4_as_fp8()
    ex.cuda()
    T = 2048
    x = torch.randn(T, 512, dtype=torch.bfloat16, device="cuda")
    idx = torch.stack([torch.randperm(16)[:4] for _ in range(T)]).cuda()
    weights = torch.rand(T, 4, device="cuda")
    assert ex._w8a8("w1", T * 4)
    fast = ex(x, weights, idx)
    if torch.cuda.get_device_capability() == (9, 0):
        assert variants == ["gluon"] * 3, variants
    saved = moe.W8A8_ROWS_PER_EXPERT
    moe.W8A8_ROWS_PER_EXPERT = 10 ** 9
    try:
        w16 = ex(x, weights, idx)
    finally:
        moe.W8A8_ROWS_PER_EXPERT = saved
    rel = float((fast - w16).norm() / w16.norm())
    assert 0 < rel < 0.05, rel
    want = _w8a8_math(ex.cpu(), x[:64].cpu(), weights[:64].cpu(), idx[:64].cpu())
    assert float((fast[:64].cpu() - want).norm() / want.norm()) < 1e-2


def test_w8a8_experts_ask_for_the_tma_variant_where_it_applies(monkeypatch):
    """The W8A8 expert GEMMs run grouped_gemm_fp8's "tma" variant (faster on the H200:
    benchmarks/results/2026-12-02-h200-fp8-experts-sweep-58e3445.json) when tma_variant_ok takes the
    operands, else "pointer"."""
    from deepinfer.layers import moe

    torch.manual_seed(0)
    ex = _fp4_experts()
    ex.repack_fp4_as_fp8()
    seen = []

    def spy(*args, variant="pointer", **kw):
        seen.append(variant)
        return real(*args, **kw)
    real = moe.grouped_gemm_fp8
    monkeypatch.setattr(moe, "grouped_gemm_fp8", spy)
    T = 64
    x = torch.randn(T, 256).to(torch.bfloat16)
    weights, idx = torch.rand(T, 2), torch.stack([torch.randperm(4)[:2] for _ in range(T)])
    for ok, want in ((True, "tma"), (False, "pointer")):
        seen.clear()
        monkeypatch.setattr(moe, "tma_variant_ok", lambda a, w, ok=ok: ok)
        ex.grouped(x, weights, idx)
        assert seen == [want] * 3


def test_repack_with_agreed_flags_folds_only_what_every_rank_can():
    """repack_fp4_experts(agree=...): the agreement sees each module's foldable flags (w1, w2, w3 per module,
    model order) and only the projections it returns true are folded; the dequantised experts are unchanged
    either way. Ranks that cannot fold w2 (one rank's shard holding the unfoldable block) make every rank
    keep w2's (1, 32) scales, so EPLB can move expert rows between them."""
    from torch import nn

    from deepinfer.layers.moe import repack_fp4_experts

    a, b = _fp4_experts(seed=1), _fp4_experts(seed=2)
    b.w2_scale.view(torch.uint8)[3, 7, :4] = torch.tensor([127, 112, 127, 127], dtype=torch.uint8)
    b.w2.view(torch.uint8)[3, 7, :16] = 0x77
    b.w2.view(torch.uint8)[3, 7, 16:32] = 0x11
    model = nn.ModuleList([a, b])
    dense = {(i, n): [m._w(n, e, torch.float32) for e in range(4)] for i, m in enumerate(model)
             for n in ("w1", "w2", "w3")}
    seen = []

    def agree(flags):  # as if another rank could not fold w1 of the first module
        seen.append(list(flags))
        return [f and i != 0 for i, f in enumerate(flags)]

    repack_fp4_experts(model, agree=agree)
    assert seen == [[True, True, True, True, False, True]]
    assert [m._block(n) for m in model for n in ("w1", "w2", "w3")] == [
        (1, 32), (1, 128), (1, 128), (1, 128), (1, 32), (1, 128)]
    for (i, n), ws in dense.items():
        assert model[i].w1.dtype == torch.float8_e4m3fn
        assert all(torch.equal(model[i]._w(n, e, torch.float32), ws[e]) for e in range(4)), (i, n)


@pytest.mark.parametrize("rows, takes, want", [(3072, True, "gluon"), (3068, True, "tma"), (3072, False, "tma")])
def test_w8a8_experts_take_the_gluon_variant_at_prefill_rows(monkeypatch, rows, takes, want):
    """From GLUON_ROWS expert-sorted rows W8A8 runs grouped_gemm_fp8's variant "gluon" where the Gluon kernel
    takes the inputs (an sm_90 GPU), else variant "tma"."""
    import deepinfer.layers.moe as moe
    from deepinfer.kernels.act_quant import act_quant

    assert moe.GLUON_ROWS == 3072
    ex = _fp4_experts(E=4)
    ex.repack_fp4_as_fp8()
    seen = []
    monkeypatch.setattr(moe.gluon_fp8, "takes", lambda *a: takes)
    monkeypatch.setattr(moe, "tma_variant_ok", lambda a, w: True)
    monkeypatch.setattr(moe, "grouped_gemm_fp8", lambda *a, variant: seen.append(variant))
    xs = torch.randn(rows, 256)
    ex._grouped_mm(xs, "w1", torch.tensor([rows // 4 * (i + 1) for i in range(3)] + [rows], dtype=torch.int32),
                   act_quant(xs, 128))
    assert seen == [want]


# ---------------------------------------------------------------- the shared expert as a group of the routed GEMVs

def _moe_fp8(dim=512, inter=256, E=16, topk=4):
    """An MoE layer as the FP8 engine holds V4's: FP4 experts repacked to FP8 codes with folded (1, 128) scales,
    the shared expert FP8 with 128 x 128 E8M0 blocks, the gate in bf16."""
    from deepinfer.layers.linear import QuantSpec
    from deepinfer.layers.moe import MoE

    g = torch.Generator().manual_seed(3)
    moe_ = MoE(dim, inter, E, topk, 1, 100, False, 1.5, 10.0, torch.bfloat16,
               expert_quant=QuantSpec(block_size=(128, 128), fp4_experts=True), shared_quant=QuantSpec((128, 128)))
    moe_.experts = _fp4_experts(dim=dim, inter=inter, E=E, dtype=torch.bfloat16)
    moe_.experts.repack_fp4_as_fp8()
    for lin in (moe_.shared_experts.w1, moe_.shared_experts.w2, moe_.shared_experts.w3):
        lin.weight.copy_((torch.randn(lin.weight.shape, generator=g) * 2).to(torch.float8_e4m3fn))
        lin.scale.view(torch.uint8).copy_(torch.randint(112, 118, lin.scale.shape, generator=g, dtype=torch.uint8))
    moe_.gate.weight.data.copy_(torch.randn(moe_.gate.weight.shape, generator=g) * 0.05)
    return moe_.cuda()


@pytest.mark.gpu
def test_shared_expert_as_a_group_matches_the_separate_path_on_gpu(monkeypatch):
    """One token: the routed experts and the shared expert in two fused GEMV launches give the separate path's
    result up to the GEMV tiles' fp32 summation order (same products); in a CUDA graph too."""
    from deepinfer.layers import moe

    calls = []
    real = moe.grouped_gemv_fused
    monkeypatch.setattr(moe, "grouped_gemv_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = _moe_fp8()
    x = torch.randn(1, 512, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(1, dtype=torch.long, device="cuda")
    fused = m(x, ids)
    assert len(calls) == 2
    monkeypatch.setattr(moe, "SHARED_AS_GROUP_TOKENS", 0)
    separate = m(x, ids)
    assert len(calls) == 2 and fused.dtype == separate.dtype == torch.bfloat16
    assert float((fused.float() - separate.float()).norm() / separate.float().norm()) < 4e-3
    monkeypatch.setattr(moe, "SHARED_AS_GROUP_TOKENS", 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(x, ids)
    x.copy_(torch.randn(1, 512, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    assert torch.equal(out, m(x, ids))


def test_shared_expert_as_a_group_stays_off_the_cpu_and_the_bf16_experts():
    from deepinfer.layers.moe import MoE

    m = MoE(64, 32, 4, 2, 1, 10, False, 1.0, 10.0, torch.bfloat16)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    assert m.experts.with_shared(x, torch.rand(1, 2), torch.tensor([[0, 1]]), m.shared_experts) is None
