"""worker/drafter.py: DSpark drafts from the context KV kept in the stages' rings equal draft_block's from the
target features (V4.1's: the NeMo-matched reference, tests/models/test_deepseek_v41.py; V4-Flash-0731's)."""
import pytest
import torch

from deepinfer.loader.model_loader import load_model
from deepinfer.models import dspark_v4, dspark_v41
from deepinfer.state.forward_batch import SeqChunk, build_forward_batch
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.worker.drafter import DSparkDrafter
from deepinfer.worker.kv_cache import allocate_v4_cache


@pytest.fixture(scope="module")
def model41(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("tiny41") / "ckpt", PRESETS["tiny41"], seed=5, dtype="fp8")
    return load_model(str(ckpt), dtype=torch.float32)[0]


@pytest.fixture(scope="module")
def model0731(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("dspark") / "ckpt", PRESETS["tiny-dspark"], seed=5, dtype="fp8")
    return load_model(str(ckpt), dtype=torch.float32)[0]


@pytest.mark.parametrize("release", ["v41", "v4-0731"])
@pytest.mark.parametrize("chunks", [[40], [13, 27], [30, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], ids=["one", "two", "decode"])
def test_drafts_from_the_rings_equal_drafts_from_the_features(request, release, chunks):
    model, draft_block = {"v41": (request.getfixturevalue("model41"), dspark_v41.draft_block),
                          "v4-0731": (request.getfixturevalue("model0731"), dspark_v4.draft_block)}[release]
    cfg = model.config
    W, n = cfg.sliding_window, sum(chunks)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (n + 1,), generator=g).tolist()
    cache = allocate_v4_cache(cfg, 1, {m: 16 for m in (1, 2, 4, 8, 16, 32, 64, 128)
                                        if any(r == m for r in cfg.compress_ratios)}, "float32", "cpu", 4,
                              ring_slack=3)
    drafter = DSparkDrafter(model, cache, 3)
    tables = {m: list(range(16)) for m in cache.num_blocks}
    feats, start = [], 0
    with torch.inference_mode():
        for size in chunks:  # prefill in chunks (then one-token decode steps), storing the context each step
            batch = build_forward_batch([SeqChunk(0, start, ids[start:start + size], tables)], W, cache.compress_kinds,
                                        cache.block_size, "cpu", device_history=model.token_history, ring_slack=3)
            _, f = model(batch, cache.layers, draft_features=True, token_history=cache.token_history)
            drafter.store_context(batch, f)
            feats.append(f)
            start += size
        feats = torch.cat(feats)
        anchor = torch.tensor([n])
        got = drafter.draft(torch.tensor([ids[n]]), anchor, torch.tensor([0]))
        lo = max(0, n - W)
        pos = torch.arange(lo, n)[None]
        want = draft_block(model, feats[lo:n][None], pos, torch.ones_like(pos, dtype=torch.bool),
                           torch.tensor([ids[n]]), anchor, "float32")
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.confidence, want.confidence, atol=1e-6, rtol=1e-6)


def test_a_checkpoint_without_draft_stages_or_a_block_too_short_is_refused(model41):
    cache = allocate_v4_cache(model41.config, 1, {m: 1 for m in set(model41.config.compress_ratios) if m}, "float32",
                              "cpu", 4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DSparkDrafter(model41, cache, model41.config.dspark_block_size + 1)


def test_chained_mtp_steps_equal_the_layer_on_host_planned_batches(tmp_path):
    """MTPDrafter chains V4's MTP layer for k > 1, each chained step planned on the device
    (single_token_batch): its drafts and logits equal the layer's on host-planned one-token batches
    (build_forward_batch) over a copy of the same cache, step by step."""
    import copy
    from types import SimpleNamespace

    from deepinfer.worker.drafter import Anchors, MTPDrafter

    ckpt = write_checkpoint(tmp_path / "ckpt", PRESETS["tiny"], seed=5, dtype="fp8")
    model = load_model(str(ckpt), dtype=torch.float32)[0]
    cfg, k, n = model.config, 3, 30
    W = cfg.sliding_window
    cache = allocate_v4_cache(cfg, 2, {m: 16 for m in set(cfg.compress_ratios) if m}, "float32", "cpu", 4,
                              ring_slack=k)
    tables = {m: list(range(16)) for m in cache.num_blocks}
    ids = torch.randint(3, cfg.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    drafter = MTPDrafter(model, cache, k)
    with torch.inference_mode():
        batch = build_forward_batch([SeqChunk(0, 0, ids[:n], tables)], W, cache.compress_kinds, cache.block_size,
                                    "cpu", ring_slack=k)
        streams = model(batch, cache.layers)
        drafter.observe([SimpleNamespace(token_ids=ids[:n], next_token=-1)], batch, streams, None)
        ref = copy.deepcopy(cache.mtp[0])  # the MTP ring before the drafter's passes
        # the step emitted ids[n] (at position n) after its last row, n - 1
        got = drafter.propose(Anchors(torch.tensor([ids[n]]), torch.tensor([n]), torch.tensor([0]),
                                      torch.tensor([n - 1])))
        first, x = model.mtp_draft(batch, streams, torch.tensor(ids[1:n + 1]), torch.tensor([n - 1]), ref)
        tokens, logits = [int(first.tokens[0, 0])], [first.logits[0, 0]]
        for i in range(1, k):
            b = build_forward_batch([SeqChunk(0, n + i - 1, [tokens[-1]], tables)], W, set(), cache.block_size,
                                    "cpu", ring_slack=k)
            li, x = model.mtp_chain(x, torch.tensor([tokens[-1]]), b, ref)
            tokens.append(int(li.argmax(-1)))
            logits.append(li[0])
    assert got.tokens[0].tolist() == tokens
    # (measured equal, 0.0, on the CI host: the same ops on the same values; 1e-5 allows other BLAS thread counts)
    torch.testing.assert_close(got.logits[0], torch.stack(logits), atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(cache.mtp[0].per_slot(), ref.per_slot()):  # the same ring rows written alike
        torch.testing.assert_close(mine.float(), theirs.float(), atol=1e-5, rtol=1e-5)
