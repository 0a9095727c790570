"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM, and incremental decode against full forwards."""
from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.state.forward_batch import SeqChunk, build_forward_batch
from deepinfer.loader.model_loader import load_model
from deepinfer.models import DeepseekV4Config, DeepseekV4ForCausalLM
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.tools.static_cache import static_v4_cache
from oracle import transformers_model

TINY = PRESETS["tiny"]
# A: every layer kind, top-k >= visible entries (no indexer ties possible)
CFG_A = {**TINY, "index_topk": 64}
# B: a real top-4 choice among up to 40 entries; 16 indexer heads make exact ReLU ties unlikely
CFG_B = {**TINY, "index_topk": 4, "index_n_heads": 16}
# C: odd sizes: 3 heads of 80, 3 output groups, hidden 160 with ragged 64x64 FP8 blocks, HCA ratio 8
CFG_C = {**TINY, "hidden_size": 160, "num_attention_heads": 3, "head_dim": 80, "o_groups": 3,
         "q_lora_rank": 50, "o_lora_rank": 20, "moe_intermediate_size": 96, "sliding_window": 6,
         "compress_ratios": [0, 0, 4, 8, 4, 8, 4, 0], "num_hidden_layers": 7, "num_hash_layers": 3,
         "n_routed_experts": 6, "num_experts_per_tok": 2, "index_topk": 5, "index_n_heads": 16,
         "quantization_config": {**TINY["quantization_config"], "weight_block_size": [64, 64]}}


def _ids(seed: int, batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(2, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _tiny_model(tmp_path, cfg: dict, dtype="float32", seed=0, **kw):
    d = write_checkpoint(tmp_path / f"ckpt_{dtype}", cfg, seed=seed, dtype=dtype)
    return load_model(str(d), dtype=torch.float32, **kw)[0]


def _full_logits(model, ids: torch.Tensor, kv="float32") -> torch.Tensor:
    """Whole sequences in one step (each request one varlen segment)."""
    cfg = model.config
    cache = static_v4_cache(cfg, ids.shape[0], ids.shape[1], kv, "cpu")
    chunks = [SeqChunk(i, 0, row.tolist(), cache.static_tables(i)) for i, row in enumerate(ids)]
    with torch.inference_mode():
        b = build_forward_batch(chunks, cfg.sliding_window, cache.compress_kinds, cache.block_size, "cpu")
        return model.compute_logits(model(b, cache.layers)).view(*ids.shape, -1)


def _incremental_logits(model, ids: torch.Tensor, step_sizes: list[int], kv="float32") -> torch.Tensor:
    """Request i advances step_sizes[i] tokens per step (1 = token-by-token decode); all share steps."""
    cfg, (B, S) = model.config, ids.shape
    cache = static_v4_cache(cfg, B + 3, S, kv, "cpu")
    done, out = [0] * B, torch.empty(B, S, cfg.vocab_size)
    with torch.inference_mode():
        while min(done) < S:
            live = [i for i in range(B) if done[i] < S]
            chunks = [SeqChunk(i + 3, done[i], ids[i, done[i]:done[i] + step_sizes[i]].tolist(),
                               cache.static_tables(i + 3)) for i in live]
            b = build_forward_batch(chunks, cfg.sliding_window, cache.compress_kinds, cache.block_size, "cpu")
            logits = model.compute_logits(model(b, cache.layers))
            off = 0
            for i, c in zip(live, chunks):
                out[i, done[i]:done[i] + len(c.token_ids)] = logits[off:off + len(c.token_ids)]
                off += len(c.token_ids)
                done[i] += len(c.token_ids)
    return out


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4):
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= rel * scale, f"max |diff| {diff:.3g} > {rel} x logit scale {scale:.3g}"


def test_full_size_flash_builds_on_meta_with_284b_parameters():
    cfg = DeepseekV4Config.from_dict(PRESETS["flash"])
    assert cfg.num_hidden_layers == 43 and cfg.n_routed_experts == 256
    assert cfg.layer_kinds.count("csa") == 21 and cfg.layer_kinds.count("hca") == 20
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, dtype=torch.bfloat16)
        quant = DeepseekV4ForCausalLM(cfg, dtype=torch.bfloat16, quantized=True)
    trunk = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert abs(trunk - 284.3e9) < 0.1e9, trunk
    assert abs(mtp - 6.6e9) < 0.1e9, mtp
    # FP8 attention/shared experts + FP4 routed experts + BF16 rest = the published ~159.6 GB
    on_disk = sum(t.numel() * t.element_size() for t in quant.state_dict().values())
    assert abs(on_disk - 159.6e9) < 0.5e9, on_disk


