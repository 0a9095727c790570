"""steps.py, the step-by-step comparison the bf16 GPU tests of every parallel layout use."""
from types import SimpleNamespace

import pytest

from steps import assert_chosen_close, assert_steps_close


def _out(tokens, logprobs):
    return [[SimpleNamespace(token_ids=tokens, logprobs=logprobs)]]


def test_steps_within_the_bound_pass_and_a_later_step_outside_it_fails():
    want = _out([1, 2, 3], [{1: -0.1, 5: -3.0}, {2: -0.2, 5: -2.0}, {3: -0.3, 6: -1.5}])
    near = _out([1, 2, 3], [{1: -0.12, 5: -3.0}, {2: -0.19, 5: -2.0}, {3: -0.3, 6: -1.5}])
    assert assert_steps_close(near, want, 0.05, "near") == pytest.approx(0.02)
    far_third = _out([1, 2, 3], [{1: -0.1, 5: -3.0}, {2: -0.2, 5: -2.0}, {3: -0.5, 6: -1.5}])
    with pytest.raises(AssertionError):
        assert_steps_close(far_third, want, 0.05, "third step off")


def test_tokens_may_part_only_at_a_near_tie():
    tie = _out([1, 2], [{1: -0.1, 5: -3.0}, {2: -0.70, 4: -0.68}])
    parted = _out([1, 4], [{1: -0.1, 5: -3.0}, {2: -0.70, 4: -0.69}])
    assert_steps_close(parted, tie, 0.05, "near tie")
    clear = _out([1, 2], [{1: -0.1, 5: -3.0}, {2: -0.1, 4: -2.5}])
    with pytest.raises(AssertionError, match="near tie"):
        assert_steps_close(_out([1, 4], [{1: -0.1, 5: -3.0}, {2: -0.1, 4: -2.5}]), clear, 0.05, "clear")


def test_only_first_tokens_compared_fails():
    one = _out([1], [{1: -0.1, 5: -3.0}])
    with pytest.raises(AssertionError, match="only the first tokens"):
        assert_steps_close(one, one, 0.05, "one step")


def test_chosen_logprobs_need_equal_tokens():
    assert_chosen_close([1, 2], [-0.1, -0.2], [1, 2], [-0.1, -0.21], 0.05, "close")
    with pytest.raises(AssertionError):
        assert_chosen_close([1, 3], [-0.1, -0.2], [1, 2], [-0.1, -0.2], 0.05, "token differs")
    with pytest.raises(AssertionError):
        assert_chosen_close([1, 2], [-0.1, -0.4], [1, 2], [-0.1, -0.2], 0.05, "logprob off")
