"""deepinfer.eval.perplexity on tiny checkpoints (fp32, CPU): windows, the engine's teacher-forced perplexity against
one computed independently (transformers' DeepseekV4ForCausalLM on the same windows), the reference column."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from deepinfer.loader.model_loader import load_model
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

from deepinfer.eval.perplexity import main, make_windows, run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))
from oracle import transformers_model  # noqa: E402

TEXT = '''def fibonacci(n: int) -> list[int]:
    """The first n Fibonacci numbers."""
    out, a, b = [], 0, 1
    for _ in range(n):
        out.append(a)
        a, b = b, a + b
    return out


class Stack:
    def __init__(self):
        self.items = []

    def push(self, x):
        self.items.append(x)

    def pop(self):
        return self.items.pop()
'''


@pytest.mark.parametrize("bos, context", [(1, 0), (1, 3), (None, 0), (None, 2)])
def test_windows_score_every_token_once_in_order(bos, context):
    tokens = list(range(100, 150))
    windows = make_windows(tokens, 8, bos, context)
    assert all(len(w.token_ids) <= 8 and w.first >= 1 for w in windows)
    scored = [t for w in windows for _, t in w.scored]
    assert scored == (tokens if bos is not None else tokens[1:])  # without BOS the first token has no prefix
    for w in windows:
        if bos is not None:
            assert w.token_ids[0] == bos
        own = w.token_ids[w.first:]
        i = tokens.index(own[0])
        lead = w.token_ids[1 if bos is not None else 0:w.first]
        assert lead == tokens[max(0, i - len(lead)):i] and len(lead) == min(i, context + (bos is None))
    with pytest.raises(ValueError, match="window"):
        make_windows(tokens, 4, bos, 3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ppl") / "ckpt", PRESETS["tiny"], seed=3, dtype="fp8")


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "held_out.py"
    path.write_text(TEXT)
    return path


# the engine on the CPU in fp32 with exact cache values and a small cache
ENGINE = ["--device", "cpu", "--kv-cache-dtype", "float32", "--kv-cache-memory", str(32 << 20)]


def test_perplexity_is_exp_of_minus_the_mean_teacher_forced_logprob(ckpt, text, tmp_path, command):
    tokens = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    assert len(tokens) > 60
    result = command(main, ["--model", str(ckpt), "--file", str(text), "--max-tokens", "60", "--window", "40",
                            "--context", "5", "--reference", "transformers", *ENGINE])

    # independently: prompts [BOS] + 5 tokens of context + 34 scored tokens, transformers' full forward of each
    hf = transformers_model(load_model(str(ckpt), dtype=torch.float32)[0], tmp_path)
    bos, lps = PRESETS["tiny"]["bos_token_id"], []
    for i in range(0, 60, 34):
        ctx, own = tokens[max(0, i - 5):i], tokens[i:min(i + 34, 60)]
        ids = [bos] + ctx + own
        with torch.inference_mode():
            lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        lps += [lp[p - 1, ids[p]].item() for p in range(1 + len(ctx), len(ids))]
    expected = math.exp(-sum(lps) / len(lps))
    assert result["tokens"] == 60 and result["windows"] == 2
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert result["reference"] == "transformers"
    assert result["reference_perplexity"] == pytest.approx(expected, rel=1e-5)
    assert result["max_abs_logprob_diff"] < 1e-4
    assert abs(result["perplexity_diff"]) < 1e-3 * expected


@pytest.mark.parametrize("argv, error", [
    (["--reference", "nemo"], "--reference: 'nemo' is the reference for deepseek_v41"),
    (["--window", "5000"], "--window: 5000 must be in [2, max_model_len="),
])
def test_bad_arguments_found_with_the_model_are_one_line_and_status_2(ckpt, text, capsys, argv, error):
    assert main(["--model", str(ckpt), "--file", str(text), *argv, *ENGINE]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and error in err and "Traceback" not in err


def test_nemo_reference_scores_the_same_tokens_on_v41(text, tmp_path):
    ckpt41 = write_checkpoint(tmp_path / "ckpt41", PRESETS["tiny41"], seed=5, dtype="fp8")
    result = run(["--model", str(ckpt41), "--file", str(text), "--max-tokens", "40", "--window", "30",
                   "--reference", "nemo", *ENGINE])
    assert result["tokens"] == 40 and result["windows"] == 2 and result["reference"] == "nemo"
    assert result["max_abs_logprob_diff"] < 1e-4
    assert result["perplexity"] == pytest.approx(result["reference_perplexity"], rel=1e-4)
