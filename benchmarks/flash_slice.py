"""The Flash slice sweep: V4-Flash's first four layers at full width (sliding, sliding, CSA, HCA;
hash, hash, hash, top-k MoE; 256 experts), random weights, on one GPU.

Engines: deepinfer bf16, deepinfer FP8/FP4 (weights kept as the hub ships them), deepinfer bf16 in
batch-invariant mode, transformers bf16 (DeepseekV4ForCausalLM). Rows: prefill (batch x length)
and decode steps (batch at a context), each with the roofline of that work on this GPU:
max(bytes moved / measured copy bandwidth, FLOPs / measured bf16 matmul rate), both ceilings
measured at the start of the run. deepinfer's rows time the engine's own step (EngineCore.step
over the Scheduler and ModelRunner, as LLM builds them); decode rows with CUDA graphs add a
"decode-graph-replay" row that times the graph replay alone. TIMING says exactly what each
phase's step_ms covers and is written into the results.
Decode state for deepinfer is filled synthetically (timing does not depend on cache values);
transformers builds its cache by prefilling, so its long-context rows are skipped.

    python benchmarks/flash_slice.py --engines deepinfer,deepinfer-fp8,transformers --out results.json
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

from common import add_commit_arg, recorded_commit

DEVICE = "cuda"
PREFILL = [(1, 2048), (4, 2048), (1, 8192)]
DECODE_BATCHES = [1, 4, 16, 64, 128]
DECODE_CONTEXTS = [256, 4096]
LAYER_RATIOS = [0, 0, 4, 128]
# deepinfer-invariant: bf16 in batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1), for its cost
ENGINES = ("deepinfer", "deepinfer-fp8", "deepinfer-invariant", "transformers")


BASE_PRESET = "flash"


def slice_config() -> dict:
    from deepinfer.tools.make_checkpoint import PRESETS

    return {**PRESETS[BASE_PRESET], "num_hidden_layers": 4, "compress_ratios": LAYER_RATIOS,
            "num_hash_layers": 3, "num_nextn_predict_layers": 0}


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


def roofline_ms(c: dict, tokens: int, batch: int, context: int, decode: bool, ceil: dict, fp8: bool) -> float:
    """`tokens` new tokens over `batch` requests at `context` (decode) or prompts of tokens/batch."""
    d, hd, h = c["hidden_size"], c["head_dim"], c["num_attention_heads"]
    expert = 3 * d * c["moe_intermediate_size"]
    wbytes, ebytes = (1, 0.5 + 1 / 64) if fp8 else (2, 2)   # FP8 dense / FP4 experts with E8M0 per 32
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


# ---- deepinfer: rows timed through the engine (EngineCore over Scheduler + ModelRunner) ----

BLOCK_SIZE = 64     # the engine's default cache block size
DECODE_WARMUP = 3   # engine steps before a decode row is timed (the first captures its CUDA graph)

# what each phase's step_ms is, written into the results next to the rows
TIMING = {
    "deepinfer:prefill":
        "one EngineCore.step() (async scheduling on, as LLM runs it) taking `batch` new prompts of `seq` "
        "tokens: Scheduler.schedule, ModelRunner.launch (input planning, forward, sampling of each prompt's "
        "first token), ModelRunner.collect (the host waits for the sampled tokens) and Scheduler.update; "
        "median of --reps steps after a warm-up. Prefill steps never overlap one another in the engine "
        "(Scheduler.schedule_ahead plans decode steps only; these prompts ask for one token).",
    "deepinfer:decode":
        "seconds per EngineCore.step() in steady pure decode of `batch` requests, async scheduling on: a "
        "step plans and launches the next one (placeholder inputs) before collecting its own sampled tokens, "
        "then updates the scheduler; greedy sampling; CUDA graphs where ModelRunner uses them (eager where "
        "the row's note says so). The timed steps compute positions `context` - 10 * reps .. `context` - 1. "
        "The requests' cache state comes from a prefill that is scheduled but not computed (the cache stays "
        "zero): step times do not depend on cache values.",
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


def _init_random(model) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for name, t in model.state_dict().items():
        if t.dtype in (torch.bfloat16, torch.float32):
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            elif "hc_" in name and name.endswith("_scale"):
                t.fill_(1.0)
            else:
                t.normal_(0, 0.02, generator=g)
        elif name.endswith("tid2eid"):
            t.copy_(torch.randint(0, model.config.n_routed_experts, t.shape, device=DEVICE, generator=g))
        elif t.dtype == torch.float8_e4m3fn:
            t.copy_((torch.randn(t.shape, device=DEVICE, generator=g) * 0.5).to(torch.float8_e4m3fn))
        elif t.dtype == torch.float8_e8m0fnu:
            t.view(torch.uint8).fill_(120)
        elif t.dtype in (torch.int8, torch.uint8):
            t.copy_(torch.randint(-128, 127, t.shape, device=DEVICE, generator=g).to(t.dtype))


def deepinfer_model(fp8: bool):
    from deepinfer.models import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config.from_dict(slice_config())
    with torch.device(DEVICE):
        model = DeepseekV4ForCausalLM(cfg, dtype=torch.bfloat16, quantized=fp8).eval()
    _init_random(model)
    return model


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


def deepinfer_engine(model, num_slots: int, max_len: int, kv_dtype: str, budget: int, invariant: bool,
                     graphs: bool):
    """An EngineCore wired as LLM wires one (async scheduling on) over `engine_cache`."""
    from deepinfer.engine.engine_core import EngineCore
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.worker.model_runner import ModelRunner

    kv, cache = engine_cache(model.config, num_slots, max_len, kv_dtype)
    runner = ModelRunner(model, cache, DEVICE, seed=0, cuda_graphs=graphs, batch_invariant=invariant)
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


def decode_seconds(engine, steps: int) -> float:
    """Seconds per engine step over `steps` steady decode steps (see TIMING): one step is in flight when the
    clock starts and one when it stops, so no pipeline fill or drain is counted."""
    for _ in range(DECODE_WARMUP):
        _check_finished(engine.step(), 0, None)
    t = time.perf_counter()
    for _ in range(steps):
        _check_finished(engine.step(), 0, None)
    return (time.perf_counter() - t) / steps


def graph_replay_seconds(graphs, reqs: list, steps: int) -> float:
    """Seconds per DecodeGraphs.run at the requests' next positions (see TIMING: not an engine step)."""
    from deepinfer.state.forward_batch import SeqChunk

    _sync()  # the engine's step in flight computes these very positions with the same tokens
    chunks = [SeqChunk(r.slot, r.num_computed_tokens, [r.output_token_ids[-1]], r.block_tables) for r in reqs]
    return pipelined(lambda: graphs.run(chunks), steps)


