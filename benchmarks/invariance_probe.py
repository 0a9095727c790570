"""Where does a request's computation first depend on its batch? Runs one target prompt through the
model (batch-invariant mode) alone, amid neighbours, and chunked, records every module's output rows
for the target's tokens, and prints the first module (in call order) whose rows differ in bits.

    python benchmarks/invariance_probe.py --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import torch

from deepinfer.layers import invariant
from deepinfer.state.forward_batch import SeqChunk, build_forward_batch
from deepinfer.loader.model_loader import load_model
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.tools.static_cache import static_v4_cache


def record(model, cache, steps, target_slot: int, on: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Run `steps` (lists of SeqChunk) in order; (module name, output rows of the target's tokens) in call order."""
    seen: list[tuple[str, torch.Tensor]] = []
    rows: list = []  # [target's token rows, tokens in the step]
    handles = []
    for name, mod in model.named_modules():
        def hook(m, inp, out, name=name):
            o = out[0] if isinstance(out, tuple) else out
            if isinstance(o, torch.Tensor) and o.dim() and o.shape[0] == rows[1]:  # one row per token of the step
                seen.append((name, o[rows[0]].detach().clone().cpu()))
        handles.append(mod.register_forward_hook(hook))
    cfg = model.config
    try:
        for chunks in steps:
            lens = [len(c.token_ids) for c in chunks]
            slots = [c.slot for c in chunks]
            dev = model.embed.weight.device
            if target_slot in slots:
                i = slots.index(target_slot)
                rows[:] = [torch.arange(sum(lens[:i]), sum(lens[:i + 1]), device=dev), sum(lens)]
            else:  # a step without the target: run it, record nothing
                rows[:] = [None, -1]
            b = build_forward_batch(chunks, cfg.sliding_window, cache.compress_kinds, cache.block_size, dev)
            with torch.inference_mode(), invariant.mode(on):
                model.compute_logits(model(b, cache.layers)[b.logits_idx])
            if target_slot in slots:
                seen.append(("--step--", torch.zeros(0)))
    finally:
        for h in handles:
            h.remove()
    return seen


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, max(0, width - t.shape[1])), value=-1)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    if all(t.dim() == 2 for t in ts):
        w = max(t.shape[1] for t in ts)
        ts = [_pad(t, w) for t in ts]
    return torch.cat(ts)


