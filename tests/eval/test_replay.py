"""deepinfer.eval.replay on the tiny V4.1 checkpoint (CPU, fp32, exact cache values): the KL per KEEP against the one
benchmarks/bounded_replay.py's Session computes outside the engine (static cache, the model called directly),
a KEEP covering the whole prompt against the exact prefill, and the agreement fields on hand-made inputs."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from deepinfer.loader.model_loader import load_model
from deepinfer.tools.make_checkpoint import PRESETS

from deepinfer.eval.common import cut_prompts
from deepinfer.eval.replay import common_prefix, deviation, kl, main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bounded_replay import Session  # noqa: E402

TEXT = " ".join(f"def f{i}(x): return x * {i} + len(str(x))" for i in range(40))


def test_deviation_fields_of_hand_made_runs():
    lp = lambda *p: {t: math.log(x) for t, x in enumerate(p)}  # noqa: E731
    exact = ([lp(0.5, 0.5), lp(0.9, 0.1)], [[1, 2, 3, 4], [5, 6, 7, 8]])
    other = ([lp(0.5, 0.5), lp(0.1, 0.9)], [[1, 2, 9, 4], [5, 6, 7, 8]])
    d = deviation(exact, other)
    assert d["kl_mean"] == pytest.approx((0.9 * math.log(9) + 0.1 * math.log(1 / 9)) / 2)
    assert d["kl_max"] == pytest.approx(0.8 * math.log(9))
    assert d["top1_agreement"] == 0.5 and d["greedy_agreement"] == 7 / 8
    assert d["identical_completions"] == 0.5 and d["mean_common_prefix"] == (2 + 4) / 2
    assert kl(lp(0.3, 0.7), lp(0.3, 0.7)) == 0 and common_prefix([1, 2], [1, 2, 3]) == 2


def test_replay_deviation_per_keep_on_tiny_v41(tiny41, tmp_path, command):
    ckpt = tiny41
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT)
    # window 16 + draft block 5: KEEP >= 21; 64 covers the 41-token prompts (then replay is exact)
    result = command(main, ["--model", str(ckpt), "--file", str(text), "--prompt-len", "40", "--max-prompts", "2",
                            "--keep", "21", "64", "--max-tokens", "4", "--device", "cpu",
                            "--kv-cache-dtype", "float32", "--kv-cache-memory", str(32 << 20)])
    assert result["prompts"] == 2 and result["prompt_tokens_mean"] == 41 and result["replay_layer"] >= 0
    short, whole = result["per_keep"]
    assert whole["keep"] == 64 and abs(whole["kl_max"]) < 1e-9 and whole["identical_completions"] == 1.0
    assert short["keep"] == 21 and short["kl_max"] > 1e-9  # rows dropped above the replay layer change the result

    # independently: Session prefill of each prompt, exact and with KEEP 21, the model called directly
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    prompts = cut_prompts(ids, 40, 2, PRESETS["tiny41"]["bos_token_id"])
    model = load_model(str(ckpt), dtype=torch.float32)[0]
    kls = []
    for p in prompts:
        e, k = (Session(model, p, len(p) + 1, "float32", keep).step().double().log_softmax(-1) for keep in (None, 21))
        kls.append(float((e.exp() * (e - k)).sum()))
    assert short["kl_mean"] == pytest.approx(sum(kls) / 2, rel=1e-3, abs=1e-7)
    assert short["kl_max"] == pytest.approx(max(kls), rel=1e-3, abs=1e-7)



def test_a_keep_below_the_engines_rule_is_one_line_and_status_2(tiny41, capsys):
    # window 16 + draft block 5: KEEP 20 does not cover them
    assert main(["--model", str(tiny41), "--prompts", "def f(x):", "--keep", "20", "64", "--device", "cpu",
                 "--kv-cache-memory", str(32 << 20)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--keep 20: yoco_prefill_keep_tokens" in err
