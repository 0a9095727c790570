"""Engram's n-gram windows from the per-slot device history (HistoryPlan) equal the host windows
built from each chunk's prev_tokens, bit for bit, and so do the hashed rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.layers.engram_hash import EngramHashParams, history_windows, ngram_rows
from deepinfer.state.forward_batch import SeqChunk, build_forward_batch


def _schedule(rng, lengths: list[int]) -> list[list[tuple[int, int, int]]]:
    """Steps of (request, start, count): each request advances by a random chunk (decodes of 1 mixed in)."""
    done, steps = [0] * len(lengths), []
    while any(d < n for d, n in zip(done, lengths)):
        step = []
        for r, n in enumerate(lengths):
            if done[r] < n and rng.random() < 0.8:
                k = int(min(n - done[r], rng.choice([1, 1, 2, 3, 7, 20])))
                step.append((r, done[r], k))
                done[r] += k
        if step:
            steps.append(step)
    return steps


@pytest.mark.parametrize("max_ngram", [2, 3, 4, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_history_windows_and_rows_equal_host_ones(max_ngram, seed):
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 60, size=5)]
    seqs = [rng.integers(0, 50, size=n).tolist() for n in lengths]
    spans = [[(int(s0), int(k))] if n > 12 and rng.random() < 0.6 else []
             for n, s0, k in zip(lengths, rng.integers(0, 8, 5), rng.integers(1, 5, 5))]
    slots = rng.permutation(8)[:5].tolist()
    params = EngramHashParams.build([1, 3], [4000, 5000], max_ngram, 2, 60, 50, pad_id=int(rng.integers(50)))
    history = torch.full((8, max_ngram), -1, dtype=torch.long)
    history[:] = torch.from_numpy(rng.integers(0, 50, size=history.shape))  # stale rows of earlier requests
    for step in _schedule(rng, lengths):
        chunks = [SeqChunk(slots[r], s, seqs[r][s:s + k], prev_tokens=seqs[r][max(0, s - 7):s],
                           image_spans=spans[r]) for r, s, k in step]
        host = build_forward_batch(chunks, 8, set(), 4, "cpu", history=max_ngram)
        dev = build_forward_batch(chunks, 8, set(), 4, "cpu", device_history=max_ngram)
        assert host.history is None and dev.token_windows is None
        windows = history_windows(dev.input_ids, dev.image_mask, history, dev.history)
        want = host.token_windows.clone()
        if host.window_mask is not None:
            want[~host.window_mask] = -1
        # the host marks missing tokens -1 and images by mask; both block the same columns
        blocked = torch.cummax((want < 0).to(torch.uint8), dim=-1).values.bool()
        assert torch.equal(torch.cummax((windows < 0).to(torch.uint8), dim=-1).values.bool(), blocked)
        assert torch.equal(windows.masked_fill(blocked, -1), want.masked_fill(blocked, -1))
        assert torch.equal(ngram_rows(windows, params),
                           ngram_rows(host.token_windows, params, mask=host.window_mask))


def test_history_plan_fills_placeholder_inputs_on_the_device():
    """The windows read the step's input ids as they are when the forward runs, so an id written
    into input_ids after planning (a placeholder filled from the step before) is what is hashed."""
    history = torch.full((2, 3), -1, dtype=torch.long)
    first = build_forward_batch([SeqChunk(1, 0, [5, 6, 7])], 8, set(), 4, "cpu", device_history=3)
    assert history_windows(first.input_ids, None, history, first.history).tolist() == [
        [5, -1, -1], [6, 5, -1], [7, 6, 5]]
    nxt = build_forward_batch([SeqChunk(1, 3, [-1])], 8, set(), 4, "cpu", device_history=3)
    nxt.input_ids[0] = 9  # filled on the device after planning
    assert history_windows(nxt.input_ids, None, history, nxt.history).tolist() == [[9, 7, 6]]


def test_running_a_step_twice_reads_and_stores_the_same():
    """A decode graph's capture runs its first step eagerly (warm-up) and then replays it: the
    history is addressed by position, so the second run reads the same windows and stores the same rows."""
    history = torch.full((3, 4), -1, dtype=torch.long)
    first = build_forward_batch([SeqChunk(2, 0, [5, 6, 7, 8, 4])], 8, set(), 4, "cpu", device_history=4)
    history_windows(first.input_ids, None, history, first.history)
    step = build_forward_batch([SeqChunk(2, 5, [3])], 8, set(), 4, "cpu", device_history=4)
    once = history_windows(step.input_ids, None, history, step.history)
    after = history.clone()
    assert once.tolist() == [[3, 4, 8, 7]]
    assert torch.equal(history_windows(step.input_ids, None, history, step.history), once)
    assert torch.equal(history, after)
