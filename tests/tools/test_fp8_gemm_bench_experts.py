"""benchmarks/fp8_gemm_bench.py --experts --smoke: every routed-expert path at a W8A16 and a W8A8 row count
on tiny shapes (CPU references), the commit given, per-layer sums and the path Experts takes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_experts_smoke_run(tmp_path):
    out = tmp_path / "e.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "benchmarks/fp8_gemm_bench.py", "--experts", "--smoke", "--commit",
                          "abcdef1", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["commit"] == "abcdef1" and r["smoke"] and r["case"] == "experts"
    paths = {"bf16", "w8a16", "w8a16-folded", "w8a8", "w8a8-gemm"}
    for T in (8, 300):
        got = [row for row in r["rows"] if row["tokens"] == T]
        assert {row["name"] for row in got} == {"w1", "w2", "w3"} and {row["path"] for row in got} == paths
        for row in got:
            assert row["us"] > 0 and row["M"] == 2 * T
            # W8A16 multiplies the same values as bf16; W8A8 rounds the activations to e4m3
            assert row["rel_err_vs_bf16"] < (0.08 if row["path"].startswith("w8a8") else 1e-2), row
    from deepinfer.layers.moe import W8A8_ROWS_PER_EXPERT
    assert [s["experts_path"] for s in r["summary"]] == [
        "w8a8" if 2 * T >= W8A8_ROWS_PER_EXPERT * 8 else "w8a16-folded" for T in (8, 300)]  # 8 experts
    for s in r["summary"]:
        assert set(s["layer_us"]) == {"bf16", "w8a16", "w8a16-folded", "w8a8"} and s["w8a8_vs_bf16"] > 0
    assert f"wrote {out}" in res.stdout
