import pytest

from deepinfer.state.forward_batch import SeqChunk, build_forward_batch


def test_window_keys_come_from_this_step_or_the_ring():
    # request 0: 3 cached tokens + 2 new; request 1: 4 new tokens from position 0; window 4
    b = build_forward_batch([SeqChunk(5, 3, [7, 8]), SeqChunk(2, 0, [1, 2, 3, 4])], 4, set(), 16, "cpu")
    assert b.positions.tolist() == [3, 4, 0, 1, 2, 3]
    # token 0 (pos 3): keys at positions 0,1,2 from the ring of slot 5, itself new
    assert b.win_ring[0].tolist() == [20, 21, 22, -1] and b.win_new[0].tolist() == [-1, -1, -1, 0]
    assert b.win_new[1].tolist() == [-1, -1, 0, 1] and b.win_ring[1].tolist() == [21, 22, -1, -1]
    # token 2 (pos 0 of request 1): only itself
    assert b.win_new[2].tolist() == [-1, -1, -1, 2] and b.win_ring[2].tolist() == [-1, -1, -1, -1]
    assert b.logits_idx.tolist() == [1, 5]
    # every token of request 1 and both of request 0 stay in the ring
    assert sorted(b.ring_src.tolist()) == [0, 1, 2, 3, 4, 5]


def test_compress_plan_closes_entries_and_tracks_visibility():
    # paged entries: block size 2, the request's ratio-4 entries live in blocks 5 and 3
    b = build_forward_batch([SeqChunk(1, 6, [9, 9, 9, 9, 9], {4: [5, 3]})], 8, {(4, True)}, 2, "cpu")
    p = b.plans[(4, True)]
    # positions 6..10: entry 1 closes at position 7 (pooling positions 0..7)
    assert p.rope_pos.tolist() == [4] and p.dst.tolist() == [5 * 2 + 1]
    assert p.src_carry[0].tolist()[:6] == [8, 9, 10, 11, 12, 13] and p.src_new[0].tolist()[6:] == [0, 1]
    assert p.visible.tolist() == [1, 2, 2, 2, 2]
    assert p.addr.tolist() == [[10, 11]]
    # a block table too short for the entries the step closes is refused
    with pytest.raises(ValueError, match="block table"):
        build_forward_batch([SeqChunk(1, 6, [9, 9, 9], {4: []})], 8, {(4, True)}, 2, "cpu")
    # the last 8 positions (3..10) stay in the carry; only 6..10 are new here
    assert p.carry_src.tolist() == [0, 1, 2, 3, 4]


def test_no_replay_plan_without_replay_from():
    """replay_from 0 (no bounded replay): a short context's window reaching below position 0 is no
    reason for a replay plan; the decode-graph input layout must not depend on the context length."""
    for start in (3, 200):
        b = build_forward_batch([SeqChunk(0, start, [7])], 128, set(), 16, "cpu")
        assert b.replay is None
    b = build_forward_batch([SeqChunk(0, 10, [7], replay_from=5)], 128, set(), 16, "cpu")
    assert b.replay is not None


def test_window_tables_are_the_same_on_the_host_and_on_the_device_path():
    # build_forward_batch expands the [T, window] tables in numpy on the host and in torch where a
    # GPU reads them: both branches of _gather_plan must agree (here torch runs on the CPU)
    import numpy as np
    import torch

    from deepinfer.state.forward_batch import _gather_plan

    rng = np.random.default_rng(0)
    for T, span in ((1, 128), (7, 4), (40, 16)):
        pos = rng.integers(0, 300, T)
        start = pos - rng.integers(0, 20, T)
        tok, slot, lo = np.arange(T), rng.integers(0, 8, T), rng.integers(0, 30, T)
        for low in (None, lo):
            host = _gather_plan(tok, pos, start, slot, span, span, low)
            dev = _gather_plan(*map(torch.from_numpy, (tok, pos, start, slot)), span, span,
                               None if low is None else torch.from_numpy(low))
            for h, d in zip(host, dev):
                assert h.dtype == np.int64 and torch.equal(torch.from_numpy(h), d)


def test_entry_addresses_follow_each_block_table_and_refuse_short_ones():
    """addr[b, w] = table_b[w // bs] * bs + w % bs for every visible entry w (random tables, some empty),
    and a table that does not cover a chunk's closed entries is refused, naming its slot."""
    import random

    from deepinfer.state.forward_batch import FixedShape

    rng = random.Random(0)
    bs, m = 4, 2
    chunks = []
    for b in range(9):
        start = rng.choice([0, 1, 7, 30])
        blocks = -(-((start + 1) // m) // bs)
        chunks.append(SeqChunk(b, start, [3], {m: rng.sample(range(100), blocks)} if blocks else {}))
    batch = build_forward_batch(chunks, 4, {(m, False)}, bs, "cpu", fixed=FixedShape({m: 0}, {m: 16}))
    addr = batch.plans[(m, False)].addr
    assert addr.shape == (9, 16)
    for b, c in enumerate(chunks):
        for w in range((c.start + 1) // m):
            assert addr[b, w] == c.block_tables[m][w // bs] * bs + w % bs
    chunks[5] = SeqChunk(5, 30, [3], {m: [1]})
    with pytest.raises(ValueError, match="slot 5: block table for ratio 2 has 1 blocks, needs 4"):
        build_forward_batch(chunks, 4, {(m, False)}, bs, "cpu")


def test_ring_early_only_where_no_written_row_is_read_by_the_step():
    """ring_early: every request has at most ring_slack + 1 tokens and no replay (the ring rows written are
    then below every query's window)."""
    def plan(lens, slack, replay_from=0):
        chunks = [SeqChunk(i, 50, list(range(n)), {}, replay_from=replay_from) for i, n in enumerate(lens)]
        return build_forward_batch(chunks, 8, set(), 4, "cpu", ring_slack=slack)

    assert plan([1, 1, 1], 0).ring_early
    assert plan([2, 1], 1).ring_early and plan([3, 2], 2).ring_early
    assert not plan([2, 1], 0).ring_early and not plan([5], 3).ring_early
    b = plan([2], 1, replay_from=48)
    assert b.replay is not None and not b.ring_early
