"""Speculative decoding, end to end: speculation off against fixed-length DSpark drafts (k tokens), prompt
lookup (ngram) and an acceptance oracle, on the same model and prompts, at several concurrencies, in one run.

Rows. `off` (no speculation; the reference every other row is compared with), `dspark` (the checkpoint's
own DSpark draft stages, speculative_config {"method": "dspark", "num_speculative_tokens": k}; the `demo`
model's stages are trained, on Python source, not on this benchmark's noise prompts; `demo-random`'s drafts
are nearly always rejected, so its row shows what drafting and verifying cost), `oracle` (below) and `ngram` (prompt lookup, {"method": "ngram",
"num_speculative_tokens": k, "prompt_lookup_max": 4}). Each row is one (method, k, r, concurrency).

The oracle is a benchmark device, not a proposer: drafts of a controlled acceptance rate r, to show where
fixed-length speculation stops paying. It runs inside the dspark LLM: DSparkDrafter.propose runs as usual
(its cost stays in the timing) and then its first k tokens are replaced on the device. Speculation off runs
first; from its greedy outputs at the same concurrency a truth table maps (anchor position, anchor token) to
the k tokens that follow it. Draft position j of the anchor (q, t) is the true token when
u(seed, q, t, j) < r and a wrong one (a different token, also from the hash) otherwise, u a blake2b hash in
[0, 1): deterministic per (position, token, j), the same in every rep. A draft is accepted up to its first
wrong token, so position j is accepted with probability r^(j+1) and the expected mean acceptance length is
1 + sum_{j=1..k} r^j (recorded per row beside the measured one; drafts cut short near max_tokens lower
it). The oracle's confidences are set to r (a calibrated drafter). Anchors missing from the table (the
warm-up's prompts) keep the real drafter's tokens. Two prompts that reach the same (position, token) with
different continuations are a `truth_conflicts`: the first one's continuation is used (rows then accept a
little less than r^(j+1), never incorrectly). Settling: without batch invariance a verify step's logits may
differ from a decode step's in the last bits, so a near-tie can flip and the speculative run leave off's
continuation, after which off's table has no entries; before each oracle row's timed runs, up to SETTLE_RUNS
untimed runs rebuild the table from their own outputs first (`truth_settle_runs`), so r holds against the
continuation the row actually emits (`equal_to_off` still compares with off).

Workload: concurrency C = C requests submitted in one LLM.generate (max_num_seqs = the largest C, so all C
run together), each prompt exactly --input-len tokens (noise, then a short motif repeated: prompt lookup
finds something to draft; or, with --prompt-tokens, slices of a token file such as the demo's held-out Python
source, where its trained draft stages are accepted at times), each generating exactly --output-len tokens (greedy, ignore_eos). Per
(configuration, C): one warm-up generate on other prompts of the same shape, then --reps timed generates
per row, the median reported. Columns:

* output tokens/s = the tokens in the completions (only tokens emitted, never 1 + draft length per step)
  / the wall time of LLM.generate (device synchronised before and after);
* per-request tokens/s = the mean over requests of (that request's completion tokens / the same generate
  wall time): what one user sees, over the whole batch's time (all requests start together and have the
  same length, so it is output tokens/s / C);
* mean acceptance length (1 + accepted / drafts, counting the target's own token), accepted per position
  (counts) and acceptance per position (accepted at position j / number of drafts): deltas of
  LLM.get_metrics() over the row's timed generates;
* equal_to_off: every timed generate's greedy token ids equal speculation off's at the same C (off's own
  row: its reps equal each other). Exact equality across batch shapes needs batch-invariant numerics on
  the GPU (--batch-invariant); the run exits 1 when any row differs (after writing the JSON).

Each configuration (off, dspark k, ngram k) runs in its own process, so each LLM sizes its cache from the
memory the others do not hold. The JSON records the device, commit, model, dtype and every setting.

    python benchmarks/spec_decode.py --model demo --ks 5 --oracle-rates 0,0.5,0.8,0.95   # the H200 run
    python benchmarks/spec_decode.py --smoke      # tiny41 on the CPU, writes into a temporary directory
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out

METHODS = ("dspark", "oracle", "ngram")
HELDOUT = "demo-heldout"  # --prompt-tokens: the held-out stdlib source in the checkpoint's tokenizer
ROOT = Path(__file__).resolve().parents[1]  # the repository: training/ is not installed
PROMPT_LOOKUP_MAX = 4
ORACLE_SEED = 1234
SETTLE_RUNS = 4  # untimed runs that make the oracle's truth the speculative run's own (settle)


# ---- workload ----

def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of exactly `length` tokens in [3, vocab): BOS 0, random noise for the first half, then a
    motif of 3-8 tokens repeated to the end."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        noise = torch.randint(3, vocab, (max(length // 2 - 1, 0),), generator=g).tolist()
        motif = torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        body = noise + motif * (length // len(motif) + 1)
        out.append(([0] + body)[:length])
    return out


def file_prompts(path: str, n: int, length: int, offset: int) -> list[list[int]]:
    """n prompts of `length` tokens cut one after another from a flat little-endian uint16 token file (the
    demo's held-out set: training/ writes runs/data/heldout.bin), the first starting `offset` prompts in."""
    import numpy as np

    tokens = np.fromfile(path, dtype="<u2")
    return _slices(tokens, n, length, offset, path)


def heldout_prompts(model_path: str, n: int, length: int, offset: int) -> list[list[int]]:
    """As file_prompts, from this machine's held-out stdlib files encoded by the checkpoint's own tokenizer.json
    (training.tokenizer.heldout_tokens: the demo's training split)."""
    return _slices(_heldout_tokens(model_path), n, length, offset, "demo-heldout")


@functools.lru_cache(maxsize=None)
def _heldout_tokens(model_path: str):
    """Encoded once a process (the timed and the warm-up prompts are cut from the same tokens)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from training.tokenizer import heldout_tokens

    return heldout_tokens(Path(model_path) / "tokenizer.json")


def _slices(tokens, n: int, length: int, offset: int, name: str) -> list[list[int]]:
    import numpy as np

    need = (offset + n) * length
    if tokens.size < need:
        raise ValueError(f"--prompt-tokens: {name} has {tokens.size} tokens, {need} needed")
    return tokens[offset * length:need].astype(np.int64).reshape(n, length).tolist()


def _prompts_doc(args) -> str:
    """What the JSON records about the prompts."""
    if args.prompt_tokens == HELDOUT:
        return (f"consecutive {args.input_len}-token slices of the held-out stdlib files (training.tokenizer's split, "
                f"Python {sys.version.split()[0]}) encoded by the checkpoint's tokenizer.json: the first max_num_seqs "
                "timed, the next warm up")
    if args.prompt_tokens:
        return (f"consecutive {args.input_len}-token slices of {args.prompt_tokens} (sha256 "
                f"{_sha256(args.prompt_tokens)}): the first max_num_seqs timed, the next warm up")
    return "noise then a repeated motif (make_prompts), seed 1; warm-up prompts seed 2"


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- the oracle ----

def _unit_hash(seed: int, pos: int, tok: int, j: int) -> tuple[float, int]:
    """(u in [0, 1), a second 32-bit draw) from blake2b of (seed, position, token, draft position)."""
    d = hashlib.blake2b(f"{seed}:{pos}:{tok}:{j}".encode(), digest_size=12).digest()
    return int.from_bytes(d[:8], "little") / 2.0 ** 64, int.from_bytes(d[8:], "little")


def expected_acceptance_length(r: float, k: int) -> float:
    """1 + sum_{j=1..k} r^j: position j (1-based) is accepted when the j drafts up to it are all true."""
    return 1 + sum(r ** j for j in range(1, k + 1))


class TruthTable:
    """(anchor position, anchor token) -> the k true tokens after it, from speculation off's outputs;
    per entry and draft position a hash u in [0, 1) and a wrong token (!= the true one)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], k: int, vocab: int,
                 seed: int = ORACLE_SEED):
        cont: dict[int, list[int]] = {}
        self.conflicts = 0
        for p, o in zip(prompts, outputs):
            seq = p + o
            for q in range(len(p), len(seq)):  # anchors are emitted tokens
                key = q * vocab + seq[q]
                nxt = (seq[q + 1:q + 1 + k] + [-1] * k)[:k]  # -1: past the end (never verified)
                if key in cont:
                    self.conflicts += cont[key] != nxt
                    continue
                cont[key] = nxt
        keys = sorted(cont)
        self.k, self.vocab = k, vocab
        self.keys = torch.tensor(keys, dtype=torch.long)
        self.true = torch.tensor([cont[key] for key in keys], dtype=torch.long).reshape(len(keys), k)
        u, wrong = torch.empty(len(keys), k, dtype=torch.float64), torch.empty(len(keys), k, dtype=torch.long)
        for i, key in enumerate(keys):
            q, t = divmod(key, vocab)
            for j in range(k):
                u[i, j], h = _unit_hash(seed, q, t, j)
                true = self.true[i, j].item()
                wrong[i, j] = h % vocab if true < 0 else (true + 1 + h % (vocab - 1)) % vocab
        self.u, self.wrong = u, wrong

    def __len__(self) -> int:
        return len(self.keys)

    def drafts(self, r: float) -> torch.Tensor:
        """[entries, k]: the true token where u < r, else the wrong one."""
        return torch.where((self.u < r) & (self.true >= 0), self.true, self.wrong)