@pytest.mark.parametrize("cfg", [CFG_A, CFG_B, CFG_C], ids=["all-kinds", "topk4-clamp", "odd-sizes"])
def test_logits_match_transformers_fp32(tmp_path, cfg):
    model = _tiny_model(tmp_path, cfg)
    if cfg is CFG_B:  # push expert pre-activations past swiglu_limit (routed and shared)
        for name, p in model.named_parameters():
            if name.endswith(("experts.w1", "experts.w3", "shared_experts.w1.weight", "shared_experts.w3.weight")):
                p.data.mul_(15)
    ids = _ids(1, 2, 160, cfg["vocab_size"])
    ours = _full_logits(model, ids)
    with torch.inference_mode():
        ref = transformers_model(model, tmp_path).forward(ids).logits
    _assert_close(ours, ref)


def test_fp8_checkpoint_roundtrip_matches_transformers_on_dequantised_weights(tmp_path):
    model = _tiny_model(tmp_path, CFG_A, dtype="fp8")
    ids = _ids(2, 2, 96, CFG_A["vocab_size"])
    ours = _full_logits(model, ids)
    with torch.inference_mode():
        ref = transformers_model(model, tmp_path).forward(ids).logits
    _assert_close(ours, ref)
    # keeping the checkpoint's FP8/FP4 tensors and dequantising on the fly gives the same model
    quant = load_model(str(tmp_path / "ckpt_fp8"), dtype=torch.float32, quantized=True)[0]
    assert quant.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert quant.layers[0].ffn.experts.w1.dtype == torch.int8
    assert torch.equal(_full_logits(quant, ids), ours)


def test_transformers_layout_checkpoint_loads(tmp_path):
    import transformers

    d = write_checkpoint(tmp_path / "hf_layout", CFG_A, seed=3, dtype="float32", layout="hf")
    model = load_model(str(d), dtype=torch.float32)[0]
    ids = _ids(3, 1, 64, CFG_A["vocab_size"])
    with torch.inference_mode():
        ref = transformers.DeepseekV4ForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32)(ids).logits
    _assert_close(_full_logits(model, ids), ref)


@pytest.mark.parametrize("cfg", [CFG_A, CFG_C], ids=["all-kinds", "odd-sizes"])
def test_chunked_prefill_and_decode_match_full_forward(tmp_path, cfg):
    model = _tiny_model(tmp_path, cfg)
    ids = _ids(4, 3, 90, cfg["vocab_size"])
    full = _full_logits(model, ids)
    # request 0: chunks of 7 (not aligned to any ratio); 1: token by token; 2: chunks of 32
    _assert_close(_incremental_logits(model, ids, [7, 1, 32]), full)


def test_fp8_kv_cache_is_consistent_across_chunking_and_differs_from_exact(tmp_path):
    model = _tiny_model(tmp_path, CFG_A)
    ids = _ids(5, 2, 70, CFG_A["vocab_size"])
    full8 = _full_logits(model, ids, kv="fp8")
    inc8 = _incremental_logits(model, ids, [5, 1], kv="fp8")
    quant_effect = (full8 - _full_logits(model, ids, kv="float32")).abs().mean()
    assert quant_effect > 1e-2  # the fp8 / fp4 rounding is really applied
    # Chunking changes fp32 last bits (matmul shapes), which can flip single e4m3/e2m1 roundings;
    # so chunked fp8 is close, not equal, to full fp8 (bit equality is batch-invariant mode's job).
    _assert_close(inc8, full8, rel=1e-2)
    assert (inc8 - full8).abs().mean() < 0.02 * quant_effect
    assert torch.equal(inc8.argmax(-1), full8.argmax(-1))


def test_fp8_ring_written_before_attention_gives_the_logits_of_the_write_after(tmp_path, monkeypatch):
    """The FP8 ring normalises, rotates and round-trips the window kv in one launch (the torch form on the CPU),
    storing it there too at decode steps (ForwardBatch.ring_early); forcing the separate ops and the store after
    attention changes no logit, token by token or with chunks (which always store after); nor do separate ops
    for the compressed entries."""
    from deepinfer.state.kv_state import EntryStore

    model = _tiny_model(tmp_path, CFG_A)
    ids = _ids(6, 2, 40, CFG_A["vocab_size"])
    calls, written = [], []
    real, real_written = EntryStore.norm_roundtrip, EntryStore.write_normed
    monkeypatch.setattr(EntryStore, "norm_roundtrip", lambda self, x, norm, rows=None: calls.append(rows is not None)
                        or real(self, x, norm, rows))
    monkeypatch.setattr(EntryStore, "write_normed", lambda self, *a: written.append(real_written(self, *a))
                        or written[-1])
    early = _incremental_logits(model, ids, [3, 1], kv="fp8")
    assert any(calls) and not all(calls)  # single-token steps stored early, the chunked ones after attention
    assert written and all(written)  # the entries: one op
    monkeypatch.setattr(EntryStore, "norm_roundtrip", lambda self, *a: None)
    assert torch.equal(early, _incremental_logits(model, ids, [3, 1], kv="fp8"))
    # the compressed entries likewise: normalised, rotated and encoded by the store in one launch, or separately
    monkeypatch.setattr(EntryStore, "write_normed", lambda self, *a: False)
    assert torch.equal(early, _incremental_logits(model, ids, [3, 1], kv="fp8"))


