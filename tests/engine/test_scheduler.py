"""Scheduler + block manager on the CPU, with a fake model that always samples token 7."""
import random

from deepinfer.engine.kv_manager import KVCacheManager, plan_capacity
from deepinfer.engine.outputs import ModelOutput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams


def _fake_execute(so):
    return ModelOutput({c.request_id: [7] * c.num_samples for c in so.chunks if c.num_samples})


def _run(sched: Scheduler, max_steps=10_000):
    steps = []
    while sched.has_unfinished():
        so = sched.schedule()
        assert so.chunks, "no progress"
        steps.append(so)
        sched.update(so, _fake_execute(so))
        assert len(steps) < max_steps
    return steps


def _req(i, prompt_len, max_tokens):
    return Request(str(i), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_token_budget_chunked_prefill_and_max_num_seqs():
    kv = KVCacheManager(num_slots=8, num_blocks={4: 100, 16: 100}, block_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=10, max_model_len=1000)
    reqs = [_req(i, 23, 3) for i in range(3)]
    for r in reqs:
        sched.add(r)
    steps = _run(sched)
    assert all(so.num_tokens <= 10 for so in steps)
    assert all(len(so.chunks) <= 2 for so in steps)
    first = [c for so in steps for c in so.chunks if c.request_id == "0"]
    assert [len(c.token_ids) for c in first][:3] == [10, 10, 3]  # a 23-token prompt in three chunks
    assert [c.start for c in first][:3] == [0, 10, 20]
    assert all(r.output_token_ids == [7, 7, 7] and r.finish_reason == "length" for r in reqs)
    assert kv.all_free()


def test_preemption_recomputes_and_loses_nothing():
    # 6 blocks of 4 ratio-4 entries = 96 tokens of compressed state for everyone together
    kv = KVCacheManager(num_slots=4, num_blocks={4: 6}, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96)
    reqs = [_req(i, 20, 30) for i in range(4)]
    for r in reqs:
        sched.add(r)
    _run(sched)
    assert sched.num_preemptions > 0
    assert all(r.output_token_ids == [7] * 30 for r in reqs)
    assert kv.all_free()


def test_random_workload_never_leaks_blocks():
    rng = random.Random(0)
    kv = KVCacheManager(num_slots=5, num_blocks={4: 12, 16: 3}, block_size=4)
    sched = Scheduler(kv, max_num_seqs=5, max_num_batched_tokens=37, max_model_len=160)
    reqs = [_req(i, rng.randint(1, 60), rng.randint(1, 40)) for i in range(40)]
    for r in reqs:
        sched.add(r)
    _run(sched)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    assert kv.all_free()


def test_plan_capacity_splits_budget_evenly_in_tokens():
    slots, blocks = plan_capacity(10_000, slot_bytes=100, block_bytes={4: 40, 128: 10}, block_size=8,
                                  max_num_seqs=16, expected_len=32)
    assert slots == 16  # each slot comes with blocks for 32 tokens (~140 bytes): 16 * 240 fits
    # 8400 bytes left buy ~6668 tokens of each ratio: 6668 // (8*4) and 6668 // (8*128) blocks
    assert blocks == {4: 208, 128: 6}
    assert slots * 100 + blocks[4] * 40 + blocks[128] * 10 <= 10_000


def test_plan_capacity_trades_slots_for_block_room_when_memory_is_tight():
    slots, blocks = plan_capacity(10_000, slot_bytes=100, block_bytes={4: 40, 128: 10}, block_size=8,
                                  max_num_seqs=256, expected_len=1024)
    assert slots == 7  # 10000 // (100 + 1024 * 1.2597)
    assert blocks[4] * 32 >= 7 * 1024 * 0.99


def _assert_arrays_match_requests(kv: KVCacheManager, sched: Scheduler) -> None:
    """The cache manager's per-slot table arrays hold exactly the block tables of the requests owning the slots
    (zeros elsewhere)."""
    held = {r.slot: r for r in sched.running if r.slot is not None}
    assert not any(r.slot is not None for r in sched.waiting)
    for slot in range(kv.num_slots):
        for m in kv.num_blocks:
            want = held[slot].block_tables.get(m, []) if slot in held else []
            n, row = kv.table_len[m][slot], kv.tables[m][slot]
            assert n == len(want) and row[:n].tolist() == want and not row[n:].any(), (slot, m)


def _assert_decode_rows_match_chunks(kv: KVCacheManager, so) -> None:
    """When a step is made, each chunk's block tables cover the entries its tokens close, and the step's
    DecodeRows are its chunks' slots, positions, tokens and tables."""
    for c in so.chunks:
        for m in kv.num_blocks:
            assert len(c.block_tables.get(m, [])) * kv.block_size >= (c.start + len(c.token_ids)) // m
    d = so.decode
    if d is None:
        assert not all(len(c.token_ids) == 1 and c.num_samples == 1 for c in so.chunks)
        return
    assert d.slots.tolist() == [c.slot for c in so.chunks]
    assert d.positions.tolist() == [c.start for c in so.chunks]
    assert d.tokens.tolist() == [c.token_ids[0] for c in so.chunks]
    assert all(t.shape[1] >= 1 for t in d.tables.values())
    for b, c in enumerate(so.chunks):
        for m in kv.num_blocks:
            n = d.table_len[m][b]
            assert d.tables[m][b, :n].tolist() == c.block_tables.get(m, [])[:n] and not d.tables[m][b, n:].any()
            assert n == len(c.block_tables.get(m, []))


def test_slot_arrays_match_the_request_objects_under_random_workloads_with_preemption_and_forks():
    """Random prompts (some n > 1: forks of the leader's prefill), stop tokens, a cache small enough to preempt,
    steps scheduled ahead as the async engine does: after every step the array-backed state equals the objects'."""
    for seed in range(4):  # odd seeds: every request admitted at once, so most steps are scheduled ahead
        rng = random.Random(seed)
        # eos: P(sampling the stop token)
        slots, n, eos, blocks = (6, 30, 0.25, {4: 14, 16: 4}) if seed % 2 == 0 else (24, 10, 0.03, {4: 64, 16: 16})
        kv = KVCacheManager(num_slots=slots, num_blocks=blocks, block_size=4)
        sched = Scheduler(kv, max_num_seqs=slots, max_num_batched_tokens=41, max_model_len=160)
        reqs = []
        for i in range(n):
            leader = Request(str(i), list(range(1, rng.randint(2, 60))),
                             SamplingParams(max_tokens=rng.randint(1, 40)), eos_token_id=0)
            leader.siblings = [Request(f"{i}.{j}", list(leader.prompt_token_ids), leader.params, eos_token_id=0,
                                       sample_index=j) for j in range(1, rng.choice([1, 1, 2, 3]))]
            reqs += [leader] + leader.siblings
            sched.add(leader)
        inflight, steps, ahead = None, 0, 0
        while sched.has_unfinished():
            if inflight is None:
                so = sched.schedule()
                _assert_decode_rows_match_chunks(kv, so)
            else:
                so = inflight
            assert so.chunks
            inflight = sched.schedule_ahead(so) if seed else None
            if inflight is not None:
                ahead += 1
                _assert_decode_rows_match_chunks(kv, inflight)
            sched.update(so, ModelOutput({c.request_id: [0 if rng.random() < eos else 7] * c.num_samples
                                          for c in so.chunks if c.num_samples}))
            _assert_arrays_match_requests(kv, sched)
            steps += 1
            assert steps < 10_000
        assert (sched.num_preemptions > 0) if seed % 2 == 0 else (ahead >= 10), (sched.num_preemptions, ahead)
        assert all(r.finished for r in reqs)
        assert kv.all_free() and not any(t.any() for t in kv.tables.values())


def test_decode_rows_keep_a_table_column_where_no_request_holds_a_block():
    """Short requests hold no ratio-128 block: their DecodeRows table for 128 still has one (zero) column, where the
    decode graphs write the scratch block of their padding rows."""
    kv = KVCacheManager(num_slots=4, num_blocks={4: 8, 128: 2}, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    for i in range(3):
        sched.add(_req(i, 5, 4))
    so = sched.schedule()
    sched.update(so, _fake_execute(so))
    d = sched.schedule().decode
    assert d is not None and d.tables[128].shape == (3, 1) and not d.tables[128].any()
    assert d.table_len[128].tolist() == [0, 0, 0] and d.tables[4].shape == (3, 1)
