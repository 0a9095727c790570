"""The interpreter helper's fork server runs each check as a fresh `python -c` would: a passing
check passes, a failing or silent one fails with its error, nothing one check changes is seen by
the next, and a check past its timeout is killed."""
import subprocess

import pytest
from interpreter import run_interpreted


def test_a_check_that_prints_ok_passes_and_one_that_raises_fails_with_its_traceback():
    run_interpreted("import os, triton\nassert os.environ['TRITON_INTERPRET'] == '1'\nprint('ok')")
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        run_interpreted("print('ok')\n1 / 0")
    with pytest.raises(AssertionError):
        run_interpreted("print('fine')")  # no 'ok'
    with pytest.raises(AssertionError):
        run_interpreted("import sys\nprint('ok')\nsys.exit(3)")


def test_checks_do_not_see_each_others_state():
    run_interpreted("import triton, torch\ntriton.LEAK = 1\ntorch.manual_seed(5)\nprint('ok')")
    run_interpreted("import triton, torch\nassert not hasattr(triton, 'LEAK')\n"
                    "assert __name__ == '__main__'\nprint('ok')")


def test_a_check_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        run_interpreted("import time\ntime.sleep(60)\nprint('ok')", timeout=1)
    run_interpreted("print('ok')")  # the server still serves
