"""benchmarks/fp8_gemm_bench.py --experts times grouped_gemm_fp8's variant "gluon" beside "tma" and bf16 on CUDA:
its rows (gluon_paths) call the variant with each GLUON_PATHS entry's tiles, tiles the Gluon launcher takes, and
they are summed per layer with the other measurement paths."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_gluon_rows_launch_variant_gluon_with_their_tiles(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import fp8_gemm_bench as bench

    calls = []
    monkeypatch.setattr(bench, "grouped_gemm_fp8", lambda *args, **kw: calls.append((args, kw)) or len(calls))
    q, qs, codes, s128, offs = (torch.zeros(1) for _ in range(5))
    paths = bench.gluon_paths(q, qs, codes, s128, offs)
    assert set(paths) == set(bench.GLUON_PATHS) == {"w8a8-gemm-gluon", "w8a8-gemm-gluon-m128", "w8a8-gemm-gluon-s3",
                                                    "w8a8-gemm-gluon-s6", "w8a8-gemm-gluon-g2",
                                                    "w8a8-gemm-gluon-ws", "w8a8-gemm-gluon-ws-g1",
                                                    "w8a8-gemm-gluon-ws-s6", "w8a8-gemm-gluon-ws-persistent",
                                                    "w8a8-gemm-gluon-ws-persistent-g1", "w8a8-gemm-gluon-serial"}
    assert set(paths) <= set(bench.MEASURED_PATHS)  # summed per layer, with their ratio to bf16
    for name, fn in paths.items():
        fn()
        args, kw = calls[-1]
        assert args == (q, qs, codes, s128, offs, bench.ACT_GROUP, (1, 128))
        assert kw == dict(variant="gluon", **bench.GLUON_PATHS[name]), name
    assert calls[-1][1]["group_steps"] == 1  # the no-overlap A/B


def test_gluon_rows_tiles_are_taken_by_the_launcher(monkeypatch):
    """Each entry's tiles, at V4's w2 shape, reach the Gluon kernel (recorded, not run) with those tiles."""
    pytest.importorskip("triton")
    ggl = pytest.importorskip("deepinfer.kernels.grouped_gemm_fp8_gluon")
    if not ggl.available():
        pytest.skip("this Triton has no Gluon")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.syspath_prepend(str(REPO / "tests" / "kernels"))
    from fp8_gemm_bench import GLUON_PATHS
    from test_grouped_gemm_fp8_gluon import _expert_launch

    for name, tiles in GLUON_PATHS.items():
        fn, bound = _expert_launch("w2", **tiles)
        cfg = {**ggl.default_config(), **tiles}
        ws = cfg["ws"]  # the warp-specialised kernel: a tile is its two consumers' BLOCK_M rows
        assert fn.__name__ == "_grouped_gemm_fp8_gluon_kernel" and bound["WS"] == ws, name
        assert bound["PERSISTENT"] == cfg["persistent"] == ("persistent" in name), name
        assert ws == name.startswith("w8a8-gemm-gluon-ws"), name
        assert bound["a_desc"].block_shape == [cfg["BLOCK_M"] * (1 + ws), ggl.BLOCK_K], name
        assert bound["w_desc"].block_shape == [cfg["BLOCK_N"], ggl.BLOCK_K], name
        assert (bound["num_warps"], bound["STAGES"], bound["GROUP"]) == (
            cfg["num_warps"], cfg["num_stages"], cfg["group_steps"]), name
