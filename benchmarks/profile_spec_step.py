"""Where a speculative decode step's time goes: the trained demo (V4.1, DSpark stages) with
speculative_config {"method": "dspark", "num_speculative_tokens": k} against speculation off, at one
concurrency, after warm-up:
  1. ms per engine step (LLM.generate wall / steps) and tokens per step, speculation off and on;
  2. cProfile of the host over the timed generate (cumulative and own seconds per function, top --rows);
     run under CUDA_LAUNCH_BLOCKING=1, each function also carries the GPU time of what it launches;
  3. a torch.profiler trace of it: GPU busy and device events per step, the top kernels.

    cd benchmarks && PYTHONPATH=.. python profile_spec_step.py --concurrency 1 --k 5
    cd benchmarks && PYTHONPATH=.. python profile_spec_step.py --smoke     # tiny41 on the CPU
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

from common import add_commit_arg, recorded_commit
from spec_decode import graphs_captured, make_prompts


STEPS = [0]  # ModelRunner.launch calls in this process


def count_steps() -> None:
    from deepinfer.worker.model_runner import ModelRunner

    real = ModelRunner.launch

    def launch(self, so, prev=None):
        STEPS[0] += 1
        return real(self, so, prev)

    ModelRunner.launch = launch


# (module, qualified name) of the host phases timed by --timeline (inclusive wall time: nested ones overlap)
PHASES = [("deepinfer.engine.scheduler", "Scheduler.schedule"), ("deepinfer.engine.scheduler", "Scheduler.update"),
          ("deepinfer.worker.model_runner", "ModelRunner.launch"),
          ("deepinfer.worker.model_runner", "ModelRunner.collect"), ("deepinfer.worker.model_runner", "ModelRunner._verify_ahead"),
          ("deepinfer.worker.cuda_graph", "DecodeGraphs.run"), ("deepinfer.worker.cuda_graph", "DecodeGraphs._plan"),
          ("deepinfer.worker.cuda_graph", "DecodeGraphs.run_planned"),
          ("deepinfer.worker.cuda_graph", "DecodeGraphs._launch_graph"), ("deepinfer.worker.model_runner", "verify"),
          ("deepinfer.worker.drafter", "DSparkDrafter.propose"), ("deepinfer.worker.draft_graphs", "DraftGraphs.run"),
          ("deepinfer.worker.model_runner", "_copy_to_host"), ("deepinfer.engine.engine_core", "EngineCore.step")]
TIMES: dict[str, list[float]] = {}


def time_phases() -> None:
    """Wraps PHASES with wall-clock accumulators (TIMES[name] = [seconds, calls])."""
    import importlib

    for mod_name, qual in PHASES:
        mod = importlib.import_module(mod_name)
        owner, attr = (getattr(mod, qual.split(".")[0]), qual.split(".")[1]) if "." in qual else (mod, qual)
        real = getattr(owner, attr)
        acc = TIMES.setdefault(qual, [0.0, 0])

        def timed_call(*a, _real=real, _acc=acc, **kw):
            t0 = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                _acc[0] += time.perf_counter() - t0
                _acc[1] += 1

        setattr(owner, attr, timed_call)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(args, spec: bool):
    from deepinfer import LLM
    from deepinfer.tools.demo import resolve_demo

    os.environ["DEEPINFER_USE_NEXTN_DECODE"] = "0"  # speculation only where asked
    path = resolve_demo(args.model) or args.model
    if args.smoke:
        from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
        import tempfile
        path = tempfile.mkdtemp()
        write_checkpoint(path, PRESETS["tiny41"], seed=0)
    cfg = {"method": "dspark", "num_speculative_tokens": args.k} if spec else None
    kw = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(args.concurrency, 1),
              max_model_len=args.input_len + args.output_len, skip_tokenizer_init=True,
              enforce_eager=args.enforce_eager)
    if args.smoke:
        kw.update(kv_cache_memory=64 << 20, kv_cache_dtype="float32")
    return LLM(path, speculative_config=cfg, **kw)


def timed(llm, prompts, params, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    return time.perf_counter() - t0


def replay_times(llm, reps: int = 20) -> None:
    """Each CUDA graph the runner holds, replayed alone `reps` times after the timed runs: median ms (a verify
    graph against the decode graph of its batch shows what the q-token forward itself costs on the device).
    Replays rewrite the cache rows of the inputs they last held: idempotent, and after every timed run."""
    runner = llm.engine.core.runner
    rows = []
    if runner.graphs is not None:
        for key, (graph, inputs, logits) in runner.graphs.graphs.items():
            kind, key = ("planned on the device", key[1:]) if key[0] == "planned" else ("", key)
            padded, visible = key[0], key[2] if kind else key[1]
            rows.append((f"step {kind} padded={padded} q={logits.shape[0] // padded} visible={dict(visible)}", graph))
    drafter = getattr(runner.drafter, "graphs", None)
    if drafter is not None:
        rows += [(f"draft padded={n}", entry[0]) for n, entry in drafter.graphs.items()]
    for name, graph in rows:
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        print(f"   replay {name}: {sorted(times)[reps // 2]:.3f} ms", flush=True)


def report(llm, args, label: str) -> None:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    vocab = llm.model.config.vocab_size
    prompts = make_prompts(args.concurrency, args.input_len, vocab, seed=1)
    warm = make_prompts(args.concurrency, args.input_len, vocab, seed=2)
    llm.generate(warm, params, use_tqdm=False)
    before = llm.get_metrics()
    steps0, graphs0 = STEPS[0], graphs_captured(llm)
    for acc in TIMES.values():
        acc[:] = [0.0, 0]
    t = timed(llm, prompts, params, args.device)
    graphs = graphs_captured(llm) - graphs0
    after = llm.get_metrics()
    tokens = args.concurrency * args.output_len
    drafts = after["num_drafts"] - before["num_drafts"]
    acc = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    steps = STEPS[0] - steps0
    print(f"== {label}: C={args.concurrency} {tokens} tokens in {t * 1e3:.1f} ms = {tokens / t:.1f} tok/s; "
          f"drafts {drafts}, accepted {acc}, steps {steps}, graphs captured in the timed run {graphs}", flush=True)
    print(f"   speculative steps left eager since start-up, by reason: {dict(llm.engine.core.runner.eager_steps)}")
    if steps:
        print(f"   {t * 1e3 / steps:.3f} ms per engine step", flush=True)
        for name, (sec, calls) in TIMES.items():
            if calls:
                print(f"   host {name}: {sec * 1e3 / steps:.3f} ms per step ({calls} calls)", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    timed(llm, prompts, params, args.device)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.rows)
    print(s.getvalue(), flush=True)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.rows)
    print(s.getvalue(), flush=True)
    if not args.device.startswith("cuda"):
        return
    replay_times(llm)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        timed(llm, prompts, params, args.device)
    events = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in events) / 1e3
    n = steps or 1
    print(f"   profiler: GPU busy {busy / n:.3f} ms per step, {len(events) / n:.0f} device events per step", flush=True)
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70),
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--only", choices=("off", "spec", "both"), default="both")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="time the host phases (PHASES) of the first timed run")
    add_commit_arg(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.output_len, args.rows = "cpu", "float32", 8, 10
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"commit {recorded_commit(args)}, device {device}", flush=True)
    count_steps()
    if args.timeline:
        time_phases()
    for spec in ([False] if args.only == "off" else [True] if args.only == "spec" else [False, True]):
        llm = build(args, spec)
        report(llm, args, f"dspark k={args.k}" if spec else "off")
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