def deepinfer_rows(fp8: bool, invariant: bool, ceil: dict, args, name: str) -> list[dict]:
    model = deepinfer_model(fp8)
    cfg, kv = model.config, ("fp8" if fp8 else "bfloat16")
    use_graphs = DEVICE == "cuda" and not args.no_cuda_graphs
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    gc.collect()
    gc.freeze()
    rows = []
    for B, S in PREFILL:
        engine = deepinfer_engine(model, B, S + 8, kv, B * S, invariant, graphs=False)
        t = prefill_seconds(engine, [tokens(S) for _ in range(B)], args.reps)
        rows.append(_row(name, "prefill", B, S, 0, B * S / t, t,
                         roofline_ms(slice_config(), B * S, B, S, False, ceil, fp8)))
        del engine
    steps = 10 * args.reps
    for C in DECODE_CONTEXTS:
        prompt_len = C - DECODE_WARMUP - steps
        if prompt_len < 1:
            raise ValueError(f"context {C} is shorter than the {DECODE_WARMUP + steps} steps of a decode row")
        for B in DECODE_BATCHES:
            engine = deepinfer_engine(model, B, C + 8, kv, B * prompt_len, invariant, use_graphs)
            reqs = start_decoding(engine, [tokens(prompt_len) for _ in range(B)], DECODE_WARMUP + steps + 8)
            t = decode_seconds(engine, steps)
            roof = roofline_ms(slice_config(), B, B, C, True, ceil, fp8)
            note = None if use_graphs else "eager (no CUDA graphs)"
            rows.append(_row(name, "decode", B, 1, C, B / t, t, roof, note))
            if engine.runner.graphs is not None:
                t = graph_replay_seconds(engine.runner.graphs, reqs, steps)
                rows.append(_row(name, "decode-graph-replay", B, 1, C, B / t, t, roof))
            _sync()
            del engine, reqs
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


