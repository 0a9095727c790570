"""Expert-parallel MoE dispatch / combine (deepinfer/distributed/expert_parallel.py) on 2 and 4 gloo
ranks (torch.multiprocessing spawn, parallel_state's groups), fp32, 8 experts, dim 64, inter 32,
top-2, skewed routing; every rank has its own tokens (data-parallel attention), one rank none.

What each rank checks against the one-process `Experts` on its own tokens:
* eager arithmetic: within rtol = atol = 1e-5 (measured: ~1e-6). Not bit-identical: an expert's
  GEMM sees the rows of every rank at once, and the CPU library picks its blocking from the row count.
* batch-invariant mode (layers/invariant.py: fixed 16-row GEMM tiles, one thread): bit-identical
  (torch.equal). Each row then goes through the same arithmetic as in one process, and with k = 2 the
  slot-order fp32 sum equals the one-process expert-order sum (two terms commute).
* the fixed-capacity (graph-capturable) exchange equals the variable-size one, bit for bit (invariant).
* with an EPLB placement (one redundant slot per rank): the same outputs, and the most rows any rank
  receives drops (max / mean printed).
The group timeout is 60 s: a rank left waiting for an idle one raises instead of hanging the test.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.distributed import parallel_state
from deepinfer.distributed.eplb import count_experts, rebalance_experts, route_to_physical
from deepinfer.distributed.expert_parallel import ExpertParallel, moe_forward, pack_rows, shard_experts, unpack_rows
from deepinfer.distributed.parallel_state import ParallelConfig
from deepinfer.layers import invariant
from deepinfer.layers.linear import QuantSpec
from deepinfer.layers.moe import Experts, MoE

E, D, INTER, K, LIMIT = 8, 64, 32, 2, 10.0
MAX_TOKENS = 16
SKEW = torch.tensor([8.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # routing probabilities: experts 0, 1 hot
TOL = dict(rtol=1e-5, atol=1e-5)
# per world size, rounds of per-rank token counts (each round: one forward of every kind)
ROUNDS = {2: [[11, 5], [0, 7]], 4: [[9, 0, 5, 16]]}


def whole_experts() -> Experts:
    torch.manual_seed(0)
    ex = Experts(D, INTER, E, LIMIT, torch.float32)
    for p in ex.parameters():
        p.data.normal_(0, 0.2)
    return ex


def whole_moe() -> MoE:
    """A routed MoE layer (top-2 of 8 by score + bias, one shared expert) with random weights."""
    torch.manual_seed(1)
    moe = MoE(D, INTER, E, K, 1, 50, False, 1.5, LIMIT, torch.float32)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    return moe


def batch(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D], router weights [T, k] fp32, distinct skewed logical ids [T, k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=g)
    w = torch.rand(tokens, K, generator=g) + 0.1
    ids = torch.multinomial(SKEW.expand(tokens, E), K, generator=g) if tokens else torch.zeros(0, K, dtype=torch.long)
    return x, w, ids


def skewed_placement(world: int, rounds: list[list[int]]):
    """EPLB placement from every rank's routing of every round: E + world slots (one replica slot a rank)."""
    ids = torch.cat([batch(t, 100 * i + r)[2] for i, ts in enumerate(rounds) for r, t in enumerate(ts)])
    return rebalance_experts(count_experts(ids, E)[None].double(), E + world, world)


