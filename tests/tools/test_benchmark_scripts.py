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


def test_flash_slice_smoke_runs_every_engine_and_says_what_it_timed(tmp_path):
    out = tmp_path / "sweep.json"
    res = run([sys.executable, "benchmarks/flash_slice.py", "--smoke", "--reps", "1", "--commit", "abcdef1",
               "--engines", "deepinfer,deepinfer-fp8,deepinfer-invariant,transformers", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["commit"] == "abcdef1" and "errors" not in result
    engines = ["deepinfer", "deepinfer-fp8", "deepinfer-invariant", "transformers"]
    for eng in engines:
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
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("wrote ")
    written = [Path(p) for p in last.removeprefix("wrote ").split(" and ")]
    assert written and all(p.is_file() for p in written)
    assert all(BENCH / "results" not in p.parents for p in written)


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
