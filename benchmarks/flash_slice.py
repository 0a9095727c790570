"""The Flash slice sweep: V4-Flash's first four layers at full width (sliding, sliding, CSA, HCA;
hash, hash, hash, top-k MoE; 256 experts), and a V4.1-Flash slice at full width with one layer of
every CSA2 role (SLICES says what each slice is), random weights, on one GPU.

Engines: deepinfer bf16, deepinfer-fp8 (the checkpoint's formats as LLM holds them where the copy
fits: FP8 blocks, FP4 experts rewritten as FP8 codes), deepinfer-fp4 (FP4 experts kept packed),
deepinfer bf16 in batch-invariant mode, transformers bf16 (DeepseekV4ForCausalLM) on the V4 slice;
deepinfer-v41 bf16, deepinfer-v41-fp8 / -fp4 (FP8 32x32 blocks + FP4 experts) on the V4.1 slice, its cache in
the reference formats (kv_cache_dtype "auto": FP8 window, NVFP4 entries, MXFP4 index keys). Rows:
prefill (batch x length) and decode steps (batch at a context), each with the roofline of that
work on this GPU: max(bytes moved / measured copy bandwidth, FLOPs / measured bf16 matmul rate),
both ceilings measured at the start of the run. deepinfer's rows time the engine's own step
(EngineCore.step over the Scheduler and ModelRunner, as LLM builds them), with async scheduling
and CUDA graphs wherever the engine uses them for that model (a row's note says where it did
not); decode rows with CUDA graphs add a "decode-graph-replay" row that times the graph replay
alone. TIMING says exactly what each phase's step_ms covers and is written into the results.
Decode state for deepinfer is filled synthetically (timing does not depend on cache values);
transformers builds its cache by prefilling, so its long-context rows are skipped.

    python benchmarks/flash_slice.py --engines deepinfer,deepinfer-fp8,deepinfer-v41,deepinfer-v41-fp8 --out r.json
    python benchmarks/flash_slice.py --smoke   # tiny widths on the CPU; writes under a temporary directory
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from datetime import date
from pathlib import Path

import torch

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out

DEVICE = "cuda"
PREFILL = [(1, 2048), (4, 2048), (1, 8192)]
DECODE_BATCHES = [1, 4, 16, 64, 128]
DECODE_CONTEXTS = [256, 4096]
LAYER_RATIOS = [0, 0, 4, 128]
# deepinfer-invariant: bf16 in batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1), for its cost
V41_ENGINES = ("deepinfer-v41", "deepinfer-v41-fp8", "deepinfer-v41-fp4")
ENGINES = ("deepinfer", "deepinfer-fp8", "deepinfer-fp4", "deepinfer-invariant", *V41_ENGINES, "transformers")
# timed steps of a decode row per --reps: the V4.1 slice's steps are longer (twice the layers, three times
# the weight bytes), so its rows time half as many and the whole V4 + V4.1 sweep fits a few minutes
DECODE_STEPS_PER_REP = {"v4": 10, "v41": 5}


BASE_PRESET = "flash"
BASE_PRESET_V41 = "flash41"
SLICE41_ARGS: dict = {}  # slice41_preset's keyword arguments (the smoke run keeps tiny41's hash primes)

SLICES = {
    "v4": "V4-Flash layers 0-3 at full width (hidden 4096, 64 heads x 512, 256 experts top-6): sliding, "
          "sliding, CSA (ratio 4), HCA (ratio 128); hash routing in layers 0-2.",
    "v41": "V4.1-Flash at full width (hidden 5120, 64 heads x 512, 384 experts top-6, every other key as released: "
           "presets_v41.slice41_preset), 8 layers, one of every role: SWA; SWA + Engram; Full ratio-2 KV source; "
           "Reuse; Reindex; Full ratio-1 candidate source; Reindex and Reuse under the candidates. Engram hashes "
           "as released (n-grams 2-4 x 8 heads, 256-wide FP8 rows, 99092 compressed ids) into a table with fewer "
           "rows (hash primes from 1e6: 24 M rows, 6.3 GB instead of 98 GB); the tokenizer's compressed token "
           "map is synthetic (id % 99092: the hashing work does not depend on it). The 8 layers' routed experts "
           "share one set of weights (8 x 27 GB of bf16 experts do not fit the GPU); each layer still reads its "
           "experts from HBM (27 GB per layer against a 50 MB L2), and the roofline counts 8 distinct sets.",
}


def slice_config() -> dict:
    from deepinfer.tools.make_checkpoint import PRESETS

    return {**PRESETS[BASE_PRESET], "num_hidden_layers": 4, "compress_ratios": LAYER_RATIOS,
            "num_hash_layers": 3, "num_nextn_predict_layers": 0}


def slice_config_v41() -> dict:
    """The V4.1 slice's config.json dict (nested text_config)."""
    from deepinfer.tools.presets_v41 import slice41_preset

    return slice41_preset(BASE_PRESET_V41, **SLICE41_ARGS)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int = 5) -> float:
    """Median seconds of `fn` after one warm-up, synchronising the GPU."""
    fn()
    _sync()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def pipelined(fn, steps: int) -> float:
    """Seconds per call of `fn` when call i+1 is issued before waiting for call i (each wait is on
    the call before the one just issued). CUDA only."""
    fn()
    _sync()
    t = time.perf_counter()
    prev = None
    for _ in range(steps):
        fn()
        ev = torch.cuda.Event()
        ev.record()
        if prev is not None:
            prev.synchronize()
        prev = ev
    _sync()
    return (time.perf_counter() - t) / steps


def ceilings() -> dict:
    if DEVICE != "cuda":
        return {"hbm_gbs": 1.0, "bf16_tflops": 1.0}  # smoke runs only
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    hbm = 2 * src.numel() / timed(lambda: dst.copy_(src), 10) / 1e9
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * 8192 ** 3 / timed(lambda: a @ a, 10) / 1e12
    del a
    torch.cuda.empty_cache()  # the engines run in child processes that need the memory
    return {"hbm_gbs": round(hbm, 1), "bf16_tflops": round(tflops, 1)}