class Oracle:
    """Replaces the first k tokens of DSparkDrafter.propose's blocks, on the device, by a TruthTable's drafts
    at rate r (anchors not in the table keep the drafter's tokens); `rate` None: the real drafter."""

    def __init__(self):
        self.table: TruthTable | None = None
        self.rate: float | None = None
        self._dev: tuple | None = None

    def set(self, table: TruthTable | None, rate: float | None) -> None:
        self.table, self.rate, self._dev = table, rate, None

    def apply(self, block, anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor):
        if self.table is None or self.rate is None or not len(self.table) or not anchor_tokens.numel():
            return block
        dev = anchor_tokens.device
        if self._dev is None:
            self._dev = (self.table.keys.to(dev), self.table.drafts(self.rate).to(dev))
        keys, drafts = self._dev
        k = self.table.k
        q = anchor_pos.long() * self.table.vocab + anchor_tokens.long()
        idx = torch.searchsorted(keys, q).clamp(max=len(keys) - 1)
        found = (keys[idx] == q)[:, None]
        block.tokens[:, :k] = torch.where(found, drafts[idx].to(block.tokens.dtype), block.tokens[:, :k])
        conf = torch.full_like(block.confidence[:, :k], self.rate)
        block.confidence[:, :k] = torch.where(found, conf, block.confidence[:, :k])
        return block


