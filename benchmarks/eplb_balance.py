"""EPLB balance on synthetic skewed routing (CPU, no model): the busiest GPU's expert load with
deepinfer.distributed.eplb's placement against the naive one (experts in contiguous runs on the
GPUs, no replicas), for V4-Flash (256 experts) and V4.1-Flash (384 experts) expert counts.

Routing is sampled: each of `--tokens` tokens picks top-k distinct experts from a Zipf(s)
distribution over the experts (a fresh random rank order per layer), and the per-expert counts are
the measured load. The placement is computed from one sample (the "window") and evaluated both on
that sample and on a second, independent sample of the same distribution (the next window: what a
placement computed from past load sees in the future).

    python benchmarks/eplb_balance.py --out benchmarks/results/2026-12-01-cpu-eplb-balance.txt
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from common import add_commit_arg, recorded_commit, refuse_existing_out

# (name, experts, top-k, GPUs, nodes, groups, redundant slots, policy)
SETUPS = [
    ("V4-Flash decode EP8", 256, 6, 8, 1, 1, 32, "global"),
    ("V4-Flash decode EP64", 256, 6, 64, 8, 8, 64, "global"),
    ("V4-Flash prefill EP16, 2 nodes", 256, 6, 16, 2, 8, 32, "hierarchical"),
    ("V4.1-Flash decode EP8", 384, 6, 8, 1, 1, 32, "global"),
    ("V4.1-Flash decode EP64", 384, 6, 64, 8, 8, 64, "global"),
    ("V4.1-Flash prefill EP16, 2 nodes", 384, 6, 16, 2, 16, 32, "hierarchical"),
]


def sampled_load(layers: int, experts: int, k: int, tokens: int, s: float, order: torch.Tensor,
                 gen: torch.Generator) -> torch.Tensor:
    """[layers, experts] token counts: every token draws k distinct experts from Zipf(s) over the
    layer's rank order `order` [layers, experts]."""
    out = torch.zeros(layers, experts, dtype=torch.float64)
    weights = torch.arange(1, experts + 1, dtype=torch.float64) ** -s
    for layer in range(layers):
        probs = torch.empty(experts, dtype=torch.float64)
        probs[order[layer]] = weights
        picks = torch.multinomial(probs.expand(tokens, -1), k, replacement=False, generator=gen)
        out[layer] = torch.bincount(picks.flatten(), minlength=experts).double()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--zipf", default="0.6,1.0,1.2", help="Zipf exponents s (comma-separated)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)

    from deepinfer.distributed.eplb import contiguous_placement, gpu_loads, rebalance_experts

    lines = [f"# EPLB balance, CPU, commit {recorded_commit(args)}",
             f"# command: python {shlex.join(['benchmarks/eplb_balance.py', *sys.argv[1:]])}",
             f"# {args.layers} layers, {args.tokens} tokens per window, top-k distinct experts per token drawn from "
             "Zipf(s) over a per-layer random expert order; seed " + str(args.seed),
             "# max/mean = busiest GPU's load over the mean GPU load (1.0 = perfect), mean over layers;",
             "# ratio = max GPU load with EPLB / max GPU load naive (contiguous experts, no replicas), mean "
             "and worst over layers;",
             "# 'next window' evaluates the placement on an independent second sample (load it was not built from)",
             f"{'setup':34s} {'policy':12s} {'s':>4s} {'naive max/mean':>14s} {'eplb max/mean':>13s} "
             f"{'ratio mean':>10s} {'ratio worst':>11s} {'next: eplb max/mean':>19s} {'next: ratio':>11s}"]
    gen = torch.Generator().manual_seed(args.seed)
    for name, experts, k, gpus, nodes, groups, redundant, policy in SETUPS:
        for s in (float(x) for x in args.zipf.split(",")):
            order = torch.stack([torch.randperm(experts, generator=gen) for _ in range(args.layers)])
            now = sampled_load(args.layers, experts, k, args.tokens, s, order, gen)
            nxt = sampled_load(args.layers, experts, k, args.tokens, s, order, gen)
            naive = contiguous_placement(args.layers, experts, gpus)
            placed = rebalance_experts(now, experts + redundant, gpus, nodes, groups, policy)
            cols = []
            for load in (now, nxt):
                mean = load.sum(1) / gpus
                before = gpu_loads(load, naive).max(1).values
                after = gpu_loads(load, placed).max(1).values
                cols.append(((before / mean).mean(), (after / mean).mean(), (after / before).mean(),
                             (after / before).max()))
            (nb, na, rm, rw), (_, xa, xr, _) = cols
            lines.append(f"{name:34s} {policy:12s} {s:4.1f} {nb:14.3f} {na:13.3f} {rm:10.3f} {rw:11.3f} "
                         f"{xa:19.3f} {xr:11.3f}")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
