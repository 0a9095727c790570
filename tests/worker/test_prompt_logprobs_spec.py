"""SamplingParams.prompt_logprobs with speculative decoding in one process (tiny fp32 checkpoints on the CPU):
V4's MTP layer, V4.1's DSpark stages and prompt lookup. A step's prompt rows are computed from the same trunk
forward whose rows speculation verifies; their values and every greedy token equal speculation off, with
chunked prefill mixing prompt rows and verify rows in one step, accepted and rejected drafts, an n = 2 fork
and a JSON-schema request in the batch."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.spec.ngram import NgramProposer
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.worker.drafter import DSparkDrafter, MTPDrafter
from deepinfer.worker.model_runner import ModelRunner

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 4}},
          "required": ["id", "tag"], "additionalProperties": False}
MAX_TOKENS = 8
# V4.1's DSpark block is 5 tokens; 3 keeps verify chunks short in the 12-token steps below
SPEC = {"mtp": {"method": "mtp", "num_speculative_tokens": 1},
        "dspark": {"method": "dspark", "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("plp_spec")
    return {"v4": write_checkpoint(root / "v4", {**PRESETS["tiny"], "index_topk": 64}, seed=11, dtype="fp8"),
            "v41": write_checkpoint(root / "v41", PRESETS["tiny41"], seed=5, dtype="fp8")}


def _llm(ckpt, spec: dict | None, **kw) -> LLM:
    # 12-token steps: prompts are prefilled in chunks, in the same steps as other requests' verify chunks
    base = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=64 << 20,
                max_num_batched_tokens=12, max_num_seqs=4, speculative_config=spec)
    return LLM(str(ckpt), **{**base, **kw})


def _prompts() -> list[list[int]]:
    """19 to 27 token ids below 500 (the tiny tokenizer's ordinary tokens)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (9, 14, 6, 11):
        motif = torch.randint(7, 500, (3,), generator=g).tolist()
        noise = torch.randint(7, 500, (n,), generator=g).tolist()
        out.append([0] + noise + motif * 3 + noise[:3])
    return out


def _params(prompt_logprobs: bool) -> list[SamplingParams]:
    """A top-2 request, an n = 2 fork (the prompt tokens' own logprobs only), a JSON-schema request (top-5)
    and one without prompt_logprobs."""
    k = (2, 0, 5, None) if prompt_logprobs else (None,) * 4
    so = {"schema_type": "json", "schema": SCHEMA}
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=k[0]),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=k[1], n=2),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=k[2], so_args=so),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=k[3])]


def _oracle(monkeypatch, method: str, k: int, truth: dict) -> None:
    """The proposer's drafts replaced by the true continuation (`truth`: (position, token) -> the tokens after
    it) with one wrong token at a position that moves with the anchor (q % (k + 1); k: none), so drafts are
    accepted in part, in full and not at all (the random model's own drafts are all rejected, and its greedy
    text rarely repeats for prompt lookup). Draft layers still run: their rings are written as without it."""
    def wanted(t, q):
        nxt = (truth.get((q, t), []) + [0] * k)[:k]
        bad = q % (k + 1)
        if bad < k:
            nxt[bad] = (nxt[bad] + 1) % 500 + 7
        return torch.tensor(nxt)

    if method == "mtp":
        real = MTPDrafter.propose

        def propose(self, anchors):
            block = real(self, anchors)
            for b, (t, q) in enumerate(zip(anchors.tokens.tolist(), anchors.pos.tolist())):
                block.tokens[b, :k] = wanted(t, q)
            return block

        monkeypatch.setattr(MTPDrafter, "propose", propose)
    elif method == "dspark":
        real = DSparkDrafter.draft

        def draft(self, anchor_tokens, anchor_pos, slots):
            block = real(self, anchor_tokens, anchor_pos, slots)
            for b, (t, q) in enumerate(zip(anchor_tokens.tolist(), anchor_pos.tolist())):
                block.tokens[b, :k] = wanted(t, q)
            return block

        monkeypatch.setattr(DSparkDrafter, "draft", draft)
    else:
        def lookup(self, token_ids, max_tokens):
            return wanted(token_ids[-1], len(token_ids) - 1).tolist()[:min(k, max_tokens)]

        monkeypatch.setattr(NgramProposer, "propose", lookup)


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


# Without batch invariance a prompt row's value depends on the rows computed with it (the CPU GEMMs' blocking
# follows the step's row count) and on where its prompt is split; speculation changes both (a verify chunk takes
# k + 1 of the step's tokens). Measured on these checkpoints and prompts (mtp, dspark, ngram): at most 4.8e-6,
# about 10 fp32 ulps of a logprob near -ln(vocab); the bound leaves 4x for other CPUs' GEMM blockings (chunked
# against unchunked prefill differs as much: tests/engine/test_prompt_logprobs.py bounds that by 1e-4).
TOL = 2e-5


@pytest.mark.parametrize("model,method,invariant", [("v4", "mtp", True), ("v41", "dspark", True),
                                                    ("v41", "ngram", True), ("v41", "dspark", False)])
def test_prompt_logprobs_and_tokens_with_speculation_equal_speculation_off(ckpts, monkeypatch, model, method,
                                                                         invariant):
    """Batch-invariant steps: a row's numbers do not depend on the rows it shares a step with, so speculation
    leaves every prompt logprob's bits as they are; without it, within TOL. Tokens equal speculation off and
    speculation on without prompt_logprobs (greedy)."""
    prompts = _prompts()
    off = _llm(ckpts[model], None, batch_invariant=invariant).generate(prompts, _params(True), use_tqdm=False)
    k = SPEC[method]["num_speculative_tokens"]
    _oracle(monkeypatch, method, k, {(i, t): (p + o.outputs[0].token_ids)[i + 1:]
                                     for p, o in zip(prompts, off) for i, t in enumerate(p + o.outputs[0].token_ids)})
    mixed = []  # per step with prompt rows: whether it also verifies drafts
    real = ModelRunner._prompt_logprobs

    def spy(self, so, streams):
        mixed.append(any(c.num_draft for c in so.chunks))
        return real(self, so, streams)

    monkeypatch.setattr(ModelRunner, "_prompt_logprobs", spy)
    llm = _llm(ckpts[model], SPEC[method], batch_invariant=invariant)
    on = llm.generate(prompts, _params(True), use_tqdm=False)
    m = llm.get_metrics()
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"] and any(mixed)
    plain = llm.generate(prompts, _params(False), use_tqdm=False)
    assert _tokens(on) == _tokens(off) == _tokens(plain)
    assert on[2].outputs[0].text.startswith("{")
    for a, b, ids in zip(off, on, prompts[:3]):
        assert len(b.prompt_logprobs) == len(ids) and b.prompt_logprobs[0] is None
        if invariant:
            assert b.prompt_logprobs == a.prompt_logprobs  # bit-identical
            continue
        for p in range(1, len(ids)):
            assert b.prompt_logprobs[p].keys() == a.prompt_logprobs[p].keys(), p
            for t, v in b.prompt_logprobs[p].items():
                assert abs(v - a.prompt_logprobs[p][t]) <= TOL, (p, t, v, a.prompt_logprobs[p][t])
    assert on[3].prompt_logprobs is None and all(o.prompt_logprobs is None for o in plain)