ORACLE = Oracle()


def install_oracle() -> None:
    """Wraps DSparkDrafter.propose (this process only): the real draft (a CUDA graph's replay where the engine
    captures them), then ORACLE's replacement, eagerly on its output."""
    from deepinfer.worker.drafter import DSparkDrafter

    real = DSparkDrafter.propose

    def propose(self, anchors):
        block = real(self, anchors)
        return block if block is None else ORACLE.apply(block, anchors.tokens, anchors.pos)

    DSparkDrafter.propose = propose


# ---- one configuration (a child process) ----

def _metrics_delta(after: dict, before: dict) -> dict:
    n = max(len(after["accepted_per_position"]), len(before["accepted_per_position"]))
    pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
    per_pos = [a - b for a, b in zip(pad(after["accepted_per_position"]), pad(before["accepted_per_position"]))]
    d = {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                   "num_preemptions")}
    d["accepted_per_position"] = per_pos
    d["acceptance_per_position"] = [round(a / d["num_drafts"], 4) if d["num_drafts"] else None for a in per_pos]
    d["mean_acceptance_length"] = round(1 + d["num_accepted_tokens"] / d["num_drafts"], 4) if d["num_drafts"] \
        else None
    return d


def speculative_config(method: str, k: int) -> dict | None:
    if method == "off":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": PROMPT_LOOKUP_MAX}
    return {"method": "dspark", "num_speculative_tokens": k}


