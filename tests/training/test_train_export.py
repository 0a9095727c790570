"""training/train_demo.py and training/export.py on the tiny41 widths (every V4.1 layer role, Engram,
mHC, 3 DSpark stages), CPU fp32: three steps on one fixed batch, resuming, and the exported
checkpoint in the engine against NeMo."""
from __future__ import annotations

import json
import math

import pytest
import torch

from training.tokenizer import build, read_tokens

SEQ, BATCH = 16, 2
ARGS = ["--preset", "tiny41", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--total-steps", "3",
        "--warmup-steps", "0", "--lr", "3e-3", "--num-anchors", "2", "--save-every", "1", "--eval-every", "2",
        "--eval-windows", "2"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tokenizer (vocab 1024 = tiny41's) + a train.bin of exactly one batch (every step sees the same
    rows) and a heldout.bin of two other windows."""
    out = tmp_path_factory.mktemp("data")
    build(out, 1024, held_out_percent=0, max_files=6)
    tokens = read_tokens(out / "train.bin").copy()  # not a map of the file rewritten below
    tokens[:SEQ * BATCH].tofile(str(out / "train.bin"))
    tokens[SEQ * BATCH:SEQ * BATCH + 2 * SEQ].tofile(str(out / "heldout.bin"))
    return out


def _train(data, out, *extra):
    from training.train_demo import main
    return main([*ARGS, "--data", str(data), "--out", str(out), *extra])


def _log(run):
    return [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert _train(data, out) == dict(step=3, total_steps=3, finished=True, reason="schedule finished")
    return out


def test_three_steps_lower_the_loss_with_finite_grads_everywhere(run, data):
    from training.nemo_models import build_models
    from training.train_demo import load_checkpoint

    log = _log(run)
    assert [r["step"] for r in log] == [1, 2, 3]
    for r in log:
        assert r["missing_grads"] == [] and r["nonfinite_grads"] == []
        for key in ("loss", "draft_ce", "draft_l1", "confidence_loss", "grad_norm"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert len(r["accept_rate"]) == 5 and 1 <= r["tau"] <= 6
    assert log[-1]["loss"] < log[0]["loss"] - 0.3
    assert "heldout_loss" not in log[0] and math.isfinite(log[1]["heldout_loss"]) and log[1]["heldout_loss"] > 0
    # every trainable tensor of target and draft moved away from NeMo's initialisation
    ck = load_checkpoint(run)
    init = build_models(json.loads((run / "config.json").read_text()), run / "tokenizer.json", num_anchors=2)
    for tag, module in (("target", init.target), ("draft", init.draft)):
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        assert len(trainable) > 50
        unchanged = [n for n in trainable if torch.equal(ck[tag][n], module.state_dict()[n])]
        assert unchanged == [], (tag, unchanged)


def test_an_interrupted_run_resumes_to_the_same_state(run, data, tmp_path):
    from training.train_demo import load_checkpoint

    out = tmp_path / "resumed"
    first = _train(data, out, "--max-minutes", "0")             # stops before its first step, at the time limit
    assert first["step"] == 0 and first["reason"].startswith("--max-minutes") and not first["finished"]
    assert _train(data, out, "--max-steps", "2")["step"] == 2
    with pytest.raises(ValueError, match="--lr"):
        _train(data, out, "--lr", "1e-3")
    assert _train(data, out)["finished"]
    assert _log(out) and [(r["loss"], r["draft_loss"], r.get("heldout_loss")) for r in _log(out)] == \
        [(r["loss"], r["draft_loss"], r.get("heldout_loss")) for r in _log(run)]
    a, b = load_checkpoint(out), load_checkpoint(run)
    assert a["data"] == b["data"] and a["step"] == b["step"] == 3
    for tag in ("target", "draft"):
        assert all(torch.equal(a[tag][k], b[tag][k]) for k in b[tag]), tag


def _nemo_greedy(logits_of, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):  # no cache: a full-prefix forward per token
        with torch.inference_mode():
            seq.append(int(logits_of(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def _engine_greedy(ckpt, prompt: list[int], n: int) -> list[int]:
    from deepinfer import LLM, SamplingParams
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20,
              yoco_prefill_truncation_mode="none")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_export_loads_in_the_engine_and_greedy_matches_nemo(run, tmp_path):
    from safetensors import safe_open
    from tokenizers import Tokenizer

    from nemo_oracle import nemo_v41_logits, nemo_v41_model
    from training.export import export
    from training.train_demo import load_trained

    trained, _, step = load_trained(run)
    prompt = [0] + Tokenizer.from_file(str(run / "tokenizer.json")).encode("def add(a, b):\n    return").ids
    # unquantised export: the engine's greedy tokens are the trained NeMo model's
    full = export(run, tmp_path / "f32", dtype="float32")
    want = _nemo_greedy(lambda ids: trained.target(ids).logits.float(), prompt, 6)
    assert _engine_greedy(full, prompt, 6) == want
    # the released layout (FP8 32x32 blocks, FP4 experts): the engine against NeMo reading the same files
    ckpt = export(run, tmp_path / "fp8", dtype="fp8")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32] and cfg["expert_dtype"] == "fp4"
    assert json.loads((ckpt / "training.json").read_text())["step"] == step == 3
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]

    def stored(name):
        with safe_open(str(ckpt / index[name]), "pt") as f:
            return f.get_tensor(name)

    assert stored("layers.0.ffn.experts.0.w1.weight").shape == (64, 64)  # two FP4 values a byte, 64 x 128
    assert stored("layers.2.attn.wq_a.weight").dtype == torch.float8_e4m3fn
    assert stored("mtp.2.confidence_head.proj.weight").dtype == torch.float32
    nemo, _ = nemo_v41_model(ckpt)
    want = _nemo_greedy(lambda ids: nemo_v41_logits(nemo, ids, exact=True), prompt, 6)
    assert _engine_greedy(ckpt, prompt, 6) == want


@pytest.mark.gpu
def test_cuda_bf16_autocast_steps_train_and_resume(data, tmp_path):
    out = tmp_path / "cuda"
    assert _train(data, out, "--device", "cuda", "--max-steps", "2")["step"] == 2
    assert _train(data, out, "--device", "cuda")["finished"]
    log = _log(out)
    assert [r["step"] for r in log] == [1, 2, 3]
    for r in log:
        assert r["missing_grads"] == [] and r["nonfinite_grads"] == []
        assert all(math.isfinite(r[k]) for k in ("loss", "draft_ce", "draft_l1", "confidence_loss"))
    assert log[-1]["loss"] < log[0]["loss"]
