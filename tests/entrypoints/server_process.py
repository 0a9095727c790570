"""`deepinfer serve` as a real subprocess on a free port, for the server tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str | Path, log: Path, *args: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", "--model", str(model), "--device", "cpu",
               "--dtype", "float32", "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = log
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError(f"the server did not start in {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-5000:]

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Sample name (labels dropped) -> value, summed over label sets."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            if "finished_reason=" in name:
                key += "{" + name.split("finished_reason=", 1)[1].split('"')[1] + "}"
            out[key] = out.get(key, 0.0) + float(value)
        return out

    def wait_cache_free(self, within_s: float = 10) -> dict[str, float]:
        """The metrics once no request is in flight and every cache block is free (AssertionError after within_s)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < within_s:
            m = self.metrics()
            if m["deepinfer:kv_cache_free_blocks"] == m["deepinfer:kv_cache_total_blocks"] and \
                    m["deepinfer:num_requests_running"] == 0 and m["deepinfer:num_requests_in_flight"] == 0:
                return m
            time.sleep(0.1)
        raise AssertionError(f"the cache was not freed after the clients left: {m}")

    def engine_pid(self) -> int:
        """The engine-core child (spawned by multiprocessing; not its resource tracker)."""
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in kids:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmd:
                return int(pid)
        raise RuntimeError(f"no engine-core child among {kids}")

    def stop_cleanly(self) -> None:
        """SIGTERM; the server must exit 0 without a traceback."""
        code = self.stop()
        assert code == 0 and "Traceback" not in self.log_path.read_text(), (code, self.log())

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (a graceful shutdown) and the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode
