"""Runs a kernel check under the Triton interpreter (TRITON_INTERPRET=1) in a fresh process: the
variable must be set before triton is imported. The code prints 'ok' when every check passed.
interpret=False runs the same check compiled (GPU tests that share the interpreter test's code)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# Two shortcomings of Triton 3.6's interpreter met by kernels with runtime loop bounds or bf16 dots
# (compiled kernels are unaffected); prepend SHIMS to the checked code:
#  * loop bounds become Python ints via int(1-element array), which numpy >= 2.3 refuses;
#  * tl.dot on bf16 multiplies the raw uint16 bit patterns (bf16 is stored as uint16 there).
SHIMS = """
import numpy as np
import triton.language as tl
import triton.runtime.interpreter as ti
_patch_tensor = ti._patch_lang_tensor
def _patch_index(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, '__index__', lambda self: int(self.handle.data.reshape(-1)[0]))
ti._patch_lang_tensor = _patch_index
_dot = ti.InterpreterBuilder.create_dot
def _as_fp32(h):
    if h.dtype.scalar != tl.bfloat16:
        return h
    return ti.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
ti.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: _dot(self, _as_fp32(a), _as_fp32(b), d, *rest)
"""


def run_interpreted(code: str, timeout: int = 300, interpret: bool = True) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "kernels")])}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:  # the same check on the GPU, compiled
        env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def interpreted_and_gpu(code: str, cpu_prelude: str, gpu_prelude: str):
    """A pair of tests running the same check: under the interpreter (CPU) and compiled (gpu-marked).
    Assign both to test_* names in a test module."""
    import pytest

    def in_the_interpreter():
        pytest.importorskip("triton")
        run_interpreted(SHIMS + cpu_prelude + code)

    @pytest.mark.gpu
    def on_gpu():
        run_interpreted(gpu_prelude + code, interpret=False)

    return in_the_interpreter, on_gpu

