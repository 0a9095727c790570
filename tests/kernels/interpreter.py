"""Runs a kernel check under the Triton interpreter (TRITON_INTERPRET=1) in a fresh process: the
variable must be set before triton is imported. The code prints 'ok' when every check passed.
interpret=False runs the same check compiled (GPU tests that share the interpreter test's code).

Interpreted checks run in processes forked from one fork server per pytest session (and per
environment), which imported torch, triton and numpy once with TRITON_INTERPRET=1 and never runs
a check itself: each check still starts from the same untouched state a fresh `python -c` would
reach after those imports, without paying ~2 CPU s of imports per check."""
import atexit
import json
import os
import struct
import subprocess
import sys
import tempfile
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
        returncode, stdout, stderr = _fork_server(env).run(code, timeout, env)
    else:  # the same check on the GPU, compiled
        env.pop("TRITON_INTERPRET", None)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
        returncode, stdout, stderr = res.returncode, res.stdout, res.stderr
    assert returncode == 0 and "ok" in stdout, stderr[-3000:]


# The fork server: reads (code, timeout) requests from stdin, forks a child per request that runs the
# code as `python -c` would (__name__ == '__main__', its own stdout / stderr files, exit status 1 on an
# exception, SystemExit's code), waits for it (killing it past the timeout) and answers (status,
# stdout, stderr; status None: timed out). Messages: 4-byte length, then JSON.
_SERVER = r"""
import json, os, signal, struct, sys, tempfile, time
import numpy, torch, triton, triton.language  # the imports every check makes, done once
inp, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # stray prints of the server itself go to its stderr
def recv():
    head = inp.read(4)
    return json.loads(inp.read(struct.unpack("<I", head)[0])) if len(head) == 4 else None
while (req := recv()) is not None:
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        pid = os.fork()
        if pid == 0:
            os.environ.clear()
            os.environ.update(req["env"])
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
            sys.argv = ["-c"]
            status = 0
            try:
                exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            except SystemExit as x:
                status = x.code if isinstance(x.code, int) else (0 if x.code is None else 1)
                if not isinstance(x.code, (int, type(None))):
                    print(x.code, file=sys.stderr)
            except BaseException:
                import traceback
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        deadline, status = time.monotonic() + req["timeout"], None
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        o.seek(0)
        e.seek(0)
        msg = json.dumps([status, o.read().decode(errors="replace"), e.read().decode(errors="replace")]).encode()
        out.write(struct.pack("<I", len(msg)) + msg)
        out.flush()
"""


class _ForkServer:
    def __init__(self, env: dict):
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log)

    def run(self, code: str, timeout: int, env: dict) -> tuple[int, str, str]:
        msg = json.dumps({"code": code, "timeout": timeout, "env": env}).encode()
        try:
            self.proc.stdin.write(struct.pack("<I", len(msg)) + msg)
            self.proc.stdin.flush()
            head = self.proc.stdout.read(4)
            status, stdout, stderr = json.loads(self.proc.stdout.read(struct.unpack("<I", head)[0]))
        except (OSError, struct.error, ValueError):
            self.close()
            self.log.seek(0)
            raise RuntimeError(f"the interpreter fork server died:\n{self.log.read().decode()[-3000:]}")
        if status is None:
            raise subprocess.TimeoutExpired([sys.executable, "-c", code[:200]], timeout, stdout, stderr)
        return status, stdout, stderr

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_servers: dict[str, _ForkServer] = {}


def _fork_server(env: dict) -> _ForkServer:
    """The session's fork server for this environment (a new one when the environment differs; the
    variable pytest sets per test is passed to each check, not read at import)."""
    key = json.dumps({k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}, sort_keys=True)
    srv = _servers.get(key)
    if srv is None or srv.proc.poll() is not None:
        for old in _servers.values():
            old.close()
        _servers.clear()
        srv = _servers[key] = _ForkServer(env)
    return srv


atexit.register(lambda: [s.close() for s in _servers.values()])


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

