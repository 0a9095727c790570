"""benchmarks/spec_decode.py: its acceptance oracle (a benchmark device: truth table, hashed per-position
acceptance, drafts replaced on the device) and its smoke run on the CPU (tiny41: every method and row
field, greedy outputs equal to speculation off, the oracle's acceptance where r pins it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


@pytest.fixture
def sd(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import spec_decode

    return spec_decode


def test_truth_table_maps_anchors_to_off_continuations_and_counts_conflicts(sd):
    vocab = 50
    prompts = [[0, 5, 6], [0, 7, 8], [0, 9, 10]]
    outputs = [[11, 12, 13, 14], [20, 21, 22, 23], [11, 30, 31, 32]]  # prompt 3 reaches (3, 11) as prompt 1
    t = sd.TruthTable(prompts, outputs, k=2, vocab=vocab)
    assert t.conflicts == 1
    keys = t.keys.tolist()
    assert keys == sorted(keys) and len(t) == 11  # 12 anchors, (3, 11) once
    row = keys.index(3 * vocab + 11)
    assert t.true[row].tolist() == [12, 13]  # the first prompt's continuation
    assert t.true[keys.index(6 * vocab + 14)].tolist() == [-1, -1]  # past the end
    assert t.true[keys.index(5 * vocab + 22)].tolist() == [23, -1]
    assert t.drafts(1.0)[row].tolist() == [12, 13]
    assert ((t.drafts(0.0) != t.true) & (t.drafts(0.0) >= 0) & (t.drafts(0.0) < vocab)).all()


def test_oracle_acceptance_per_position_follows_the_rate(sd):
    """u is uniform: each position's draft is true about r of the time, the same in every table."""
    g = torch.Generator().manual_seed(0)
    prompts = [[0] + torch.randint(3, 997, (7,), generator=g).tolist() for _ in range(40)]
    outputs = [torch.randint(3, 997, (60,), generator=g).tolist() for _ in range(40)]
    t = sd.TruthTable(prompts, outputs, k=3, vocab=997)
    again = sd.TruthTable(prompts, outputs, k=3, vocab=997)
    assert torch.equal(t.u, again.u) and torch.equal(t.wrong, again.wrong)
    valid = t.true >= 0
    for r in (0.0, 0.5, 0.8, 0.95):
        right = (t.drafts(r) == t.true)[valid].double().mean().item()
        assert abs(right - r) < 0.02, (r, right)
    # the chance that positions 0..j are all true (what fixed-length verification accepts) is r^(j+1)
    full = valid.all(1)
    prefix = (t.drafts(0.8) == t.true)[full].cumprod(1).double().mean(0)
    assert prefix.tolist() == pytest.approx([0.8, 0.64, 0.512], abs=0.03)
    assert sd.expected_acceptance_length(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert sd.expected_acceptance_length(0.0, 5) == 1


def test_oracle_replaces_only_known_anchors(sd):
    vocab = 40
    t = sd.TruthTable([[0, 5]], [[6, 7, 8, 9]], k=2, vocab=vocab)
    oracle = sd.Oracle()
    block = SimpleNamespace(tokens=torch.full((3, 5), 33), confidence=torch.full((3, 5), 0.25))
    anchors, pos = torch.tensor([6, 7, 6]), torch.tensor([2, 3, 3])  # (2, 6) and (3, 7) known; (3, 6) not
    assert oracle.apply(block, anchors, pos) is block and (block.tokens == 33).all()  # no table: unchanged
    oracle.set(t, 1.0)
    oracle.apply(block, anchors, pos)
    assert block.tokens.tolist() == [[7, 8, 33, 33, 33], [8, 9, 33, 33, 33], [33] * 5]
    assert block.confidence[:, :2].tolist() == [[1.0, 1.0], [1.0, 1.0], [0.25, 0.25]]
    oracle.set(t, 0.0)
    block.tokens.fill_(33)
    oracle.apply(block, anchors, pos)
    assert block.tokens[0, 0] != 7 and block.tokens[1, 0] != 8 and block.tokens[2, 0] == 33


def test_rows_count_emitted_tokens_and_compare_with_off(sd):
    want = [[1, 2, 3, 4], [5, 6, 7, 8]]
    delta = dict(num_drafts=0, accepted_per_position=[])
    same = sd.make_row("ngram", 2, None, 2, [0.5, 0.25, 1.0], [want, want, want], want, 4, delta)
    assert (same["seconds"], same["output_tokens"], same["output_tokens_per_s"]) == (0.5, 8, 16.0)
    assert same["per_request_tokens_per_s"] == 8.0
    assert same["equal_to_off"] and same["mismatched_requests"] == 0 and same["first_mismatch_token"] is None
    late = [[1, 2, 3, 4], [5, 6, 9, 8]]
    row = sd.make_row("dspark", 2, None, 2, [1.0, 1.0], [want, late], want, 4, delta)  # one rep differs
    assert not row["equal_to_off"] and row["mismatched_requests"] == 1 and row["first_mismatch_token"] == 2
    with pytest.raises(RuntimeError, match="exactly 4"):
        sd.make_row("dspark", 2, None, 2, [1.0], [[[1, 2, 3], [5, 6, 7, 8]]], want, 4, delta)


def test_metrics_delta_is_per_row(sd):
    before = dict(num_drafts=4, num_draft_tokens=8, num_accepted_tokens=3, num_preemptions=1,
                  accepted_per_position=[2, 1])
    after = dict(num_drafts=14, num_draft_tokens=38, num_accepted_tokens=18, num_preemptions=1,
                 accepted_per_position=[10, 6, 5])
    d = sd._metrics_delta(after, before)
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"], d["num_preemptions"]) == (10, 30, 15, 0)
    assert d["accepted_per_position"] == [8, 5, 5] and d["acceptance_per_position"] == [0.8, 0.5, 0.5]
    assert d["mean_acceptance_length"] == 2.5


def _smoke(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "benchmarks/spec_decode.py", "--smoke", "--commit", "abcdef1",
                          "--out-dir", str(tmp_path), *extra], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    return res, tmp_path / f"{date.today()}-cpu-abcdef1-spec-decode-smoke.json"


def _check_oracle_row(r: dict) -> None:
    assert r["truth_conflicts"] == 0 and r["truth_entries"] > 0
    assert r["expected_mean_acceptance_length"] == pytest.approx(1 + r["acceptance_rate"] + r["acceptance_rate"] ** 2)
    if r["acceptance_rate"] == 1.0:  # every draft is the true continuation: all accepted
        assert r["num_accepted_tokens"] == r["num_draft_tokens"] > r["num_drafts"]
    if r["acceptance_rate"] == 0.0:
        assert r["num_accepted_tokens"] == 0


def test_smoke_run_records_every_row_and_matches_speculation_off(tmp_path):
    res, out = _smoke(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == f"wrote {out}"
    result = json.loads(out.read_text())
    assert (result["device"], result["commit"], result["dtype"], result["smoke"]) == ("cpu", "abcdef1", "float32", True)
    assert result["model"].startswith("preset tiny41")
    s = result["settings"]
    assert (s["concurrency"], s["ks"], s["oracle_rates"], s["ngram_k"]) == ([1, 2], [2], [0.0, 0.5, 1.0], 2)
    assert (s["input_len"], s["output_len"], s["reps"], s["max_num_seqs"]) == (16, 8, 1, 2)
    rows = result["rows"]
    assert sorted((r["method"], r["k"], r["acceptance_rate"] or 0.0, r["concurrency"]) for r in rows) == sorted(
        [("off", 0, 0.0, c) for c in (1, 2)] + [("dspark", 2, 0.0, c) for c in (1, 2)]
        + [("oracle", 2, r, c) for r in (0.0, 0.5, 1.0) for c in (1, 2)] + [("ngram", 2, 0.0, c) for c in (1, 2)])
    fields = {"output_tokens", "seconds", "output_tokens_per_s", "per_request_tokens_per_s", "num_drafts",
              "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "acceptance_per_position",
              "mean_acceptance_length", "equal_to_off", "speedup_vs_off", "async_scheduling", "cuda_graphs"}
    for r in rows:
        assert fields <= set(r), r
        assert r["equal_to_off"] is True and r["mismatched_requests"] == 0 and r["first_mismatch_token"] is None
        assert r["varlen"] is False
        assert r["output_tokens"] == 8 * r["concurrency"] and r["output_tokens_per_s"] > 0
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["seconds"], rel=1e-3)
        assert r["per_request_tokens_per_s"] == pytest.approx(8 / r["seconds"], rel=1e-3)
        assert sum(r["accepted_per_position"]) == r["num_accepted_tokens"]
        if r["method"] == "off":
            assert r["num_drafts"] == 0 and r["speedup_vs_off"] == 1
        if r["method"] in ("dspark", "oracle"):
            assert r["num_drafts"] > 0 and len(r["acceptance_per_position"]) <= 2
            assert r["mean_acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"],
                                                                abs=1e-3)
        if r["method"] == "oracle":
            _check_oracle_row(r)