def _join(seen: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A run whose prompt took several steps, as one prefill: each module's rows concatenated over
    the prompt's steps (in call order per step), then the final (decode) step as recorded."""
    per_step, cur = [], []
    for name, t in seen:
        if name == "--step--":
            per_step.append(cur)
            cur = []
        else:
            cur.append((name, t))
    prefill = per_step[:-1]
    joined = [(name, _cat([s[k][1] for s in prefill])) for k, (name, _) in enumerate(prefill[0])
              if all(len(s) > k and s[k][0] == name for s in prefill)]
    return joined + [("--step--", torch.zeros(0))] + per_step[-1] + [("--step--", torch.zeros(0))]


def engine_probe(args) -> None:
    """The engine's own schedules (async, chunked, mixed prefill/decode; eager so hooks see every
    step): every module's output row of every target token, keyed by the token's position, solo vs
    each mix; prints the first (position, module) that differs."""
    from deepinfer import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", PRESETS[args.preset], seed=args.seed, dtype="fp8")
        cfg = PRESETS[args.preset]
        vocab = cfg.get("text_config", cfg)["vocab_size"]

        def prompts(lens, seed):
            g = torch.Generator().manual_seed(seed)
            return [[0] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lens]

        target = prompts([61], 1)[0]
        short, long = prompts([5, 9, 7], 2), prompts([90, 75, 83], 3)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
        runs = {}
        mixes = [("solo", 8192, []), ("short neighbours", 8192, short), ("long neighbours", 64, long),
                 ("chunked prompt", 8, []), ("chunked, mixed", 12, short[:1] + long[:1])]
        if args.graphs:
            return graph_outputs(args, ckpt, target, mixes, params)
        if args.spec:
            return spec_probe(args, ckpt, prompts([args.prompt_len], 1)[0])
        for name, budget, batch in mixes:
            llm = LLM(str(ckpt), device=args.device, dtype=args.dtype, kv_cache_dtype=args.dtype,
                      kv_cache_memory=64 << 20, batch_invariant=not args.off, enforce_eager=True,
                      max_num_batched_tokens=budget, skip_tokenizer_init=True)
            tid = str(min(1, len(batch)))  # a fresh LLM numbers its requests 0, 1, ... in prompt order
            runs[name] = _engine_rows(llm, tid, batch[:1] + [target] + batch[1:], params)
            del llm
    solo = runs.pop("solo")
    for name, got in runs.items():
        diff = next(((pos, m) for pos in sorted(solo) for (m, a), (m2, b) in zip(solo[pos], got.get(pos, []))
                     if m != m2 or not torch.equal(a, b)), None)
        missing = sorted(set(solo) ^ set(got))
        print(f"{name}: " + (f"first difference at position {diff[0]}, module {diff[1]}" if diff else
                             "every module's row of every target token bit-identical")
              + (f" (positions recorded in one run only: {missing[:5]})" if missing else ""))


def spec_probe(args, ckpt, target: list[int]) -> None:
    """Speculation off vs DSpark with k drafts (the checkpoint's own stages), batch-invariant eager
    steps: each position's module rows as finally kept (a verify chunk's accepted rows; a rejected
    draft's rows are replaced by the next step's), off's decode rows against the verify rows; prints
    the first (position, module) that differs, and per differing position its first module."""
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=5)
    runs, outs = {}, {}
    for name, spec in (("off", None), (f"dspark k={args.spec}", {"method": "dspark", "num_speculative_tokens": args.spec})):
        llm = LLM(str(ckpt), device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  kv_cache_memory=256 << 20, batch_invariant=True, enforce_eager=True,
                  skip_tokenizer_init=True, speculative_config=spec)
        runs[name] = _engine_rows(llm, "0", [target], params, outs.setdefault(name, []))
        del llm
    (off_name, off), (name, got) = runs.items()
    a, b = outs[off_name][0].token_ids, outs[name][0].token_ids
    first_tok = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"{name} vs off ({args.kv_cache_dtype} cache): output tokens " +
          ("identical" if first_tok is None else f"differ from output {first_tok}"))
    bad = []
    for pos in sorted(off):
        mods = got.get(pos)
        if mods is None:
            continue
        # a module whose output has one row per token only at some step sizes (e.g. the indexer's key
        # projection over closing entries) is recorded in one run only: match rows by (module, n-th call)
        theirs: dict[str, list] = collections.defaultdict(list)
        for m, y in mods:
            theirs[m].append(y)
        seen: collections.Counter = collections.Counter()
        for m, x in off[pos]:
            k, seen[m] = seen[m], seen[m] + 1
            y = theirs[m][k] if k < len(theirs[m]) else None
            if y is not None and y.shape == x.shape and not torch.equal(x, y):
                bad.append((pos, m, (x.float() - y.float()).abs().max().item()))
                break
    print(f"positions with a differing module row: {len(bad)} of {len(off)}")
    for pos, m, diff in bad[:args.rows]:
        print(f"  position {pos}: first module {m}, max |diff| {diff}")


def graph_outputs(args, ckpt, target, mixes, params) -> None:
    """The target's output (token ids, top logprobs) per mix with CUDA graphs vs eager: prints, per
    mix and mode, the first output index differing from the eager solo run, and how many of the
    engine's steps ran as graph replays."""
    from deepinfer import LLM

    ref = None
    for eager in (True, False):
        for name, budget, batch in mixes:
            llm = LLM(str(ckpt), device=args.device, dtype=args.dtype, kv_cache_dtype=args.dtype,
                      kv_cache_memory=64 << 20, batch_invariant=not args.off, enforce_eager=eager,
                      max_num_batched_tokens=budget, skip_tokenizer_init=True)
            graphs = llm.engine.core.runner.graphs
            replays = [0]
            if graphs is not None:
                run = graphs.run

                def counted(*a, run=run, **k):
                    replays[0] += 1
                    return run(*a, **k)
                graphs.run = counted
            out = llm.generate(batch[:1] + [target] + batch[1:], params, use_tqdm=False)[min(1, len(batch))].outputs[0]
            got = list(zip(out.token_ids, out.logprobs))
            ref = got if ref is None else ref
            first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            print(f"{'eager' if eager else 'graphs'} {name}: " + ("identical to eager solo" if first is None else
                  f"output {first} differs from eager solo: {got[first]} vs {ref[first]}") + f"; graph replays {replays[0]}")
            del llm


