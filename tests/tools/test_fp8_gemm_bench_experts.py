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
    paths = {"bf16", "w8a16", "w8a16-folded", "w8a8", "w8a8-gemm", "w8a8-gemm-tma", "w8a8-gemm-tma-persistent",
             "w4a8", "w4a8-gemm", "w4a8-gemm-plain", "w4a16"}
    for T in (8, 300):
        got = [row for row in r["rows"] if row["tokens"] == T]
        assert {row["name"] for row in got} == {"w1", "w2", "w3"} and {row["path"] for row in got} == paths
        for row in got:
            assert row["us"] > 0 and row["M"] == 2 * T
            # W8A16 multiplies the same values as bf16; W8A8 / W4A8 round the activations to e4m3
            assert row["rel_err_vs_bf16"] < (0.08 if row["path"].startswith(("w8a8", "w4a8")) else 1e-2), row
        for name in ("w1", "w2", "w3"):  # the packed FP4 weights hold the same values as the FP8 codes
            err = {row["path"]: row["rel_err_vs_bf16"] for row in got if row["name"] == name}
            assert err["w4a8"] == err["w4a8-gemm"] == err["w8a8-gemm"] > 0, err
    from deepinfer.layers.moe import W8A8_ROWS_PER_EXPERT
    assert [s["experts_path"] for s in r["summary"]] == [
        "w8a8" if 2 * T >= W8A8_ROWS_PER_EXPERT * 8 else "w8a16-folded" for T in (8, 300)]  # 8 experts
    for s in r["summary"]:
        assert set(s["layer_us"]) == {"bf16", "w8a16", "w8a16-folded", "w8a8", "w8a8-gemm-tma",
                                      "w8a8-gemm-tma-persistent", "w4a8", "w4a16"} and s["w8a8_vs_bf16"] > 0
        assert s["w8a8-gemm-tma_vs_bf16"] > 0 and s["w4a8_vs_bf16"] > 0
    assert f"wrote {out}" in res.stdout


def test_sweep_entries_are_launches_of_the_grouped_fp8_gemm(monkeypatch):
    """Every --sweep entry (recorded on the CPU, not run): grouped_gemm_fp8._launch takes its arguments, with the
    tiles, variant and persistent program count it names; at most 20 entries, labels distinct per variant."""
    import pytest
    import torch
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.syspath_prepend(str(REPO / "tests" / "kernels"))
    from fp8_gemm_bench import SWEEP, sweep_launch_args
    from sm90 import record
    from deepinfer.kernels.grouped_gemm_fp8 import _launch

    e4, E, N, K = torch.float8_e4m3fn, 4, 256, 256
    args = (torch.empty(40, K, dtype=e4), torch.empty(K // 128, 40).t(), torch.empty(E, N, K, dtype=e4),
            torch.zeros(E, N, K // 128, dtype=torch.uint8), torch.zeros(E, dtype=torch.int32))
    assert len(SWEEP) <= 20
    labels = [(e.get("variant", "pointer"), sweep_launch_args(e, 132)[0]) for e in SWEEP]
    assert len(set(labels)) == len(labels)
    assert {v for v, _ in labels} == {"pointer", "tma"} and any(label.endswith("/p2") for _, label in labels)
    for entry in SWEEP:
        label, cfg = sweep_launch_args(entry, 132)
        with record() as got:
            _launch(*args, **cfg)
        (launch,) = got
        kernel = "_grouped_gemm_fp8_tma_kernel" if entry.get("variant") == "tma" else "_grouped_gemm_fp8_kernel"
        assert launch.fn.__name__ == kernel, label
        assert [launch.constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")] == [
            entry["BLOCK_M"], entry["BLOCK_N"], entry["BLOCK_K"]], label
        assert launch.options == dict(num_warps=entry["num_warps"], num_stages=entry["num_stages"]), label
        if kernel.endswith("tma_kernel"):
            assert launch.constexprs["PERSISTENT"] == ("programs_per_sm" in entry), label