def test_mtp_block_loads_and_drafts(tmp_path):
    model = _tiny_model(tmp_path, CFG_A, dtype="fp8")
    cfg = model.config
    assert len(model.mtp) == 1 and model.mtp[0].e_proj.weight.abs().sum() > 0
    ids = _ids(7, 1, 20, cfg.vocab_size)[0]
    cache = static_v4_cache(cfg, 1, 32, "float32", "cpu")
    with torch.inference_mode():
        b = build_forward_batch([SeqChunk(0, 0, ids[:-1].tolist(), cache.static_tables(0))], cfg.sliding_window,
                                cache.compress_kinds, cache.block_size, "cpu")
        streams = model(b, cache.layers)
        logits = model.mtp_logits(streams, ids[1:], model.step_context(b), cache.mtp[0])
    assert logits.shape == (19, cfg.vocab_size) and torch.isfinite(logits).all()


def test_dspark_checkpoint_loads_every_stage(tmp_path):
    d = write_checkpoint(tmp_path / "dspark", PRESETS["tiny-dspark"], seed=1, dtype="fp8")
    model = load_model(str(d), dtype=torch.float32)[0]
    assert model.config.has_dspark and len(model.mtp) == 3
    assert model.mtp[0].main_proj.weight.abs().sum() > 0
    assert model.mtp[2].confidence_head.proj.weight.abs().sum() > 0
    assert model.mtp[2].markov_head.markov_w2.weight.abs().sum() > 0 and model.mtp[2].hc_head_scale.abs().sum() > 0
    assert not getattr(model, "unmapped_tensors", {})


def test_dspark_features_are_the_streams_leaving_the_target_layers(tmp_path):
    """-0731's DSpark reads the residual streams after each of dspark_target_layer_ids (vLLM 0.34.0 and SGLang
    0.5.23 take V4's target ids as "after layer L", V4.1's as "entering layer L"), averaged over the streams."""
    d = write_checkpoint(tmp_path / "dspark", PRESETS["tiny-dspark"], seed=1, dtype="fp8")
    model = load_model(str(d), dtype=torch.float32)[0]
    cfg = model.config
    leaving = {}
    for i in cfg.dspark_target_layer_ids:
        model.layers[i].register_forward_hook(lambda m, a, out, i=i: leaving.__setitem__(i, out.float().mean(1)))
    ids = _ids(3, 1, 20, cfg.vocab_size)[0]
    cache = static_v4_cache(cfg, 1, 32, "float32", "cpu")
    with torch.inference_mode():
        b = build_forward_batch([SeqChunk(0, 0, ids.tolist(), cache.static_tables(0))], cfg.sliding_window,
                                cache.compress_kinds, cache.block_size, "cpu")
        streams, feats = model(b, cache.layers, draft_features=True)
    assert feats.shape == (20, len(cfg.dspark_target_layer_ids) * cfg.hidden_size)
    assert torch.equal(feats, torch.cat([leaving[i] for i in cfg.dspark_target_layer_ids], -1))
    assert torch.equal(leaving[cfg.dspark_target_layer_ids[-1]], streams.float().mean(1))  # the last is the top


def test_indexer_ties_break_to_the_lowest_entry(tmp_path):
    model = _tiny_model(tmp_path, CFG_B)
    idx = copy.deepcopy(model.layers[1].attn.indexer)
    idx.wq_b.weight.data.zero_()  # every score is relu(0) = 0: a tie among all visible entries
    cfg = model.config
    cache = static_v4_cache(cfg, 1, 64, "float32", "cpu")
    ids = _ids(8, 1, 40, cfg.vocab_size)[0].tolist()
    b = build_forward_batch([SeqChunk(0, 0, ids, cache.static_tables(0))], cfg.sliding_window,
                            cache.compress_kinds, cache.block_size, "cpu")
    ctx = model.step_context(b)
    x = torch.randn(40, cfg.hidden_size)
    qr = torch.randn(40, cfg.q_lora_rank)
    with torch.inference_mode():
        sel = idx(x, qr, b, b.plans[(4, True)], cache.layers[1].index_keys, cache.layers[1].carry["indexer"],
                  ctx.rope_compress, ctx.entry_rope(b.plans[(4, True)]))
    visible = (torch.arange(40) + 1) // 4
    for t in range(40):
        want = list(range(min(int(visible[t]), 4)))
        assert sel[t].tolist() == want + [-1] * (4 - len(want))