def llm_kwargs(plan: dict) -> dict:
    kw = dict(device=plan["device"], dtype=plan["dtype"], kv_cache_dtype=plan["kv_cache_dtype"],
              max_num_seqs=max(plan["concurrency"]), max_model_len=plan["input_len"] + plan["output_len"],
              max_num_batched_tokens=plan["max_num_batched_tokens"], skip_tokenizer_init=True,
              enforce_eager=plan["enforce_eager"], batch_invariant=plan["batch_invariant"])
    if plan["kv_cache_memory"]:
        kw["kv_cache_memory"] = plan["kv_cache_memory"]
    return kw


def runner_steps(llm) -> dict[str, int]:
    """The runner's counts so far: verify steps scheduled ahead, speculative steps the graphs could not take."""
    runner = llm.engine.core.runner
    return {"verify_ahead_steps": getattr(runner, "ahead_steps", 0),
            "eager_speculative_steps": sum(getattr(runner, "eager_steps", {}).values())}


def policy_lengths(llm) -> dict[int, int]:
    """How often the graphs' verify-length policy chose each length so far (-1: before any confidence)."""
    return dict(getattr(llm.scheduler, "policy_lengths", {}))


def step_times_ms(llm) -> dict | None:
    """The varlen policy's start-up step times (ms) by batch bucket x verify length, or None."""
    times = getattr(getattr(llm.scheduler, "varlen", None), "times", None)
    if times is None:
        return None
    return {"buckets": times.buckets.tolist(),
            "ms": [[round(float(x) * 1e3, 4) if np.isfinite(x) else None for x in row] for row in times.seconds]}


def graphs_captured(llm) -> int:
    """CUDA graphs the LLM's runner holds so far: its decode / verify graphs and its drafter's."""
    runner = llm.engine.core.runner
    drafter = getattr(runner.drafter, "graphs", None)
    return (len(runner.graphs.graphs) if runner.graphs is not None else 0) + \
        (len(drafter.graphs) if drafter is not None else 0)


