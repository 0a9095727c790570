"""Engine host time per step: `EngineCore.step` as `LLM` wires it (scheduling, planning, graph-input
packing, sampling, collect) at 1 / 16 / 64 / 256 requests, pure decode and mixed (decodes plus one
prefill chunk a step), V4 and V4.1.

--model noop (default): the model's forward and logits are replaced by a no-op of the same interface
(zeros; the decode-graph replay likewise), on tiny widths with a 1024-token vocabulary, so the wall
time per step is the engine's host work (plus sampling over 1024 columns). --model real on CUDA: the
real engine step of the same tiny model (graphs and async scheduling on), for the GPU side of the
comparison. Each row also records cProfile's top functions by own time (a separate, profiled pass).

    PYTHONPATH=. python benchmarks/engine_overhead.py [--archs v4,v41] [--requests 1,16,64,256]
        [--phases decode,mixed] [--steps 50] [--model noop|real] [--device cpu|cuda] [--out F.json]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import tempfile
import time
from pathlib import Path

import torch

from common import add_commit_arg, recorded_commit, refuse_existing_out
from deepinfer import LLM, SamplingParams
from deepinfer.engine.request import Request
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.worker.cuda_graph import DecodeGraphs

PRESET = {"v4": "tiny", "v41": "tiny41"}
PROMPT_LEN, MIXED_PROMPT_LEN = 32, 256


class NoOpModel:
    """The runner's model with forward and logits replaced by zeros; every other attribute is the model's."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, batch, layers, draft_features=False, **_):
        streams = torch.zeros(batch.input_ids.shape[0], 1, device=batch.input_ids.device)
        return (streams, streams) if draft_features else streams

    def compute_logits(self, states):
        return torch.zeros(states.shape[0], self._model.config.vocab_size, device=states.device)


class NoOpGraphs(DecodeGraphs):
    """DecodeGraphs' host side (planning, inputs packed into the staging buffer and copied to the graph's
    input buffer) with no capture and no replay: the logits are zeros."""

    def _capture(self, host_batch, inputs):
        return None, inputs, torch.zeros(host_batch.input_ids.shape[0], self.model.config.vocab_size,
                                         device=self.device)

    def _launch_graph(self, entry) -> None:
        pass


def _engine(arch: str, root: Path, device: str, model: str, max_seqs: int) -> LLM:
    ckpt = write_checkpoint(root / arch, PRESETS[PRESET[arch]], seed=0, dtype="fp8")
    llm = LLM(str(ckpt), device=device, dtype="float32" if device == "cpu" else "bfloat16",
              kv_cache_memory=512 << 20, max_num_seqs=max_seqs, max_model_len=2048)
    if model == "noop":
        r = llm.engine.core.runner
        r.model = NoOpModel(r.model)
        if device == "cpu" or r.graphs is not None:
            r.graphs = NoOpGraphs(r.model, r.cache, r.cache.scratch_slot, r.cache.scratch_addr, device=device)
    return llm


def _requests(tag: str, n: int, prompt_len: int, out_len: int) -> list[Request]:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    return [Request(f"{tag}-{i}", [5 + (7 * i + j) % 900 for j in range(prompt_len)], params) for i in range(n)]


def _timed(llm: LLM, arch: str, phase: str, B: int, steps: int, profile: bool) -> tuple[float, float, str]:
    """(wall ms, this process's CPU ms) per engine step over `steps` steady steps (B decoding requests;
    mixed: plus a new prompt per step). On a shared machine the CPU time is the steadier figure."""
    eng = llm.engine
    tag = f"{arch}-{phase}-{B}-{int(profile)}"
    reqs = _requests(tag, B, PROMPT_LEN, 3 * steps + 64)
    for q in reqs:
        eng.add_request(q)
    while any(q.num_computed_tokens < len(q.prompt_token_ids) for q in reqs):
        eng.step()
    for _ in range(4):
        eng.step()
    extra = _requests(tag + "-new", steps, MIXED_PROMPT_LEN, 1) if phase == "mixed" else []
    prof = cProfile.Profile() if profile else None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t, cpu = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    for i in range(steps):
        if extra:
            eng.add_request(extra[i])
        eng.step()
    if prof:
        prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ms, cpu_ms = 1e3 * (time.perf_counter() - t) / steps, 1e3 * (time.process_time() - cpu) / steps
    eng.abort([q.request_id for q in reqs + extra], "measured")
    while eng.has_unfinished():
        eng.step()
    text = ""
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        text = s.getvalue()
    return ms, cpu_ms, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="v4,v41")
    ap.add_argument("--requests", default="1,16,64,256")
    ap.add_argument("--phases", default="decode,mixed")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--model", choices=("noop", "real"), default="noop")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: host work is single-threaded)")
    ap.add_argument("--out", default=None, help="JSON results")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.requests.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            llm = _engine(arch, Path(tmp), args.device, args.model, max(sizes) + 1)
            for phase in args.phases.split(","):
                for B in sizes:
                    _timed(llm, arch, phase, B, 5, False)  # warm-up (graph capture, first shapes)
                    ms, cpu_ms, _ = _timed(llm, arch, phase, B, args.steps, False)
                    _, _, prof = _timed(llm, arch, phase, B, args.steps, True)
                    wall = "host_ms_per_step" if args.model == "noop" else "ms_per_step"
                    rows.append({"arch": arch, "phase": phase, "requests": B, "model": args.model,
                                 wall: round(ms, 4), "process_cpu_ms_per_step": round(cpu_ms, 4),
                                 "steps": args.steps, "profile_top": prof})
                    print(f"{arch} {phase} {B:4d} requests: {ms:.3f} ms per engine step, {cpu_ms:.3f} ms CPU "
                          f"({args.model})", flush=True)
            llm.close()
    result = {"benchmark": "engine_overhead", "commit": recorded_commit(args), "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or
              platform.machine(), "torch_threads": args.threads, "prompt_len": PROMPT_LEN,
              "mixed_prompt_len": MIXED_PROMPT_LEN, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