def _has_varlen() -> bool:
    import inspect

    from deepinfer import LLM

    return "enable_mtp_varlen" in inspect.signature(LLM).parameters


@pytest.mark.skipif(not _has_varlen(), reason="the engine has no enable_mtp_varlen yet (issue 17 item 3)")
def test_smoke_run_with_varlen_beside_fixed_length(tmp_path):
    res, out = _smoke(tmp_path, "--varlen", "--methods", "oracle")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    oracle = sorted((r["varlen"], r["acceptance_rate"], r["concurrency"]) for r in rows if r["method"] == "oracle")
    assert oracle == [(v, a, c) for v in (False, True) for a in (0.0, 0.5, 1.0) for c in (1, 2)]
    assert not any(r["method"] in ("dspark", "ngram") for r in rows)
    for r in rows:
        assert r["equal_to_off"] is True
        if r["method"] == "oracle":
            _check_oracle_row(r)


def test_prompts_from_a_token_file_are_consecutive_slices(sd, tmp_path):
    path = tmp_path / "tokens.bin"
    torch.arange(40, dtype=torch.int16).numpy().astype("<u2").tofile(path)
    assert sd.file_prompts(str(path), 2, 5, 1) == [list(range(5, 10)), list(range(10, 15))]
    with pytest.raises(ValueError, match="--prompt-tokens"):
        sd.file_prompts(str(path), 8, 5, 1)