def run_config(plan: dict, method: str, k: int, varlen: bool = False) -> dict:
    """Rows of one LLM: speculation `method` with k drafts ("dspark" also runs the oracle rows; `varlen`:
    confidence-scheduled verification instead of fixed length), every concurrency; off also returns its
    outputs (the reference)."""
    import inspect

    from deepinfer import LLM, SamplingParams

    # speculation only where this script asks for it (a checkpoint with draft stages may speculate by default)
    os.environ["DEEPINFER_USE_NEXTN_DECODE"] = "0"
    os.environ.pop("DEEPINFER_ENABLE_MTP_VARLEN", None)
    if method == "dspark" and plan["oracle_rates"]:
        install_oracle()
    kw = llm_kwargs(plan)
    if varlen:
        if "enable_mtp_varlen" not in inspect.signature(LLM).parameters:
            raise RuntimeError("--varlen: this engine's LLM has no enable_mtp_varlen (confidence-scheduled "
                               "verification, issue 17 item 3)")
        kw["enable_mtp_varlen"] = True
    llm = LLM(plan["model_path"], speculative_config=speculative_config(method, k), **kw)
    if varlen and not getattr(llm.config, "enable_mtp_varlen", False):
        raise RuntimeError("--varlen: the engine turned enable_mtp_varlen off (batch_invariant forces fixed length)")
    engine = {"varlen": varlen, "async_scheduling": llm.engine.core.async_scheduling,
              "cuda_graphs": llm.engine.core.runner.graphs is not None, "batch_invariant": bool(llm.config.batch_invariant),
              "step_times_ms": step_times_ms(llm)}
    params = SamplingParams(temperature=0, max_tokens=plan["output_len"], ignore_eos=True)
    vocab, most = plan["vocab"], max(plan["concurrency"])
    if plan["prompt_tokens"]:  # the file's first `most` prompts are timed, the next `most` warm up
        cut = functools.partial(heldout_prompts, plan["model_path"]) if plan["prompt_tokens"] == HELDOUT \
            else functools.partial(file_prompts, plan["prompt_tokens"])
        pool, warm_pool = cut(most, plan["input_len"], 0), cut(most, plan["input_len"], most)
    else:
        pool = make_prompts(most, plan["input_len"], vocab, seed=1)
        warm_pool = make_prompts(most, plan["input_len"], vocab, seed=2)
    rows, reference = [], {}
    for c in plan["concurrency"]:
        prompts = pool[:c]
        want = plan["off_outputs"].get(str(c)) if method != "off" else None
        variants: list[tuple[str, float | None]] = [(method, None)]
        table = None
        if method == "dspark":
            variants = ([("dspark", None)] if plan["run_dspark"] else []) + [("oracle", r) for r in plan["oracle_rates"]]
            if plan["oracle_rates"]:
                table = TruthTable(prompts, want, k, vocab)
        ORACLE.set(None, None)
        llm.generate(warm_pool[:c], params, use_tqdm=False)  # warm-up: other prompts, the same shape
        for name, rate in variants:
            truth, settle_runs = table, 0
            if table is not None and rate is not None:
                truth, settle_runs = settle(llm, prompts, params, want, truth, rate, k, vocab)
            ORACLE.set(truth, rate)
            before, graphs_before, steps_before = llm.get_metrics(), graphs_captured(llm), runner_steps(llm)
            lengths_before = policy_lengths(llm)
            runs, outs_each = [], []
            for _ in range(plan["reps"]):
                _sync(plan["device"])
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                _sync(plan["device"])
                runs.append(time.perf_counter() - t0)
                outs_each.append([o.outputs[0].token_ids for o in outs])
            delta = _metrics_delta(llm.get_metrics(), before)
            row = make_row(name, k, rate, c, runs, outs_each, want if want is not None else outs_each[0],
                           plan["output_len"], delta)
            if table is not None and rate is not None:
                row.update(truth_entries=len(truth), truth_conflicts=truth.conflicts, truth_settle_runs=settle_runs,
                           expected_mean_acceptance_length=round(expected_acceptance_length(rate, k), 4))
            if method == "off" and delta["num_drafts"]:
                raise RuntimeError(f"speculation off drafted {delta['num_drafts']} times: the LLM speculated "
                                   "without a speculative_config")
            # graphs captured inside the timed generates (a capture costs many steps: none is expected)
            row["graphs_captured"] = graphs_captured(llm) - graphs_before
            # verify steps scheduled ahead of the step before's read-back, and speculative steps left eager
            row.update({key: after - steps_before[key] for key, after in runner_steps(llm).items()})
            if varlen:  # the lengths the policy chose in the timed generates
                now = policy_lengths(llm)
                row["policy_lengths"] = {str(n): now[n] - lengths_before.get(n, 0) for n in sorted(now)
                                         if now[n] != lengths_before.get(n, 0)}
            rows.append({**row, **engine})
            print(f"  {fmt_row(row)}", file=sys.stderr, flush=True)
        if method == "off":
            reference[str(c)] = outs_each[0]
    ORACLE.set(None, None)
    return {"rows": rows, "off_outputs": reference}


