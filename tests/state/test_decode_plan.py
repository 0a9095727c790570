"""state/decode_plan.py: a pure-decode step planned from arrays equals build_forward_batch's plan of the same
rows (what the decode graphs pack), tensor for tensor."""
import numpy as np
import pytest

from deepinfer.state.decode_plan import decode_inputs
from deepinfer.state.forward_batch import FixedShape, SeqChunk, build_forward_batch
from deepinfer.worker.cuda_graph import _tensors


@pytest.mark.parametrize("kinds,window,history,slack", [({(4, True), (128, False)}, 8, 3, 0),
                                                       ({(4, True), (2, False)}, 16, 0, 2),
                                                       (set(), 4, 2, 1)])
def test_decode_inputs_equal_the_forward_batch_of_the_same_rows(kinds, window, history, slack):
    rng = np.random.default_rng(len(kinds) + window)
    bs, B = 4, 13
    ratios = sorted({m for m, _ in kinds})
    slots = rng.permutation(40)[:B]
    pos = rng.integers(0, 700, B)
    pos[:3] = (0, 3, 127)  # the first token, and positions that close an entry of ratio 4 / 128
    tokens = np.where(rng.random(B) < 0.5, -1, rng.integers(0, 1000, B))
    tables, lens, chunks = {}, {}, []
    for m in ratios:
        need = -(-((pos + 1) // m) // bs)
        lens[m] = need + rng.integers(0, 2, B)  # a table may hold one block more than its entries need
        tables[m] = np.zeros((B, int(lens[m].max()) + 3), dtype=np.int64)
        for b in range(B):
            tables[m][b, :lens[m][b]] = rng.permutation(500)[:lens[m][b]]
    for b in range(B):
        chunks.append(SeqChunk(int(slots[b]), int(pos[b]), [int(tokens[b])],
                               {m: tables[m][b, :lens[m][b]].tolist() for m in ratios}))
    visible = {m: max(64, 1 << int(((pos + 1) // m).max() - 1).bit_length()) for m in ratios}
    fixed = FixedShape({m: 1000 + m for m in ratios}, visible)
    want = _tensors(build_forward_batch(chunks, window, kinds, bs, "cpu", fixed=fixed, device_history=history,
                                        ring_slack=slack))
    got = decode_inputs(tokens, slots, pos, tables, lens, window, kinds, bs, fixed, history, slack)
    assert len(got) == len(want)
    for (name, w), g in zip(want, got):
        assert tuple(w.shape) == g.shape, name
        assert np.array_equal(w.numpy(), g), name