def ep_rank_main(rank: int, world: int, init_method: str, out: str) -> None:
    parallel_state.init_parallel(ParallelConfig(data_parallel_size=world), rank, "cpu", init_method, timeout_s=60)
    try:
        torch.set_num_threads(1)
        group = parallel_state.dp_group()  # tensor_parallel_size 1: every rank
        whole = whole_experts()
        placement = skewed_placement(world, ROUNDS[world])
        plain = ExpertParallel(shard_experts(whole, None, 0, rank, world), E, group=group, max_tokens=MAX_TOKENS)
        eplb = ExpertParallel(shard_experts(whole, placement, 0, rank, world), E, placement, 0, group,
                              max_tokens=MAX_TOKENS)
        assert plain.experts.num_experts == E // world and eplb.experts.num_experts == E // world + 1
        moe = whole_moe()
        moe_ep = ExpertParallel(shard_experts(moe.experts, placement, 0, rank, world), E, placement, 0, group,
                                max_tokens=MAX_TOKENS)
        received = []
        for i, tokens in enumerate(ROUNDS[world]):
            x, w, ids = batch(tokens[rank], 100 * i + rank)
            shared = torch.randn(x.shape[0], D)
            want = whole(x, w, ids)
            for ep in (plain, eplb):
                got = ep.forward(x, w, ids)
                assert got.shape == (tokens[rank], D) and got.dtype == torch.float32
                torch.testing.assert_close(got, want, **TOL)
                torch.testing.assert_close(ep.forward_fixed(x, w, ids), want, **TOL)
                with invariant.mode(True):
                    exact = whole(x, w, ids)
                    assert torch.equal(ep.forward(x, w, ids), exact), (rank, i)
                    assert torch.equal(ep.forward_fixed(x, w, ids), exact), (rank, i)
                    assert torch.equal(ep.forward(x, w, ids, shared), whole(x, w, ids, shared))
            received.append((plain.received_rows(ids), eplb.received_rows(ids)))
            # the whole layer: router and shared expert on this rank's tokens, experts over the group
            input_ids = torch.randint(0, 50, (tokens[rank],), generator=torch.Generator().manual_seed(rank))
            with invariant.mode(True):
                want = moe(x, input_ids)
                for fixed in (False, True):
                    moe_ep.fixed_capacity = fixed
                    assert torch.equal(moe_forward(moe, moe_ep, x, input_ids), want), (rank, i, fixed)
        if rank == 0:
            torch.save(received, f"{out}/received.pt")
    finally:
        parallel_state.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_one_process_on_every_rank(world, tmp_path):
    torch.multiprocessing.spawn(ep_rank_main, args=(world, f"file://{tmp_path / 'store'}", str(tmp_path)),
                                nprocs=world)
    for (before, after), tokens in zip(torch.load(tmp_path / "received.pt"), ROUNDS[world], strict=True):
        assert before.shape == after.shape == (world,)
        assert int(before.sum()) == int(after.sum()) == sum(tokens) * K  # every pair received once
        ratio_before = float(before.max()) / float(before.float().mean())
        ratio_after = float(after.max()) / float(after.float().mean())
        print(f"\nworld {world}, tokens {tokens}: rows received per rank {before.tolist()} -> {after.tolist()} "
              f"with EPLB, max/mean {ratio_before:.2f} -> {ratio_after:.2f}")
        assert after.max() < before.max()


# one process (EP group of one): routing, sharding and the refusals, no spawn


def test_route_is_eplbs_rule_shifted_per_rank():
    placement = rebalance_experts(SKEW[None].double(), E + 2, 1)
    hot = int(SKEW.argmax())
    assert placement.replica_counts[0, hot] >= 2
    local = shard_experts(whole_experts(), placement, 0, 0, 1)
    routes = [ExpertParallel(local, E, placement, token_offset=r) for r in range(2)]
    ids = batch(12, 3)[2]
    assert torch.equal(routes[0].route(ids), route_to_physical(ids, placement, 0))
    # decode, one token a rank: rank r's copy of the hot expert takes replica r
    one = torch.tensor([[hot, hot + 1]])
    assert [int(ep.route(one)[0, 0]) for ep in routes] == placement.logical_to_physical[0, hot, :2].tolist()


def test_shard_experts_copies_each_slots_logical_expert():
    whole = whole_experts()
    placement = skewed_placement(2, ROUNDS[2])
    for rank in range(2):
        local = shard_experts(whole, placement, 0, rank, 2)
        experts = placement.gpu_experts(0, rank)
        assert (local.num_experts, local.first_expert, local.num_global) == (5, 0, 6)
        for name in ("w1", "w2", "w3"):
            assert torch.equal(getattr(local, name), getattr(whole, name)[experts])


def test_one_rank_group_matches_experts_with_replicas_and_an_empty_batch():
    whole = whole_experts()
    placement = rebalance_experts(SKEW[None].double(), E + 3, 1)
    ep = ExpertParallel(shard_experts(whole, placement, 0, 0, 1), E, placement, max_tokens=MAX_TOKENS)
    x, w, ids = batch(13, 1)
    with invariant.mode(True):
        assert torch.equal(ep.forward(x, w, ids), whole(x, w, ids))
        assert torch.equal(ep.forward_fixed(x, w, ids), whole(x, w, ids))
    assert ep.forward(x[:0], w[:0], ids[:0]).shape == (0, D)
    assert ep.forward_fixed(x[:0], w[:0], ids[:0]).shape == (0, D)
    assert ep.received_rows(ids).tolist() == [13 * K]


