"""state/device_plan.py: a fixed-shape step of q tokens a request planned on the device from tensors equals
build_forward_batch's plan of the same chunks (what the speculative graphs run), tensor for tensor."""
import numpy as np
import pytest
import torch

from deepinfer.state.device_plan import plan_on_device, table_width
from deepinfer.state.forward_batch import FixedShape, SeqChunk, build_forward_batch
from deepinfer.worker.cuda_graph import _tensors


@pytest.mark.parametrize("kinds,window,history,slack,q", [({(4, True), (128, False)}, 8, 3, 5, 6),
                                                         ({(4, True), (2, False)}, 16, 0, 2, 3),
                                                         ({(1, False), (4, False)}, 4, 2, 3, 1),
                                                         (set(), 4, 2, 1, 2)])
def test_device_plan_equals_the_forward_batch_of_the_same_chunks(kinds, window, history, slack, q):
    rng = np.random.default_rng(len(kinds) + window + q)
    bs, B = 4, 11
    ratios = sorted({m for m, _ in kinds})
    slots = rng.permutation(40)[:B]
    starts = rng.integers(0, 700, B)
    starts[:3] = (0, 3 - q % 4, 128 - q)  # the first token, steps that close an entry of ratio 4 / 128
    starts = np.maximum(starts, 0)
    tokens = rng.integers(0, 1000, (B, q))
    visible = {m: max(64, 1 << int(((starts + q) // m).max() - 1).bit_length()) for m in ratios}
    fixed = FixedShape({m: 1000 + m for m in ratios}, visible)
    tables, chunks = {}, []
    for m in ratios:
        need = -(-((starts + q) // m) // bs)
        lens = need + rng.integers(0, 2, B)  # a table may hold one block more than its entries need
        tables[m] = np.zeros((B, max(table_width(visible[m], bs), int(lens.max()))), dtype=np.int64)
        for b in range(B):
            tables[m][b, :lens[b]] = rng.permutation(499)[:lens[b]] + 1  # (0: past the table)
        tables[m] = tables[m][:, :table_width(visible[m], bs)]
    for b in range(B):
        chunks.append(SeqChunk(int(slots[b]), int(starts[b]), tokens[b].tolist(),
                               {m: [int(x) for x in tables[m][b] if x] or [0] for m in ratios}))
    want = build_forward_batch(chunks, window, kinds, bs, "cpu", fixed=fixed, device_history=history,
                               ring_slack=slack)
    t = torch.from_numpy
    got = plan_on_device(t(tokens.reshape(-1)), t(starts), t(slots), {m: t(v) for m, v in tables.items()}, q, window,
                         kinds, bs, fixed, history, slack)
    w_named, g_named = _tensors(want), _tensors(got)
    assert [n for n, _ in g_named] == [n for n, _ in w_named]
    for (name, w), (_, g) in zip(w_named, g_named):
        assert tuple(w.shape) == tuple(g.shape), name
        assert torch.equal(w, g), name
    assert got.req_lens == want.req_lens and got.ring_early == want.ring_early
    assert got.replay is None and want.replay is None


def test_device_plan_refuses_steps_past_the_ring_slack():
    t = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="ring slack"):
        plan_on_device(t, t[:1], t[:1], {}, 3, 4, set(), 4, FixedShape({}, {}), 0, 1)