@pytest.mark.gpu
def test_cuda_matches_cpu(tmp_path):
    d = write_checkpoint(tmp_path / "ckpt", CFG_A, seed=0, dtype="fp8")
    ids = _ids(9, 2, 80, CFG_A["vocab_size"])
    cpu = _full_logits(load_model(str(d), dtype=torch.float32)[0], ids)
    model = load_model(str(d), dtype=torch.float32, device="cuda")[0]
    cfg = model.config
    cache = static_v4_cache(cfg, 2, 80, "float32", "cuda")
    with torch.inference_mode():
        chunks = [SeqChunk(i, 0, r.tolist(), cache.static_tables(i)) for i, r in enumerate(ids)]
        b = build_forward_batch(chunks, cfg.sliding_window, cache.compress_kinds, cache.block_size, "cuda")
        gpu = model.compute_logits(model(b, cache.layers)).view(*ids.shape, -1).cpu()
    _assert_close(gpu, cpu, rel=1e-3)


def _decode_steps(model, device: str, kv: str, mode: str):
    """Logits of 50 decode steps after a 20-token prefill (3 requests, then 2): `eager` plans,
    `fixed` = the padded fixed-shape plans run eagerly, `graph` = those replayed as CUDA graphs."""
    from deepinfer.worker.cuda_graph import DecodeGraphs

    cfg = model.config
    ids = _ids(10, 3, 70, CFG_A["vocab_size"]).tolist()
    cache = static_v4_cache(cfg, 3, 80, kv, device, scratch=True)
    runner = DecodeGraphs(model, cache, cache.scratch_slot, cache.scratch_addr, visible_bucket=4, device=device)
    steps = []
    with torch.inference_mode():
        b = build_forward_batch([SeqChunk(i, 0, ids[i][:20], cache.static_tables(i)) for i in range(3)],
                                cfg.sliding_window, cache.compress_kinds, cache.block_size, device)
        model(b, cache.layers)
        for p in range(20, 70):
            chunks = [SeqChunk(i, p, [ids[i][p]], cache.static_tables(i)) for i in (range(3) if p < 50 else range(2))]
            if mode == "graph":
                out = runner.run(chunks)
            elif mode == "fixed":
                out = runner.forward(runner.plan(chunks)[1])[:len(chunks)]
            else:
                b = build_forward_batch(chunks, cfg.sliding_window, cache.compress_kinds, cache.block_size, device)
                out = model.compute_logits(model(b, cache.layers)[b.logits_idx])
            steps.append(out.float().cpu())
    return torch.cat(steps), runner


def test_fixed_shape_decode_plans_match_the_varlen_plans(tmp_path):
    """Padding rows, scratch compressor rows and bucketed entry widths change nothing (fp32)."""
    model = _tiny_model(tmp_path, CFG_A)
    _assert_close(_decode_steps(model, "cpu", "float32", "fixed")[0], _decode_steps(model, "cpu", "float32", "eager")[0])


@pytest.mark.gpu
def test_cuda_graph_decode_replays_the_fixed_shape_step_exactly(tmp_path):
    d = write_checkpoint(tmp_path / "ckpt", CFG_A, seed=0, dtype="fp8")
    model = load_model(str(d), dtype=torch.bfloat16, device="cuda")[0]
    graph, runner = _decode_steps(model, "cuda", "fp8", "graph")
    assert len(runner.graphs) > 1  # several batch / entry-width buckets were captured
    assert torch.equal(graph, _decode_steps(model, "cuda", "fp8", "fixed")[0])


@pytest.mark.gpu
def test_fp4_index_keys_score_through_the_per_token_kernel_as_through_torch(tmp_path, monkeypatch):
    """FP8 cache on CUDA (FP4 index keys): decode's indexer scores through the per-token Triton kernel reading the
    keys as mxfp4 rows (layers/attention.py) and, with that kernel refused, through the gathered fp32 keys and torch
    einsums. The two differ in fp32 summation order only, so the decode logits agree to bf16 noise."""
    from deepinfer.kernels import index_scores

    d = write_checkpoint(tmp_path / "ckpt", CFG_A, seed=0, dtype="fp8")
    model = load_model(str(d), dtype=torch.bfloat16, device="cuda")[0]
    launched = []
    real = index_scores._launch_per_token
    monkeypatch.setattr(index_scores, "_launch_per_token",
                        lambda *a, **k: launched.append(k.get("fmt")) or real(*a, **k))
    kernel = _decode_steps(model, "cuda", "fp8", "fixed")[0]
    assert "mxfp4" in launched
    monkeypatch.setattr(index_scores, "supported_store", lambda q, fmt: False)
    launched.clear()
    torch_path = _decode_steps(model, "cuda", "fp8", "fixed")[0]
    assert "mxfp4" not in launched
    _assert_close(kernel, torch_path, rel=2e-2)
