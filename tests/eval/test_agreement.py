"""deepinfer.eval.agreement: the fields on hand-made logprob rows, and the command on the tiny V4 checkpoint (CPU, fp32,
exact cache values) against transformers' argmax after each prefix, computed in the test."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer.loader.model_loader import load_model
from deepinfer.tools.make_checkpoint import PRESETS

from deepinfer.eval.agreement import compare, main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))
from oracle import transformers_model  # noqa: E402


def test_compare_on_hand_made_rows():
    rows = [[[0.0, -1.0, -2.0], [-3.0, -0.5, -1.0], [-1.0, -1.0, -0.1]],   # argmax 0, 1, 2
            [[-0.2, -0.2, -5.0], [-1.0, -2.0, -0.3]]]                      # a tie (0 or 1), then argmax 2
    r = compare([[0, 2, 2], [1, 0]], rows)
    # prompt 1 disagrees at position 2 (token 2 where the reference picks 1, margin 0.5), prompt 2 at position 2
    assert r["common_prefix"] == [1, 1] and r["mean_common_prefix"] == 1
    assert r["greedy_agreement"] == 3 / 5 and r["identical_completions"] == 0
    assert r["first_mismatch_margins"] == pytest.approx([0.5, 0.7])
    assert compare([[0]], [[[0.0, -1.0]]])["identical_completions"] == 1


def test_engine_agrees_with_transformers_greedy_on_tiny_v4(tiny, tmp_path, command):
    ckpt = tiny
    result = command(main, ["--model", str(ckpt), "--prompts", "def add(a, b):", "--max-tokens", "5",
                            "--device", "cpu", "--kv-cache-dtype", "float32", "--kv-cache-memory", str(32 << 20)])
    assert result["reference"] == "transformers" and result["prompts"] == 1
    # independently: transformers' argmax after each prefix of prompt + the engine's tokens (one forward a prompt;
    # up to the first difference this is transformers' own greedy continuation)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    hf = transformers_model(load_model(str(ckpt), dtype=torch.float32)[0], tmp_path / "hf")
    prefixes = []
    for text, ours in zip(["def add(a, b):"], result["completions"]):
        ids = [PRESETS["tiny"]["bos_token_id"]] + tok.encode(text, add_special_tokens=False).ids
        with torch.inference_mode():
            theirs = hf(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1].argmax(-1).tolist()
        prefixes.append(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), 5))
    assert result["common_prefix"] == prefixes
    assert result["greedy_agreement"] == 1.0 and result["identical_completions"] == 1.0  # fp32, exact cache
