"""CSA2 (layers/csa2.py): the indexer's and compressor's kernel path equals the torch path.

Values are chosen so that every score is exact in fp32 whatever the summation order (keys and
queries on the E2M1 grid with scale 1, head weights small integers / 16), so the kernel path must
give the torch path's ids and candidates bit for bit, ties (many, signed zeros among them) included."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from interpreter import SHIMS, run_interpreted  # noqa: E402

from deepinfer.formats.quant import FP4_VALUES  # noqa: E402
from deepinfer.layers import csa2  # noqa: E402
from deepinfer.layers.csa2 import CSA2State, Indexer41, PoolCompressor  # noqa: E402
from deepinfer.state.forward_batch import CompressPlan, ForwardBatch  # noqa: E402
from deepinfer.state.kv_state import CarryState, FormatStore, LayerCache  # noqa: E402

H, DI, DIM = 4, 64, 32


def on_grid(*shape, g):
    """E2M1 grid values, every 32-group holding a +-6 (so the mxfp4 scale is 1: stored exactly)."""
    grid = torch.tensor(FP4_VALUES, dtype=torch.float32)
    v = grid[torch.randint(0, 16, shape, generator=g)]
    v = v.view(*shape[:-1], shape[-1] // 32, 32)
    v[..., 0] = 6.0 * torch.where(torch.rand(v.shape[:-1], generator=g) < 0.5, -1.0, 1.0)
    return v.view(*shape)


def setup(fmt: str, lens=(20, 1, 5, 1), nv: int = 40, R: int = 150, seed: int = 0, device: str = "cpu"):
    """An indexer with head weights w_h = x[:, h] / 16 (x small integers), a key store of R rows in
    `fmt`, requests of `lens` tokens seeing 0..nv of their nv entries (addresses: random rows)."""
    g = torch.Generator().manual_seed(seed)
    T, B = sum(lens), len(lens)
    ind = Indexer41(DIM, 16, DIM, H, DI, 6, False, 1e-6, torch.bfloat16)
    with torch.no_grad():
        ind.weights_proj.weight.zero_()
        ind.weights_proj.weight[torch.arange(H), torch.arange(H)] = 4.0  # w_h = 4 x_h / (8 * 2)
    x = torch.randint(-4, 5, (T, DIM), generator=g).to(torch.bfloat16)
    store = FormatStore(R, DI, fmt, "cpu")
    store.write(torch.arange(R), on_grid(R, DI, g=g))
    q = on_grid(T, H, DI, g=g).to(torch.bfloat16)
    assert torch.equal(store.roundtrip(q), q)
    token_req = torch.repeat_interleave(torch.arange(B), torch.tensor(lens))
    addr = torch.randint(0, R, (B, nv), generator=g)  # repeated rows: equal keys, more ties
    visible = torch.randint(0, nv + 1, (T,), generator=g)
    visible[0], visible[-1] = 0, nv
    z = torch.zeros(0, dtype=torch.long)
    plan = CompressPlan(1, z.view(0, 1), z.view(0, 1), z, z, z, z, visible, addr)
    batch = ForwardBatch(z.new_zeros(T), z.new_zeros(T), token_req, z, z.view(T, 0), z.view(T, 0), z, z,
                         {(1, False): plan}, req_lens=tuple(lens))
    mv = lambda t: t.to(device)  # noqa: E731
    if device != "cpu":
        ind, x, q, store_dev = ind.to(device), mv(x), mv(q), FormatStore(R, DI, fmt, device)
        for a, b in zip(store_dev.tensors(), store.tensors()):
            a.copy_(b)
        store = store_dev
        plan = CompressPlan(1, *(mv(t) for t in (plan.src_new, plan.src_carry, z, z, z, z, visible, addr)))
        batch = ForwardBatch(*(mv(t) for t in (batch.input_ids, batch.positions, token_req, z)),
                             mv(z.view(T, 0)), mv(z.view(T, 0)), mv(z), mv(z), {(1, False): plan}, req_lens=tuple(lens))
    return ind, x, q, batch, CSA2State(LayerCache(ring=None, index_keys=store), plan)


def run_roles(ind, x, q, batch, state, cand=(3, 4)):
    """The three indexer roles: plain, candidate source, candidate user. -> (ids, cands, ids, ids)."""
    plain, _ = ind(x, q, batch, state, None, False)
    src, cands = ind(x, q, batch, state, cand, False)
    state.candidates = cands
    user, _ = ind(x, q, batch, state, None, True)
    return plain, cands, src, user


def test_torch_path_selects_among_candidates():
    ind, x, q, batch, state = setup("mxfp4")
    plain, cands, src, user = run_roles(ind, x, q, batch, state)
    assert torch.equal(src, plain)  # the candidate source ranks every visible entry
    ok = user >= 0
    assert cands[torch.arange(user.shape[0])[:, None].expand_as(user)[ok], user[ok]].all()
    assert (cands.sum(1) <= 3 * 4).all() and not cands[0].any()


CHECK = """
import torch
from deepinfer.layers import csa2
from test_csa2 import setup, run_roles, pool_case
for fmt in ("mxfp4", "bfloat16"):
    for nv, lens in ((40, (20, 1, 5, 1)), (1100, (3, 17))):
        ind, x, q, batch, state = setup(fmt, lens=lens, nv=nv, seed=nv)
        cand = (3, 4) if nv == 40 else (5, 8)
        got = run_roles(ind, x, q, batch, state, cand)
        kernels, csa2._kernels = csa2._kernels, lambda t: False
        want = run_roles(ind, x, q, batch, state, cand)
        csa2._kernels = kernels
        assert got[0].shape[1] == min(6, nv) and got[1].shape[1] == nv
        for a, b in zip(got, want):
            assert torch.equal(a, b), (fmt, nv)
