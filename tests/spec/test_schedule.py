"""Confidence-scheduled verification lengths: hand-computed cases, brute force, causality, limits."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from deepinfer.spec.schedule import (SPSTable, StepTimes, allocate, allocate_fixed, allocate_top_k,
                                     budget_from_stale, expected_throughput, survival, uniform_length)

# Step time 10 ms up to 2 tokens, 11 ms at 4, 16 ms at 8; max 10 tokens a step.
# Dense seconds: B=1,2: .010, 3: .0105, 4: .011, 5: .01225, 6: .0135, 7: .01475, 8: .016,
# past the last point proportional to B: 9: .018, 10: .020.
POINTS = [(1, 0.010), (2, 0.010), (4, 0.011), (8, 0.016)]
# Two requests, gamma 3: survival a0 = .9, .72, .36 and a1 = .6, .3, .3.
CONF = [[0.9, 0.8, 0.5], [0.6, 0.5, 1.0]]


def table():
    return SPSTable.from_points(POINTS, max_batch=10)


def jagged():
    """10 ms a step for 1-2 tokens, 12.5 ms for 3-6: the third token costs a jump, later ones are free."""
    return SPSTable.from_points([(1, 0.01), (2, 0.01), (3, 0.0125), (6, 0.0125)], max_batch=6)


def flat(max_batch=64):
    return SPSTable(np.full(max_batch + 1, 0.01))


def brute_force(conf, sps, max_len=None):
    """Best Theta over every prefix allocation l_r in 0..max_len_r, and the allocations reaching it."""
    conf = np.asarray(conf, dtype=np.float64)
    limits = [conf.shape[1]] * conf.shape[0] if max_len is None else list(max_len)
    best, arg = -1.0, []
    for ls in itertools.product(*(range(m + 1) for m in limits)):
        if len(ls) + sum(ls) > sps.max_batch:
            continue
        theta = expected_throughput(conf, ls, sps)
        if theta > best + 1e-12:
            best, arg = theta, [ls]
        elif abs(theta - best) <= 1e-12:
            arg.append(ls)
    return best, arg


def path(conf, sps, max_len=None):
    """Theta after the k best candidates, k = 0.. (the curve the greedy walks along)."""
    a = survival(conf)
    n = min(int(np.asarray(max_len).sum()) if max_len is not None else a.size, sps.max_batch - a.shape[0])
    return np.array([expected_throughput(conf, allocate_top_k(conf, k, max_len), sps) for k in range(n + 1)])


# --- SPSTable -----------------------------------------------------------------------------------

def test_sps_table_interpolates_time_linearly_and_scales_past_the_last_point():
    t = table()
    np.testing.assert_allclose(t.seconds[1:], [.010, .010, .0105, .011, .01225, .0135, .01475, .016, .018, .020])
    assert t(3) == pytest.approx(1 / 0.0105)
    assert t(9) == pytest.approx(1 / 0.018)              # tokens/s held at the last point's 8 / 16 ms
    np.testing.assert_allclose(t(np.array([1, 4, 10])), [100.0, 1 / 0.011, 50.0])
    below = SPSTable.from_points([(4, 0.02), (8, 0.03)], max_batch=8)
    assert below(1) == below(4) == pytest.approx(50.0)   # a step never costs less than the smallest measured
    assert below(0) == below(1)


@pytest.mark.parametrize("points, max_batch, field", [
    ([], 4, "points"), ([(2, 0.01), (2, 0.02)], 4, "points"), ([(1, 0.0)], 4, "points"),
    ([(1, float("nan"))], 4, "points"), ([(5, 0.01)], 4, "points"), ([(0, 0.01)], 4, "points"),
    ([(1, 0.01)], 0, "max_batch")])
def test_sps_table_refuses_bad_points_naming_the_field(points, max_batch, field):
    with pytest.raises(ValueError, match=field):
        SPSTable.from_points(points, max_batch)


def test_sps_table_refuses_queries_past_its_max_batch():
    with pytest.raises(ValueError, match="batch"):
        table()(11)


# --- hand-computed cases ------------------------------------------------------------------------

def test_allocate_hand_case_stops_at_the_first_non_improvement():
    # ranked: (0,1) .9, (0,2) .72, (1,1) .6, (0,3) .36, (1,2) .3, (1,3) .3
    # Theta: k=0 2*100=200; k=1 2.9/.0105=276.19; k=2 3.62/.011=329.09; k=3 4.22/.01225=344.49;
    #        k=4 4.58/.0135=339.26 (worse: stop at k=3)
    assert allocate(CONF, table()).tolist() == [2, 1]
    assert expected_throughput(CONF, [2, 1], table()) == pytest.approx(4.22 / 0.01225)
    assert allocate(CONF, table(), budget=2).tolist() == [2, 0]
    # max_len [1, 3]: (0,1) .9, (1,1) .6, (1,2) .3: k=2 3.5/.011 = 318.18; k=3 3.8/.01225 = 310.20, worse
    assert allocate(CONF, table(), max_len=[1, 3]).tolist() == [1, 1]


def test_allocate_accepts_torch_tensors():
    assert allocate(torch.tensor(CONF), table(), max_len=torch.tensor([3, 3])).tolist() == [2, 1]


def test_three_requests_with_limits_and_budget_on_a_flat_table():
    conf = [[1.0, 1.0, 1.0], [0.5, 0.5, 0.5], [0.8, 0.1, 0.0]]
    # flat SPS: Theta grows with every candidate of a > 0; (2,3) has a = 0 and stops the greedy
    assert allocate(conf, flat(), max_len=[1, 3, 3]).tolist() == [1, 3, 2]
    # budget 3: (0,1) 1.0, (2,1) .8, (1,1) .5
    assert allocate(conf, flat(), budget=3, max_len=[1, 3, 3]).tolist() == [1, 1, 1]
    assert allocate_top_k(conf, 3, max_len=[1, 3, 3]).tolist() == [1, 1, 1]
    assert budget_from_stale(conf, flat(), max_len=[1, 3, 3]) == 6


def test_ties_go_to_the_lower_request_then_the_lower_position():
    conf = [[0.5, 1.0, 1.0], [0.5, 1.0, 1.0]]    # every a is .5
    assert allocate_top_k(conf, 2).tolist() == [2, 0]
    assert allocate_top_k(conf, 4).tolist() == [3, 1]


def test_budget_from_stale_and_top_k_hand_case():
    assert budget_from_stale(CONF, table()) == 3     # the curve above peaks at k=3
    assert allocate_top_k(CONF, 3).tolist() == [2, 1]
    assert allocate_top_k(CONF, 4).tolist() == [3, 1]
    assert allocate_top_k(CONF, 0).tolist() == [0, 0]
    assert allocate_top_k(CONF, 100).tolist() == [3, 3]


def test_fixed_length_is_k_capped_by_each_request_maximum():
    assert allocate_fixed(2, [3, 1, 0, 5]).tolist() == [2, 1, 0, 2]
    assert allocate_fixed(0, [3, 1]).tolist() == [0, 0]
    assert allocate_fixed(5, []).tolist() == []


def test_early_stop_differs_from_the_full_search_on_a_jagged_table():
    """The paper's early stop gives up at the first dip of a jagged SPS curve; the full search
    (and brute force) sees past it. Ranked a: .5 .45 .405 .4 (.36 .324 do not fit 6 tokens).
    Theta: k=0 2/.01=200; k=1 2.5/.0125=200 (no improvement: the greedy stops at [0, 0]);
    k=2 236; k=3 268.4; k=4 3.755/.0125=300.4 -> full search K=4, lengths [3, 1]."""
    conf = [[0.5, 0.9, 0.9], [0.4, 0.9, 0.9]]
    assert allocate(conf, jagged()).tolist() == [0, 0]
    assert budget_from_stale(conf, jagged()) == 4
    assert allocate_top_k(conf, 4).tolist() == [3, 1]
    best, arg = brute_force(conf, jagged())
    assert best == pytest.approx(300.4) and arg == [(3, 1)]
    assert expected_throughput(conf, [0, 0], jagged()) == pytest.approx(200.0)


# --- brute force --------------------------------------------------------------------------------

def _random_case(rng, max_r=3, gamma=3):
    r = int(rng.integers(1, max_r + 1))
    conf = rng.uniform(0.0, 1.0, (r, gamma)) ** rng.uniform(0.2, 2.0)
    max_len = rng.integers(0, gamma + 1, r)
    return conf, max_len


def test_greedy_equals_brute_force_on_affine_step_times():
    """t(B) = t0 + t1 * B makes Theta unimodal along the ranked order (each admission's Theta is
    the mediant of the last one and a / t1), so the early stop finds the global best."""
    rng = np.random.default_rng(0)
    for _ in range(150):
        conf, max_len = _random_case(rng)
        t0, t1 = rng.uniform(0.005, 0.02), rng.uniform(1e-4, 5e-3)
        sps = SPSTable(t0 + t1 * np.maximum(np.arange(13), 1))
        best, arg = brute_force(conf, sps, max_len)
        got = allocate(conf, sps, max_len=max_len)
        assert expected_throughput(conf, got, sps) == pytest.approx(best, rel=1e-12)
        if len(arg) == 1:
            assert tuple(got.tolist()) == arg[0]


def test_full_search_always_equals_brute_force_and_greedy_does_where_unimodal():
    rng = np.random.default_rng(1)
    differed = unimodal = 0
    for _ in range(200):
        conf, max_len = _random_case(rng)
        sps = SPSTable(rng.uniform(0.01, 0.02, 11))                 # jagged: any step time per B
        best, _ = brute_force(conf, sps, max_len)
        k = budget_from_stale(conf, sps, max_len=max_len)
        assert expected_throughput(conf, allocate_top_k(conf, k, max_len), sps) == pytest.approx(best, rel=1e-12)
        greedy = expected_throughput(conf, allocate(conf, sps, max_len=max_len), sps)
        curve = np.diff(path(conf, sps, max_len))
        falls = np.flatnonzero(curve <= 0)
        if falls.size == 0 or np.all(curve[falls[0]:] <= 0):
            unimodal += 1
            assert greedy == pytest.approx(best, rel=1e-12)
        elif greedy < best - 1e-9:
            differed += 1
    assert unimodal > 20 and differed > 20        # both kinds of case were exercised


# --- causality ----------------------------------------------------------------------------------

def test_admission_of_a_draft_never_depends_on_later_positions_confidences():
    """Whether (r, j) is verified must not depend on c_{r,j+1..} (they depend on draft token j):
    true for the early-stop greedy and for top-K with a fixed K, on any table."""
    rng = np.random.default_rng(2)
    for _ in range(150):
        conf, max_len = _random_case(rng, gamma=4)
        sps = SPSTable(rng.uniform(0.01, 0.02, 13))
        k = int(rng.integers(0, 8))
        base_g, base_t = allocate(conf, sps, max_len=max_len), allocate_top_k(conf, k, max_len)
        r, j = int(rng.integers(conf.shape[0])), int(rng.integers(1, 4))
        changed = conf.copy()
        changed[r, j:] = rng.uniform(0.0, 1.0, conf.shape[1] - j)
        assert (allocate(changed, sps, max_len=max_len)[r] >= j) == (base_g[r] >= j)
        assert (allocate_top_k(changed, k, max_len)[r] >= j) == (base_t[r] >= j)


def test_full_search_leaks_later_confidences_into_admission():
    """Why §5.2 runs the full search only on stale confidences: on fresh ones, c_{0,2} (computed
    from draft token 1) decides whether draft token 1 itself is verified.
    c_0 = [.5, x, x], c_1 = 0: Theta k=0 200, k=1 2.5/.0125 = 200, k=2 (2.5 + .5x)/.0125."""
    low, high = [[0.5, 0.0, 0.0], [0.0] * 3], [[0.5, 0.9, 0.9], [0.0] * 3]
    assert budget_from_stale(low, jagged()) == 0 and budget_from_stale(high, jagged()) == 3
    assert allocate(low, jagged()).tolist() == allocate(high, jagged()).tolist() == [0, 0]


# --- monotonicity, limits, degenerate inputs ----------------------------------------------------

def test_higher_confidences_never_shorten_the_total_on_a_flat_table():
    rng = np.random.default_rng(3)
    for _ in range(200):
        conf, max_len = _random_case(rng, max_r=6, gamma=5)
        conf[rng.uniform(size=conf.shape) < 0.2] = 0.0
        higher = conf + (1.0 - conf) * rng.uniform(0.0, 1.0, conf.shape) * (rng.uniform(size=conf.shape) < 0.5)
        for f in (lambda c: allocate(c, flat(), max_len=max_len).sum(),
                  lambda c: budget_from_stale(c, flat(), max_len=max_len)):
            assert f(higher) >= f(conf)


def test_every_mode_respects_each_request_maximum():
    rng = np.random.default_rng(4)
    for _ in range(100):
        conf, max_len = _random_case(rng, max_r=5, gamma=5)
        sps = SPSTable(rng.uniform(0.01, 0.02, 40))
        for got in (allocate(conf, sps, max_len=max_len), allocate_top_k(conf, 40, max_len),
                    allocate_top_k(conf, budget_from_stale(conf, sps, max_len), max_len),
                    allocate_fixed(5, max_len)):
            assert np.all(got <= max_len) and np.all(got >= 0)
        assert np.array_equal(allocate_top_k(conf, 40, max_len), max_len)


def test_degenerate_inputs():
    none = np.zeros((0, 3))
    assert allocate(none, table()).tolist() == [] and allocate_top_k(none, 5).tolist() == []
    assert budget_from_stale(none, table()) == 0
    assert allocate(np.zeros((2, 0)), table()).tolist() == [0, 0]
    assert budget_from_stale(np.zeros((2, 0)), table()) == 0
    zeros = np.zeros((3, 3))
    assert allocate(zeros, table()).tolist() == [0, 0, 0] and budget_from_stale(zeros, flat()) == 0
    ones = np.ones((3, 3))
    assert allocate(ones, flat()).tolist() == [3, 3, 3]
    # all ones on the measured table: Theta = (3 + k) * SPS(3 + k) = 285.7, 363.6, 408.2, 444.4, 474.6,
    # 500 (k=5: 8 tokens in 16 ms), then 500 again past the last point (tokens/s held): both stop at 5
    assert allocate(ones, table()).sum() == budget_from_stale(ones, table()) == 5
    assert allocate(ones, table(), max_len=[0, 0, 0]).tolist() == [0, 0, 0]


@pytest.mark.parametrize("call, field", [
    (lambda: allocate([[0.5, float("nan")]], table()), "conf"),
    (lambda: allocate([[0.5, 1.5]], table()), "conf"),
    (lambda: allocate([0.5, 0.5], table()), "conf"),
    (lambda: allocate(np.full((11, 1), 0.5), table()), "conf"),      # 11 base tokens > max_batch 10
    (lambda: allocate(CONF, table(), max_len=[1]), "max_len"),
    (lambda: allocate(CONF, table(), max_len=[1, -1]), "max_len"),
    (lambda: allocate(CONF, table(), max_len=[1.5, 1]), "max_len"),
    (lambda: allocate(CONF, table(), budget=-1), "budget"),
    (lambda: allocate_top_k(CONF, -1), "budget"),
    (lambda: allocate_fixed(-1, [1]), "k"),
    (lambda: expected_throughput(CONF, [4, 0], table()), "lengths")])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


# Graph steps by (requests, drafts each): at 1-2 requests a draft costs 10 %, at 3-4 requests 60 % (and the
# third draft is beyond the token budget at 4 requests).
TIMES = StepTimes([2, 4], [[0.010, 0.011, 0.012, 0.013], [0.010, 0.016, 0.022, np.inf]])


def test_step_times_read_the_next_bucket_and_refuse_outside_the_table():
    assert TIMES(1, 0) == TIMES(2, 0) == 0.010 and TIMES(3, 2) == TIMES(4, 2) == 0.022
    assert TIMES(4, 3) == np.inf
    with pytest.raises(ValueError, match="outside"):
        TIMES(5, 0)
    with pytest.raises(ValueError, match="seconds"):
        StepTimes([1, 2], [[0.01, 0.02]])
    with pytest.raises(ValueError, match="buckets"):
        StepTimes([2, 1], [[0.01], [0.02]])


def test_uniform_length_equals_brute_force_and_backs_off_where_drafts_cannot_pay():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 5))
        conf = rng.uniform(0, 1, (n, 3))
        limit = rng.integers(0, 4, n)
        a = survival(conf)

        def theta(length):
            return (n + sum(a[r, :min(length, limit[r])].sum() for r in range(n))) / TIMES(n, length)
        best = max(range(4), key=lambda length: (theta(length), -length))
        assert uniform_length(conf, TIMES, max_len=limit) == best
    sure = [[0.9, 0.9, 0.9]]
    assert uniform_length(sure, TIMES) == 3  # one request: every draft pays (a 10 % step for 0.9 more tokens)
    # four requests: a draft costs 60 % of the step; 0.5 more tokens a request do not pay (300 against 400
    # tokens/s); at 0.9: 400, 475, 493 tokens/s at 0, 1, 2 drafts, and the third is beyond the token budget
    assert uniform_length([[0.5, 0.5, 0.5]] * 4, TIMES) == 0
    assert uniform_length(sure * 4, TIMES) == 2
    assert uniform_length(np.zeros((0, 3)), TIMES) == 0