def _engine_rows(llm, tid: str, prompts, params, outputs: list | None = None) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """position -> [(module, output row)] of request `tid`'s tokens, over the whole generate call; a
    position computed again (a rejected draft's, a preempted request's) keeps its last step's rows.
    The speculative drafter's own modules (mtp.*) are not recorded."""
    rows: dict[int, list] = {}
    cur: list = []  # [(token row in the step, position)], tokens in the step
    handles = []
    for name, mod in llm.model.named_modules():
        if "compressor" in name or name.startswith("mtp"):  # one row per closed entry; drafter stages
            continue

        def hook(m, inp, out, name=name):
            o = out[0] if isinstance(out, tuple) else out
            if cur and isinstance(o, torch.Tensor) and o.dim() and o.shape[0] == cur[1]:
                for r, pos in cur[0]:
                    row = o[r].detach().cpu()
                    if not row.is_floating_point():  # selected-entry ids: the width varies, -1 pads
                        row = row[row >= 0]
                    rows.setdefault(pos, []).append((name, row))
        handles.append(mod.register_forward_hook(hook))
    runner = llm.engine.core.runner
    launch = runner.launch

    def traced(so, prev=None):
        off, mine = 0, []
        for c in so.chunks:
            if c.request_id == tid:
                mine += [(off + j, c.start + j) for j in range(len(c.token_ids))]
            off += len(c.token_ids)
        cur[:] = [mine, off] if mine else []
        for _, pos in mine:
            rows[pos] = []
        return launch(so, prev)

    runner.launch = traced
    try:
        out = llm.generate(prompts, params, use_tqdm=False)
        if outputs is not None:
            outputs += [o.outputs[0] for o in out]
    finally:
        runner.launch = launch
        for h in handles:
            h.remove()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--off", action="store_true", help="without batch-invariant mode (shows what it fixes)")
    ap.add_argument("--chunk", type=int, default=8, help="prompt chunk size of the chunked run")
    ap.add_argument("--engine", action="store_true",
                    help="drive the engine (eager steps) through the batch mixes of tests/engine/test_batch_invariance.py")
    ap.add_argument("--graphs", action="store_true",
                    help="with --engine: compare the target's outputs with CUDA graphs vs eager, per mix")
    ap.add_argument("--spec", type=int, default=0,
                    help="with --engine: speculation off vs DSpark with this many drafts (a V4.1 preset), per position")
    ap.add_argument("--kv-cache-dtype", default="auto", help="--spec: the cache format")
    ap.add_argument("--prompt-len", type=int, default=128, help="--spec: prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=40, help="--spec: output tokens")
    ap.add_argument("--rows", type=int, default=20, help="--spec: differing positions to print")
    ap.add_argument("--seed", type=int, default=3, help="checkpoint seed (the demo is demo41, seed 0)")
    args = ap.parse_args()
    if args.engine:
        return engine_probe(args)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", PRESETS[args.preset], seed=3, dtype="fp8")
        model, _ = load_model(str(ckpt), dtype=getattr(torch, args.dtype), device=args.device)
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    target = [0] + torch.randint(3, cfg.vocab_size, (60,), generator=g).tolist()
    short = [[0] + torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (4, 8)]

    def fresh():
        return static_v4_cache(cfg, 3, 128, args.dtype, args.device, block_size=16, scratch=True)

    def chunk(cache, slot, start, ids):
        return SeqChunk(slot, start, ids, cache.static_tables(slot))

    n, nxt = len(target), [5]  # then one decode step (eager) with the same next token everywhere
    c = fresh()
    solo = record(model, c, [[chunk(c, 0, 0, target)], [chunk(c, 0, n, nxt)]], 0, not args.off)
    c = fresh()
    mixed = record(model, c, [[chunk(c, 1, 0, short[0]), chunk(c, 0, 0, target), chunk(c, 2, 0, short[1])],
                              [chunk(c, 1, len(short[0]), nxt), chunk(c, 0, n, nxt), chunk(c, 2, len(short[1]), nxt)]], 0, not args.off)
    c = fresh()
    k = args.chunk
    steps = [[chunk(c, 0, s, target[s:s + k])] for s in range(0, n, k)] + [[chunk(c, 0, n, nxt)]]
    chunked = _join(record(model, c, steps, 0, not args.off))
    # the engine's "long neighbours" mix with a 64-token budget: the target's prompt in two pieces
    # next to other requests' continuation chunks, its first decode beside another prefill chunk
    c = fresh()
    long = [[0] + torch.randint(3, cfg.vocab_size, (m,), generator=g).tolist() for m in (89, 40)]
    steps = [[chunk(c, 1, 0, long[0][:64])], [chunk(c, 1, 64, long[0][64:]), chunk(c, 0, 0, target[:38])],
             [chunk(c, 0, 38, target[38:]), chunk(c, 2, 0, long[1][:41])],
             [chunk(c, 1, len(long[0]), nxt), chunk(c, 0, n, nxt)]]
    interleaved = _join(record(model, c, steps, 0, not args.off))
    for label, other in (("with neighbours", mixed), (f"chunked by {k}", chunked),
                         ("interleaved with long neighbours", interleaved)):
        phase = "prefill"
        for (n1, a), (n2, b) in zip(solo, other):
            if n1 == "--step--":
                phase = "decode"
                continue
            if a.dim() == 2 and b.dim() == 2 and a.shape[1] != b.shape[1]:  # selected-entry ids: pad with -1
                a, b = _pad(a, b.shape[1]), _pad(b, a.shape[1])
            if n1 != n2 or a.shape != b.shape:
                print(f"{label}: call order differs at {n1} / {n2} ({tuple(a.shape)} vs {tuple(b.shape)})")
                break
            if not torch.equal(a, b):
                print(f"{label}: first difference in {n1} ({phase}): max |diff| {(a.float() - b.float()).abs().max().item():.3g}")
                break
        else:
            print(f"{label}: every module's rows bit-identical")
    if args.device.startswith("cuda") and args.dtype == "bfloat16":  # the engine graphs bf16 models only
        graph_check(model, cfg, fresh, chunk, target, short, nxt, not args.off)


def graph_check(model, cfg, fresh, chunk, target, short, nxt, on: bool, steps: int = 6,
                modes: tuple[bool, ...] = (False, True)) -> None:
    """Decode steps through DecodeGraphs (padded batch buckets, fixed shapes: every token gets a
    compressor row) vs eager steps, alone vs amid two neighbours: the target's logits at each of
    `steps` positions (some of which close compressed entries), against alone + eager."""
    from deepinfer.worker.cuda_graph import DecodeGraphs

    logits = {}
    for label, prompts in (("alone", [target]), ("with neighbours", [short[0], target, short[1]])):
        for graphs in modes:
            c = fresh()
            dev = model.embed.weight.device
            slots = list(range(len(prompts)))
            i = prompts.index(target)
            runner = DecodeGraphs(model, c, c.scratch_slot, c.scratch_addr) if graphs else None
            outs = []
            with torch.inference_mode(), invariant.mode(on):
                b = build_forward_batch([chunk(c, s, 0, p) for s, p in zip(slots, prompts)], cfg.sliding_window,
                                        c.compress_kinds, c.block_size, dev)
                model(b, c.layers)
                for k in range(steps):
                    dec = [chunk(c, s, len(p) + k, [nxt[0] + k]) for s, p in zip(slots, prompts)]
                    if graphs:
                        outs.append(runner.run(dec)[i].float().cpu())
                    else:
                        b = build_forward_batch(dec, cfg.sliding_window, c.compress_kinds, c.block_size, dev)
                        outs.append(model.compute_logits(model(b, c.layers)[b.logits_idx])[i].float().cpu())
            logits[(label, graphs)] = outs
    ref = logits[("alone", False)]
    n = len(target)
    for key, outs in logits.items():
        bad = [(n + k, (o - r).abs().max().item()) for k, (o, r) in enumerate(zip(outs, ref)) if not torch.equal(o, r)]
        print(f"decode logits {key[0]}, {'graph' if key[1] else 'eager'}, positions {n}..{n + steps - 1}: "
              + ("bit-identical" if not bad else f"differ at {bad}") + " vs alone, eager")


if __name__ == "__main__":
    main()