comp, x, plan, carry = pool_case()
got = comp(x, plan, carry)
got_carry = [t.clone() for t in carry.tensors()]
comp, x, plan, carry = pool_case()
csa2._kernels = lambda t: False
want = comp(x, plan, carry)
torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
assert all(torch.equal(a, b) for a, b in zip(got_carry, carry.tensors()))
print('ok')
"""


def pool_case(seed: int = 0):
    """A ratio-2 compressor closing 5 entries: some pool a carried token and a new one, some two new."""
    g = torch.Generator().manual_seed(seed)
    comp = PoolCompressor(DIM, 64, 2, 1e-6, torch.bfloat16)
    with torch.no_grad():
        comp.wkv.weight.copy_(torch.randn(64, DIM, generator=g))
        comp.wgate.weight.copy_(torch.randn(64, DIM, generator=g))
    x = torch.randn(9, DIM, generator=g).to(torch.bfloat16)
    carry = CarryState(torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g))
    new = torch.tensor([[-1, 0], [1, 2], [3, 4], [-1, 6], [7, 8]])
    old = torch.tensor([[2, -1], [-1, -1], [-1, -1], [5, -1], [-1, -1]])
    z = torch.zeros(0, dtype=torch.long)
    plan = CompressPlan(2, new, old, z, z, torch.tensor([5, 8]), torch.tensor([0, 3]), z, z.view(1, 0))
    return comp, x, plan, carry


def test_kernel_path_equals_torch_path_in_the_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(SHIMS + f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n" + CHECK, timeout=900)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "bfloat16"])
def test_kernel_path_equals_torch_path_on_gpu(fmt):
    for nv, lens in ((40, (20, 1, 5, 1)), (1100, (3, 17)), (5000, (1,) * 8 + (40,))):
        cand = (3, 4) if nv == 40 else (5, 8)
        got = run_roles(*setup(fmt, lens=lens, nv=nv, seed=nv, device="cuda"), cand)
        want = run_roles(*setup(fmt, lens=lens, nv=nv, seed=nv), cand)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b), (fmt, nv)


@pytest.mark.gpu
def test_indexer_scores_are_batch_invariant_on_gpu():
    """Invariant mode: a token's scores are the same bits alone and in a batch (per-token kernel)."""
    from deepinfer.layers import invariant
    g = torch.Generator().manual_seed(1)
    ind, x, q, batch, state = setup("mxfp4", lens=(30, 1, 1), nv=300, device="cuda")
    q = (q.float() * torch.randn(q.shape, generator=g).to("cuda")).to(torch.bfloat16)  # inexact sums
    w = torch.randn(q.shape[0], H, generator=g).to("cuda")
    with invariant.mode(True):
        full = torch.cat([s for _, s in ind._scores(q, w, batch, state)])
        for lo, hi in ((0, 30), (30, 31), (31, 32), (5, 6)):
            sub = ForwardBatch(batch.input_ids[lo:hi], batch.positions[lo:hi], batch.token_req[lo:hi], batch.logits_idx,
                               batch.win_new[lo:hi], batch.win_ring[lo:hi], batch.ring_src, batch.ring_dst, batch.plans,
                               req_lens=(hi - lo,))
            st = CSA2State(state.source, CompressPlan(1, *[getattr(state.plan, f) for f in
                                                           ("src_new", "src_carry", "dst", "rope_pos", "carry_src",
                                                            "carry_dst")], state.plan.visible[lo:hi], state.plan.addr))
            alone = torch.cat([s for _, s in ind._scores(q[lo:hi], w[lo:hi], sub, st)])
            assert torch.equal(alone, full[lo:hi])