# ---- cost model of the slice: weights touched + KV read (bytes), linear + attention FLOPs ----

def _attn_params(c: dict, ratio: int) -> int:
    d, h, hd, rq, ro, g = (c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"],
                           c["o_lora_rank"], c["o_groups"])
    n = d * rq + rq * h * hd + d * hd + ro * h * hd + g * ro * d
    if ratio == 4:  # overlapped compressor (2 x width 2*hd) + indexer (wq_b, weights_proj, its compressor)
        hi, di = c["index_n_heads"], c["index_head_dim"]
        n += 2 * 2 * hd * d + rq * hi * di + d * hi + 2 * 2 * di * d
    elif ratio:
        n += 2 * hd * d
    return n


def _keys(c: dict, ratio: int, context: int) -> int:
    """Keys one query at `context` attends to in a layer of this ratio."""
    extra = min(c["index_topk"], context // 4) if ratio == 4 else (context // ratio if ratio else 0)
    return min(c["sliding_window"], context) + extra


FP4_EXPERT_BYTES = 0.5 + 1 / 32  # bytes per routed-expert weight as shipped: FP4 codes + one E8M0 byte per 32


def roofline_ms(c: dict, tokens: int, batch: int, context: int, decode: bool, ceil: dict, fp8: bool,
                expert_bytes: float | None = None) -> float:
    """`tokens` new tokens over `batch` requests at `context` (decode) or prompts of tokens/batch.
    `expert_bytes`: bytes per routed-expert weight (default: as shipped, FP4_EXPERT_BYTES when `fp8`, else 2);
    held_expert_bytes(model) gives the engine's held format (FP8 codes once repacked)."""
    d, hd, h = c["hidden_size"], c["head_dim"], c["num_attention_heads"]
    expert = 3 * d * c["moe_intermediate_size"]
    wbytes, ebytes = (1, FP4_EXPERT_BYTES) if fp8 else (2, 2)   # FP8 dense / FP4 experts with E8M0 per 32
    ebytes = ebytes if expert_bytes is None else expert_bytes
    E, k = c["n_routed_experts"], c["num_experts_per_tok"]
    touched = E * (1 - (1 - 1 / E) ** (tokens * k))       # expected distinct experts per layer
    weights = sum(_attn_params(c, r) * wbytes + (expert * wbytes + touched * expert * ebytes)
                  for r in LAYER_RATIOS) + 2 * c["vocab_size"] * d
    entry = 584 if fp8 else 2 * hd
    seq = tokens // batch
    ctx_of = (lambda i: context) if decode else (lambda i: i + 1)  # noqa: E731
    kv = batch * sum(entry * _keys(c, r, context) for r in LAYER_RATIOS) if decode else 0
    attn_flops = sum(4 * h * hd * _keys(c, r, ctx_of(i)) for r in LAYER_RATIOS
                     for i in (range(seq) if not decode else [0])) * batch
    flops = 2 * tokens * sum(_attn_params(c, r) + (k + 1) * expert for r in LAYER_RATIOS) \
        + attn_flops + 2 * batch * c["vocab_size"] * d
    return 1e3 * max((weights + kv) / (ceil["hbm_gbs"] * 1e9), flops / (ceil["bf16_tflops"] * 1e12))


# ---- the V4.1 slice's cost model: weights touched, Engram rows and cache read (bytes), FLOPs ----

# bytes per element of the V4.1 cache formats: kv_cache_dtype -> (window, compressed entry, index key)
CACHE_BYTES_V41 = {
    "auto": (1 + 1 / 32, 0.5 + 1 / 16, 0.5 + 1 / 32),   # FP8 + 2^k scale per 32; NVFP4 (e4m3 per 16); MXFP4
    "fp8": (1 + 1 / 32, 0.5 + 1 / 16, 0.5 + 1 / 32),
    "bfloat16": (2, 2, 2),
    "float32": (4, 4, 4),
}


def _layer_weights41(c, i: int) -> list[tuple[int, str, bool]]:
    """(parameters, storage, applied to every row) of layer i's weights other than its routed experts.
    Storage "q" is FP8 in the quantised engine and bf16 otherwise, "bf16" and "fp32" are kept so in
    both. Under bounded replay the replay layer applies the last flag's weights (the window kv, the
    compressor, the index keys) to every row of the prompt, the others to the kept rows only."""
    from deepinfer.models.config_v41 import FULL, REINDEX

    d, h, hd, rq, ro, g = (c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_lora_rank,
                           c.o_groups)
    n, hi, di = c.hc_mult, c.index_n_heads, c.index_head_dim
    role, ratio = c.role(i), c.compress_ratios[i]
    out = [(d * hd, "q", True),                                                    # wkv
           (d * rq + rq * h * hd + h * hd * ro + g * ro * d, "q", False),          # wq_a, wq_b, wo_a, wo_b
           (2 * (2 + n) * n * n * d, "fp32", False),                               # mHC projections
           (c.n_routed_experts * d, "bf16", False),                                # router
           (3 * d * c.moe_intermediate_size * c.n_shared_experts, "q", False)]     # shared expert
    if role == FULL:  # compressor (fp32 projections; a gate when it pools) and the index-key projection
        out += [((2 if ratio > 1 else 1) * d * hd, "fp32", True), (hd * di, "bf16", True)]
    if role in (FULL, REINDEX):  # indexer queries and head weights
        out += [(rq * hi * di, "q", False), (d * hi, "bf16", False)]
    if i in c.engram_layer_ids:
        hash_dim = (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim
        out.append((hash_dim * d * (n + 1), "q", True))
    return out


def _reads41(c, i: int, pos: int) -> tuple[int, int, int]:
    """(window rows, compressed entries, index keys scored) of a query at position `pos` - 1 in layer i."""
    from deepinfer.models.config_v41 import FULL, REINDEX

    ratio, cand = c.compress_ratios[i], c.candidate_source_layer_id
    window = min(c.sliding_window, pos)
    if not ratio:
        return window, 0, 0
    visible = pos // ratio
    scored = 0
    if c.role(i) in (FULL, REINDEX):  # below the candidate source only the candidate blocks are scored
        scored = min(visible, c.candidate_topk_blocks * c.candidate_block_size) if 0 <= cand < i else visible
    return window, min(c.index_topk, visible), scored


def roofline41_ms(c, tokens: int, batch: int, context: int, decode: bool, ceil: dict, fp8: bool,
                  kv_cache_dtype: str, keep: int | None = None, expert_bytes: float | None = None) -> float:
    """roofline_ms of the V4.1 slice (`c`: its DeepseekV41Config). Bytes: every layer's weights (routed
    experts: the expected distinct experts its rows select, FP4 + E8M0 per 32 in the quantised engine),
    the Engram rows the tokens read (FP8 + E8M0 per 32), the fp32 head, and in decode the cache each
    query reads in the formats of `kv_cache_dtype`: window rows, the top-k compressed entries and
    the index keys the indexer scores. FLOPs: projections, experts, attention and indexer scores.
    `keep`: a prefill's SWA bounded replay (as the engine runs it): from the replay layer (the last
    KV source) up, each prompt's last `keep` rows only. `expert_bytes`: as roofline_ms's."""
    d, hd, h, n_layers = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_hidden_layers
    bo, bi = c.quant.block_size or (1, 1)
    per = {"q": (1 + 1 / (bo * bi)) if fp8 else 2, "bf16": 2, "fp32": 4}
    ebytes = (FP4_EXPERT_BYTES if fp8 else 2) if expert_bytes is None else expert_bytes
    expert = 3 * d * c.moe_intermediate_size
    E, k = c.n_routed_experts, c.num_experts_per_tok
    seq = 1 if decode else tokens // batch
    cut = max(c.kv_source_layer_ids, default=-1) if keep is not None and keep < seq and not decode else n_layers
    kept = range(seq - keep + 1, seq + 1) if cut < n_layers else range(1, seq + 1)
    hash_heads = (c.engram_max_ngram_size - 1) * c.engram_n_heads
    row_bytes = c.engram_head_dim * ((1 + 1 / 32) if c.quant.block_size else 2)   # the table stays as stored
    weights = tokens * len(c.engram_layer_ids) * hash_heads * row_bytes     # Engram rows
    weights += 4 * c.vocab_size * d + 2 * tokens * d                         # fp32 head, embedding rows
    flops = 2 * batch * c.vocab_size * d
    win_b, entry_b, key_b = CACHE_BYTES_V41[kv_cache_dtype]
    di, hi = c.index_head_dim, c.index_n_heads
    kv = 0
    for i in range(n_layers):
        rows = tokens if i < cut else batch * len(kept)
        weights += E * (1 - (1 - 1 / E) ** (rows * k)) * expert * ebytes    # distinct experts the rows select
        flops += 2 * rows * k * expert
        for p, kind, every in _layer_weights41(c, i):
            weights += p * per[kind]
            flops += 2 * (tokens if every and i <= cut else rows) * p
        for pos in [context] if decode else (range(1, seq + 1) if i < cut else kept):
            window, entries, scored = _reads41(c, i, pos)
            flops += batch * (4 * h * hd * (window + entries) + 2 * hi * di * scored)
            if decode:
                kv += batch * (hd * (window * win_b + entries * entry_b) + di * scored * key_b)
    return 1e3 * max((weights + kv) / (ceil["hbm_gbs"] * 1e9), flops / (ceil["bf16_tflops"] * 1e12))


# ---- deepinfer: rows timed through the engine (EngineCore over Scheduler + ModelRunner) ----

BLOCK_SIZE = 64     # the engine's default cache block size
# engine steps before a decode row is timed: the first captures its CUDA graph; the FP8 engine's batch-1 rows had
# a start-up transient of 2 (13d47bf) and 5 (b082dd3) steps at ~2 ms after three warm-up steps, against 1.1 ms
# steady (cause not found; benchmarks/NOTES.md, "2026-12-02, fifth session"): 16 keep it out of a steady row
DECODE_WARMUP = 16

# what each phase's step_ms is, written into the results next to the rows
TIMING = {
    "deepinfer:prefill":
        "one EngineCore.step() (the engine as LLM builds it: V4.1 prefills with its default SWA bounded replay) "
        "taking `batch` new prompts of `seq` tokens: Scheduler.schedule, ModelRunner.launch (input planning, "
        "forward, sampling of each prompt's "
        "first token), ModelRunner.collect (the host waits for the sampled tokens) and Scheduler.update; "
        "median of --reps steps after a warm-up. Prefill steps never overlap one another in the engine "
        "(Scheduler.schedule_ahead plans decode steps only; these prompts ask for one token).",
    "deepinfer:decode":
        "seconds per EngineCore.step() in steady pure decode of `batch` requests, greedy sampling, the engine "
        "as LLM builds it: with async scheduling (where the runner takes placeholder inputs) a step plans and "
        "launches the next one before collecting its own sampled tokens, then updates the scheduler; "
        "otherwise a step schedules, launches, waits for its tokens and updates; CUDA graphs where "
        "ModelRunner uses them. The row's note names what the engine did not use (graphs, async "
        "scheduling). The timed steps compute positions `context` - 1 - steps .. `context` - 2 (and, async, launch "
        "the step at `context` - 1), steps = 10 * reps (V4 slice) or 5 * reps (V4.1 slice), after "
        f"{DECODE_WARMUP} untimed steps (the first captures the row's CUDA graph); `diag` lists each "
        "timed step's ms, the CUDA graphs captured during them (captures happen on a graph's first use), GC "
        "pauses and allocator retries. The requests' cache state comes from a prefill that is "
        "scheduled but not computed (the cache stays zero): step times do not depend on cache values.",
    "deepinfer:decode-graph-replay":
        "not an engine step: DecodeGraphs.run alone (host planning, one input copy, graph replay) for the "
        "decode row's requests, back to back, each call issued before waiting for the one before; no "
        "scheduler, sampling or collect. Sweeps recorded before the engine-step rows timed decode this way.",
    "transformers:prefill":
        "one synchronous forward of DeepseekV4ForCausalLM (use_cache=False, logits_to_keep=1), median of --reps",
    "transformers:decode":
        "(generate of 9 tokens - generate of 1 token) / 8, greedy: generate's own sampling and host loop "
        "included",
}


INIT_CHUNK = 1 << 28  # elements filled at a time: bounds the fp32 / int64 temporaries of large tensors


def _init_random(model) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    seen = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:  # a tensor several modules share
            continue
        seen.add(t.data_ptr())
        rows = max(1, INIT_CHUNK // max(1, t[0].numel())) if t.dim() else 1
        for part in (t.split(rows) if t.dim() else [t]):
            _fill_random(name, part, model.config.n_routed_experts, g)


def _fill_random(name: str, t: torch.Tensor, n_experts: int, g: torch.Generator) -> None:
    if t.dtype in (torch.bfloat16, torch.float32):
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif "hc_" in name and name.endswith("_scale"):
            t.fill_(1.0)
        else:
            t.normal_(0, 0.02, generator=g)
    elif name.endswith("tid2eid"):
        t.copy_(torch.randint(0, n_experts, t.shape, device=DEVICE, generator=g))
    elif t.dtype == torch.float8_e4m3fn:
        t.copy_((torch.randn(t.shape, device=DEVICE, generator=g) * 0.5).to(torch.float8_e4m3fn))
    elif t.dtype == torch.float8_e8m0fnu:
        t.view(torch.uint8).fill_(120)
    elif t.dtype in (torch.int8, torch.uint8):
        t.copy_(torch.randint(-128, 127, t.shape, device=DEVICE, generator=g).to(t.dtype))


def deepinfer_model(fp8: bool, repack: bool = True):
    from deepinfer.models import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config.from_dict(slice_config())
    with torch.device(DEVICE):
        model = DeepseekV4ForCausalLM(cfg, dtype=torch.bfloat16, quantized=fp8).eval()
    _init_random(model)
    return _as_llm_holds(model, repack)


def _as_llm_holds(model, repack: bool = True):
    """FP4 routed experts as LLM holds them on a GPU where the copy fits (the slices fit an H200): FP8
    codes, the faster kernel (engine/memory_fit.py repack_fits; layers/moe.py repack_fp4_as_fp8); FP8
    Linears as load_model leaves them (layers/linear.py prepare_fp8_linears)."""
    from deepinfer.layers.linear import prepare_fp8_linears
    from deepinfer.layers.moe import repack_fp4_experts

    if DEVICE == "cuda" and repack:
        repack_fp4_experts(model)
    prepare_fp8_linears(model)  # as load_model leaves a model: FP8 Linears' W8A8 scales widened once
    return model


def deepinfer_model_v41(fp8: bool, repack: bool = True):
    """The V4.1 slice (SLICES["v41"]): DeepseekV41ForCausalLM as LLM builds it (bf16 activations; with
    `fp8` the weights stay FP8 / FP4 as shipped), its layers' routed experts one shared set, and the
    Engram hash constants from a synthetic compressed token map of the config's size."""
    from dataclasses import replace

    from deepinfer.layers.moe import MLP, Experts
    from deepinfer.models.config_v41 import DeepseekV41Config
    from deepinfer.models.deepseek_v4 import quant_spec
    from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM

    cfg = DeepseekV41Config.from_dict(slice_config_v41())
    dtype, (quant, expert_quant) = torch.bfloat16, quant_spec(cfg, fp8)
    # built with one quantisation block of expert width, then given full-width experts: a shared routed
    # set and a shared expert per layer (the throwaway narrow ones are freed)
    narrow = replace(cfg, moe_intermediate_size=(cfg.quant.block_size or (32, 32))[0])
    with torch.device(DEVICE):
        model = DeepseekV41ForCausalLM(narrow, dtype=dtype, quantized=fp8).eval()
        experts = Experts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.swiglu_limit, dtype,
                          expert_quant)
        for layer in model.layers:
            layer.ffn.experts = experts
            layer.ffn.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           cfg.swiglu_limit, dtype, quant)
    model.config = cfg
    _init_random(model)
    n = cfg.engram_compressed_vocab_size
    model.set_engram_vocab([i % n for i in range(cfg.vocab_size)])  # synthetic: every compressed id used
    return _as_llm_holds(model, repack)


def engine_cache(cfg, num_slots: int, max_len: int, kv_dtype: str, device: str | None = None):
    """(KVCacheManager, V4Cache) for `num_slots` requests of up to `max_len` tokens each, with the scratch
    slot decode graphs pad with (as LLM allocates them)."""
    from deepinfer.engine.kv_manager import KVCacheManager
    from deepinfer.worker.kv_cache import allocate_v4_cache, cache_spec

    ratios = cache_spec(cfg, kv_dtype, BLOCK_SIZE).ratios
    per_request = KVCacheManager(1, dict.fromkeys(ratios, 0), BLOCK_SIZE).blocks_for(max_len)
    blocks = {m: num_slots * n for m, n in per_request.items()}
    cache = allocate_v4_cache(cfg, num_slots, blocks, kv_dtype, device or DEVICE, BLOCK_SIZE, scratch=True)
    return KVCacheManager(num_slots, blocks, BLOCK_SIZE), cache


def default_replay_keep(cfg) -> int | None:
    """Rows LLM's default SWA bounded replay keeps (the runner applies it to models with a replay layer)."""
    from deepinfer.config import EngineConfig
    from deepinfer.llm import _replay_keep

    return _replay_keep(EngineConfig(), cfg)


def deepinfer_engine(model, num_slots: int, max_len: int, kv_dtype: str, budget: int, invariant: bool,
                     graphs: bool):
    """An EngineCore wired as LLM wires one with its defaults (async scheduling on where the runner takes
    placeholder inputs, bounded replay of V4.1 prefills) over `engine_cache`."""
    from deepinfer.engine.engine_core import EngineCore
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.worker.model_runner import ModelRunner

    kv, cache = engine_cache(model.config, num_slots, max_len, kv_dtype)
    runner = ModelRunner(model, cache, DEVICE, seed=0, replay_keep=default_replay_keep(model.config),
                         cuda_graphs=graphs, batch_invariant=invariant)
    return EngineCore(Scheduler(kv, num_slots, budget, max_len), runner, None, async_scheduling=True)


def prefill_seconds(engine, prompts: list[list[int]], reps: int) -> float:
    """Median seconds of the engine step that prefills `prompts` (see TIMING), after one warm-up."""
    from deepinfer import SamplingParams
    from deepinfer.engine.request import Request

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ts = []
    for rep in range(reps + 1):
        reqs = [Request(f"prefill{rep}-{i}", p, params) for i, p in enumerate(prompts)]
        for r in reqs:
            engine.add_request(r)
        _sync()
        t = time.perf_counter()
        done = engine.step()
        _sync()
        ts.append(time.perf_counter() - t)
        _check_finished(done, len(reqs), "length")
        for r in done:
            engine.completion(r, 0)
    return sorted(ts[1:])[(len(ts) - 1) // 2]


def _check_finished(done: list, expected: int, reason: str | None) -> None:
    """A timed step must finish exactly the requests the row expects, for the reason expected (a failing
    step may come back as aborted requests rather than an exception)."""
    wrong = [r for r in done if r.finish_reason != reason]
    if len(done) != expected or wrong:
        first = "".join(f" ({r.request_id}: {r.finish_reason}, {getattr(r, 'error', None)})" for r in wrong[:1])
        raise RuntimeError(f"{len(done)} requests finished in a timed step where {expected} should{first}")


def start_decoding(engine, prompts: list[list[int]], max_tokens: int) -> list:
    """Requests in the state their prefill leaves (prompt cached, first token sampled), without computing
    it: the prefill step is scheduled and its output made up (each request 'samples' its last prompt token)."""
    from deepinfer import SamplingParams
    from deepinfer.engine.outputs import ModelOutput
    from deepinfer.engine.request import Request

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [Request(f"decode{i}", p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    so = engine.scheduler.schedule()
    engine.scheduler.update(so, ModelOutput({c.request_id: [c.token_ids[-1]] for c in so.chunks}))
    if any(len(r.output_token_ids) != 1 for r in reqs):
        raise RuntimeError("the made-up prefill did not take every prompt in one step")
    return reqs


def decode_row_engine(model, B: int, C: int, kv: str, steps: int, invariant: bool, graphs: bool, tokens):
    """(engine, requests) of a decode row: B requests whose prompts (tokens(n) each) end DECODE_WARMUP +
    `steps` + 1 positions before context C, made up as prefilled (start_decoding). Under async scheduling
    the last timed step also launches the step at position C - 1: no timed step reaches position C, which
    (C a power of two) would need the next entry-width bucket's CUDA graph, captured on first use."""
    prompt_len = C - DECODE_WARMUP - steps - 1  # the last timed step launches the one at C - 1 ahead
    if prompt_len < 1:
        raise ValueError(f"context {C} is shorter than the {DECODE_WARMUP + steps} steps of a decode row")
    engine = deepinfer_engine(model, B, C + 8, kv, B * prompt_len, invariant, graphs)
    return engine, start_decoding(engine, [tokens(prompt_len) for _ in range(B)], DECODE_WARMUP + steps + 8)


def decode_seconds(engine, steps: int, diag: dict | None = None) -> float:
    """Seconds per engine step over `steps` steady decode steps (see TIMING): one step is in flight when the
    clock starts and one when it stops, so no pipeline fill or drain is counted. `diag`, if given, gets
    what happened during the timed steps: each step's ms, CUDA graphs captured, Python GC pauses (ms)
    and caching-allocator retries (each frees cached blocks and synchronises the device)."""
    for _ in range(DECODE_WARMUP):
        _check_finished(engine.step(), 0, None)
    graphs = engine.runner.graphs
    n_graphs = len(graphs.graphs) if graphs is not None else 0
    retries = _alloc_retries()
    gc_ms, gc_start = [], []

    def on_gc(phase, _info):
        if phase == "start":
            gc_start.append(time.perf_counter())
        elif gc_start:
            gc_ms.append(1e3 * (time.perf_counter() - gc_start.pop()))

    each = []
    gc.callbacks.append(on_gc)
    try:
        t = t0 = time.perf_counter()
        for _ in range(steps):
            _check_finished(engine.step(), 0, None)
            now = time.perf_counter()
            each.append(now - t)
            t = now
    finally:
        gc.callbacks.remove(on_gc)
    if diag is not None:
        diag.update(step_ms_each=[round(1e3 * x, 3) for x in each],
                    graphs_captured=(len(graphs.graphs) if graphs is not None else 0) - n_graphs,
                    gc_ms=round(sum(gc_ms), 3), alloc_retries=_alloc_retries() - retries)
    return (t - t0) / steps


def _alloc_retries() -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if DEVICE == "cuda" else 0


def graph_replay_seconds(graphs, reqs: list, steps: int) -> float:
    """Seconds per DecodeGraphs.run at the requests' next positions (see TIMING: not an engine step)."""
    from deepinfer.state.forward_batch import SeqChunk

    _sync()  # the engine's step in flight computes these very positions with the same tokens
    chunks = [SeqChunk(r.slot, r.num_computed_tokens, [r.output_token_ids[-1]], r.block_tables) for r in reqs]
    return pipelined(lambda: graphs.run(chunks), steps)


def _engine_note(engine) -> str | None:
    """What the engine did not use for a row's steps (None: CUDA graphs and async scheduling both on)."""
    off = ["eager (no CUDA graphs)"] if engine.runner.graphs is None else []
    off += [] if engine.async_scheduling else ["synchronous steps (no async scheduling)"]
    return "; ".join(off) or None


def _failed_row(name: str, phase: str, B: int, S: int, C: int, err: Exception) -> dict:
    """A row whose engine step raised: recorded (step_ms null, the error in its note), the sweep goes on."""
    import traceback

    traceback.print_exception(err)
    return _row(name, phase, B, S, C, None, None, None, f"failed: {type(err).__name__}: {str(err)[:300]}")


def held_expert_bytes(model) -> float:
    """Bytes per routed-expert weight as `model` holds them (codes and scales): 2 in bf16, FP4_EXPERT_BYTES
    packed, 1 + 1/128 or 1 + 1/32 as FP8 codes after the repack (folded scales or not)."""
    from deepinfer.layers.moe import Experts

    m = next(m for m in model.modules() if isinstance(m, Experts))
    held = sum(t.numel() * t.element_size() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
    codes_per_byte = 2 if m.w2.dtype in (torch.int8, torch.uint8) else 1  # packed FP4: two codes a byte
    return held / (3 * m.w2.numel() * codes_per_byte)


def deepinfer_rows(fp8: bool, invariant: bool, ceil: dict, args, name: str, arch: str = "v4") -> list[dict]:
    """Rows of one deepinfer engine on the V4 slice (`arch` "v4") or the V4.1 slice ("v41")."""
    if arch == "v41":
        model, kv = deepinfer_model_v41(fp8, not name.endswith("-fp4")), getattr(args, "v41_kv_cache_dtype", "auto")
        keep = default_replay_keep(model.config)

        def roofline(tokens, B, C, decode, held=None):
            return roofline41_ms(model.config, tokens, B, C, decode, ceil, fp8, kv, keep, held)
    else:
        model, kv = deepinfer_model(fp8, not name.endswith("-fp4")), ("fp8" if fp8 else "bfloat16")

        def roofline(tokens, B, C, decode, held=None):
            return roofline_ms(slice_config(), tokens, B, C, decode, ceil, fp8, held)
    # the experts as this engine holds them, where that differs from the shipped bytes the roofline counts
    # (FP8 codes after the repack: Hopper has no FP4 MMA): decode rows also record that roofline
    held = held_expert_bytes(model) if fp8 else None
    if held is not None and abs(held - FP4_EXPERT_BYTES) < 1e-9:
        held = None
    cfg = model.config
    use_graphs = DEVICE == "cuda" and not args.no_cuda_graphs
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    gc.collect()
    gc.freeze()
    rows = []
    for B, S in PREFILL:
        try:
            engine = deepinfer_engine(model, B, S + 8, kv, B * S, invariant, graphs=False)
            t = prefill_seconds(engine, [tokens(S) for _ in range(B)], args.reps)
            rows.append(_row(name, "prefill", B, S, 0, B * S / t, t, roofline(B * S, B, S, False)))
        except Exception as e:  # noqa: BLE001 (out of memory, a failing step: the other rows still run)
            rows.append(_failed_row(name, "prefill", B, S, 0, e))
        engine = None
    steps = DECODE_STEPS_PER_REP[arch] * args.reps
    for C in DECODE_CONTEXTS:
        for B in DECODE_BATCHES:
            roof = roofline(B, B, C, True)
            try:
                engine, reqs = decode_row_engine(model, B, C, kv, steps, invariant, use_graphs, tokens)
                diag: dict = {}
                t = decode_seconds(engine, steps, diag)
                note = "; ".join(filter(None, [_engine_note(engine), diag["graphs_captured"] and
                                               f"{diag['graphs_captured']} CUDA graph capture(s) in the timed steps"]))
                rows.append(_row(name, "decode", B, 1, C, B / t, t, roof, note or None, diag,
                                 None if held is None else roofline(B, B, C, True, held)))
            except Exception as e:  # noqa: BLE001
                rows.append(_failed_row(name, "decode", B, 1, C, e))
                engine = reqs = None
                continue
            if engine.runner.graphs is not None:
                try:
                    t = graph_replay_seconds(engine.runner.graphs, reqs, steps)
                    rows.append(_row(name, "decode-graph-replay", B, 1, C, B / t, t, roof))
                except Exception as e:  # noqa: BLE001
                    rows.append(_failed_row(name, "decode-graph-replay", B, 1, C, e))
            _sync()
            engine = reqs = None
    del model
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---- transformers ----

def transformers_config():
    """DeepseekV4ForCausalLM's config of the slice: its defaults are V4-Flash's widths; other presets
    (the smoke run's) go through the checkpoint writer's transformers config."""
    from transformers import DeepseekV4Config

    if BASE_PRESET != "flash":
        from deepinfer.tools.make_checkpoint import checkpoint_config

        return DeepseekV4Config(**checkpoint_config(slice_config(), "bfloat16", "hf"))
    types = ["sliding_attention", "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    return DeepseekV4Config(num_hidden_layers=4, layer_types=types, mlp_layer_types=["hash_moe"] * 3 + ["moe"])


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def transformers_rows(ceil: dict, args) -> list[dict]:
    from transformers import DeepseekV4ForCausalLM

    cfg = transformers_config()
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = DeepseekV4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    for m in model.modules():
        if hasattr(m, "tid2eid"):
            m.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, m.tid2eid.shape, device=DEVICE))
    gc.collect()
    gc.freeze()
    rows = []
    with torch.inference_mode():
        for B, S in PREFILL:
            ids = torch.randint(0, cfg.vocab_size, (B, S), device=DEVICE)
            try:
                t = timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), args.reps)
                rows.append(_row("transformers", "prefill", B, S, 0, B * S / t, t,
                                 roofline_ms(slice_config(), B * S, B, S, False, ceil, False)))
            except torch.OutOfMemoryError:
                rows.append(_row("transformers", "prefill", B, S, 0, None, None, None, "out of memory"))
            _empty_cache()
        for C in DECODE_CONTEXTS:
            for B in DECODE_BATCHES:
                if B * C > args.hf_max_prefill_tokens:
                    rows.append(_row("transformers", "decode", B, 1, C, None, None, None,
                                     f"skipped: building its cache needs a {B}x{C} prefill"))
                    continue
                ids = torch.randint(0, cfg.vocab_size, (B, C), device=DEVICE)
                gen = lambda n: model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n,  # noqa: E731
                                               do_sample=False)
                t1, t9 = timed(lambda: gen(1), 1), timed(lambda: gen(9), 1)
                t = (t9 - t1) / 8
                rows.append(_row("transformers", "decode", B, 1, C, B / t, t,
                                 roofline_ms(slice_config(), B, B, C, True, ceil, False)))
                _empty_cache()
    del model
    gc.collect()
    _empty_cache()
    return rows


def _row(engine, phase, batch, seq, context, tps, t, roof, note=None, diag=None, roof_held=None) -> dict:
    """One result row; `diag` (decode rows of deepinfer) = decode_seconds' account of the timed steps;
    `roof_held`: the roofline over the routed experts' bytes as the engine holds them (held_expert_bytes),
    given where that differs from the shipped bytes `roof` counts."""
    row = {"engine": engine, "phase": phase, "batch": batch, "seq": seq, "context": context,
           "tokens_per_s": None if tps is None else round(tps, 1),
           "step_ms": None if t is None else round(1e3 * t, 3),
           "roofline_ms": None if roof is None else round(roof, 3)}
    if roof_held is not None:
        row["roofline_held_ms"] = round(roof_held, 3)
    if note:
        row["note"] = note
    if diag:
        row["diag"] = diag
    print(json.dumps(row), flush=True)
    return row


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    pre = [r for r in result["rows"] if r["phase"] == "prefill" and r["tokens_per_s"]]
    labels = sorted({f"{r['batch']}x{r['seq']}" for r in pre})
    for i, eng in enumerate(sorted({r["engine"] for r in pre})):
        vals = [next((r["tokens_per_s"] for r in pre if r["engine"] == eng and f"{r['batch']}x{r['seq']}" == lab), 0)
                for lab in labels]
        n = len({r["engine"] for r in pre})
        axes[0].bar([j + 0.8 / n * i for j in range(len(labels))], vals, width=0.8 / n, label=eng)
    axes[0].set_xticks(range(len(labels)), labels)
    axes[0].set_title("prefill tokens/s (engine step)")
    axes[0].legend()
    for ax, ctx in zip(axes[1:], DECODE_CONTEXTS):
        for eng in sorted({r["engine"] for r in result["rows"]}):
            kinds = (("decode", "o-", eng), ("decode-graph-replay", "x:", f"{eng} graph replay only"))
            for phase, style, label in kinds:
                pts = [(r["batch"], r["step_ms"]) for r in result["rows"]
                       if r["engine"] == eng and r["phase"] == phase and r["context"] == ctx and r["step_ms"]]
                if pts:
                    ax.plot(*zip(*pts), style, label=label)
        for eng, style in (("deepinfer", "k--"), ("deepinfer-v41", "k-.")):
            roof = [(r["batch"], r["roofline_ms"]) for r in result["rows"]
                    if r["engine"] == eng and r["phase"] == "decode" and r["context"] == ctx and r["roofline_ms"]]
            if roof:
                ax.plot(*zip(*roof), style, label=f"roofline {'V4.1' if eng.endswith('v41') else 'V4'} slice (bf16)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"decode step ms (engine step), context {ctx}")
        ax.set_xlabel("batch")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _arch(eng: str) -> str:
    return "v41" if eng in V41_ENGINES else "v4"


def engine_rows(eng: str, ceil: dict, args) -> list[dict]:
    """Rows of one engine, timed with the Python heap frozen after setup (as a serving engine runs:
    vLLM and our LLM call gc.freeze() after start-up), so collector pauses of earlier allocations
    do not land in timed steps."""
    if eng == "transformers":
        return transformers_rows(ceil, args)
    if eng in V41_ENGINES:
        return deepinfer_rows(eng != "deepinfer-v41", False, ceil, args, eng, arch="v41")
    return deepinfer_rows(eng in ("deepinfer-fp8", "deepinfer-fp4"), eng == "deepinfer-invariant", ceil, args, eng)


def run_engine_process(eng: str, ceil: dict, args) -> tuple[list[dict], str | None]:
    """Each engine runs in a fresh process: no allocator, heap or compiled-kernel state carries
    from one engine's run into the next one's timings."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--engine-only", eng, "--rows-out", f.name, "--ceilings", json.dumps(ceil),
               "--reps", str(args.reps), "--hf-max-prefill-tokens", str(args.hf_max_prefill_tokens),
               "--v41-kv-cache-dtype", args.v41_kv_cache_dtype]
        cmd += ["--no-cuda-graphs"] * args.no_cuda_graphs + ["--smoke"] * args.smoke
        cmd += [x for k in ("prefill", "decode_batches", "decode_contexts") if getattr(args, k)
                for x in (f"--{k.replace('_', '-')}", getattr(args, k))]
        res = subprocess.run(cmd)
        got = json.loads(Path(f.name).read_text() or "[]")
    return got, None if res.returncode == 0 else f"engine process exited with {res.returncode} (traceback above)"


def use_smoke_settings() -> None:
    """Tiny widths on the CPU: every row kind runs once, so a GPU run will not fail on the script."""
    global DEVICE, BASE_PRESET, BASE_PRESET_V41, SLICE41_ARGS, PREFILL, DECODE_BATCHES, DECODE_CONTEXTS
    DEVICE, BASE_PRESET, PREFILL, DECODE_BATCHES, DECODE_CONTEXTS = "cpu", "tiny", [(1, 64)], [1, 2], [64]
    BASE_PRESET_V41, SLICE41_ARGS = "tiny41", {"engram_vocab_size": None}


def select_rows(args) -> None:
    """--prefill / --decode-batches / --decode-contexts replace the sweep's row lists (a shorter run of the
    rows an issue's targets name; the full sweep is the default)."""
    global PREFILL, DECODE_BATCHES, DECODE_CONTEXTS
    if args.prefill:
        PREFILL = [] if args.prefill == "-" else [tuple(int(v) for v in x.split("x")) for x in args.prefill.split(",")]
    if args.decode_batches:
        DECODE_BATCHES = [int(x) for x in args.decode_batches.split(",")]
    if args.decode_contexts:
        DECODE_CONTEXTS = [int(x) for x in args.decode_contexts.split(",")]


def results_path(args, device: str) -> Path:
    """--out, else benchmarks/results/<date>-<device>.json; a smoke run never writes into the tracked
    results directory (a fresh temporary directory instead)."""
    if args.out:
        return Path(args.out)
    name = f"{date.today()}-{device.replace(' ', '-')}.json"
    if args.smoke:
        import tempfile

        return Path(tempfile.mkdtemp(prefix="flash-slice-smoke-")) / name
    return new_results_path(Path(__file__).parent / "results" / name)


def print_table(rows: list[dict]) -> None:
    """One line a row; `x held` is the step over the roofline of the experts' held bytes (decode rows of an
    engine that holds them in another format than shipped: roofline_held_ms)."""
    print(f"{'engine':<21}{'phase':<21}{'B':>5}{'S':>6}{'ctx':>6}{'tok/s':>12}{'step ms':>10}{'roof ms':>10}"
          f"{'x roof':>8}{'x held':>8}")
    for r in rows:
        x = f"{r['step_ms'] / r['roofline_ms']:.1f}" if r["step_ms"] and r["roofline_ms"] else "-"
        xh = f"{r['step_ms'] / r['roofline_held_ms']:.2f}" if r["step_ms"] and r.get("roofline_held_ms") else "-"
        print(f"{r['engine']:<21}{r['phase']:<21}{r['batch']:>5}{r['seq']:>6}{r['context']:>6}"
              f"{str(r['tokens_per_s']):>12}{str(r['step_ms']):>10}{str(r['roofline_ms']):>10}{x:>8}{xh:>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-only", default=None, help=argparse.SUPPRESS)  # child process of run_engine_process
    ap.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ceilings", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engines", default="deepinfer,deepinfer-fp8,deepinfer-v41,deepinfer-v41-fp8,transformers")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hf-max-prefill-tokens", type=int, default=64 * 256)
    ap.add_argument("--v41-kv-cache-dtype", default="auto", choices=sorted(CACHE_BYTES_V41),
                    help="the V4.1 rows' cache (default auto: the reference formats)")
    ap.add_argument("--out", default=None)
    add_commit_arg(ap)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="time eager decode steps for deepinfer bf16")
    ap.add_argument("--smoke", action="store_true", help="tiny widths on the CPU: checks the script, times nothing")
    ap.add_argument("--prefill", default=None, help="a subset of rows: comma-separated BxS prefill shapes, e.g. 4x2048 "
                    "(none: '-')")
    ap.add_argument("--decode-batches", default=None, help="a subset of rows: comma-separated decode batches")
    ap.add_argument("--decode-contexts", default=None, help="a subset of rows: comma-separated decode contexts")
    args = ap.parse_args()
    refuse_existing_out(args)
    if args.smoke:
        use_smoke_settings()
    select_rows(args)
    if args.engine_only:
        rows = engine_rows(args.engine_only, json.loads(args.ceilings), args)
        Path(args.rows_out).write_text(json.dumps(rows))
        return
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"--engines: unknown engine {unknown[0]!r} (one of {', '.join(ENGINES)})")
    ceil = ceilings()
    print(json.dumps({"ceilings": ceil}), flush=True)
    rows, errors = [], {}
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu-smoke"
    out = results_path(args, gpu)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": gpu, "date": str(date.today()), "commit": recorded_commit(args), "ceilings": ceil,
              "timing": TIMING, "slices": {a: SLICES[a] for a in sorted({_arch(e) for e in engines})}, "rows": rows}
    if any(e in V41_ENGINES for e in engines):
        result["v41_kv_cache_dtype"] = args.v41_kv_cache_dtype
    for eng in engines:
        got, err = run_engine_process(eng, ceil, args)  # one engine failing must not lose the others' rows
        rows += got
        failed = sum(1 for r in got if r.get("note", "").startswith("failed"))
        err = "; ".join(([err] if err else []) + ([f"{failed} rows failed (their notes say why)"] if failed else []))
        if err:
            errors[eng] = err
            result["errors"] = errors
        out.write_text(json.dumps(result, indent=2) + "\n")  # after every engine: a cut-off run keeps its rows
    print_table(rows)
    wrote = [out]
    try:
        plot(result, out.with_suffix(".png"))
        wrote.append(out.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot")
    print("wrote " + " and ".join(str(p) for p in wrote))


if __name__ == "__main__":
    main()
