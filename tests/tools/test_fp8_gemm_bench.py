"""benchmarks/fp8_gemm_bench.py --smoke: every path at every row count on tiny shapes (CPU), the results
JSON records the commit given, Linear's pick per row count and per-layer sums against bf16."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_every_path_and_the_commit(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "benchmarks/fp8_gemm_bench.py", "--smoke", "--commit", "abcdef1",
                          "--m", "1,64", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["commit"] == "abcdef1" and r["smoke"] and r["device"] == "cpu"
    ms = sorted({row["M"] for row in r["rows"]})
    assert ms == [1, 64, r["fp8_gemm_rows"] + 1]                      # smoke adds a W8A8-sized row count
    paths = {"bf16", "w8a16", "w8a8", "w8a8-triton", "act_quant"}
    for sl in ("v4", "v41"):
        for M in ms:
            got = {row["path"] for row in r["rows"] if row["slice"] == sl and row["M"] == M}
            assert got == paths, (sl, M)
    for row in r["rows"]:
        assert row["us"] > 0 and row["gbps"] > 0 and row["roofline_us"] > 0
        w8a8 = row["M"] >= r["fp8_gemm_rows"] and row["slice"] == "v4"  # V4.1's 32 x 32 blocks stay on W8A16
        assert row["linear_path"] == ("w8a8" if w8a8 else "w8a16")
    for s in r["summary"]:
        assert s["layer_us"]["bf16"] > 0 and s["linear_vs_bf16"] > 0
    assert f"wrote {out}" in res.stdout


def test_bad_commit_is_refused(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "benchmarks/fp8_gemm_bench.py", "--smoke", "--commit", "not a hash",
                          "--out", str(tmp_path / "r.json")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode != 0 and "--commit" in res.stderr and not (tmp_path / "r.json").exists()