def settle(llm, prompts: list[list[int]], params, want: list[list[int]], table: TruthTable, rate: float, k: int,
           vocab: int) -> tuple[TruthTable, int]:
    """The oracle's truth made the speculative run's own: a verify step's logits may differ from a decode step's in
    the last bits (bf16, other row counts), so a near-tie can flip and the run leave off's continuation, where
    off's table has no entry and acceptance collapses. Untimed runs at `rate` each rebuild the table from their
    own outputs first (then off's), until a run repeats the one before (at most SETTLE_RUNS). -> (table, runs)."""
    last = None
    for run in range(1, SETTLE_RUNS + 1):
        ORACLE.set(table, rate)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if outs == last:
            return table, run
        table, last = TruthTable(prompts + prompts, outs + want, k, vocab), outs
    return table, SETTLE_RUNS


def make_row(method: str, k: int, rate: float | None, c: int, runs: list[float], outs_each: list, want: list,
             output_len: int, delta: dict) -> dict:
    wrong = [(i, len(t)) for i, t in enumerate(outs_each[0]) if len(t) != output_len]
    if wrong:
        raise RuntimeError(f"{method} k={k} C={c}: {len(wrong)} completions did not emit exactly {output_len} "
                           f"tokens, first (request, tokens) {wrong[0]}")
    mismatched = sorted({i for outs in outs_each for i, (a, b) in enumerate(zip(outs, want)) if a != b})
    # the earliest completion token where any rep differs from the reference (None: equal)
    first = min((next(j for j, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)
                 for outs in outs_each for a, b in zip(outs, want) if a != b), default=None)
    seconds = statistics.median(runs)
    tokens = sum(len(t) for t in outs_each[0])
    return {"method": method, "k": k if method != "off" else 0, "acceptance_rate": rate, "concurrency": c,
            "requests": c, "output_tokens": tokens, "seconds": round(seconds, 4),
            "runs_s": [round(t, 4) for t in runs], "output_tokens_per_s": round(tokens / seconds, 2),
            "per_request_tokens_per_s": round(statistics.mean(len(t) / seconds for t in outs_each[0]), 3),
            **delta, "equal_to_off": not mismatched, "mismatched_requests": len(mismatched),
            "first_mismatch_token": first}


def fmt_row(r: dict) -> str:
    label = r["method"] + ("/varlen" if r.get("varlen") else "")
    if "error" in r:
        return f"{label:<14}{r.get('k', ''):>3}  error: {r['error']}"
    rate = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:g}"
    mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.3f}"
    per_pos = ",".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"
    speed = f"{r['speedup_vs_off']:.3f}" if r.get("speedup_vs_off") is not None else "-"
    return (f"{label:<14}{r['k']:>3}{rate:>6}{r['concurrency']:>6}{r['output_tokens_per_s']:>12.1f}"
            f"{r['per_request_tokens_per_s']:>10.2f}{speed:>9}{mal:>8}  {str(r['equal_to_off']):<6} {per_pos}")


HEADER = (f"{'method':<14}{'k':>3}{'r':>6}{'conc':>6}{'out tok/s':>12}{'req tok/s':>10}{'vs off':>9}{'acc len':>8}"
          f"  {'equal':<6} acceptance per position")


# ---- the run ----

