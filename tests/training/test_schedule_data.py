"""training/train_demo.py's learning-rate schedule, --total-steps auto and packed-window order (no model)."""
from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from training.train_demo import DataState, PackedWindows, auto_total_steps, lr_at, parse_args


def _args(**kw):
    return argparse.Namespace(**{"lr": 1e-3, "warmup_steps": 10, "min_lr_ratio": 0.1, **kw})


def test_warmup_then_cosine_to_the_floor():
    a = _args()
    assert lr_at(1, a, 110) == pytest.approx(1e-4) and lr_at(10, a, 110) == pytest.approx(1e-3)
    assert lr_at(60, a, 110) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))        # half-way down the cosine
    assert lr_at(110, a, 110) == pytest.approx(1e-4) and lr_at(500, a, 110) == pytest.approx(1e-4)
    lrs = [lr_at(s, a, 110) for s in range(10, 111)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))
    assert lr_at(1, _args(warmup_steps=0), 3) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 3)))


def test_auto_total_steps_uses_the_median_of_steps_6_to_15():
    times = [9.0] * 5 + [0.5] * 9 + [30.0]                                     # slow start, one outlier
    assert auto_total_steps(times, 10, 15) == 1200                             # 600 s / 0.5 s
    assert auto_total_steps(times, 0.01, 15) == 16
    with pytest.raises(ValueError):
        auto_total_steps(times[:10], 10, 10)


def test_windows_cover_each_epoch_once_in_a_seeded_order_and_resume_mid_epoch():
    tokens = np.arange(7 * 4 + 3, dtype=np.uint16)                             # 7 whole windows of 4
    w = PackedWindows(tokens, 4, 3, seed=5)
    firsts = [int(r[0]) // 4 for _ in range(7) for r in w.next_batch()]      # 21 windows = 3 epochs
    assert [sorted(firsts[i:i + 7]) for i in (0, 7, 14)] == [list(range(7))] * 3
    assert firsts[:7] != firsts[7:14]                                          # a new order per epoch
    again = PackedWindows(tokens, 4, 3, seed=5, state=DataState(1, 2))         # resume: epoch 1, third window
    assert [int(r[0]) // 4 for r in again.next_batch()] == firsts[9:12]
    with pytest.raises(ValueError, match="--seq-len"):
        PackedWindows(tokens[:3], 4, 1, seed=0)


def test_bad_settings_name_the_flag():
    with pytest.raises(SystemExit):
        parse_args(["--data", "d", "--out", "o", "--total-steps", "many"])
    with pytest.raises(SystemExit):
        parse_args(["--data", "d", "--out", "o", "--seq-len", "100"])
