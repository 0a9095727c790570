"""deepinfer.eval.dspark: the ECE per position of a hand-made log, and the command on the tiny V4.1 checkpoint (CPU)
against the engine's own counters and the scheduler's log."""
from __future__ import annotations

import pytest

from deepinfer.eval.common import cut_prompts
from deepinfer.eval.dspark import calibrated, conditional_rows, ece_per_position, main, survival_rows

# (confidences, drafted, accepted) of three verified blocks
LOG = [([0.9, 0.5], 2, 2), ([0.9, 0.5], 2, 0), ([0.2], 1, 0)]


def test_ece_of_a_hand_made_log():
    # position 1: confidences 0.9, 0.9, 0.2 against accepted 1, 0, 0; 10 bins: |0.9 + 0.9 - 1| + |0.2 - 0| over 3
    # position 2 (blocks drafted that far): survival 0.45, 0.45 against 1, 0: |0.9 - 1| over 2
    assert ece_per_position(LOG, survival_rows, bins=10) == pytest.approx([1.0 / 3, 0.05])
    # conditionally, position 2 counts only the first block (the second's draft 1 was rejected): |0.5 - 1|
    assert ece_per_position(LOG, conditional_rows, bins=10) == pytest.approx([1.0 / 3, 0.5])
    # temperature 1 changes nothing; temperature 2 at position 1 maps 0.9 to sigmoid(logit(0.9) / 2) = 0.75
    assert calibrated(LOG, [1.0, 1.0])[0][0] == pytest.approx([0.9, 0.5])
    assert calibrated(LOG, [2.0, 1.0])[0][0] == pytest.approx([0.75, 0.5])
    assert ece_per_position([], survival_rows) == []


def test_prompts_cut_from_tokens():
    assert cut_prompts(list(range(10)), 4, 5, 1) == [[1, 0, 1, 2, 3], [1, 4, 5, 6, 7]]
    assert cut_prompts(list(range(10)), 3, 2, None) == [[0, 1, 2], [3, 4, 5]]
    assert cut_prompts(list(range(3)), 4, 5, 1) == []
    assert cut_prompts(list(range(10)), 3, 5, None, skip=2) == [[6, 7, 8]]  # the pieces after the first 2
    assert cut_prompts(list(range(10)), 3, 5, None, skip=3) == []


TEXT = " ".join(f"def f{i}(x): return x + {i}" for i in range(60))


def test_dspark_acceptance_and_ece_on_tiny_v41(tiny41, tmp_path, command):
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT)
    result = command(main, ["--model", str(tiny41), "--file", str(text), "--prompt-len", "16", "--max-prompts", "2",
                            "--max-tokens", "6", "--gamma", "3", "--bins", "10", "--device", "cpu",
                            "--kv-cache-dtype", "float32", "--kv-cache-memory", str(32 << 20)])
    assert result["prompts"] == 2 and result["gamma"] == 3 and result["method"] == "dspark"
    n, acc, drafted = result["num_drafts"], result["accepted_per_position"], result["drafted_per_position"]
    assert n > 0 and len(drafted) == 3 and drafted[0] == n
    assert result["mean_acceptance_length"] == pytest.approx(1 + result["num_accepted_tokens"] / n)
    assert result["num_accepted_tokens"] == sum(acc) and result["num_draft_tokens"] == sum(drafted)
    assert result["acceptance_per_position"] == pytest.approx([a / d for a, d in zip(acc, drafted)])
    for name in ("ece_per_position", "ece_conditional_per_position"):
        assert len(result[name]) == 3 and all(e is None or 0 <= e <= 1 for e in result[name])
    # the survival ECE at position 1 is |sum(confidence) - accepted| summed over bins: within
    # |mean confidence - acceptance| (the one-bin ECE) and 1
    gap = abs(result["mean_confidence_per_position"][0] - result["acceptance_per_position"][0])
    assert gap - 1e-12 <= result["ece_per_position"][0] <= 1
    assert "ece_calibrated_per_position" not in result  # the checkpoint has no dspark_calibration.json
