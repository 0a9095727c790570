"""The benchmark scripts (benchmarks/): results record a commit from git or --commit only; the
Flash-slice sweep times deepinfer through the engine's own step; its smoke run (every row kind on a
tiny model, on the CPU) leaves the tracked benchmarks/results/ alone and names only what it wrote."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """The benchmarks directory importable as the scripts see it (they import `common` as a sibling)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import common
    import flash_slice

    return common, flash_slice


def run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


# ---- the commit a results file records ----

def test_git_commit_is_head_and_dirty_only_when_tracked_files_differ(bench, tmp_path):
    common, _ = bench
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "tracked.txt").write_text("a")
    _git(repo, "add", "tracked.txt")
    _git(repo, "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert common.git_commit(repo) == head
    (repo / "untracked.txt").write_text("b")
    assert common.git_commit(repo) == head
    (repo / "tracked.txt").write_text("changed")
    assert common.git_commit(repo) == head + "-dirty"
    (tmp_path / "plain").mkdir()
    assert common.git_commit(tmp_path / "plain") == "unknown"


@pytest.mark.parametrize("text", ["9af9e5a + the changes committed in b5f2bfc", "HEAD", "52ce6", "52CE6A3",
                                  "52ce6a3 (dirty)"])
def test_commit_argument_refuses_anything_but_a_hash(bench, text, capsys):
    common, _ = bench
    ap = argparse.ArgumentParser()
    common.add_commit_arg(ap)
    with pytest.raises(SystemExit):
        ap.parse_args(["--commit", text])
    assert "--commit" in capsys.readouterr().err


def test_recorded_commit_is_the_argument_or_git(bench):
    common, _ = bench
    ap = argparse.ArgumentParser()
    common.add_commit_arg(ap)
    assert common.recorded_commit(ap.parse_args(["--commit", "52ce6a3"])) == "52ce6a3"
    assert common.recorded_commit(ap.parse_args(["--commit", "52ce6a3-dirty"])) == "52ce6a3-dirty"
    assert common.recorded_commit(ap.parse_args([])) == common.git_commit()


def _writes_results(src: str) -> bool:
    return "json.dump(" in src or "write_text(json.dumps" in src


def test_every_results_writing_script_records_its_commit_through_common():
    scripts = [p for p in sorted(BENCH.glob("*.py")) if p.name != "common.py" and _writes_results(p.read_text())]
    assert len(scripts) >= 8
    for p in scripts:
        src = p.read_text()
        assert "add_commit_arg(ap)" in src and "recorded_commit(args)" in src, p.name
        assert "git_commit()" not in src, p.name


def test_identical_completions_records_the_given_commit(tmp_path):
    out = tmp_path / "ic.json"
    res = run([sys.executable, "benchmarks/identical_completions.py", "--preset", "tiny", "--device", "cpu",
               "--num", "2", "--modes", "on", "--prompt-len", "8", "--output-len", "3", "--commit", "1234abc",
               "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["commit"] == "1234abc"
    assert "commit" not in result["workload"]
    assert result["rows"][0]["completions"] == 2


# ---- the Flash-slice sweep ----

def test_flash_slice_deepinfer_rows_time_engine_steps(bench, monkeypatch):
    """Prefill rows: one synchronous engine step per timing (nothing launched ahead); decode rows: engine
    steps that each launch the next step ahead and collect their own sampled tokens."""
    import gc

    from deepinfer.worker.model_runner import ModelRunner

    _, fs = bench
    monkeypatch.setattr(fs, "DEVICE", "cpu")
    monkeypatch.setattr(fs, "BASE_PRESET", "tiny")
    monkeypatch.setattr(fs, "PREFILL", [(2, 24)])
    monkeypatch.setattr(fs, "DECODE_BATCHES", [1, 3])
    monkeypatch.setattr(fs, "DECODE_CONTEXTS", [48])
    calls = {"launch": 0, "launch_ahead": 0, "collect": 0}
    launch, collect = ModelRunner.launch, ModelRunner.collect

    def counting_launch(self, so, prev=None):
        calls["launch_ahead" if prev is not None else "launch"] += 1
        return launch(self, so, prev)

    def counting_collect(self, h):
        calls["collect"] += 1
        return collect(self, h)

    monkeypatch.setattr(ModelRunner, "launch", counting_launch)
    monkeypatch.setattr(ModelRunner, "collect", counting_collect)
    args = argparse.Namespace(reps=1, no_cuda_graphs=False)
    try:
        rows = fs.deepinfer_rows(False, False, {"hbm_gbs": 1.0, "bf16_tflops": 1.0}, args, "deepinfer")
    finally:
        gc.unfreeze()
    assert [(r["phase"], r["batch"]) for r in rows] == [("prefill", 2), ("decode", 1), ("decode", 3)]
    assert all(r["step_ms"] > 0 for r in rows)
    steps = fs.DECODE_WARMUP + 10 * args.reps      # engine steps per decode row
    prefill_steps = args.reps + 1                  # one warm-up
    assert calls["launch"] == prefill_steps + 2    # + the first step of each decode row
    assert calls["launch_ahead"] == 2 * steps
    assert calls["collect"] == prefill_steps + 2 * steps


SMOKE_ENGINES = ["deepinfer", "deepinfer-fp8", "deepinfer-invariant", "deepinfer-v41", "deepinfer-v41-fp8",
                 "transformers"]


def test_flash_slice_smoke_runs_every_engine_and_says_what_it_timed(tmp_path):
    out = tmp_path / "sweep.json"
    res = run([sys.executable, "benchmarks/flash_slice.py", "--smoke", "--reps", "1", "--commit", "abcdef1",
               "--engines", ",".join(SMOKE_ENGINES), "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["commit"] == "abcdef1" and "errors" not in result
    assert set(result["slices"]) == {"v4", "v41"} and result["v41_kv_cache_dtype"] == "auto"
    for eng in SMOKE_ENGINES:
        got = {(r["phase"], r["batch"]) for r in result["rows"] if r["engine"] == eng}
        assert got == {("prefill", 1), ("decode", 1), ("decode", 2)}, eng
    assert all(r["step_ms"] and r["step_ms"] > 0 for r in result["rows"])
    for r in result["rows"]:
        family = "transformers" if r["engine"] == "transformers" else "deepinfer"
        assert result["timing"][f"{family}:{r['phase']}"]
    written = [Path(p) for p in res.stdout.strip().splitlines()[-1].removeprefix("wrote ").split(" and ")]
    assert out in written and all(p.is_file() for p in written)


def test_run_sweep_smoke_leaves_tracked_results_alone(tmp_path):
    before = sorted(p.name for p in (BENCH / "results").iterdir())
    res = run(["bash", "benchmarks/run_sweep.sh", "--smoke"], ENGINES="deepinfer", REPS="1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in (BENCH / "results").iterdir()) == before
    wrote = [line for line in res.stdout.strip().splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 2  # the sweep's files, then the executor rows'
    written = [Path(p) for line in wrote for p in line.removeprefix("wrote ").split(" and ")]
    assert all(p.is_file() for p in written)
    assert "-executor-overhead-" in written[-1].name
    assert all(BENCH / "results" not in p.parents for p in written)


# ---- the V4.1 slice ----

def test_flash_slice_v41_is_every_role_at_released_width(bench):
    """Released V4.1-Flash widths and Engram hashing; the table smaller only in rows; one layer per role."""
    from deepinfer.layers.engram_hash import EngramHashParams
    from deepinfer.models.config_v41 import DeepseekV41Config
    from deepinfer.tools.presets_v41 import PRESETS_V41, SLICE41_LAYERS

    _, fs = bench
    top = fs.slice_config_v41()
    cfg = DeepseekV41Config.from_dict(top)
    assert [cfg.role(i) for i in range(cfg.num_hidden_layers)] == \
        ["swa", "swa", "full", "reuse", "reindex", "full", "reindex", "reuse"]
    assert cfg.compress_ratios == (0, 0, 2, 2, 2, 1, 1, 1) and cfg.engram_layer_ids == (1,)
    assert cfg.candidate_source_layer_id == 5 and not cfg.has_dspark
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (5120, 64, 512)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (384, 6)
    released = PRESETS_V41["flash41"]["text_config"]
    changed = set(SLICE41_LAYERS) | {"engram_vocab_size", "engram_num_embeddings"}
    assert {k: v for k, v in top["text_config"].items() if k not in changed} == \
        {k: v for k, v in released.items() if k not in changed}
    assert top["quantization_config"]["weight_block_size"] == [32, 32] and top["expert_dtype"] == "fp4"
    # the same hash heads (n-gram sizes, heads, row width, compressed ids), a table of fewer rows that they fill
    assert cfg.engram_compressed_vocab_size == 99092
    assert (cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_head_dim) == (4, 8, 256)
    rows = cfg.engram_num_embeddings[0]
    assert 16_000_000 < rows < min(released["engram_num_embeddings"]) // 8
    assert EngramHashParams.build(cfg.engram_layer_ids, cfg.engram_num_embeddings, 4, 8, cfg.engram_vocab_size,
                                  99092).rows_needed == (rows,)


@pytest.fixture
def smoke_v41(bench, monkeypatch):
    _, fs = bench
    monkeypatch.setattr(fs, "DEVICE", "cpu")
    monkeypatch.setattr(fs, "BASE_PRESET_V41", "tiny41")
    monkeypatch.setattr(fs, "SLICE41_ARGS", {"engram_vocab_size": None})
    return fs


def test_flash_slice_v41_model_shares_full_width_experts_and_hashes_a_synthetic_map(smoke_v41):
    fs = smoke_v41
    for fp8 in (False, True):
        model = fs.deepinfer_model_v41(fp8)
        cfg = model.config
        assert cfg.moe_intermediate_size == 64 and [cfg.role(i) for i in range(8)][2:] == \
            ["full", "reuse", "reindex", "full", "reindex", "reuse"]
        experts = model.layers[0].ffn.experts
        assert all(layer.ffn.experts is experts for layer in model.layers)
        assert experts.w1.shape[:2] == (cfg.n_routed_experts, cfg.moe_intermediate_size)
        assert experts.w1.dtype == (torch.int8 if fp8 else torch.bfloat16)  # FP4 packed as shipped
        for layer in model.layers:
            assert layer.ffn.shared_experts.w1.weight.shape[0] == cfg.moe_intermediate_size
            assert layer.attn.wq_a.weight.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
        assert model.engram_params is not None
        assert model.engram_params.compressed_vocab == cfg.engram_compressed_vocab_size


def test_roofline41_reads_the_cache_in_its_formats(bench):
    """Decode bytes of one query at context 4096: the reference formats (FP8 window 1 + 1/32 bytes, NVFP4
    entries 0.5 + 1/16, MXFP4 index keys 0.5 + 1/32) against bf16 (2 bytes each), by hand: 8 layers read
    128 window rows of 512; 6 compressed layers read 512 entries of 512; the indexers score 2048
    (ratio-2 Full, Reindex), 4096 (ratio-1 Full) and 4096 (Reindex under 2048 candidate blocks of 8) keys of 128."""
    from deepinfer.models.config_v41 import DeepseekV41Config

    _, fs = bench
    cfg = DeepseekV41Config.from_dict(fs.slice_config_v41())
    bytes_only = {"hbm_gbs": 1e-6, "bf16_tflops": 1e9}  # 1 byte = 1 ms
    ms = {kv: fs.roofline41_ms(cfg, 1, 1, 4096, True, bytes_only, False, kv) for kv in ("auto", "bfloat16")}
    saved = 8 * 128 * 512 * (2 - 1 - 1 / 32) + 6 * 512 * 512 * (2 - 0.5 - 1 / 16) \
        + (2048 + 2048 + 4096 + 4096) * 128 * (2 - 0.5 - 1 / 32)
    assert ms["bfloat16"] - ms["auto"] == pytest.approx(saved, rel=1e-9)
    # 64 requests read 64 caches; weights do not grow with the batch's cache
    b64 = {kv: fs.roofline41_ms(cfg, 64, 64, 4096, True, bytes_only, False, kv) for kv in ("auto", "bfloat16")}
    assert b64["bfloat16"] - b64["auto"] == pytest.approx(64 * saved, rel=1e-9)
    # shipped weights (FP8 32x32, FP4 experts) move fewer bytes than bf16
    assert fs.roofline41_ms(cfg, 64, 64, 4096, True, bytes_only, True, "auto") < b64["auto"] / 2
    # a prefill under bounded replay: the layers from the replay layer up compute the kept rows only
    flops_only = {"hbm_gbs": 1e9, "bf16_tflops": 1.0}
    exact = fs.roofline41_ms(cfg, 8192, 1, 8192, False, flops_only, False, "auto")
    assert fs.roofline41_ms(cfg, 8192, 1, 8192, False, flops_only, False, "auto", keep=8192) == exact
    assert fs.roofline41_ms(cfg, 8192, 1, 8192, False, flops_only, False, "auto", keep=140) < 0.8 * exact


def test_roofline_counts_the_experts_as_shipped_or_as_held(bench, monkeypatch):
    """The V4 slice's FP8 roofline counts routed experts as shipped (FP4 codes + one E8M0 byte per 32 weights);
    `expert_bytes` swaps in the held format, which held_expert_bytes reads off a model: 2 in bf16, packed FP4,
    FP8 codes after the repack (one byte a weight + their scales)."""
    from deepinfer.layers.moe import repack_fp4_experts

    _, fs = bench
    monkeypatch.setattr(fs, "BASE_PRESET", "tiny")
    monkeypatch.setattr(fs, "DEVICE", "cpu")
    c = fs.slice_config()
    bytes_only = {"hbm_gbs": 1e-6, "bf16_tflops": 1e9}  # 1 byte = 1 ms
    shipped = fs.roofline_ms(c, 64, 64, 256, True, bytes_only, True)
    assert fs.FP4_EXPERT_BYTES == 0.5 + 1 / 32
    assert fs.roofline_ms(c, 64, 64, 256, True, bytes_only, True, fs.FP4_EXPERT_BYTES) == shipped
    held = fs.roofline_ms(c, 64, 64, 256, True, bytes_only, True, 1 + 1 / 32)
    E, k, expert = c["n_routed_experts"], c["num_experts_per_tok"], 3 * c["hidden_size"] * c["moe_intermediate_size"]
    touched = E * (1 - (1 - 1 / E) ** (64 * k))
    assert held - shipped == pytest.approx(len(fs.LAYER_RATIOS) * touched * expert * 0.5)
    assert fs.held_expert_bytes(fs.deepinfer_model(False, repack=False)) == 2
    model = fs.deepinfer_model(True, repack=False)
    assert fs.held_expert_bytes(model) == pytest.approx(fs.FP4_EXPERT_BYTES)
    repack_fp4_experts(model)
    assert fs.held_expert_bytes(model) in (pytest.approx(1 + 1 / 32), pytest.approx(1 + 1 / 128))


def test_flash_slice_v41_rows_time_engine_steps(smoke_v41, monkeypatch):
    """V4.1 rows time EngineCore.step as the engine runs it (synchronous or launching ahead): every model
    launch happens inside an engine step, a prefill row times one step per rep, a decode row its steps."""
    import gc

    from deepinfer.engine.engine_core import EngineCore
    from deepinfer.worker.model_runner import ModelRunner

    fs = smoke_v41
    monkeypatch.setattr(fs, "PREFILL", [(2, 24)])
    monkeypatch.setattr(fs, "DECODE_BATCHES", [1, 3])
    monkeypatch.setattr(fs, "DECODE_CONTEXTS", [48])
    calls = {"step": 0, "launch": 0, "outside": 0}
    step, launch = EngineCore.step, ModelRunner.launch
    inside = []

    def counting_step(self):
        calls["step"] += 1
        inside.append(1)
        try:
            return step(self)
        finally:
            inside.pop()

    def counting_launch(self, so, prev=None):
        calls["launch"] += 1
        calls["outside"] += not inside
        return launch(self, so, prev)

    monkeypatch.setattr(EngineCore, "step", counting_step)
    monkeypatch.setattr(ModelRunner, "launch", counting_launch)
    args = argparse.Namespace(reps=1, no_cuda_graphs=False, v41_kv_cache_dtype="auto")
    try:
        rows = fs.deepinfer_rows(False, False, {"hbm_gbs": 1.0, "bf16_tflops": 1.0}, args, "deepinfer-v41", "v41")
    finally:
        gc.unfreeze()
    assert [(r["engine"], r["phase"], r["batch"]) for r in rows] == \
        [("deepinfer-v41", "prefill", 2), ("deepinfer-v41", "decode", 1), ("deepinfer-v41", "decode", 3)]
    assert all(r["step_ms"] > 0 and r["roofline_ms"] > 0 for r in rows)
    decode_steps = fs.DECODE_WARMUP + fs.DECODE_STEPS_PER_REP["v41"] * args.reps
    assert calls["step"] == (args.reps + 1) + 2 * decode_steps
    assert calls["outside"] == 0
    # each engine step launches one model step; one more may be in flight when a decode row ends
    assert calls["step"] <= calls["launch"] <= calls["step"] + 2


# ---- end to end: the demo models ----

def test_demo_throughput_counts_only_emitted_tokens(bench):
    from types import SimpleNamespace as NS

    import demo_throughput

    done = [NS(request_id="0", outputs=[NS(finish_reason="length", token_ids=[5, 6, 7])]),
            NS(request_id="1", outputs=[NS(finish_reason="length", token_ids=[1, 2, 3])])]
    assert demo_throughput.emitted_tokens(done, 3) == 6
    short = done + [NS(request_id="2", outputs=[NS(finish_reason="abort", token_ids=[4])])]
    with pytest.raises(RuntimeError, match="exactly 3"):
        demo_throughput.emitted_tokens(short, 3)


def test_demo_throughput_smoke_measures_both_models_and_their_ratio(tmp_path):
    out = tmp_path / "demo.json"
    res = run([sys.executable, "benchmarks/demo_throughput.py", "--smoke", "--commit", "abcdef1", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["commit"] == "abcdef1"
    assert [(r["model"], r["preset"]) for r in result["rows"]] == [
        ("V4 demo", "tiny"), ("V4.1 demo", "tiny41"), ("V4.1 demo, engram_device=cpu", "tiny41")]
    for r in result["rows"]:
        assert r["output_tokens"] == 4 * 4 and r["output_tokens_per_s"] > 0
        assert isinstance(r["async_scheduling"], bool) and r["cuda_graphs"] is False  # no graphs on the CPU
    assert result["rows"][1]["async_scheduling"] and not result["rows"][2]["async_scheduling"]  # host hashing
    ratio = result["rows"][1]["output_tokens_per_s"] / result["rows"][0]["output_tokens_per_s"]
    assert result["ratio_v41_over_v4"] == pytest.approx(ratio, rel=1e-2)
    host = result["rows"][2]["output_tokens_per_s"] / result["rows"][1]["output_tokens_per_s"]
    assert result["ratio_engram_host_over_device"] == pytest.approx(host, rel=1e-2)
    assert res.stdout.strip().splitlines()[-1] == f"wrote {out}"


# ---- measurements live in benchmarks/NOTES.md, not in the kernels ----

MEASUREMENT = re.compile(r"results/|\.jsonl?\b|\b\d+(\.\d+)? ?(us|ms)\b|TB/s|TFLOP")


def test_kernel_sources_carry_no_timings_or_result_files():
    """Kernel docstrings and comments say what a kernel does and why; timings and the result files
    that chose a default belong in benchmarks/NOTES.md."""
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted((REPO / "deepinfer" / "kernels").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if MEASUREMENT.search(line)]
    assert not found, "\n".join(found)


def test_result_records_hold_a_commit_hash_or_null():
    """A record's commit is what git or --commit gave (or null where nothing was recorded); anything
    else known about the tree that ran is in its commit_note."""
    form = re.compile(r"[0-9a-f]{7,40}(-dirty)?")
    for p in sorted((BENCH / "results").glob("*.json")):
        record = json.loads(p.read_text())
        commit = record.get("commit")
        assert commit is None or form.fullmatch(commit), f"{p.name}: {commit!r}"


def test_host_step_stub_times_both_models(tmp_path):
    out = tmp_path / "host.txt"
    res = run([sys.executable, "benchmarks/host_step_stub.py", "--batches", "2", "--steps", "3", "--rows", "3",
               "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    heads = [line for line in out.read_text().splitlines() if "ms host per engine step" in line]
    assert [h.split(" batch")[0] for h in heads] == ["v4 (tiny)", "v41 (tiny41)"]
    assert all("async=True" in h for h in heads)


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_profile_engine_step_smoke(arch):
    """v4 also with --kernel-sites: eager steps under the profiler, each op (CPU) / kernel (CUDA) with the deepinfer
    line under it."""
    sites = ["--kernel-sites"] if arch == "v4" else []
    res = run([sys.executable, "benchmarks/profile_engine_step.py", "--arch", arch, "--smoke", *sites,
               "--commit", "abcdef1"])
    assert res.returncode == 0, res.stderr[-3000:]
    head, *lines = res.stdout.splitlines()
    assert head == f"# commit abcdef1: profile_engine_step.py --arch {arch} --smoke {' '.join(sites + [''])}--commit abcdef1"
    if sites:
        at = lines.index(next(line for line in lines if line.startswith("kernel sites over 3 eager steps")))
        listed = lines[at + 1:]
        assert listed and all(" x " in line and " us " in line for line in listed)
        assert any("deepinfer/layers/" in line or "deepinfer/kernels/" in line for line in listed)
    rows = [json.loads(line.split(": ", 1)[1]) for line in lines if line.startswith("sweep decode row")]
    steps = {"v4": 10, "v41": 5}[arch]  # flash_slice.DECODE_STEPS_PER_REP, --reps 1
    assert len(rows) == 2 and all(len(r["step_ms_each"]) == steps and r["graphs_captured"] == 0 for r in rows)
    assert lines[2].startswith(f"{arch} fp8=False batch 1 context 40: async=True, graphs=False")
    assert "ms per engine step" in res.stdout


def test_profile_engine_step_prefill_smoke():
    res = run([sys.executable, "benchmarks/profile_engine_step.py", "--arch", "v41", "--phase", "prefill", "--smoke"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[1].startswith("v41 fp8=False prefill 1 x 32: engine step ")
    assert "aten::" in res.stdout  # the profiler's op table of one prefill step


def test_offline_throughput_runs_a_parallel_layout(tmp_path):
    """The multi-GPU issue's throughput command, on 2 gloo ranks of the tiny model (CPU)."""
    out = tmp_path / "r.json"
    res = run([sys.executable, "benchmarks/offline_throughput.py", "--preset", "tiny", "--device", "cpu",
               "--num-prompts", "3", "--input-len", "12", "--output-len", "3", "--skip-transformers",
               "--data-parallel-size", "2", "--enable-expert-parallel", "--commit", "abcdef1", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["parallel"] == {"tensor_parallel_size": 1, "data_parallel_size": 2, "enable_expert_parallel": True}
    assert row["output_tokens"] == 9


def test_offline_throughput_serves_a_released_config_with_dummy_weights(tmp_path):
    """Issue 21's released-size run in small: the preset's config.json only (load_format dummy), DP + EP on 2
    gloo ranks, one timed generate per concurrency, each row counting the tokens it emitted."""
    out = tmp_path / "r.json"
    res = run([sys.executable, "benchmarks/offline_throughput.py", "--preset", "tiny", "--device", "cpu",
               "--load-format", "dummy", "--concurrency", "1,3", "--input-len", "12", "--output-len", "3",
               "--data-parallel-size", "2", "--enable-expert-parallel", "--commit", "abcdef1", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["load_format"] == "dummy" and "--concurrency 1,3" in result["command"]
    assert [(r["concurrency"], r["output_tokens"]) for r in result["rows"]] == [(1, 3), (3, 9)]  # no transformers row


def test_weights_memory_smoke_holds_the_kept_formats_at_their_size_on_disk(bench, tmp_path, monkeypatch):
    """The H200 weights-memory measurement's script, on tiny / tiny41 (CPU, in this process): the kept
    formats at their bytes on disk, the dequantised model at its bf16 bytes."""
    import weights_memory

    out = tmp_path / "wm.json"
    monkeypatch.setattr(sys, "argv", ["weights_memory.py", "--smoke", "--commit", "abcdef1", "--out", str(out)])
    weights_memory.main()
    result = json.loads(out.read_text())
    assert result["commit"] == "abcdef1" and result["command"].endswith(f"--smoke --commit abcdef1 --out {out}")
    rows = result["rows"]
    assert [(r["arch"], r["preset"], r["quantization"], r["keeps_formats"]) for r in rows] == [
        ("v4", "tiny", "fp8", True), ("v4", "tiny", "none", False),
        ("v41", "tiny41", "fp8", True), ("v41", "tiny41", "none", False)]
    for kept, dense in (rows[:2], rows[2:]):
        assert kept["allocated_bytes"] == kept["loaded"]["total"] and "CPU" in kept["allocated_source"]
        assert abs(kept["allocated_bytes"] - kept["disk_bytes"]) < 0.03 * kept["disk_bytes"]
        assert kept["loaded"]["packed_fp4"] > 0 and kept["allocated_bytes"] < 0.8 * kept["bf16_equiv_bytes"]
        assert dense["allocated_bytes"] == pytest.approx(dense["bf16_equiv_bytes"], rel=0.01)  # + Engram's id map
        assert dense["loaded"]["packed_fp4"] == 0 and dense["loaded"]["experts"] > 2 * kept["loaded"]["experts"]


def test_flash_slice_row_subset(bench):
    """--prefill / --decode-batches / --decode-contexts replace the row lists (what a short device call
    times); '-' drops the prefill rows."""
    import argparse

    _, fs = bench
    saved = fs.PREFILL, fs.DECODE_BATCHES, fs.DECODE_CONTEXTS
    try:
        fs.select_rows(argparse.Namespace(prefill="4x2048,1x8192", decode_batches="1,64", decode_contexts="256"))
        assert (fs.PREFILL, fs.DECODE_BATCHES, fs.DECODE_CONTEXTS) == ([(4, 2048), (1, 8192)], [1, 64], [256])
        fs.select_rows(argparse.Namespace(prefill="-", decode_batches=None, decode_contexts=None))
        assert fs.PREFILL == [] and fs.DECODE_BATCHES == [1, 64]
    finally:
        fs.PREFILL, fs.DECODE_BATCHES, fs.DECODE_CONTEXTS = saved