def _row(engine, phase, batch, seq, context, tps, t, roof, note=None) -> dict:
    row = {"engine": engine, "phase": phase, "batch": batch, "seq": seq, "context": context,
           "tokens_per_s": None if tps is None else round(tps, 1),
           "step_ms": None if t is None else round(1e3 * t, 3),
           "roofline_ms": None if roof is None else round(roof, 3)}
    if note:
        row["note"] = note
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
        roof = [(r["batch"], r["roofline_ms"]) for r in result["rows"]
                if r["engine"] == "deepinfer" and r["phase"] == "decode" and r["context"] == ctx]
        if roof:
            ax.plot(*zip(*roof), "k--", label="roofline (bf16)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"decode step ms (engine step), context {ctx}")
        ax.set_xlabel("batch")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def engine_rows(eng: str, ceil: dict, args) -> list[dict]:
    """Rows of one engine, timed with the Python heap frozen after setup (as a serving engine runs:
    vLLM and our LLM call gc.freeze() after start-up), so collector pauses of earlier allocations
    do not land in timed steps."""
    if eng == "transformers":
        return transformers_rows(ceil, args)
    return deepinfer_rows(eng == "deepinfer-fp8", eng == "deepinfer-invariant", ceil, args, eng)


def run_engine_process(eng: str, ceil: dict, args) -> tuple[list[dict], str | None]:
    """Each engine runs in a fresh process: no allocator, heap or compiled-kernel state carries
    from one engine's run into the next one's timings."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--engine-only", eng, "--rows-out", f.name, "--ceilings", json.dumps(ceil),
               "--reps", str(args.reps), "--hf-max-prefill-tokens", str(args.hf_max_prefill_tokens)]
        cmd += ["--no-cuda-graphs"] * args.no_cuda_graphs + ["--smoke"] * args.smoke
        res = subprocess.run(cmd)
        got = json.loads(Path(f.name).read_text() or "[]")
    return got, None if res.returncode == 0 else f"engine process exited with {res.returncode} (traceback above)"


def use_smoke_settings() -> None:
    """Tiny widths on the CPU: every row kind runs once, so a GPU run will not fail on the script."""
    global DEVICE, BASE_PRESET, PREFILL, DECODE_BATCHES, DECODE_CONTEXTS
    DEVICE, BASE_PRESET, PREFILL, DECODE_BATCHES, DECODE_CONTEXTS = "cpu", "tiny", [(1, 64)], [1, 2], [64]


def results_path(args, device: str) -> Path:
    """--out, else benchmarks/results/<date>-<device>.json; a smoke run never writes into the tracked
    results directory (a fresh temporary directory instead)."""
    if args.out:
        return Path(args.out)
    name = f"{date.today()}-{device.replace(' ', '-')}.json"
    if args.smoke:
        import tempfile

        return Path(tempfile.mkdtemp(prefix="flash-slice-smoke-")) / name
    return Path(__file__).parent / "results" / name


def print_table(rows: list[dict]) -> None:
    print(f"{'engine':<21}{'phase':<21}{'B':>5}{'S':>6}{'ctx':>6}{'tok/s':>12}{'step ms':>10}{'roof ms':>10}"
          f"{'x roof':>8}")
    for r in rows:
        x = f"{r['step_ms'] / r['roofline_ms']:.1f}" if r["step_ms"] and r["roofline_ms"] else "-"
        print(f"{r['engine']:<21}{r['phase']:<21}{r['batch']:>5}{r['seq']:>6}{r['context']:>6}"
              f"{str(r['tokens_per_s']):>12}{str(r['step_ms']):>10}{str(r['roofline_ms']):>10}{x:>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-only", default=None, help=argparse.SUPPRESS)  # child process of run_engine_process
    ap.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ceilings", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engines", default="deepinfer,deepinfer-fp8,transformers")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hf-max-prefill-tokens", type=int, default=64 * 256)
    ap.add_argument("--out", default=None)
    add_commit_arg(ap)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="time eager decode steps for deepinfer bf16")
    ap.add_argument("--smoke", action="store_true", help="tiny widths on the CPU: checks the script, times nothing")
    args = ap.parse_args()
    if args.smoke:
        use_smoke_settings()
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
              "timing": TIMING, "rows": rows}
    for eng in engines:
        got, err = run_engine_process(eng, ceil, args)  # one engine failing must not lose the others' rows
        rows += got
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
