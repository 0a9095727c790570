import random

from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.request import Request
from deepinfer.sampling_params import SamplingParams


def test_allocate_holds_exactly_the_blocks_for_the_longest_length_asked():
    """Random growth (one token at a time, or jumps), shrinking asks and frees: a request holds
    blocks_for(the largest length it was granted) for every ratio, an ask that would need more
    than is free changes nothing, and free + held == total throughout."""
    rng = random.Random(0)
    kv = KVCacheManager(num_slots=3, num_blocks={4: 12, 128: 3}, block_size=2)
    reqs = [Request(str(i), [1], SamplingParams()) for i in range(4)]
    granted = {r.request_id: 0 for r in reqs}
    for _ in range(3000):
        r = rng.choice(reqs)
        if rng.random() < 0.03:
            kv.free(r)
            granted[r.request_id] = 0
            continue
        n = granted[r.request_id] + (1 if rng.random() < 0.8 else rng.randint(-20, 60))
        before = ({m: list(t) for m, t in r.block_tables.items()}, r.slot, kv.num_free())
        ok = kv.allocate(r, max(n, 0))
        if ok:
            granted[r.request_id] = max(granted[r.request_id], n)
        else:
            assert ({m: list(t) for m, t in r.block_tables.items()}, r.slot, kv.num_free()) == before
        want = kv.blocks_for(granted[r.request_id])
        if r.slot is not None:
            assert {m: len(r.block_tables.get(m, [])) for m in want} == want
        slots, free = kv.num_free()
        held = [q for q in reqs if q.slot is not None]
        assert slots + len(held) == 3
        for m, total in kv.num_blocks.items():
            assert free[m] + sum(len(q.block_tables.get(m, [])) for q in held) == total


def test_requests_compare_by_identity():
    """Scheduler lists find a request by identity: two requests with equal fields are different requests
    (and membership tests do not compare every field of every request)."""
    a, b = (Request("x", [1, 2], SamplingParams()) for _ in range(2))
    assert a != b and a == a and len({a, b}) == 2
    assert [a].count(b) == 0