def test_fp4_experts_are_sharded_as_shipped():
    """Packed FP4 codes and their E8M0 scales copied per slot: replicas included, the layer's output."""
    torch.manual_seed(0)
    whole = Experts(D, INTER, E, LIMIT, torch.float32, QuantSpec(block_size=(128, 128), fp4_experts=True))
    for name in ("w1", "w2", "w3"):
        getattr(whole, name).copy_(torch.randint(-128, 127, getattr(whole, name).shape, dtype=torch.int8))
        getattr(whole, f"{name}_scale").view(torch.uint8).copy_(
            torch.randint(115, 130, getattr(whole, f"{name}_scale").shape, dtype=torch.uint8))
    placement = rebalance_experts(SKEW[None].double(), E + 2, 1)
    ep = ExpertParallel(shard_experts(whole, placement, 0, 0, 1), E, placement, max_tokens=MAX_TOKENS)
    assert ep.experts.w1.dtype == torch.int8 and ep.experts.w1_scale.dtype == whole.w1_scale.dtype
    x, w, ids = batch(11, 4)
    with invariant.mode(True):
        assert torch.equal(ep.forward(x, w, ids), whole(x, w, ids))
        assert torch.equal(ep.forward_fixed(x, w, ids), whole(x, w, ids))


def test_a_new_placement_is_routed_in_place():
    """Rebalancing between steps: the routing tables are overwritten where they are (a captured graph
    keeps reading them), the caller copies the slots' new weights; the output stays the layer's."""
    whole = whole_experts()
    old = rebalance_experts(SKEW[None].double(), E + 3, 1)
    new = rebalance_experts(SKEW.flip(0)[None].double(), E + 3, 1)
    ep = ExpertParallel(shard_experts(whole, old, 0, 0, 1), E, old, max_tokens=MAX_TOKENS)
    tables = (ep.logical_to_physical.data_ptr(), ep.replica_counts.data_ptr())
    moved = shard_experts(whole, new, 0, 0, 1)
    for name in ("w1", "w2", "w3"):
        getattr(ep.experts, name).copy_(getattr(moved, name))
    ep.set_placement(new, 0)
    assert (ep.logical_to_physical.data_ptr(), ep.replica_counts.data_ptr()) == tables
    x, w, ids = batch(13, 2)
    assert torch.equal(ep.route(ids), route_to_physical(ids, new, 0))
    assert not torch.equal(ep.route(ids), route_to_physical(ids, old, 0))
    with invariant.mode(True):
        assert torch.equal(ep.forward(x, w, ids), whole(x, w, ids))
        assert torch.equal(ep.forward_fixed(x, w, ids), whole(x, w, ids))
    with pytest.raises(ValueError, match="12 slots on each of 1 ranks, expected 8 in 11"):
        ep.set_placement(rebalance_experts(SKEW[None].double(), E + 4, 1), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_rows_carry_their_ids_bit_for_bit(dtype):
    rows = torch.randn(5, 64).to(dtype)
    ids = torch.tensor([0, 7, 300, 70000, 2 ** 31 - 1])
    buf = pack_rows(rows, ids)
    assert buf.shape == (5, 64 + 4 // rows.element_size()) and buf.dtype == dtype
    got, got_ids = unpack_rows(buf.clone(), 64)
    assert torch.equal(got.view(torch.uint8), rows.view(torch.uint8)) and torch.equal(got_ids, ids)
    with pytest.raises(ValueError, match="aligned int32 id"):
        pack_rows(torch.zeros(2, 63, dtype=torch.bfloat16), ids[:2])


def test_bad_inputs_are_refused_by_name():
    whole = whole_experts()
    with pytest.raises(ValueError, match="experts: expected this rank's 8 slots"):
        ExpertParallel(shard_experts(whole, None, 0, 0, 2), E)  # 4 slots for a group of one
    ep = ExpertParallel(shard_experts(whole, None, 0, 0, 1), E, max_tokens=4)
    x, w, ids = batch(5, 0)
    with pytest.raises(ValueError, match="max_tokens=4"):
        ep.forward_fixed(x, w, ids)
    with pytest.raises(ValueError, match="weights"):
        ep.forward(x, w[:, :1], ids)
    with pytest.raises(ValueError, match="max_tokens: forward_fixed needs"):
        ExpertParallel(shard_experts(whole, None, 0, 0, 1), E).forward_fixed(x, w, ids)
    with pytest.raises(ValueError, match="forward_fixed needs num_global = 9"):
        ExpertParallel(whole, E, max_tokens=8).forward_fixed(x, w, ids)  # the whole module: no drop id
    with pytest.raises(ValueError, match="placement"):
        ExpertParallel(whole, E, rebalance_experts(SKEW[None].double(), E, 2))


# GPU: the grouped-GEMM local compute (bf16), the fixed-capacity exchange inside a CUDA graph, NCCL

GPU_E, GPU_D, GPU_INTER, GPU_K, GPU_TOKENS = 16, 256, 128, 4, 32


def gpu_layer(world: int, rank: int) -> tuple[Experts, ExpertParallel]:
    """bf16 experts on this rank's GPU, an EPLB placement with one replica slot per rank."""
    torch.manual_seed(0)
    whole = Experts(GPU_D, GPU_INTER, GPU_E, LIMIT, torch.bfloat16).cuda()
    for p in whole.parameters():
        p.data.normal_(0, 0.05)
    load = torch.arange(GPU_E, 0, -1, dtype=torch.float64) ** 2  # expert 0 hottest
    placement = rebalance_experts(load[None], GPU_E + world, world)
    ep = ExpertParallel(shard_experts(whole, placement, 0, rank, world), GPU_E, placement,
                        group=parallel_state.dp_group(), max_tokens=GPU_TOKENS)
    return whole, ep


def gpu_batch(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, GPU_D, generator=g).to("cuda", torch.bfloat16)
    w = (torch.rand(tokens, GPU_K, generator=g) + 0.1).cuda()
    probs = torch.arange(GPU_E, 0, -1, dtype=torch.float32).expand(max(tokens, 1), GPU_E)
    ids = torch.multinomial(probs, GPU_K, generator=g)[:tokens].cuda()
    return x, w, ids


def check_gpu_rank(whole: Experts, ep: ExpertParallel, tokens: int, seed: int) -> None:
    """Eager exchanges against one process (bf16 GEMMs over other row groupings: 2e-2), then
    forward_fixed captured in a CUDA graph and replayed on new inputs (bit for bit the eager call)."""
    x, w, ids = gpu_batch(tokens, seed)
    shared = torch.randn_like(x)
    got = [ep.forward(x, w, ids, shared), ep.forward_fixed(x, w, ids, shared)]
    for g in got:
        assert g.shape == (tokens, GPU_D) and g.dtype == torch.bfloat16
        if tokens:  # (an idle rank only joins the collectives)
            torch.testing.assert_close(g.float(), whole(x, w, ids, shared).float(), rtol=2e-2, atol=2e-2)
    sx, sw, sids = gpu_batch(GPU_TOKENS, seed + 1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles, NCCL communicators
        for _ in range(2):
            ep.forward_fixed(sx, sw, sids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ep.forward_fixed(sx, sw, sids)
    for s in (seed + 2, seed + 3):
        for static, new in zip((sx, sw, sids), gpu_batch(GPU_TOKENS, s)):
            static.copy_(new)
        graph.replay()
        assert torch.equal(out, ep.forward_fixed(sx, sw, sids))


@pytest.mark.gpu
def test_fixed_capacity_exchange_replays_in_a_cuda_graph():
    whole, ep = gpu_layer(1, 0)
    check_gpu_rank(whole, ep, 20, 0)


def ep_gpu_rank_main(rank: int, init_method: str) -> None:
    parallel_state.init_parallel(ParallelConfig(data_parallel_size=2), rank, "cuda", init_method, timeout_s=120)
    try:
        whole, ep = gpu_layer(2, rank)
        check_gpu_rank(whole, ep, [0, 23][rank], 10 * rank)  # rank 0 idle in the eager checks
    finally:
        parallel_state.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_expert_parallel_on_two_gpus_over_nccl(tmp_path):
    torch.multiprocessing.spawn(ep_gpu_rank_main, args=(f"file://{tmp_path / 'store'}",), nprocs=2)
