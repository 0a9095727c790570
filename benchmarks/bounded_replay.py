"""SWA bounded replay (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact) vs the exact prefill.

On a random DeepSeek-V4.1 checkpoint: prefill FLOPs counted by torch's FlopCounterMode in both
modes, then the deviation over a greedy continuation: KL(exact || compact) of the next-token
distributions (compact teacher-forced on the exact tokens) and the greedy agreement of two
free-running generations.

    python benchmarks/bounded_replay.py --preset demo41 --prompt-len 2048 --steps 300
"""
from __future__ import annotations

import argparse
import json
import tempfile
from datetime import date
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out

from deepinfer.state.forward_batch import SeqChunk, build_forward_batch
from deepinfer.loader.model_loader import load_model
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.tools.static_cache import static_v4_cache


class Session:
    """One request decoded step by step; `keep` = bounded-replay rows (None = exact)."""

    def __init__(self, model, prompt: list[int], max_len: int, kv: str, keep: int | None):
        self.model, self.seq, self.keep = model, list(prompt), keep
        self.cache = static_v4_cache(model.config, 1, max_len, kv, "cpu")
        self.done = 0

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """Compute every token not yet in the cache; next-token logits [V]."""
        c, n = self.cache, len(self.seq)
        replay_from = 0 if self.keep is None else max(0, n - self.keep)
        chunk = SeqChunk(0, self.done, self.seq[self.done:], c.static_tables(0), self.seq[max(0, self.done - 7):self.done],
                         replay_from)
        b = build_forward_batch([chunk], self.model.config.sliding_window, c.compress_kinds, c.block_size, "cpu",
                                self.model.token_history)
        hidden = self.model(b, c.layers)
        self.done = n
        return self.model.compute_logits(hidden[b.logits_idx])[0]


def prefill_flops(model, prompt, max_len, kv, keep) -> int:
    with FlopCounterMode(display=False) as fc:
        Session(model, prompt, max_len, kv, keep).step()
    return fc.get_total_flops()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo41")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--keep", type=int, default=140)
    ap.add_argument("--kv-cache-dtype", default="float32")
    ap.add_argument("--out", default=None)
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", PRESETS[args.preset], seed=0, dtype="fp8")
        model = load_model(str(ckpt), dtype=torch.float32)[0]
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    prompt = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (args.prompt_len - 1,), generator=g).tolist()
    max_len = args.prompt_len + args.steps + 1
    f_exact = prefill_flops(model, prompt, max_len, args.kv_cache_dtype, None)
    f_compact = prefill_flops(model, prompt, max_len, args.kv_cache_dtype, args.keep)

    exact = Session(model, prompt, max_len, args.kv_cache_dtype, None)
    forced = Session(model, prompt, max_len, args.kv_cache_dtype, args.keep)
    free = Session(model, prompt, max_len, args.kv_cache_dtype, args.keep)
    kls, agree = [], 0
    for _ in range(args.steps):
        le, lf, lc = exact.step(), forced.step(), free.step()
        pe = le.log_softmax(-1)
        kls.append(float((pe.exp() * (pe - lf.log_softmax(-1))).sum()))
        tok, tok_free = int(le.argmax()), int(lc.argmax())
        agree += tok == int(lf.argmax())
        exact.seq.append(tok)
        forced.seq.append(tok)
        free.seq.append(tok_free)
    n_gen = len(exact.seq) - len(prompt)
    free_match = sum(a == b for a, b in zip(exact.seq[len(prompt):], free.seq[len(prompt):]))
    result = {
        "date": str(date.today()), "commit": recorded_commit(args), "preset": args.preset,
        "prompt_len": args.prompt_len, "steps": args.steps,
        "keep": args.keep, "kv_cache_dtype": args.kv_cache_dtype, "replay_layer": model.replay_layer,
        "num_layers": cfg.num_hidden_layers,
        "prefill_flops_exact": f_exact, "prefill_flops_compact": f_compact,
        "prefill_flops_saved": round(1 - f_compact / f_exact, 4),
        "kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
        "greedy_agreement_teacher_forced": round(agree / args.steps, 4),
        "greedy_agreement_free_running": round(free_match / n_gen, 4),
        "command": f"python benchmarks/bounded_replay.py --preset {args.preset} --prompt-len {args.prompt_len} "
                   f"--steps {args.steps} --keep {args.keep} --kv-cache-dtype {args.kv_cache_dtype}",
    }
    out = new_results_path(args.out or Path(__file__).parent / "results" /
                           f"{date.today()}-cpu-bounded-replay-{args.preset}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