def run_child(plan: dict, method: str, k: int, varlen: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, out_path = Path(tmp) / "plan.json", Path(tmp) / "rows.json"
        plan_path.write_text(json.dumps(plan))
        print(f"{method} k={k}{' varlen' if varlen else ''}:", file=sys.stderr, flush=True)
        res = subprocess.run([sys.executable, __file__, "--child", method, "--child-k", str(k),
                              "--child-plan", str(plan_path), "--child-out", str(out_path)]
                             + (["--child-varlen"] if varlen else []))
        text = out_path.read_text() if out_path.is_file() else ""
    if res.returncode != 0 or not text:
        return {"rows": [{"method": method, "k": k, "varlen": varlen,
                          "error": f"process exited with {res.returncode} (traceback above)"}], "off_outputs": {}}
    return json.loads(text)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=("off", "dspark", "ngram"), help=argparse.SUPPRESS)
    ap.add_argument("--child-k", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-plan", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-varlen", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="demo",
                    help="checkpoint directory, 'demo' (the trained V4.1 demo) or 'demo-random'; default demo")
    ap.add_argument("--preset", default=None,
                    help="instead of --model: a random checkpoint of this make_checkpoint preset (e.g. tiny41)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="cache bytes (default: the LLM's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="batch-invariant numerics (greedy outputs independent of batch shape)")
    ap.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64, 128], help="comma list (default 1,4,16,64,128)")
    ap.add_argument("--ks", type=_ints, default=[5], help="DSpark draft lengths k, comma list in 1..5 (default 5)")
    ap.add_argument("--oracle-rates", type=_floats, default=[0.0, 0.5, 0.8, 0.95],
                    help="oracle acceptance rates r per draft position, comma list (default 0,0.5,0.8,0.95)")
    ap.add_argument("--ngram-k", type=int, default=5, help="prompt-lookup draft length (default 5)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma list of {', '.join(METHODS)} (speculation off always runs); default all")
    ap.add_argument("--varlen", action="store_true",
                    help="also run the dspark and oracle rows with enable_mtp_varlen (confidence-scheduled "
                         "verification of up to k drafts) beside fixed length")
    ap.add_argument("--prompt-tokens", default=None,
                    help="prompts cut from this flat uint16 token file (e.g. the demo's held-out Python source, "
                         f"runs/data/heldout.bin), or '{HELDOUT}' (that source encoded here by the checkpoint's "
                         "tokenizer.json), instead of noise and a motif")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny41 on the CPU (float32), concurrency 1,2, 16 in / 8 out, k 2, r 0,0.5,1, one rep")
    ap.add_argument("--out", default=None, help="JSON results path (default: <out-dir>/<generated name>)")
    ap.add_argument("--out-dir", default=None,
                    help="directory of the generated name <date>-<device>-<commit>-spec-decode[-smoke].json "
                         "(default benchmarks/results, or a temporary directory with --smoke)")
    add_commit_arg(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.device, args.dtype, args.kv_cache_dtype = "tiny41", "cpu", "float32", "float32"
        args.kv_cache_memory = args.kv_cache_memory or 64 << 20
        args.concurrency, args.ks, args.oracle_rates, args.ngram_k = [1, 2], [2], [0.0, 0.5, 1.0], 2
        args.input_len, args.output_len, args.reps = 16, 8, 1
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: {bad} not in {list(METHODS)}")
    args.methods = methods
    if not all(1 <= k <= 5 for k in args.ks):
        ap.error(f"--ks: {args.ks} must be in 1..5 (the DSpark block)")
    if not all(0.0 <= r <= 1.0 for r in args.oracle_rates):
        ap.error(f"--oracle-rates: {args.oracle_rates} must be in [0, 1]")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error(f"--concurrency: {args.concurrency} must be positive integers")
    return args


def resolve_model(args, tmp: Path) -> tuple[str, str]:
    """(checkpoint path, what the JSON records as the model)."""
    if args.preset:
        from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

        return str(write_checkpoint(tmp / args.preset, PRESETS[args.preset], seed=5, dtype="fp8")), \
            f"preset {args.preset} (random weights, seed 5, fp8 layout)"
    from deepinfer.tools.demo import resolve_demo

    path = resolve_demo(args.model)
    if path is None:
        return args.model, args.model
    weights = "random weights" if args.model == "demo-random" else "trained weights"
    return path, f"{args.model} (deepinfer.tools.demo: V4.1 demo41 widths, {weights})"


def main() -> None:
    args = parse_args()
    refuse_existing_out(args)
    if args.child:
        plan = json.loads(Path(args.child_plan).read_text())
        Path(args.child_out).write_text(json.dumps(run_config(plan, args.child, args.child_k, args.child_varlen)))
        return
    from deepinfer.loader.model_config import read_model_config

    with tempfile.TemporaryDirectory() as tmp:
        path, model_name = resolve_model(args, Path(tmp))
        plan = {"model_path": path, "vocab": read_model_config(path).vocab_size, "device": args.device,
                "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "kv_cache_memory": args.kv_cache_memory,
                "max_num_batched_tokens": args.max_num_batched_tokens, "enforce_eager": args.enforce_eager,
                "batch_invariant": args.batch_invariant, "concurrency": args.concurrency,
                "input_len": args.input_len, "output_len": args.output_len, "reps": args.reps,
                "oracle_rates": args.oracle_rates if "oracle" in args.methods else [],
                "prompt_tokens": args.prompt_tokens,
                "run_dspark": "dspark" in args.methods, "off_outputs": {}}
        off = run_child(plan, "off", 0)
        rows = off["rows"]
        plan["off_outputs"] = off["off_outputs"]
        if plan["off_outputs"]:
            if plan["run_dspark"] or plan["oracle_rates"]:
                for k in args.ks:
                    for varlen in (False, True) if args.varlen else (False,):
                        rows += run_child(plan, "dspark", k, varlen)["rows"]
            if "ngram" in args.methods and args.ngram_k:
                rows += run_child(plan, "ngram", args.ngram_k)["rows"]
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["method"] == "off" and "error" not in r}
    for r in rows:
        if "error" not in r:
            r["speedup_vs_off"] = round(r["output_tokens_per_s"] / base[r["concurrency"]], 4)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    commit = recorded_commit(args)
    result = {
        "device": device, "date": str(date.today()), "commit": commit, "model": model_name,
        "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "smoke": args.smoke,
        "settings": {"concurrency": args.concurrency, "ks": args.ks, "oracle_rates": args.oracle_rates,
                     "ngram_k": args.ngram_k, "varlen": args.varlen, "prompt_lookup_max": PROMPT_LOOKUP_MAX, "methods": args.methods,
                     "input_len": args.input_len, "output_len": args.output_len, "reps": args.reps,
                     "sampling": "greedy, ignore_eos", "max_num_seqs": max(args.concurrency),
                     "max_model_len": args.input_len + args.output_len,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_memory": args.kv_cache_memory,
                     "enforce_eager": args.enforce_eager, "batch_invariant": args.batch_invariant,
                     "oracle_seed": ORACLE_SEED,
                     "prompts": _prompts_doc(args)},
        "columns": {"output_tokens_per_s": "completion tokens / LLM.generate wall time (median of reps)",
                    "per_request_tokens_per_s": "mean over requests of own completion tokens / the same wall time",
                    "acceptance_per_position": "accepted at draft position j / num_drafts (get_metrics deltas)",
                    "mean_acceptance_length": "1 + num_accepted_tokens / num_drafts",
                    "equal_to_off": "greedy token ids of every timed rep == speculation off's at this concurrency",
                    "graphs_captured": "CUDA graphs (decode / verify and draft) captured during the row's timed "
                                       "generates",
                    "oracle": "benchmark device, not a proposer: DSpark drafts replaced by off's continuation "
                              "with probability r per position"},
        "rows": rows,
    }
    name = f"{date.today()}-{device.replace(' ', '-')}-{commit}-spec-decode{'-smoke' if args.smoke else ''}.json"
    if args.out:
        out = Path(args.out)
    else:
        out_dir = args.out_dir or (tempfile.mkdtemp(prefix="spec-decode-smoke-") if args.smoke
                                   else Path(__file__).parent / "results")
        out = new_results_path(Path(out_dir) / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{device}, {model_name}, {args.dtype}, {args.input_len} in / {args.output_len} out, commit {commit}")
    print(HEADER)
    for r in rows:
        print(fmt_row(r))
    failed = [r for r in rows if "error" in r or not r["equal_to_off"]]
    if failed:
        print(f"{len(failed)} rows failed or differ from speculation off", file=sys.stderr)
    print(f"wrote {out}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
